//! `gate init` and `--bless` killed at every step of their journal (issue 51; docs/gate.md,
//! "Interrupted init and bless"): with the test hook `TRACEGATE_FAULT_AT=N` the gate SIGKILLs
//! itself right after its N-th journal step, N = 1, 2, … until a run completes, so every step is
//! killed once. After each kill the next gate command sees the project exactly as it was before
//! the command (a kill before the commit point) or exactly as the command's own journal made it
//! (after), compared file by file and byte by byte; rerunning the command then recovers, and
//! `gate run port` passes — never "golden trace … differs". A recovery killed in its turn is
//! finished by the next. Negative controls: the old/new classifier calls a mix of the two
//! neither; a malformed hook value is refused before anything is written.
//!
//! The port and its reference are both `examples/producer` (`--reference cmd`): no Python runs,
//! so the ~30 gate runs cost seconds. What the journal writes does not depend on who recorded
//! the traces (gate/src/journal.rs).

use crate::common;

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};

const STAGING: &str = ".tracegate-staging";

fn example_producer() -> PathBuf {
    common::sibling("example-producer")
}

struct Out {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
}

impl std::fmt::Display for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?} signal {:?}\n{}\n{}",
            self.code, self.signal, self.stdout, self.stderr
        )
    }
}

fn gate(dir: &Path, args: &[&str], fault: Option<&str>) -> Out {
    let mut cmd = common::gate();
    cmd.current_dir(dir)
        .args(args)
        .env_remove("GITHUB_ACTIONS")
        .env_remove("TRACEGATE_FAULT_AT");
    if let Some(n) = fault {
        cmd.env("TRACEGATE_FAULT_AT", n);
    }
    let out = cmd.output().unwrap();
    Out {
        code: out.status.code(),
        signal: out.status.signal(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

const PROMPTS: &str = r#"{"schema": 1, "prompts": [
  {"id": "short", "tokens": [12, 218, 345, 152, 81]},
  {"id": "mid", "tokens": [438, 493, 24, 203, 157, 369, 394, 425, 82, 100, 321]}]}"#;

/// A new project (the model only) and, outside it, its prompt file (init copies it in).
fn pristine() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("project/model");
    std::fs::create_dir_all(&model).unwrap();
    for f in std::fs::read_dir(common::repo().join("fixtures/tiny-qwen3")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, model.join(f.file_name().unwrap())).unwrap();
    }
    let prompts = dir.path().join("prompts-outside.json");
    std::fs::write(&prompts, PROMPTS).unwrap();
    (dir, prompts)
}

fn init_args(prompts: &Path) -> Vec<String> {
    let cmd = format!("'{}' {{verb}} {{args}}", example_producer().display());
    [
        "init",
        "--model",
        "model",
        "--candidate-cmd",
        &cmd,
        "--reference",
        "cmd",
        "--reference-cmd",
        &cmd,
        "--prompts",
        prompts.to_str().unwrap(),
        "--generate",
        "2",
    ]
    .map(String::from)
    .to_vec()
}

/// Every file and directory of a project but the work directory (`target/`, scratch) and the
/// journal: path -> bytes (a directory: None).
type Snapshot = BTreeMap<String, Option<Vec<u8>>>;

fn snapshot(root: &Path) -> Snapshot {
    fn walk(root: &Path, dir: &Path, out: &mut Snapshot) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().display().to_string();
            if rel == "target" || rel == STAGING {
                continue;
            }
            if p.is_dir() {
                out.insert(format!("{rel}/"), None);
                walk(root, &p, out);
            } else {
                out.insert(rel, Some(std::fs::read(&p).unwrap()));
            }
        }
    }
    let mut out = Snapshot::new();
    walk(root, root, &mut out);
    out
}

/// The project a killed run's journal commits to: `old` with every file the manifest names in
/// its new bytes — still staged, or already renamed into place. None: no manifest (the run was
/// killed before its commit point).
fn committed(root: &Path, old: &Snapshot) -> Option<Snapshot> {
    let staging = root.join(STAGING);
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(staging.join("manifest.json")).ok()?)
            .unwrap();
    let now = snapshot(root);
    let mut new = old.clone();
    for rel in manifest["files"].as_array().unwrap() {
        let rel = rel.as_str().unwrap();
        let bytes = match std::fs::read(staging.join("files").join(rel)) {
            Ok(b) => b,
            Err(_) => now[rel].clone().expect("a renamed file"),
        };
        let mut dir = Path::new(rel).parent();
        while let Some(d) = dir.filter(|d| !d.as_os_str().is_empty()) {
            new.insert(format!("{}/", d.display()), None);
            dir = d.parent();
        }
        new.insert(rel.to_string(), Some(bytes));
    }
    Some(new)
}

