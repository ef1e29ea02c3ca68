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

// ------------------------------------------------------------------------------------------
// Decode-step capsules: a layer wrong only at a decode step (capsule/decode.rs).

/// A RoPE position off by one in layer 1 of the contract's cached decode only (`cached-pos`,
/// bisect_decode.rs): `gate bisect --generate 3 --capsule` writes a decode capsule of step 1
/// (position 5) that replays, with `layer --decode-from 5` and nothing else, to the decode
/// isolation's verdict, stage and numbers; the engine passes it; its pytest file and C test
/// judge as it does; a changed input.trace and a manifest that moves or drops the step are
/// refused.
#[test]
fn a_decode_capsule_replays_the_decode_isolations_verdict_stage_and_numbers() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cap = tmp.path().join("capsule");
    let cand = defective("cached-pos");
    let (code, out, rep) = bisect(
        tmp.path(),
        "engine",
        &["--candidate", "cmd", "--candidate-cmd", &cand],
        &["--generate", "3", "--capsule", cap.to_str().unwrap()],
    );
    assert_eq!(code, 6, "{out}");
    assert!(
        out.contains("capsule written to") && out.contains("at decode step 1 (position 5)"),
        "{out}"
    );
    let d = &rep["decode"];
    assert_eq!(d["first_wrong_layer"], 1, "{out}");
    let m = manifest(&cap);
    assert_eq!(
        (&m["layer"], &m["decode"]["step"], &m["decode"]["position"]),
        (&1.into(), &1.into(), &5.into()),
        "{m}"
    );
    // The whole prefix, said so: 5 prompt rows and step 1's input row.
    assert_eq!(
        (&m["rows"]["kept"], &m["rows"]["minimised"]),
        (&6.into(), &false.into())
    );
    assert!(m["rows"]["not_minimised"]
        .as_str()
        .unwrap()
        .contains("whole prefix"));
    assert_eq!(m["rows"]["still_fails"], true);
    let input = Trace::open(cap.join("input.trace"));
    assert_eq!(input.rows("layer.01.hidden_in"), 6);
    let reference = Trace::open(cap.join("reference.trace"));
    assert_eq!(reference.rows("layer.01.attn_out"), 1);
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate-cmd", &cand]);
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["verdict"], "wrong", "{text}");
    assert_eq!(run["stage"], d["stage"], "{text}");
    assert_eq!(run["stage"]["tensor"], "layer.01.attn_out");
    assert_eq!(run["isolated"], d["layers"][1]["isolated"], "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    // It ran the decode isolation's call.
    let call = run["runs"][0]["invocation"].as_str().unwrap();
    assert!(
        call.contains("--decode-from 5") && call.contains("input.trace"),
        "{call}"
    );
    let replayed = tmp.path().join("replay/capsule.candidate.trace");
    let planted = tmp.path().join("planted.trace");
    std::fs::copy(&replayed, &planted).unwrap();
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(
        (code, run["verdict"].as_str()),
        (0, Some("passes")),
        "{text}"
    );
    let correct = tmp.path().join("engine.trace");
    std::fs::copy(&replayed, &correct).unwrap();
    c_test(tmp.path(), &cap, &m, &planted, &correct);
    let (code, text) = pytest(&cap, None);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("layer.01.attn_out"), "{text}");
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&cap, Some(&engine));
    assert_eq!(code, 0, "{text}");
    decode_edits_are_refused(tmp.path(), &cap, &m);
}

/// One byte of input.trace changed is refused by its sha256; a manifest re-sealed with another
/// step position, or with no decode step (replayed as a prefill layer on reference.trace's one
/// row), by the traces' own; the unedited manifest re-sealed is accepted (the control).
fn decode_edits_are_refused(tmp: &Path, cap: &Path, m: &Value) {
    let bad = copy_capsule(tmp, cap, "decode-tampered");
    let mut rows = std::fs::read(bad.join("input.trace")).unwrap();
    let last = rows.len() - 1;
    rows[last] ^= 1;
    std::fs::write(bad.join("input.trace"), rows).unwrap();
    let (code, text, _) = capsule_run(tmp, &bad, &["--candidate", "engine"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("input.trace was changed"), "{text}");
    let resealed = |name: &str, f: &dyn Fn(&mut Value)| {
        let dir = copy_capsule(tmp, cap, name);
        let mut e = m.clone();
        f(&mut e);
        let text = serde_json::to_vec_pretty(&e).unwrap();
        std::fs::write(dir.join("manifest.json"), &text).unwrap();
        let hex = hex::encode(sha2::Sha256::digest(&text));
        std::fs::write(
            dir.join("manifest.sha256"),
            format!("{hex}  manifest.json\n"),
        )
        .unwrap();
        capsule_run(tmp, &dir, &["--candidate", "engine"])
    };
    let (code, text, _) = resealed("decode-moved", &|e| e["decode"]["position"] = 4.into());
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("reference.trace holds"), "{text}");
    let (code, text, _) = resealed("decode-dropped", &|e| e["decode"] = Value::Null);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("records no decode step"), "{text}");
    let (code, text, _) = resealed("decode-resealed", &|_| {});
    assert_eq!(code, 0, "{text}");
}

