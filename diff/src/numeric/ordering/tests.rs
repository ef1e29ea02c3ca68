use super::*;
use crate::numeric::element::element_distance;

fn f32_dist(a: f32, b: f32) -> (Option<Special>, Option<u64>) {
    element_distance(DType::F32, a.to_bits() as u64, b.to_bits() as u64)
}

#[test]
fn ulp_crosses_zero() {
    let tiny = f32::from_bits(1);
    assert_eq!(f32_dist(tiny, -tiny), (None, Some(2)));
    assert_eq!(f32_dist(0.0, -tiny), (None, Some(1)));
    assert_eq!(
        f32_dist(1.0, f32::from_bits(1.0f32.to_bits() + 1)),
        (None, Some(1))
    );
}

#[test]
fn signed_zero_is_zero_ulp_but_named() {
    assert_eq!(f32_dist(0.0, -0.0), (Some(Special::SignedZero), Some(0)));
}

#[test]
fn nan_cases_are_named_not_measured() {
    let q = f32::from_bits(0x7fc0_0000);
    let p = f32::from_bits(0x7fc0_0001);
    assert_eq!(f32_dist(q, 1.0), (Some(Special::NanMismatch), None));
    assert_eq!(f32_dist(q, p), (Some(Special::NanPayload), None));
}

#[test]
fn infinity_is_one_step_past_max() {
    assert_eq!(
        f32_dist(f32::MAX, f32::INFINITY),
        (Some(Special::Infinity), Some(1))
    );
    let (k, d) = f32_dist(f32::INFINITY, f32::NEG_INFINITY);
    assert_eq!((k, d), (Some(Special::Infinity), Some(2 * 0x7f80_0000)));
}

#[test]
fn sixteen_bit_units() {
    // One bf16 step is 1, not 65536.
    let one = half::bf16::from_f32(1.0).to_bits() as u64;
    assert_eq!(element_distance(DType::BF16, one, one + 1), (None, Some(1)));
    let one = half::f16::from_f32(1.0).to_bits() as u64;
    assert_eq!(element_distance(DType::F16, one, one + 3), (None, Some(3)));
    let one = 1.0f64.to_bits();
    assert_eq!(element_distance(DType::F64, one, one - 5), (None, Some(5)));
    assert_eq!(
        element_distance(DType::F64, 0, (-0.0f64).to_bits()),
        (Some(Special::SignedZero), Some(0))
    );
}

#[test]
fn integers_report_absolute_difference() {
    let a = (-3i32) as u32 as u64;
    let b = 4u64;
    assert_eq!(
        element_distance(DType::I32, I32K::bits(&(a as u32).to_le_bytes()), b),
        (None, Some(7))
    );
    assert_eq!(
        element_distance(DType::I64, i64::MIN as u64, i64::MAX as u64),
        (None, Some(u64::MAX))
    );
}

/// Rounds bits of `K` to `to`'s format, as the mixed scan does.
fn rnd<K: Float, T: Float>(bits: u64) -> u64 {
    round_to::<K>(T::FORMAT, bits)
}

