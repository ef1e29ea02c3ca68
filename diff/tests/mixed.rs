//! Mixed precision (docs/diff.md, "Mixed precision"): float tensors of two dtypes compared
//! element by element in the coarser dtype's ULPs, the finer value rounded to nearest even
//! first. Every expected bit pattern and distance below is worked by hand in its comment.

use crate::common;

use common::*;
use serde_json::{json, Value};
use tracegate_diff::{Options, Policy, Report, Special, Verdict};
use tracegate_trace::DType;

fn f32s(bits: &[u32]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

fn h16s(bits: &[u16]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

fn f64s(bits: &[u64]) -> Vec<u8> {
    bits.iter().flat_map(|b| b.to_le_bytes()).collect()
}

fn spec(tensors: Vec<T>) -> Spec {
    Spec {
        provenance: engine_provenance(),
        tensors,
        decisions: Vec::new(),
    }
}

fn policy(rule: Value) -> Policy {
    Policy::parse(
        &json!({"format": "tracegate-policy/1", "name": "test", "rules": [rule]}).to_string(),
    )
    .unwrap()
}

fn with_policy(rule: Value) -> Options {
    Options {
        policy: Some(policy(rule)),
        ..Options::default()
    }
}

fn all() -> Options {
    Options {
        all: true,
        ..Options::default()
    }
}

/// (max ULP, differing elements) of each row, in order.
fn rows(rep: &Report) -> Vec<(&str, Option<u64>, Option<u64>)> {
    rep.per_tensor
        .iter()
        .map(|r| (r.tensor.as_str(), r.max_ulp, r.differing_elements))
        .collect()
}

/// f32 values whose low 16 bits are not zero, and their bf16 roundings, by hand (the low half
/// below 0x8000 rounds down, above it up):
///   0x3f801234 (1.000555…)     → 0x3f80 (1)
///   0xc0490fdb (−π)            → 0xc049 (−3.140625)
///   0x3dcccccd (0.1)           → 0x3dcd (0.10009765625)
///   0x42f6e979 (123.45600128…) → 0x42f7 (123.5), the largest difference: 0x42f70000 − 0x42f6e979
///                                = 5767 f32 steps of 2^-17 = 5767/131072
const F32: [u32; 4] = [0x3f80_1234, 0xc049_0fdb, 0x3dcc_cccd, 0x42f6_e979];
const BF16: [u16; 4] = [0x3f80, 0xc049, 0x3dcd, 0x42f7];

fn rounded_pair() -> (Spec, Spec) {
    (
        spec(vec![t_raw("x", DType::F32, &[2, 2], f32s(&F32))]),
        spec(vec![t_raw("x", DType::BF16, &[2, 2], h16s(&BF16))]),
    )
}

#[test]
fn a_bf16_candidate_equal_after_rounding_is_0_ulp_but_different_by_bits() {
    let (r, c) = rounded_pair();
    let rep = diff_with(&r, &c, &Options::default());
    // By bits: never identical across dtypes, and no structure finding any more.
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(rep.findings.len(), 1, "{:?}", rep.findings);
    let f = &rep.findings[0];
    assert_eq!((f.kind.as_str(), f.tensor()), ("values_differ", Some("x")));
    assert!(f.detail.contains("reference f32 vs candidate bf16, compared in bf16 ULPs: 4 of 4 elements differ in value"), "{}", f.detail);
    let row = &rep.per_tensor[0];
    assert_eq!(
        (row.dtype, row.candidate_dtype, row.ulp_dtype),
        ("f32", DType::BF16, Some(DType::BF16))
    );
    assert_eq!(
        (row.status.as_str(), row.differing_elements, row.max_ulp),
        ("different", Some(4), Some(0))
    );
    // Its real statistics, from the values themselves, not from the rounded ones.
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (
            d.dtype.as_str(),
            d.candidate_dtype.as_str(),
            d.ulp_dtype.as_deref()
        ),
        ("f32", "bf16", Some("bf16"))
    );
    assert_eq!((d.flat_index, d.ulp, d.special), (0, Some(0), None));
    assert_eq!(
        (
            d.reference_bits.as_str(),
            d.candidate_bits.as_str(),
            d.candidate_value.as_str()
        ),
        ("0x3f801234", "0x3f80", "1")
    );
    assert_eq!((d.max_ulp, d.median_ulp), (Some(0), Some(0)));
    assert_eq!(d.max_abs.0, 5767.0 / 131072.0);
    assert!(d.rel_l2.unwrap().0 > 0.0 && d.cosine.unwrap().0 < 1.0);

    // Under a policy, judged like any other tensor: 0 bf16 ULPs is within max_ulp 0 …
    let rep = diff_with(&r, &c, &with_policy(json!({"pattern": "**", "max_ulp": 0})));
    assert_eq!(rep.verdict, Verdict::WithinPolicy, "{:?}", rep.findings);
    assert_eq!(rep.per_tensor[0].status.as_str(), "within_policy");
    // … and the negative control: the real max |difference|, 0.044, breaks max_abs 1e-3.
    let rep = diff_with(
        &r,
        &c,
        &with_policy(json!({"pattern": "**", "max_abs": 1e-3})),
    );
    assert_eq!(rep.verdict, Verdict::Different);
    assert_eq!(rep.per_tensor[0].status.as_str(), "outside_policy");
}

#[test]
fn a_planted_element_3_bf16_ulps_off_is_located() {
    // f32 values exact in bf16 (low halves zero), so only the planted element differs:
    // flat 5 of [2, 4] is [1, 1]; 0x4040 (3.0) + 3 steps = 0x4043 = (1 + 67/128)·2 = 3.046875.
    let exact: [u16; 8] = [
        0x3f80, 0x4000, 0xbf80, 0x3f00, 0x4080, 0x4040, 0xc0a0, 0x3e80,
    ];
    let r = spec(vec![t_raw(
        "layer.00.mlp_out",
        DType::F32,
        &[2, 4],
        f32s(&exact.map(|h| (h as u32) << 16)),
    )]);
    let mut planted = exact;
    planted[5] += 3;
    let c = spec(vec![t_raw(
        "layer.00.mlp_out",
        DType::BF16,
        &[2, 4],
        h16s(&planted),
    )]);
    let rep = diff_with(&r, &c, &Options::default());
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (d.tensor.as_str(), d.flat_index, d.coords.clone()),
        ("layer.00.mlp_out", 5, vec![1, 1])
    );
    assert_eq!(
        (d.ulp, d.max_ulp, d.median_ulp, d.differing_elements),
        (Some(3), Some(3), Some(3), 1)
    );
    assert_eq!(
        (d.reference_value.as_str(), d.reference_bits.as_str()),
        ("3", "0x40400000")
    );
    // The shortest decimal that reads back to 0x4043 in bf16 (neighbours 3.03125, 3.0625).
    assert_eq!(
        (d.candidate_value.as_str(), d.candidate_bits.as_str()),
        ("3.05", "0x4043")
    );
    assert_eq!(d.max_abs.0, 0.046875);
    // max_ulp bounds count bf16 steps: 3 passes max_ulp 3 and breaks max_ulp 2.
    assert_eq!(
        diff_with(&r, &c, &with_policy(json!({"pattern": "**", "max_ulp": 3}))).verdict,
        Verdict::WithinPolicy
    );
    let rep = diff_with(&r, &c, &with_policy(json!({"pattern": "**", "max_ulp": 2})));
    assert_eq!(rep.verdict, Verdict::Different);
    let v = &rep.per_tensor[0].violations;
    assert_eq!(
        (v.len(), v[0].bound, v[0].to_string().as_str()),
        (1, "max_ulp", "max ULP 3 > 2")
    );
}