// ---- Heads and experts (capsule/units.rs; docs/bisect.md, "Capsules", "Heads and experts") ----

/// `gate bisect --capture internals --capsule` on `model`, prompt short, the engine the
/// reference, the defective contract with `defect` the candidate: (exit code, output, capsule).
fn units_bisect(tmp: &Path, model: &str, defect: &str) -> (i32, String, PathBuf) {
    let cap = tmp.join("capsule");
    let cand = defective(defect);
    let args = [
        "--model",
        model,
        "--prompt",
        "short",
        "--reference",
        "engine",
        "--capture",
        "internals",
        "--candidate",
        "cmd",
        "--candidate-cmd",
        &cand,
        "--capsule",
        cap.to_str().unwrap(),
    ];
    let b = common::bisect(&tmp.join("work"), &tmp.join("report.json"), &args);
    (b.code, b.stdout, cap)
}

/// The experts stored in `cap`'s layer.safetensors (an `experts.E.` name component), read
/// from its header.
fn stored_experts(cap: &Path) -> std::collections::BTreeSet<u64> {
    let bytes = std::fs::read(cap.join("layer.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    header
        .as_object()
        .unwrap()
        .keys()
        .filter_map(|k| {
            let parts: Vec<&str> = k.split('.').collect();
            parts
                .windows(2)
                .find(|w| w[0] == "experts")
                .and_then(|w| w[1].parse().ok())
        })
        .collect()
}

fn numbers(v: &Value) -> Vec<u64> {
    v.as_array()
        .unwrap_or_else(|| panic!("not an array: {v}"))
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// Experts 2 and 6 of tiny-qwen3-moe's layer 1 planted: the failure is named as those experts;
/// the experts no kept row routes to (by the reference's own router.topk, read here from the
/// capsule's reference rows) are removed from layer.safetensors and named; expert 6, failing
/// but routed to by no kept row, is kept all the same (the negative control: the reduction
/// would drop it); the reduced capsule still fails for the planted candidate, as recorded, and
/// the engine passes it, from `gate capsule run` and from the pytest file.
#[test]
fn experts_no_kept_row_routes_to_are_removed_and_the_failing_ones_named_and_kept() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let defect = "expert-add@1:2,6";
    let (code, out, cap) = units_bisect(tmp.path(), "fixtures/tiny-qwen3-moe", defect);
    assert_eq!(code, 1, "{out}");
    let m = manifest(&cap);
    assert_eq!(m["stage"]["tensor"], "layer.01.expert.002.out", "{out}");
    let e = &m["units"]["experts"];
    assert_eq!(numbers(&e["failing"]), [2, 6], "{e}");
    // Routed: the kept rows' router decisions, as the capsule's reference trace holds them.
    let t = tracegate_trace::Trace::open(cap.join("reference.trace")).unwrap();
    let d = t
        .decisions()
        .iter()
        .find(|d| d.name == "layer.01.router.topk")
        .unwrap();
    let routed: std::collections::BTreeSet<u64> =
        t.decision_values(d).iter().map(|&v| v as u64).collect();
    assert!(!routed.contains(&6), "row choice changed: {routed:?}");
    let removed: Vec<u64> = (0..8).filter(|x| !routed.contains(x) && *x != 6).collect();
    assert!(!removed.is_empty());
    assert_eq!(numbers(&e["removed"]), removed, "{e}");
    assert_eq!(numbers(&e["failing_not_exercised"]), [6], "{e}");
    assert_eq!(e["still_fails"], true, "{e}");
    let stored = stored_experts(&cap);
    assert!(
        stored.contains(&6),
        "a failing expert was dropped: {stored:?}"
    );
    assert!(removed.iter().all(|x| !stored.contains(x)), "{stored:?}");
    assert_eq!(stored.len() + removed.len(), 8, "{stored:?}");
    // Replayed: the planted candidate fails as recorded, the engine passes.
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate-cmd", &defective(defect)]);
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["stage"]["tensor"], "layer.01.expert.002.out", "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    let (code, text, _) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(code, 0, "{text}");
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&cap, Some(&engine));
    assert_eq!(code, 0, "{text}");
}

/// A defect that shows only while expert 7's weights are not zero: the reduced capsule (expert
/// 7 routed to by no kept row, so removed) no longer fails, so the reduction is undone, said,
/// and the capsule keeps every expert and still fails.
#[test]
fn an_expert_reduction_that_stops_the_failure_is_undone() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let (code, out, cap) = units_bisect(tmp.path(), "fixtures/tiny-qwen3-moe", "expert-add@1:2?7");
    assert_eq!(code, 1, "{out}");
    let m = manifest(&cap);
    let e = &m["units"]["experts"];
    assert_eq!(numbers(&e["failing"]), [2], "{e}");
    assert_eq!(e["still_fails"], false, "{e}");
    assert_eq!(numbers(&e["removed"]), Vec::<u64>::new(), "{e}");
    assert!(
        e["not_minimised"].as_str().unwrap().starts_with("undone:"),
        "{e}"
    );
    assert_eq!(stored_experts(&cap).len(), 8);
    assert_eq!(m["rows"]["still_fails"], true, "{}", m["rows"]);
}

