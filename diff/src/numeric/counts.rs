//! The ULP distances a scan counts for the median: a window of buckets ([`Window`]) placed from
//! a sample, and the counts in it ([`UlpCounts`]). The scan and every fast kernel fill them;
//! `median` reads them.

use super::element::pair_element;
use super::ordering::Pair;

/// Buckets the scan counts distances into, around where the median is expected.
pub(super) const BUCKETS: usize = 4096;
/// Interleaved copies of every bucket, so that a run of equal distances (a tensor 1 ULP off
/// everywhere) does not serialise on one memory location.
pub(super) const COPIES: usize = 4;
/// Element pairs sampled before the scan to place the window.
pub(super) const SAMPLE: usize = 4096;

/// Where the scan counts ULP distances for the median: how many lie below `lo`, and how many
/// in each 2^shift-wide bucket of [lo, lo + BUCKETS·2^shift). A window that holds the median
/// gives it with no further pass over the data (when shift = 0) or one more (otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    pub(super) lo: u64,
    pub(super) shift: u32,
    /// Buckets in use (≤ BUCKETS): the window is no wider than the sample says, since every
    /// distance inside it costs a count and those outside only a compare.
    pub(super) buckets: u32,
}

impl Window {
    /// Counts [0, BUCKETS) one ULP per bucket: the window when a sample says nothing.
    pub(super) const SMALL: Window = Window {
        lo: 0,
        shift: 0,
        buckets: BUCKETS as u32,
    };

    /// The largest offset from `lo` inside the window (clamped: `lo + last` fits a u64).
    pub(super) fn last(&self) -> u64 {
        (((self.buckets as u128) << self.shift) - 1).min((u64::MAX - self.lo) as u128) as u64
    }

    /// The window for u32 distances (f32): its start and its last offset. A distance `u` is
    /// inside when `u − lo` (wrapping) is at most `last`: below `lo` it wraps above `last`.
    pub(super) fn as_u32(&self) -> (u32, u32) {
        let lo = self.lo.min(u32::MAX as u64) as u32;
        (lo, self.last().min((u32::MAX - lo) as u64) as u32)
    }

    /// Places the window from an evenly spaced sample of the pairs: it covers the sample's
    /// quantiles around the middle, widened as the sample shrinks, so that the true median
    /// falls inside unless the sample misleads badly (then the median costs more passes, and
    /// is still exact). Few differing pairs in the sample: count [0, BUCKETS) exactly.
    pub(super) fn place(pair: Pair, r: &[u8], c: &[u8]) -> Window {
        let n = r.len() / pair.reference.size();
        let picks = n.min(SAMPLE);
        let mut sample: Vec<u64> = (0..picks)
            .filter_map(|k| {
                let i = (k as u128 * n as u128 / picks as u128) as u64;
                pair_element(pair, r, c, i)?.1
            })
            .collect();
        if sample.len() < 64 {
            return Window::SMALL;
        }
        sample.sort_unstable();
        let m = sample.len();
        // Three standard errors of the sample median's rank, and at least 10% either side.
        let margin = (1.5 / (m as f64).sqrt()).max(0.1);
        let at = |q: f64| sample[((q * (m - 1) as f64).round() as usize).min(m - 1)];
        let (from, to) = (at((0.5 - margin).max(0.0)), at((0.5 + margin).min(1.0)));
        let span = (to - from) as u128 + 1;
        let shift = span
            .div_ceil(BUCKETS as u128)
            .next_power_of_two()
            .trailing_zeros();
        Window {
            lo: from,
            shift,
            buckets: span.div_ceil(1 << shift) as u32,
        }
    }
}

/// The scan's counts of ULP distances in a [`Window`]; NaN pairs, which have no distance, are
/// not counted. Fixed size: the memory does not grow with the tensor.
pub(crate) struct UlpCounts {
    pub(super) window: Window,
    pub(super) below: u64,
    pub(super) buckets: Box<[u64; BUCKETS * COPIES]>,
}

impl UlpCounts {
    pub(super) fn new(window: Window) -> UlpCounts {
        let buckets = vec![0; BUCKETS * COPIES]
            .into_boxed_slice()
            .try_into()
            .expect("BUCKETS * COPIES elements");
        UlpCounts {
            window,
            below: 0,
            buckets,
        }
    }

    /// Counts one pair in bucket `k`, in copy `j % COPIES`.
    #[inline(always)]
    pub(super) fn bump(&mut self, k: usize, j: usize) {
        self.bump_by(k, j, 1);
    }

    /// Adds `n` to bucket `k`, copy `j % COPIES`.
    #[inline(always)]
    pub(super) fn bump_by(&mut self, k: usize, j: usize, n: u64) {
        // The mask keeps the index in range without a bounds check in the hot loop (bucket
        // numbers are below BUCKETS by construction, or come with n = 0).
        self.buckets[(k * COPIES + j % COPIES) & (BUCKETS * COPIES - 1)] += n;
    }

    /// Counts one distance (the careful path's way).
    #[inline(always)]
    pub(super) fn add(&mut self, u: u64) {
        let w = self.window;
        if u < w.lo {
            self.below += 1;
        } else if u - w.lo <= w.last() {
            self.bump(((u - w.lo) >> w.shift) as usize, 0);
        }
    }

    /// Counts bucket numbers gathered by a fast kernel, the `j`-th into copy `j % COPIES`.
    #[inline(always)]
    pub(super) fn add_buckets(&mut self, buckets: &[u32]) {
        for (j, &k) in buckets.iter().enumerate() {
            self.bump(k as usize, j);
        }
    }

    pub(super) fn merge(mut self, o: UlpCounts) -> UlpCounts {
        debug_assert_eq!(self.window, o.window);
        self.below += o.below;
        for (x, y) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *x += y;
        }
        self
    }

    pub(super) fn bucket(&self, k: usize) -> u64 {
        self.buckets[k * COPIES..(k + 1) * COPIES].iter().sum()
    }

    /// The bucket that holds the `rank`-th smallest counted distance, if the window does.
    pub(super) fn bucket_of(&self, rank: u64) -> Option<usize> {
        let mut inside = rank.checked_sub(self.below)?;
        for k in 0..self.window.buckets as usize {
            let m = self.bucket(k);
            if inside < m {
                return Some(k);
            }
            inside -= m;
        }
        None
    }
}