#[test]
fn a_planted_element_is_found_by_the_fast_kernel_too() {
    // Large enough for the f32/bf16 kernel (64 Ki-element chunks, 16-element blocks): every
    // value exact in bf16 (bits k << 16 for bf16 bits k in 0x3c00..0x4400, all finite), one
    // planted 3 steps off in the second chunk, at flat 65536 + 21 = 65557 = [64, 21] of [100, 1024].
    let n = 100 * 1024;
    let exact: Vec<u16> = (0..n).map(|i| 0x3c00 + (i % 0x800) as u16).collect();
    let r = spec(vec![t_raw(
        "big",
        DType::F32,
        &[100, 1024],
        f32s(&exact.iter().map(|&h| (h as u32) << 16).collect::<Vec<_>>()),
    )]);
    let mut planted = exact.clone();
    planted[65557] += 3;
    let c = spec(vec![t_raw(
        "big",
        DType::BF16,
        &[100, 1024],
        h16s(&planted),
    )]);
    for (rs, cs) in [(&r, &c), (&c, &r)] {
        let rep = diff_with(rs, cs, &Options::default());
        let d = rep.first_divergence.as_ref().unwrap();
        assert_eq!(
            (
                d.flat_index,
                d.coords.clone(),
                d.ulp,
                d.max_ulp,
                d.differing_elements
            ),
            (65557, vec![64, 21], Some(3), Some(3), 1)
        );
    }
    // Without the planted element: equal values, no first divergence (the negative control).
    assert!(diff_with(
        &r,
        &spec(vec![t_raw("big", DType::BF16, &[100, 1024], h16s(&exact))]),
        &Options::default()
    )
    .first_divergence
    .is_none());
}

