//! Labels of flipped decisions and the excusal of rows after a near-tie (docs/diff.md,
//! "Labels" and "Near-ties under a policy"), on planted model-shaped traces: each label, the
//! upstream tensor a consequence names, a near-tie that excuses exactly its token's later rows,
//! and negative controls where the same flip or a difference elsewhere still fails.

use crate::common;

use common::*;
use tracegate_diff::{compare_files, render_human, NearTie, Options, Policy, Report, Verdict};
use tracegate_trace::Attributes;

/// (label, upstream, after) of the flip at `row` of `decision`.
fn flip(rep: &Report, decision: &str, row: u64) -> (&'static str, Option<String>, Option<String>) {
    let f = flip_at(rep, decision, row);
    (f.label.as_str(), f.upstream.clone(), f.after.clone())
}

fn status<'a>(rep: &'a Report, tensor: &str) -> &'a str {
    tensor_row(rep, tensor).status.as_str()
}

fn get_f32(s: &Spec, name: &str, i: usize) -> f32 {
    let t = s.tensors.iter().find(|t| t.name == name).unwrap();
    f32::from_le_bytes(t.bytes[i * 4..i * 4 + 4].try_into().unwrap())
}

/// Adds `by` to every element of token `token`'s rows: the first axis, or for `attn_probs`
/// (`[heads, tokens, keys]`) the second, in every head.
fn push_token(s: &mut Spec, name: &str, token: usize, by: f32) {
    let shape = s
        .tensors
        .iter()
        .find(|t| t.name == name)
        .unwrap()
        .shape
        .clone();
    let spans: Vec<(usize, usize)> = if name.ends_with(".attn_probs") {
        let (heads, tokens, keys) = (shape[0] as usize, shape[1] as usize, shape[2] as usize);
        (0..heads)
            .map(|h| ((h * tokens + token) * keys, (h * tokens + token + 1) * keys))
            .collect()
    } else {
        let width = shape[1..].iter().product::<u64>() as usize;
        vec![(token * width, (token + 1) * width)]
    };
    for (a, b) in spans {
        for i in a..b {
            let v = get_f32(s, name, i);
            s.set_f32(name, i, v + by);
        }
    }
}

/// The common model with `layer.01.attn_probs` (`[2 heads, 4 tokens, 4 keys]`, before
/// `layer.01.attn_out`, as the producers capture it) and two decode steps: step 0 is the
/// argmax of the last logits row (14, margin 0.75, as `logits.argmax` row 3).
fn model_ext() -> Spec {
    let mut m = crafted();
    let at = m
        .tensors
        .iter()
        .position(|t| t.name == "layer.01.attn_out")
        .unwrap();
    let probs: Vec<f32> = values(32, 17).iter().map(|v| (v + 1.7) / 4.0).collect();
    m.tensors
        .insert(at, t_f32("layer.01.attn_probs", &[2, 4, 4], &probs));
    m.decisions.push(D {
        name: "decode.0000.argmax".into(),
        shape: vec![1],
        values: vec![14],
        margins: Some(vec![0.75]),
    });
    m.decide();
    m.decisions.push(D {
        name: "decode.0001.argmax".into(),
        shape: vec![1],
        values: vec![3],
        margins: Some(vec![2.0]),
    });
    m
}

/// Every tensor captured after `layer.00.router.logits`.
const AFTER_ROUTER_0: [&str; 10] = [
    "layer.00.mlp_out",
    "layer.00.hidden_out",
    "layer.01.hidden_in",
    "layer.01.attn_probs",
    "layer.01.attn_out",
    "layer.01.router.logits",
    "layer.01.mlp_out",
    "layer.01.hidden_out",
    "final_norm.out",
    "logits",
];

/// The reference and an oracle-like candidate where token 3's router row in layer 0 moved by
/// `moved` (element 12, expert 0, the runner-up `1e-6` below expert 1: [`crafted`]), so the
/// candidate's own scores pick [2, 0] instead of [2, 1]. Token 3 then took another expert: its
/// rows differ widely in every later tensor and its later decisions flip (layer 1's router,
/// the last logits row, both decode steps), each taken from the candidate's own scores.
fn near_tie_pair(moved: f32) -> (Spec, Spec) {
    let r = model_ext();
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = get_f32(&r, "layer.00.router.logits", 12);
    c.set_f32("layer.00.router.logits", 12, v + moved);
    for name in AFTER_ROUTER_0 {
        push_token(
            &mut c,
            name,
            3,
            if name.ends_with("attn_probs") {
                0.25
            } else {
                1.0
            },
        );
    }
    // Token 3's later choices: layer 1's router [0, 1] (was [3, 2]), its logits 5 (was 14).
    for (e, z) in [1.0, 0.5, -0.5, -1.0].into_iter().enumerate() {
        c.set_f32("layer.01.router.logits", 12 + e, z);
    }
    c.raise("logits", 3, 5, 0.5);
    c.decide();
    c.decision_mut("decode.0001.argmax").values[0] = 4;
    (r, c)
}

/// The divergence element 12 of `layer.00.router.logits` gets in `near_tie_pair(moved)`:
/// f32 rounding of the planted value, measured here in f64.
fn moved_by(r: &Spec, moved: f32) -> f64 {
    let v = get_f32(r, "layer.00.router.logits", 12);
    ((v + moved) as f64 - v as f64).abs()
}

/// The gap the near-tie crosses in the reference's own scores: expert 1's logit minus expert 0's.
fn crafted_gap(r: &Spec) -> f64 {
    get_f32(r, "layer.00.router.logits", 13) as f64
        - get_f32(r, "layer.00.router.logits", 12) as f64
}

