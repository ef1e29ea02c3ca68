//! The noise-relative bound (`max_noise_ratio`, `--noise-reference`; docs/diff.md,
//! "Noise-relative bound"). Claim: a tensor passes the bound only when the candidate's relative
//! L2 against the reference is at most k times the noise reference's, measured on the same
//! elements of a noise trace from the same weights and prompt. Everything else fails it or is
//! refused: a noise trace without the tensor, with another shape or other positions, exact where
//! the candidate is not, NaN, or from other weights; a bound without a noise trace, or a noise
//! trace nothing reads. The expected ratios are computed here in binary64 from the values
//! written, not read from the code under test.

use std::path::Path;
use std::process::Command;

use tracegate_diff::{compare, FindingKind, NoiseReference, Options, Policy, RowStatus, Verdict};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

const NAME: &str = "layer.00.mlp_out";

fn write_with(
    path: &Path,
    weights: &str,
    positions: Vec<i64>,
    tensors: &[(&str, Vec<f32>)],
) -> Trace {
    // The candidate is a port; the reference and the noise reference are tracegate's producers
    // (a noise reference from anyone else is refused: a_noise_trace_the_candidate_supplies_...).
    let producer = if path
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with('c'))
    {
        "my-port"
    } else {
        "oracle"
    };
    let prov = serde_json::json!({"producer": producer, "weights_digest": weights, "prompt_tokens": [1, 2]});
    let mut w = TraceWriter::create(path, prov).unwrap();
    let attrs = Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(positions);
    for (name, v) in tensors {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor(name, DType::F32, &[2, (v.len() / 2) as u64], &bytes, &attrs)
            .unwrap();
    }
    w.finish().unwrap();
    Trace::open(path).unwrap()
}

fn write(path: &Path, tensors: &[(&str, Vec<f32>)]) -> Trace {
    write_with(path, "w-1", vec![0, 1], tensors)
}

fn base() -> Vec<f32> {
    (0..64).map(|i| (i as f32 * 0.37).sin() + 0.2).collect()
}

/// `base` moved by `scale` times a fixed pattern (`phase` picks one of two patterns, so noise
/// and candidate errors are not proportional).
fn moved(scale: f32, phase: usize) -> Vec<f32> {
    base()
        .iter()
        .enumerate()
        .map(|(i, x)| x + scale * (((i + phase) % 5) as f32 - 2.0))
        .collect()
}

/// ‖c − r‖ / ‖r‖ in binary64 over the f32 values.
fn rel_l2(r: &[f32], c: &[f32]) -> f64 {
    let (mut dd, mut rr) = (0.0f64, 0.0f64);
    for (a, b) in r.iter().zip(c) {
        let d = *b as f64 - *a as f64;
        dd += d * d;
        rr += *a as f64 * *a as f64;
    }
    (dd / rr).sqrt()
}

fn policy(k: f64) -> Policy {
    Policy::parse(&format!(
        r#"{{"format": "tracegate-policy/1", "name": "noise", "rules": [{{"pattern": "**", "max_noise_ratio": {k}}}]}}"#
    ))
    .unwrap()
}

fn judged(r: &Trace, c: &Trace, noise: Trace, k: f64) -> tracegate_diff::Report {
    let opts = Options {
        policy: Some(policy(k)),
        noise: Some(NoiseReference(std::sync::Arc::new(noise))),
        ..Options::default()
    };
    compare(r, c, &opts)
}

fn row<'a>(rep: &'a tracegate_diff::Report, name: &str) -> &'a tracegate_diff::TensorRow {
    rep.per_tensor.iter().find(|r| r.tensor == name).unwrap()
}

fn noise_violation(rep: &tracegate_diff::Report, name: &str) -> Option<Option<f64>> {
    row(rep, name)
        .violations
        .iter()
        .find(|v| v.bound == "max_noise_ratio")
        .map(|v| {
            v.value.map(|a| match a {
                tracegate_diff::Amount::Real(x) => x.0,
                tracegate_diff::Amount::Count(n) => n as f64,
            })
        })
}

