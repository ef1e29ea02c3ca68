//! One definition of each element-wise measure (docs/diff.md, "Measures"): planted NaN and
//! infinity pairs give the same numbers in trace-diff's report row, in the public measures
//! (`tracegate_diff::measures`) and in `gate bisect`'s calibration (`bisect::prefill::f32_stats`, whose
//! rel L2 the bisect report divides the layer rows' by). Every expected value is worked by hand
//! below from the definitions, not computed by the code under test.

use std::panic::{catch_unwind, AssertUnwindSafe};

use serde_json::json;
use tracegate_diff::measures::{self, compare_element, Difference, Pair, Special};
use tracegate_diff::{compare_files, Options};
use tracegate_gate::bisect::prefill::f32_stats;
use tracegate_trace::{Attributes, DType, TraceWriter};

const NAN: u32 = 0x7fc0_0000;
const NAN_1: u32 = 0x7fc0_0001;
const INF: u32 = 0x7f80_0000;
const NEG_INF: u32 = 0xff80_0000;
const MAX: u32 = 0x7f7f_ffff;
const NEG_ZERO: u32 = 0x8000_0000;

/// The planted pairs (reference bits, candidate bits) and what each is, by definition (`None`:
/// the same value; else its special kind and its distance in f32 ULPs).
fn planted(c1: f32) -> Vec<(u32, u32, Option<Difference>)> {
    let c1_ulp = match c1 {
        // 2.0 is 0x40000000, 1.5 is 0x3fc00000, 1.25 is 0x3fa00000: the magnitudes' difference.
        1.5 => 0x0040_0000,
        1.25 => 0x0060_0000,
        _ => unreachable!("worked by hand for 1.5 and 1.25 only"),
    };
    vec![
        (1f32.to_bits(), 1f32.to_bits(), None),
        (2f32.to_bits(), c1.to_bits(), Some((None, Some(c1_ulp)))),
        // NaN vs NaN, the same bits: equal, and not summed.
        (NAN, NAN, None),
        // NaN vs NaN, another payload: differs, no distance.
        (NAN, NAN_1, Some((Some(Special::NanPayload), None))),
        // NaN vs a number: differs, no distance.
        (
            NAN,
            3f32.to_bits(),
            Some((Some(Special::NanMismatch), None)),
        ),
        // +inf vs +inf: equal, and not summed.
        (INF, INF, None),
        // +inf vs −inf: ordered integers 0x7f800000 and −0x7f800000.
        (
            INF,
            NEG_INF,
            Some((Some(Special::Infinity), Some(2 * 0x7f80_0000))),
        ),
        // +inf vs the largest finite f32: the next ordered integer.
        (INF, MAX, Some((Some(Special::Infinity), Some(1)))),
        // +0 vs −0: both ordered 0, the bits differ.
        (0, NEG_ZERO, Some((Some(Special::SignedZero), Some(0)))),
        (3f32.to_bits(), 3f32.to_bits(), None),
        (NEG_ZERO, NEG_ZERO, None),
    ]
}

/// The measures of [`planted`], by hand.
#[derive(Debug, PartialEq)]
struct Expected {
    total: u64,
    differing: u64,
    max_ulp: u64,
    max_abs: f64,
    max_rel: f64,
    rel_l2: f64,
    cosine: f64,
    scale_error: f64,
    /// signed_zero, nan_mismatch, nan_payload, infinity.
    kinds: [u64; 4],
    /// The report's first divergence: its flat index and the tensor's median ULP.
    first: u64,
    median_ulp: u64,
}

/// Sums over the pairs whose values are both finite, which are (1, 1), (2, c1), (+0, −0),
/// (3, 3) and (−0, −0): Σr² = 1 + 4 + 0 + 9 + 0 = 14, Σc² = 1 + c1² + 9, Σrc = 1 + 2·c1 + 9,
/// Σ(r − c)² = (2 − c1)². Differing: indices 1, 3, 4, 6, 7, 8. Max ULP: +inf vs −inf,
/// 2·0x7f800000. Max abs and max rel: the one finite pair that differs in value, 2 vs c1.
/// Median: the distances of the pairs that have one are c1's, 2·0x7f800000, 1 and 0; sorted,
/// rank ⌊(4 − 1)/2⌋ = 1 is 1.
fn expected(c1: f32) -> Expected {
    let (cc, rc, dd, d) = match c1 {
        1.5 => (1.0 + 2.25 + 9.0, 1.0 + 3.0 + 9.0, 0.25, 0.5),
        1.25 => (1.0 + 1.5625 + 9.0, 1.0 + 2.5 + 9.0, 0.5625, 0.75),
        _ => unreachable!(),
    };
    let rr = 14.0f64;
    Expected {
        total: 11,
        differing: 6,
        max_ulp: 2 * 0x7f80_0000,
        max_abs: d,
        max_rel: d / 2.0,
        rel_l2: (dd / rr).sqrt(),
        cosine: rc / (rr * cc).sqrt(),
        scale_error: rc / rr - 1.0,
        kinds: [1, 1, 1, 2],
        first: 1,
        median_ulp: 1,
    }
}

fn floats(bits: impl Iterator<Item = u32>) -> Vec<f32> {
    bits.map(f32::from_bits).collect()
}