#[test]
fn a_near_tie_excuses_its_tokens_later_rows_and_decisions() {
    let (r, c) = near_tie_pair(2e-6);
    let d = moved_by(&r, 2e-6);
    assert!(
        crafted_gap(&r) <= 2.0 * d,
        "the plant must put the gap within 2·d: d = {d}"
    );
    assert_eq!(
        c.decisions[0].values[6..8],
        [2, 0],
        "the candidate's own scores pick expert 0"
    );
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::NotChecked, "{:#?}", rep.findings);
    assert!(rep.findings.is_empty(), "{:#?}", rep.findings);

    let res = decision_result(&rep, "layer.00.router.topk");
    let f = &res.flips[0];
    assert_eq!((f.row, f.label.as_str()), (3, "near-tie"));
    assert_eq!(f.source_divergence.unwrap().0, d);
    // The bound is the policy's honest noise of router logits (1e-4), factor 2: not 2·d.
    assert_eq!(f.noise_bound.unwrap().0, 2.0 * 1e-4);
    assert_eq!(f.honest_noise_from.as_deref(), Some("policy"));
    assert_eq!(f.gap.unwrap().0, crafted_gap(&r));

    let origin = Some("layer.00.router.topk row 3".to_string());
    for (decision, row) in [
        ("layer.01.router.topk", 3),
        ("logits.argmax", 3),
        ("decode.0000.argmax", 0),
        ("decode.0001.argmax", 0),
    ] {
        assert_eq!(
            flip(&rep, decision, row),
            ("after-near-tie", None, origin.clone()),
            "{decision}"
        );
    }
    // Nothing hidden: the near-tie, each tensor's rows left out, the decision rows.
    let n = rep.decisions.near_ties.as_ref().unwrap();
    assert_eq!(
        n.excused
            .iter()
            .map(|e| (e.decision.as_str(), e.row, e.position))
            .collect::<Vec<_>>(),
        [("layer.00.router.topk", 3, 3)]
    );
    assert_eq!(
        n.tensors
            .iter()
            .map(|t| (t.tensor.as_str(), t.rows))
            .collect::<Vec<_>>(),
        AFTER_ROUTER_0.map(|t| (t, 1))
    );
    assert_eq!(n.decision_rows, 4);
    for t in AFTER_ROUTER_0 {
        assert_eq!(status(&rep, t), "within_policy", "{t}");
    }
    let human = render_human(&rep);
    let first = human.lines().next().unwrap();
    assert!(first.starts_with("NOT CHECKED past a near-tie"), "{first}");
    assert!(
        first.contains(
            "(1 near-tie excused: layer.00.router.topk row 3; 14 rows after a near-tie not judged)"
        ),
        "{first}"
    );
    assert!(
        human.contains("after a near-tie (layer.00.router.topk row 3)"),
        "{human}"
    );
    let json = report_json(&rep);
    assert_eq!(
        json["decisions"]["near_ties"]["excused"][0]["decision"],
        "layer.00.router.topk"
    );
    assert_eq!(
        json["decisions"]["near_ties"]["tensors"][3]["tensor"],
        "layer.01.attn_probs"
    );
}

#[test]
fn another_tokens_difference_after_a_near_tie_still_fails() {
    // Token 1's row of layer.01.hidden_out, and separately token 1's query row of attn_probs
    // (its second axis), moved: not after the near-tie, so still judged.
    for (tensor, by) in [("layer.01.hidden_out", 1.0), ("layer.01.attn_probs", 0.25)] {
        let (r, mut c) = near_tie_pair(2e-6);
        push_token(&mut c, tensor, 1, by);
        c.decision_mut("logits.argmax").values[1] = 0;
        let rep = diff(&r, &c, Some(oracle_policy()));
        assert_eq!(rep.verdict, Verdict::Different, "{tensor}");
        assert_eq!(status(&rep, tensor), "outside_policy", "{tensor}");
        assert_eq!(
            rep.findings
                .iter()
                .filter(|f| f.kind.as_str() == "outside_policy")
                .map(|f| f.tensor())
                .collect::<Vec<_>>(),
            [Some(tensor)]
        );
        assert_eq!(
            flip(&rep, "layer.00.router.topk", 3).0,
            "near-tie",
            "{tensor}"
        );
        assert_eq!(
            flip(&rep, "logits.argmax", 1),
            ("consequence", Some(tensor.to_string()), None),
            "{tensor}"
        );
        assert_eq!(
            flip(&rep, "logits.argmax", 3).0,
            "after-near-tie",
            "{tensor}"
        );
        // Token 3's row was still left out of that tensor's judgement, and said so.
        let n = rep.decisions.near_ties.as_ref().unwrap();
        assert!(
            n.tensors.iter().any(|t| t.tensor == tensor && t.rows == 1),
            "{tensor}"
        );
        let first = render_human(&rep).lines().next().unwrap().to_string();
        assert!(
            first.starts_with("DIFFERENT") && first.contains("1 near-tie excused"),
            "{first}"
        );
    }
}

#[test]
fn a_flip_its_own_scores_do_not_make_is_a_defect_and_excuses_nothing() {
    // The router row moved by a few ULP only: 2·d < 1e-6, so the candidate's own scores still
    // pick [2, 1]; it records [2, 0] all the same (a decision rule that does not follow its
    // scores). The measured noise cannot explain that flip.
    let (r, mut c) = near_tie_pair(2e-7);
    assert!(2.0 * moved_by(&r, 2e-7) < crafted_gap(&r));
    assert_eq!(
        c.decisions[0].values[6..8],
        [2, 1],
        "honest scores: no flip"
    );
    c.decision_mut("layer.00.router.topk").values[7] = 0;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        flip(&rep, "layer.00.router.topk", 3),
        ("defect", None, None)
    );
    let f = &rep.decisions.results[0].flips[0];
    assert!(
        f.why
            .as_deref()
            .is_some_and(|w| w
                .contains("candidate's own layer.00.router.logits row does not pick its choice")),
        "{f:?}"
    );
    assert!(render_human(&rep)
        .contains("defect: the candidate's own layer.00.router.logits row does not pick"));

    // Its token's later rows are judged, so the first of them is outside the policy and every
    // later flip is its consequence.
    assert_eq!(status(&rep, "layer.00.mlp_out"), "outside_policy");
    let upstream = Some("layer.00.mlp_out".to_string());
    for (decision, row) in [
        ("layer.01.router.topk", 3),
        ("logits.argmax", 3),
        ("decode.0000.argmax", 0),
        ("decode.0001.argmax", 0),
    ] {
        assert_eq!(
            flip(&rep, decision, row),
            ("consequence", upstream.clone(), None),
            "{decision}"
        );
    }
    let n = rep.decisions.near_ties.as_ref().unwrap();
    assert!(
        n.excused.is_empty() && n.tensors.is_empty() && n.decision_rows == 0,
        "{n:?}"
    );
    assert!(!render_human(&rep)
        .lines()
        .next()
        .unwrap()
        .contains("near-tie"));
}

