//! Repro capsules (docs/bisect.md, "Capsules"): `gate bisect --capsule DIR` on a planted defect
//! writes a capsule that `gate capsule run` replays with nothing else, to the bisection's own
//! verdict, stage and numbers; the capsule fails for the defective candidate and passes for a
//! correct one (the engine), and so does its generated pytest file; minimised, it keeps fewer
//! rows and still fails, re-run; a clean bisection writes none; a changed file is refused.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sha2::Digest as _;

use crate::common::{self, defective, repo};

fn example_producer() -> PathBuf {
    common::sibling("example-producer")
}

fn engine() -> PathBuf {
    common::sibling("engine")
}

/// `gate bisect` on tiny-qwen3, prompt short, with `candidate` and `extra`; its work dir, report
/// and (maybe) capsule under `tmp`. Returns (exit code, stdout, report).
fn bisect(tmp: &Path, reference: &str, candidate: &[&str], extra: &[&str]) -> (i32, String, Value) {
    let settings = ["--model", "fixtures/tiny-qwen3", "--prompt", "short"];
    let reference = ["--reference", reference, "--capture", "internals"];
    let all = [&settings[..], &reference, candidate, extra].concat();
    let b = common::bisect(&tmp.join("work"), &tmp.join("report.json"), &all);
    (b.code, b.stdout, b.report)
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
    let (code, text) = common::code_and_output(&out);
    let report = std::fs::read(&report)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or(Value::Null);
    (code, text, report)
}

fn pytest(dir: &Path, candidate: Option<&str>) -> (i32, String) {
    let root = repo().canonicalize().unwrap();
    let path = ["contract", "oracle", "binding/python"]
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
    common::code_and_output(&out)
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
    // The candidates' layer outputs on the capsule, for its C test below.
    let replayed = tmp.path().join("replay/capsule.candidate.trace");
    let planted = tmp.path().join("planted.trace");
    std::fs::copy(&replayed, &planted).unwrap();
    let (code, text, _) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(code, 0, "{text}");
    let correct = tmp.path().join("engine.trace");
    std::fs::copy(&replayed, &correct).unwrap();
    c_test(tmp.path(), &cap, &m, &planted, &correct);
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
    edited_manifests_are_refused(tmp.path(), &cap, &m);
}

/// A copy of capsule `cap` in `tmp/name`.
fn copy_capsule(tmp: &Path, cap: &Path, name: &str) -> PathBuf {
    let to = tmp.join(name);
    std::fs::create_dir(&to).unwrap();
    for e in std::fs::read_dir(cap).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// The manifest's own integrity: its rule's bound loosened is refused by manifest.sha256, and
/// when manifest.sha256 is rewritten to match, by the rule re-derived from policy.json; the
/// layer changed (and re-sealed) is refused by reference.trace's own.
fn edited_manifests_are_refused(tmp: &Path, cap: &Path, m: &Value) {
    let rule = m["rule"]["rule"]
        .as_object()
        .expect("a rule for the stage tensor");
    let (bound, limit) = rule
        .iter()
        .find(|(k, v)| k.starts_with("max_") && v.is_number())
        .map(|(k, v)| (k.clone(), v.as_f64().unwrap()))
        .expect("a max_ bound");
    let edit = |name: &str, f: &dyn Fn(&mut Value), reseal: bool| {
        let dir = copy_capsule(tmp, cap, name);
        let mut e = m.clone();
        f(&mut e);
        let text = serde_json::to_vec_pretty(&e).unwrap();
        std::fs::write(dir.join("manifest.json"), &text).unwrap();
        if reseal {
            let hex = hex::encode(sha2::Sha256::digest(&text));
            std::fs::write(
                dir.join("manifest.sha256"),
                format!("{hex}  manifest.json\n"),
            )
            .unwrap();
        }
        capsule_run(tmp, &dir, &["--candidate", "engine"])
    };
    let loosen = |e: &mut Value| e["rule"]["rule"][&bound] = (limit * 1000.0).into();
    let (code, text, _) = edit("loosened", &loosen, false);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("manifest.json was changed"), "{text}");
    // The pytest file refuses it too, whatever the candidate.
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&tmp.join("loosened"), Some(&engine));
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("manifest.json was changed"), "{text}");
    let (code, text, _) = edit("loosened-resealed", &loosen, true);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("policy.json holds it to"), "{text}");
    let (code, text, _) = edit("other-layer", &|e: &mut Value| e["layer"] = 2.into(), true);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("reference.trace holds layer 3"), "{text}");
    // Control: the unedited manifest, re-sealed the same way, is accepted.
    let (code, text, _) = edit("resealed", &|_: &mut Value| {}, true);
    assert_eq!(code, 0, "{text}");
}

