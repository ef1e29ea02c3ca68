//! The gate is code and is tested: it passes as bundled, and each planted defect fails it with
//! the right finding. Runs the real `gate` binary on the tiny fixtures.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::common;
use common::{copy_dir, python};

fn repo() -> PathBuf {
    common::repo().canonicalize().unwrap()
}

/// A copy of the project's gate inputs (milestones, baselines, fixtures) that a test may edit.
fn scratch_root() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for f in ["milestones.json", "baselines.json"] {
        std::fs::copy(repo().join(f), dir.path().join(f)).unwrap();
    }
    copy_dir(&repo().join("fixtures"), &dir.path().join("fixtures"));
    dir
}

/// An interpreter for which `import torch` fails: the oracle is then unavailable.
fn torchless_python(dir: &Path) -> PathBuf {
    let block = dir.join("block");
    std::fs::create_dir_all(&block).unwrap();
    std::fs::write(
        block.join("torch.py"),
        "raise ImportError('torch is blocked for this test')\n",
    )
    .unwrap();
    let script = dir.join("torchless-python");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nPYTHONPATH='{}' exec '{}' \"$@\"\n",
            block.display(),
            python().display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// XORs `mask` into byte `byte` of tensor `tensor`'s data in a safetensors file.
fn flip_weight_bits(weights: &Path, tensor: &str, byte: usize, mask: u8) {
    let mut bytes = std::fs::read(weights).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let start = header[tensor]["data_offsets"][0].as_u64().unwrap() as usize;
    bytes[8 + header_len + start + byte] ^= mask;
    std::fs::write(weights, bytes).unwrap();
}

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    report: Option<Value>,
}

/// The gate binary with the common arguments. Tests run in parallel on the same checkout, so
/// each run gets its own trace directory unless the test names one.
fn gate_command(
    root: &Path,
    args: &[&str],
    env: &[(&str, &Path)],
    report: &Path,
    work: &Path,
) -> Command {
    let mut cmd = common::gate();
    // From the root, so `--model fixtures/...` names the root's fixture.
    cmd.current_dir(root)
        .arg("--root")
        .arg(root)
        .args(args)
        .arg("--report")
        .arg(report);
    if !args.contains(&"--work") {
        cmd.arg("--work").arg(work);
    }
    cmd.env("TRACEGATE_PYTHON", python());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

fn finished(out: Output, report: &Path) -> Run {
    let Output {
        status,
        stdout,
        stderr,
    } = out;
    let report: Option<Value> = std::fs::read_to_string(report)
        .ok()
        .map(|s| serde_json::from_str(&s).unwrap());
    // Every report file is an array, one report per model that ran.
    for r in report.iter().flat_map(|r| r.as_array().unwrap()) {
        report_validator().assert_valid(r);
    }
    // A run of one model (`--model`) is read as that model's report.
    let report = report.map(|r| match r.as_array().map(Vec::as_slice) {
        Some([one]) => one.clone(),
        _ => r,
    });
    Run {
        code: status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&stdout).into(),
        stderr: String::from_utf8_lossy(&stderr).into(),
        report,
    }
}

fn gate(root: &Path, args: &[&str], env: &[(&str, &Path)]) -> Run {
    let report_dir = tempfile::tempdir().unwrap();
    let report = report_dir.path().join("report.json");
    let out = gate_command(root, args, env, &report, &report_dir.path().join("work"))
        .output()
        .unwrap();
    finished(out, &report)
}

/// `gate` for tests whose failure mode is the gate blocking: a gate still running after
/// `WATCHDOG` (far beyond what these runs need) is killed and the test fails, instead of hanging.
fn gate_watched(root: &Path, args: &[&str], env: &[(&str, &Path)]) -> Run {
    const WATCHDOG: std::time::Duration = std::time::Duration::from_secs(180);
    let report_dir = tempfile::tempdir().unwrap();
    let report = report_dir.path().join("report.json");
    let child = gate_command(root, args, env, &report, &report_dir.path().join("work"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as libc::pid_t;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    match rx.recv_timeout(WATCHDOG) {
        Ok(out) => finished(out.unwrap(), &report),
        Err(_) => {
            // SAFETY: kill on the pid of a child this test spawned and has not reaped.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the gate was still running after {WATCHDOG:?}: it blocked");
        }
    }
}

/// docs/gate-report.schema.json, with the diff report's schema it refers to, compiled once.
fn report_validator() -> &'static tracegate_schema_check::Schema {
    common::validator("gate-report.schema.json")
}

#[test]
fn the_report_validator_refuses_what_the_schema_does_not_describe() {
    // The negative control of the validation in `finished`: it is not accept-all, and it follows
    // the reference into the diff report's schema.
    assert!(!report_validator().is_valid(&serde_json::json!({})));
    assert!(!report_validator().is_valid(&serde_json::json!({"schema": "tracegate-gate-report/3"})));
    let v = &report_validator();
    let bad_violation = serde_json::json!({"tensor": "x", "dtype": "f32", "candidate_dtype": "f32", "ulp_dtype": "f32", "shape": [1],
        "rule": null, "violations": [{"bound": "max_l2", "limit": 1, "value": 2}], "worst_element": null});
    let prompt = |fv: Value| {
        serde_json::json!({"id": "p", "tokens": 1, "runs": [], "digests": {}, "checks": [], "counts": null,
        "generated": {"engine_cached": null, "engine_uncached": null, "contract": null, "oracle": null},
        "oracle": {"smallest_margin": null, "smallest_margin_at": null, "worst_max_rel": null, "worst_max_rel_tensor": null,
                   "worst_rel_l2": null, "worst_rel_l2_tensor": null, "near_ties": [], "rows_after_near_tie": 0, "first_violation": fv}})
    };
    let report = |fv: Value| {
        serde_json::json!({"schema": "tracegate-gate-report/3", "milestone": "m0", "claim": "", "model": "", "family": "",
        "prompt_file": "", "prompt_sha256": "0".repeat(64), "generate": 1, "threads": 1, "timeout_s": 1, "policy": "", "gate_invocation": [],
        "stack": {}, "prompts": [prompt(fv)], "baselines": [], "baselines_not_selected": [], "totals": {},
        "wall_s": {"setup": 0.0, "producers": 0.0, "judge": 0.0, "total": 0.0}, "verdict": "FAIL"})
    };
    assert!(
        v.is_valid(&report(Value::Null)),
        "{:?}",
        v.errors(&report(Value::Null))
    );
    assert!(!v.is_valid(&report(bad_violation)));
}

/// `gate m0` on tiny-qwen3, prompt `only`, with `more` arguments, torch blocked: the oracle is
/// unavailable unless `more` names an `--oracle-cmd`.
fn m0_tiny(only: &str, more: &[&str]) -> Run {
    m0_tiny_by(gate, only, more)
}

/// [`m0_tiny`] under the watchdog of [`gate_watched`].
fn m0_tiny_watched(only: &str, more: &[&str]) -> Run {
    m0_tiny_by(gate_watched, only, more)
}

/// [`gate`] or [`gate_watched`].
type Runner = fn(&Path, &[&str], &[(&str, &Path)]) -> Run;

fn m0_tiny_by(run: Runner, only: &str, more: &[&str]) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let args = run_args("m0", "fixtures/tiny-qwen3", only, more);
    run(&repo(), &args, &[("TRACEGATE_ORACLE_PYTHON", &torchless)])
}

/// The arguments of `gate MILESTONE --model MODEL --only ONLY`, then `more`.
fn run_args<'a>(
    milestone: &'a str,
    model: &'a str,
    only: &'a str,
    more: &[&'a str],
) -> Vec<&'a str> {
    [&[milestone, "--model", model, "--only", only], more].concat()
}