#[test]
fn the_near_tie_factor_comes_from_the_policy() {
    let (r, c) = near_tie_pair(2e-6);
    let d = moved_by(&r, 2e-6);
    // 0.4·d < 1e-6 ≤ 2·d: the same flip is a defect under a stricter calibration.
    assert!(0.4 * d < 1e-6);
    let mut strict = oracle_policy();
    // The honest noise of the router's scores set to the candidate's own divergence here, so
    // only the factor differs from the default calibration.
    strict.near_tie = Some(NearTie {
        margin_factor: 0.4,
        noise_abs: vec![tracegate_diff::NoiseAbs {
            pattern: "layer.*.router.logits".into(),
            max_abs: d,
            why: "test".into(),
            scope: None,
        }],
        why: "test".into(),
    });
    let rep = diff(&r, &c, Some(strict));
    assert_eq!(rep.verdict, Verdict::Different);
    let res = decision_result(&rep, "layer.00.router.topk");
    assert_eq!(
        (
            res.flips[0].label.as_str(),
            res.flips[0].noise_bound.unwrap().0
        ),
        ("defect", 0.4 * d)
    );
    assert_eq!(rep.decisions.near_ties.as_ref().unwrap().margin_factor, 0.4);
    // The field is checked when the policy is read.
    let base =
        r#"{"format":"tracegate-policy/1","name":"x","rules":[{"pattern":"**","max_abs":1}]"#;
    assert_eq!(
        Policy::parse(&format!(
            r#"{base},"near_tie":{{"margin_factor":3,"why":"w"}}}}"#
        ))
        .unwrap()
        .near_tie_factor(),
        3.0
    );
    assert_eq!(
        Policy::parse(&format!("{base}}}"))
            .unwrap()
            .near_tie_factor(),
        2.0
    );
    for bad in [
        r#""near_tie":{"margin_factor":-1}"#,
        r#""near_tie":{"factor":2}"#,
        r#""near_tie":{}"#,
    ] {
        assert!(Policy::parse(&format!("{base},{bad}}}")).is_err(), "{bad}");
    }
}

#[test]
fn without_a_policy_there_is_no_near_tie() {
    // The same flip judged by bits: its source differs, so it is a consequence of the first
    // differing tensor, and nothing is excused.
    let (r, c) = near_tie_pair(2e-6);
    let rep = diff(&r, &c, None);
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        flip(&rep, "layer.00.router.topk", 3),
        ("consequence", Some("layer.00.router.logits".into()), None)
    );
    assert!(rep.decisions.near_ties.is_none());
}

#[test]
fn a_consequence_names_the_first_tensor_outside_the_policy_before_it() {
    // A planted bug in layer 1's attention (every query row changed, as a bidirectional mask
    // does): attn_probs and everything after it are far outside the policy.
    let r = model_ext();
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    for name in &AFTER_ROUTER_0[3..] {
        for token in 0..4 {
            push_token(
                &mut c,
                name,
                token,
                if name.ends_with("attn_probs") {
                    0.25
                } else {
                    1.0
                },
            );
        }
    }
    c.decision_mut("layer.01.router.topk").values[0] = 3;
    c.decision_mut("logits.argmax").values[0] = 6;
    // Layer 0's router comes before the bug, and its scores are bit-identical: a defect.
    c.decision_mut("layer.00.router.topk").values[0] = 1;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    let upstream = Some("layer.01.attn_probs".to_string());
    assert_eq!(
        flip(&rep, "layer.01.router.topk", 0),
        ("consequence", upstream.clone(), None)
    );
    assert_eq!(
        flip(&rep, "logits.argmax", 0),
        ("consequence", upstream, None)
    );
    assert_eq!(
        flip(&rep, "layer.00.router.topk", 0),
        ("defect", None, None)
    );
    assert!(render_human(&rep).contains("→ consequence of layer.01.attn_probs"));

    // Judged by bits, the first tensor that differs at all is named: a 1-ULP change earlier.
    let mut c2 = c.clone();
    c2.poke_f32_bits("layer.00.hidden_out", 5, |b| b + 1);
    let rep = diff(&r, &c2, None);
    assert_eq!(
        flip(&rep, "logits.argmax", 0).1.as_deref(),
        Some("layer.00.hidden_out")
    );
    assert_eq!(
        flip(&rep, "layer.00.router.topk", 0),
        ("defect", None, None)
    );
}

