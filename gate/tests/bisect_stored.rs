//! `gate bisect --reference trace:PATH`: a reference trace recorded once stands in for the
//! reference producer. It must judge as the live reference does (the same verdict, layer, stage
//! and numbers on a planted defect; nothing wrong on a clean candidate), run no reference
//! producer, and refuse a trace that was edited, recorded for another prompt, decode length or
//! capture, or is one layer's — each refusal one line and a refused report.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::common;
use common::{defective, repo};

struct Run {
    code: i32,
    stdout: String,
    stderr: String,
    report: Value,
    work: PathBuf,
}

/// `gate bisect --model fixtures/tiny-qwen3` with `args`, from the root, its work directory a
/// fresh one under `dir`; the report is checked against the schema.
fn bisect(dir: &Path, args: &[&str]) -> Run {
    let work = tempfile::tempdir_in(dir).unwrap().keep();
    let all = [&["--model", "fixtures/tiny-qwen3"], args].concat();
    let common::Bisected {
        code,
        stdout,
        stderr,
        report,
    } = common::bisect(&work, &work.join("report.json"), &all);
    Run {
        code,
        stdout,
        stderr,
        report,
        work,
    }
}

/// [`bisect`] of the engine against itself on prompt `short`, with `more` arguments: the live
/// run whose reference.trace the tests store.
fn engine_against_engine(dir: &Path, more: &[&str]) -> Run {
    let args = [
        "--prompt",
        "short",
        "--reference",
        "engine",
        "--candidate",
        "engine",
    ];
    bisect(dir, &[&args[..], more].concat())
}

fn stored(path: &Path) -> String {
    format!("trace:{}", path.display())
}

/// What a bisection concluded, without where its traces went, how long its runs took, or the
/// calibration (which runs the reference's layer verb: a stored trace has none).
fn conclusion(r: &Value) -> Value {
    let mut layers = r["layers"].clone();
    for row in layers.as_array_mut().unwrap() {
        let row = row.as_object_mut().unwrap();
        for k in [
            "calibration_rel_l2",
            "whole_vs_calibration",
            "isolated_vs_calibration",
        ] {
            row.remove(k).expect(k);
        }
    }
    serde_json::json!({
        "verdict": r["verdict"], "first_wrong_layer": r["first_wrong_layer"], "stage": r["stage"],
        "layers": layers, "whole_run": r["whole_run"], "judge_by": r["judge"]["by"],
        "policy": r["judge"]["policy_name"], "decisions_forced": r["decisions_forced"],
        "self_consistency": r["self_consistency"], "outliers": r["outliers"],
    })
}

#[test]
fn a_stored_engine_trace_judges_a_planted_defect_as_the_live_engine_does() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let candidate = defective("mlp-add");
    let args = [
        "--prompt",
        "short",
        "--candidate",
        "cmd",
        "--candidate-cmd",
        &candidate,
        "--capture",
        "internals",
        "--all-layers",
        "--exact",
    ];
    let live = bisect(
        dir.path(),
        &[&["--reference", "engine"], &args[..]].concat(),
    );
    assert_eq!(live.code, 1, "{}{}", live.stdout, live.stderr);
    assert_eq!(live.report["first_wrong_layer"], 2, "{}", live.stdout);
    assert_eq!(live.report["reference_trace"], Value::Null);

    // The live run's own reference trace, recorded once, stands in for the engine.
    let golden = dir.path().join("golden.trace");
    std::fs::copy(live.work.join("reference.trace"), &golden).unwrap();
    let digest = tracegate_trace::Trace::open(&golden)
        .unwrap()
        .digest()
        .hex();
    let reference = stored(&golden);
    let s = bisect(
        dir.path(),
        &[&["--reference", &reference], &args[..]].concat(),
    );
    assert_eq!(s.code, 1, "{}{}", s.stdout, s.stderr);
    assert_eq!(
        conclusion(&s.report),
        conclusion(&live.report),
        "{}",
        s.stdout
    );
    assert_eq!(s.report["reference"], reference);
    // Judged by bits, the blamed layer's calibration ran the live engine's layer verb; against
    // the stored trace it is NOT CHECKED, saying why.
    assert_eq!(live.report["calibration"]["not_checked"], Value::Null);
    let why = s.report["calibration"]["not_checked"].as_str().unwrap();
    assert!(
        why.contains("stored trace") && why.contains("layer verb"),
        "{why}"
    );
    assert_eq!(s.report["reference_trace"]["digest"], digest.as_str());
    assert_eq!(s.report["reference_trace"]["producer"], "engine");
    assert!(
        s.stdout
            .contains(&format!("recorded by engine, digest {}", &digest[..16])),
        "{}",
        s.stdout
    );
    // No reference producer ran: every run is the candidate's.
    let runs = s.report["runs"].as_array().unwrap();
    assert!(!runs.is_empty());
    for run in runs {
        assert_eq!(run["producer"], "candidate-cmd", "{run}");
    }

    // Negative control of the pair: the clean engine against the same stored trace, by bits.
    let clean = bisect(
        dir.path(),
        &["--reference", &reference, "--candidate", "engine"],
    );
    assert_eq!(clean.code, 0, "{}{}", clean.stdout, clean.stderr);
    assert_eq!(clean.report["verdict"], "nothing_wrong");
    assert_eq!(clean.report["judge"]["by"], "bits", "{}", clean.stdout);
    // The prompt and the capture came from the stored trace.
    assert_eq!(clean.report["tokens"], live.report["tokens"]);
    assert_eq!(clean.report["capture"], "internals");
}