fn check<'a>(report: &'a Value, prompt: &str, name: &str) -> &'a Value {
    report["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == prompt)
        .unwrap()["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["check"] == name)
        .unwrap_or_else(|| panic!("no check {name} for {prompt}"))
}

#[test]
fn passes_as_bundled_and_records_invocations() {
    let root = repo();
    let r = gate(&root, &["check"], &[]);
    assert_eq!(r.code, 0, "gate check failed:\n{}\n{}", r.stdout, r.stderr);
    for m in ["m0", "m1", "dg0", "m2"] {
        let line = r
            .stdout
            .lines()
            .find(|l| l.starts_with(m) && l.contains("stable:"))
            .unwrap();
        assert!(
            line.contains("stable: PASS")
                && line.contains("matches: PASS")
                && line.contains("agrees: PASS"),
            "{line}"
        );
    }
    let reports = r.report.unwrap();
    // One report per model of every milestone, in milestones.json's order.
    let models: Vec<(&str, &str)> = reports
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["milestone"].as_str().unwrap(),
                r["model"].as_str().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        models,
        [
            ("m0", "fixtures/tiny-qwen3"),
            ("m0", "fixtures/tiny-qwen3_5"),
            ("m0", "fixtures/tiny-llama"),
            ("m0", "fixtures/tiny-qwen2"),
            ("m0", "fixtures/tiny-gemma3"),
            ("m1", "fixtures/tiny-qwen3-moe"),
            ("m1", "fixtures/tiny-qwen3_5-moe"),
            ("dg0", "fixtures/tiny-diffusion-gemma"),
            // m2: one report per split (tp=2, ep=2 of the MoE fixture; tp=2 of the dense one).
            ("m2", "fixtures/tiny-qwen3-moe"),
            ("m2", "fixtures/tiny-qwen3-moe"),
            ("m2", "fixtures/tiny-qwen3")
        ]
    );
    // m2 runs two of the five frozen prompts (its `prompts.only`).
    assert!(reports
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["verdict"] == "PASS"
            && r["prompts"].as_array().unwrap().len()
                == if r["milestone"] == "m2" { 2 } else { 5 }));
    let m1 = reports
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["milestone"] == "m1")
        .unwrap();
    assert_eq!(m1["verdict"], "PASS");
    assert_eq!(m1["prompts"].as_array().unwrap().len(), 5);
    let runs = m1["prompts"][0]["runs"].as_array().unwrap();
    let invocations: Vec<&str> = runs
        .iter()
        .map(|r| r["invocation"].as_str().unwrap())
        .collect();
    assert!(
        invocations[0].starts_with("engine trace --model fixtures/tiny-qwen3-moe --tokens "),
        "{invocations:?}"
    );
    assert!(
        invocations
            .iter()
            .any(|i| i.contains("-m tracegate_contract trace")),
        "{invocations:?}"
    );
    assert!(
        invocations
            .iter()
            .any(|i| i.contains("-m tracegate_oracle trace")),
        "{invocations:?}"
    );
    assert_eq!(m1["prompt_sha256"].as_str().unwrap().len(), 64);
    assert!(m1["stack"]["oracle_stack"]["torch"].is_string());
    assert!(runs
        .iter()
        .all(|r| r["seconds"].as_f64().unwrap() > 0.0 && r["peak_rss_kib"].as_u64().unwrap() > 0));
}

#[test]
fn a_perturbed_fixture_weight_fails_stable() {
    let root = scratch_root();
    // A high exponent bit of the first bf16 weight.
    flip_weight_bits(
        &root
            .path()
            .join("fixtures/tiny-qwen3-moe/model.safetensors"),
        "model.layers.1.self_attn.o_proj.weight",
        1,
        0x20,
    );
    let torchless = torchless_python(root.path());
    let r = gate(
        root.path(),
        &run_args("m1", "fixtures/tiny-qwen3-moe", "mid", &[]),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let stable = check(&rep, "mid", "stable");
    assert_eq!(stable["status"], "FAIL");
    assert_eq!(stable["findings"][0]["kind"], "digest_changed");
    // Engine and contract read the same (perturbed) weights, so they still match each other.
    assert_eq!(check(&rep, "mid", "matches")["status"], "PASS");
}

#[test]
fn a_contract_one_ulp_off_fails_matches_at_that_tensor() {
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let template = test_producer(
        "planted_trace.py",
        "--base contract --nudge layer.01.mlp_out",
    );
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--contract-cmd", &template],
        ),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let matches = check(&rep, "short", "matches");
    assert_eq!(matches["status"], "FAIL");
    let f = matches["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "tensor_differs")
        .expect("a tensor_differs finding");
    assert_eq!(f["name"], "layer.01.mlp_out");
    assert_eq!(f["count"], 1);
    assert!(f["detail"].as_str().unwrap().contains("1 ULP"), "{f}");
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
    assert!(rep["prompts"][0]["runs"][2]["invocation"]
        .as_str()
        .unwrap()
        .contains("planted_trace.py --base contract --nudge layer.01.mlp_out trace --model"));
}

#[test]
fn a_crashing_producer_is_a_failed_row_with_its_stderr() {
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let template = format!("'{}' -c \"import sys; sys.stderr.write('contract exploded\\n'); sys.exit(3)\" {{verb}} {{args}}", python().display());
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short,repeat",
            &["--contract-cmd", &template],
        ),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    assert_eq!(
        rep["prompts"].as_array().unwrap().len(),
        2,
        "a crashed producer must not drop the row"
    );
    for p in ["short", "repeat"] {
        let m = check(&rep, p, "matches");
        assert_eq!(m["status"], "FAIL");
        let detail = m["detail"].as_str().unwrap();
        assert!(
            detail.contains("contract exploded") && detail.contains("exit status 3"),
            "{detail}"
        );
    }
    assert!(r.stdout.contains("contract crashed"), "{}", r.stdout);
}

#[test]
fn an_edited_prompt_file_is_refused_unless_blessed() {
    let root = scratch_root();
    let prompts = root.path().join("fixtures/prompts/frozen.json");
    let text = std::fs::read_to_string(&prompts)
        .unwrap()
        .replacen("[7, 7, 7,", "[7, 7, 8,", 1);
    std::fs::write(&prompts, text).unwrap();
    let r = gate(
        root.path(),
        &run_args("m1", "fixtures/tiny-qwen3-moe", "short", &[]),
        &[],
    );
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("differs from milestone m1's record") && r.stderr.contains("--bless"),
        "{}",
        r.stderr
    );
    assert!(r.report.is_none(), "a refused run writes no report");
    // --prompts PATH is held to the same record.
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--prompts", prompts.to_str().unwrap()],
        ),
        &[],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
}

#[test]
fn an_unknown_only_id_is_refused() {
    let r = gate(
        &repo(),
        &run_args("m1", "fixtures/tiny-qwen3-moe", "short,nosuch", &[]),
        &[],
    );
    assert_eq!(r.code, 2);
    assert!(
        r.stderr.contains("unknown prompt id \"nosuch\"")
            && r.stderr.contains("known: short, repeat"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_misspelt_prompt_set_lists_the_named_sets() {
    let r = gate(
        &repo(),
        &[
            "m1",
            "--model",
            "fixtures/tiny-qwen3-moe",
            "--prompts",
            "frozn",
        ],
        &[],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains("frozn.json") && r.stderr.contains("the named prompt sets are frozen"),
        "{}",
        r.stderr
    );
}

#[test]
fn an_unavailable_oracle_is_not_checked_not_passed() {
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let r = gate(
        &repo(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &[]),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(
        r.code, 4,
        "nothing failed but the oracle was not checked:\n{}\n{}",
        r.stdout, r.stderr
    );
    let rep = r.report.unwrap();
    assert_eq!(rep["verdict"], "INCOMPLETE");
    for name in ["agrees", "generation_oracle"] {
        let c = check(&rep, "short", name);
        assert_eq!(c["status"], "NOT CHECKED");
        assert!(
            c["detail"]
                .as_str()
                .unwrap()
                .contains("torch is blocked for this test"),
            "{c}"
        );
    }
    assert_eq!(check(&rep, "short", "matches")["status"], "PASS");
}

#[test]
fn bless_records_expectations_and_baselines_that_then_pass() {
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    // Forget m0's expectations and all baselines.
    let ms_path = root.path().join("milestones.json");
    let mut ms: Value = serde_json::from_str(&std::fs::read_to_string(&ms_path).unwrap()).unwrap();
    ms["milestones"][0]["models"][0]["expect"] = serde_json::json!({});
    std::fs::write(&ms_path, serde_json::to_string(&ms).unwrap()).unwrap();
    std::fs::write(
        root.path().join("baselines.json"),
        r#"{"schema": 1, "baselines": []}"#,
    )
    .unwrap();
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];

    let r = gate(
        root.path(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &[]),
        &env,
    );
    assert_eq!(r.code, 1, "zero checked baselines must fail:\n{}", r.stdout);
    let rep = r.report.unwrap();
    assert_eq!(check(&rep, "short", "stable")["status"], "NOT CHECKED");
    assert!(rep["baselines"]
        .as_array()
        .unwrap()
        .iter()
        .any(|b| b["status"] == "FAIL"
            && b["detail"]
                .as_str()
                .unwrap()
                .contains("zero checked baselines")));

    let r = gate(
        root.path(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &["--bless"]),
        &env,
    );
    assert!(
        r.stdout.contains("m0 tiny-qwen3/short: new expectation")
            && r.stdout.contains("baseline m0.tiny-qwen3.short.t1.g8: new"),
        "{}",
        r.stdout
    );

    let r = gate(
        root.path(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &[]),
        &env,
    );
    assert_eq!(r.code, 4, "only the oracle is unchecked now:\n{}", r.stdout);
    let rep = r.report.unwrap();
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
    assert_eq!(rep["baselines"][0]["status"], "PASS");

    // A baseline whose conditions do not hold is NOT CHECKED with its reason.
    let r = gate(
        root.path(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &["--threads", "2"]),
        &env,
    );
    let rep = r.report.unwrap();
    let b = &rep["baselines"][0];
    assert_eq!(b["status"], "NOT CHECKED");
    assert!(
        b["detail"]
            .as_str()
            .unwrap()
            .contains("requires threads=1, this run has threads=2"),
        "{b}"
    );
    // The stable digest does not depend on the thread count.
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
}

#[test]
fn blessing_a_failing_run_records_no_state_that_passes() {
    // A contract one ULP off at layer.01.mlp_out, blessed: the next run still fails matches,
    // because bit-identity with the contract is required, not recorded.
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let template = test_producer(
        "planted_trace.py",
        "--base contract --nudge layer.01.mlp_out",
    );
    let args = run_args(
        "m1",
        "fixtures/tiny-qwen3_5-moe",
        "short",
        &["--contract-cmd", template.as_str()],
    );
    let blessed = gate(root.path(), &[&args[..], &["--bless"]].concat(), &env);
    assert_eq!(blessed.code, 1, "{}\n{}", blessed.stdout, blessed.stderr);
    assert_eq!(
        check(blessed.report.as_ref().unwrap(), "short", "matches")["status"],
        "FAIL"
    );
    let r = gate(root.path(), &args, &env);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let matches = check(&rep, "short", "matches");
    assert_eq!(matches["status"], "FAIL", "{matches}");
    assert!(
        findings(matches)
            .iter()
            .any(|(kind, name, _)| kind == "tensor_differs" && name == "layer.01.mlp_out"),
        "{matches}"
    );
    // The engine is unchanged: its digest, recorded again, still holds.
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
}

#[test]
fn a_changed_count_fails_the_baseline() {
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    let bl_path = root.path().join("baselines.json");
    let mut bl: Value = serde_json::from_str(&std::fs::read_to_string(&bl_path).unwrap()).unwrap();
    let b = bl["baselines"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|b| b["id"] == "m1.tiny-qwen3-moe.short.t1.g8")
        .unwrap();
    let old = b["counts"]["tokens_generated"].as_u64().unwrap();
    b["counts"]["tokens_generated"] = serde_json::json!(old + 1);
    std::fs::write(&bl_path, serde_json::to_string(&bl).unwrap()).unwrap();
    let r = gate(
        root.path(),
        &run_args("m1", "fixtures/tiny-qwen3-moe", "short", &[]),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1);
    let rep = r.report.unwrap();
    let b = rep["baselines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["check"] == "baseline m1.tiny-qwen3-moe.short.t1.g8")
        .unwrap();
    assert_eq!(b["status"], "FAIL");
    assert_eq!(b["findings"][0]["name"], "tokens_generated");
}

#[test]
fn a_second_run_on_a_locked_trace_directory_is_refused() {
    use std::os::fd::AsRawFd;
    let work = tempfile::tempdir().unwrap();
    let work_arg = work.path().to_str().unwrap();
    std::fs::create_dir_all(work.path().join("m1")).unwrap();
    let held = std::fs::File::create(work.path().join("m1/.lock")).unwrap();
    // SAFETY: flock on a descriptor this test owns.
    assert_eq!(
        unsafe { libc::flock(held.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) },
        0
    );
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--work", work_arg],
        ),
        &env,
    );
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("is in use by another gate run") && r.stderr.contains("--work DIR"),
        "{}",
        r.stderr
    );
    assert!(
        !work.path().join("m1/tiny-qwen3-moe/short").exists(),
        "a refused run must not touch the traces"
    );
    drop(held);
    // Released (as the kernel does when the holder exits): the same directory runs.
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--work", work_arg],
        ),
        &env,
    );
    assert_eq!(r.code, 4, "{}\n{}", r.stdout, r.stderr);
    assert!(work
        .path()
        .join("m1/tiny-qwen3-moe/short/engine.trace")
        .is_file());
}

