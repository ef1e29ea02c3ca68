//! `gate bisect` against candidates built as an adversary would (issue 32, items 6-8):
//! - a reused `--work` directory: a producer that exits 0 without writing is a failure naming
//!   the verb, the file and the command, never judged on the previous run's trace; a directory
//!   bisect did not make is refused and left untouched;
//! - the decode path: steps after an excused flip are NOT CHECKED (exit 4), a cache self-check
//!   whose comparison was refused or compared nothing is not `agrees`, a candidate with decode
//!   tokens but no decode numbers has its tokens compared and the first differing step named;
//! - one classification of findings: a signed zero, a NaN payload or an infinity is a value
//!   difference in bisect as in trace-diff (`tracegate_diff::compare`), never "structure differs".

use std::path::{Path, PathBuf};

use crate::common;
use common::repo;

use common::Bisected as Run;

/// `gate bisect --model fixtures/tiny-qwen3 --prompt short ARGS --work WORK` from the root, its
/// report (schema-checked) in `report_dir`.
fn bisect(work: &Path, report_dir: &Path, args: &[&str]) -> Run {
    bisect_on(("fixtures/tiny-qwen3", "short"), work, report_dir, args)
}

/// [`bisect`] of another model and prompt.
fn bisect_on((model, prompt): (&str, &str), work: &Path, report_dir: &Path, args: &[&str]) -> Run {
    let all = [&["--model", model, "--prompt", prompt], args].concat();
    common::bisect(work, &report_dir.join("report.json"), &all)
}

/// A test producer under gate/tests/producers run by the project's Python, with `words`.
fn producer(script: &str, words: &str) -> String {
    let root = repo();
    format!(
        "'{}' '{}' {words}",
        root.join(".venv/bin/python").display(),
        root.join("gate/tests/producers").join(script).display()
    )
}

fn scratch() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let work = dir.path().join("work");
    (dir, work)
}

// ------------------------------------------------------------------------------------------
// Item 6: stale outputs

#[test]
fn a_candidate_that_writes_nothing_in_a_reused_work_dir_is_refused_never_judged_on_old_traces() {
    let (dir, work) = scratch();
    let first = bisect(
        &work,
        dir.path(),
        &["--reference", "engine", "--candidate", "engine"],
    );
    assert_eq!(first.code, 0, "{}{}", first.stdout, first.stderr);
    assert!(work.join("candidate.trace").is_file());
    // The previous run's candidate.trace is still there; /bin/true writes nothing.
    let silent = bisect(
        &work,
        dir.path(),
        &common::against_engine("/bin/true {verb} {args}", &[]),
    );
    assert_eq!(
        (silent.code, silent.report["verdict"].as_str()),
        (2, Some("refused")),
        "{}{}",
        silent.stdout,
        silent.stderr
    );
    let why = silent.report["summary"].as_str().unwrap();
    // The gate spells a path inside the root relative to it.
    let file = "/work/candidate.trace";
    assert!(
        why.contains("trace failed: exited 0 but wrote no trace at")
            && why.contains(file)
            && why.contains("$ /bin/true trace --model fixtures/tiny-qwen3"),
        "{why}"
    );
    assert!(
        !work.join("candidate.trace").exists(),
        "the stale trace is gone"
    );
}

#[test]
fn a_layer_verb_that_writes_nothing_in_a_reused_work_dir_is_not_checked() {
    let (dir, work) = scratch();
    let all = ["--all-layers", "--reference", "engine", "--candidate"];
    let first = bisect(&work, dir.path(), &[&all[..], &["contract"]].concat());
    assert_eq!(first.code, 0, "{}{}", first.stdout, first.stderr);
    assert!(work.join("candidate.layer.00.trace").is_file());
    let cmd = producer("silent.py", "layer {verb} {args}");
    let silent = bisect(
        &work,
        dir.path(),
        &[&all[..], &["cmd", "--candidate-cmd", &cmd]].concat(),
    );
    assert_eq!(
        (silent.code, silent.report["verdict"].as_str()),
        (4, Some("not_checked")),
        "{}{}",
        silent.stdout,
        silent.stderr
    );
    let head = silent.headline();
    assert!(
        head.contains("isolation NOT CHECKED from layer 00: the candidate's layer verb failed: exited 0 but wrote no trace at")
            && head.contains("candidate.layer.00.trace")
            && head.contains("silent.py layer layer --model"),
        "{head}"
    );
}