/// Checks the three places against `want`: the public measures (and each element), the diff
/// report's row of the planted tensor, and bisect's calibration row.
fn check_everywhere(c1: f32, want: &Expected) {
    let pairs = planted(c1);
    let r = floats(pairs.iter().map(|p| p.0));
    let c = floats(pairs.iter().map(|p| p.1));
    let f32_pair = Pair::same(DType::F32);
    for (i, &(a, b, element)) in pairs.iter().enumerate() {
        assert_eq!(
            compare_element(f32_pair, a as u64, b as u64),
            element,
            "element {i}: {a:#010x} vs {b:#010x}"
        );
    }

    // The public measures.
    let m = measures::measure_f32(&r, &c).expect("same length");
    let got = Expected {
        total: m.total(),
        differing: m.differing(),
        max_ulp: m.max_ulp().expect("some pair has a distance"),
        max_abs: m.max_abs(),
        max_rel: m.max_rel(),
        rel_l2: m.rel_l2().expect("defined"),
        cosine: m.cosine().expect("defined"),
        scale_error: m.scale_error().expect("defined"),
        kinds: [
            m.signed_zero(),
            m.nan_mismatch(),
            m.nan_payload(),
            m.infinity(),
        ],
        first: m.first().expect("some pair differs"),
        median_ulp: want.median_ulp, // the public measures have no median: the report's below
    };
    assert_eq!(&got, want, "tracegate_diff::measures");

    // The diff report's row, through trace files as trace-diff reads them.
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, v: &[f32]| {
        let path = dir.path().join(name);
        let mut w = TraceWriter::create(&path, json!({"producer": "engine"})).unwrap();
        w.tensor_f32(
            "layer.00.hidden_out",
            &[v.len() as u64],
            v,
            &Attributes::default(),
        )
        .unwrap();
        w.finish().unwrap();
        path
    };
    let (rp, cp) = (write("r.trace", &r), write("c.trace", &c));
    let rep = compare_files(&rp, &cp, &Options::default());
    let row = &rep.per_tensor[0];
    let real = |x: Option<tracegate_diff::Real>| x.expect("measured").0;
    let first = rep.first_divergence.as_ref().expect("a first divergence");
    let got = Expected {
        total: row.total_elements,
        differing: row.differing_elements.expect("compared"),
        max_ulp: row.max_ulp.expect("some pair has a distance"),
        max_abs: real(row.max_abs),
        max_rel: real(row.max_rel),
        rel_l2: real(row.rel_l2),
        cosine: real(row.cosine),
        scale_error: real(row.scale_error),
        kinds: [
            row.signed_zero,
            row.nan_mismatch,
            row.nan_payload,
            row.infinity,
        ],
        first: first.flat_index,
        median_ulp: row.median_ulp.expect("the first divergence has a median"),
    };
    assert_eq!(&got, want, "trace-diff's row");

    // gate bisect's calibration row: rel L2, max ULP, differing and total elements.
    let cal = f32_stats(&r, &c).expect("same length");
    assert_eq!(
        (
            cal.rel_l2,
            cal.max_ulp,
            cal.differing_elements,
            cal.total_elements
        ),
        (Some(want.rel_l2), want.max_ulp, want.differing, want.total),
        "bisect's calibration"
    );
}

#[test]
fn planted_nan_and_infinity_pairs_measure_the_same_everywhere() {
    check_everywhere(1.5, &expected(1.5));
    check_everywhere(1.25, &expected(1.25));
}

/// Negative control: the check fails when the expectation is another case's (every measure
/// derived from the finite pair moves), so it cannot pass by comparing nothing.
#[test]
fn the_check_fails_on_another_cases_numbers() {
    let wrong = catch_unwind(AssertUnwindSafe(|| check_everywhere(1.5, &expected(1.25))));
    assert!(wrong.is_err(), "1.5's measures matched 1.25's hand values");
    // And a measure that summed the NaN and infinity pairs (what bisect did before) would not
    // match the hand value: such a rel L2 is not a number.
    let pairs = planted(1.5);
    let (dd, rr) = pairs.iter().fold((0f64, 0f64), |(dd, rr), &(a, b, _)| {
        let (x, y) = (f32::from_bits(a) as f64, f32::from_bits(b) as f64);
        (dd + (y - x) * (y - x), rr + x * x)
    });
    assert!((dd / rr).sqrt().is_nan());
}

/// Mixed precision, element by element (docs/diff.md, "Mixed precision", worked examples):
/// distances in the coarser dtype's steps after rounding the finer value to it.
#[test]
fn mixed_precision_elements_worked_by_hand() {
    let pair = Pair::new(DType::F32, DType::BF16).unwrap();
    // 123.456 rounds to bf16 0x42f7 (123.5); 0x42f7 − 0x42f4 = 3.
    assert_eq!(
        compare_element(pair, 0x42f6_e979, 0x42f4),
        Some((None, Some(3)))
    );
    // The largest f32 rounds to bf16 +inf, one step past the largest bf16.
    assert_eq!(
        compare_element(pair, MAX as u64, 0x7f7f),
        Some((None, Some(1)))
    );
    // The same NaN in both widths is the same value; −NaN is another payload.
    assert_eq!(compare_element(pair, NAN as u64, 0x7fc0), None);
    assert_eq!(
        compare_element(pair, 0xffc0_0000, 0x7fc0),
        Some((Some(Special::NanPayload), None))
    );
    // +inf against bf16 −inf: 2·0x7f80 bf16 steps.
    assert_eq!(
        compare_element(pair, INF as u64, 0xff80),
        Some((Some(Special::Infinity), Some(2 * 0x7f80)))
    );
    // +0 against bf16 −0.
    assert_eq!(
        compare_element(pair, 0, 0x8000),
        Some((Some(Special::SignedZero), Some(0)))
    );
}