#[test]
fn a_declared_divergence_excuses_exactly_the_count_it_names() {
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let template = test_producer(
        "planted_trace.py",
        "--base contract --nudge layer.01.mlp_out",
    );
    let ms_path = root.path().join("milestones.json");
    let declare = |count: u64| {
        let mut ms: Value =
            serde_json::from_str(&std::fs::read_to_string(&ms_path).unwrap()).unwrap();
        ms["milestones"][1]["models"][0]["declared_divergences"] = serde_json::json!([{
            "prompt": "short", "check": "matches", "kind": "tensor_differs", "name": "layer.01.mlp_out",
            "count": count, "reason": "test: a one-element nudge"
        }]);
        ms["milestones"][1]["models"][0]["expect"]["short"]["differing_elements"] =
            serde_json::json!(1);
        std::fs::write(&ms_path, serde_json::to_string(&ms).unwrap()).unwrap();
    };
    let run = || {
        gate(
            root.path(),
            &run_args(
                "m1",
                "fixtures/tiny-qwen3-moe",
                "short",
                &["--contract-cmd", &template],
            ),
            &env,
        )
        .report
        .unwrap()
    };

    declare(1);
    let rep = run();
    let m = check(&rep, "short", "matches");
    assert_eq!(m["status"], "PASS", "{m}");
    assert_eq!(m["excused"].as_array().unwrap().len(), 1, "{m}");
    assert_eq!(m["excused"][0]["count"], 1);

    // The same tensor with another count is a different divergence: not excused.
    declare(2);
    let rep = run();
    let m = check(&rep, "short", "matches");
    assert_eq!(m["status"], "FAIL", "{m}");
    assert_eq!(m["findings"][0]["kind"], "tensor_differs");
    assert!(m["excused"].as_array().unwrap().is_empty(), "{m}");
}

#[test]
fn another_generate_count_is_not_checked_against_expectations_and_gets_its_own_baseline() {
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--generate", "3"],
        ),
        &env,
    );
    let rep = r.report.unwrap();
    let stable = check(&rep, "short", "stable");
    assert_eq!(stable["status"], "NOT CHECKED");
    assert!(
        stable["detail"]
            .as_str()
            .unwrap()
            .contains("recorded for --generate 8, this run generates 3"),
        "{stable}"
    );
    // Bit-identity and path independence are still checked at any N.
    assert_eq!(check(&rep, "short", "matches")["status"], "PASS");
    let g = check(&rep, "short", "generation");
    assert_eq!(g["status"], "PASS");
    assert!(g["detail"].as_str().unwrap().starts_with("3 tokens"), "{g}");

    // No baseline exists for N=3: the N=8 ones are NOT CHECKED, each naming its condition, and
    // the run is INCOMPLETE (exit 4), not a failure; --bless records one and leaves the N=8
    // expectations alone.
    assert_eq!(rep["verdict"], "INCOMPLETE", "{}", r.stdout);
    let b = rep["baselines"].as_array().unwrap();
    assert!(b.iter().all(|b| b["status"] == "NOT CHECKED"), "{b:?}");
    assert!(
        b.iter().any(|b| b["detail"]
            .as_str()
            .unwrap()
            .contains("applies to this run's conditions")),
        "{b:?}"
    );
    let root = scratch_root();
    let before = std::fs::read_to_string(root.path().join("milestones.json")).unwrap();
    let r = gate(
        root.path(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--generate", "3", "--bless"],
        ),
        &env,
    );
    assert!(
        r.stdout
            .contains("expectations left as recorded for --generate 8")
            && r.stdout
                .contains("baseline m1.tiny-qwen3-moe.short.t1.g3: new"),
        "{}",
        r.stdout
    );
    assert_eq!(
        std::fs::read_to_string(root.path().join("milestones.json")).unwrap(),
        before
    );
    let r = gate(
        root.path(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--generate", "3"],
        ),
        &env,
    );
    let rep = r.report.unwrap();
    let b = rep["baselines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["check"] == "baseline m1.tiny-qwen3-moe.short.t1.g3")
        .unwrap();
    assert_eq!(b["status"], "PASS", "{b}");
}

#[test]
fn the_milestones_own_checkpoint_named_by_model_keeps_its_baselines() {
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let model = repo().join("fixtures/tiny-qwen3-moe");
    let r = gate(
        &repo(),
        &["m1", "--only", "short", "--model", model.to_str().unwrap()],
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 4, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    assert_eq!(rep["model"], "fixtures/tiny-qwen3-moe");
    let b = rep["baselines"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["check"] == "baseline m1.tiny-qwen3-moe.short.t1.g8")
        .unwrap();
    assert_eq!(b["status"], "PASS", "{b}");
}

#[test]
fn bad_command_templates_and_thread_counts_are_refused_before_any_run() {
    for (template, why) in [
        ("'unterminated {verb} {args}", "unterminated ' quote"),
        ("python x.py", "no {verb}"),
        ("", "empty"),
        ("x {verb} --a={args}", "{args} must be a word of its own"),
    ] {
        let r = gate(
            &repo(),
            &run_args(
                "m1",
                "fixtures/tiny-qwen3-moe",
                "short",
                &["--contract-cmd", template],
            ),
            &[],
        );
        assert_eq!(r.code, 2, "{template}: {}", r.stderr);
        assert!(
            r.stderr.contains(why) && r.report.is_none(),
            "{template}: {}",
            r.stderr
        );
    }
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--threads", "0"],
        ),
        &[],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(r.stderr.contains("at least 1"), "{}", r.stderr);
}

