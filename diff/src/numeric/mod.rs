//! Element-level arithmetic of a comparison: ULP distance in the stored dtype's own steps,
//! exact printing of values, and the per-tensor scan that gathers a divergence's statistics.
//!
//! Every float dtype maps its bits to an *ordered integer*: non-negative values keep their
//! magnitude bits, negative values take the negated magnitude. Adjacent representable values
//! are then adjacent integers, +0 and −0 both map to 0, and the distance across zero is the
//! sum of the two sides' steps. NaNs have no distance and are counted on their own.
//!
//! One concept a file, bottom to top (each imports only those above it in this list):
//! `ordering` (element kinds, rounding between formats, ULP distance), `format` (printing
//! values), `element` (one element of a payload or a pair: bits, value, how they differ),
//! `pair_stats` (a tensor pair's statistics, [`Stats`]), `counts` (the ULP distances counted
//! for the median), `lanes` (the fast kernels' lane accumulators and bit arithmetic), `chunk`
//! (one chunk by the careful path, element by element), `kernels` (the portable fast kernels
//! of f32 and f32/bf16) with `avx512` and `avx2` (their intrinsics versions), `scan` (a tensor
//! pair's statistics chunk by chunk on the rayon pool, each chunk by the kernel the dtypes and
//! the CPU call for), `median` (the exact median ULP, scanning again when it must); here, what
//! the rest of the crate uses.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod chunk;
mod counts;
mod element;
mod format;
mod kernels;
mod lanes;
mod median;
mod ordering;
pub(crate) mod pair_stats;
mod scan;
#[cfg(test)]
mod tests;

pub(crate) use element::{
    element_bits, element_value, pair_bits, pair_element, reference_dtype_distance,
};
pub use format::{describe_bits, format_value, hex_bits, unravel};
pub(crate) use median::median_ulp;
pub(crate) use ordering::{dispatch, Num, BF16K, F16K, F32K, F64K, I16K, I32K, I64K, I8K, U8K};
pub use ordering::{Pair, Special};
pub(crate) use pair_stats::Stats;
pub(crate) use scan::{scan, scan_range};