#[derive(Debug, PartialEq)]
enum Seen {
    Old,
    New,
    Neither(String),
}

/// Whether `now` is exactly `old` or exactly `new`; else the first path that tells it is neither.
fn classify(now: &Snapshot, old: &Snapshot, new: &Snapshot) -> Seen {
    if now == old {
        return Seen::Old;
    }
    if now == new {
        return Seen::New;
    }
    let differs = |a: &Snapshot, b: &Snapshot| {
        a.keys()
            .chain(b.keys())
            .find(|k| a.get(*k) != b.get(*k))
            .cloned()
            .unwrap_or_default()
    };
    Seen::Neither(format!(
        "{} differs from the old project, {} from the new",
        differs(now, old),
        differs(now, new)
    ))
}

fn killed_at(out: &Out, n: usize) -> Option<String> {
    if out.signal != Some(libc::SIGKILL) {
        return None;
    }
    let tag = format!("TRACEGATE_FAULT_AT={n}: killed after journal step {n} (");
    let line = out
        .stderr
        .lines()
        .find(|l| l.starts_with(&tag))
        .unwrap_or_else(|| panic!("killed without saying where: {out}"));
    Some(
        line[tag.len()..]
            .strip_suffix(')')
            .unwrap_or(&line[tag.len()..])
            .to_string(),
    )
}

/// Kills `args` at every journal step in a fresh copy of `template` (its project as `old`)
/// and checks each outcome (module doc); `rerun_refused_when_new`: rerunning the command once
/// it was killed after its commit point is refused (init: the project is initialised). The
/// steps killed, by name.
fn kill_at_every_step(template: &Path, args: &[&str], rerun_refused_when_new: bool) -> Vec<String> {
    let old = snapshot(template);
    let mut steps = Vec::new();
    let (mut saw_old, mut saw_new) = (false, false);
    for n in 1.. {
        let work = tempfile::tempdir().unwrap();
        let d = work.path().join("project");
        common::copy_dir(template, &d);
        let fault = n.to_string();
        let out = gate(&d, args, Some(&fault));
        let Some(step) = killed_at(&out, n) else {
            assert_eq!(out.code, Some(0), "run with {n} > steps: {out}");
            assert!(!d.join(STAGING).exists());
            break;
        };
        // The journal names the new project; a run killed after removing it left it in place.
        let new = match d.join(STAGING).exists() {
            true => committed(&d, &old),
            false => Some(snapshot(&d)),
        };
        if new.is_none() {
            // Before the commit point nothing of the project has changed yet.
            assert_eq!(
                classify(&snapshot(&d), &old, &old),
                Seen::Old,
                "step {n} ({step})"
            );
        }
        // The next gate command recovers: `gate run port` with --root (init's project has no
        // milestones.json yet to be found by).
        let run = gate(&d, &["--root", ".", "run", "port"], None);
        assert!(!d.join(STAGING).exists(), "step {n} ({step}): {run}");
        let seen = classify(&snapshot(&d), &old, new.as_ref().unwrap_or(&old));
        match &new {
            None => {
                assert_eq!(seen, Seen::Old, "step {n} ({step}): {run}");
                saw_old = true;
            }
            Some(new) => {
                assert_ne!(new, &old, "step {n} ({step}): the command changed nothing");
                assert_eq!(seen, Seen::New, "step {n} ({step}): {run}");
                assert!(
                    run.stderr.contains("gate: finished `gate ") || step == "journal removed",
                    "step {n} ({step}): {run}"
                );
                assert_eq!(
                    run.code,
                    Some(0),
                    "step {n} ({step}): the new project passes: {run}"
                );
                saw_new = true;
            }
        }
        // Rerunning the command recovers.
        let again = gate(&d, args, None);
        if new.is_some() && rerun_refused_when_new {
            assert_eq!(again.code, Some(2), "step {n} ({step}): {again}");
            assert!(
                again.stderr.contains("already holds milestones.json"),
                "step {n} ({step}): {again}"
            );
        } else {
            assert_eq!(again.code, Some(0), "step {n} ({step}): rerun: {again}");
        }
        let run = gate(&d, &["run", "port"], None);
        assert_eq!(
            run.code,
            Some(0),
            "step {n} ({step}): after the rerun: {run}"
        );
        assert!(!d.join(STAGING).exists());
        steps.push(step);
    }
    assert!(saw_old && saw_new, "{steps:?}");
    steps
}

