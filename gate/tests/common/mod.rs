//! What the gate's test modules share: the gate command, the repository root, its Python and the reports'
//! schemas (docs/*.schema.json, checked by `tracegate-schema-check`). Each test module uses what
//! it needs.
#![allow(dead_code)]

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The gate under test, with residency off (docs/producers.md, "Resident workers"): a test run
/// leaves no worker behind. The resident tests (tests/resident.rs) turn it on in a runtime
/// directory of their own.
pub fn gate() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gate"));
    cmd.env("TRACEGATE_RESIDENT", "0");
    cmd
}

/// A copy of directory `from` at `to`, every file with its permissions (std::fs::copy).
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// docs/`name`'s schema (docs/*.schema.json, compiled once per test binary).
/// The repository's Python (the contract's and oracle's), which the tests' candidates run on.
pub fn python() -> PathBuf {
    let py = repo().canonicalize().unwrap().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} missing: run scripts/setup.sh",
        py.display()
    );
    py
}

pub fn validator(name: &str) -> &'static tracegate_schema_check::Schema {
    tracegate_schema_check::schema(name)
}

/// docs/bisect-report.schema.json's schema.
pub fn bisect_validator() -> &'static tracegate_schema_check::Schema {
    validator("bisect-report.schema.json")
}

/// Panics unless `report` is a valid `gate bisect` report.
pub fn assert_valid_bisect_report(report: &Value) {
    bisect_validator().assert_valid(report);
}

/// The contract with one planted defect (tests/producers/defective_contract.py `--defect NAME`)
/// as a serving command template, run by the project's Python.
pub fn defective(defect: &str) -> String {
    format!(
        "'{}' '{}' --defect {defect} {{verb|serve}} {{args}}",
        repo().join(".venv/bin/python").display(),
        repo()
            .join("gate/tests/producers/defective_contract.py")
            .display()
    )
}

/// A finished `gate bisect`: its exit code, output and report.
pub struct Bisected {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub report: Value,
}

impl Bisected {
    pub fn headline(&self) -> &str {
        headline(&self.stdout)
    }
}

/// The verdict line of `gate bisect`'s text output: its second line (the first says how bisect
/// judged, docs/bisect.md, "Judging", and must).
pub fn headline(stdout: &str) -> &str {
    let mut lines = stdout.lines();
    assert!(
        lines.next().unwrap_or("").starts_with("judged by "),
        "the first line does not say how it judged: {stdout}"
    );
    lines.next().unwrap_or("")
}

/// `gate --root ROOT bisect --work WORK --report REPORT ARGS`, from the repository root (so
/// `--model fixtures/...` and a relative `work` name the root's). A report left by an earlier
/// run in a reused directory is removed first, so it is never read as this run's.
pub fn bisect_command<S: AsRef<OsStr>>(
    work: &Path,
    report: &Path,
    args: &[S],
) -> std::process::Command {
    let root = repo();
    let _ = std::fs::remove_file(report);
    let mut cmd = gate();
    cmd.current_dir(&root)
        .arg("--root")
        .arg(&root)
        .arg("bisect")
        .arg("--work")
        .arg(work)
        .arg("--report")
        .arg(report)
        .args(args);
    cmd
}

/// The report `gate bisect` wrote at `report`, checked against docs/bisect-report.schema.json
/// (a refusal's too); no report is a panic with the run's output.
pub fn read_bisect_report(report: &Path, stdout: &str, stderr: &str) -> Value {
    let text = std::fs::read_to_string(report)
        .unwrap_or_else(|e| panic!("no report ({e}):\n{stdout}\n{stderr}"));
    let report: Value = serde_json::from_str(&text).unwrap();
    assert_valid_bisect_report(&report);
    report
}

/// [`bisect_command`] run to its end: exit code, output and the checked report.
pub fn bisect<S: AsRef<OsStr>>(work: &Path, report: &Path, args: &[S]) -> Bisected {
    let out = bisect_command(work, report, args).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let report = read_bisect_report(report, &stdout, &stderr);
    Bisected {
        code: out.status.code().unwrap_or(-1),
        stdout,
        stderr,
        report,
    }
}

/// A fresh work directory under the repository's `target/` (bisect's traces and report) and
/// its path relative to the root, as the tests that read the report's trace paths name it.
pub fn work_dir() -> (tempfile::TempDir, PathBuf) {
    let root = repo();
    let work = tempfile::tempdir_in(root.join("target")).unwrap();
    let rel = work.path().strip_prefix(&root).unwrap().to_path_buf();
    (work, rel)
}

/// A binary of the workspace built beside the gate (`example-producer`, `engine`, `trace-diff`,
/// `trace-merge`); missing, a panic saying how to build it.
pub fn sibling(name: &str) -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_gate")).with_file_name(name);
    assert!(
        p.is_file(),
        "{} is missing: build it with `cargo build --release --bins`",
        p.display()
    );
    p
}

/// Check `name` of a report's first prompt (the port, ranks and m2 tests run one prompt).
pub fn check<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["prompts"][0]["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no check {name}: {report}"))
}

/// A finished command's exit code (-1 when a signal ended it) and its stdout then stderr.
pub fn code_and_output(out: &std::process::Output) -> (i32, String) {
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

/// `gate bisect`'s arguments for candidate command `cmd` against the engine, then `more`.
pub fn against_engine<'a>(cmd: &'a str, more: &[&'a str]) -> Vec<&'a str> {
    let candidate = [
        "--reference",
        "engine",
        "--candidate",
        "cmd",
        "--candidate-cmd",
        cmd,
    ];
    [&candidate[..], more].concat()
}

/// Each entry's `status` in a bisect report's `layers` (of a whole run or of a decode step).
pub fn statuses(layers: &Value) -> Vec<&str> {
    layers
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["status"].as_str().unwrap())
        .collect()
}

/// The stage tensors a bisect report's blamed layer matches in (`stage.matching`).
pub fn matching(report: &Value) -> Vec<&str> {
    report["stage"]["matching"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect()
}

/// `cmd`'s output; it must exit 0 (a set-up step of a test, not what the test is about).
pub fn succeeded(cmd: &mut std::process::Command) -> std::process::Output {
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{cmd:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}
