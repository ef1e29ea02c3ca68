//! Rerouted experts (docs/diff.md, "Rerouted experts"), on planted model-shaped traces with
//! per-expert outputs: a router near-tie that sends one token to another expert is within the
//! policy, its token's rows counted as after the near-tie; the same reroute after a defect, an
//! extra token that no near-tie excuses, or a positions mismatch anywhere else still fails.

use crate::common;

use common::*;
use tracegate_diff::{compare_files, render_human, Options, Report, Verdict};

fn label(rep: &Report, decision: &str, row: u64) -> (&'static str, Option<String>) {
    let f = flip_at(rep, decision, row);
    (f.label.as_str(), f.upstream.clone())
}

fn findings(rep: &Report, kind: &str) -> Vec<(String, String)> {
    rep.findings
        .iter()
        .filter(|f| f.kind.as_str() == kind)
        .map(|f| {
            (
                f.tensor().map(str::to_string).unwrap_or_default(),
                f.detail.clone(),
            )
        })
        .collect()
}

/// `layer.LL.expert.EEE.out` holding `positions`, one row of 8 per position; a position's row
/// is the same on both sides (its values depend on layer, expert and position only).
fn expert(l: usize, e: usize, positions: &[i64]) -> T {
    let v: Vec<f32> = positions
        .iter()
        .flat_map(|&p| values(8, (100 * l + 10 * e) as u32 + p as u32 + 1))
        .collect();
    let mut t = t_f32(
        &format!("layer.{l:02}.expert.{e:03}.out"),
        &[positions.len() as u64, 8],
        &v,
    );
    t.attrs = prefill().with_positions(positions.to_vec());
    t
}

/// The experts' tokens under a router decision (`[4 tokens, top-2]`, 4 experts).
fn routed(topk: &[i64]) -> Vec<Vec<i64>> {
    (0..4)
        .map(|e| {
            (0..4)
                .filter(|&t| topk[2 * t as usize..2 * t as usize + 2].contains(&e))
                .collect()
        })
        .collect()
}

/// Puts each layer's expert outputs after its router logits (as the engine captures them),
/// routed by the spec's own router decisions.
fn with_experts(mut s: Spec) -> Spec {
    for l in 0..2 {
        let topk = s
            .decisions
            .iter()
            .find(|d| d.name == format!("layer.{l:02}.router.topk"))
            .unwrap()
            .values
            .clone();
        let at = s
            .tensors
            .iter()
            .position(|t| t.name == format!("layer.{l:02}.router.logits"))
            .unwrap()
            + 1;
        for (e, positions) in routed(&topk).iter().enumerate().rev() {
            s.tensors.insert(at, expert(l, e, positions));
        }
    }
    s
}

/// Token 3's layer-0 router row moved by `moved` (expert 0, the runner-up `1e-6` below expert
/// 1: [`crafted`]), so the candidate's own scores choose [2, 0] instead of [2, 1]: expert 0
/// gains token 3, expert 1 loses it, and in layer 1 (token 3 now picks [0, 1] instead of
/// [3, 2]) experts 0 and 1 gain it, 2 and 3 lose it. Token 3's later rows differ. Every
/// decision of the candidate is taken from its own scores.
fn reroute_pair(moved: f32) -> (Spec, Spec) {
    let r = crafted();
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let v = f32::from_le_bytes(
        c.tensor_mut("layer.00.router.logits").bytes[48..52]
            .try_into()
            .unwrap(),
    );
    c.set_f32("layer.00.router.logits", 12, v + moved);
    for name in [
        "layer.00.mlp_out",
        "layer.00.hidden_out",
        "layer.01.hidden_in",
        "layer.01.attn_out",
        "layer.01.router.logits",
        "layer.01.mlp_out",
        "layer.01.hidden_out",
        "final_norm.out",
        "logits",
    ] {
        let width = c.tensor_mut(name).shape[1] as usize;
        for i in 3 * width..4 * width {
            c.poke_f32_bits(name, i, |b| (f32::from_bits(b) + 1.0).to_bits());
        }
    }
    for (e, z) in [1.0, 0.5, -0.5, -1.0].into_iter().enumerate() {
        c.set_f32("layer.01.router.logits", 12 + e, z);
    }
    c.raise("logits", 3, 5, 0.5);
    c.decide();
    (with_experts(r), with_experts(c))
}