#[test]
fn within_k_times_the_noise_passes_and_beyond_it_fails_with_the_ratio() {
    let d = tempfile::tempdir().unwrap();
    let r = write(&d.path().join("r.trace"), &[(NAME, base())]);
    let noise = moved(2e-3, 0);
    let want_noise = rel_l2(&base(), &noise);
    for (scale, k, passes) in [(1e-3f32, 1.0, true), (6e-3, 1.0, false), (6e-3, 4.0, true)] {
        let cand = moved(scale, 2);
        let c = write(
            &d.path().join(format!("c{scale}.trace")),
            &[(NAME, cand.clone())],
        );
        let n = write(&d.path().join("n.trace"), &[(NAME, noise.clone())]);
        let rep = judged(&r, &c, n, k);
        let ratio = rel_l2(&base(), &cand) / want_noise;
        let rule = row(&rep, NAME).rule.as_ref().unwrap();
        let measured_noise = rule.noise_rel_l2.unwrap().unwrap().0;
        assert!(
            (measured_noise / want_noise - 1.0).abs() < 1e-9,
            "{measured_noise} vs {want_noise}"
        );
        assert_eq!(ratio <= k, passes, "ratio {ratio} vs k {k}");
        if passes {
            assert_eq!(rep.verdict, Verdict::WithinPolicy, "scale {scale}, k {k}");
            assert_eq!(row(&rep, NAME).status, RowStatus::WithinPolicy);
        } else {
            assert_eq!(rep.verdict, Verdict::Different);
            let got = noise_violation(&rep, NAME).unwrap().unwrap();
            assert!((got / ratio - 1.0).abs() < 1e-9, "{got} vs {ratio}");
        }
    }
}

#[test]
fn a_port_more_precise_than_the_noise_never_fails_for_it_however_far_from_f32() {
    // The candidate's error (1e-2 scale) is far outside any f32 bound, yet below the noise
    // reference's: the noise-relative bound alone passes it.
    let d = tempfile::tempdir().unwrap();
    let r = write(&d.path().join("r.trace"), &[(NAME, base())]);
    let c = write(&d.path().join("c.trace"), &[(NAME, moved(1e-2, 1))]);
    let n = write(&d.path().join("n.trace"), &[(NAME, moved(2e-2, 3))]);
    let rep = judged(&r, &c, n, 1.0);
    assert_eq!(rep.verdict, Verdict::WithinPolicy);
}

#[test]
fn a_noise_trace_that_cannot_measure_the_tensor_fails_it_never_passes_it() {
    let d = tempfile::tempdir().unwrap();
    let r = write(
        &d.path().join("r.trace"),
        &[(NAME, base()), ("layer.01.mlp_out", base())],
    );
    let c = write(
        &d.path().join("c.trace"),
        &[(NAME, moved(1e-3, 2)), ("layer.01.mlp_out", moved(1e-3, 2))],
    );
    let mut nan = moved(2e-3, 0);
    nan[7] = f32::NAN;
    let cases: Vec<(&str, Trace)> = vec![
        // The tensor is absent from the noise trace (layer.01 is there, layer.00 is not).
        (
            "absent",
            write(
                &d.path().join("n1.trace"),
                &[("layer.01.mlp_out", moved(2e-3, 0))],
            ),
        ),
        // Exact in the noise trace while the candidate is not: that precision computes it exactly.
        (
            "exact",
            write(&d.path().join("n2.trace"), &[(NAME, base())]),
        ),
        // Another shape: [4, 16] instead of [2, 32].
        ("shape", {
            let path = d.path().join("n3.trace");
            let prov = serde_json::json!({"producer": "oracle", "weights_digest": "w-1", "prompt_tokens": [1, 2]});
            let mut w = TraceWriter::create(&path, prov).unwrap();
            let attrs = Attributes::default()
                .with_path("prefill")
                .with_mask("causal")
                .with_positions(vec![0, 1, 2, 3]);
            let bytes: Vec<u8> = moved(2e-3, 0)
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect();
            w.tensor(NAME, DType::F32, &[4, 16], &bytes, &attrs)
                .unwrap();
            w.finish().unwrap();
            Trace::open(&path).unwrap()
        }),
        // NaN in the noise trace: its relative L2 is no measure of honest noise.
        ("nan", write(&d.path().join("n5.trace"), &[(NAME, nan)])),
    ];
    for (case, n) in cases {
        let rep = judged(&r, &c, n, 1e6);
        assert_eq!(
            rep.verdict,
            Verdict::Different,
            "{case}: {:?}",
            rep.findings
        );
        assert_eq!(row(&rep, NAME).status, RowStatus::OutsidePolicy, "{case}");
        let v = noise_violation(&rep, NAME).unwrap_or_else(|| panic!("{case}: no violation"));
        assert!(v.is_none_or(|x| x.is_nan()), "{case}: ratio {v:?} measured");
    }
}

