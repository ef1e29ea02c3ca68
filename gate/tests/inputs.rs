//! The gate's JSON inputs as an adversary hands them over (issue 33 items 8, 12, 13): a repeated
//! key, a FIFO, `/dev/zero`, a directory, an oversized file, a prompt entry with a field the
//! gate does not read. Each is refused with the file and what is wrong; the shipped file each
//! attack starts from loads (the negative control).

use std::path::{Path, PathBuf};

use tracegate_gate::baselines::BaselineFile;
use tracegate_gate::milestones::MilestoneFile;
use tracegate_gate::prompts;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn shipped(name: &str) -> String {
    std::fs::read_to_string(root().join(name)).unwrap()
}

/// `text` with its first `from` replaced by `to` (the attack must change the file).
fn edit(text: &str, from: &str, to: &str) -> String {
    assert!(text.contains(from), "{from:?} not in the shipped file");
    text.replacen(from, to, 1)
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn fifo(dir: &Path, name: &str) -> PathBuf {
    let p = dir.join(name);
    let made = std::process::Command::new("mkfifo").arg(&p).status();
    assert!(made.unwrap().success());
    p
}

#[test]
fn a_second_policy_key_in_a_milestone_is_refused_not_obeyed() {
    // On main the second key won: the gate judged m0 under the lax policy it named.
    let dir = tempfile::tempdir().unwrap();
    let text = shipped("milestones.json");
    let ok = write(dir.path(), "milestones.json", &text);
    assert_eq!(MilestoneFile::load(&ok).unwrap().milestones[0].id, "m0");
    let policy = r#""policy": "fixtures/policy/oracle-default.json","#;
    let lax = format!(r#"{policy} "policy": "./lax.json","#);
    let p = write(dir.path(), "milestones.json", &edit(&text, policy, &lax));
    let e = MilestoneFile::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("milestones.json") && e.contains(r#"duplicate key "policy" in milestones[0]"#),
        "{e}"
    );
}

#[test]
fn two_counts_of_one_name_in_a_baseline_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let text = shipped("baselines.json");
    let ok = write(dir.path(), "baselines.json", &text);
    assert!(!BaselineFile::load(&ok).unwrap().baselines.is_empty());
    let counts = r#""counts": {"#;
    let p = write(
        dir.path(),
        "baselines.json",
        &edit(&text, counts, r#""counts": {"tensors": 1, "#),
    );
    let e = BaselineFile::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("baselines.json")
            && e.contains(r#"duplicate key "tensors" in baselines[0].counts"#),
        "{e}"
    );
}

#[test]
fn json_inputs_that_are_not_one_bounded_regular_file_are_refused() {
    // On main each FIFO blocked the gate forever (opened without a writer, this test would hang
    // until the harness's timeout) and /dev/zero as prompts was read until memory ran out.
    let dir = tempfile::tempdir().unwrap();
    let m = fifo(dir.path(), "milestones.json");
    let e = MilestoneFile::load(&m).unwrap_err().to_string();
    assert!(
        e.contains("milestones.json") && e.contains("a FIFO, not a regular file"),
        "{e}"
    );
    let b = fifo(dir.path(), "baselines.json");
    let e = BaselineFile::load(&b).unwrap_err().to_string();
    assert!(
        e.contains("baselines.json") && e.contains("a FIFO, not a regular file"),
        "{e}"
    );
    let p = fifo(dir.path(), "prompts.json");
    let e = prompts::load(&p).unwrap_err().to_string();
    assert!(
        e.contains("prompts.json") && e.contains("a FIFO, not a regular file"),
        "{e}"
    );
    let e = prompts::load(Path::new("/dev/zero"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/dev/zero") && e.contains("a device, not a regular file"),
        "{e}"
    );
    let e = prompts::load(dir.path()).unwrap_err().to_string();
    assert!(e.contains("a directory, not a regular file"), "{e}");
    // Sparse: the size is refused from fstat, nothing is read.
    let big = dir.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(tracegate_trace::json::MAX_JSON_LEN + 1)
        .unwrap();
    let e = prompts::load(&big).unwrap_err().to_string();
    assert!(
        e.contains("big.json") && e.contains("more than the limit"),
        "{e}"
    );
    // A model whose config.json is a FIFO: the prompt-length check reads it first.
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    fifo(&model, "config.json");
    let e = prompts::check_fits(dir.path(), "model", None, 3, 0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains("a FIFO, not a regular file"),
        "{e}"
    );
}

#[test]
fn prompt_sets_refuse_unknown_fields_and_repeated_keys() {
    let dir = tempfile::tempdir().unwrap();
    let text = shipped("fixtures/prompts/frozen.json");
    let ok = write(dir.path(), "frozen.json", &text);
    let set = prompts::load(&ok).unwrap();
    // The hash is of the bytes read: the one milestones.json records for the shipped file.
    let recorded = MilestoneFile::load(&root().join("milestones.json")).unwrap();
    assert_eq!(set.sha256, recorded.milestones[0].prompts.sha256);
    let first = r#""id": "#;
    for (attack, want) in [
        // On main the field was dropped, and `--bless` recorded the set as passed.
        (
            edit(&text, first, r#""generate": 64, "id": "#),
            "prompts[0] (id \"",
        ),
        (
            edit(&text, r#""schema""#, r#""generate": 3, "schema""#),
            r#"unknown field "generate" (a prompt set has schema, about, vocab_min, prompts)"#,
        ),
        (
            edit(&text, first, r#""tokens": [1], "id": "#),
            r#"duplicate key "tokens" in prompts[0]"#,
        ),
    ] {
        let p = write(dir.path(), "attack.json", &attack);
        let e = prompts::load(&p).unwrap_err().to_string();
        assert!(e.contains("attack.json") && e.contains(want), "{e}");
    }
    let p = write(
        dir.path(),
        "attack.json",
        &edit(&text, first, r#""generate": 64, "id": "#),
    );
    let e = prompts::load(&p).unwrap_err().to_string();
    assert!(
        e.contains(r#"unknown field "generate" (a prompt has id, tokens)"#),
        "{e}"
    );
}

#[test]
fn a_model_config_with_a_repeated_key_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    let text = shipped("fixtures/tiny-qwen3/config.json");
    std::fs::write(model.join("config.json"), &text).unwrap();
    prompts::check_fits(dir.path(), "model", None, 3, 0).unwrap();
    let attack = edit(&text, "{", r#"{"max_position_embeddings": 1000000, "#);
    std::fs::write(model.join("config.json"), attack).unwrap();
    let e = prompts::check_fits(dir.path(), "model", None, 3, 0)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("config.json") && e.contains(r#"duplicate key "max_position_embeddings""#),
        "{e}"
    );
}