#[test]
fn a_directory_bisect_did_not_make_is_refused_and_left_untouched() {
    let (dir, work) = scratch();
    std::fs::create_dir(&work).unwrap();
    std::fs::write(work.join("notes.trace"), "mine").unwrap();
    std::fs::write(work.join("keep.txt"), "mine too").unwrap();
    let r = bisect(
        &work,
        dir.path(),
        &["--reference", "engine", "--candidate", "engine"],
    );
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    let why = r.report["summary"].as_str().unwrap();
    assert!(
        why.contains("--work")
            && why.contains("2 entries")
            && why.contains("keep.txt, notes.trace"),
        "{why}"
    );
    assert_eq!(
        std::fs::read_to_string(work.join("notes.trace")).unwrap(),
        "mine"
    );
    let mut left: Vec<String> = std::fs::read_dir(&work)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(
        left,
        ["keep.txt", "notes.trace"],
        "nothing created, nothing removed"
    );
    // An empty directory, and one bisect made, are used; a bisect directory keeps what is not a
    // trace (a report, a page).
    let (dir2, work2) = scratch();
    std::fs::create_dir(&work2).unwrap();
    let ok = bisect(
        &work2,
        dir2.path(),
        &["--reference", "engine", "--candidate", "engine"],
    );
    assert_eq!(ok.code, 0, "{}{}", ok.stdout, ok.stderr);
    std::fs::write(work2.join("page.html"), "kept").unwrap();
    let again = bisect(
        &work2,
        dir2.path(),
        &["--reference", "engine", "--candidate", "engine"],
    );
    assert_eq!(again.code, 0, "{}{}", again.stdout, again.stderr);
    assert_eq!(
        std::fs::read_to_string(work2.join("page.html")).unwrap(),
        "kept"
    );
}

// ------------------------------------------------------------------------------------------
// Item 7: the decode path

fn decode_run(work_dir: &tempfile::TempDir, reference: &[&str], candidate: &str) -> Run {
    let work = work_dir.path().join("work");
    let mut args = vec!["--generate", "3"];
    args.extend_from_slice(reference);
    args.extend(["--candidate", "cmd", "--candidate-cmd", candidate]);
    bisect(&work, work_dir.path(), &args)
}