#[test]
fn a_router_without_its_logits_is_downstream_of_its_layers_attention() {
    // Without router.logits the source is layer.00.hidden_in, but the router reads
    // hidden_in + attn_out: a bug in that attention makes the flip its consequence.
    let mut r = model();
    r.tensors.retain(|t| !t.name.ends_with("router.logits"));
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    push_token(&mut c, "layer.00.attn_out", 0, 1.0);
    c.decision_mut("layer.00.router.topk").values[0] = 1;
    let rep = diff(&r, &c, Some(oracle_policy()));
    let res = decision_result(&rep, "layer.00.router.topk");
    assert_eq!(res.source.as_deref(), Some("layer.00.hidden_in"));
    assert_eq!(
        flip(&rep, "layer.00.router.topk", 0),
        ("consequence", Some("layer.00.attn_out".into()), None)
    );
    // Its scores are not in the trace: no noise bound, so on clean inputs a flip is a defect,
    // even where hidden_in's row moved by 100 times the margin (within the policy).
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = get_f32(&r, "layer.00.hidden_in", 3 * 8);
    c.set_f32("layer.00.hidden_in", 3 * 8, v + 1e-4);
    c.decision_mut("layer.00.router.topk").values[6..8].copy_from_slice(&[1, 0]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    let f = &decision_result(&rep, "layer.00.router.topk").flips[0];
    assert!(rep
        .per_tensor
        .iter()
        .all(|t| matches!(t.status.as_str(), "identical" | "within_policy")));
    assert!(
        f.source_divergence.unwrap().0 > 100.0 * 1e-6 * 0.99,
        "{f:?}"
    );
    assert_eq!(
        (f.row, f.label.as_str(), f.noise_bound),
        (3, "defect", None),
        "margin 1e-6, yet no bound from hidden_in: {f:?}"
    );
}

#[test]
fn a_large_margin_flip_with_clean_inputs_is_a_defect() {
    // Every tensor within the policy (a few ULP everywhere after the embedding); row 2 of
    // layer 0's router (margin 0.75) flips anyway.
    let (r, mut c) = oracle_like_pair();
    c.decision_mut("layer.00.router.topk").values[4..6].copy_from_slice(&[0, 1]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert!(rep
        .per_tensor
        .iter()
        .all(|t| matches!(t.status.as_str(), "identical" | "within_policy")));
    assert_eq!(rep.verdict, Verdict::Different);
    let res = decision_result(&rep, "layer.00.router.topk");
    let f = &res.flips[0];
    assert_eq!(
        (f.row, f.label.as_str(), f.upstream.as_deref()),
        (2, "defect", None)
    );
    assert!(f.noise_bound.unwrap().0 < 0.75, "{f:?}");
    assert!(rep.findings.iter().any(
        |x| x.kind.as_str() == "decision_differs" && x.tensor() == Some("layer.00.router.topk")
    ));
    assert!(rep.decisions.near_ties.as_ref().unwrap().excused.is_empty());
}

#[test]
fn a_reorder_is_judged_by_the_swapped_pair_not_the_margin() {
    // layer.01.router.topk row 1 chooses [2, 3]; the candidate orders them [3, 2]. Its recorded
    // margin (k-th minus (k+1)-th) says nothing about the pair: their scores do.
    let build = |z3: f32| {
        let mut r = crafted();
        r.set_f32("layer.01.router.logits", 4 + 2, 1.0);
        r.set_f32("layer.01.router.logits", 4 + 3, z3);
        r.decide();
        assert_eq!(r.decisions[1].values[2..4], [2, 3]);
        let mut c = r.clone();
        c.provenance = oracle_provenance();
        c.set_f32("layer.01.router.logits", 4 + 3, z3 + 2e-6);
        c.decide();
        (r, c)
    };
    let flip_of = |rep: &Report| decision_result(rep, "layer.01.router.topk").flips[0].clone();
    // Gap 1e-6 (as f32) against a row that moved by ~2e-6: the candidate's own scores reorder
    // the pair, a near-tie.
    let (r, c) = build(1.0 - 1e-6);
    assert_eq!(c.decisions[1].values[2..4], [3, 2]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    let f = flip_of(&rep);
    assert!(f.same_values_different_order);
    assert_eq!(f.label.as_str(), "near-tie", "{f:?}");
    assert_eq!(f.gap.unwrap().0, 1.0 - (1.0f32 - 1e-6) as f64);
    // Gap 0.5: no honest movement of ~2e-6 reorders it; a candidate that records [3, 2] anyway
    // is a defect, whatever its (tiny, copied) margin says.
    let (r, mut c) = build(0.5);
    assert_eq!(c.decisions[1].values[2..4], [2, 3]);
    c.decision_mut("layer.01.router.topk").values.swap(2, 3);
    let rep = diff(&r, &c, Some(oracle_policy()));
    let f = flip_of(&rep);
    assert_eq!(
        (f.label.as_str(), f.gap.unwrap().0),
        ("defect", 0.5),
        "{f:?}"
    );
}

#[test]
fn decode_steps_are_bounded_by_their_own_logits_only() {
    // decode.0000 decides from the last logits row (3), whose runner-up (5) is 1e-6 below its
    // top (14) in the reference; that row moved by ~2e-6 and the candidate's own scores pick 5:
    // a near-tie, and the step after it runs on another sequence.
    let mut r = model_ext();
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    r.set_f32("logits", 3 * 16 + 5, top - 1e-6);
    r.decide();
    assert_eq!(r.decisions[3].values, [14]);
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    c.set_f32("logits", 3 * 16 + 14, top - 2e-6);
    c.decide();
    c.decision_mut("decode.0001.argmax").values[0] = 4;
    assert_eq!(c.decisions[3].values, [5]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::NotChecked, "{:#?}", rep.findings);
    assert_eq!(flip(&rep, "logits.argmax", 3).0, "near-tie");
    let origin = Some("logits.argmax row 3".to_string());
    assert_eq!(
        flip(&rep, "decode.0000.argmax", 0),
        ("after-near-tie", None, origin.clone())
    );
    assert_eq!(
        flip(&rep, "decode.0001.argmax", 0),
        ("after-near-tie", None, origin)
    );

    // A later step alone: its own logits are not in the trace, the prompt's do not bound it.
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    c.decision_mut("decode.0001.argmax").values[0] = 4;
    c.decision_mut("decode.0001.argmax").margins = Some(vec![1e-9]);
    let mut r2 = r.clone();
    r2.decision_mut("decode.0001.argmax").margins = Some(vec![1e-9]);
    let rep = diff(&r2, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    let res = decision_result(&rep, "decode.0001.argmax");
    assert_eq!(
        (res.flips[0].label.as_str(), res.flips[0].noise_bound),
        ("defect", None)
    );
}

// --- attacks: candidates built to make an excusal rule say "agrees" about a defect ----------
// Each would have passed before the near-tie rule read the scores (docs/diff.md, "The
// near-tie rule"); each must now fail, naming why.

fn diff_with(r: &Spec, c: &Spec, opts: Options) -> Report {
    let (_dir, rp, cp) = pair(r, c);
    compare_files(&rp, &cp, &opts)
}

/// The reference's logits row 3 with its top two 1e-5 apart (14 above 5), and a token 8.0
/// below the top (0).
fn near_tie_logits() -> Spec {
    let mut r = model_ext();
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    r.set_f32("logits", 3 * 16 + 5, top - 1e-5);
    r.set_f32("logits", 3 * 16, top - 8.0);
    r.decide();
    r
}

#[test]
fn attack_a_flip_far_below_the_top_is_no_near_tie() {
    // The reference's top two are 1e-5 apart; the candidate's logits row moved by 2e-5 (a
    // recorded margin of 1e-5 would be "within 2·d"), and it picks token 0, 8.0 below the top,
    // which is not even the argmax of its own row.
    let r = near_tie_logits();
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = get_f32(&r, "logits", 3 * 16 + 7);
    c.set_f32("logits", 3 * 16 + 7, v + 2e-5);
    c.decision_mut("logits.argmax").values[3] = 0;
    c.decision_mut("decode.0000.argmax").values[0] = 0;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different, "{:#?}", rep.findings);
    let f = rep.decisions.results[2].flips[0].clone();
    assert_eq!((f.row, f.label.as_str()), (3, "defect"), "{f:?}");
    assert_eq!(
        f.gap.unwrap().0,
        8.0,
        "the gap is read from the reference's scores"
    );
    assert!(f
        .why
        .unwrap()
        .contains("candidate's own logits row does not pick its choice"));
    // Even a candidate whose own logits do pick it had to move them by 8: outside the policy,
    // so a consequence, never a near-tie.
    let mut c2 = r.clone();
    c2.provenance = oracle_provenance();
    c2.raise("logits", 3, 0, 0.5);
    c2.decide();
    let rep = diff(&r, &c2, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        flip(&rep, "logits.argmax", 3),
        ("consequence", Some("logits".into()), None)
    );
    // The control: the runner-up, picked by the candidate's own moved scores, is a near-tie.
    let mut c3 = r.clone();
    c3.provenance = oracle_provenance();
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    c3.set_f32("logits", 3 * 16 + 14, top - 2e-5);
    c3.decide();
    let rep = diff(&r, &c3, Some(oracle_policy()));
    assert_eq!(
        flip(&rep, "logits.argmax", 3).0,
        "near-tie",
        "{:#?}",
        rep.findings
    );
}

#[test]
fn attack_a_recorded_margin_that_contradicts_the_scores_is_not_believed() {
    // Row 0's logits put 5 1.5 above the rest; the reference records a margin of 1e-6 there, and
    // the candidate flips with its scores moved by 1e-6.
    let mut r = model_ext();
    r.decision_mut("logits.argmax").margins.as_mut().unwrap()[0] = 1e-6;
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = get_f32(&r, "logits", 3);
    c.set_f32("logits", 3, v + 1e-6);
    c.decision_mut("logits.argmax").values[0] = 3;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(flip(&rep, "logits.argmax", 0).0, "defect");
    let contradictions: Vec<_> = rep
        .findings
        .iter()
        .filter(|f| f.kind.as_str() == "margin_contradicts_scores")
        .map(|f| f.detail.clone())
        .collect();
    assert!(
        contradictions
            .iter()
            .any(|d| d.starts_with("the reference's recorded margins contradict its own logits in 1 of 4 rows; first at row 0")),
        "{contradictions:?}"
    );
    // The control: the same reference with its true margin has no such finding.
    let mut honest = r.clone();
    honest.decide();
    let rep = diff(&honest, &honest, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Identical, "{:#?}", rep.findings);
}

#[test]
fn attack_the_best_expert_swapped_for_the_worst_is_no_near_tie() {
    // Token 3's router row is a near-tie between its second (1) and third (0) expert; the
    // candidate, its row moved by 2e-6, records [3, 1]: the worst expert for the best.
    let (r, mut c) = near_tie_pair(2e-6);
    c.decision_mut("layer.00.router.topk").values[6..8].copy_from_slice(&[3, 1]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    let f = &rep.decisions.results[0].flips[0];
    assert_eq!((f.row, f.label.as_str()), (3, "defect"), "{f:?}");
    // Expert 2 (logit 1.0) fell below expert 3 (logit -1.0): the gap crossed is 2.
    assert_eq!(f.gap.unwrap().0, 2.0);
}

#[test]
fn attack_non_finite_values_after_a_near_tie_are_never_excused() {
    // The near-tie excuses token 3's later rows; the candidate writes NaN and +inf into every
    // one of them.
    let (r, mut c) = near_tie_pair(2e-6);
    for name in ["layer.00.hidden_out", "layer.01.mlp_out", "final_norm.out"] {
        let width = c.tensor_mut(name).shape[1] as usize;
        c.set_f32(name, 3 * width, f32::NAN);
        c.set_f32(name, 3 * width + 1, f32::INFINITY);
    }
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(flip(&rep, "layer.00.router.topk", 3).0, "near-tie");
    assert_eq!(rep.verdict, Verdict::Different);
    for name in ["layer.00.hidden_out", "layer.01.mlp_out", "final_norm.out"] {
        let row = tensor_row(&rep, name);
        assert_eq!(
            (row.status.as_str(), row.nan_mismatch, row.infinity),
            ("outside_policy", 1, 1),
            "{name}"
        );
        let worst = row.worst_element.as_ref().unwrap();
        assert_eq!(
            worst.coords[0], 3,
            "{name}: the worst element is in the excused row"
        );
    }
    // The control: the same near-tie without them fails nothing (what follows it is not
    // checked, exit 4, not different).
    let (r, c) = near_tie_pair(2e-6);
    assert_eq!(
        diff(&r, &c, Some(oracle_policy())).verdict,
        Verdict::NotChecked
    );
}

#[test]
fn attack_a_left_out_source_excuses_nothing() {
    // The router logit moved by +50, the worst expert chosen, the token's later rows moved by
    // +100: with the router logits left out by --skip, their divergence (50) would explain
    // any flip.
    let (r, mut c) = near_tie_pair(2e-6);
    let v = get_f32(&r, "layer.00.router.logits", 15);
    c.set_f32("layer.00.router.logits", 15, v + 50.0);
    for name in AFTER_ROUTER_0 {
        push_token(
            &mut c,
            name,
            3,
            if name.ends_with("attn_probs") {
                0.0
            } else {
                100.0
            },
        );
    }
    c.decide();
    assert_eq!(
        c.decisions[0].values[6..8],
        [3, 2],
        "its own scores choose the worst expert"
    );
    let skip = |pattern: &str| Options {
        policy: Some(oracle_policy()),
        filter: tracegate_diff::Filter {
            only: vec![],
            skip: vec![pattern.to_string()],
        },
        ..Options::default()
    };
    for pattern in ["layer.*.router.logits", "layer.00.**"] {
        let rep = diff_with(&r, &c, skip(pattern));
        assert_eq!(
            rep.verdict,
            Verdict::Different,
            "--skip {pattern}: {:#?}",
            rep.findings
        );
        let f = rep
            .decisions
            .results
            .iter()
            .find(|d| d.name == "layer.00.router.topk");
        if let Some(f) = f {
            let f = &f.flips[0];
            assert_eq!(f.label.as_str(), "defect", "--skip {pattern}: {f:?}");
            assert!(
                f.why
                    .as_deref()
                    .unwrap()
                    .contains("was left out by the filter"),
                "{f:?}"
            );
        }
        assert!(rep.decisions.near_ties.as_ref().unwrap().excused.is_empty());
    }
    // Without the filter the same candidate is different too: the logits row is outside.
    assert_eq!(
        diff(&r, &c, Some(oracle_policy())).verdict,
        Verdict::Different
    );
    // The control: an honest near-tie with the same --skip is still a defect (no excuse
    // without the source), never within the policy.
    let (r, c) = near_tie_pair(2e-6);
    let rep = diff_with(&r, &c, skip("layer.*.router.logits"));
    assert_eq!(flip(&rep, "layer.00.router.topk", 3).0, "defect");
}

#[test]
fn attack_router_margins_without_router_logits_get_no_divergence() {
    // Without router.logits the margin's tolerance has no scores to measure: hidden_in moved
    // by 0.05 must not let a router margin move from its value by 0.09.
    let mut r = crafted();
    r.tensors.retain(|t| !t.name.ends_with("router.logits"));
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = get_f32(&r, "layer.00.hidden_in", 0);
    c.set_f32("layer.00.hidden_in", 0, v + 0.05);
    let m = c
        .decision_mut("layer.00.router.topk")
        .margins
        .as_mut()
        .unwrap();
    m[0] += 0.09;
    let rep = diff(&r, &c, Some(oracle_policy()));
    let res = &rep.decisions.results[0];
    assert_eq!(
        (res.margins.as_str(), res.margin_outside_rows),
        ("different", 1),
        "{res:?}"
    );
    assert_eq!(rep.verdict, Verdict::Different);
}

#[test]
fn router_margins_without_router_logits_get_the_policys_honest_noise() {
    // A clean f32 pair without router.logits: a router margin (a probability gap) moved by
    // 5e-5, as f32 rounding moves it deep in a model, is within the policy (2 x the policy's
    // 1e-4 router.logits noise + slack), never judged by 1e-5 alone; 1e-3 is still outside.
    let mut r = crafted();
    r.tensors.retain(|t| !t.name.ends_with("router.logits"));
    for (shift, within) in [(5e-5f32, true), (1e-3, false)] {
        let mut c = r.clone();
        c.provenance = oracle_provenance();
        c.decision_mut("layer.00.router.topk")
            .margins
            .as_mut()
            .unwrap()[0] += shift;
        let rep = diff(&r, &c, Some(oracle_policy()));
        let res = &rep.decisions.results[0];
        assert_eq!(
            res.margin_outside_rows,
            u64::from(!within),
            "{shift}: {res:?}"
        );
        assert_eq!(
            rep.verdict == Verdict::Different,
            !within,
            "{shift}: {:?}",
            rep.verdict
        );
    }
}

#[test]
fn attack_infinite_margins_are_equal_only_by_bits() {
    // A decision without scores in the trace (decode step 1): its margin's tolerance is the
    // slack alone, 1e-5·max(1, |a|, |b|), which an infinite margin would make infinite.
    for bad in [f32::INFINITY, f32::NEG_INFINITY, f32::NAN] {
        let r = model_ext();
        let mut c = r.clone();
        c.provenance = oracle_provenance();
        c.decision_mut("decode.0001.argmax").margins = Some(vec![bad]);
        let rep = diff(&r, &c, Some(oracle_policy()));
        assert_eq!(rep.verdict, Verdict::Different, "{bad}");
        let res = decision_result(&rep, "decode.0001.argmax");
        assert_eq!(
            (res.margins.as_str(), res.margin_outside_rows),
            ("different", 1),
            "{bad}"
        );
        // Both sides infinite, same bits: equal.
        let mut r2 = r.clone();
        r2.decision_mut("decode.0001.argmax").margins = Some(vec![bad]);
        if !bad.is_nan() {
            assert_eq!(
                diff(&r2, &c, Some(oracle_policy())).verdict,
                Verdict::Identical
            );
        }
    }
}

#[test]
fn attack_a_layout_the_excusal_does_not_know_has_no_rows_to_excuse() {
    // A port's own capture point `layer.01.head_probs`, laid out `[4 heads, 4 tokens, 2]` with
    // one position per token (0..3), after token 3's near-tie in layer 0. The candidate moves
    // head 3 at every token, tokens 0-2 before the tie included. Read as token-major, head 3
    // would be "position 3", after the near-tie, and excused whole; the excusal knows the
    // token axis only of the documented capture points, so this row is judged whole.
    let with_head_probs = |s: &mut Spec, defect: bool| {
        let at = s
            .tensors
            .iter()
            .position(|t| t.name == "layer.01.attn_out")
            .unwrap();
        let mut v = values(32, 23);
        if defect {
            v[24..].iter_mut().for_each(|x| *x += 1.0);
        }
        s.tensors
            .insert(at, t_f32("layer.01.head_probs", &[4, 4, 2], &v));
    };
    let mut policy: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../fixtures/policy/oracle-default.json"),
        )
        .unwrap(),
    )
    .unwrap();
    policy["rules"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"pattern": "layer.*.head_probs", "max_rel_l2": 1e-5}));
    let policy = Policy::parse(&policy.to_string()).unwrap();
    let (mut r, mut c) = near_tie_pair(2e-6);
    with_head_probs(&mut r, false);
    // The control: the same tensor on both sides; the near-tie is excused as without it.
    let mut same = c.clone();
    with_head_probs(&mut same, false);
    let rep = diff(&r, &same, Some(policy.clone()));
    assert_eq!(rep.verdict, Verdict::NotChecked, "{:#?}", rep.findings);
    assert_eq!(flip(&rep, "layer.00.router.topk", 3).0, "near-tie");
    with_head_probs(&mut c, true);
    let rep = diff(&r, &c, Some(policy));
    assert_eq!(status(&rep, "layer.01.head_probs"), "outside_policy");
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
}

