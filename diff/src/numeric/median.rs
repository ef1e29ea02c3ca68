//! The exact lower median of a tensor pair's ULP distances, counted during the scan in a
//! fixed-size window of buckets, with further passes only when the window misses it.

use super::counts::{UlpCounts, Window, BUCKETS};
use super::ordering::Pair;
use super::pair_stats::Stats;
use super::scan::scan_window;

/// The exact lower median of the ULP distances (rank ⌊(n−1)/2⌋ among the differing pairs that
/// have one). When the rank falls in the scan's window, the counts give it (buckets 1 ULP
/// wide) or name the bucket that holds it; otherwise it lies somewhere in [0, 2^b), b the bit
/// length of the maximum. Each further pass scans again with that range as the window, split
/// into up to BUCKETS buckets, and keeps the one holding the rank: a bucket up to 4096 ULP
/// wide takes one pass. No per-element memory is kept.
pub(crate) fn median_ulp(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    stats: &Stats,
    ulps: &UlpCounts,
) -> Option<u64> {
    median_search(pair, r, c, stats, ulps).0
}

/// [`median_ulp`], and how many passes over the data it took beyond the scan.
pub(super) fn median_search(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    stats: &Stats,
    ulps: &UlpCounts,
) -> (Option<u64>, u32) {
    let n = stats.with_distance();
    if n == 0 {
        return (None, 0);
    }
    let rank = (n - 1) / 2;
    // [lo, lo + 2^bits) holds the rank-th distance: the scan's bucket that holds it, or else
    // every distance there is.
    let (mut lo, mut bits) = (0u64, 64 - stats.max_ulp.leading_zeros());
    if let Some(k) = ulps.bucket_of(rank) {
        (lo, bits) = (
            ulps.window.lo + ((k as u64) << ulps.window.shift),
            ulps.window.shift,
        );
    }
    let mut passes = 0;
    while bits > 0 {
        let shift = bits.saturating_sub(BUCKETS.trailing_zeros());
        let window = Window {
            lo,
            shift,
            buckets: 1 << (bits - shift),
        };
        let (_, counts) = scan_window(pair, r, c, Some(window));
        let k = counts
            .and_then(|u| u.bucket_of(rank))
            .expect("the range holds the rank");
        lo += (k as u64) << shift;
        bits = shift;
        passes += 1;
    }
    (Some(lo), passes)
}
