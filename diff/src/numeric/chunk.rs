//! One chunk of a tensor pair by the careful path, element by element ([`scan_chunk`], and
//! [`scan_chunk_mixed`] across two float dtypes), and the join of a fast kernel's blocks with
//! those it leaves to the careful path ([`finish_chunk`]).

use super::counts::UlpCounts;
use super::lanes::LANES;
use super::ordering::{classify, mixed_pair, Float, Num};
use super::pair_stats::Stats;

/// Elements per work unit: big enough to amortise scheduling, small enough to balance two
/// cores on a single large tensor. Chunks are folded back in index order, so every sum is
/// the same whatever the thread count.
pub(super) const CHUNK: usize = 1 << 16;

/// Sums and maxima over one chunk; `base` is the chunk's first absolute index.
pub(super) fn scan_chunk<K: Num>(
    r: &[u8],
    c: &[u8],
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
) -> Stats {
    let mut s = Stats::new();
    let n = r.len() / K::SIZE;
    s.total = n as u64;
    if r == c {
        // Identical bytes (the common case in a mostly-equal tensor): only the norms matter,
        // and rr = cc = rc, dd = 0.
        let mut acc = [0.0f64; 8];
        let mut finite_only = true;
        let mut blocks = r.chunks_exact(K::SIZE * 8);
        for blk in &mut blocks {
            for (i, e) in blk.chunks_exact(K::SIZE).enumerate() {
                let v = K::to_f64(K::bits(e));
                acc[i] += v * v;
            }
        }
        for e in blocks.remainder().chunks_exact(K::SIZE) {
            let v = K::to_f64(K::bits(e));
            acc[0] += v * v;
        }
        let mut sum = 0.0;
        for a in acc {
            sum += a;
        }
        if !sum.is_finite() {
            finite_only = false;
        }
        if finite_only {
            s.rr = sum;
            s.cc = sum;
            s.rc = sum;
            return s;
        }
    }
    for (i, (e, f)) in r
        .chunks_exact(K::SIZE)
        .zip(c.chunks_exact(K::SIZE))
        .enumerate()
    {
        let (a, b) = (K::bits(e), K::bits(f));
        let differs = (a != b).then(|| classify::<K>(a, b));
        let ulp = s.add(base + i as u64, K::to_f64(a), K::to_f64(b), differs);
        if let (Some(u), Some(counts)) = (ulp, ulps.as_deref_mut()) {
            counts.add(u);
        }
    }
    s
}

/// [`scan_chunk`] for two float dtypes, element by element ([`mixed_pair`]): the careful path
/// of every mixed pair, and the whole scan of all but f32 against bf16.
pub(super) fn scan_chunk_mixed<A: Float, B: Float>(
    r: &[u8],
    c: &[u8],
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
) -> Stats {
    let mut s = Stats::new();
    s.total = (r.len() / A::SIZE) as u64;
    for (i, (e, f)) in r
        .chunks_exact(A::SIZE)
        .zip(c.chunks_exact(B::SIZE))
        .enumerate()
    {
        let (a, b) = (A::bits(e), B::bits(f));
        let differs = mixed_pair::<A, B>(a, b);
        let ulp = s.add(base + i as u64, A::to_f64(a), B::to_f64(b), differs);
        if let (Some(u), Some(counts)) = (ulp, ulps.as_deref_mut()) {
            counts.add(u);
        }
    }
    s
}

/// Joins the blocks flagged in `nonfinite` (a NaN or an infinity) and the tail (< 16
/// elements), both taken by the careful path, to the statistics of a chunk's other full
/// blocks. `sizes` are the two sides' element sizes.
pub(super) fn finish_chunk(
    blocks: Stats,
    nonfinite: &[u64; CHUNK / LANES / 64],
    (r, c): (&[u8], &[u8]),
    sizes: (usize, usize),
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
    careful: impl Fn(&[u8], &[u8], u64, Option<&mut UlpCounts>) -> Stats,
) -> Stats {
    let (sr, sc) = sizes;
    let mut special = Stats::new();
    for (w, &word) in nonfinite.iter().enumerate() {
        let mut bits = word;
        while bits != 0 {
            let at = LANES * (64 * w + bits.trailing_zeros() as usize);
            let (ra, ca) = (
                &r[sr * at..sr * (at + LANES)],
                &c[sc * at..sc * (at + LANES)],
            );
            special = special.merge(careful(ra, ca, base + at as u64, ulps.as_deref_mut()));
            bits &= bits - 1;
        }
    }
    let n = r.len() / sr;
    let done = n - n % LANES;
    let tail = careful(&r[sr * done..], &c[sc * done..], base + done as u64, ulps);
    let first = [blocks.first, special.first, tail.first]
        .into_iter()
        .flatten()
        .min();
    let mut s = blocks.merge(special).merge(tail);
    s.total = n as u64;
    s.first = first;
    s
}