const REROUTED: [&str; 6] = [
    "layer.00.expert.000.out",
    "layer.00.expert.001.out",
    "layer.01.expert.000.out",
    "layer.01.expert.001.out",
    "layer.01.expert.002.out",
    "layer.01.expert.003.out",
];

#[test]
fn the_plant_reroutes_as_described() {
    // Guards the fixture, not the differ: the lists the tests below rely on.
    let (r, c) = reroute_pair(2e-6);
    let pos = |s: &Spec, n: &str| {
        s.tensors
            .iter()
            .find(|t| t.name == n)
            .unwrap()
            .attrs
            .positions
            .clone()
            .unwrap()
    };
    assert_eq!(
        (
            pos(&r, "layer.00.expert.000.out"),
            pos(&c, "layer.00.expert.000.out")
        ),
        (vec![0, 2], vec![0, 2, 3])
    );
    assert_eq!(
        (
            pos(&r, "layer.00.expert.001.out"),
            pos(&c, "layer.00.expert.001.out")
        ),
        (vec![1, 3], vec![1])
    );
    assert_eq!(
        (
            pos(&r, "layer.00.expert.002.out"),
            pos(&c, "layer.00.expert.002.out")
        ),
        (vec![1, 3], vec![1, 3])
    );
    assert_eq!(
        (
            pos(&r, "layer.01.expert.003.out"),
            pos(&c, "layer.01.expert.003.out")
        ),
        (vec![1, 3], vec![1])
    );
}

#[test]
fn a_near_tie_reroute_is_not_checked_and_counted() {
    let (r, c) = reroute_pair(2e-6);
    let rep = diff(&r, &c, Some(oracle_policy()));
    // The rerouted token's rows are not judged: no pass (docs/diff.md, "Near-ties under a policy").
    assert_eq!(rep.verdict, Verdict::NotChecked, "{:#?}", rep.findings);
    assert!(rep.findings.is_empty(), "{:#?}", rep.findings);
    assert_eq!(label(&rep, "layer.00.router.topk", 3).0, "near-tie");
    assert_eq!(label(&rep, "layer.01.router.topk", 3).0, "after-near-tie");
    let n = rep.decisions.near_ties.as_ref().unwrap();
    for t in REROUTED {
        assert!(
            n.tensors.iter().any(|x| x.tensor == t && x.rows == 1),
            "{t}: {:?}",
            n.tensors
        );
        // The rows both sides hold are equal here: judged, and nothing differs.
        assert_eq!(
            (
                tensor_row(&rep, t).status.as_str(),
                tensor_row(&rep, t).differing_elements
            ),
            ("identical", Some(0)),
            "{t}"
        );
    }
    // 9 non-expert tensors with token 3's row + 6 rerouted experts + 2 decision rows.
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.starts_with("NOT CHECKED past a near-tie")
            && first.contains("17 rows after a near-tie not judged"),
        "{first}"
    );
    assert_valid_report(&report_json(&rep));
}