#[test]
fn the_reference_may_be_the_coarser_side() {
    // bf16 reference, f32 candidate: 0x3f808000 is a tie between 0x3f80 and 0x3f81 and goes
    // to the even 0x3f80 (0 ULP); 0x40418000 ties between 0x4041 and 0x4042, goes to 0x4042,
    // 2 steps from 0x4040. Relative to the reference: |3.0234375 − 3| / 3 = 2^-7.
    let r = spec(vec![t_raw("x", DType::BF16, &[2], h16s(&[0x3f80, 0x4040]))]);
    let c = spec(vec![t_raw(
        "x",
        DType::F32,
        &[2],
        f32s(&[0x3f80_8000, 0x4041_8000]),
    )]);
    let rep = diff_with(&r, &c, &Options::default());
    let row = &rep.per_tensor[0];
    assert_eq!(
        (row.dtype, row.candidate_dtype, row.ulp_dtype),
        ("bf16", DType::F32, Some(DType::BF16))
    );
    assert_eq!((row.max_ulp, row.differing_elements), (Some(2), Some(2)));
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (d.reference_bits.as_str(), d.candidate_bits.as_str(), d.ulp),
        ("0x3f80", "0x3f808000", Some(0))
    );
    assert_eq!(d.max_rel.0, 1.0 / 128.0);
}

#[test]
fn ties_round_to_even_not_up_nor_down() {
    // Round-half-up would give 1 and 1; truncation 0 and 0; to nearest even gives 0 and 1:
    // 0x3f808000 → 0x3f80 (even, 0 from 0x3f80), 0x3f818000 → 0x3f82 (even, 1 from 0x3f81).
    let r = spec(vec![
        t_raw("tie.down", DType::F32, &[1], f32s(&[0x3f80_8000])),
        t_raw("tie.up", DType::F32, &[1], f32s(&[0x3f81_8000])),
    ]);
    let c = spec(vec![
        t_raw("tie.down", DType::BF16, &[1], h16s(&[0x3f80])),
        t_raw("tie.up", DType::BF16, &[1], h16s(&[0x3f81])),
    ]);
    let rep = diff_with(&r, &c, &all());
    assert_eq!(
        rows(&rep),
        vec![("tie.down", Some(0), Some(1)), ("tie.up", Some(1), Some(1))]
    );
}

#[test]
fn f16_against_f32_rounds_to_f16_and_overflows_to_infinity() {
    // 1 + 3·2^-11 (0x3f803000) ties between f16 0x3c01 and 0x3c02: 0x3c02, 2 steps from 0x3c00.
    // 65520 (0x477ff000) ties between 65504 (0x7bff) and 65536, which f16 cannot hold: the even
    // side is infinity (0x7c00), one step past 0x7bff; both values are finite, so no special.
    let r = spec(vec![t_raw(
        "x",
        DType::F32,
        &[2],
        f32s(&[0x3f80_3000, 0x477f_f000]),
    )]);
    let c = spec(vec![t_raw("x", DType::F16, &[2], h16s(&[0x3c00, 0x7bff]))]);
    let rep = diff_with(&r, &c, &Options::default());
    let row = &rep.per_tensor[0];
    assert_eq!(
        (
            row.candidate_dtype,
            row.ulp_dtype,
            row.max_ulp,
            row.infinity
        ),
        (DType::F16, Some(DType::F16), Some(2), 0)
    );
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!((d.ulp, d.median_ulp, d.max_abs.0), (Some(2), Some(1), 16.0));
}

