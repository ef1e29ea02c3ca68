//! The per-tensor scan: statistics of a tensor pair gathered chunk by chunk on the rayon pool,
//! by the careful element-by-element path or, for f32 and f32/bf16, a fast kernel
//! ([`super::kernels`]).

use rayon::prelude::*;
use tracegate_trace::DType;

use super::kernels::{scan_f32, scan_f32_bf16, LANES};
use super::median::{UlpCounts, Window};
use super::ordering::{
    classify, dispatch, mixed_pair, with_float, Float, Num, Pair, BF16K, F16K, F32K, F64K, I16K,
    I32K, I64K, I8K, U8K,
};
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

/// Runs `kernel` over [`CHUNK`]-element pieces of both payloads on the rayon pool, counting
/// distances in `window` when one is given. Statistics are merged in chunk order, so float
/// sums do not depend on the thread count; counts are integers and are summed per thread.
/// `sizes` are the reference's and the candidate's element sizes (they differ for mixed dtypes).
pub(super) fn scan_chunks(
    r: &[u8],
    c: &[u8],
    sizes: (usize, usize),
    window: Option<Window>,
    kernel: impl Fn(&[u8], &[u8], u64, Option<&mut UlpCounts>) -> Stats + Sync,
) -> (Stats, Option<UlpCounts>) {
    let (mut parts, ulps) = r
        .par_chunks(CHUNK * sizes.0)
        .zip(c.par_chunks(CHUNK * sizes.1))
        .enumerate()
        .fold(
            || (Vec::new(), window.map(UlpCounts::new)),
            |(mut parts, mut ulps), (i, (a, b))| {
                parts.push((i, kernel(a, b, (i * CHUNK) as u64, ulps.as_mut())));
                (parts, ulps)
            },
        )
        .reduce(
            || (Vec::new(), None),
            |(mut p, u), (q, v)| {
                p.extend(q);
                let merged = match (u, v) {
                    (Some(u), Some(v)) => Some(u.merge(v)),
                    (u, v) => u.or(v),
                };
                (p, merged)
            },
        );
    parts.sort_unstable_by_key(|p| p.0);
    (
        parts
            .into_iter()
            .map(|p| p.1)
            .fold(Stats::new(), Stats::merge),
        ulps,
    )
}

pub(super) fn scan_k<K: Num>(
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    scan_chunks(r, c, (K::SIZE, K::SIZE), window, scan_chunk::<K>)
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

/// Scans two payloads of the same element count; with `count`, also counts the ULP distances
/// that [`median_ulp`] needs, in a window placed from a sample first.
pub(crate) fn scan(pair: Pair, r: &[u8], c: &[u8], count: bool) -> (Stats, Option<UlpCounts>) {
    scan_window(pair, r, c, count.then(|| Window::place(pair, r, c)))
}

pub(super) fn scan_window(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    debug_assert_eq!(
        r.len() / pair.reference.size(),
        c.len() / pair.candidate.size()
    );
    match (pair.reference, pair.candidate) {
        (DType::F32, DType::F32) => scan_f32(r, c, window),
        (DType::F32, DType::BF16) => scan_f32_bf16::<true>(r, c, window),
        (DType::BF16, DType::F32) => scan_f32_bf16::<false>(r, c, window),
        (dtype, same) if dtype == same => dispatch!(dtype, scan_k, r, c, window),
        (rt, ct) => with_float!(rt, A => with_float!(ct, B => {
            scan_chunks(r, c, (A::SIZE, B::SIZE), window, scan_chunk_mixed::<A, B>)
        })),
    }
}