#[test]
fn assert_observed_fails_a_baseline_outside_its_tolerance() {
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let bl_path = root.path().join("baselines.json");
    let mut bl: Value = serde_json::from_str(&std::fs::read_to_string(&bl_path).unwrap()).unwrap();
    let b = bl["baselines"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|b| b["id"] == "m1.tiny-qwen3-moe.short.t1.g8")
        .unwrap();
    // Only one observation, a recorded engine time of one nanosecond: any real run is millions
    // of percent slower, so the outcome does not depend on how loaded the machine is.
    b["observed"] = serde_json::json!({"engine_seconds": 1e-9});
    std::fs::write(&bl_path, serde_json::to_string(&bl).unwrap()).unwrap();
    let baseline = |args: &[&str]| {
        let rep = gate(root.path(), args, &env).report.unwrap();
        rep["baselines"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["check"] == "baseline m1.tiny-qwen3-moe.short.t1.g8")
            .unwrap()
            .clone()
    };
    // Observed figures are reported, not asserted, unless asked.
    assert_eq!(
        baseline(&run_args("m1", "fixtures/tiny-qwen3-moe", "short", &[]))["status"],
        "PASS"
    );
    let b = baseline(&run_args(
        "m1",
        "fixtures/tiny-qwen3-moe",
        "short",
        &["--assert-observed", "0.5"],
    ));
    assert_eq!(b["status"], "FAIL", "{b}");
    assert_eq!(b["findings"].as_array().unwrap().len(), 1, "{b}");
    assert_eq!(
        (
            b["findings"][0]["kind"].as_str(),
            b["findings"][0]["name"].as_str()
        ),
        (Some("observed_out_of_tolerance"), Some("engine_seconds"))
    );
}

#[test]
fn gate_check_exits_1_when_a_milestone_fails() {
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    // An exponent bit of the first f32 weight.
    flip_weight_bits(
        &root.path().join("fixtures/tiny-qwen3/model.safetensors"),
        "model.layers.0.mlp.down_proj.weight",
        3,
        0x10,
    );
    let r = gate(
        root.path(),
        &["check", "--only", "short"],
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let m0 = r
        .stdout
        .lines()
        .find(|l| l.starts_with("m0") && l.contains("stable:"))
        .unwrap();
    assert!(
        m0.contains("stable: FAIL") && m0.contains("matches: PASS"),
        "{m0}"
    );
    let m1 = r
        .stdout
        .lines()
        .find(|l| l.starts_with("m1") && l.contains("stable:"))
        .unwrap();
    assert!(m1.contains("stable: PASS"), "{m1}");
}

/// A producer template that runs tests/producers/NAME with these leading arguments.
fn test_producer(name: &str, args: &str) -> String {
    format!(
        "'{}' '{}' {args} {{verb}} {{args}}",
        python().display(),
        repo().join("gate/tests/producers").join(name).display()
    )
}

fn findings(check: &Value) -> Vec<(String, String, u64)> {
    check["findings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (
                f["kind"].as_str().unwrap().to_string(),
                f["name"].as_str().unwrap().to_string(),
                f["count"].as_u64().unwrap(),
            )
        })
        .collect()
}

// Negative controls of the oracle's checks. The oracle's place is taken by the contract (bit-equal
// to the engine, and fast) with one planted defect: the checks judge whatever trace the oracle
// command wrote, so each planted defect must be the one finding.

