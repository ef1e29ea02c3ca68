//! The element-wise measures of a comparison, defined once (docs/diff.md, "Measures"): what
//! trace-diff's rows report, and what any other tool that compares two tensors (`gate bisect`'s
//! calibration) uses, so that numbers from both may be divided by each other.
//!
//! - One element pair ([`compare_element`]): equal, or differing with a kind ([`Special`]:
//!   signed zero, NaN on one side, NaN payload, infinity) and a distance in ULPs of the pair's
//!   comparison dtype ([`Pair::ulp_dtype`]; integers: the absolute difference). NaN pairs have
//!   no distance.
//! - A tensor pair ([`measure`], [`measure_f32`]): the [`Stats`] (defined with the scan that
//!   gathers them, in `numeric/pair_stats.rs`, and re-exported here). Every float sum and
//!   every maximum runs over the pairs where **both values are finite**: a NaN or an infinity
//!   is counted by kind, never summed, so one of them cannot turn rel L2 or cosine into NaN.

use std::fmt;

pub use crate::numeric::pair_stats::Stats;
use crate::numeric::{pair_bits, scan};
pub use crate::numeric::{Pair, Special};
use tracegate_trace::DType;

/// How one differing element pair differs: its special kind, if any, and its distance (None
/// for a NaN pair).
pub type Difference = (Option<Special>, Option<u64>);

/// One element pair, given as raw bits (each in its own dtype, zero-extended): None when the
/// two are the same value (one dtype: the same bits; two float dtypes: the same bits once
/// widened exactly to f64), else its special kind and its distance in ULPs of
/// [`Pair::ulp_dtype`] (integers: |a − b|; NaN pairs: none).
pub fn compare_element(pair: Pair, reference: u64, candidate: u64) -> Option<Difference> {
    pair_bits(pair, reference, candidate)
}

/// Why two payloads cannot be measured against each other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MeasureError {
    /// A payload's byte length is not a whole number of its dtype's elements.
    Partial { dtype: DType, bytes: usize },
    /// The two payloads hold different numbers of elements.
    Count { reference: usize, candidate: usize },
}

impl fmt::Display for MeasureError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeasureError::Partial { dtype, bytes } => {
                write!(
                    f,
                    "{bytes} bytes are not a whole number of {dtype} elements"
                )
            }
            MeasureError::Count {
                reference,
                candidate,
            } => write!(
                f,
                "the reference has {reference} elements and the candidate {candidate}"
            ),
        }
    }
}

impl std::error::Error for MeasureError {}

/// The measures of two little-endian payloads of `pair`'s dtypes, element by element, exactly
/// as trace-diff's `per_tensor` row gets them (the same scan).
pub fn measure(pair: Pair, reference: &[u8], candidate: &[u8]) -> Result<Stats, MeasureError> {
    let count = |dtype: DType, bytes: &[u8]| {
        let size = dtype.size();
        if bytes.len().is_multiple_of(size) {
            Ok(bytes.len() / size)
        } else {
            Err(MeasureError::Partial {
                dtype,
                bytes: bytes.len(),
            })
        }
    };
    let (n, m) = (
        count(pair.reference, reference)?,
        count(pair.candidate, candidate)?,
    );
    if n != m {
        return Err(MeasureError::Count {
            reference: n,
            candidate: m,
        });
    }
    Ok(scan(pair, reference, candidate, false).0)
}

/// [`measure`] for two f32 slices (both copied to little-endian bytes first).
pub fn measure_f32(reference: &[f32], candidate: &[f32]) -> Result<Stats, MeasureError> {
    let bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
    measure(Pair::same(DType::F32), &bytes(reference), &bytes(candidate))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_that_do_not_pair_are_errors_naming_the_numbers() {
        let one = Pair::same(DType::F32);
        assert_eq!(
            measure_f32(&[1.0], &[1.0, 2.0]).unwrap_err(),
            MeasureError::Count {
                reference: 1,
                candidate: 2
            }
        );
        let partial = measure(one, &[0; 5], &[0; 4]).unwrap_err();
        assert_eq!(
            partial.to_string(),
            "5 bytes are not a whole number of f32 elements"
        );
        // Negative control: pairing payloads measure (and 2 vs 1 differs by 0x00800000 ULP).
        let m = measure_f32(&[2.0], &[1.0]).expect("one element each");
        assert_eq!(
            (m.total(), m.differing(), m.max_ulp()),
            (1, 1, Some(0x0080_0000))
        );
    }
}