#[test]
fn a_stored_oracle_trace_stands_in_for_torch_and_is_judged_by_policy() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    // Recorded once: the oracle (transformers' own class) against the engine, which agree.
    let live = bisect(
        dir.path(),
        &[
            "--prompt",
            "short",
            "--reference",
            "oracle",
            "--candidate",
            "engine",
            "--capture",
            "internals",
        ],
    );
    assert_eq!(live.code, 0, "{}{}", live.stdout, live.stderr);
    let golden = dir.path().join("oracle.trace");
    std::fs::copy(live.work.join("reference.trace"), &golden).unwrap();
    let reference = stored(&golden);

    let candidate = defective("mlp-add");
    let s = bisect(
        dir.path(),
        &[
            "--reference",
            &reference,
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &candidate,
        ],
    );
    assert_eq!(s.code, 1, "{}{}", s.stdout, s.stderr);
    assert_eq!(s.report["first_wrong_layer"], 2, "{}", s.stdout);
    assert_eq!(
        s.report["stage"]["tensor"], "layer.02.mlp_out",
        "{}",
        s.stdout
    );
    // An oracle trace is never an ordered producer: judged by the candidate's precision's policy.
    assert_eq!(s.report["judge"]["by"], "policy", "{}", s.stdout);
    assert_eq!(s.report["reference_trace"]["producer"], "oracle");
    assert!(s.stdout.starts_with("judged by policy f32"), "{}", s.stdout);
    for run in s.report["runs"].as_array().unwrap() {
        assert_eq!(run["producer"], "candidate-cmd", "{run}");
    }
}

/// A refusal: exit 2, one line on stderr naming `words`, a refused report, nothing judged.
fn assert_refused(r: &Run, words: &[&str]) {
    assert_eq!(r.code, 2, "{}{}", r.stdout, r.stderr);
    assert_eq!(r.report["verdict"], "refused");
    let summary = r.report["summary"].as_str().unwrap();
    for w in words {
        assert!(summary.contains(w), "{summary:?} does not name {w:?}");
    }
    assert_eq!(
        r.stderr
            .trim_end()
            .lines()
            .filter(|l| l.starts_with("gate:"))
            .count(),
        1,
        "{}",
        r.stderr
    );
    assert!(!r.work.join("candidate.trace").exists());
}

