//! "Which tolerance?" (`passing_bounds`): the bounds a report says would have passed do pass,
//! exactly — written into the policy, every tensor they name is within it — and nothing smaller
//! does: each bound moved one step tighter fails a tensor again. A NaN is named as unpassable and
//! stays outside whatever the bounds.

use tracegate_diff::{compare, Amount, Options, Policy, RowStatus};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

fn write(path: &std::path::Path, tensors: &[(&str, Vec<f32>)]) -> Trace {
    let prov = serde_json::json!({"producer": "my-port", "weights_digest": "w-1", "prompt_tokens": [1, 2]});
    let mut w = TraceWriter::create(path, prov).unwrap();
    let attrs = Attributes::default()
        .with_path("prefill")
        .with_mask("causal")
        .with_positions(vec![0, 1]);
    for (name, v) in tensors {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        w.tensor(name, DType::F32, &[2, (v.len() / 2) as u64], &bytes, &attrs)
            .unwrap();
    }
    w.finish().unwrap();
    Trace::open(path).unwrap()
}

fn set(policy: &mut Policy, index: usize, bound: &str, v: Amount) {
    let r = &mut policy.rules[index];
    let real = match v {
        Amount::Count(n) => n as f64,
        Amount::Real(x) => x.0,
    };
    match bound {
        "max_ulp" => r.max_ulp = Some(real as u64),
        "max_abs" => r.max_abs = Some(real),
        "max_rel" => r.max_rel = Some(real),
        "max_rel_l2" => r.max_rel_l2 = Some(real),
        "min_cosine" => r.min_cosine = Some(real),
        "max_scale_error" => r.max_scale_error = Some(real),
        other => panic!("bound {other}"),
    }
}

/// One step tighter: the next f64 towards failing (a count one less).
fn tighter(bound: &str, v: Amount) -> Amount {
    match v {
        Amount::Count(n) => Amount::Count(n - 1),
        Amount::Real(x) if bound == "min_cosine" => {
            Amount::Real(tracegate_diff::Real(x.0.next_up()))
        }
        Amount::Real(x) => Amount::Real(tracegate_diff::Real(x.0.next_down())),
    }
}

#[test]
fn the_passing_bounds_pass_exactly_and_a_nan_never_does() {
    let dir = tempfile::tempdir().unwrap();
    let base: Vec<f32> = (0..16).map(|i| (i as f32 * 0.37).sin() + 0.1).collect();
    let nudged = |scale: f32| -> Vec<f32> {
        base.iter()
            .enumerate()
            .map(|(i, x)| x + scale * ((i % 3) as f32 - 1.0))
            .collect()
    };
    let mut with_nan = base.clone();
    with_nan[5] = f32::NAN;
    let reference = write(
        &dir.path().join("r.trace"),
        &[
            ("layer.00.attn_out", base.clone()),
            ("layer.01.attn_out", base.clone()),
            ("layer.00.mlp_out", base.clone()),
            ("logits", base.clone()),
        ],
    );
    let candidate = write(
        &dir.path().join("c.trace"),
        &[
            ("layer.00.attn_out", nudged(1e-3)),
            ("layer.01.attn_out", nudged(3e-3)),
            ("layer.00.mlp_out", with_nan),
            ("logits", base.clone()),
        ],
    );
    let policy = Policy::resolve("f32", std::path::Path::new(".")).unwrap();
    let judged = |p: &Policy| {
        compare(
            &reference,
            &candidate,
            &Options {
                policy: Some(p.clone()),
                ..Options::default()
            },
        )
    };
    let rep = judged(&policy);
    let status =
        |rep: &tracegate_diff::Report, name: &str| crate::common::tensor_row(rep, name).status;
    assert_eq!(status(&rep, "layer.01.attn_out"), RowStatus::OutsidePolicy);
    let passing = rep.passing_bounds();
    let attn = passing
        .iter()
        .find(|p| p.rule.pattern == "layer.*.attn_out")
        .expect("the attn_out rule");
    assert_eq!(attn.tensors, ["layer.00.attn_out", "layer.01.attn_out"]);
    assert!(attn.unpassable.is_empty(), "{:?}", attn.unpassable);
    assert!(!attn.bounds.is_empty());
    let mlp = passing
        .iter()
        .find(|p| p.rule.pattern == "layer.*.mlp_out")
        .expect("the mlp_out rule");
    assert!(
        mlp.unpassable
            .iter()
            .any(|u| u.starts_with("layer.00.mlp_out")),
        "{:?}",
        mlp.unpassable
    );
    // Written into the policy, they pass both attn_out tensors; the NaN stays outside.
    let mut loosened = policy.clone();
    for p in &passing {
        for (bound, v) in &p.bounds {
            set(&mut loosened, p.rule.index, bound, *v);
        }
    }
    let again = judged(&loosened);
    for t in ["layer.00.attn_out", "layer.01.attn_out"] {
        assert_eq!(status(&again, t), RowStatus::WithinPolicy, "{t}");
    }
    assert_eq!(status(&again, "layer.00.mlp_out"), RowStatus::OutsidePolicy);
    assert!(again
        .passing_bounds()
        .iter()
        .all(|p| p.rule.pattern == "layer.*.mlp_out"));
    // Each bound one step tighter fails an attn_out tensor again: none is larger than needed.
    for (bound, v) in &attn.bounds {
        let mut tight = loosened.clone();
        set(&mut tight, attn.rule.index, bound, tighter(bound, *v));
        let rep = judged(&tight);
        assert!(
            ["layer.00.attn_out", "layer.01.attn_out"]
                .iter()
                .any(|t| status(&rep, t) == RowStatus::OutsidePolicy),
            "{bound} one step tighter than {v} still passes"
        );
    }
}