#[test]
fn f64_against_f32_rounds_once_to_f32() {
    // 1 + 2^-24 + 2^-52 (0x3ff0000010000001) is just above the tie between f32 1 and its
    // successor: it rounds up to 0x3f800001, 1 step from 1 and 0 from 0x3f800001 itself.
    let r = spec(vec![t_raw(
        "x",
        DType::F64,
        &[2],
        f64s(&[0x3ff0_0000_1000_0001, 0x3ff0_0000_1000_0001]),
    )]);
    let c = spec(vec![t_raw(
        "x",
        DType::F32,
        &[2],
        f32s(&[0x3f80_0000, 0x3f80_0001]),
    )]);
    let rep = diff_with(&r, &c, &Options::default());
    let row = &rep.per_tensor[0];
    assert_eq!(
        (
            row.dtype,
            row.ulp_dtype,
            row.max_ulp,
            row.differing_elements
        ),
        ("f64", Some(DType::F32), Some(1), Some(2))
    );
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (d.reference_bits.as_str(), d.candidate_bits.as_str(), d.ulp),
        ("0x3ff0000010000001", "0x3f800000", Some(1))
    );
}

#[test]
fn bf16_against_f16_compares_in_bf16() {
    // f16 1 + 3·2^-8 (0x3c0c) ties between bf16 0x3f81 and 0x3f82: 0x3f82, the reference;
    // f16 65504 (0x7bff) rounds up to bf16 65536 (0x4780), finite: f16's range lies inside
    // bf16's. Both 0 ULP, both different values.
    let r = spec(vec![t_raw("x", DType::BF16, &[2], h16s(&[0x3f82, 0x4780]))]);
    let c = spec(vec![t_raw("x", DType::F16, &[2], h16s(&[0x3c0c, 0x7bff]))]);
    let rep = diff_with(&r, &c, &Options::default());
    let row = &rep.per_tensor[0];
    assert_eq!(
        (
            row.candidate_dtype,
            row.ulp_dtype,
            row.max_ulp,
            row.differing_elements,
            row.infinity
        ),
        (DType::F16, Some(DType::BF16), Some(0), Some(2), 0)
    );
    assert_eq!(rep.first_divergence.as_ref().unwrap().max_abs.0, 32.0);
}

#[test]
fn nan_infinity_and_signed_zero_across_dtypes() {
    // f32 against bf16, element by element:
    //   +0 vs −0 (0x8000)                 signed zero
    //   NaN 0x7fc00000 vs NaN 0x7fc0      the same NaN (both widen to 0x7ff8000000000000): equal
    //   +inf vs +inf                      equal
    //   1.0 vs NaN                        NaN mismatch
    //   NaN 0xffc00000 vs NaN 0x7fc0      NaN payload (sign) difference
    //   f32 MAX vs +inf                   infinity (MAX rounds to bf16 +inf: 0 ULP)
    let r = spec(vec![t_raw(
        "x",
        DType::F32,
        &[6],
        f32s(&[
            0,
            0x7fc0_0000,
            0x7f80_0000,
            0x3f80_0000,
            0xffc0_0000,
            0x7f7f_ffff,
        ]),
    )]);
    let c = spec(vec![t_raw(
        "x",
        DType::BF16,
        &[6],
        h16s(&[0x8000, 0x7fc0, 0x7f80, 0x7fc0, 0x7fc0, 0x7f80]),
    )]);
    let rep = diff_with(&r, &c, &Options::default());
    let row = &rep.per_tensor[0];
    assert_eq!(
        (
            row.differing_elements,
            row.signed_zero,
            row.nan_mismatch,
            row.nan_payload,
            row.infinity
        ),
        (Some(4), 1, 1, 1, 1)
    );
    assert_eq!(row.max_ulp, Some(0));
    let d = rep.first_divergence.as_ref().unwrap();
    assert_eq!(
        (d.flat_index, d.special, d.ulp),
        (0, Some(Special::SignedZero), Some(0))
    );
    assert_eq!(
        (d.reference_value.as_str(), d.candidate_value.as_str()),
        ("0", "-0")
    );
    let kinds: Vec<&str> = rep.findings.iter().map(|f| f.kind.as_str()).collect();
    for k in ["signed_zero", "nan_mismatch", "nan_payload", "infinity"] {
        assert!(kinds.contains(&k), "{k} in {kinds:?}");
    }
    // A NaN or infinity difference fails every rule, across dtypes too.
    let rep = diff_with(
        &r,
        &c,
        &with_policy(json!({"pattern": "**", "max_abs": 1e300})),
    );
    assert_eq!(rep.per_tensor[0].status.as_str(), "outside_policy");
}