#[test]
fn an_oracle_tensor_outside_the_policy_fails_agrees() {
    // A 1-ULP nudge (noise within the policy) in an earlier tensor than the defect: the failure
    // must be named by the first violation, not by the first bit difference.
    let oracle = test_producer(
        "planted_trace.py",
        "--base contract --nudge layer.00.attn_out --push layer.01.mlp_out",
    );
    let r = m0_tiny("short", &["--oracle-cmd", &oracle]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let agrees = check(&rep, "short", "agrees");
    assert_eq!(agrees["status"], "FAIL", "{agrees}");
    assert_eq!(
        findings(agrees),
        [(
            "outside_policy".to_string(),
            "layer.01.mlp_out".to_string(),
            1
        )],
        "{agrees}"
    );
    let detail = agrees["detail"].as_str().unwrap();
    assert!(
        detail.contains("; 1 tensor(s) outside the policy, first layer.01.mlp_out: relative L2 "),
        "{detail}"
    );
    assert!(
        !detail.contains("layer.00.attn_out"),
        "the noise is not the failure: {detail}"
    );
    // The planted element (flat 0 = [0,0]) is the worst, moved to 1000 * (|x| + 1) in f32.
    let v = &rep["prompts"][0]["oracle"]["first_violation"];
    assert_eq!(
        (v["tensor"].as_str(), &v["rule"]["pattern"]),
        (
            Some("layer.01.mlp_out"),
            &serde_json::json!("layer.*.mlp_out")
        ),
        "{v}"
    );
    assert_eq!(v["violations"][0]["bound"], "max_rel_l2", "{v}");
    assert!(
        v["violations"][0]["value"].as_f64().unwrap()
            > v["violations"][0]["limit"].as_f64().unwrap(),
        "{v}"
    );
    let w = &v["worst_element"];
    assert_eq!(
        (w["flat_index"].as_u64(), &w["coords"]),
        (Some(0), &serde_json::json!([0, 0])),
        "{v}"
    );
    let bits =
        |k: &str| u32::from_str_radix(w[k].as_str().unwrap().trim_start_matches("0x"), 16).unwrap();
    let pushed = 1000f32 * (f32::from_bits(bits("reference_bits")).abs() + 1f32);
    assert_eq!(bits("candidate_bits"), pushed.to_bits(), "{w}");
    let finding = &agrees["findings"][0]["detail"];
    assert!(
        finding
            .as_str()
            .unwrap()
            .contains("(rule #3 layer.*.mlp_out); worst at [0,0]: "),
        "{finding}"
    );
    for other in ["stable", "matches", "generation", "generation_oracle"] {
        assert_eq!(check(&rep, "short", other)["status"], "PASS", "{other}");
    }
}

#[test]
fn an_oracle_decode_token_flip_fails_generation_oracle() {
    let oracle = test_producer(
        "planted_trace.py",
        "--base contract --flip decode.0003.argmax",
    );
    let r = m0_tiny("short", &["--oracle-cmd", &oracle]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let g = check(&rep, "short", "generation_oracle");
    assert_eq!(g["status"], "FAIL", "{g}");
    assert_eq!(
        findings(g),
        [("tokens_differ".to_string(), "oracle".to_string(), 1)],
        "{g}"
    );
    // The flipped decision is also a decision that differs under `agrees`.
    let agrees = findings(check(&rep, "short", "agrees"));
    assert!(
        agrees.contains(&(
            "decision_differs".to_string(),
            "decode.0003.argmax".to_string(),
            1
        )),
        "{agrees:?}"
    );
    assert_eq!(check(&rep, "short", "generation")["status"], "PASS");
}

/// `gate m0` on tiny-qwen3, prompt edge64, with `planted_trace.py EDITS` as the oracle (no torch).
fn m0_edge64_with_planted_oracle(edits: &str) -> Run {
    let oracle = test_producer("planted_trace.py", edits);
    m0_tiny("edge64", &["--oracle-cmd", &oracle])
}

#[test]
fn attack_a_flip_manufactured_across_more_than_honest_noise_is_no_near_tie() {
    // edge64's smallest engine margin (logits row 10, ~8.7e-3) flipped by a logit moved by 1.5
    // times it, well within the policy's relative L2: the candidate's own difference would have
    // sized its excuse (gap <= 2·d). Honest f32 noise in logits is 1e-3 per element
    // (near_tie.noise_abs, measured on SmolLM2 and the fixtures): a gap of 8.7e-3 cannot come
    // from it, so the flip is a defect. Row 0 flipped with its logits untouched: a defect too.
    let run = m0_edge64_with_planted_oracle;
    let r = run("--base contract --near-tie 10 --flip logits.argmax");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let agrees = check(&rep, "edge64", "agrees");
    // Both rows counted; row 0's margin, left as recorded, contradicts its logits.
    let want = [
        (
            "margin_contradicts_scores".to_string(),
            "logits.argmax".to_string(),
            1,
        ),
        (
            "decision_differs".to_string(),
            "logits.argmax".to_string(),
            2,
        ),
        (
            "count_changed".to_string(),
            "oracle_decisions_differing".to_string(),
            1,
        ),
    ];
    assert_eq!(findings(agrees), want, "{agrees}");
    let contradiction = agrees["findings"][0]["detail"].as_str().unwrap();
    assert!(
        contradiction.contains("in 1 of 64 rows; first at row 0"),
        "{contradiction}"
    );
    let detail = agrees["findings"][1]["detail"].as_str().unwrap();
    assert!(
        detail.contains("row 10 [393]→[290] defect (gap 0.008736 > bound 0.002)"),
        "{detail}"
    );
    // The manufactured flip alone fails too, and nothing is called a near-tie.
    let r = run("--base contract --near-tie 10");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let agrees = check(&rep, "edge64", "agrees");
    assert_eq!(agrees["status"].as_str(), Some("FAIL"), "{agrees}");
    assert!(
        !agrees["detail"].as_str().unwrap().contains("near-tie"),
        "{agrees}"
    );
}

#[test]
fn a_flip_far_below_the_top_beside_a_moved_runner_up_fails_agrees() {
    // The near-tie plant's moved runner-up (1.5 times the row's margin: within the policy), but
    // the candidate's argmax goes to the row's lowest logit. A rule that read the recorded
    // reference margin (~8.7e-3 ≤ 2·d) would excuse it; the scores say it crossed the whole row.
    let r = m0_edge64_with_planted_oracle("--base contract --far-flip 10");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let agrees = check(&rep, "edge64", "agrees");
    assert_eq!(agrees["status"], "FAIL", "{agrees}");
    let f = findings(agrees);
    assert!(
        f.contains(&(
            "decision_differs".to_string(),
            "logits.argmax".to_string(),
            1
        )),
        "{agrees}"
    );
    let detail = agrees["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|x| x["kind"] == "decision_differs")
        .unwrap()["detail"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(
        detail.contains("row 10 ") && detail.contains("defect") && !detail.contains("near-tie"),
        "{detail}"
    );
    assert!(
        agrees["detail"].as_str().unwrap().contains("DIFFERENT"),
        "{agrees}"
    );
}

#[test]
fn a_contract_decode_token_flip_fails_generation() {
    let contract = test_producer(
        "planted_trace.py",
        "--base contract --flip decode.0005.argmax",
    );
    let r = m0_tiny("short", &["--contract-cmd", &contract]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let g = check(&rep, "short", "generation");
    assert_eq!(g["status"], "FAIL", "{g}");
    assert_eq!(
        findings(g),
        [("tokens_differ".to_string(), "contract".to_string(), 1)],
        "{g}"
    );
    // The flipped token's recorded margin is its old one: it contradicts the step's logits.
    let matches = findings(check(&rep, "short", "matches"));
    assert_eq!(
        matches,
        [
            (
                "margin_contradicts_scores".to_string(),
                "decode.0005.argmax".to_string(),
                1
            ),
            (
                "decision_differs".to_string(),
                "decode.0005.argmax".to_string(),
                1
            )
        ]
    );
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
}

// Equal tokens from runs that are not comparable are not a pass: a contract whose trace says
// it ran other weights, an oracle whose trace says it ran another prompt (both passed before).

fn foreign_producer(base: &str, set: &str) -> String {
    test_producer(
        "foreign_provenance.py",
        &format!("--base {base} --set '{set}'"),
    )
}

#[test]
fn a_contract_of_other_weights_fails_generation_not_only_matches() {
    let contract = foreign_producer(
        "contract",
        r#"weights_digest="00112233445566778899aabbccddeeff""#,
    );
    let r = m0_tiny("short", &["--contract-cmd", &contract]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let g = check(&rep, "short", "generation");
    assert_eq!(g["status"], "FAIL", "{g}");
    assert_eq!(
        findings(g),
        [("weights_mismatch".to_string(), "contract".to_string(), 1)],
        "{g}"
    );
    let detail = g["detail"].as_str().unwrap();
    assert!(
        detail.contains("not comparable") && detail.contains("00112233445566778899aabbccddeeff"),
        "{g}"
    );
    assert_eq!(check(&rep, "short", "matches")["status"], "FAIL");
    // The engine's own runs are comparable: stable is unaffected.
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
}

#[test]
fn bidi_characters_from_a_producers_trace_are_escaped_on_the_html_page() {
    // The contract's trace claims a weights digest that hides its text behind a right-to-left
    // override; the refusal quotes it in the findings, which the page shows.
    let dir = tempfile::tempdir().unwrap();
    let contract = foreign_producer(
        "contract",
        r#"weights_digest="\u202eff00\u2066x\u2069\u200f""#,
    );
    let page = dir.path().join("out.html");
    let r = m0_tiny(
        "short",
        &[
            "--contract-cmd",
            &contract,
            "--html",
            page.to_str().unwrap(),
        ],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let html = std::fs::read_to_string(&page).unwrap();
    assert!(
        html.contains("\\u{202e}ff00\\u{2066}x\\u{2069}\\u{200f}"),
        "shown escaped"
    );
    let raw: Vec<char> = html
        .chars()
        .filter(|c| matches!(c, '\u{202e}' | '\u{2066}' | '\u{2069}' | '\u{200f}'))
        .collect();
    assert_eq!(raw, [], "raw bidi characters on the page");
}

#[test]
fn an_oracle_of_another_prompt_fails_generation_oracle() {
    // The oracle's place is taken by the contract, as in the oracle's other negative controls.
    let oracle = foreign_producer("contract", "prompt_tokens=[1,2,3]");
    let r = m0_tiny("short", &["--oracle-cmd", &oracle]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let g = check(&rep, "short", "generation_oracle");
    assert_eq!(g["status"], "FAIL", "{g}");
    assert_eq!(
        findings(g),
        [("prompt_mismatch".to_string(), "oracle".to_string(), 1)],
        "{g}"
    );
    assert_eq!(check(&rep, "short", "agrees")["status"], "FAIL");
    assert_eq!(check(&rep, "short", "generation")["status"], "PASS");
}

#[test]
fn a_hanging_producer_is_killed_at_the_timeout_and_the_run_refused() {
    let contract = test_producer("misbehaving.py", "hang");
    let r = m0_tiny_watched("short", &["--contract-cmd", &contract, "--timeout", "2"]);
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("short: contract trace timed out after 2 s (--timeout) and was killed: $ ")
            && r.stderr.contains("misbehaving.py hang trace --model"),
        "{}",
        r.stderr
    );
}

#[test]
fn an_endless_writer_is_killed_at_the_timeout_too() {
    let contract = test_producer("misbehaving.py", "endless");
    let r = m0_tiny_watched("short", &["--contract-cmd", &contract, "--timeout", "2"]);
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr
            .contains("short: contract trace timed out after 2 s (--timeout)"),
        "{}",
        r.stderr
    );
}

#[test]
fn a_producer_leaving_a_child_that_holds_its_output_does_not_block_the_gate() {
    let work = tempfile::tempdir().unwrap();
    let contract = test_producer("misbehaving.py", "background");
    let r = m0_tiny_watched(
        "short",
        &[
            "--contract-cmd",
            &contract,
            "--work",
            work.path().to_str().unwrap(),
        ],
    );
    assert_eq!(
        r.code, 4,
        "only the oracle is unchecked:\n{}\n{}",
        r.stdout, r.stderr
    );
    let rep = r.report.unwrap();
    assert_eq!(check(&rep, "short", "matches")["status"], "PASS");
    // The leftover sleeper shared the producer's process group, which the gate ends with it.
    let pid = std::fs::read_to_string(
        work.path()
            .join("m0/tiny-qwen3/short/contract.trace.sleeper-pid"),
    )
    .unwrap();
    let stat = format!("/proc/{}/stat", pid.trim());
    let gone = || {
        std::fs::read_to_string(&stat).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
    };
    let mut tries = 0;
    while !gone() && tries < 100 {
        std::thread::sleep(std::time::Duration::from_millis(100));
        tries += 1;
    }
    assert!(
        gone(),
        "the producer's background sleep (pid {pid}) outlived the run"
    );
}

#[test]
fn a_child_that_left_the_producers_group_holding_its_output_does_not_block_the_gate() {
    let work = tempfile::tempdir().unwrap();
    let contract = test_producer("misbehaving.py", "escaped");
    let r = m0_tiny_watched(
        "short",
        &[
            "--contract-cmd",
            &contract,
            "--work",
            work.path().to_str().unwrap(),
        ],
    );
    // The sleeper is out of the gate's reach: this test started it (through the gate), so it ends it.
    let pid = std::fs::read_to_string(
        work.path()
            .join("m0/tiny-qwen3/short/contract.trace.sleeper-pid"),
    )
    .unwrap();
    let pid: libc::pid_t = pid.trim().parse().unwrap();
    // SAFETY: kill on the pid of the sleep this test's producer started.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    assert_eq!(
        r.code, 4,
        "only the oracle is unchecked:\n{}\n{}",
        r.stdout, r.stderr
    );
    assert_eq!(
        check(&r.report.unwrap(), "short", "matches")["status"],
        "PASS"
    );
}

#[test]
fn a_producer_flooding_stderr_is_kept_to_its_head_and_tail() {
    let contract = test_producer("misbehaving.py", "flood");
    let r = m0_tiny_watched("short", &["--contract-cmd", &contract]);
    assert_eq!(r.code, 1, "{}", r.stdout);
    let rep = r.report.unwrap();
    let run = &rep["prompts"][0]["runs"][2];
    assert_eq!(run["producer"], "contract");
    // What misbehaving.py writes: FIRST-LINE\n, 50,000,000 x, \nLAST-LINE\n.
    assert_eq!(run["stderr_bytes"], 11 + 50_000_000 + 11);
    let kept = run["stderr"].as_str().unwrap();
    assert!(
        kept.starts_with("FIRST-LINE\n") && kept.contains("LAST-LINE\n[exit status 1]"),
        "{}…",
        &kept[..200]
    );
    assert!(
        kept.len() < 20_000,
        "{} bytes of stderr kept in the report",
        kept.len()
    );
    let detail = check(&rep, "short", "matches")["detail"].as_str().unwrap();
    assert!(
        detail.contains("FIRST-LINE") && detail.contains("LAST-LINE") && detail.len() < 3_000,
        "{} bytes",
        detail.len()
    );
}

#[test]
fn relative_report_model_and_work_are_taken_from_the_current_directory() {
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    // Started in a directory two levels below the root, without --root.
    let here = tempfile::tempdir_in(repo().join("target")).unwrap();
    let out = common::gate()
        .current_dir(here.path())
        .args([
            "m0",
            "--only",
            "short",
            "--model",
            "../../fixtures/tiny-qwen3",
            "--work",
            "w",
            "--report",
            "r.json",
        ])
        .env("TRACEGATE_PYTHON", python())
        .env("TRACEGATE_ORACLE_PYTHON", &torchless)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    let report = std::fs::canonicalize(here.path()).unwrap().join("r.json");
    assert!(
        stderr.contains(&format!("report written to {}", report.display())),
        "{stderr}"
    );
    let rep: Value = serde_json::from_str(&std::fs::read_to_string(&report).unwrap()).unwrap();
    assert_eq!(rep.as_array().unwrap().len(), 1, "--model runs one model");
    assert_eq!(
        rep[0]["model"], "fixtures/tiny-qwen3",
        "the milestone's own checkpoint, spelled from elsewhere"
    );
    assert!(here
        .path()
        .join("w/m0/tiny-qwen3/short/engine.trace")
        .is_file());
    assert!(!repo().join("r.json").exists() && !repo().join("w").exists());
}

#[test]
fn a_prompt_longer_than_the_models_positions_is_refused_before_any_producer_runs() {
    let work = tempfile::tempdir().unwrap();
    let r = gate(
        &repo(),
        &run_args(
            "m0",
            "fixtures/tiny-qwen3",
            "short",
            &["--generate", "252", "--work", work.path().to_str().unwrap()],
        ),
        &[],
    );
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("prompt \"short\": 5 tokens + 252 generated = 257 positions exceed max_position_embeddings 256 of ")
            && r.stderr.contains("fixtures/tiny-qwen3/config.json"),
        "{}",
        r.stderr
    );
    assert!(!work.path().join("m0").exists(), "no producer may run");
}

#[test]
fn a_generate_count_that_overflows_the_positions_is_refused_before_any_producer_runs() {
    // 5 tokens + u64::MAX wraps to 4 positions in unchecked arithmetic: the producers then ran.
    let huge = u64::MAX.to_string();
    let want = format!(
        "prompt \"short\": 5 tokens + {huge} generated = more than {huge} positions exceed max_position_embeddings 256 of "
    );
    let work = tempfile::tempdir().unwrap();
    let w = work.path().to_str().unwrap();
    let base = run_args("m0", "fixtures/tiny-qwen3", "short", &["--work", w]);
    let r = gate(&repo(), &[&base[..], &["--generate", &huge]].concat(), &[]);
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stderr.contains(&want), "{}", r.stderr);
    assert!(!work.path().join("m0").exists(), "no producer may run");
    // The same count as the milestone's own `generate`, in a hostile milestones.json.
    let root = scratch_root();
    let path = root.path().join("milestones.json");
    let mut ms: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    for m in ms["milestones"].as_array_mut().unwrap() {
        m["generate"] = Value::from(u64::MAX);
    }
    std::fs::write(&path, serde_json::to_string(&ms).unwrap()).unwrap();
    let r = gate(root.path(), &base, &[]);
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(r.stderr.contains(&want), "{}", r.stderr);
    assert!(!work.path().join("m0").exists(), "no producer may run");
}

#[test]
fn a_prompt_longer_than_the_text_configs_positions_is_refused_too() {
    // The multimodal layout keeps the limit under text_config only: read from the top level,
    // the check would silently not run.
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(repo().join("fixtures/tiny-qwen3_5/config.json")).unwrap(),
    )
    .unwrap();
    assert!(config.get("max_position_embeddings").is_none());
    assert_eq!(config["text_config"]["max_position_embeddings"], 256);
    let work = tempfile::tempdir().unwrap();
    // The stack probe fails fast without torch: nothing here needs the oracle.
    let torchless = torchless_python(work.path());
    let args = |generate: &'static str| {
        let w = work.path().to_str().unwrap().to_string();
        gate(
            &repo(),
            &run_args(
                "m0",
                "fixtures/tiny-qwen3_5",
                "short",
                &[
                    "--generate",
                    generate,
                    "--work",
                    &w,
                    "--oracle-cmd",
                    "false {verb}",
                    "--contract-cmd",
                    "false {verb}",
                ],
            ),
            &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
        )
    };
    let r = args("252");
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stderr.contains("prompt \"short\": 5 tokens + 252 generated = 257 positions exceed max_position_embeddings 256 of ")
            && r.stderr.contains("fixtures/tiny-qwen3_5/config.json"),
        "{}",
        r.stderr
    );
    assert!(!work.path().join("m0").exists(), "no producer may run");
    // Control: a prompt that fits is not refused (the producers, here `false`, then fail); the
    // message above names 256, a limit only text_config holds.
    let r = args("3");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
}