/// Heads: gqa-mod reads kv head h % 2 for query head h instead of h / 2, so only the query
/// heads where the two differ (1 and 2 of 4) have wrong attention probabilities: named, the
/// failure local; k-norm:3 scales every key head: both named, not local. Heads are not cut.
#[test]
fn failing_heads_are_named_and_local_only_when_some_heads_pass() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let (code, out, cap) = units_bisect(tmp.path(), "fixtures/tiny-qwen3", "gqa-mod");
    assert_eq!(code, 1, "{out}");
    let m = manifest(&cap);
    let h = &m["units"]["heads"];
    assert_eq!(m["stage"]["tensor"], "layer.03.attn_probs", "{out}");
    let wrong: Vec<u64> = (0..4u64).filter(|q| q / 2 != q % 2).collect();
    let probs = h["failing"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["point"] == "layer.03.attn_probs")
        .unwrap_or_else(|| panic!("{h}"));
    assert_eq!(numbers(&probs["heads"]), wrong, "{h}");
    assert_eq!(probs["of"], 4);
    assert_eq!(h["local"], true, "{h}");
    assert_eq!(h["reduced"], true, "{h}");
    assert!(
        m["units"]["experts"].is_null(),
        "a dense layer: {}",
        m["units"]
    );
    // Every key head wrong: named, and not local.
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let cap = tmp.path().join("capsule");
    let cand = format!(
        "'{}' {{verb}} {{args}} --plant k-norm:3",
        example_producer().display()
    );
    let (code, out, _) = bisect(
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
    let h = &manifest(&cap)["units"]["heads"];
    let k = h["failing"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["point"] == "layer.03.k")
        .unwrap_or_else(|| panic!("{h}"));
    assert_eq!(numbers(&k["heads"]), [0, 1], "{h}");
    assert_eq!(h["local"], false, "{h}");
    // Not local: not cut, and said why.
    assert_eq!(h["reduced"], false, "{h}");
    let why = h["why_not_reduced"].as_str().unwrap_or_default();
    assert!(why.starts_with("the failure is not local"), "{h}");
}

// ---- GGUF capsules (docs/bisect.md, "Capsules") ----

/// Writes a tiny llama GGUF with ggml's own GGUFWriter (oracle/tests/gguf_models.py; vocabulary
/// 512 for the prompt `short`), its layer 2's matrices in Q8_0, Q4_K, F16, Q6_K, Q5_0, Q4_0 and
/// Q4_1, and prints layer 2's tensors as ggml's own GGUFReader reads them: name → [type,
/// sha256 of the bytes]. The expected blocks come from ggml's reader, not from the gate's.
const TINY_GGUF: &str = r#"
import hashlib, json, sys
sys.path.insert(0, "oracle/tests")
from pathlib import Path
import gguf, gguf_models as g
g.VOCAB = 512
Q = g.Q
g.tiny_llama(Path(sys.argv[1]), 3, [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.F16, Q.Q6_K, Q.Q5_0], Q.Q8_0)
r = gguf.GGUFReader(sys.argv[1])
print(json.dumps({t.name: [t.tensor_type.name, hashlib.sha256(t.data.tobytes()).hexdigest()]
                  for t in r.tensors if t.name.startswith("blk.2.")}))