#[test]
fn init_killed_at_every_step_leaves_the_project_old_or_new_and_a_rerun_recovers() {
    let (dir, prompts) = pristine();
    let template = dir.path().join("project");
    let args = init_args(&prompts);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let steps = kill_at_every_step(&template, &args, true);
    assert_eq!(
        steps,
        journal_steps(&[
            "milestones.json",
            "baselines.json",
            "golden/short.trace",
            "golden/mid.trace",
            "prompts.json",
        ])
    );
}

/// The steps of a journal writing `files`, in order (gate/src/journal.rs).
fn journal_steps(files: &[&str]) -> Vec<String> {
    let mut want = vec!["journal created".to_string()];
    want.extend(files.iter().map(|f| format!("staged {f}")));
    want.push("manifest written (commit point)".into());
    want.extend(files.iter().map(|f| format!("renamed {f}")));
    want.push("journal removed".into());
    want
}

#[test]
fn bless_killed_at_every_step_leaves_the_project_old_or_new_and_a_rerun_recovers() {
    let (dir, prompts) = pristine();
    let template = dir.path().join("project");
    let args = init_args(&prompts);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = gate(&template, &args, None);
    assert_eq!(out.code, Some(0), "{out}");
    std::fs::remove_dir_all(template.join("target")).unwrap();
    // The user edits a prompt: `--bless` re-records its golden trace (and the set's sha256).
    std::fs::write(
        template.join("prompts.json"),
        PROMPTS.replace("[12, 218, 345, 152, 81]", "[12, 218, 345, 152, 82]"),
    )
    .unwrap();
    let steps = kill_at_every_step(&template, &["run", "port", "--bless"], false);
    assert_eq!(
        steps,
        journal_steps(&[
            "milestones.json",
            "baselines.json",
            "golden/short.trace",
            "golden/mid.trace",
        ])
    );
}

#[test]
fn a_killed_recovery_is_finished_by_the_next_command() {
    let (dir, prompts) = pristine();
    let d = dir.path().join("project");
    let args = init_args(&prompts);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let old = snapshot(&d);
    // Killed after the commit point and the first rename (milestones.json).
    let out = gate(&d, &args, Some("8"));
    assert_eq!(
        killed_at(&out, 8).as_deref(),
        Some("renamed milestones.json"),
        "{out}"
    );
    let new = committed(&d, &old).unwrap();
    // The recovery killed in its turn, after its own first rename: still a mix on disk.
    let out = gate(&d, &["run", "port"], Some("1"));
    assert_eq!(
        killed_at(&out, 1).as_deref(),
        Some("renamed baselines.json"),
        "{out}"
    );
    assert!(matches!(
        classify(&snapshot(&d), &old, &new),
        Seen::Neither(_)
    ));
    let out = gate(&d, &["run", "port"], None);
    assert_eq!(out.code, Some(0), "{out}");
    assert!(out.stderr.contains("gate: finished `gate init`"), "{out}");
    assert_eq!(classify(&snapshot(&d), &old, &new), Seen::New);
}

#[test]
fn the_classifier_calls_a_mix_neither_and_a_malformed_hook_is_refused() {
    let (dir, prompts) = pristine();
    let d = dir.path().join("project");
    let args = init_args(&prompts);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // A malformed hook: refused in one line before anything is written.
    for bad in [
        "",
        "0",
        "-1",
        "+3",
        " 3",
        "3s",
        "abc",
        "99999999999999999999999",
    ] {
        let out = gate(&d, &args, Some(bad));
        assert_eq!(out.code, Some(2), "{bad:?}: {out}");
        assert!(
            out.stderr.trim().lines().count() == 1
                && out
                    .stderr
                    .contains(&format!("TRACEGATE_FAULT_AT={bad:?} is not accepted")),
            "{bad:?}: {out}"
        );
    }
    assert_eq!(
        std::fs::read_dir(&d).unwrap().count(),
        1,
        "nothing but the model"
    );
    let old = snapshot(&d);
    let out = gate(&d, &args, None);
    assert_eq!(out.code, Some(0), "{out}");
    let new = snapshot(&d);
    let out = gate(&d, &["run", "port"], Some("x"));
    assert_eq!(out.code, Some(2), "{out}");
    // The classifier: the new milestones.json beside the old files is neither.
    let mut mix = old.clone();
    mix.insert("milestones.json".into(), new["milestones.json"].clone());
    assert!(matches!(classify(&mix, &old, &new), Seen::Neither(_)));
    let mut mix = new.clone();
    mix.insert(
        "golden/short.trace".into(),
        Some(b"an old golden trace".to_vec()),
    );
    assert!(matches!(classify(&mix, &old, &new), Seen::Neither(_)));
    assert_eq!(classify(&new, &old, &new), Seen::New);
}