#[test]
fn integer_and_float_or_two_integer_widths_stay_dtype_mismatches() {
    let r = spec(vec![
        t_raw("ids", DType::I32, &[2], f32s(&[1, 2])),
        t_raw("pos", DType::I32, &[2], f32s(&[1, 2])),
    ]);
    let c = spec(vec![
        t_raw("ids", DType::F32, &[2], f32s(&[0x3f80_0000, 0x4000_0000])),
        t_raw("pos", DType::I64, &[2], f64s(&[1, 2])),
    ]);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    // A DIFFERENT verdict verifies only what it read: the note saying so is not this test's.
    let found: Vec<(&str, Option<&str>)> = rep
        .findings
        .iter()
        .filter(|f| f.kind != tracegate_diff::FindingKind::VerifiedInPart)
        .map(|f| (f.kind.as_str(), f.tensor()))
        .collect();
    assert_eq!(
        found,
        vec![
            ("dtype_mismatch", Some("ids")),
            ("dtype_mismatch", Some("pos"))
        ]
    );
    assert!(
        rep.per_tensor.is_empty(),
        "no value comparison for a structure finding"
    );
}

#[test]
fn equal_values_in_two_dtypes_are_never_identical() {
    // Every f32 value is exact in bf16 and the candidate holds it: no element differs, yet
    // the pair is not IDENTICAL by bits, and a policy judges it (within any bound).
    let exact: [u16; 3] = [0x3f80, 0xc040, 0x0000];
    let r = spec(vec![t_raw(
        "x",
        DType::F32,
        &[3],
        f32s(&exact.map(|h| (h as u32) << 16)),
    )]);
    let c = spec(vec![t_raw("x", DType::BF16, &[3], h16s(&exact))]);
    let rep = diff_with(&r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Different);
    assert!(rep.first_divergence.is_none());
    assert_eq!(
        (
            rep.per_tensor[0].status.as_str(),
            rep.per_tensor[0].differing_elements
        ),
        ("different", Some(0))
    );
    let human = tracegate_diff::render_human(&rep);
    assert!(human.starts_with("DIFFERENT — values equal in all 1 common tensors, 1 of them in two dtypes (never bit-identical)"), "{human}");
    let rep = diff_with(&r, &c, &with_policy(json!({"pattern": "**", "max_ulp": 0})));
    assert_eq!(
        (rep.verdict, rep.per_tensor[0].status.as_str()),
        (Verdict::WithinPolicy, "within_policy")
    );
}