"#;

/// `layer.safetensors`' tensors: name → (dtype, its `__metadata__` entry, sha256 of its bytes).
fn layer_file_tensors(path: &Path) -> std::collections::BTreeMap<String, (String, String, String)> {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let head: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let meta = &head["__metadata__"];
    head.as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            let (b, e) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let sha = hex::encode(sha2::Sha256::digest(&data[b..e]));
            let what = meta[k].as_str().unwrap_or_default().to_string();
            (
                k.clone(),
                (v["dtype"].as_str().unwrap().to_string(), what, sha),
            )
        })
        .collect()
}

/// A GGUF model: the capsule holds layer 2's blocks as quantised (every tensor of ggml's own
/// reading, bytes unchanged, with its type), no config.json (the replay GGUF's header is the
/// config); it replays the defective contract to the bisection's verdict, stage and numbers,
/// the engine passes it, and so does its pytest file. A changed byte of the blocks is refused by
/// its sha256, and, re-sealed, by the replay GGUF's weights digest.
#[test]
fn a_gguf_capsule_holds_the_layers_blocks_and_replays_the_bisection() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let model = tmp.path().join("tiny.gguf");
    let w = Command::new(common::python())
        .current_dir(repo())
        .args(["-c", TINY_GGUF, model.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(w.status.success(), "{}", String::from_utf8_lossy(&w.stderr));
    let blocks: Value = serde_json::from_slice(&w.stdout).unwrap();
    let cap = tmp.path().join("capsule");
    let cand = defective("mlp-add");
    let b = common::bisect(
        &tmp.path().join("work"),
        &tmp.path().join("report.json"),
        &[
            "--model",
            model.to_str().unwrap(),
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--capture",
            "internals",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &cand,
            "--capsule",
            cap.to_str().unwrap(),
            "--capsule-full",
        ],
    );
    let (out, rep) = (b.stdout, b.report);
    assert_eq!(b.code, 1, "{out}{}", b.stderr);
    assert!(out.contains("capsule written to"), "{out}");
    let m = manifest(&cap);
    assert_eq!(m["weights"]["format"], "gguf", "{m}");
    assert_eq!(m["weights"]["replay_file"], "model.gguf");
    assert!(!cap.join("config.json").exists());
    // The blocks, as ggml's reader reads them: every tensor of layer 2, its type, its bytes.
    let mine = layer_file_tensors(&cap.join("layer.safetensors"));
    let want = blocks.as_object().unwrap();
    assert_eq!(mine.len(), want.len(), "{mine:?} vs {want:?}");
    for (name, w) in want {
        let (dtype, what, sha) = &mine[name];
        assert_eq!(dtype, "U8", "{name}");
        assert!(
            what.starts_with(&format!("{} [", w[0].as_str().unwrap())),
            "{name}: {what}"
        );
        assert_eq!(sha, w[1].as_str().unwrap(), "{name}");
    }
    assert!(want.values().any(|w| w[0] == "Q4_K") && want.values().any(|w| w[0] == "Q6_K"));
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate-cmd", &cand]);
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["stage"]["tensor"], "layer.02.mlp_out", "{text}");
    assert_eq!(run["stage"], rep["stage"], "{text}");
    assert_eq!(run["isolated"], rep["layers"][2]["isolated"], "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    let (code, text, run) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(code, 0, "{text}");
    assert_eq!(run["verdict"], "passes", "{text}");
    let (code, text) = pytest(&cap, None);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("layer.02.mlp_out"), "{text}");
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&cap, Some(&engine));
    assert_eq!(code, 0, "{text}");
    // Negative controls: one byte of the last tensor's blocks changed.
    let bad = copy_capsule(tmp.path(), &cap, "tampered");
    let path = bad.join("layer.safetensors");
    let mut bytes = std::fs::read(&path).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let (code, text, _) = capsule_run(tmp.path(), &bad, &["--candidate", "engine"]);
    assert_eq!(code, 2, "{text}");
    assert!(text.contains("layer.safetensors was changed"), "{text}");
    // … and re-sealed (its sha256 in the manifest, manifest.sha256 rewritten): the replay GGUF
    // is no longer the one the capsule's reference trace was recorded against.
    let mut e = m.clone();
    e["files"]["layer.safetensors"] = hex::encode(sha2::Sha256::digest(&bytes)).into();
    let text = serde_json::to_vec_pretty(&e).unwrap();
    std::fs::write(bad.join("manifest.json"), &text).unwrap();
    let hex = hex::encode(sha2::Sha256::digest(&text));
    std::fs::write(
        bad.join("manifest.sha256"),
        format!("{hex}  manifest.json\n"),
    )
    .unwrap();
    let (code, text, _) = capsule_run(tmp.path(), &bad, &["--candidate", "engine"]);
    assert_eq!(code, 2, "{text}");
    assert!(
        text.contains("the replay model's weights digest is"),
        "{text}"
    );
}

