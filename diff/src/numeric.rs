//! Element-level arithmetic of a comparison: ULP distance in the stored dtype's own steps,
//! exact printing of values, and the per-tensor scan that gathers a divergence's statistics.
//!
//! Every float dtype maps its bits to an *ordered integer*: non-negative values keep their
//! magnitude bits, negative values take the negated magnitude. Adjacent representable values
//! are then adjacent integers, +0 and −0 both map to 0, and the distance across zero is the
//! sum of the two sides' steps. NaNs have no distance and are counted on their own.

use rayon::prelude::*;
use serde::Serialize;
use tracegate_trace::DType;

/// Elements per work unit: big enough to amortise scheduling, small enough to balance two
/// cores on a single large tensor. Chunks are folded back in index order, so every sum is
/// the same whatever the thread count.
const CHUNK: usize = 1 << 16;

/// One stored element type, seen as raw bits (zero-extended into a u64).
pub(crate) trait Num: Sync {
    const SIZE: usize;
    const FLOAT: bool;
    fn bits(b: &[u8]) -> u64;
    fn to_f64(bits: u64) -> f64;
    /// Ordered integer (floats) or the value itself (integers).
    fn ord(bits: u64) -> i128;
    fn is_nan(bits: u64) -> bool;
    fn is_inf(bits: u64) -> bool;
}

macro_rules! float_kind {
    ($name:ident, $size:expr, $bits:ty, $to_f64:expr, $exp_mask:expr, $man_mask:expr) => {
        pub(crate) struct $name;
        impl Num for $name {
            const SIZE: usize = $size;
            const FLOAT: bool = true;
            #[inline(always)]
            fn bits(b: &[u8]) -> u64 {
                <$bits>::from_le_bytes(b.try_into().unwrap()) as u64
            }
            #[inline(always)]
            fn to_f64(bits: u64) -> f64 {
                let f: fn($bits) -> f64 = $to_f64;
                f(bits as $bits)
            }
            #[inline(always)]
            fn ord(bits: u64) -> i128 {
                let sign: u64 = 1 << ($size * 8 - 1);
                let mag = (bits & (sign - 1)) as i128;
                if bits & sign != 0 {
                    -mag
                } else {
                    mag
                }
            }
            #[inline(always)]
            fn is_nan(bits: u64) -> bool {
                bits & $exp_mask == $exp_mask && bits & $man_mask != 0
            }
            #[inline(always)]
            fn is_inf(bits: u64) -> bool {
                bits & ($exp_mask | $man_mask) == $exp_mask
            }
        }
    };
}

float_kind!(F64K, 8, u64, |b| f64::from_bits(b), 0x7ff0_0000_0000_0000, 0x000f_ffff_ffff_ffff);
float_kind!(F32K, 4, u32, |b| f32::from_bits(b) as f64, 0x7f80_0000, 0x007f_ffff);
float_kind!(F16K, 2, u16, |b| half::f16::from_bits(b).to_f64(), 0x7c00, 0x03ff);
float_kind!(BF16K, 2, u16, |b| half::bf16::from_bits(b).to_f64(), 0x7f80, 0x007f);

macro_rules! int_kind {
    ($name:ident, $size:expr, $ty:ty) => {
        pub(crate) struct $name;
        impl Num for $name {
            const SIZE: usize = $size;
            const FLOAT: bool = false;
            #[inline(always)]
            fn bits(b: &[u8]) -> u64 {
                // Sign-extend through the signed type, then keep the raw pattern's width.
                <$ty>::from_le_bytes(b.try_into().unwrap()) as i128 as u64
            }
            #[inline(always)]
            fn to_f64(bits: u64) -> f64 {
                bits as $ty as f64
            }
            #[inline(always)]
            fn ord(bits: u64) -> i128 {
                bits as $ty as i128
            }
            fn is_nan(_: u64) -> bool {
                false
            }
            fn is_inf(_: u64) -> bool {
                false
            }
        }
    };
}

int_kind!(I64K, 8, i64);
int_kind!(I32K, 4, i32);
int_kind!(I16K, 2, i16);
int_kind!(I8K, 1, i8);
int_kind!(U8K, 1, u8);

