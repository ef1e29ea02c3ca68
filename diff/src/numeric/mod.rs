//! Element-level arithmetic of a comparison: ULP distance in the stored dtype's own steps,
//! exact printing of values, and the per-tensor scan that gathers a divergence's statistics.
//!
//! Every float dtype maps its bits to an *ordered integer*: non-negative values keep their
//! magnitude bits, negative values take the negated magnitude. Adjacent representable values
//! are then adjacent integers, +0 and −0 both map to 0, and the distance across zero is the
//! sum of the two sides' steps. NaNs have no distance and are counted on their own.
//!
//! One concept a file: `ordering` (element kinds, rounding between formats, ULP distance),
//! `pair_stats` (a tensor pair's statistics, [`Stats`]), `scan` (gathers them chunk by chunk,
//! by the careful path), `kernels` (the
//! portable fast kernels of f32 and f32/bf16) with `avx512` and `avx2` (their intrinsics
//! versions), `median` (the exact median ULP), `format` (printing values); here, the element
//! accessors the report uses.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod format;
mod kernels;
mod median;
mod ordering;
pub(crate) mod pair_stats;
mod scan;
#[cfg(test)]
mod tests;

use tracegate_trace::DType;

pub use format::{describe_bits, format_value, hex_bits, unravel};
pub(crate) use median::median_ulp;
use ordering::mixed_pair;
pub(crate) use ordering::{
    classify, dispatch, with_float, Num, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K,
};
pub use ordering::{Pair, Special};
pub(crate) use pair_stats::Stats;
pub(crate) use scan::scan;

/// Scans the elements `[start, end)` of the reference payload against those of `c_range` in the
/// candidate's (the same range, except for a rerouted expert's rows): the rows a near-tie leaves
/// in, a rerouted expert's rows, the noise reference's measure over either.
pub(crate) fn scan_range(
    pair: Pair,
    rd: &[u8],
    cd: &[u8],
    (start, end): (u64, u64),
    (c_start, c_end): (u64, u64),
) -> Stats {
    let (rs, cs) = (pair.reference.size(), pair.candidate.size());
    let (a, b) = (
        &rd[start as usize * rs..end as usize * rs],
        &cd[c_start as usize * cs..c_end as usize * cs],
    );
    scan(pair, a, b, false).0
}

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

/// [`pair_element`] for two elements given as bits (see [`crate::measures::compare_element`]).
pub(crate) fn pair_bits(pair: Pair, a: u64, b: u64) -> Option<(Option<Special>, Option<u64>)> {
    if !pair.is_mixed() {
        return (a != b).then(|| element_distance(pair.reference, a, b));
    }
    with_float!(pair.reference, A => with_float!(pair.candidate, B => mixed_pair::<A, B>(a, b)))
}
