//! `matches` (engine ≡ contract) compares the whole content: a contract trace whose margins or
//! attributes alone were edited must fail it with a finding naming what changed (issue 12:
//! both passed). Runs the real `gate` binary with a planted contract producer.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap()
}

fn python() -> PathBuf {
    let py = repo().join(".venv/bin/python");
    assert!(py.exists(), "{} missing: run scripts/setup.sh", py.display());
    py
}

/// An interpreter for which `import torch` fails: the oracle is not needed here.
fn torchless_python(dir: &Path) -> PathBuf {
    let block = dir.join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(block.join("torch.py"), "raise ImportError('torch is blocked for this test')\n").unwrap();
    let script = dir.join("torchless-python");
    std::fs::write(&script, format!("#!/bin/sh\nPYTHONPATH='{}' exec '{}' \"$@\"\n", block.display(), python().display())).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// Runs `gate m1 --only short` with the contract replaced by `content_edit.py EDIT`; returns
/// the exit code, the `matches` check of prompt `short`, and the output for messages.
fn run_with_edit(edit: &str) -> (i32, Value, String) {
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let producer = repo().join("gate/tests/producers/content_edit.py");
    let template = format!("'{}' '{}' {edit} {{verb}} {{args}}", python().display(), producer.display());
    let report = dir.path().join("report.json");
    let out = Command::new(env!("CARGO_BIN_EXE_gate"))
        .arg("--root")
        .arg(repo())
        .args(["m1", "--only", "short", "--contract-cmd", &template, "--report"])
        .arg(&report)
        .arg("--work")
        .arg(dir.path().join("work"))
        .env("TRACEGATE_PYTHON", python())
        .env("TRACEGATE_ORACLE_PYTHON", &torchless)
        .output()
        .unwrap();
    let text = format!("{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap_or_else(|e| panic!("no report ({e}):\n{text}"))).unwrap();
    let prompt = rep["prompts"].as_array().unwrap().iter().find(|p| p["id"] == "short").unwrap_or_else(|| panic!("no prompt short:\n{rep}"));
    let matches = prompt["checks"].as_array().unwrap().iter().find(|c| c["check"] == "matches").unwrap_or_else(|| panic!("no matches check:\n{rep}")).clone();
    (out.status.code().unwrap_or(-1), matches, text)
}

fn findings_of<'a>(check: &'a Value, kind: &str) -> Vec<&'a Value> {
    check["findings"].as_array().unwrap().iter().filter(|f| f["kind"] == kind).collect()
}

#[test]
fn margins_set_to_1e6_fail_matches() {
    let (code, matches, text) = run_with_edit("margins-1e6");
    assert_eq!(code, 1, "{text}");
    assert_eq!(matches["status"], "FAIL", "{matches}");
    let found = findings_of(&matches, "margin_differs");
    // The MoE fixture's every decision has margins; each one is named.
    assert!(found.iter().any(|f| f["name"] == "logits.argmax"), "{matches}");
    assert!(found.iter().any(|f| f["name"] == "layer.00.router.topk"), "{matches}");
    assert!(found.iter().all(|f| f["detail"].as_str().unwrap().contains("1e6")), "{matches}");
    // Nothing but margins changed: no tensor differs.
    assert!(findings_of(&matches, "tensor_differs").is_empty(), "{matches}");
}

#[test]
fn an_extra_attribute_on_logits_fails_matches() {
    let (code, matches, text) = run_with_edit("logits-attr");
    assert_eq!(code, 1, "{text}");
    assert_eq!(matches["status"], "FAIL", "{matches}");
    let found = findings_of(&matches, "attribute_differs");
    assert_eq!(found.len(), 1, "{matches}");
    assert_eq!(found[0]["name"], "logits");
    assert!(found[0]["detail"].as_str().unwrap().contains("\"note\""), "{matches}");
}
