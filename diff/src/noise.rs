//! The noise reference of the noise-relative bound (docs/diff.md, "Noise-relative bound"): the
//! reference model run in the candidate's own precision, whose error against the reference is
//! what that precision does honestly. A rule's `max_noise_ratio` bounds the candidate's relative
//! L2 by k times the noise reference's, on the same elements.
//!
//! Nothing here can pass a tensor by itself: a ratio that cannot be measured is undefined, and no
//! bound accepts an undefined value (`policy::Rule::violations`).

use std::fmt;
use std::sync::Arc;

use tracegate_trace::{TensorInfo, Trace};

use crate::numeric::{self, Pair};

/// An opened, verified noise reference trace (shared: `Options` is cloned per comparison).
#[derive(Clone)]
pub struct NoiseReference(pub Arc<Trace>);

impl fmt::Debug for NoiseReference {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "NoiseReference({})", self.0.path().display())
    }
}

/// The noise reference's payload for the reference tensor `ri`: the same name, shape and token
/// positions (the same prompt's rows), in a float dtype the scan can pair with the reference's.
fn counterpart<'a>(noise: &'a Trace, ri: &TensorInfo) -> Option<(Pair, &'a [u8])> {
    let ni = noise.tensor_info(&ri.name)?;
    if ni.shape != ri.shape || ni.attributes.positions != ri.attributes.positions {
        return None;
    }
    Some((Pair::new(ri.dtype, ni.dtype)?, noise.data(ni)))
}

/// The noise reference's relative L2 against the reference over the element ranges `ranges`
/// of tensor `ri` (the whole tensor, or the rows a near-tie left in); None when the noise
/// reference has no such tensor, differs from the reference by a NaN or an infinity, or the
/// measure is undefined.
pub(crate) fn rel_l2(
    noise: &Trace,
    ri: &TensorInfo,
    rd: &[u8],
    ranges: &[(u64, u64)],
) -> Option<f64> {
    // Same shape as the reference tensor (checked), so the ranges lie in both payloads.
    let (pair, nd) = counterpart(noise, ri)?;
    let mut stats = numeric::Stats::default();
    for &range in ranges {
        stats = stats.merge(numeric::scan_range(pair, rd, nd, range, range));
    }
    // A NaN or infinity where the reference is finite (or the reverse) is no honest rounding,
    // and the relative L2 leaves such elements out: a noise trace holding one measures nothing.
    if stats.nan_mismatch + stats.nan_payload + stats.infinity > 0 {
        return None;
    }
    stats.rel_l2()
}

/// The candidate's relative L2 over the noise reference's. Undefined (None) when either is, and
/// when the noise reference is exact (0) while the candidate is not: that precision computes
/// the tensor exactly, so any error is the candidate's own. Both 0 is a ratio of 0.
pub(crate) fn ratio(candidate: Option<f64>, noise: Option<f64>) -> Option<f64> {
    let (c, n) = (candidate?, noise?);
    if c == 0.0 {
        Some(0.0)
    } else if n == 0.0 {
        None
    } else {
        Some(c / n)
    }
}
