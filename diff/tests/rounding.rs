//! Rounding mode (docs/diff.md, "Rounding mode"; docs/traps.md, trap 17): a bf16 candidate whose
//! values are an f32 reference's truncations, not its roundings to nearest even, fails with a
//! `rounding_mode` finding even inside a policy's bounds; rounded away from zero it is named so;
//! rounded to nearest even, with or without symmetric noise of a bf16 step, nothing is said.

use crate::common;

use common::*;
use serde_json::json;
use tracegate_diff::{compare_files, FindingKind, Options, Policy, Report, Verdict};
use tracegate_trace::DType;

/// 16 × 32 f32 values with varied low bits, from a seeded LCG.
fn reference_bits() -> Vec<u32> {
    let mut s: u64 = 0x5eed;
    (0..512)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let x = (s >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0;
            x.to_bits()
        })
        .collect()
}

fn rne(b: u32) -> u16 {
    ((b as u64 + 0x7fff + ((b as u64 >> 16) & 1)) >> 16) as u16
}

fn diff(candidate: impl Fn(usize, u32) -> u16) -> Report {
    let bits = reference_bits();
    let r = Spec {
        provenance: engine_provenance(),
        tensors: vec![t_raw(
            "layer.00.hidden_out",
            DType::F32,
            &[16, 32],
            bits.iter().flat_map(|b| b.to_le_bytes()).collect(),
        )],
        decisions: Vec::new(),
    };
    let mut c = r.clone();
    c.tensors[0] = t_raw(
        "layer.00.hidden_out",
        DType::BF16,
        &[16, 32],
        bits.iter()
            .enumerate()
            .flat_map(|(i, &b)| candidate(i, b).to_le_bytes())
            .collect(),
    );
    let (_dir, rp, cp) = pair(&r, &c);
    let policy = Policy::parse(
        &json!({"format": "tracegate-policy/1", "name": "loose", "candidate_dtype": "bf16",
                "rules": [{"pattern": "**", "max_rel_l2": 0.05}]})
        .to_string(),
    )
    .unwrap();
    compare_files(
        &rp,
        &cp,
        &Options {
            policy: Some(policy),
            ..Options::default()
        },
    )
}

fn rounding(rep: &Report) -> Vec<&str> {
    rep.findings
        .iter()
        .filter(|f| f.kind == FindingKind::RoundingMode)
        .map(|f| f.detail.as_str())
        .collect()
}

#[test]
fn truncation_inside_the_bounds_fails_as_a_rounding_mode() {
    let rep = diff(|_, b| (b >> 16) as u16);
    assert_eq!(rep.verdict, Verdict::Different);
    let said = rounding(&rep);
    assert_eq!(said.len(), 1, "{:?}", rep.findings);
    assert!(
        said[0].contains("truncated (rounded towards zero)"),
        "{}",
        said[0]
    );
    // Every bound holds: the finding alone fails it.
    assert!(rep.first_violation().is_none());
}

#[test]
fn away_from_zero_is_named_as_itself() {
    let rep = diff(|_, b| ((b as u64 + 0xffff) >> 16) as u16);
    assert_eq!(rep.verdict, Verdict::Different);
    let said = rounding(&rep);
    assert_eq!(said.len(), 1, "{:?}", rep.findings);
    assert!(said[0].contains("rounded away from zero"), "{}", said[0]);
}

#[test]
fn nearest_even_with_or_without_symmetric_noise_says_nothing() {
    let rep = diff(|_, b| rne(b));
    assert_eq!(rep.verdict, Verdict::WithinPolicy);
    assert!(rounding(&rep).is_empty());
    // A bf16 computation's own rounding: a third of the elements one step off nearest even,
    // up and down alike (by index), as honest noise moves them.
    let rep = diff(|i, b| match i % 6 {
        0 => rne(b).wrapping_add(1),
        3 => rne(b).wrapping_sub(1),
        _ => rne(b),
    });
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:?}", rep.findings);
    assert!(rounding(&rep).is_empty());
}