#[test]
fn a_trace_without_its_weights_digest_or_prompt_says_that_rule_did_not_run() {
    let r = crafted();
    let mut c = r.clone();
    c.provenance
        .as_object_mut()
        .unwrap()
        .remove("weights_digest");
    let rep = diff(&r, &c, None);
    // Same content: still identical, with a note naming the key, the side and NOT CHECKED.
    assert_eq!(rep.verdict, Verdict::Identical);
    let notes: Vec<&str> = rep
        .findings
        .iter()
        .filter(|f| f.kind.as_str() == "comparability_not_checked")
        .map(|f| f.detail.as_str())
        .collect();
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("weights_digest absent from the candidate")
            && notes[0].contains("NOT CHECKED"),
        "{}",
        notes[0]
    );
    assert!(render_human(&rep).contains("comparability_not_checked"));
    // Both keys absent from both sides: two notes.
    let mut r2 = r.clone();
    for s in [&mut r2, &mut c] {
        let p = s.provenance.as_object_mut().unwrap();
        p.remove("weights_digest");
        p.remove("prompt_tokens");
    }
    let rep = diff(&r2, &c, None);
    let n = rep
        .findings
        .iter()
        .filter(|f| f.kind.as_str() == "comparability_not_checked")
        .count();
    assert_eq!(n, 2);
    // The control: both recorded, no note.
    let rep = diff(&r, &r.clone(), None);
    assert!(rep.findings.is_empty(), "{:#?}", rep.findings);
}