#[test]
fn a_noise_trace_from_other_weights_or_another_prompt_is_refused_as_incomparable() {
    let d = tempfile::tempdir().unwrap();
    let r = write(&d.path().join("r.trace"), &[(NAME, base())]);
    let c = write(&d.path().join("c.trace"), &[(NAME, moved(1e-3, 2))]);
    for (case, weights, positions, named) in [
        ("weights", "w-2", vec![0, 1], "w-2"),
        ("positions", "w-1", vec![5, 6], "[5, 6]"),
    ] {
        let n = write_with(
            &d.path().join(format!("n-{case}.trace")),
            weights,
            positions,
            &[(NAME, moved(2e-3, 0))],
        );
        let rep = judged(&r, &c, n, 1e6);
        assert_eq!(rep.verdict, Verdict::Incomparable, "{case}");
        assert!(
            rep.findings
                .iter()
                .any(|f| f.detail.starts_with("noise reference") && f.detail.contains(named)),
            "{case}: {:?}",
            rep.findings
        );
    }
}

#[test]
fn the_cli_refuses_a_bound_without_a_noise_trace_and_a_noise_trace_nothing_reads() {
    let d = tempfile::tempdir().unwrap();
    write(&d.path().join("r.trace"), &[(NAME, base())]);
    write(&d.path().join("c.trace"), &[(NAME, moved(1e-3, 2))]);
    write(&d.path().join("n.trace"), &[(NAME, moved(2e-3, 0))]);
    let noise_policy = d.path().join("noise.json");
    std::fs::write(
        &noise_policy,
        r#"{"format": "tracegate-policy/1", "name": "noise", "rules": [{"pattern": "**", "max_noise_ratio": 2}]}"#,
    )
    .unwrap();
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_trace-diff"))
            .current_dir(d.path())
            .args(["r.trace", "c.trace"])
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    let (code, err) = run(&["--policy", "noise.json"]);
    assert_eq!(code, Some(2));
    assert!(
        err.contains("max_noise_ratio") && err.contains("--noise-reference"),
        "{err}"
    );
    let (code, err) = run(&["--noise-reference", "n.trace"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("nothing would read it"), "{err}");
    let (code, err) = run(&[
        "--policy",
        "noise.json",
        "--noise-reference",
        "missing.trace",
    ]);
    assert_eq!(code, Some(2));
    assert!(err.contains("missing.trace"), "{err}");
    let (code, err) = run(&["--policy", "noise.json", "--noise-reference", "n.trace"]);
    assert_eq!(code, Some(0), "{err}");
}

/// The adversary supplies its own noise: its own trace (every ratio 1, its own near-ties sized by
/// itself), a copy under another producer name, or another port's run. Each is refused before
/// anything is judged, whatever the policy.
#[test]
fn a_noise_trace_the_candidate_supplies_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let r = write(&d.path().join("r.trace"), &[(NAME, base())]);
    // 3e-2 is far beyond the f32 policy and beyond 2x any honest noise below.
    let c = write(&d.path().join("c.trace"), &[(NAME, moved(3e-2, 2))]);
    // The candidate itself (same content digest), and another port's run of the same numbers
    // (the candidate's own trace would not be its own content once anything differs): refused,
    // by content and by producer.
    let other = write(&d.path().join("c-other.trace"), &[(NAME, moved(3e-2, 3))]);
    for (noise, why) in [
        (Trace::open(c.path()).unwrap(), "the candidate's own"),
        (other, "\"my-port\""),
    ] {
        let rep = judged(&r, &c, noise, 2.0);
        assert_eq!(rep.verdict, Verdict::Incomparable);
        assert!(
            rep.findings
                .iter()
                .any(|f| f.kind == FindingKind::NoiseReferenceRefused && f.detail.contains(why)),
            "{why}: {:#?}",
            rep.findings
        );
    }
    // The control: tracegate's own run of the same noise size is read, and the candidate fails.
    let honest = write(&d.path().join("n.trace"), &[(NAME, moved(1e-3, 3))]);
    assert_eq!(judged(&r, &c, honest, 2.0).verdict, Verdict::Different);
}

