//! What the gate's test modules share: the gate command, the repository root, its Python and the reports'
//! schemas (docs/*.schema.json, checked by `tracegate-schema-check`). Each test module uses what
//! it needs.
#![allow(dead_code)]

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