#[test]
fn a_common_rows_difference_in_a_rerouted_expert_is_still_judged() {
    // Token 0's row in layer 0's expert 0 (index 0 on both sides) moved far: token 0 is not
    // after the near-tie, so the expert is outside the policy.
    let (r, mut c) = reroute_pair(2e-6);
    for i in 0..8 {
        c.poke_f32_bits("layer.00.expert.000.out", i, |b| {
            (f32::from_bits(b) + 1.0).to_bits()
        });
    }
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        tensor_row(&rep, "layer.00.expert.000.out").status.as_str(),
        "outside_policy"
    );
    assert_eq!(
        tensor_row(&rep, "layer.00.expert.000.out").differing_elements,
        Some(8)
    );
    assert_eq!(
        findings(&rep, "outside_policy")
            .iter()
            .map(|f| f.0.as_str())
            .collect::<Vec<_>>(),
        ["layer.00.expert.000.out"]
    );
    assert!(findings(&rep, "rerouted").is_empty());
}

#[test]
fn the_same_reroute_after_a_defect_fails() {
    // The candidate's router row 3 is the reference's, bit for bit, yet it records [2, 0] (and
    // routes by it): its own scores do not make that flip, a defect, and the experts' changed
    // tokens are rerouted.
    let (r, mut c) = reroute_pair(2e-6);
    let v = f32::from_le_bytes(
        r.tensors
            .iter()
            .find(|t| t.name == "layer.00.router.logits")
            .unwrap()
            .bytes[48..52]
            .try_into()
            .unwrap(),
    );
    c.set_f32("layer.00.router.logits", 12, v);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(label(&rep, "layer.00.router.topk", 3), ("defect", None));
    for t in REROUTED {
        assert_eq!(tensor_row(&rep, t).status.as_str(), "rerouted", "{t}");
    }
    let f = findings(&rep, "rerouted");
    assert_eq!(f.len(), 6, "{f:?}");
    assert_eq!(f[0].0, "layer.00.expert.000.out");
    assert!(
        f[0].1.contains("layer.00.router.topk")
            && f[0]
                .1
                .contains("[] only in the reference, [3] only in the candidate"),
        "{}",
        f[0].1
    );
    // The first rerouted expert is upstream of layer 1's router: its flip is a consequence.
    assert_eq!(
        label(&rep, "layer.01.router.topk", 3),
        ("consequence", Some("layer.00.expert.000.out".into()))
    );
    assert!(rep.decisions.near_ties.as_ref().unwrap().tensors.is_empty());
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.starts_with("DIFFERENT")
            && first.contains("6 expert tensors rerouted (first: layer.00.expert.000.out)"),
        "{first}"
    );
    assert_valid_report(&report_json(&rep));
}

#[test]
fn an_extra_token_no_near_tie_excuses_fails() {
    // Token 0 also in the candidate's layer-0 expert 2: not after any near-tie.
    let (r, mut c) = reroute_pair(2e-6);
    let at = c
        .tensors
        .iter()
        .position(|t| t.name == "layer.00.expert.002.out")
        .unwrap();
    c.tensors[at] = expert(0, 2, &[0, 1, 3]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(
        tensor_row(&rep, "layer.00.expert.002.out").status.as_str(),
        "rerouted"
    );
    let f = findings(&rep, "rerouted");
    assert_eq!(
        f.iter().map(|x| x.0.as_str()).collect::<Vec<_>>(),
        ["layer.00.expert.002.out"]
    );
    assert!(
        f[0].1
            .contains("[] only in the reference, [0] only in the candidate, not after a near-tie"),
        "{}",
        f[0].1
    );
    // The near-tie's own reroutes are still excused.
    assert_eq!(
        tensor_row(&rep, "layer.00.expert.000.out").status.as_str(),
        "identical"
    );
    // The only failure: the headline must not read "all tensors within the policy".
    assert!(rep.first_violation().is_none());
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.starts_with("DIFFERENT — 1 expert tensor rerouted (first: layer.00.expert.002.out)"),
        "{first}"
    );
    assert!(!first.contains("within the policy"), "{first}");
}