#[test]
fn a_name_without_zero_padding_is_named_with_the_references_spelling() {
    // A port that writes `layer.0.hidden_in` gets every such tensor missing and extra; the
    // extra one's finding says what the reference calls it.
    let r = crafted();
    let mut c = r.clone();
    for t in &mut c.tensors {
        t.name = t.name.replace("layer.00.", "layer.0.");
    }
    let rep = diff(&r, &c, None);
    let f = rep
        .findings
        .iter()
        .find(|f| f.tensor() == Some("layer.0.hidden_in"))
        .unwrap();
    assert!(
        f.detail.contains("which has layer.00.hidden_in") && f.detail.contains("zero-padded"),
        "{}",
        f.detail
    );
    // The control: an extra tensor with no padded twin gets no hint.
    let mut c = r.clone();
    c.tensors.push(t_f32("my.point", &[4, 1], &[0.0; 4]));
    let rep = diff(&r, &c, None);
    let f = rep
        .findings
        .iter()
        .find(|f| f.tensor() == Some("my.point"))
        .unwrap();
    assert_eq!(f.detail, "in the candidate, not in the reference");
}

#[test]
fn a_policy_for_another_precision_is_named_and_warned_about() {
    let load = |name: &str| {
        Policy::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join(format!("../fixtures/policy/{name}.json")),
        )
        .unwrap()
    };
    let r = crafted();
    let mut c = r.clone();
    c.provenance = oracle_provenance(); // dtype float32
                                        // One element 1 ULP off: within either policy, so the headline is WITHIN POLICY's.
    let v = get_f32(&r, "layer.00.attn_out", 0);
    c.set_f32("layer.00.attn_out", 0, f32::from_bits(v.to_bits() + 1));
    let mismatch = |rep: &Report| {
        rep.findings
            .iter()
            .filter(|f| f.kind.as_str() == "policy_precision_mismatch")
            .map(|f| f.detail.clone())
            .collect::<Vec<_>>()
    };
    // bf16 bounds on an f32 candidate: far looser than its rounding; said in the headline.
    let rep = diff(&r, &c, Some(load("bf16")));
    let notes = mismatch(&rep);
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(notes[0].contains("is for bf16 candidates, and this candidate computes in f32"));
    let text = render_human(&rep);
    assert!(
        text.lines()
            .next()
            .unwrap()
            .contains("WARNING, they differ"),
        "{text}"
    );
    // The control: the f32 policy on the same candidate names both and warns of nothing.
    let rep = diff(&r, &c, Some(load("oracle-default")));
    assert!(mismatch(&rep).is_empty());
    let text = render_human(&rep);
    assert!(
        text.lines()
            .next()
            .unwrap()
            .contains("(for f32 candidates, as this one)"),
        "{text}"
    );
    // An f32 policy on a bf16 candidate (its dtype, and its declaration: every tensor it
    // writes is f32): honest rounding would break it; said.
    c.provenance["dtype"] = serde_json::json!("bfloat16");
    c.provenance["precision"] = serde_json::json!("bf16");
    let rep = diff(&r, &c, Some(load("oracle-default")));
    assert!(mismatch(&rep)[0].contains("honest reduced-precision rounding breaks them"));
    // Its dtype alone over f32 tensors reads f32, the finer (issue 56: gate read the tensors,
    // trace-diff the dtype, and the one reading keeps the stricter): nothing to warn of.
    c.provenance.as_object_mut().unwrap().remove("precision");
    let rep = diff(&r, &c, Some(load("oracle-default")));
    assert!(mismatch(&rep).is_empty(), "{:?}", mismatch(&rep));
    assert_eq!(
        rep.policy
            .as_ref()
            .unwrap()
            .candidate_computes_in
            .as_deref(),
        Some("f32")
    );
}