/// The policy-wide noise ratio (`noise_ratio.max_ratio`, the f32 policy's 10): beside a noise
/// reference every rule is also a noise-relative bound; without one, or where the noise is 0,
/// the rule's own bounds stand alone.
#[test]
fn the_policy_noise_ratio_holds_every_tensor_to_k_times_the_noise_run() {
    let d = tempfile::tempdir().unwrap();
    let f32_policy = |noise: Option<Trace>| Options {
        policy: Some(Policy::resolve("f32", Path::new(".")).unwrap()),
        noise: noise.map(|n| NoiseReference(std::sync::Arc::new(n))),
        ..Options::default()
    };
    assert_eq!(
        Policy::resolve("f32", Path::new("."))
            .unwrap()
            .noise_ratio
            .map(|n| n.max_ratio),
        Some(10.0)
    );
    // `layer.00.mlp_out` (rule: rel L2 1e-4): the noise run at ~1e-6, a candidate at ~3e-5 —
    // inside the f32 rule, 30x the noise (an eps defect's size on the fixtures).
    let r = write(&d.path().join("r.trace"), &[(NAME, base())]);
    let n = || write(&d.path().join("n.trace"), &[(NAME, moved(1e-6, 0))]);
    let bad = write(&d.path().join("c-bad.trace"), &[(NAME, moved(3e-5, 2))]);
    let honest = write(&d.path().join("c-ok.trace"), &[(NAME, moved(2e-6, 2))]);
    let ratio = |c: &[f32]| rel_l2(&base(), c) / rel_l2(&base(), &moved(1e-6, 0));
    assert!(ratio(&moved(3e-5, 2)) > 10.0 && rel_l2(&base(), &moved(3e-5, 2)) < 1e-4);
    assert!(ratio(&moved(2e-6, 2)) < 10.0);
    let rep = compare(&r, &bad, &f32_policy(Some(n())));
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(noise_violation(&rep, NAME).flatten().unwrap() > 10.0);
    assert_eq!(
        compare(&r, &honest, &f32_policy(Some(n()))).verdict,
        Verdict::WithinPolicy
    );
    // Without the noise run the same defect is within the f32 policy: the noise run is what
    // sees it, not a tighter bound.
    assert_eq!(
        compare(&r, &bad, &f32_policy(None)).verdict,
        Verdict::WithinPolicy
    );
    // A noise run equal to the reference (noise 0) is no bound: the rule alone judges.
    let zero = write(&d.path().join("n0.trace"), &[(NAME, base())]);
    let rep = compare(&r, &bad, &f32_policy(Some(zero)));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:#?}", rep.findings);
}