#[test]
fn steps_after_an_excused_decode_flip_are_not_checked_never_nothing_wrong() {
    // Both sides meet in a near-tie at step 1 (logits 1e-6 apart, each side's argmax the other):
    // the policy excuses the flip, and step 2 is not compared.
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let reference = producer(
        "decode_adversary.py",
        "--base none --tie 1=ref {verb} {args}",
    );
    let candidate = producer(
        "decode_adversary.py",
        "--base none --tie 1=cand {verb} {args}",
    );
    let r = decode_run(
        &dir,
        &["--reference", "cmd", "--reference-cmd", &reference],
        &candidate,
    );
    // The decode comparison keeps the (already judged) prefill in view, so this honest
    // near-tie is excused and the steps after it are NOT CHECKED: never a pass, never a defect.
    let d = &r.report["decode"];
    assert_eq!(
        (
            r.code,
            r.report["verdict"].as_str(),
            r.report["exit_code"].as_i64()
        ),
        (4, Some("not_checked"), Some(4)),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert_eq!(
        (
            d["steps_compared"].as_u64(),
            d["first_diverging_step"].as_u64()
        ),
        (Some(2), None)
    );
    assert!(
        d["reason"]
            .as_str()
            .unwrap()
            .contains("decode.0001.argmax is a near-tie")
            && d["reason"].as_str().unwrap().contains("step 2 NOT CHECKED"),
        "{d}"
    );
    assert!(
        r.headline().starts_with("decode step 2 NOT CHECKED"),
        "{}",
        r.stdout
    );
    // The control: the same near-tie on both sides is no flip, and every step is compared.
    let same = decode_run(
        &dir,
        &["--reference", "cmd", "--reference-cmd", &reference],
        &reference,
    );
    assert_eq!(
        (same.code, same.report["decode"]["steps_compared"].as_u64()),
        (0, Some(3)),
        "{}",
        same.stdout
    );
}

#[test]
fn a_cache_self_check_that_compared_nothing_or_was_refused_does_not_agree() {
    // late-pos: a decode defect on both paths, so a step diverges and the cache check runs; the
    // --cache off run is then made uncomparable or empty of decode steps.
    for (uncached, why) in [
        (
            "other-prompt",
            "cannot be compared with its cached run (incomparable): prompt_mismatch",
        ),
        (
            "no-decode",
            "share no decode tensor or decision at steps 0-1: nothing compared",
        ),
    ] {
        let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
        let cmd = producer(
            "decode_adversary.py",
            &format!("--base late-pos --uncached {uncached} {{verb}} {{args}}"),
        );
        let r = decode_run(&dir, &["--reference", "engine"], &cmd);
        let c = &r.report["decode"]["cache_check"];
        assert_eq!(
            (
                c["status"].as_str(),
                r.report["decode"]["first_diverging_step"].as_u64()
            ),
            (Some("not_checked"), Some(1)),
            "{uncached}: {}",
            r.stdout
        );
        assert!(
            c["reason"].as_str().unwrap().contains(why),
            "{uncached}: {c}"
        );
        assert!(
            r.headline().contains("cache self-check NOT CHECKED"),
            "{}",
            r.stdout
        );
    }
    // The control: the honest --cache off run of the same defect agrees (the defect is on both
    // paths).
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cmd = producer("decode_adversary.py", "--base late-pos {verb} {args}");
    let r = decode_run(&dir, &["--reference", "engine"], &cmd);
    assert_eq!(
        r.report["decode"]["cache_check"]["status"], "agrees",
        "{}",
        r.stdout
    );
}

#[test]
fn decode_tokens_without_decode_numbers_are_compared_and_the_first_differing_step_named() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cmd = producer(
        "decode_adversary.py",
        "--base none --tokens-only --flip-token 2 {verb} {args}",
    );
    let r = decode_run(&dir, &["--reference", "engine"], &cmd);
    let d = &r.report["decode"];
    assert_eq!(
        (r.code, r.report["verdict"].as_str()),
        (1, Some("decisions_differ")),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert_eq!(
        (
            d["first_diverging_step"].as_u64(),
            d["position"].as_i64(),
            d["first_diverging"].as_str()
        ),
        (Some(2), Some(6), Some("decode.0002.argmax"))
    );
    let head = r.headline();
    assert!(
        head.starts_with("decode step 2 (position 6) first diverges at decode.0002.argmax: the candidate takes another token; the steps' numbers NOT CHECKED"),
        "{head}"
    );
    // The control: the same tokens, no numbers: still NOT CHECKED, never a pass.
    let cmd = producer(
        "decode_adversary.py",
        "--base none --tokens-only {verb} {args}",
    );
    let r = decode_run(&dir, &["--reference", "engine"], &cmd);
    assert_eq!(
        (r.code, r.report["verdict"].as_str()),
        (4, Some("not_checked")),
        "{}",
        r.stdout
    );
    assert!(
        r.headline().contains("decode steps NOT CHECKED")
            && r.headline().contains("their tokens agree at steps 0-2"),
        "{}",
        r.stdout
    );
}

// ------------------------------------------------------------------------------------------
// Item 8: one classification of findings

/// trace-diff's verdict on the bisection's two whole traces, and the row status of `tensor`.
fn differ_says(work: &Path, policy: Option<&str>, tensor: &str) -> (String, String) {
    let opts = tracegate_diff::Options {
        all: true,
        policy: policy.map(|p| tracegate_diff::Policy::resolve(p, &repo()).unwrap()),
        ..tracegate_diff::Options::default()
    };
    let rep = tracegate_diff::compare_files(
        &work.join("reference.trace"),
        &work.join("candidate.trace"),
        &opts,
    );
    let row = rep
        .per_tensor
        .iter()
        .find(|r| r.tensor == tensor)
        .map(|r| r.status.as_str().to_string())
        .unwrap_or_default();
    (rep.verdict.as_str().to_string(), row)
}

#[test]
fn a_signed_zero_nan_payload_or_infinity_is_the_same_class_in_bisect_as_in_trace_diff() {
    // Two user producers (the contract with embed.out's first element given these bits): the
    // traces differ in that element only.
    let cases = [
        ("signed zero", "0x00000000", "0x80000000"),
        ("NaN payload", "0x7fc00000", "0x7fc00001"),
        ("infinity", "0x7f800000", "0xff800000"),
    ];
    for (what, r_bits, c_bits) in cases {
        for exact in [false, true] {
            let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
            let work = dir.path().join("work");
            let side = |bits: &str| {
                producer(
                    "planted_trace.py",
                    &format!("--base contract --bits embed.out={bits} {{verb|serve}} {{args}}"),
                )
            };
            let (reference, candidate) = (side(r_bits), side(c_bits));
            let mut args = vec![
                "--reference",
                "cmd",
                "--reference-cmd",
                &reference,
                "--candidate",
                "cmd",
                "--candidate-cmd",
                &candidate,
            ];
            if exact {
                args.push("--exact");
            }
            let r = bisect(&work, dir.path(), &args);
            let (verdict, row) = differ_says(&work, (!exact).then_some("f32"), "embed.out");
            let said = format!(
                "{what} (exact {exact}): trace-diff {verdict}/{row}; bisect {}:\n{}",
                r.report["verdict"], r.stdout
            );
            // Bisect never calls a value difference structure.
            assert_ne!(r.report["verdict"], "structure_differs", "{said}");
            assert!(!r.stdout.contains("structure"), "{said}");
            if verdict == "within_policy" || verdict == "identical" {
                assert_eq!(
                    (r.code, r.report["verdict"].as_str()),
                    (0, Some("nothing_wrong")),
                    "{said}"
                );
            } else {
                // The differ's value row is what bisect bisects from: embed.out, before layer 00.
                assert!(
                    matches!(row.as_str(), "different" | "outside_policy"),
                    "{said}"
                );
                assert_eq!(
                    (
                        r.code,
                        r.report["verdict"].as_str(),
                        r.report["whole_run"]["first_diverging"].as_str(),
                        r.report["whole_run"]["first_diverging_how"].as_str()
                    ),
                    (
                        1,
                        Some("outside_layers"),
                        Some("embed.out"),
                        Some("differs")
                    ),
                    "{said}"
                );
            }
            // What the differ says of these pairs, so the test cannot pass on nothing: a signed
            // zero is within the f32 policy, a NaN or infinity difference is not; by bits each
            // differs.
            let want = match (what, exact) {
                ("signed zero", false) => "within_policy",
                _ => "different",
            };
            assert_eq!(verdict, want, "{said}");
        }
    }
}

#[test]
fn a_relative_candidate_command_that_is_not_found_says_where_templates_run() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let r = bisect(
        &dir.path().join("work"),
        dir.path(),
        &common::against_engine("./my-port.sh {verb} {args}", &[]),
    );
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    let said = format!("{}{}", r.stderr, r.report["summary"]);
    assert!(
        said.contains("could not start \"./my-port.sh\"")
            && said.contains("command templates run in the project root"),
        "{said}"
    );
}