#[test]
fn rounding_is_to_nearest_even_worked_by_hand() {
    // f32 → bf16: the low 16 bits are dropped; 0x8000 is exactly half a bf16 step.
    assert_eq!(
        rnd::<F32K, BF16K>(0x3f80_8000),
        0x3f80,
        "tie, 0x3f80 even: down"
    );
    assert_eq!(
        rnd::<F32K, BF16K>(0x3f81_8000),
        0x3f82,
        "tie, 0x3f81 odd: up"
    );
    assert_eq!(rnd::<F32K, BF16K>(0x3f80_8001), 0x3f81, "above half: up");
    assert_eq!(rnd::<F32K, BF16K>(0x3f80_7fff), 0x3f80, "below half: down");
    assert_eq!(
        rnd::<F32K, BF16K>(0xbf81_8000),
        0xbf82,
        "the sign does not change the rule"
    );
    assert_eq!(
        rnd::<F32K, BF16K>(0x0000_8000),
        0x0000,
        "subnormal tie to even zero"
    );
    assert_eq!(rnd::<F32K, BF16K>(0x0001_8000), 0x0002, "subnormal tie up");
    assert_eq!(rnd::<F32K, BF16K>(0x8000_0000), 0x8000, "-0 stays -0");
    assert_eq!(
        rnd::<F32K, BF16K>(0x7f7f_7fff),
        0x7f7f,
        "below half past bf16 MAX: MAX"
    );
    assert_eq!(
        rnd::<F32K, BF16K>(0x7f7f_8000),
        0x7f80,
        "tie at the top: even, which is infinity"
    );
    assert_eq!(
        rnd::<F32K, BF16K>(0x7f7f_ffff),
        0x7f80,
        "f32 MAX overflows to +inf"
    );
    assert_eq!(rnd::<F32K, BF16K>(0xff80_0000), 0xff80, "-inf stays -inf");
    // f32 → f16: 13 bits dropped (0x1000 is half a step), 5-bit exponent.
    assert_eq!(
        rnd::<F32K, F16K>(0x3f80_1000),
        0x3c00,
        "1 + 2^-11: tie, down to even"
    );
    assert_eq!(
        rnd::<F32K, F16K>(0x3f80_3000),
        0x3c02,
        "1 + 3·2^-11: tie, up to even"
    );
    assert_eq!(
        rnd::<F32K, F16K>(0x477f_f000),
        0x7c00,
        "65520: tie between 65504 and 65536, even is infinity"
    );
    assert_eq!(rnd::<F32K, F16K>(0x477f_ef00), 0x7bff, "65519: 65504");
    assert_eq!(
        rnd::<F32K, F16K>(0x3380_0000),
        0x0001,
        "2^-24: the smallest subnormal"
    );
    assert_eq!(
        rnd::<F32K, F16K>(0x3300_0000),
        0x0000,
        "2^-25: tie between 0 and 2^-24, even 0"
    );
    assert_eq!(
        rnd::<F32K, F16K>(0x33c0_0000),
        0x0002,
        "3·2^-25: tie between 1 and 2 steps, even 2"
    );
    assert_eq!(
        rnd::<F32K, F16K>(0x3880_0000),
        0x0400,
        "2^-14: the smallest normal"
    );
    // f64 → f32 and f64 → the 16-bit formats, one rounding from the exact value.
    assert_eq!(
        rnd::<F64K, F32K>(0x3ff0_0000_1000_0000),
        0x3f80_0000,
        "1 + 2^-24: tie, down"
    );
    assert_eq!(
        rnd::<F64K, F32K>(0x3ff0_0000_1000_0010),
        0x3f80_0001,
        "1 + 2^-24 + 2^-48: up"
    );
    assert_eq!(
        rnd::<F64K, F32K>(0x36a0_0000_0000_0000),
        0x0000_0001,
        "2^-149"
    );
    assert_eq!(
        rnd::<F64K, F32K>(0x3690_0000_0000_0000),
        0x0000_0000,
        "2^-150: tie, even 0"
    );
    assert_eq!(
        rnd::<F64K, F32K>(0x47ef_ffff_f000_0000),
        0x7f80_0000,
        "halfway past f32 MAX: infinity"
    );
    // 1 + 2^-8 + 2^-40: through f32 it would tie at bf16 and go down to 1.0.
    assert_eq!(rnd::<F64K, BF16K>(0x3ff0_1000_0000_1000), 0x3f81);
    assert_eq!(
        rnd::<F64K, F16K>(0x3ff0_0200_0000_1000),
        0x3c01,
        "1 + 2^-11 + 2^-40: up"
    );
    assert_eq!(
        rnd::<F64K, F16K>(0xc0f0_0000_0000_0000),
        0xfc00,
        "-65536: -inf"
    );
    // f16 → bf16: 3 bits dropped, and f16's whole range fits bf16's.
    assert_eq!(rnd::<F16K, BF16K>(0x3c04), 0x3f80, "1 + 2^-8: tie, down");
    assert_eq!(rnd::<F16K, BF16K>(0x3c0c), 0x3f82, "1 + 3·2^-8: tie, up");
    assert_eq!(
        rnd::<F16K, BF16K>(0x7bff),
        0x4780,
        "f16 MAX 65504 rounds to 65536, finite in bf16"
    );
    assert_eq!(
        rnd::<F16K, BF16K>(0x0001),
        0x3380,
        "2^-24, a subnormal in f16, is normal in bf16"
    );
    assert_eq!(rnd::<F16K, BF16K>(0xfc00), 0xff80, "-inf");
    assert_eq!(
        rnd::<F32K, F32K>(0x3f80_0001),
        0x3f80_0001,
        "its own format: unchanged"
    );
}