#[test]
fn a_flip_measures_its_mixed_source_row() {
    // logits [2, 4]: f32 reference, bf16 candidate; row 1 element 2 moves from 1.5 to 2.25
    // (0x4010), so row 1's argmax flips from 1 to 2 and its divergence is 0.75; row 0 equal.
    let row0: [u16; 4] = [0x3f80, 0x4000, 0x3f00, 0x3e80];
    let row1: [u16; 4] = [0x3f80, 0x4000, 0x3fc0, 0x3f00];
    let ref_bits: Vec<u32> = row0
        .iter()
        .chain(&row1)
        .map(|&h| (h as u32) << 16)
        .collect();
    let mut cand: Vec<u16> = row0.iter().chain(&row1).copied().collect();
    cand[6] = 0x4010;
    let mut r = spec(vec![t_raw("logits", DType::F32, &[2, 4], f32s(&ref_bits))]);
    let mut c = spec(vec![t_raw("logits", DType::BF16, &[2, 4], h16s(&cand))]);
    r.decisions.push(D {
        name: "logits.argmax".into(),
        shape: vec![2],
        values: vec![1, 1],
        margins: Some(vec![1.0, 0.5]),
    });
    c.decisions.push(D {
        name: "logits.argmax".into(),
        shape: vec![2],
        values: vec![1, 2],
        margins: Some(vec![1.0, 0.25]),
    });
    let rep = diff_with(&r, &c, &Options::default());
    let d = &rep.decisions.results[0];
    assert_eq!((d.source.as_deref(), d.differing_rows), (Some("logits"), 1));
    assert_eq!(
        (d.flips[0].row, d.flips[0].source_divergence.map(|x| x.0)),
        (1, Some(0.75))
    );
}

// --- the binary ------------------------------------------------------------------------

fn trace_diff(args: &[&str]) -> (i32, String) {
    let out = run(args);
    (out.code, out.stdout)
}

#[test]
fn the_cli_names_both_dtypes_and_the_ulp_unit() {
    let (r, c) = rounded_pair();
    let (dir, rp, cp) = pair(&r, &c);
    let (code, out) = trace_diff(&["--json", p(&rp), p(&cp)]);
    assert_eq!(code, 1);
    let v: Value = serde_json::from_str(&out).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!(v["verdict"], "different");
    let fd = &v["first_bit_difference"];
    assert_eq!(
        (&fd["dtype"], &fd["candidate_dtype"], &fd["ulp_dtype"]),
        (&json!("f32"), &json!("bf16"), &json!("bf16"))
    );
    assert_eq!(
        (&fd["reference_bits"], &fd["candidate_bits"]),
        (&json!("0x3f801234"), &json!("0x3f80"))
    );
    let row = &v["per_tensor"][0];
    assert_eq!(
        (
            &row["dtype"],
            &row["candidate_dtype"],
            &row["ulp_dtype"],
            &row["max_ulp"]
        ),
        (&json!("f32"), &json!("bf16"), &json!("bf16"), &json!(0))
    );
    assert!(v["findings"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["kind"] != "dtype_mismatch"));

    let (_, human) = trace_diff(&[p(&rp), p(&cp)]);
    assert!(human.starts_with("DIFFERENT — first at x[0,0]: 1.0005555 (0x3f801234) vs 1 (0x3f80), 0 ULP (bf16) (4/4 elements differ)"), "{human}");
    assert!(
        human.contains("  tensor     x  f32 vs bf16 [2, 2]\n"),
        "{human}"
    );
    // 0 bf16 ULP, and 0x3f801234 - 0x3f800000 = 0x1234 = 4660 steps of the reference's f32.
    assert!(
        human.contains("  distance   0 ULP (bf16), 4,660 ULP (f32, the reference's dtype)\n"),
        "{human}"
    );

    let policy_file = dir.path().join("policy.json");
    std::fs::write(&policy_file, json!({"format": "tracegate-policy/1", "name": "bf16", "rules": [{"pattern": "**", "max_ulp": 0}]}).to_string()).unwrap();
    let (code, out) = trace_diff(&["--json", "--policy", p(&policy_file), p(&rp), p(&cp)]);
    let v: Value = serde_json::from_str(&out).unwrap();
    if v.get("verdict").is_some() {
        assert_valid_report(&v); // a compare report (not --show's description)
    }
    assert_eq!((code, &v["verdict"]), (0, &json!("within_policy")));
    let (_, human) = trace_diff(&["--policy", p(&policy_file), p(&rp), p(&cp)]);
    assert!(
        human.contains("0 bf16"),
        "the curve's max ULP names its unit: {human}"
    );
}