// Two oracle runs on different stacks: refused by default, the refusal naming the flag; with
// `--allow-stack-mismatch` bisected, each difference stated in the whole run's findings. Both
// sides are the contract claiming to be an oracle on another device (cheap, and the numbers
// equal: only the stack rule can tell them apart).
#[test]
fn oracle_stacks_that_differ_are_refused_naming_the_flag_and_bisected_with_it() {
    let side = |device: &str| {
        producer(
            "foreign_provenance.py",
            &format!(
                "--base contract --set 'producer=\"oracle\"' --set 'device=\"{device}\"' {{verb}} {{args}}"
            ),
        )
    };
    let (reference, candidate) = (side("cpu"), side("cuda:0"));
    let args = [
        "--reference",
        "cmd",
        "--reference-cmd",
        &reference,
        "--candidate",
        "cmd",
        "--candidate-cmd",
        &candidate,
    ];
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let refused = bisect(&dir.path().join("refused"), dir.path(), &args);
    assert_eq!(refused.code, 2, "{}{}", refused.stdout, refused.stderr);
    let said = format!("{}{}", refused.stderr, refused.report["summary"]);
    assert!(
        said.contains("device is cpu in the reference, cuda:0 in the candidate")
            && said.contains("gate bisect compare them anyway with --allow-stack-mismatch"),
        "{said}"
    );

    let allowed = bisect(
        &dir.path().join("allowed"),
        dir.path(),
        &[&args[..], &["--allow-stack-mismatch"]].concat(),
    );
    assert_eq!(allowed.code, 0, "{}{}", allowed.stdout, allowed.stderr);
    let findings = allowed.report["whole_run"]["findings"].to_string();
    assert!(
        findings.contains("stack_mismatch_allowed")
            && findings.contains("device is cpu in the reference, cuda:0 in the candidate"),
        "{findings}"
    );
}