#[test]
fn by_bits_a_rerouted_expert_is_a_difference_not_incomparable() {
    let (r, c) = reroute_pair(2e-6);
    let rep = diff(&r, &c, None);
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(
        findings(&rep, "positions_mismatch").is_empty()
            && findings(&rep, "shape_mismatch").is_empty(),
        "{:#?}",
        rep.findings
    );
    assert_eq!(
        findings(&rep, "rerouted")
            .iter()
            .map(|x| x.0.as_str())
            .collect::<Vec<_>>(),
        REROUTED
    );
    assert_eq!(
        tensor_row(&rep, "layer.00.expert.002.out").status.as_str(),
        "identical"
    );
    let first = render_human(&rep).lines().next().unwrap().to_string();
    assert!(
        first.starts_with("DIFFERENT — first at layer.00.router.logits")
            && first.contains("; 6 expert tensors rerouted (first: layer.00.expert.000.out)"),
        "{first}"
    );
}

#[test]
fn a_positions_mismatch_elsewhere_is_still_refused() {
    // A non-expert tensor, and an expert whose rows do not match its positions list. Our writer
    // refuses the second (one position per row), so it is written as a hostile writer would:
    // the index edited after the fact, read unverified.
    for (tensor, positions) in [
        ("layer.00.mlp_out", vec![0, 1, 2, 4]),
        ("layer.00.expert.002.out", vec![1, 2, 3]),
    ] {
        let (r, c) = reroute_pair(2e-6);
        let (_dir, rp, cp) = pair(&r, &c);
        rewrite_index(&cp, |ix| {
            for t in ix["tensors"].as_array_mut().unwrap() {
                if t["name"] == tensor {
                    t["attributes"]["positions"] = serde_json::json!(positions);
                }
            }
        });
        let rep = compare_files(
            &rp,
            &cp,
            &Options {
                policy: Some(oracle_policy()),
                verify: false,
                ..Options::default()
            },
        );
        assert_eq!(rep.verdict, Verdict::Incomparable, "{tensor}");
        assert_eq!(
            findings(&rep, "positions_mismatch")
                .iter()
                .map(|x| x.0.as_str())
                .collect::<Vec<_>>(),
            [tensor]
        );
    }
}

#[test]
fn attack_a_repeated_position_cannot_hide_a_row() {
    // The candidate's expert 0 lists position 2 twice: a row of 1e30 sits under the first entry
    // and the honest row under the second, so matching by position would never read it, and
    // its extra row would pass as rerouting.
    let r = with_experts(crafted());
    let mut c = r.clone();
    c.provenance = oracle_provenance();
    let name = "layer.00.expert.000.out";
    let t = c.tensor_mut(name);
    let positions = t.attrs.positions.clone().unwrap();
    assert_eq!(positions, [0, 2]);
    let (row0, row2) = (t.bytes[..32].to_vec(), t.bytes[32..].to_vec());
    t.bytes = [row0, f32_bytes(&[1e30; 8]), row2].concat();
    t.shape = vec![3, 8];
    t.attrs = prefill().with_positions(vec![0, 2, 2]);
    for opts in [
        Options::default(),
        Options {
            policy: Some(oracle_policy()),
            filter: tracegate_diff::Filter {
                only: vec!["layer.*.expert.*.out".into()],
                skip: vec![],
            },
            ..Options::default()
        },
    ] {
        let (_dir, rp, cp) = pair(&r, &c);
        let rep = compare_files(&rp, &cp, &opts);
        assert_eq!(rep.verdict, Verdict::Incomparable, "{:#?}", rep.findings);
        let f = findings(&rep, "positions_mismatch");
        assert_eq!(f.len(), 1, "{f:?}");
        assert_eq!(f[0].0, name);
        assert!(
            f[0].1
                .contains("not strictly increasing: entry 2 is 2 after 2"),
            "{}",
            f[0].1
        );
    }
    // The control: the same rows under distinct positions are a reroute, compared by position.
    c.tensor_mut(name).attrs = prefill().with_positions(vec![0, 1, 2]);
    let rep = diff(&r, &c, Some(oracle_policy()));
    assert_ne!(rep.verdict, Verdict::Incomparable);
}