/// Signed distance-free classification of one differing element pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Special {
    /// +0 against −0: distance 0, bytes differ.
    SignedZero,
    /// NaN on exactly one side.
    NanMismatch,
    /// NaN on both sides with different bits (payload or sign).
    NanPayload,
    /// An infinity on at least one side (the distance is still counted in ordered steps).
    Infinity,
}

impl Special {
    pub fn describe(self) -> &'static str {
        match self {
            Special::SignedZero => "signed-zero difference (+0 vs -0, 0 ULP)",
            Special::NanMismatch => "NaN mismatch (NaN on one side only)",
            Special::NanPayload => "NaN-payload difference (both NaN, different bits)",
            Special::Infinity => "infinity difference",
        }
    }
}

/// Classifies a differing pair (`a != b` as bits) and gives its ULP distance when it has one.
#[inline(always)]
pub(crate) fn classify<K: Num>(a: u64, b: u64) -> (Option<Special>, Option<u64>) {
    if K::FLOAT {
        let (na, nb) = (K::is_nan(a), K::is_nan(b));
        if na && nb {
            return (Some(Special::NanPayload), None);
        }
        if na || nb {
            return (Some(Special::NanMismatch), None);
        }
    }
    let d = (K::ord(a) - K::ord(b)).unsigned_abs() as u64;
    if K::FLOAT {
        if d == 0 {
            return (Some(Special::SignedZero), Some(0));
        }
        if K::is_inf(a) || K::is_inf(b) {
            return (Some(Special::Infinity), Some(d));
        }
    }
    (None, Some(d))
}

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
    fn new() -> Stats {
        Stats::default()
    }

    /// Appends a later range (indices are already absolute).
    fn merge(mut self, o: Stats) -> Stats {
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

    pub fn cosine(&self) -> Option<f64> {
        if self.differing == 0 {
            return Some(1.0);
        }
        let den = (self.rr * self.cc).sqrt();
        (den > 0.0 && den.is_finite()).then(|| self.rc / den)
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
fn scan_chunk<K: Num>(r: &[u8], c: &[u8], base: u64) -> Stats {
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
    for (i, (e, f)) in r.chunks_exact(K::SIZE).zip(c.chunks_exact(K::SIZE)).enumerate() {
        let (a, b) = (K::bits(e), K::bits(f));
        let (x, y) = (K::to_f64(a), K::to_f64(b));
        let both_finite = x.is_finite() && y.is_finite();
        if both_finite {
            s.rr += x * x;
            s.cc += y * y;
            s.rc += x * y;
        }
        if a == b {
            continue;
        }
        let idx = base + i as u64;
        s.differing += 1;
        if s.first.is_none() {
            s.first = Some(idx);
        }
        let (special, ulp) = classify::<K>(a, b);
        match special {
            Some(Special::SignedZero) => s.signed_zero += 1,
            Some(Special::NanMismatch) => s.nan_mismatch += 1,
            Some(Special::NanPayload) => s.nan_payload += 1,
            Some(Special::Infinity) => s.infinity += 1,
            None => {}
        }
        if let Some(u) = ulp {
            s.max_ulp = s.max_ulp.max(u);
        }
        if both_finite {
            let d = (x - y).abs();
            s.dd += d * d;
            s.max_abs = s.max_abs.max(d);
            let rel = if x == 0.0 { f64::INFINITY } else { d / x.abs() };
            if d > 0.0 {
                s.max_rel = s.max_rel.max(rel);
            }
        }
    }
    s
}

fn scan_k<K: Num>(r: &[u8], c: &[u8]) -> Stats {
    let step = CHUNK * K::SIZE;
    let parts: Vec<Stats> = r
        .par_chunks(step)
        .zip(c.par_chunks(step))
        .enumerate()
        .map(|(i, (a, b))| scan_chunk::<K>(a, b, (i * CHUNK) as u64))
        .collect();
    parts.into_iter().fold(Stats::new(), Stats::merge)
}

/// f32, the dtype of nearly every activation, gets a kernel the compiler can vectorise: 16
/// lanes per block with fixed per-lane accumulators (so sums do not depend on the vector
/// width), branch-free ULPs, and a fall-back to the careful path for any block holding a NaN
/// or an infinity.
fn scan_f32(r: &[u8], c: &[u8]) -> Stats {
    let step = CHUNK * 4;
    let parts: Vec<Stats> = r
        .par_chunks(step)
        .zip(c.par_chunks(step))
        .enumerate()
        .map(|(i, (a, b))| {
            let base = (i * CHUNK) as u64;
            if a == b {
                return scan_chunk::<F32K>(a, b, base);
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512dq") {
                // SAFETY: the CPU supports AVX-512 F and DQ (checked just above).
                return unsafe { scan_chunk_f32_avx512(a, b, base) };
            }
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU supports AVX2 (checked just above).
                return unsafe { scan_chunk_f32_avx2(a, b, base) };
            }
            scan_chunk_f32(a, b, base)
        })
        .collect();
    parts.into_iter().fold(Stats::new(), Stats::merge)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq")]
unsafe fn scan_chunk_f32_avx512(r: &[u8], c: &[u8], base: u64) -> Stats {
    scan_chunk_f32(r, c, base)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_chunk_f32_avx2(r: &[u8], c: &[u8], base: u64) -> Stats {
    scan_chunk_f32(r, c, base)
}

const LANES: usize = 16;

#[inline(always)]
fn scan_chunk_f32(r: &[u8], c: &[u8], base: u64) -> Stats {
    let mut s = Stats::new();
    let n = r.len() / 4;
    let (mut rr, mut cc, mut rc, mut dd) = ([0f64; LANES], [0f64; LANES], [0f64; LANES], [0f64; LANES]);
    // The largest d/|x| per lane is kept as a fraction (num/den) and divided once at the end:
    // a comparison by cross-multiplication costs far less than a division per element.
    let (mut max_abs, mut rel_num, mut rel_den) = ([0f64; LANES], [0f64; LANES], [1f64; LANES]);
    let (mut max_ulp, mut differing, mut signed_zero) = ([0u32; LANES], [0u32; LANES], [0u32; LANES]);
    let mut special = Stats::new();
    let mut rb = r.chunks_exact(4 * LANES);
    let mut cb = c.chunks_exact(4 * LANES);
    for (blk, (ra, ca)) in (&mut rb).zip(&mut cb).enumerate() {
        let mut a = [0u32; LANES];
        let mut b = [0u32; LANES];
        for i in 0..LANES {
            a[i] = u32::from_le_bytes(ra[4 * i..4 * i + 4].try_into().unwrap());
            b[i] = u32::from_le_bytes(ca[4 * i..4 * i + 4].try_into().unwrap());
        }
        let mut nonfinite = false;
        for i in 0..LANES {
            nonfinite |= (a[i] & 0x7f80_0000 == 0x7f80_0000) | (b[i] & 0x7f80_0000 == 0x7f80_0000);
        }
        if nonfinite {
            special = special.merge(scan_chunk::<F32K>(ra, ca, base + (blk * LANES) as u64));
            continue;
        }
        for i in 0..LANES {
            let (oa, ob) = (ord32(a[i]), ord32(b[i]));
            let u = if oa >= ob { oa.wrapping_sub(ob) as u32 } else { ob.wrapping_sub(oa) as u32 };
            let diff = (a[i] != b[i]) as u32;
            max_ulp[i] = max_ulp[i].max(u);
            differing[i] += diff;
            signed_zero[i] += diff & (u == 0) as u32;
            let x = f32::from_bits(a[i]) as f64;
            let y = f32::from_bits(b[i]) as f64;
            rr[i] += x * x;
            cc[i] += y * y;
            rc[i] += x * y;
            let d = (x - y).abs();
            dd[i] += d * d;
            max_abs[i] = max_abs[i].max(d);
            // x = 0 with d > 0 takes den = 0: the relative difference is +inf, as defined.
            let bigger = d * rel_den[i] > rel_num[i] * x.abs();
            rel_num[i] = if bigger { d } else { rel_num[i] };
            rel_den[i] = if bigger { x.abs() } else { rel_den[i] };
        }
    }
    // The tail (< 16 elements) takes the careful path.
    let done = n - n % LANES;
    let tail = scan_chunk::<F32K>(rb.remainder(), cb.remainder(), base + done as u64);
    for i in 0..LANES {
        s.rr += rr[i];
        s.cc += cc[i];
        s.rc += rc[i];
        s.dd += dd[i];
        s.max_abs = s.max_abs.max(max_abs[i]);
        if rel_num[i] > 0.0 {
            s.max_rel = s.max_rel.max(rel_num[i] / rel_den[i]);
        }
        s.max_ulp = s.max_ulp.max(max_ulp[i] as u64);
        s.differing += differing[i] as u64;
        s.signed_zero += signed_zero[i] as u64;
    }
    // Special blocks' and the tail's statistics join in; totals and the first index are the
    // chunk's own.
    let mut s = s.merge(special).merge(tail);
    s.total = n as u64;
    s.first = r.chunks_exact(4).zip(c.chunks_exact(4)).position(|(x, y)| x != y).map(|i| base + i as u64);
    s
}

/// f32 bits as an ordered integer (any non-NaN value: |result| ≤ 0x7f800000, so two of them
/// are at most 0xff000000 apart and the distance fits a u32).
#[inline(always)]
fn ord32(bits: u32) -> i32 {
    let m = (bits & 0x7fff_ffff) as i32;
    let s = (bits as i32) >> 31;
    (m ^ s).wrapping_sub(s)
}

/// Counts, per bucket of width `2^shift` starting at `lo`, the distances in
/// `[lo, lo + 65536·2^shift)`. Counts are integers, so per-thread histograms can be summed in
/// any order.
fn refine_k<K: Num>(r: &[u8], c: &[u8], lo: u64, shift: u32) -> Vec<u64> {
    refine_with(r, c, K::SIZE, |ra, ca, h| {
        for (e, f) in ra.chunks_exact(K::SIZE).zip(ca.chunks_exact(K::SIZE)) {
            let (a, b) = (K::bits(e), K::bits(f));
            if a == b {
                continue;
            }
            if let (_, Some(u)) = classify::<K>(a, b) {
                bump(h, u, lo, shift);
            }
        }
    })
}

/// The f32 form of [`refine_k`]: branch-free distances, NaN pairs skipped.
fn refine_f32(r: &[u8], c: &[u8], lo: u64, shift: u32) -> Vec<u64> {
    refine_with(r, c, 4, |ra, ca, h| {
        for (e, f) in ra.chunks_exact(4).zip(ca.chunks_exact(4)) {
            let a = u32::from_le_bytes(e.try_into().unwrap());
            let b = u32::from_le_bytes(f.try_into().unwrap());
            let nan = (a & 0x7fff_ffff > 0x7f80_0000) | (b & 0x7fff_ffff > 0x7f80_0000);
            if a == b || nan {
                continue;
            }
            let (oa, ob) = (ord32(a), ord32(b));
            let u = if oa >= ob { oa.wrapping_sub(ob) as u32 } else { ob.wrapping_sub(oa) as u32 };
            bump(h, u as u64, lo, shift);
        }
    })
}

#[inline(always)]
fn bump(h: &mut [u64], u: u64, lo: u64, shift: u32) {
    if u >= lo {
        let k = (u - lo) >> shift;
        if k < 1 << 16 {
            h[k as usize] += 1;
        }
    }
}

fn refine_with(r: &[u8], c: &[u8], size: usize, count: impl Fn(&[u8], &[u8], &mut Vec<u64>) + Sync) -> Vec<u64> {
    let step = CHUNK * size;
    let empty = || vec![0u64; 1 << 16];
    r.par_chunks(step)
        .zip(c.par_chunks(step))
        .fold(empty, |mut h, (ra, ca)| {
            if ra != ca {
                count(ra, ca, &mut h);
            }
            h
        })
        .reduce(empty, |mut a, b| {
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
            a
        })
}

macro_rules! dispatch {
    ($dtype:expr, $f:ident, $($arg:expr),*) => {
        match $dtype {
            DType::F64 => $f::<F64K>($($arg),*),
            DType::F32 => $f::<F32K>($($arg),*),
            DType::F16 => $f::<F16K>($($arg),*),
            DType::BF16 => $f::<BF16K>($($arg),*),
            DType::I64 => $f::<I64K>($($arg),*),
            DType::I32 => $f::<I32K>($($arg),*),
            DType::I16 => $f::<I16K>($($arg),*),
            DType::I8 => $f::<I8K>($($arg),*),
            DType::U8 | DType::Bool => $f::<U8K>($($arg),*),
        }
    };
}

/// Scans two equal-length payloads of one dtype.
pub(crate) fn scan(dtype: DType, r: &[u8], c: &[u8]) -> Stats {
    debug_assert_eq!(r.len(), c.len());
    if dtype == DType::F32 {
        return scan_f32(r, c);
    }
    dispatch!(dtype, scan_k, r, c)
}

/// The exact lower median of the ULP distances (rank ⌊(n−1)/2⌋ among the differing pairs that
/// have one). Each pass splits the remaining range [lo, lo + 2^bits) into 65536 buckets and
/// keeps the one holding the rank, starting from the bit length of the maximum: a distance
/// below 65536 takes one pass, any f32 distance at most two. No per-element memory is kept.
pub(crate) fn median_ulp(dtype: DType, r: &[u8], c: &[u8], stats: &Stats) -> Option<u64> {
    let n = stats.with_distance();
    if n == 0 {
        return None;
    }
    if stats.max_ulp == 0 {
        return Some(0);
    }
    let mut rank = (n - 1) / 2;
    let mut lo = 0u64;
    let mut bits = 64 - stats.max_ulp.leading_zeros();
    while bits > 0 {
        let shift = bits.saturating_sub(16);
        let h = if dtype == DType::F32 { refine_f32(r, c, lo, shift) } else { dispatch!(dtype, refine_k, r, c, lo, shift) };
        let mut k = 0usize;
        while rank >= h[k] {
            rank -= h[k];
            k += 1;
        }
        lo += (k as u64) << shift;
        bits = shift;
    }
    Some(lo)
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

/// The ULP (or, for integers, absolute) distance between two elements, and their special kind.
pub(crate) fn element_distance(dtype: DType, a: u64, b: u64) -> (Option<Special>, Option<u64>) {
    if a == b {
        return (None, Some(0));
    }
    dispatch!(dtype, classify, a, b)
}

/// Hex of the raw bits at the dtype's width, e.g. `0x3f800000` for f32 1.0.
pub fn hex_bits(dtype: DType, bits: u64) -> String {
    let width = dtype.size() * 2;
    let mask = if dtype.size() == 8 { u64::MAX } else { (1u64 << (dtype.size() * 8)) - 1 };
    format!("0x{:0width$x}", bits & mask)
}

/// The value as the shortest decimal that reads back to the same bits in its own dtype.
pub fn format_value(dtype: DType, bits: u64) -> String {
    match dtype {
        DType::F64 => fmt_float(f64::from_bits(bits)),
        // Rust's float Display is the shortest round-trip form for the float's own width.
        DType::F32 => {
            let v = f32::from_bits(bits as u32);
            if v.is_finite() && v != 0.0 && !(1e-5..1e16).contains(&v.abs()) {
                format!("{v:e}")
            } else {
                fmt_special(v as f64).unwrap_or_else(|| format!("{v}"))
            }
        }
        DType::F16 => shortest16(bits as u16, |b| half::f16::from_bits(b).to_f64(), |x| half::f16::from_f64(x).to_bits()),
        DType::BF16 => shortest16(bits as u16, |b| half::bf16::from_bits(b).to_f64(), |x| half::bf16::from_f64(x).to_bits()),
        DType::Bool => if bits & 0xff != 0 { "true".into() } else { "false".into() },
        DType::U8 => format!("{}", bits as u8),
        _ => format!("{}", bits as i64),
    }
}

fn fmt_special(v: f64) -> Option<String> {
    if v.is_nan() {
        Some("NaN".into())
    } else if v.is_infinite() {
        Some(if v > 0.0 { "inf".into() } else { "-inf".into() })
    } else {
        None
    }
}

fn fmt_float(v: f64) -> String {
    if let Some(s) = fmt_special(v) {
        return s;
    }
    if v != 0.0 && !(1e-5..1e16).contains(&v.abs()) {
        format!("{v:e}")
    } else {
        format!("{v}")
    }
}

/// Shortest decimal for a 16-bit float: the fewest significant digits whose correctly rounded
/// conversion back to the dtype gives the same bits (printing the widened f32 would show
/// digits the format does not have: bf16 0.1 is not "0.10009765625").
fn shortest16(bits: u16, widen: impl Fn(u16) -> f64, narrow: impl Fn(f64) -> u16) -> String {
    let v = widen(bits);
    if let Some(s) = fmt_special(v) {
        return s;
    }
    if v == 0.0 {
        return if bits & 0x8000 != 0 { "-0".into() } else { "0".into() };
    }
    for digits in 1..=17 {
        let s = format!("{:.*e}", digits - 1, v);
        let x: f64 = s.parse().expect("formatted float parses");
        if narrow(x) == bits {
            return fmt_float(x);
        }
    }
    fmt_float(v)
}

/// Row-major coordinates of a flat index.
pub fn unravel(mut index: u64, shape: &[u64]) -> Vec<u64> {
    let mut coords = vec![0u64; shape.len()];
    for (c, &d) in coords.iter_mut().zip(shape).rev() {
        if d > 0 {
            *c = index % d;
            index /= d;
        }
    }
    coords
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_dist(a: f32, b: f32) -> (Option<Special>, Option<u64>) {
        element_distance(DType::F32, a.to_bits() as u64, b.to_bits() as u64)
    }

    #[test]
    fn ulp_crosses_zero() {
        let tiny = f32::from_bits(1);
        assert_eq!(f32_dist(tiny, -tiny), (None, Some(2)));
        assert_eq!(f32_dist(0.0, -tiny), (None, Some(1)));
        assert_eq!(f32_dist(1.0, f32::from_bits(1.0f32.to_bits() + 1)), (None, Some(1)));
    }

    #[test]
    fn signed_zero_is_zero_ulp_but_named() {
        assert_eq!(f32_dist(0.0, -0.0), (Some(Special::SignedZero), Some(0)));
    }

    #[test]
    fn nan_cases_are_named_not_measured() {
        let q = f32::from_bits(0x7fc0_0000);
        let p = f32::from_bits(0x7fc0_0001);
        assert_eq!(f32_dist(q, 1.0), (Some(Special::NanMismatch), None));
        assert_eq!(f32_dist(q, p), (Some(Special::NanPayload), None));
    }

    #[test]
    fn infinity_is_one_step_past_max() {
        assert_eq!(f32_dist(f32::MAX, f32::INFINITY), (Some(Special::Infinity), Some(1)));
        let (k, d) = f32_dist(f32::INFINITY, f32::NEG_INFINITY);
        assert_eq!((k, d), (Some(Special::Infinity), Some(2 * 0x7f80_0000)));
    }

    #[test]
    fn sixteen_bit_units() {
        // One bf16 step is 1, not 65536.
        let one = half::bf16::from_f32(1.0).to_bits() as u64;
        assert_eq!(element_distance(DType::BF16, one, one + 1), (None, Some(1)));
        let one = half::f16::from_f32(1.0).to_bits() as u64;
        assert_eq!(element_distance(DType::F16, one, one + 3), (None, Some(3)));
        let one = 1.0f64.to_bits();
        assert_eq!(element_distance(DType::F64, one, one - 5), (None, Some(5)));
        assert_eq!(element_distance(DType::F64, 0, (-0.0f64).to_bits()), (Some(Special::SignedZero), Some(0)));
    }

    #[test]
    fn integers_report_absolute_difference() {
        let a = (-3i32) as u32 as u64;
        let b = 4u64;
        assert_eq!(element_distance(DType::I32, I32K::bits(&(a as u32).to_le_bytes()), b), (None, Some(7)));
        assert_eq!(element_distance(DType::I64, i64::MIN as u64, i64::MAX as u64), (None, Some(u64::MAX)));
    }

    #[test]
    fn shortest_printing() {
        assert_eq!(format_value(DType::BF16, half::bf16::from_f32(0.1).to_bits() as u64), "0.1");
        assert_eq!(format_value(DType::F16, half::f16::from_f32(0.1).to_bits() as u64), "0.1");
        assert_eq!(format_value(DType::F32, 0.1f32.to_bits() as u64), "0.1");
        assert_eq!(format_value(DType::F32, (-0.0f32).to_bits() as u64), "-0");
        assert_eq!(format_value(DType::F32, 1e-30f32.to_bits() as u64), "1e-30");
        assert_eq!(format_value(DType::F64, 0.1f64.to_bits()), "0.1");
        assert_eq!(hex_bits(DType::F32, 1.0f32.to_bits() as u64), "0x3f800000");
        assert_eq!(hex_bits(DType::BF16, 0x3f80), "0x3f80");
    }

    #[test]
    fn median_is_exact() {
        // Distances 1..=1001 ULP plus a huge outlier: the lower median is 501.
        let base = 1.0f32.to_bits();
        let mut r = Vec::new();
        let mut c = Vec::new();
        for i in 1..=1001u32 {
            r.extend_from_slice(&base.to_le_bytes());
            c.extend_from_slice(&(base + i * 1000 + 7).to_le_bytes());
        }
        let s = scan(DType::F32, &r, &c);
        assert_eq!(s.differing, 1001);
        assert_eq!(median_ulp(DType::F32, &r, &c, &s), Some(501 * 1000 + 7));
        assert_eq!(s.max_ulp, 1001 * 1000 + 7);
    }

    #[test]
    fn f32_fast_kernel_agrees_with_the_careful_path() {
        // Mixed: equal runs, small and huge ULPs, signed zeros, NaNs, infinities, zeros, a tail.
        let n = 3 * CHUNK + 37;
        let mut r = Vec::new();
        let mut c = Vec::new();
        for i in 0..n {
            let x = (((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0;
            let mut a = x.to_bits();
            let mut b = match i % 7 {
                0 | 1 => a,
                2 => a.wrapping_add((i % 500) as u32),
                3 => (-x).to_bits(),
                4 => (x * 1.5).to_bits(),
                5 => a ^ 1,
                _ => a,
            };
            match i % 1009 {
                0 => (a, b) = (0, 0x8000_0000),
                1 => b = 0x7fc0_0000,
                2 => (a, b) = (0x7fc0_0000, 0x7fc0_0001),
                3 => b = f32::INFINITY.to_bits(),
                4 => (a, b) = (0, 1),
                _ => {}
            }
            r.extend_from_slice(&a.to_le_bytes());
            c.extend_from_slice(&b.to_le_bytes());
        }
        let fast = scan(DType::F32, &r, &c);
        let careful = scan_k::<F32K>(&r, &c);
        assert_eq!(
            (fast.total, fast.differing, fast.first, fast.max_ulp, fast.signed_zero, fast.nan_mismatch, fast.nan_payload, fast.infinity),
            (careful.total, careful.differing, careful.first, careful.max_ulp, careful.signed_zero, careful.nan_mismatch, careful.nan_payload, careful.infinity)
        );
        assert_eq!((fast.max_abs, fast.max_rel), (careful.max_abs, careful.max_rel));
        for (x, y) in [(fast.rr, careful.rr), (fast.cc, careful.cc), (fast.rc, careful.rc), (fast.dd, careful.dd)] {
            assert!((x - y).abs() <= 1e-12 * y.abs(), "{x} vs {y}");
        }
        assert_eq!(median_ulp(DType::F32, &r, &c, &fast), median_ulp(DType::F32, &r, &c, &careful));
    }

    #[test]
    fn unravel_row_major() {
        assert_eq!(unravel(0, &[2, 3]), vec![0, 0]);
        assert_eq!(unravel(5, &[2, 3]), vec![1, 2]);
        assert_eq!(unravel(7, &[2, 3, 4]), vec![0, 1, 3]);
    }
}