#[test]
fn a_model_of_another_family_and_an_old_milestones_schema_are_refused_by_name() {
    let r = gate(
        &repo(),
        &run_args("m0", "fixtures/tiny-qwen3_5-moe", "short", &[]),
        &[],
    );
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr.contains(
            "model_type \"qwen3_5_moe_text\" is not a family of milestone m0 (qwen3, qwen3_5_text, llama, qwen2, gemma3_text)"
        ),
        "{}",
        r.stderr
    );
    let root = scratch_root();
    let path = root.path().join("milestones.json");
    let mut file: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    file["schema"] = 1.into();
    std::fs::write(&path, file.to_string()).unwrap();
    let r = gate(root.path(), &["m0", "--only", "short"], &[]);
    assert_eq!(r.code, 2, "{}", r.stderr);
    assert!(
        r.stderr
            .contains("schema 1 is not supported (this gate reads schema 2"),
        "{}",
        r.stderr
    );
}

#[test]
fn only_short_exits_0_when_every_check_it_ran_passed() {
    // The contract unchanged in the oracle's place, so every check of `short` can pass.
    let oracle = test_producer("planted_trace.py", "--base contract");
    let r = m0_tiny("short", &["--oracle-cmd", &oracle]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    assert_eq!(rep["verdict"], "PASS");
    assert!(
        rep["totals"].get("NOT CHECKED").is_none(),
        "{}",
        rep["totals"]
    );
    let not_selected: Vec<&str> = rep["baselines_not_selected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        not_selected.contains(&"m0.tiny-qwen3.mid.t1.g8")
            && !not_selected.contains(&"m0.tiny-qwen3.short.t1.g8"),
        "{not_selected:?}"
    );
    assert!(
        r.stdout.contains("not selected (--only): baselines "),
        "{}",
        r.stdout
    );
}

// `matches` (engine ≡ contract) compares the whole content: a contract trace whose margins or
// attributes alone were edited fails it with a finding naming what changed (both passed before).

fn matches_with_contract_edit(edit: &str) -> (Run, Value) {
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let contract = test_producer("planted_trace.py", &format!("--base contract {edit}"));
    let r = gate(
        &repo(),
        &run_args(
            "m1",
            "fixtures/tiny-qwen3-moe",
            "short",
            &["--contract-cmd", &contract],
        ),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    let matches = check(
        r.report
            .as_ref()
            .unwrap_or_else(|| panic!("no report:\n{}\n{}", r.stdout, r.stderr)),
        "short",
        "matches",
    )
    .clone();
    (r, matches)
}

fn findings_of<'a>(check: &'a Value, kind: &str) -> Vec<&'a Value> {
    check["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == kind)
        .collect()
}

#[test]
fn margins_set_to_1e6_fail_matches() {
    let (r, matches) = matches_with_contract_edit("--margins 1e6");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(matches["status"], "FAIL", "{matches}");
    let found = findings_of(&matches, "margin_differs");
    // The MoE fixture's every decision has margins; each one is named.
    assert!(
        found.iter().any(|f| f["name"] == "logits.argmax"),
        "{matches}"
    );
    assert!(
        found.iter().any(|f| f["name"] == "layer.00.router.topk"),
        "{matches}"
    );
    assert!(
        found
            .iter()
            .all(|f| f["detail"].as_str().unwrap().contains("1e6")),
        "{matches}"
    );
    // Nothing but margins changed: no tensor differs.
    assert!(
        findings_of(&matches, "tensor_differs").is_empty(),
        "{matches}"
    );
}

#[test]
fn an_extra_attribute_on_logits_fails_matches() {
    let (r, matches) = matches_with_contract_edit("--attr logits");
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert_eq!(matches["status"], "FAIL", "{matches}");
    let found = findings_of(&matches, "attribute_differs");
    assert_eq!(found.len(), 1, "{matches}");
    assert_eq!(found[0]["name"], "logits");
    assert!(
        found[0]["detail"].as_str().unwrap().contains("\"note\""),
        "{matches}"
    );
}

/// A template that runs tests/producers/NAME as a serving producer (`{verb|serve}`).
fn served_test_producer(name: &str, args: &str) -> String {
    format!(
        "'{}' '{}' {args} {{verb|serve}} {{args}}",
        python().display(),
        repo().join("gate/tests/producers").join(name).display()
    )
}

/// Whether process `pid` has ended (gone, or a zombie awaiting its reaper).
fn ended(pid: &str) -> bool {
    let stat = format!("/proc/{}/stat", pid.trim());
    let gone = || {
        std::fs::read_to_string(&stat).map_or(true, |s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| r.trim_start().starts_with('Z'))
        })
    };
    for _ in 0..100 {
        if gone() {
            return true;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    false
}

#[test]
fn served_and_per_call_runs_give_the_same_digests() {
    // One trace directory for both (one after the other), so the invocations can be compared.
    let work = tempfile::tempdir().unwrap();
    let args = run_args(
        "m1",
        "fixtures/tiny-qwen3-moe",
        "short",
        &["--work", work.path().to_str().unwrap()],
    );
    let served = gate(&repo(), &args, &[]);
    let per_call = gate(&repo(), &args, &[("TRACEGATE_SERVE", Path::new("0"))]);
    let (s, p) = (served.report.unwrap(), per_call.report.unwrap());
    let runs = |r: &Value| r["prompts"][0]["runs"].as_array().unwrap().clone();
    // Negative control for the comparison below: the runs really were served, and then not.
    for (i, producer) in [(2, "contract"), (3, "oracle")] {
        assert_eq!(runs(&s)[i]["producer"], producer);
        assert!(
            runs(&s)[i]["served_by"].as_u64().is_some(),
            "{producer} not served: {}",
            runs(&s)[i]
        );
        assert!(
            runs(&p)[i].get("served_by").is_none(),
            "{producer} served under TRACEGATE_SERVE=0"
        );
        // The recorded invocation is the per-call command line either way.
        assert_eq!(runs(&s)[i]["invocation"], runs(&p)[i]["invocation"]);
    }
    let digests = |r: &Value| r["prompts"][0]["digests"].clone();
    assert_eq!(digests(&s).as_object().unwrap().len(), 4, "{}", digests(&s));
    assert_eq!(digests(&s), digests(&p));
    assert_eq!(check(&s, "short", "stable")["status"], "PASS");
}

#[test]
fn a_worker_that_dies_mid_run_fails_that_row_with_its_stderr_and_the_next_request_gets_a_fresh_one()
{
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let work = tempfile::tempdir().unwrap();
    let contract = served_test_producer("serving.py", "crash-second");
    let r = gate_watched(
        &repo(),
        &run_args(
            "m0",
            "fixtures/tiny-qwen3",
            "short,repeat,mid",
            &[
                "--contract-cmd",
                &contract,
                "--work",
                work.path().to_str().unwrap(),
            ],
        ),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let order: Vec<&str> = rep["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["id"].as_str().unwrap())
        .collect();
    let (first, second, third) = (order[0], order[1], order[2]);
    assert_eq!(check(&rep, first, "matches")["status"], "PASS");
    let m = check(&rep, second, "matches");
    assert_eq!(m["status"], "FAIL");
    let detail = m["detail"].as_str().unwrap();
    assert!(
        detail.contains("SECOND-REQUEST-CRASH")
            && detail.contains("ended without answering; exit status 7"),
        "{detail}"
    );
    // A fresh worker answers the third prompt.
    assert_eq!(check(&rep, third, "matches")["status"], "PASS");
    let pid = |p: &str| {
        std::fs::read_to_string(
            work.path()
                .join(format!("m0/tiny-qwen3/{p}/contract.trace.worker-pid")),
        )
        .unwrap()
    };
    assert_eq!(pid(first), pid(second));
    assert_ne!(pid(second), pid(third));
    let runs = |p: &str| {
        rep["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|x| x["id"] == p)
            .unwrap()["runs"][2]
            .clone()
    };
    assert_eq!(
        runs(first)["served_by"].as_u64().unwrap().to_string(),
        pid(first)
    );
    assert_eq!(
        runs(third)["served_by"].as_u64().unwrap().to_string(),
        pid(third)
    );
    assert!(
        ended(&pid(third)),
        "the worker (pid {}) outlived the gate",
        pid(third)
    );
}

#[test]
fn a_worker_that_hangs_is_killed_at_the_timeout_of_that_request() {
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let work = tempfile::tempdir().unwrap();
    let contract = served_test_producer("serving.py", "hang-second");
    let r = gate_watched(
        &repo(),
        &run_args(
            "m0",
            "fixtures/tiny-qwen3",
            "short,repeat",
            &[
                "--contract-cmd",
                &contract,
                "--timeout",
                "10",
                "--work",
                work.path().to_str().unwrap(),
            ],
        ),
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    // The prompt-file order decides which prompt is the worker's second request.
    assert!(
        r.stderr
            .contains(": contract trace timed out after 10 s (--timeout) and was killed: $ ")
            && r.stderr.contains("serving.py hang-second trace --model"),
        "{}",
        r.stderr
    );
    let pid = std::fs::read_to_string(
        work.path()
            .join("m0/tiny-qwen3/repeat/contract.trace.worker-pid"),
    )
    .or_else(|_| {
        std::fs::read_to_string(
            work.path()
                .join("m0/tiny-qwen3/short/contract.trace.worker-pid"),
        )
    })
    .unwrap();
    assert!(ended(&pid), "the hung worker (pid {pid}) outlived the gate");
}

#[test]
fn a_failed_producers_control_sequences_are_shown_never_sent_to_the_terminal() {
    // A contract that fails saying a clear-screen, a window title, a colour and a carriage
    // return: the gate's text, refusals, JSON and JUnit reports and GitHub annotations quote it
    // with those escaped (`\u{1b}`), and so does `gate bisect`.
    let dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(dir.path());
    let script = dir.path().join("hostile.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\nprintf 'HOSTILE \\033[2J\\033]0;pwned\\007 \\033[31mred\\033[0m\\rover\\n' >&2\nexit 3\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let cmd = format!("'{}' {{verb}} {{args}}", script.display());
    let junit = dir.path().join("junit.xml");
    let r = gate(
        &repo(),
        &run_args(
            "m0",
            "fixtures/tiny-qwen3",
            "short",
            &["--contract-cmd", &cmd, "--junit", junit.to_str().unwrap()],
        ),
        &[
            ("TRACEGATE_ORACLE_PYTHON", &torchless),
            ("GITHUB_ACTIONS", Path::new("true")),
        ],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    assert!(
        r.stdout.contains("::error "),
        "no annotations: {}",
        r.stdout
    );
    let shown = "HOSTILE \\u{1b}[2J\\u{1b}]0;pwned\\u{7} \\u{1b}[31mred\\u{1b}[0m\\u{d}over";
    let detail = check(r.report.as_ref().unwrap(), "short", "matches")["detail"]
        .as_str()
        .unwrap()
        .to_string();
    let junit = std::fs::read_to_string(&junit).unwrap();
    for (what, text) in [
        ("stdout", &r.stdout),
        ("stderr", &r.stderr),
        ("report", &detail),
        ("junit", &junit),
    ] {
        assert!(
            !text.contains(['\x1b', '\x07', '\r']),
            "{what} carries the producer's control characters: {text:?}"
        );
    }
    assert!(r.stdout.contains(shown), "{}", r.stdout);
    assert!(detail.contains(shown), "{detail}");
    assert!(junit.contains(shown), "{junit}");

    // gate bisect, the same producer as the candidate: its run fails, quoted as shown.
    let work = tempfile::tempdir_in(repo().join("target")).unwrap();
    let out = common::gate()
        .current_dir(repo())
        .args([
            "bisect",
            "--model",
            "fixtures/tiny-qwen3",
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &cmd,
            "--work",
            work.path().strip_prefix(repo()).unwrap().to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        (stdout.contains(shown) || stderr.contains(shown))
            && !stdout.contains(['\x1b', '\x07', '\r'])
            && !stderr.contains(['\x1b', '\x07', '\r']),
        "{stdout:?}\n{stderr:?}"
    );
}

/// The processes whose command line holds `mark` and that still run (not zombies), from /proc.
fn running_with(mark: &str) -> Vec<(i32, String)> {
    let mut found = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let (Ok(cmd), Ok(stat)) = (
            std::fs::read(format!("/proc/{pid}/cmdline")),
            std::fs::read_to_string(format!("/proc/{pid}/stat")),
        ) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
        if cmd.contains(mark) && !zombie {
            found.push((pid, cmd));
        }
    }
    found
}

#[test]
fn a_runs_own_workers_are_gone_the_moment_the_gate_has_exited() {
    // Residency off (common::gate): the contract is this run's own worker, one that does not
    // leave when its stdin closes and leaves a child in its process group (serving.py
    // slow-leave). Both carry a mark of this test in their command lines.
    let dir = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let mark = dir.path().join("slow-leave-mark").display().to_string();
    let contract = served_test_producer("serving.py", &format!("'slow-leave:{mark}'"));
    let r = m0_tiny_watched(
        "short",
        &[
            "--contract-cmd",
            &contract,
            "--work",
            work.path().to_str().unwrap(),
        ],
    );
    // The moment the gate's process has exited (gate_watched returns then):
    let left = running_with(&mark);
    for (pid, _) in &left {
        // SAFETY: a process this test started (through the gate), found by the test's mark.
        unsafe { libc::kill(*pid, libc::SIGKILL) };
    }
    let rep = r.report.expect("a report");
    let worker = rep["prompts"][0]["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|run| run["producer"] == "contract")
        .and_then(|run| run["served_by"].as_u64());
    assert!(
        worker.is_some(),
        "the contract was not served: {}",
        r.stderr
    );
    assert_eq!(
        check(&rep, "short", "matches")["status"],
        "PASS",
        "{}",
        r.stderr
    );
    assert!(
        left.is_empty(),
        "still running after the gate exited: {left:?}\n{}",
        r.stderr
    );
    assert!(
        r.stderr
            .contains("had not left 3 s after its stdin closed: killed"),
        "{}",
        r.stderr
    );
}

#[test]
fn several_models_end_with_one_line_summing_every_report_and_the_worst_verdict() {
    // A decay defect in a linear-attention layer: tiny-qwen3_5 fails matches, tiny-qwen3,
    // tiny-llama, tiny-qwen2 and tiny-gemma3 (no such layer) do not; the oracle is unavailable,
    // so their reports are INCOMPLETE.
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let defective = test_producer("defective_contract.py", "--defect gdn-decay@2");
    let r = gate(
        &repo(),
        &["m0", "--only", "short", "--contract-cmd", &defective],
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let reps = r.report.unwrap();
    let reps = reps.as_array().unwrap();
    let verdicts: Vec<&str> = reps
        .iter()
        .map(|r| r["verdict"].as_str().unwrap())
        .collect();
    assert_eq!(
        verdicts,
        [
            "INCOMPLETE",
            "FAIL",
            "INCOMPLETE",
            "INCOMPLETE",
            "INCOMPLETE"
        ],
        "{}",
        r.stdout
    );
    let total = |s: &str| -> u64 {
        reps.iter()
            .map(|r| r["totals"][s].as_u64().unwrap_or(0))
            .sum()
    };
    let want = format!(
        "gate m0, 5 models: FAIL — {} PASS, {} FAIL, {} NOT CHECKED",
        total("PASS"),
        total("FAIL"),
        total("NOT CHECKED")
    );
    assert!(total("FAIL") > 0 && total("PASS") > 0, "{}", r.stdout);
    assert_eq!(
        r.stdout.trim_end().lines().last(),
        Some(want.as_str()),
        "{}",
        r.stdout
    );
}

#[test]
fn blessing_one_milestone_moves_every_milestone_sharing_its_prompt_file() {
    // m0 and m1 both record fixtures/prompts/frozen.json. A byte that changes no prompt (a
    // trailing newline) changes its sha256; `gate m0 --bless` accepts it, and m1 must then run,
    // not refuse the file m0 just accepted.
    let root = scratch_root();
    let torchless = torchless_python(root.path());
    let env = [("TRACEGATE_ORACLE_PYTHON", torchless.as_path())];
    let prompts = root.path().join("fixtures/prompts/frozen.json");
    let mut text = std::fs::read_to_string(&prompts).unwrap();
    text.push('\n');
    std::fs::write(&prompts, text).unwrap();
    let m1 = run_args("m1", "fixtures/tiny-qwen3-moe", "short", &[]);
    // The control: before any blessing m1 refuses the changed file.
    let r = gate(root.path(), &m1, &env);
    assert_eq!(r.code, 2, "{}\n{}", r.stdout, r.stderr);
    let r = gate(
        root.path(),
        &run_args("m0", "fixtures/tiny-qwen3", "short", &["--bless"]),
        &env,
    );
    assert!(
        r.stdout.contains("m1: prompts sha256") && r.stdout.contains("shares frozen with m0"),
        "{}\n{}",
        r.stdout,
        r.stderr
    );
    let ms: Value = serde_json::from_str(
        &std::fs::read_to_string(root.path().join("milestones.json")).unwrap(),
    )
    .unwrap();
    let shas: Vec<&str> = ms["milestones"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["prompts"]["sha256"].as_str().unwrap())
        .collect();
    assert!(shas.windows(2).all(|w| w[0] == w[1]), "{shas:?}");
    let r = gate(root.path(), &m1, &env);
    assert_ne!(
        r.code, 2,
        "m1 refused what m0 blessed:\n{}\n{}",
        r.stdout, r.stderr
    );
    let rep = r.report.unwrap();
    assert_eq!(check(&rep, "short", "matches")["status"], "PASS");
}

/// dg0 on one prompt, with `extra` arguments: block diffusion's runs (the engine and the
/// contract with the milestone's seed, the oracle forced by the engine's trace).
fn dg0(extra: &[&str], env: &[(&str, &Path)]) -> Run {
    let mut args = vec!["run", "dg0", "--only", "short"];
    args.extend_from_slice(extra);
    gate(&repo(), &args, env)
}

#[test]
fn dg0_runs_the_oracle_forced_by_the_engines_trace_and_passes() {
    let r = dg0(&[], &[]);
    assert_eq!(r.code, 0, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let runs = rep["prompts"][0]["runs"].as_array().unwrap();
    let invocation = |producer: &str| {
        runs.iter()
            .find(|x| x["producer"] == producer)
            .map(|x| x["invocation"].as_str().unwrap().to_string())
    };
    // Block diffusion has no uncached path: three runs, each with the seed.
    assert_eq!(runs.len(), 3, "{runs:?}");
    for p in ["engine", "contract", "oracle"] {
        let i = invocation(p).unwrap();
        assert!(
            i.contains("--seed 3") && i.contains("--capture internals"),
            "{i}"
        );
    }
    let oracle = invocation("oracle").unwrap();
    assert!(
        oracle.contains("--force-decisions") && oracle.contains("short/engine.trace"),
        "{oracle}"
    );
    for c in [
        "stable",
        "matches",
        "generation",
        "agrees",
        "generation_oracle",
    ] {
        assert_eq!(check(&rep, "short", c)["status"], "PASS", "{c}");
    }
    let generation = check(&rep, "short", "generation")["detail"]
        .as_str()
        .unwrap();
    assert!(generation.contains("14 committed tokens"), "{generation}");
}

#[test]
fn dg0_names_a_contract_that_skips_self_conditioning_at_its_first_step() {
    // Negative control of matches: the contract with the seed's incident planted.
    let torchless_dir = tempfile::tempdir().unwrap();
    let torchless = torchless_python(torchless_dir.path());
    let r = dg0(
        &["--contract-cmd", &common::defective("dg-sc-skip")],
        &[("TRACEGATE_ORACLE_PYTHON", &torchless)],
    );
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let matches = check(&rep, "short", "matches");
    assert_eq!(matches["status"], "FAIL");
    let first = matches["findings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["kind"] == "tensor_differs")
        .expect("a tensor_differs finding");
    assert_eq!(first["name"], "denoise.0000.0000.sc.out", "{first}");
    assert_eq!(check(&rep, "short", "stable")["status"], "PASS");
}

#[test]
fn dg0_fails_an_oracle_whose_mlp_adds_where_it_should_overwrite() {
    // Negative control of agrees: the defective contract stands in for the oracle, and the
    // gate forces it with the engine's trace as it forces transformers; the forcing keeps the
    // canvases equal, so the numbers name the defect.
    let r = dg0(&["--oracle-cmd", &common::defective("dg-mlp-add")], &[]);
    assert_eq!(r.code, 1, "{}\n{}", r.stdout, r.stderr);
    let rep = r.report.unwrap();
    let agrees = check(&rep, "short", "agrees");
    assert_eq!(agrees["status"], "FAIL");
    let detail = agrees["detail"].as_str().unwrap();
    // Under internals the MLP's own output is captured: the first point outside the policy.
    assert!(
        detail.contains("outside the policy, first layer.00.dense_mlp.out"),
        "{detail}"
    );
    // The unplanted contract as the oracle agrees (bit for bit, forced by the engine).
    let clean = dg0(&["--oracle-cmd", &common::defective("none")], &[]);
    assert_eq!(
        check(clean.report.as_ref().unwrap(), "short", "agrees")["status"],
        "PASS",
        "{}",
        clean.stdout
    );
}