#[test]
fn mixed_pairs_worked_by_hand() {
    let fb = |a: u32, b: u16| mixed_pair::<F32K, BF16K>(a as u64, b as u64);
    assert_eq!(fb(0x3f80_0000, 0x3f80), None, "1.0 in both");
    assert_eq!(
        fb(0x3f80_8000, 0x3f80),
        Some((None, Some(0))),
        "a different value, the same after rounding"
    );
    assert_eq!(
        fb(0x3f81_8000, 0x3f81),
        Some((None, Some(1))),
        "rounds to 0x3f82"
    );
    assert_eq!(
        fb(0x42f6_e979, 0x42f4),
        Some((None, Some(3))),
        "123.456 rounds to 0x42f7 (123.5), 3 steps from 122"
    );
    assert_eq!(
        fb(0xbf80_0000, 0x3f80),
        Some((None, Some(2 * 0x3f80))),
        "-1 vs 1 crosses zero"
    );
    assert_eq!(
        fb(0x0000_0000, 0x8000),
        Some((Some(Special::SignedZero), Some(0)))
    );
    assert_eq!(
        fb(0x0000_0001, 0x8000),
        Some((None, Some(0))),
        "2^-149 rounds to +0: a value, not a signed zero"
    );
    assert_eq!(fb(0x7fc0_0000, 0x7fc0), None, "the same quiet NaN");
    assert_eq!(
        fb(0xffc0_0000, 0x7fc0),
        Some((Some(Special::NanPayload), None)),
        "NaNs of other signs"
    );
    assert_eq!(
        fb(0x7fc0_0001, 0x7fc0),
        Some((Some(Special::NanPayload), None)),
        "payload below bf16's, left-aligned"
    );
    assert_eq!(
        fb(0x7fc0_0000, 0x3f80),
        Some((Some(Special::NanMismatch), None))
    );
    assert_eq!(fb(0x7f80_0000, 0x7f80), None, "+inf in both");
    assert_eq!(
        fb(0x7f7f_ffff, 0x7f80),
        Some((Some(Special::Infinity), Some(0))),
        "f32 MAX rounds to the bf16 +inf"
    );
    assert_eq!(
        fb(0x7f7f_ffff, 0x7f7f),
        Some((None, Some(1))),
        "f32 MAX is a step past bf16 MAX, at infinity"
    );
    // The other way round, and the other pairs.
    assert_eq!(
        mixed_pair::<BF16K, F32K>(0x3f81, 0x3f81_8000),
        Some((None, Some(1)))
    );
    assert_eq!(
        mixed_pair::<F16K, F32K>(0x3c00, 0x3f80_3000),
        Some((None, Some(2))),
        "1 vs 1 + 3·2^-11 (f16 0x3c02)"
    );
    assert_eq!(
        mixed_pair::<F64K, F32K>(1f64.to_bits(), 0x3f80_0001),
        Some((None, Some(1)))
    );
    assert_eq!(
        mixed_pair::<BF16K, F16K>(0x3f82, 0x3c0c),
        Some((None, Some(0))),
        "f16 1 + 3·2^-8 rounds to bf16 0x3f82"
    );
    assert_eq!(
        mixed_pair::<F16K, F32K>(0x7c00, 0x477f_f000),
        Some((Some(Special::Infinity), Some(0))),
        "65520 overflows f16"
    );
}

#[test]
fn pairs_compare_in_the_coarser_dtype() {
    let u = |r, c| Pair::new(r, c).and_then(Pair::ulp_dtype);
    assert_eq!(u(DType::F32, DType::BF16), Some(DType::BF16));
    assert_eq!(u(DType::BF16, DType::F32), Some(DType::BF16));
    assert_eq!(u(DType::F64, DType::F16), Some(DType::F16));
    assert_eq!(u(DType::F16, DType::BF16), Some(DType::BF16));
    assert_eq!(u(DType::F32, DType::F32), Some(DType::F32));
    assert_eq!(
        Pair::new(DType::I32, DType::I32).map(Pair::ulp_dtype),
        Some(None),
        "integers: absolute difference"
    );
    assert_eq!(Pair::new(DType::I32, DType::F32), None);
    assert_eq!(Pair::new(DType::I32, DType::I64), None);
}
