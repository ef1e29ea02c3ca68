//! Repro capsules (docs/bisect.md, "Capsules"): `gate bisect --capsule DIR` on a planted defect
//! writes a capsule that `gate capsule run` replays with nothing else, to the bisection's own
//! verdict, stage and numbers; the capsule fails for the defective candidate and passes for a
//! correct one (the engine), and so does its generated pytest file; minimised, it keeps fewer
//! rows and still fails, re-run; a clean bisection writes none; a changed file is refused.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

use crate::common::{self, defective, repo};

fn example_producer() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_gate")).with_file_name("example-producer")
}

fn engine() -> PathBuf {
    Path::new(env!("CARGO_BIN_EXE_gate")).with_file_name("engine")
}

/// `gate bisect` on tiny-qwen3, prompt short, with `candidate` and `extra`; its work dir, report
/// and (maybe) capsule under `tmp`. Returns (exit code, stdout, report).
fn bisect(tmp: &Path, reference: &str, candidate: &[&str], extra: &[&str]) -> (i32, String, Value) {
    let root = repo();
    let work = tmp.join("work");
    let report = tmp.join("report.json");
    let out = common::gate()
        .current_dir(&root)
        .args([
            "--root",
            root.to_str().unwrap(),
            "bisect",
            "--model",
            "fixtures/tiny-qwen3",
        ])
        .args([
            "--prompt",
            "short",
            "--reference",
            reference,
            "--capture",
            "internals",
        ])
        .args([
            "--work",
            work.to_str().unwrap(),
            "--report",
            report.to_str().unwrap(),
        ])
        .args(candidate)
        .args(extra)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let report: Value = serde_json::from_slice(&std::fs::read(&report).unwrap_or_default())
        .unwrap_or_else(|e| panic!("no report ({e}): {stdout}\n{stderr}"));
    (out.status.code().unwrap_or(-1), stdout, report)
}

/// `gate capsule run DIR` with `candidate`, run from a directory that is not the root; returns
/// (exit code, stdout + stderr, its JSON report or Null).
fn capsule_run(tmp: &Path, dir: &Path, candidate: &[&str]) -> (i32, String, Value) {
    let report = tmp.join("capsule-run.json");
    let _ = std::fs::remove_file(&report);
    let out = common::gate()
        .current_dir(tmp)
        .args([
            "--root",
            repo().to_str().unwrap(),
            "capsule",
            "run",
            dir.to_str().unwrap(),
        ])
        .args(["--work", tmp.join("replay").to_str().unwrap()])
        .args(["--report", report.to_str().unwrap()])
        .args(candidate)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let report = std::fs::read(&report)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    (out.status.code().unwrap_or(-1), text, report)
}

fn pytest(dir: &Path, candidate: Option<&str>) -> (i32, String) {
    let root = repo().canonicalize().unwrap();
    let path = ["contract", "oracle", "trace/python/python"]
        .map(|p| root.join(p).display().to_string())
        .join(":");
    let mut cmd = Command::new(common::python());
    cmd.args(["-m", "pytest", "-q", "-p", "no:cacheprovider"])
        .arg(dir.join("test_capsule.py"))
        .current_dir(dir)
        .env("PYTHONPATH", path)
        .env_remove("TRACEGATE_CAPSULE_CANDIDATE");
    if let Some(c) = candidate {
        cmd.env("TRACEGATE_CAPSULE_CANDIDATE", c);
    }
    let out = cmd.output().unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn manifest(dir: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join("manifest.json")).unwrap()).unwrap()
}

