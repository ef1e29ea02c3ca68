//! What the gate's test binaries share: the repository root and the JSON Schema validators of the
//! reports (docs/*.schema.json, draft 2020-12, with the diff report's schema, which the others
//! refer to by its $id, registered). Each test binary uses what it needs.
#![allow(dead_code)]

use std::path::PathBuf;

use serde_json::Value;

/// The gate under test, with residency off (docs/producers.md, "Resident workers"): a test run
/// leaves no worker behind. The resident tests (tests/resident.rs) turn it on in a runtime
/// directory of their own.
pub fn gate() -> std::process::Command {
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_gate"));
    cmd.env("TRACEGATE_RESIDENT", "0");
    cmd
}

pub fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn read_schema(name: &str) -> Value {
    let path = repo().join("docs").join(name);
    serde_json::from_str(
        &std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
    )
    .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The validator of docs/`name`, compiled against the diff report's schema.
pub fn validator(name: &str) -> jsonschema::Validator {
    let diff = read_schema("diff-report.schema.json");
    let id = diff["$id"].as_str().unwrap().to_string();
    let registry: &'static jsonschema::Registry = Box::leak(Box::new(
        jsonschema::Registry::new()
            .add(id, diff)
            .unwrap()
            .prepare()
            .unwrap(),
    ));
    jsonschema::options()
        .with_draft(jsonschema::Draft::Draft202012)
        .with_registry(registry)
        .build(&read_schema(name))
        .unwrap_or_else(|e| panic!("docs/{name} is not a valid schema: {e}"))
}

/// Panics unless `report` is valid under `v` (the validator of docs/`name`).
pub fn assert_valid(v: &jsonschema::Validator, name: &str, report: &Value) {
    let errors: Vec<String> = v
        .iter_errors(report)
        .map(|e| format!("at {}: {e}", e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "the report does not match docs/{name}:\n{}\n{report:#}",
        errors.join("\n")
    );
}

/// docs/bisect-report.schema.json's validator, compiled once per test binary.
pub fn bisect_validator() -> &'static jsonschema::Validator {
    static V: std::sync::OnceLock<jsonschema::Validator> = std::sync::OnceLock::new();
    V.get_or_init(|| validator("bisect-report.schema.json"))
}

/// Panics unless `report` is a valid `gate bisect` report.
pub fn assert_valid_bisect_report(report: &Value) {
    assert_valid(bisect_validator(), "bisect-report.schema.json", report);
}
