//! The per-tensor scan: statistics of a tensor pair gathered chunk by chunk on the rayon pool,
//! by the careful element-by-element path or, for f32 and f32/bf16, a fast kernel
//! ([`super::kernels`]).

use rayon::prelude::*;
use tracegate_trace::DType;

use super::kernels::{scan_f32, scan_f32_bf16, LANES};
use super::median::{UlpCounts, Window};
use super::ordering::{
    classify, dispatch, mixed_pair, with_float, Float, Num, Pair, Special, BF16K, F16K, F32K, F64K,
    I16K, I32K, I64K, I8K, U8K,
};

/// Elements per work unit: big enough to amortise scheduling, small enough to balance two
/// cores on a single large tensor. Chunks are folded back in index order, so every sum is
/// the same whatever the thread count.
pub(super) const CHUNK: usize = 1 << 16;

/// Statistics of one tensor pair (or a range of it). Float sums run over pairs where both
/// values are finite; NaN and infinity pairs are counted, not summed.
#[derive(Clone, Debug, Default)]
pub(crate) struct Stats {
    pub total: u64,
    pub differing: u64,
    pub first: Option<u64>,
    pub max_ulp: u64,
    pub max_abs: f64,
    pub max_rel: f64,
    pub rr: f64,
    pub cc: f64,
    pub rc: f64,
    pub dd: f64,
    pub signed_zero: u64,
    pub nan_mismatch: u64,
    pub nan_payload: u64,
    pub infinity: u64,
}

impl Stats {
    pub(super) fn new() -> Stats {
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
    /// are finite, and, when it differs, its kind and distance (`differs`).
    #[inline(always)]
    pub(super) fn add(
        &mut self,
        idx: u64,
        x: f64,
        y: f64,
        differs: Option<(Option<Special>, Option<u64>)>,
        ulps: Option<&mut UlpCounts>,
    ) {
        let both_finite = x.is_finite() && y.is_finite();
        if both_finite {
            self.rr += x * x;
            self.cc += y * y;
            self.rc += x * y;
        }
        let Some((special, ulp)) = differs else {
            return;
        };
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
            if let Some(ulps) = ulps {
                ulps.add(u);
            }
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
    }

    pub fn cosine(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(1.0);
        }
        let den = (self.rr * self.cc).sqrt();
        (den > 0.0 && den.is_finite()).then(|| self.rc / den)
    }

    /// ⟨c, r⟩ / ⟨r, r⟩ − 1, the candidate's least-squares scale against the reference minus one
    /// (signed; finite pairs only, as the other sums).
    pub fn scale_error(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(0.0);
        }
        (self.rr > 0.0).then(|| self.rc / self.rr - 1.0)
    }

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
}

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
        s.add(
            base + i as u64,
            K::to_f64(a),
            K::to_f64(b),
            differs,
            ulps.as_deref_mut(),
        );
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
        s.add(
            base + i as u64,
            A::to_f64(a),
            B::to_f64(b),
            mixed_pair::<A, B>(a, b),
            ulps.as_deref_mut(),
        );
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