// ---- Heads cut (capsule/units.rs `Cut`; docs/bisect.md, "Capsules", "Heads and experts") ----

/// `layer.safetensors`' (or a checkpoint's) f32 tensors: name → (shape, values).
fn f32_tensors(file: &Path) -> std::collections::BTreeMap<String, (Vec<u64>, Vec<f32>)> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    header
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "__metadata__")
        .map(|(k, v)| {
            assert_eq!(v["dtype"], "F32", "{k}");
            let (b, e) = (
                v["data_offsets"][0].as_u64().unwrap() as usize,
                v["data_offsets"][1].as_u64().unwrap() as usize,
            );
            let vals = data[b..e]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (k.clone(), (numbers(&v["shape"]), vals))
        })
        .collect()
}

/// A trace tensor's f32 values and shape.
fn trace_f32(t: &tracegate_trace::Trace, name: &str) -> (Vec<u64>, Vec<f32>) {
    let info = t.tensor_info(name).unwrap_or_else(|| panic!("no {name}"));
    let vals = t
        .data(info)
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (info.shape.clone(), vals)
}

/// gqa-mod fails query heads 1 and 2 of tiny-qwen3's 4 at attn_probs (the stage, before
/// o_proj): the capsule keeps those heads (and the key/value heads they read), which are worked
/// out here from config.json, not by the code under test. Its layer.safetensors holds exactly
/// those heads' rows of q_proj (the others zero, against the checkpoint's), k_proj/v_proj whole
/// (both key/value heads read), no o_proj, post-attention norm or MLP; reference.trace holds
/// the kept heads' slices of q, k, v, attn_probs (against the bisection's own reference) and no
/// later point; the reduced capsule still fails for the planted candidate at attn_probs, as
/// recorded, passes the engine, and its pytest file and C test refuse it (never pass).
#[test]
fn a_head_local_failure_is_cut_to_its_heads_and_still_fails() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let (code, out, cap) = units_bisect(tmp.path(), "fixtures/tiny-qwen3", "gqa-mod");
    assert_eq!(code, 1, "{out}");
    let m = manifest(&cap);
    assert_eq!(m["stage"]["tensor"], "layer.03.attn_probs", "{out}");
    let h = &m["units"]["heads"];
    let config: Value = serde_json::from_slice(
        &std::fs::read(repo().join("fixtures/tiny-qwen3/config.json")).unwrap(),
    )
    .unwrap();
    let heads = config["num_attention_heads"].as_u64().unwrap();
    let kv_heads = config["num_key_value_heads"].as_u64().unwrap();
    let dim = config["head_dim"].as_u64().unwrap() as usize;
    let group = heads / kv_heads;
    // gqa-mod: query head q reads key/value head q % kv_heads, not q / group.
    let kept: Vec<u64> = (0..heads).filter(|q| q / group != q % kv_heads).collect();
    let kv: Vec<u64> = kept
        .iter()
        .map(|q| q / group)
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    assert_eq!(kept, [1, 2]);
    assert_eq!(h["reduced"], true, "{h}");
    assert_eq!(numbers(&h["kept"]), kept, "{h}");
    assert_eq!(numbers(&h["removed"]), [0, 3], "{h}");
    assert_eq!(numbers(&h["kv_kept"]), kv, "{h}");
    assert_eq!(h["still_fails"], true, "{h}");
    let points: Vec<String> = ["q", "k", "v", "attn_probs"]
        .iter()
        .map(|p| format!("layer.03.{p}"))
        .collect();
    assert_eq!(h["judged"]["points"], serde_json::json!(points), "{h}");
    assert!(h["why_not_reduced"].is_null(), "{h}");
    // The weights: exactly the kept heads' rows, against the checkpoint.
    let mine = f32_tensors(&cap.join("layer.safetensors"));
    let source = f32_tensors(&repo().join("fixtures/tiny-qwen3/model.safetensors"));
    let pfx = "model.layers.3.";
    for gone in [
        "self_attn.o_proj.weight",
        "post_attention_layernorm.weight",
        "mlp.up_proj.weight",
    ] {
        assert!(
            !mine.contains_key(&format!("{pfx}{gone}")),
            "{gone} kept: {:?}",
            mine.keys()
        );
    }
    for (proj, keep, of) in [
        ("q", &kept, heads),
        ("k", &kv, kv_heads),
        ("v", &kv, kv_heads),
    ] {
        for part in ["weight", "bias"] {
            let name = format!("{pfx}self_attn.{proj}_proj.{part}");
            let (shape, got) = &mine[&name];
            let (want_shape, want) = &source[&name];
            assert_eq!(shape, want_shape, "{name}");
            let per_head = want.len() / of as usize;
            assert_eq!(per_head % dim, 0, "{name}");
            for head in 0..of {
                let r = head as usize * per_head..(head as usize + 1) * per_head;
                if keep.contains(&head) {
                    assert_eq!(got[r.clone()], want[r], "{name} head {head}");
                } else {
                    assert!(got[r].iter().all(|&x| x == 0.0), "{name} head {head} kept");
                }
            }
        }
    }
    for whole in [
        "input_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
    ] {
        let name = format!("{pfx}{whole}");
        assert_eq!(mine[&name], source[&name], "{name}");
    }
    // The reference rows: the kept heads' slices of the bisection's own reference.
    let refr = tracegate_trace::Trace::open(cap.join("reference.trace")).unwrap();
    let whole = tracegate_trace::Trace::open(tmp.path().join("work/reference.trace")).unwrap();
    for later in ["attn_out", "mlp_out", "hidden_out"] {
        assert!(
            refr.tensor_info(&format!("layer.03.{later}")).is_none(),
            "{later} judged"
        );
    }
    let (shape, probs) = trace_f32(&refr, "layer.03.attn_probs");
    let (wshape, wprobs) = trace_f32(&whole, "layer.03.attn_probs");
    let rows = shape[1] as usize;
    assert_eq!(shape, [kept.len() as u64, rows as u64, rows as u64]);
    let n = wshape[1] as usize;
    for (i, &head) in kept.iter().enumerate() {
        for r in 0..rows {
            let at = (head as usize * n + r) * n;
            assert_eq!(
                probs[(i * rows + r) * rows..(i * rows + r + 1) * rows],
                wprobs[at..at + rows],
                "attn_probs head {head} row {r}"
            );
        }
    }
    let (qs, _) = trace_f32(&refr, "layer.03.q");
    assert_eq!(qs, [rows as u64, kept.len() as u64, dim as u64]);
    // Replayed: the planted candidate still fails there, as recorded; the engine passes.
    let (code, text, run) = capsule_run(
        tmp.path(),
        &cap,
        &["--candidate-cmd", &defective("gqa-mod")],
    );
    assert_eq!(code, 1, "{text}");
    assert_eq!(run["stage"]["tensor"], "layer.03.attn_probs", "{text}");
    assert_eq!(run["as_recorded"], true, "{text}");
    let replayed = tmp.path().join("replay/capsule.candidate.trace");
    let planted = tmp.path().join("planted.trace");
    std::fs::copy(&replayed, &planted).unwrap();
    let (code, text, _) = capsule_run(tmp.path(), &cap, &["--candidate", "engine"]);
    assert_eq!(code, 0, "{text}");
    let correct = tmp.path().join("engine.trace");
    std::fs::copy(&replayed, &correct).unwrap();
    // The generated tests cut the candidate's per-head points to the kept heads as the replay
    // does (manifest units.heads.judged.slices): uncut, the engine's whole-head output would not
    // have the reference's shape and could not pass.
    let slices = &m["units"]["heads"]["judged"]["slices"];
    assert_eq!(
        slices["layer.03.attn_probs"]["heads"],
        serde_json::json!(kept),
        "{slices}"
    );
    let (code, text) = pytest(&cap, None);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("layer.03.attn_probs"), "{text}");
    let engine = format!("'{}' {{verb}} {{args}}", engine().display());
    let (code, text) = pytest(&cap, Some(&engine));
    assert_eq!(code, 0, "{text}");
    c_test(tmp.path(), &cap, &m, &planted, &correct);
}