#[test]
fn a_stored_reference_is_refused_when_edited_or_recorded_for_another_bisection() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let live = engine_against_engine(dir.path(), &[]);
    assert_eq!(live.code, 0, "{}{}", live.stdout, live.stderr);
    let golden = dir.path().join("golden.trace");
    std::fs::copy(live.work.join("reference.trace"), &golden).unwrap();
    let reference = stored(&golden);
    let tokens = live.report["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.to_string())
        .collect::<Vec<_>>()
        .join(",");

    // The control: the trace as recorded is used.
    let ok = bisect(
        dir.path(),
        &["--reference", &reference, "--candidate", "engine"],
    );
    assert_eq!(ok.code, 0, "{}{}", ok.stdout, ok.stderr);

    // One payload byte changed: refused by its digest, before the candidate runs.
    let edited = dir.path().join("edited.trace");
    let mut bytes = std::fs::read(&golden).unwrap();
    let t = tracegate_trace::Trace::open(&golden).unwrap();
    let info = t.tensor_info("layer.02.mlp_out").unwrap();
    bytes[info.offset as usize] ^= 1;
    drop(t);
    std::fs::write(&edited, &bytes).unwrap();
    let r = bisect(
        dir.path(),
        &["--reference", &stored(&edited), "--candidate", "engine"],
    );
    assert_refused(
        &r,
        &["layer.02.mlp_out", "no longer matches", "as recorded"],
    );

    let other = [
        (
            vec!["--tokens", "1,2,3"],
            vec!["recorded for prompt tokens", "asks [1, 2, 3]"],
        ),
        (
            vec!["--generate", "2"],
            vec!["recorded with --generate 0", "asks --generate 2"],
        ),
        (
            vec!["--capture", "internals"],
            vec!["recorded with --capture default", "--capture internals"],
        ),
        (vec!["--calibrate"], vec!["--calibrate", "has none"]),
        (
            vec!["--reference-cmd", "my-engine {verb} {args}"],
            vec!["--reference-cmd", "runs no command"],
        ),
    ];
    for (args, words) in other {
        let r = bisect(
            dir.path(),
            &[
                &["--reference", &reference, "--candidate", "engine"],
                &args[..],
            ]
            .concat(),
        );
        assert_refused(&r, &words);
    }
    // The stored prompt, given again, is the same bisection.
    let same = bisect(
        dir.path(),
        &[
            "--reference",
            &reference,
            "--candidate",
            "engine",
            "--tokens",
            &tokens,
        ],
    );
    assert_eq!(same.code, 0, "{}{}", same.stdout, same.stderr);

    // One layer's trace is not a whole run.
    let layer = live.work.join("candidate.layer.00.trace");
    let layer = if layer.exists() {
        layer
    } else {
        // Nothing diverged, so the live run isolated no layer: make one with --all-layers.
        let all = engine_against_engine(dir.path(), &["--all-layers"]);
        all.work.join("candidate.layer.00.trace")
    };
    let r = bisect(
        dir.path(),
        &["--reference", &stored(&layer), "--candidate", "engine"],
    );
    assert_refused(&r, &["verb is \"layer\"", "whole run"]);
    let r = bisect(
        dir.path(),
        &["--reference", "trace:", "--candidate", "engine"],
    );
    assert_refused(&r, &["needs a path"]);
}

/// Rewrites `from` into `to` with tracegate.TraceWriter (its provenance kept, so it still says
/// `engine`): `drop-layer` leaves out layer 04, `drop-internals` the q/k/v/attn_probs points of
/// a trace still claiming `capture: internals`, `nan` puts one NaN in layer 02's hidden_out.
fn forge(from: &Path, to: &Path, how: &str) {
    let script = r#"
import sys, tracegate
src, out, how = tracegate.Trace(sys.argv[1]), sys.argv[2], sys.argv[3]
internals = ("q", "k", "v", "attn_probs")
with tracegate.TraceWriter(out, dict(src.provenance)) as w:
    for n in src.names:
        if how == "drop-layer" and n.startswith("layer.04."):
            continue
        if how == "drop-internals" and n.split(".")[-1] in internals:
            continue
        a = src[n].copy()
        if how == "nan" and n == "layer.02.hidden_out":
            a.flat[3] = float("nan")
        w.tensor(n, a, **src.attributes(n))
    for d, v in src.decisions.items():
        w.decision(d, v, src.margins.get(d))
"#;
    common::succeeded(
        std::process::Command::new(repo().join(".venv/bin/python"))
            .args(["-c", script])
            .arg(from)
            .arg(to)
            .arg(how),
    );
}

#[test]
fn a_forged_stored_reference_never_makes_a_clean_candidate_agree_by_bits_or_by_policy() {
    let dir = tempfile::tempdir_in(repo().join("target")).unwrap();
    let live = engine_against_engine(dir.path(), &["--capture", "internals"]);
    assert_eq!(live.code, 0, "{}{}", live.stdout, live.stderr);
    let golden = live.work.join("reference.trace");
    for (how, verdict) in [
        ("drop-layer", "structure_differs"),
        ("drop-internals", "structure_differs"),
        ("nan", "wrong_layer"),
    ] {
        let forged = dir.path().join(format!("{how}.trace"));
        forge(&golden, &forged, how);
        for judge in [&["--exact"][..], &["--policy", "f32"][..]] {
            let r = bisect(
                dir.path(),
                &[
                    &["--reference", &stored(&forged), "--candidate", "engine"],
                    judge,
                ]
                .concat(),
            );
            assert_eq!(r.code, 1, "{how} {judge:?}: {}{}", r.stdout, r.stderr);
            assert_eq!(
                r.report["verdict"], verdict,
                "{how} {judge:?}: {}",
                r.stdout
            );
        }
    }
}
