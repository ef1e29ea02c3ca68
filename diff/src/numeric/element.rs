//! One element of a payload, and of a pair of payloads: its bits, its value, and how the two
//! sides' elements differ (special kind and ULP distance).

use tracegate_trace::DType;

use super::ordering::{
    classify, dispatch, mixed_pair, ord_in, round_to, with_float, Float, Num, Pair, Special, BF16K,
    F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K,
};

/// Raw bits of element `index` of a payload.
pub(crate) fn element_bits(dtype: DType, data: &[u8], index: u64) -> u64 {
    let size = dtype.size();
    let e = &data[index as usize * size..(index as usize + 1) * size];
    dispatch!(dtype, bits_of, e)
}

fn bits_of<K: Num>(e: &[u8]) -> u64 {
    K::bits(e)
}

/// Element `index` of a payload as a number (integers exactly up to 2^53).
pub(crate) fn element_value(dtype: DType, data: &[u8], index: u64) -> f64 {
    let bits = element_bits(dtype, data, index);
    dispatch!(dtype, value_of, bits)
}

fn value_of<K: Num>(bits: u64) -> f64 {
    K::to_f64(bits)
}

/// The ULP (or, for integers, absolute) distance between two elements, and their special kind.
pub(crate) fn element_distance(dtype: DType, a: u64, b: u64) -> (Option<Special>, Option<u64>) {
    if a == b {
        return (None, Some(0));
    }
    dispatch!(dtype, classify, a, b)
}

/// Element `index` of both payloads: its special kind and distance (in [`Pair::ulp_dtype`]'s
/// steps) when it differs, None when it does not.
pub(crate) fn pair_element(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    index: u64,
) -> Option<(Option<Special>, Option<u64>)> {
    let (a, b) = (
        element_bits(pair.reference, r, index),
        element_bits(pair.candidate, c, index),
    );
    pair_bits(pair, a, b)
}

/// A mixed pair's element counted in the candidate's coarser dtype (an f16 candidate against an
/// f32 reference), counted again in the reference dtype's steps: the candidate's value rounded
/// to the reference's dtype (exactly, where that holds it: f16 and bf16 in f32). An f16
/// candidate's value that is the reference's rounded to f16 is 0 f16 ULP and thousands of f32
/// ULP; an f32 policy judges the second. None where the pair is counted in the reference's
/// dtype already, or for a NaN.
pub(crate) fn reference_dtype_distance(pair: Pair, a: u64, b: u64) -> Option<u64> {
    if !pair.is_mixed() || pair.ulp_dtype() != Some(pair.candidate) {
        return None;
    }
    with_float!(pair.reference, A => with_float!(pair.candidate, B => in_reference::<A, B>(a, b)))
}

fn in_reference<A: Float, B: Float>(a: u64, b: u64) -> Option<u64> {
    if A::is_nan(a) || B::is_nan(b) {
        return None;
    }
    let b = round_to::<B>(A::FORMAT, b);
    Some((ord_in(A::FORMAT, a) as i128 - ord_in(A::FORMAT, b) as i128).unsigned_abs() as u64)
}

/// [`pair_element`] for two elements given as bits (see [`crate::measures::compare_element`]).
pub(crate) fn pair_bits(pair: Pair, a: u64, b: u64) -> Option<(Option<Special>, Option<u64>)> {
    if !pair.is_mixed() {
        return (a != b).then(|| element_distance(pair.reference, a, b));
    }
    with_float!(pair.reference, A => with_float!(pair.candidate, B => mixed_pair::<A, B>(a, b)))
}