/// `gate bisect --noise-reference`: the whole runs read tracegate's noise run, and a "noise"
/// the port wrote itself is refused before anything is judged.
#[test]
fn a_noise_reference_the_port_wrote_is_refused_and_tracegates_own_is_read() {
    let root = repo();
    let dir = tempfile::tempdir_in(root.join("target")).unwrap();
    let example = root.join("target/release/example-producer");
    let trace = |exe: &Path, out: &Path| {
        let o = std::process::Command::new(exe)
            .current_dir(&root)
            .args(["trace", "--model", "fixtures/tiny-qwen3"])
            .args(["--tokens", "12,218,345,152,81", "--capture", "default"])
            .args(["--out", out.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    };
    let own = dir.path().join("own.trace");
    trace(&example, &own);
    let args = |noise: &Path| {
        vec![
            "--reference".to_string(),
            "engine".into(),
            "--candidate".into(),
            "cmd".into(),
            "--candidate-cmd".into(),
            format!("'{}' {{verb}} {{args}}", example.display()),
            "--noise-reference".into(),
            noise.to_str().unwrap().to_string(),
        ]
    };
    let a = args(&own);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let refused = bisect(&dir.path().join("w1"), dir.path(), &a);
    assert_eq!(refused.code, 2, "{}{}", refused.stdout, refused.stderr);
    let said = format!("{}{}", refused.stderr, refused.report["summary"]);
    assert!(
        said.contains("noise_reference_refused")
            || said.contains("not one of tracegate's reference producers"),
        "{said}"
    );
    // The control: the engine's own run (tracegate's) is read; the honest port is within.
    let noise = dir.path().join("noise.trace");
    trace(&root.join("target/release/engine"), &noise);
    let a = args(&noise);
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let read = bisect(&dir.path().join("w2"), dir.path(), &a);
    assert_eq!(read.code, 0, "{}{}", read.stdout, read.stderr);
}

/// An honest bf16 port of the MoE fixture (transformers in bf16) whose routers flip at near-ties
/// of the f32 engine's scores, and which declines forcing: nothing judged differs, but what
/// followed the near-ties was never compared — NOT CHECKED (exit 4), never "nothing wrong".
#[test]
fn a_port_that_declines_forcing_past_its_near_ties_is_not_checked_never_nothing_wrong() {
    let root = repo();
    let py = root.join(".venv/bin/python");
    let cmd = format!(
        "'{}' '{}' '{}' -m tracegate_oracle -- {{verb}} {{args}} --dtype bf16",
        py.display(),
        root.join("gate/tests/producers/no_force.py").display(),
        py.display()
    );
    let dir = tempfile::tempdir_in(root.join("target")).unwrap();
    let r = bisect_on(
        ("fixtures/tiny-qwen3-moe", "mid"),
        &dir.path().join("w"),
        dir.path(),
        &common::against_engine(&cmd, &["--precision", "bf16", "--capture", "internals"]),
    );
    assert_eq!(r.code, 4, "{}{}", r.stdout, r.stderr);
    assert_eq!(r.report["verdict"], "not_checked", "{}", r.stdout);
    assert!(
        r.stdout.contains("NOT CHECKED past a near-tie"),
        "{}",
        r.stdout
    );
}