/// Every row: the capsule (all rows kept) replays the defective contract to the bisection's
/// verdict, stage and numbers, and passes the engine.
#[test]
fn a_full_capsule_replays_the_bisections_verdict_stage_and_numbers() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cap = tmp.path().join("capsule");
    let cand = defective("mlp-add");
    let (code, out, rep) = bisect(
        tmp.path(),
        "engine",
        &["--candidate", "cmd", "--candidate-cmd", &cand],
        &["--capsule", cap.to_str().unwrap(), "--capsule-full"],
    );
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("capsule written to"), "{out}");
    let m = manifest(&cap);
    assert_eq!(m["rows"]["kept"], 5, "{m}");
    assert_eq!(m["rows"]["minimised"], false);
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate-cmd", &cand]);
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["verdict"], "wrong", "{text}");
    assert_eq!(run["stage"]["tensor"], rep["stage"]["tensor"]);
    assert_eq!(run["stage"]["detail"], rep["stage"]["detail"], "{text}");
    assert_eq!(run["stage"]["tensor"], "layer.02.mlp_out");
    // The numbers: every isolated tensor's counts, ULPs, rel L2, cosine and broken bounds.
    assert_eq!(run["isolated"], rep["layers"][2]["isolated"], "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    assert!(text.contains("broke max_rel_l2"), "{text}");
    // A correct candidate passes the same capsule.
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(run["verdict"], "passes", "{text}");
}

/// Minimised: fewer rows, said what was removed, still failing (re-run), the same stage; its
/// pytest file fails the defect and passes the engine; a changed file is refused by name.
#[test]
fn a_minimised_capsule_still_fails_and_its_pytest_file_judges_as_it_does() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cap = tmp.path().join("capsule");
    let cand = format!(
        "'{}' {{verb}} {{args}} --plant k-norm:3",
        example_producer().display()
    );
    let (code, out, rep) = bisect(
        tmp.path(),
        "engine",
        &[
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &cand,
            "--policy",
            "f32",
        ],
        &["--capsule", cap.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{out}");
    assert_eq!(rep["first_wrong_layer"], 3, "{out}");
    let m = manifest(&cap);
    let kept = m["rows"]["kept"].as_u64().unwrap();
    assert!(kept < 5, "not minimised: {}", m["rows"]);
    assert_eq!(m["rows"]["minimised"], true);
    assert_eq!(m["rows"]["still_fails"], true);
    assert!(
        m["rows"]["removed"]
            .as_str()
            .unwrap()
            .contains(&format!("positions {kept}..4")),
        "{}",
        m["rows"]
    );
    let t = Trace::open(cap.join("reference.trace"));
    assert_eq!(t.rows("layer.03.hidden_in"), kept);
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate-cmd", &cand]);
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["stage"]["tensor"], rep["stage"]["tensor"], "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    // The pytest file: the bisection's candidate (the planted one) fails, the engine passes.
    let (code, text) = pytest(&cap, None);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("layer.03.k"), "{text}");
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&cap, Some(&engine));
    assert_eq!(code, 0, "{text}");
    // Tampered: one byte of the layer's weights.
    let bad = tmp.path().join("tampered");
    std::fs::create_dir(&bad).unwrap();
    for e in std::fs::read_dir(&cap).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), bad.join(e.file_name())).unwrap();
    }
    let mut w = std::fs::read(bad.join("layer.safetensors")).unwrap();
    let last = w.len() - 1;
    w[last] ^= 1;
    std::fs::write(bad.join("layer.safetensors"), w).unwrap();
    let (code, text, _) = capsule_run(tmp.path(), &bad, &["--candidate", "engine"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("layer.safetensors was changed"), "{text}");
}

/// A bisection with nothing wrong writes no capsule and says why; the exit code stays its own.
#[test]
fn a_clean_bisection_writes_no_capsule() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cap = tmp.path().join("capsule");
    let (code, out, _) = bisect(
        tmp.path(),
        "engine",
        &["--candidate", "contract"],
        &["--capsule", cap.to_str().unwrap()],
    );
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("capsule NOT WRITTEN: nothing is wrong"),
        "{out}"
    );
    assert!(!cap.exists());
}

/// The row count of a tensor in a trace (its first axis), through the trace reader.
struct Trace(tracegate_trace::Trace);

impl Trace {
    fn open(p: PathBuf) -> Trace {
        Trace(tracegate_trace::Trace::open(p).unwrap())
    }
    fn rows(&self, name: &str) -> u64 {
        self.0.tensor_info(name).unwrap().shape[0]
    }
}