#[test]
fn a_weights_digest_of_another_form_points_to_the_function() {
    // A port that records the sha256 of its weights file: refused as other weights, and told
    // how tracegate's digest is made.
    let r = crafted();
    let mut c = r.clone();
    c.provenance["weights_digest"] = serde_json::json!("ab".repeat(32));
    let rep = diff(&r, &c, None);
    assert_eq!(rep.verdict, Verdict::Incomparable);
    let f = &rep.findings[0];
    assert_eq!(f.kind.as_str(), "weights_mismatch");
    assert!(
        f.detail.contains("neither is a tracegate weights digest"),
        "{}",
        f.detail
    );
    assert!(
        f.detail.contains("tracegate.weights_digest(model_dir)"),
        "{}",
        f.detail
    );
    let mut r1 = r.clone();
    r1.provenance["weights_digest"] = serde_json::json!("0".repeat(32));
    let rep = diff(&r1, &c, None);
    assert!(
        rep.findings[0]
            .detail
            .contains("the candidate's is not a tracegate weights digest"),
        "{}",
        rep.findings[0].detail
    );
    // The control: two digests of tracegate's form that differ get no hint.
    let mut r2 = r.clone();
    r2.provenance["weights_digest"] = serde_json::json!("0".repeat(32));
    c.provenance["weights_digest"] = serde_json::json!("1".repeat(32));
    let rep = diff(&r2, &c, None);
    assert!(
        !rep.findings[0].detail.contains("not a tracegate"),
        "{}",
        rep.findings[0].detail
    );
}

/// `model_ext` with the reference's last logits row a near-tie (14 over 5 by 1e-6) and two decode
/// steps' hidden states (`decode.0000.layer.00.hidden_out` at position 4, `decode.0001…` at 5).
fn with_decode_steps() -> Spec {
    let mut r = model_ext();
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    r.set_f32("logits", 3 * 16 + 5, top - 1e-6);
    r.decide();
    for (s, seed) in [(0u64, 95u32), (1, 96)] {
        let mut t = t_f32(
            &format!("decode.{s:04}.layer.00.hidden_out"),
            &[1, 8],
            &values(8, seed),
        );
        t.attrs = Attributes::default()
            .with_path("decode")
            .with_mask("causal")
            .with_positions(vec![4 + s as i64]);
        r.tensors.push(t);
    }
    r
}

/// The candidate of `with_decode_steps`: its last logits row moved by ~2e-6 so its own scores
/// pick 5, and its decode steps (another token, another sequence) far from the reference's.
fn flipped_at_the_last_row(r: &Spec) -> Spec {
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let top = get_f32(r, "logits", 3 * 16 + 14);
    c.set_f32("logits", 3 * 16 + 14, top - 2e-6);
    c.decide();
    c.decision_mut("decode.0001.argmax").values[0] = 4;
    for s in 0..2 {
        push_token(
            &mut c,
            &format!("decode.{s:04}.layer.00.hidden_out"),
            0,
            1.0,
        );
    }
    c
}

#[test]
fn decode_steps_after_a_near_tie_token_leave_the_judgement_whole_and_counted() {
    let r = with_decode_steps();
    let c = flipped_at_the_last_row(&r);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::NotChecked, "{:#?}", rep.findings);
    assert_eq!(flip(&rep, "logits.argmax", 3).0, "near-tie");
    let steps = [
        "decode.0000.layer.00.hidden_out",
        "decode.0001.layer.00.hidden_out",
    ];
    for t in steps {
        assert_eq!(status(&rep, t), "after_near_tie", "{t}");
    }
    let n = rep.decisions.near_ties.as_ref().unwrap();
    let left: Vec<(&str, u64)> = n
        .tensors
        .iter()
        .map(|t| (t.tensor.as_str(), t.rows))
        .collect();
    assert_eq!(left, steps.map(|t| (t, 1)));
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(first.contains("2 after a near-tie not judged"), "{first}");
    assert_eq!(
        report_json(&rep)["per_tensor"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["status"] == "after_near_tie")
            .count(),
        2
    );
}