#[test]
fn an_f16_candidate_outside_an_f32_policy_is_never_said_to_be_0_ulp_alone() {
    // f32 0x3f801000 (1 + 2^-11) is a tie between f16 1 (0x3c00) and 1 + 2^-10 (0x3c01): to
    // even, 0x3c00. The f16 candidate 1 is then 0 f16 ULP from it (they round alike) and
    // 0x3f801000 - 0x3f800000 = 4096 f32 ULP; its relative L2, 2^-11 / (1 + 2^-11) = 4.9e-4,
    // breaks an f32 bound of 1e-4. The finding once read "0 ULP (f16)" and nothing else.
    let r = spec(vec![t_raw("x", DType::F32, &[1], f32s(&[0x3f80_1000]))]);
    let c = spec(vec![t_raw("x", DType::F16, &[1], h16s(&[0x3c00]))]);
    let rep = diff_with(
        &r,
        &c,
        &with_policy(json!({"pattern": "**", "max_rel_l2": 1e-4})),
    );
    assert_eq!(rep.verdict, Verdict::Different);
    let v = rep.first_violation().expect("outside the policy");
    let e = v.worst_element.as_ref().unwrap();
    assert_eq!((e.ulp, e.reference_dtype_ulp), (Some(0), Some(4096)));
    let said = v.to_string();
    assert!(
        said.contains("0 ULP (f16), 4,096 ULP (f32, the reference's dtype)"),
        "{said}"
    );
    let human = tracegate_diff::render_human(&rep);
    assert!(
        human.contains("distance   0 ULP (f16), 4,096 ULP (f32, the reference's dtype)"),
        "{human}"
    );
    assert_valid_report(&report_json(&rep));
    // The control: counted in the reference's own dtype (a bf16 reference, an f32 candidate),
    // the distance needs no second unit and the report carries none.
    let r = spec(vec![t_raw("x", DType::BF16, &[1], h16s(&[0x3f80]))]);
    let c = spec(vec![t_raw("x", DType::F32, &[1], f32s(&[0x3f80_1000]))]);
    let rep = diff_with(
        &r,
        &c,
        &with_policy(json!({"pattern": "**", "max_rel_l2": 1e-6})),
    );
    let v = rep.first_violation().expect("outside the policy");
    assert_eq!(v.worst_element.as_ref().unwrap().reference_dtype_ulp, None);
    assert!(!v.to_string().contains("reference's dtype"), "{v}");
}

#[test]
fn an_f64_candidate_against_an_f32_reference_is_a_dtype_finding_not_a_pass() {
    // The candidate's f64 values are the reference's f32 ones widened exactly: equal in value,
    // so by value alone it passed every policy; only the bytes (a baseline) moved.
    let vals = [0x3f80_1234u32, 0xc049_0fdb];
    let wide: Vec<u64> = vals
        .iter()
        .map(|b| (f32::from_bits(*b) as f64).to_bits())
        .collect();
    let r = spec(vec![t_raw("x", DType::F32, &[2], f32s(&vals))]);
    let c = spec(vec![t_raw("x", DType::F64, &[2], f64s(&wide))]);
    for opts in [
        Options::default(),
        with_policy(json!({"pattern": "**", "max_rel_l2": 1e-4})),
    ] {
        let rep = diff_with(&r, &c, &opts);
        assert_eq!(rep.verdict, Verdict::Different, "{:?}", rep.findings);
        let f = rep
            .findings
            .iter()
            .find(|f| f.kind.as_str() == "dtype_mismatch")
            .unwrap_or_else(|| panic!("no dtype finding: {:?}", rep.findings));
        assert_eq!(f.tensor(), Some("x"));
        assert!(
            f.detail
                .starts_with("reference f32 vs candidate f64: stored in f64"),
            "{}",
            f.detail
        );
        // Still compared by value: the row says the values are equal.
        assert_eq!(rep.per_tensor[0].differing_elements, Some(0));
    }
    // The controls: an f64 reference against an f64 candidate, and an f32 candidate against
    // an f64 reference (a coarser port), raise no dtype finding.
    let wide_r = spec(vec![t_raw("x", DType::F64, &[2], f64s(&wide))]);
    let rep = diff_with(&wide_r, &c, &Options::default());
    assert_eq!(rep.verdict, Verdict::Identical, "{:?}", rep.findings);
    let rep = diff_with(&wide_r, &r, &Options::default());
    assert!(
        rep.findings
            .iter()
            .all(|f| f.kind.as_str() != "dtype_mismatch"),
        "{:?}",
        rep.findings
    );
}
