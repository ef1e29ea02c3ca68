//! A tensor pair's statistics ([`Stats`]): the sums and counts every measure of
//! [`crate::measures`] is defined from, gathered by the scan and its fast kernels.

use super::ordering::Special;

/// Statistics of one tensor pair (or a range of it), the sums the measures are defined from.
/// Float sums (in f64, in a fixed order: chunks folded in index order, so the result does not
/// depend on the thread count) run over pairs where both values are finite; NaN and infinity
/// pairs are counted, not summed.
#[derive(Clone, Debug, Default)]
pub struct Stats {
    pub(crate) total: u64,
    pub(crate) differing: u64,
    pub(crate) first: Option<u64>,
    /// The largest distance of a differing pair that has one (0 when none has).
    pub(crate) max_ulp: u64,
    pub(crate) max_abs: f64,
    pub(crate) max_rel: f64,
    /// Σr², Σc², Σrc and Σ(r − c)² over the pairs where both values are finite.
    pub(crate) rr: f64,
    pub(crate) cc: f64,
    pub(crate) rc: f64,
    pub(crate) dd: f64,
    pub(crate) signed_zero: u64,
    pub(crate) nan_mismatch: u64,
    pub(crate) nan_payload: u64,
    pub(crate) infinity: u64,
}

impl Stats {
    pub(crate) fn new() -> Stats {
        Stats::default()
    }

    /// Appends a later range (indices are already absolute).
    pub(crate) fn merge(mut self, o: Stats) -> Stats {
        self.total += o.total;
        self.differing += o.differing;
        self.first = self.first.or(o.first);
        self.max_ulp = self.max_ulp.max(o.max_ulp);
        self.max_abs = self.max_abs.max(o.max_abs);
        self.max_rel = self.max_rel.max(o.max_rel);
        self.rr += o.rr;
        self.cc += o.cc;
        self.rc += o.rc;
        self.dd += o.dd;
        self.signed_zero += o.signed_zero;
        self.nan_mismatch += o.nan_mismatch;
        self.nan_payload += o.nan_payload;
        self.infinity += o.infinity;
        self
    }

    /// Adds one element pair (index `idx`, values `x` and `y`): its values to the sums when both
    /// are finite, and, when it differs, its kind and distance (`differs`, from
    /// [`compare_element`](crate::measures::compare_element)'s rules). Returns the distance to
    /// count for the median, if any. The fast kernels (`kernels`, `avx2`, `avx512` beside this
    /// file) compute the same, lane for lane; tests hold them to it.
    #[inline(always)]
    pub(crate) fn add(
        &mut self,
        idx: u64,
        x: f64,
        y: f64,
        differs: Option<(Option<Special>, Option<u64>)>,
    ) -> Option<u64> {
        let both_finite = x.is_finite() && y.is_finite();
        if both_finite {
            self.rr += x * x;
            self.cc += y * y;
            self.rc += x * y;
        }
        let (special, ulp) = differs?;
        self.differing += 1;
        if self.first.is_none() {
            self.first = Some(idx);
        }
        match special {
            Some(Special::SignedZero) => self.signed_zero += 1,
            Some(Special::NanMismatch) => self.nan_mismatch += 1,
            Some(Special::NanPayload) => self.nan_payload += 1,
            Some(Special::Infinity) => self.infinity += 1,
            None => {}
        }
        if let Some(u) = ulp {
            self.max_ulp = self.max_ulp.max(u);
        }
        if both_finite {
            let d = (x - y).abs();
            self.dd += d * d;
            self.max_abs = self.max_abs.max(d);
            let rel = if x == 0.0 { f64::INFINITY } else { d / x.abs() };
            if d > 0.0 {
                self.max_rel = self.max_rel.max(rel);
            }
        }
        ulp
    }

    /// Element pairs compared.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// Element pairs that differ: in bits for one dtype, in value (widened exactly to f64)
    /// across two (docs/diff.md, "Mixed precision").
    pub fn differing(&self) -> u64 {
        self.differing
    }

    /// Flat index of the first differing pair.
    pub fn first(&self) -> Option<u64> {
        self.first
    }

    /// The largest distance among the differing pairs: 0 when none differs, None when every
    /// differing pair is a NaN pair (none has a distance).
    pub fn max_ulp(&self) -> Option<u64> {
        if self.differing == 0 {
            Some(0)
        } else {
            (self.with_distance() > 0).then_some(self.max_ulp)
        }
    }

    /// Max |r − c| over the differing pairs whose values are both finite (0 when there is none).
    pub fn max_abs(&self) -> f64 {
        self.max_abs
    }

    /// Max |r − c| / |r| over the same pairs; r = 0 with c ≠ 0 is +inf.
    pub fn max_rel(&self) -> f64 {
        self.max_rel
    }

    /// Σrc / √(Σr²·Σc²); 1 when no pair differs, None when undefined (a zero vector).
    pub fn cosine(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(1.0);
        }
        let den = (self.rr * self.cc).sqrt();
        (den > 0.0 && den.is_finite()).then(|| self.rc / den)
    }

    /// ⟨c, r⟩ / ⟨r, r⟩ − 1, the candidate's least-squares scale against the reference minus one
    /// (signed; finite pairs only, as the other sums); 0 when no pair differs.
    pub fn scale_error(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(0.0);
        }
        (self.rr > 0.0).then(|| self.rc / self.rr - 1.0)
    }

    /// √(Σ(r − c)² / Σr²); 0 when no pair differs, None when Σr² = 0 and some pair differs.
    pub fn rel_l2(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(0.0);
        }
        (self.rr > 0.0).then(|| (self.dd / self.rr).sqrt())
    }

    /// Differing pairs that have a ULP distance (everything but NaN pairs).
    pub fn with_distance(&self) -> u64 {
        self.differing - self.nan_mismatch - self.nan_payload
    }

    /// +0 against −0 (distance 0).
    pub fn signed_zero(&self) -> u64 {
        self.signed_zero
    }

    /// A NaN on exactly one side (no distance).
    pub fn nan_mismatch(&self) -> u64 {
        self.nan_mismatch
    }

    /// NaN on both sides with different bits (no distance).
    pub fn nan_payload(&self) -> u64 {
        self.nan_payload
    }

    /// An infinity on at least one side, no NaN (the distance counts ordered steps).
    pub fn infinity(&self) -> u64 {
        self.infinity
    }
}
