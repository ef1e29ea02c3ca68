//! The gate's CI outputs (docs/ci.md): `--junit FILE` holds exactly the report's checks — each
//! prompt's and each baseline's, FAIL a failure, NOT CHECKED a skipped case, never a pass — read
//! back by an XML parser that is not ours (Python's ElementTree); under GitHub Actions the gate
//! prints one ::error per FAIL and one ::warning per NOT CHECKED, and none elsewhere.

use crate::common;

use std::path::Path;
use std::process::Command;

use serde_json::Value;

use common::{python, repo};

/// `gate m1` on one prompt of the MoE fixture with a contract one ULP off in one tensor
/// (`matches` FAILs) and the oracle blocked by a Python without torch (its checks NOT CHECKED).
fn planted_m1(dir: &Path, github: bool) -> (i32, String, Value, std::path::PathBuf) {
    let block = dir.join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(block.join("torch.py"), "raise ImportError('blocked')\n").unwrap();
    let contract = format!(
        "'{}' '{}' --base contract --nudge layer.01.mlp_out {{verb}} {{args}}",
        python().display(),
        repo()
            .join("gate/tests/producers/planted_trace.py")
            .display()
    );
    let (report, junit) = (dir.join("report.json"), dir.join("junit.xml"));
    let mut cmd = common::gate();
    cmd.current_dir(repo())
        .args([
            "m1",
            "--model",
            "fixtures/tiny-qwen3-moe",
            "--only",
            "short",
        ])
        .args(["--contract-cmd", &contract])
        .arg("--work")
        .arg(dir.join("work"))
        .arg("--report")
        .arg(&report)
        .arg("--junit")
        .arg(&junit)
        .env("TRACEGATE_PYTHON", python())
        .env("PYTHONPATH", &block)
        .env_remove("GITHUB_ACTIONS");
    if github {
        cmd.env("GITHUB_ACTIONS", "true");
    }
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        junit.exists(),
        "no JUnit file:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    (out.status.code().unwrap_or(-1), stdout, report, junit)
}

/// The JUnit file as Python's ElementTree reads it: the totals and, per case, `[classname,
/// name, status, message]` with status pass, failure or skipped.
fn parsed(junit: &Path) -> Value {
    let script = r#"
import json, sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
assert root.tag == "testsuites", root.tag
cases = []
for suite in root.findall("testsuite"):
    for c in suite.findall("testcase"):
        kids = list(c)
        status = kids[0].tag if kids else "pass"
        message = kids[0].get("message") if kids else None
        cases.append([c.get("classname"), c.get("name"), status, message])
print(json.dumps({"tests": int(root.get("tests")), "failures": int(root.get("failures")),
                  "skipped": int(root.get("skipped")), "cases": cases}))
"#;
    let out = Command::new(python())
        .args(["-c", script])
        .arg(junit)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ElementTree refused the JUnit file: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Every check of the report as `[classname, name, status, first line of detail]`.
fn report_cases(reports: &Value) -> Vec<Value> {
    let mut out = Vec::new();
    for r in reports.as_array().unwrap() {
        let model = Path::new(r["model"].as_str().unwrap())
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let groups = r["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p["id"].as_str().unwrap().to_string(), &p["checks"]))
            .chain([("baselines".to_string(), &r["baselines"])]);
        for (group, checks) in groups {
            for c in checks.as_array().unwrap() {
                let first = c["detail"].as_str().unwrap().lines().next().unwrap_or("");
                let (status, message) = match c["status"].as_str().unwrap() {
                    "PASS" => ("pass", Value::Null),
                    "FAIL" => ("failure", first.into()),
                    _ => ("skipped", format!("NOT CHECKED: {first}").into()),
                };
                out.push(serde_json::json!([
                    format!("{}.{model}.{group}", r["milestone"].as_str().unwrap()),
                    c["check"],
                    status,
                    message
                ]));
            }
        }
    }
    out
}

#[test]
fn the_junit_file_holds_exactly_the_reports_checks_and_github_gets_one_line_per_non_pass() {
    let dir = tempfile::tempdir().unwrap();
    let (code, stdout, report, junit) = planted_m1(dir.path(), true);
    assert_eq!(code, 1, "{stdout}");
    let x = parsed(&junit);
    let expected = report_cases(&report);
    assert_eq!(x["cases"].as_array().unwrap(), &expected, "{x}");
    let n = |s: &str| expected.iter().filter(|c| c[2] == s).count() as u64;
    assert_eq!(x["tests"], expected.len() as u64);
    assert_eq!(x["failures"], n("failure"));
    assert_eq!(x["skipped"], n("skipped"));
    // The planted defect and the missing oracle are there, by name.
    assert!(
        n("failure") >= 1 && n("skipped") >= 1 && n("pass") >= 1,
        "{x}"
    );
    let matches = expected
        .iter()
        .find(|c| c[1] == "matches")
        .expect("a matches case");
    assert_eq!(matches[0], "m1.tiny-qwen3-moe.short");
    assert_eq!(matches[2], "failure");
    let xml = std::fs::read_to_string(&junit).unwrap();
    assert!(
        xml.contains("layer.01.mlp_out"),
        "the failure names no tensor:\n{xml}"
    );

    let errors: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("::error "))
        .collect();
    let warnings: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("::warning "))
        .collect();
    assert_eq!(errors.len() as u64, n("failure"), "{stdout}");
    assert_eq!(warnings.len() as u64, n("skipped"), "{stdout}");
    assert!(
        errors.iter().any(|l| l
            .starts_with("::error title=gate m1 tiny-qwen3-moe short/matches%3A FAIL::")
            && l.contains("layer.01.mlp_out")),
        "{stdout}"
    );
    // A multi-line detail stays on its one line.
    for l in errors.iter().chain(&warnings) {
        assert!(!l.contains('\n') && l.contains("::"), "{l}");
    }

    // Negative control: outside GitHub Actions no workflow command is printed.
    let other = tempfile::tempdir().unwrap();
    let (code, stdout, report, junit) = planted_m1(other.path(), false);
    assert_eq!(code, 1, "{stdout}");
    assert!(!stdout.lines().any(|l| l.starts_with("::")), "{stdout}");
    assert_eq!(
        parsed(&junit)["cases"].as_array().unwrap(),
        &report_cases(&report)
    );
}

#[test]
fn a_junit_file_that_cannot_be_written_is_refused_before_anything_runs() {
    let dir = tempfile::tempdir().unwrap();
    let out = common::gate()
        .current_dir(repo())
        .args(["m0", "--model", "fixtures/tiny-qwen3", "--only", "short"])
        .arg("--work")
        .arg(dir.path().join("work"))
        .arg("--junit")
        .arg(dir.path().join("missing/junit.xml"))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--junit"), "{stderr}");
    assert!(!dir.path().join("work").exists(), "something ran: {stderr}");
}