#[test]
fn attack_decode_steps_after_a_near_tie_hide_no_nan_and_no_step_without_one() {
    let r = with_decode_steps();
    // A NaN in a decode step after the near-tie stays judged.
    let mut c = flipped_at_the_last_row(&r);
    c.set_f32("decode.0001.layer.00.hidden_out", 3, f32::NAN);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        status(&rep, "decode.0001.layer.00.hidden_out"),
        "outside_policy"
    );
    assert_eq!(
        status(&rep, "decode.0000.layer.00.hidden_out"),
        "after_near_tie"
    );
    // The same decode difference with no flip before it is judged, and fails.
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    push_token(&mut c, "decode.0001.layer.00.hidden_out", 0, 1.0);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        status(&rep, "decode.0001.layer.00.hidden_out"),
        "outside_policy"
    );
    // A flip that is no near-tie (the candidate's last row picks 5 by 0.5 over a reference
    // margin of 1e-6 moved by 0.5: a defect) excuses no decode step.
    let mut c = flipped_at_the_last_row(&r);
    c.raise("logits", 3, 5, 0.5);
    c.decide();
    c.decision_mut("decode.0001.argmax").values[0] = 4;
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_ne!(flip(&rep, "logits.argmax", 3).0, "near-tie");
    for s in 0..2 {
        assert_eq!(
            status(&rep, &format!("decode.{s:04}.layer.00.hidden_out")),
            "outside_policy"
        );
    }
    // Without a policy there are no near-ties: by bits every step differs.
    let c = flipped_at_the_last_row(&r);
    let rep = diff(&r, &c, None);
    assert_eq!(rep.verdict, Verdict::Different);
    for s in 0..2 {
        let st = status(&rep, &format!("decode.{s:04}.layer.00.hidden_out"));
        assert!(st == "different" || st == "differs_by_digest", "{st}");
    }
}

// --- the judged never sizes its own near-tie (issue: the near-tie bound is the candidate's) ---

/// Every decode step of `with_decode_steps`'s candidate moved far: what follows the flip.
fn scramble_decode(c: &mut Spec) {
    for s in 0..2 {
        push_token(c, &format!("decode.{s:04}.layer.00.hidden_out"), 0, 7.0);
    }
}

/// The reference of `with_decode_steps` with logits of a trained model's size (x100), and its
/// last row's runner-up (token 5) `gap` below the top (token 14).
fn large_logits(gap: f32) -> Spec {
    let mut r = with_decode_steps();
    for i in 0..64 {
        let v = get_f32(&r, "logits", i);
        r.set_f32("logits", i, v * 100.0);
    }
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    r.set_f32("logits", 3 * 16 + 5, top - gap);
    r.decide();
    assert_eq!(
        r.decisions
            .iter()
            .find(|d| d.name == "logits.argmax")
            .unwrap()
            .values[3],
        14
    );
    r
}

#[test]
fn attack_a_candidate_spending_the_logits_budget_on_two_elements_is_no_near_tie() {
    // The adversary moves the top logit down and the runner-up up by `by` each: within the
    // logits' relative-L2 bound (the row norm is large), its own scores pick the runner-up, and
    // gap 0.05 <= 2·d = 2·0.026 held under the old rule, whatever the decode steps then did.
    let r = large_logits(0.05);
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let by = 0.026;
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    let second = get_f32(&r, "logits", 3 * 16 + 5);
    c.set_f32("logits", 3 * 16 + 14, top - by);
    c.set_f32("logits", 3 * 16 + 5, second + by);
    c.decide();
    assert_eq!(
        c.decisions
            .iter()
            .find(|d| d.name == "logits.argmax")
            .unwrap()
            .values[3],
        5
    );
    // Every decode step afterwards is a random number.
    scramble_decode(&mut c);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(
        status(&rep, "logits"),
        "within_policy",
        "the plant stays within the logits rule"
    );
    assert_eq!(rep.verdict, Verdict::Different, "{}", render_human(&rep));
    let f = &decision_result(&rep, "logits.argmax").flips[0];
    assert_eq!(f.label.as_str(), "defect");
    // The bound is the policy's honest noise (1e-3 for f32 logits), not the candidate's 0.026.
    assert_eq!(f.honest_noise.map(|x| x.0), Some(1e-3));
    assert_eq!(f.honest_noise_from.as_deref(), Some("policy"));
    assert_eq!(f.noise_bound.map(|x| x.0), Some(2e-3));
    assert!(f.source_divergence.unwrap().0 > 0.02);
    // The control: the same plant across a gap honest f32 noise can cross is a near-tie, and
    // what follows it is NOT CHECKED (exit 4), never a pass.
    let r = large_logits(1e-3);
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    c.set_f32("logits", 3 * 16 + 14, top - 6e-4);
    c.set_f32("logits", 3 * 16 + 5, top - 1e-3 + 6e-4);
    c.decide();
    scramble_decode(&mut c);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(flip(&rep, "logits.argmax", 3).0, "near-tie");
    assert_eq!(rep.verdict, Verdict::NotChecked, "{}", render_human(&rep));
    assert_eq!(rep.exit_code(), 4);
    assert!(render_human(&rep).starts_with("NOT CHECKED past a near-tie"));
}

#[test]
fn attack_what_follows_a_near_tie_never_exits_0_from_the_cli() {
    let r = with_decode_steps();
    let c = flipped_at_the_last_row(&r);
    let (dir, rp, cp) = pair(&r, &c);
    let out = run(&[p(&rp), p(&cp), "--policy", "f32"]);
    assert_eq!(out.code, 4, "{}{}", out.stdout, out.stderr);
    assert!(
        out.stdout.starts_with("NOT CHECKED past a near-tie"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("--force-decisions"), "{}", out.stdout);
    drop(dir);
}

#[test]
fn attack_a_first_token_leading_by_8_8_logits_is_no_bf16_near_tie() {
    // Under the bf16 policy the candidate moves the top logit down and the runner-up up by 4.9
    // (within the logits' relative-L2 bound on a trained model's row norm): the old rule's
    // bound 2·d = 9.8 excused a lead of 8.8. The bf16 policy's honest logits noise is 4.0
    // (measured worst 3.18): 8.8 > 2·4.0, a defect.
    let bf16 = Policy::resolve("bf16", std::path::Path::new(".")).unwrap();
    let r = large_logits(8.8);
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let top = get_f32(&r, "logits", 3 * 16 + 14);
    let second = get_f32(&r, "logits", 3 * 16 + 5);
    c.set_f32("logits", 3 * 16 + 14, top - 4.9);
    c.set_f32("logits", 3 * 16 + 5, second + 4.9);
    c.decide();
    let rep = diff(&r, &c, Some(bf16.clone()));
    assert_eq!(
        status(&rep, "logits"),
        "within_policy",
        "{}",
        render_human(&rep)
    );
    let (label, _, _) = flip(&rep, "logits.argmax", 3);
    assert_eq!(label, "defect", "{}", render_human(&rep));
    assert_eq!(rep.verdict, Verdict::Different);
}