/// libtracegate_capi, built beside the gate (`cargo build --release -p tracegate-capi`).
fn capi_dir() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_gate"))
        .parent()
        .unwrap()
        .to_path_buf();
    assert!(
        dir.join("libtracegate_capi.so").is_file(),
        "{} has no libtracegate_capi.so: build it with `cargo build --release -p tracegate-capi`",
        dir.display()
    );
    dir
}

/// Runs the C test binary `exe` on capsule `dir` and a candidate trace: exit code and output.
fn run_c(exe: &Path, dir: &Path, candidate: &Path) -> (i32, String) {
    let out = Command::new(exe)
        .arg(dir)
        .arg(candidate)
        .env("LD_LIBRARY_PATH", capi_dir())
        .output()
        .unwrap();
    common::code_and_output(&out)
}

/// The capsule's test_capsule.c, compiled with the system's cc against capi/: the planted
/// candidate's layer output fails naming the stage tensor and the broken bound, the engine's
/// passes; a candidate trace with none of the layer's capture points checks nothing and fails;
/// another trace in the capsule's place of reference.trace is refused.
fn c_test(tmp: &Path, cap: &Path, m: &Value, planted: &Path, correct: &Path) {
    let exe = tmp.join("test_capsule");
    let out = Command::new("cc")
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror", "-o"])
        .arg(&exe)
        .arg(cap.join("test_capsule.c"))
        .arg("-I")
        .arg(repo().join("capi/include"))
        .arg("-L")
        .arg(capi_dir())
        .args(["-ltracegate_capi", "-lm"])
        .output()
        .expect("cc (a C compiler) is needed to test test_capsule.c");
    assert!(
        out.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stage = m["stage"]["tensor"].as_str().unwrap();
    let (code, text) = run_c(&exe, cap, planted);
    assert_eq!(code, 1, "{text}");
    let broken = m["broke"][0]["bound"].as_str().unwrap();
    assert!(
        text.contains(&format!("FAIL {stage}: broke {broken}")),
        "{text}"
    );
    // Its number is the replay's (docs/diff.md's measure, summed in another order).
    let said: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(&format!("FAIL {stage}: broke {broken}: ")))
        .and_then(|l| l.split(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no value: {text}"));
    let tensor = m["expected"]["isolated"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tensor"] == stage)
        .unwrap();
    let recorded = tensor["violations"][0]["value"].as_f64().unwrap();
    assert!(
        (said - recorded).abs() <= 1e-6 * recorded.abs(),
        "{said} vs {recorded}: {text}"
    );
    let (code, text) = run_c(&exe, cap, correct);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains(&format!("ok {stage}")), "{text}");
    // Nothing to check is no pass.
    let empty = tmp.join("unrelated.trace");
    let mut w =
        tracegate_trace::TraceWriter::create(&empty, serde_json::json!({"producer": "test"}))
            .unwrap();
    w.tensor_f32(
        "layer.00.hidden_out",
        &[1, 2],
        &[1.0, 2.0],
        &Default::default(),
    )
    .unwrap();
    w.finish().unwrap();
    let (code, text) = run_c(&exe, cap, &empty);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("0 capture points checked"), "{text}");
    // The capsule's reference swapped for another valid trace (the planted candidate's: the
    // engine's has the reference's very content, and so its digest).
    let swapped = copy_capsule(tmp, cap, "swapped");
    std::fs::copy(planted, swapped.join("reference.trace")).unwrap();
    let (code, text) = run_c(&exe, &swapped, correct);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("not the capsule's"), "{text}");
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
