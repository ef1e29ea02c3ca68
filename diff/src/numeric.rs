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
        impl Float for $name {
            const FORMAT: Format = Format {
                exp: ($exp_mask as u64).count_ones(),
                frac: ($man_mask as u64).count_ones(),
            };
        }
    };
}

float_kind!(
    F64K,
    8,
    u64,
    |b| f64::from_bits(b),
    0x7ff0_0000_0000_0000,
    0x000f_ffff_ffff_ffff
);
float_kind!(
    F32K,
    4,
    u32,
    |b| f32::from_bits(b) as f64,
    0x7f80_0000,
    0x007f_ffff
);
float_kind!(
    F16K,
    2,
    u16,
    |b| half::f16::from_bits(b).to_f64(),
    0x7c00,
    0x03ff
);
float_kind!(
    BF16K,
    2,
    u16,
    |b| half::bf16::from_bits(b).to_f64(),
    0x7f80,
    0x007f
);

/// An IEEE binary float format: exponent bits and fraction bits (the significand has one more).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Format {
    pub exp: u32,
    pub frac: u32,
}

/// A float dtype's format, taken from its masks above (one place for it).
pub(crate) trait Float: Num {
    const FORMAT: Format;
}

fn format_of(dtype: DType) -> Option<Format> {
    match dtype {
        DType::F64 => Some(F64K::FORMAT),
        DType::F32 => Some(F32K::FORMAT),
        DType::F16 => Some(F16K::FORMAT),
        DType::BF16 => Some(BF16K::FORMAT),
        _ => None,
    }
}

/// The dtypes of a tensor pair that can be compared element by element: one dtype, or two
/// float dtypes (*mixed*, docs/diff.md "Mixed precision"). Anything else is a structure finding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pair {
    pub reference: DType,
    pub candidate: DType,
}

impl Pair {
    pub fn new(reference: DType, candidate: DType) -> Option<Pair> {
        (reference == candidate || (reference.is_float() && candidate.is_float())).then_some(Pair {
            reference,
            candidate,
        })
    }

    pub const fn same(dtype: DType) -> Pair {
        Pair {
            reference: dtype,
            candidate: dtype,
        }
    }

    pub fn is_mixed(self) -> bool {
        self.reference != self.candidate
    }

    /// The dtype whose steps count distances: the one with fewer significand bits (bf16 against
    /// f16: bf16, whose range holds f16's, so rounding f16 to it cannot overflow). None for
    /// integers, whose distance is the absolute difference.
    pub fn ulp_dtype(self) -> Option<DType> {
        let (r, c) = (format_of(self.reference)?, format_of(self.candidate)?);
        Some(if c.frac < r.frac {
            self.candidate
        } else {
            self.reference
        })
    }
}

/// The f64 bits of a float's value, exactly (every format here widens to f64 without
/// rounding). A NaN keeps its sign and its payload, left-aligned, so the quiet bit stays the
/// quiet bit: f32 0x7fc00000 and bf16 0x7fc0 both become 0x7ff8000000000000.
#[inline(always)]
fn widen<K: Float>(bits: u64) -> u64 {
    if K::is_nan(bits) {
        let Format { exp, frac } = K::FORMAT;
        let sign = (bits >> (exp + frac)) & 1;
        (sign << 63) | 0x7ff0_0000_0000_0000 | ((bits & ((1 << frac) - 1)) << (52 - frac))
    } else {
        K::to_f64(bits).to_bits()
    }
}

/// Rounds a non-NaN f64 (bits) to `to`, to nearest with ties to even, as IEEE 754 converts:
/// subnormals where `to` has them, and past the largest finite value to infinity. One
/// rounding from the exact value: f64 → bf16 through f32 would round twice (1 + 2^-8 + 2^-40
/// would tie at f32 and go to even, 1.0, instead of up to 1 + 2^-7).
#[inline(always)]
fn narrow(to: Format, x: u64) -> u64 {
    let Format { exp: e, frac: m } = to;
    let sign = (x >> 63) << (e + m);
    let mag = x & !(1 << 63);
    let inf = ((1u64 << e) - 1) << m;
    debug_assert!(mag <= 0x7ff0_0000_0000_0000, "NaN is never rounded");
    if mag == 0x7ff0_0000_0000_0000 {
        return sign | inf;
    }
    if mag == 0 {
        return sign;
    }
    // value = sig · 2^e2, its leading bit 2^p.
    let biased = (mag >> 52) as i64;
    let (sig, e2) = if biased == 0 {
        (mag, -1074)
    } else {
        ((mag & ((1 << 52) - 1)) | (1 << 52), biased - 1075)
    };
    let p = 63 - sig.leading_zeros() as i64 + e2;
    // The step of `to` at this magnitude: 2^(p − m) for a normal, the subnormal step below.
    let bias = (1i64 << (e - 1)) - 1;
    let subnormal_step = 1 - bias - m as i64;
    let step = (p - m as i64).max(subnormal_step);
    let shift = step - e2;
    let q = if shift <= 0 {
        sig << -shift
    } else if shift >= 64 {
        0 // below half a step (sig < 2^53)
    } else {
        let (q, rest, half) = (sig >> shift, sig & ((1 << shift) - 1), 1u64 << (shift - 1));
        q + (rest > half || (rest == half && q & 1 == 1)) as u64
    };
    // q steps of 2^step: the encoding counts steps from the subnormal step up (a carry out of
    // the fraction moves into the exponent field, as it should).
    let enc = (((step - subnormal_step) as u64) << m) + q;
    sign | enc.min(inf)
}

/// Bits of a value of format `K` rounded to `to` (unchanged when `to` is its own format).
#[inline(always)]
fn round_to<K: Float>(to: Format, bits: u64) -> u64 {
    if K::FORMAT == to {
        bits
    } else {
        narrow(to, widen::<K>(bits))
    }
}

/// Ordered integer of bits in format `f` (see the module comment).
#[inline(always)]
fn ord_in(f: Format, bits: u64) -> i64 {
    let sign = 1u64 << (f.exp + f.frac);
    let mag = (bits & (sign - 1)) as i64;
    if bits & sign != 0 {
        -mag
    } else {
        mag
    }
}

/// The format with fewer significand bits: the comparison dtype's (see [`Pair::ulp_dtype`]).
const fn coarser(a: Format, b: Format) -> Format {
    if b.frac < a.frac {
        b
    } else {
        a
    }
}

/// One element pair of two float formats `A` (reference) and `B` (candidate); None when they
/// are the same value. An element differs when the two values, widened exactly to f64, differ
/// in bits: a different real number, a zero of the other sign, a NaN against a number, or
/// NaNs of different sign or payload (left-aligned). Its distance is in the coarser format's
/// steps between both values rounded to it (0 when they round alike); its special kind
/// follows the real values, as for one dtype.
#[inline(always)]
fn mixed_pair<A: Float, B: Float>(a: u64, b: u64) -> Option<(Option<Special>, Option<u64>)> {
    let (x, y) = (widen::<A>(a), widen::<B>(b));
    if x == y {
        return None;
    }
    let (fx, fy) = (f64::from_bits(x), f64::from_bits(y));
    let (na, nb) = (fx.is_nan(), fy.is_nan());
    if na || nb {
        let special = if na && nb {
            Special::NanPayload
        } else {
            Special::NanMismatch
        };
        return Some((Some(special), None));
    }
    let to = coarser(A::FORMAT, B::FORMAT);
    let d = (ord_in(to, round_to::<A>(to, a)) - ord_in(to, round_to::<B>(to, b))).unsigned_abs();
    let special = if fx == 0.0 && fy == 0.0 {
        Some(Special::SignedZero)
    } else if fx.is_infinite() || fy.is_infinite() {
        Some(Special::Infinity)
    } else {
        None
    };
    Some((special, Some(d)))
}

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
    fn add(
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

/// Buckets the scan counts distances into, around where the median is expected.
const BUCKETS: usize = 4096;
/// Interleaved copies of every bucket, so that a run of equal distances (a tensor 1 ULP off
/// everywhere) does not serialise on one memory location.
const COPIES: usize = 4;
/// Element pairs sampled before the scan to place the window.
const SAMPLE: usize = 4096;

/// Where the scan counts ULP distances for the median: how many lie below `lo`, and how many
/// in each 2^shift-wide bucket of [lo, lo + BUCKETS·2^shift). A window that holds the median
/// gives it with no further pass over the data (when shift = 0) or one more (otherwise).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Window {
    lo: u64,
    shift: u32,
    /// Buckets in use (≤ BUCKETS): the window is no wider than the sample says, since every
    /// distance inside it costs a count and those outside only a compare.
    buckets: u32,
}

impl Window {
    /// Counts [0, BUCKETS) one ULP per bucket: the window when a sample says nothing.
    const SMALL: Window = Window {
        lo: 0,
        shift: 0,
        buckets: BUCKETS as u32,
    };

    /// The largest offset from `lo` inside the window (clamped: `lo + last` fits a u64).
    fn last(&self) -> u64 {
        (((self.buckets as u128) << self.shift) - 1).min((u64::MAX - self.lo) as u128) as u64
    }

    /// The window for u32 distances (f32): its start and its last offset. A distance `u` is
    /// inside when `u − lo` (wrapping) is at most `last`: below `lo` it wraps above `last`.
    fn as_u32(&self) -> (u32, u32) {
        let lo = self.lo.min(u32::MAX as u64) as u32;
        (lo, self.last().min((u32::MAX - lo) as u64) as u32)
    }

    /// Places the window from an evenly spaced sample of the pairs: it covers the sample's
    /// quantiles around the middle, widened as the sample shrinks, so that the true median
    /// falls inside unless the sample misleads badly (then the median costs more passes, and
    /// is still exact). Few differing pairs in the sample: count [0, BUCKETS) exactly.
    fn place(pair: Pair, r: &[u8], c: &[u8]) -> Window {
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
    window: Window,
    below: u64,
    buckets: Box<[u64; BUCKETS * COPIES]>,
}

impl UlpCounts {
    fn new(window: Window) -> UlpCounts {
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
    fn bump(&mut self, k: usize, j: usize) {
        self.bump_by(k, j, 1);
    }

    /// Adds `n` to bucket `k`, copy `j % COPIES`.
    #[inline(always)]
    fn bump_by(&mut self, k: usize, j: usize, n: u64) {
        // The mask keeps the index in range without a bounds check in the hot loop (bucket
        // numbers are below BUCKETS by construction, or come with n = 0).
        self.buckets[(k * COPIES + j % COPIES) & (BUCKETS * COPIES - 1)] += n;
    }

    /// Counts one distance (the careful path's way).
    #[inline(always)]
    fn add(&mut self, u: u64) {
        let w = self.window;
        if u < w.lo {
            self.below += 1;
        } else if u - w.lo <= w.last() {
            self.bump(((u - w.lo) >> w.shift) as usize, 0);
        }
    }

    /// Counts bucket numbers gathered by a fast kernel, the `j`-th into copy `j % COPIES`.
    #[inline(always)]
    fn add_buckets(&mut self, buckets: &[u32]) {
        for (j, &k) in buckets.iter().enumerate() {
            self.bump(k as usize, j);
        }
    }

    fn merge(mut self, o: UlpCounts) -> UlpCounts {
        debug_assert_eq!(self.window, o.window);
        self.below += o.below;
        for (x, y) in self.buckets.iter_mut().zip(o.buckets.iter()) {
            *x += y;
        }
        self
    }

    fn bucket(&self, k: usize) -> u64 {
        self.buckets[k * COPIES..(k + 1) * COPIES].iter().sum()
    }

    /// The bucket that holds the `rank`-th smallest counted distance, if the window does.
    fn bucket_of(&self, rank: u64) -> Option<usize> {
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

/// Sums and maxima over one chunk; `base` is the chunk's first absolute index.
fn scan_chunk<K: Num>(r: &[u8], c: &[u8], base: u64, mut ulps: Option<&mut UlpCounts>) -> Stats {
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
fn scan_chunk_mixed<A: Float, B: Float>(
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
fn scan_chunks(
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

fn scan_k<K: Num>(r: &[u8], c: &[u8], window: Option<Window>) -> (Stats, Option<UlpCounts>) {
    scan_chunks(r, c, (K::SIZE, K::SIZE), window, scan_chunk::<K>)
}

/// f32, the dtype of nearly every activation, gets fast kernels: AVX-512 intrinsics where the
/// CPU has them, else portable code the compiler vectorises. Blocks holding a NaN or an
/// infinity take the careful path.
fn scan_f32(r: &[u8], c: &[u8], window: Option<Window>) -> (Stats, Option<UlpCounts>) {
    #[cfg(target_arch = "x86_64")]
    let avx512 = std::is_x86_feature_detected!("avx512f")
        && std::is_x86_feature_detected!("avx512dq")
        && std::is_x86_feature_detected!("popcnt");
    scan_chunks(r, c, (4, 4), window, |a, b, base, ulps| {
        if a == b {
            return scan_chunk::<F32K>(a, b, base, ulps);
        }
        #[cfg(target_arch = "x86_64")]
        if avx512 {
            // SAFETY: the CPU has every feature the kernel enables (checked above).
            return unsafe {
                match ulps {
                    Some(u) => avx512::scan_chunk_f32::<true>(a, b, base, Some(u)),
                    None => avx512::scan_chunk_f32::<false>(a, b, base, None),
                }
            };
        }
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU supports AVX2 (checked just above).
            return unsafe { scan_chunk_f32_avx2(a, b, base, ulps) };
        }
        scan_chunk_f32(a, b, base, ulps)
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn scan_chunk_f32_avx2(
    r: &[u8],
    c: &[u8],
    base: u64,
    ulps: Option<&mut UlpCounts>,
) -> Stats {
    scan_chunk_f32(r, c, base, ulps)
}

const LANES: usize = 16;

/// Per-lane float accumulators of the fast kernels. The f32 kernels use 16 (LANES): lane `i`
/// takes the elements at `i` mod 16, whatever the vector width, so every f32 kernel gives the
/// same sums to the bit. The f32/bf16 kernel uses 4, one AVX2 vector each: sixteen would not
/// fit the sixteen AVX2 registers.
struct LaneSums<const N: usize> {
    rr: [f64; N],
    cc: [f64; N],
    rc: [f64; N],
    dd: [f64; N],
    max_abs: [f64; N],
    // The largest d/|x| is kept as a fraction (num/den) and divided once at the end: a
    // comparison by cross-multiplication costs far less than a division per element.
    rel_num: [f64; N],
    rel_den: [f64; N],
}

impl<const N: usize> LaneSums<N> {
    fn new() -> LaneSums<N> {
        let z = [0f64; N];
        LaneSums {
            rr: z,
            cc: z,
            rc: z,
            dd: z,
            max_abs: z,
            rel_num: z,
            rel_den: [1f64; N],
        }
    }

    /// Adds one finite pair (reference `x`, candidate `y`) to lane `i`.
    #[inline(always)]
    fn add(&mut self, i: usize, x: f64, y: f64) {
        self.rr[i] += x * x;
        self.cc[i] += y * y;
        self.rc[i] += x * y;
        let d = (x - y).abs();
        self.dd[i] += d * d;
        self.max_abs[i] = self.max_abs[i].max(d);
        // x = 0 with d > 0 takes den = 0: the relative difference is +inf, as defined.
        let bigger = d * self.rel_den[i] > self.rel_num[i] * x.abs();
        self.rel_num[i] = if bigger { d } else { self.rel_num[i] };
        self.rel_den[i] = if bigger { x.abs() } else { self.rel_den[i] };
    }

    /// Adds the lanes into `s` in lane order.
    fn fold_into(&self, s: &mut Stats) {
        for i in 0..N {
            s.rr += self.rr[i];
            s.cc += self.cc[i];
            s.rc += self.rc[i];
            s.dd += self.dd[i];
            s.max_abs = s.max_abs.max(self.max_abs[i]);
            if self.rel_num[i] > 0.0 {
                s.max_rel = s.max_rel.max(self.rel_num[i] / self.rel_den[i]);
            }
        }
    }
}

/// The portable f32 kernel: 16 lanes per block with fixed per-lane accumulators and
/// branch-free ULPs.
#[inline(always)]
fn scan_chunk_f32(r: &[u8], c: &[u8], base: u64, mut ulps: Option<&mut UlpCounts>) -> Stats {
    let mut s = Stats::new();
    let n = r.len() / 4;
    assert!(n <= CHUNK, "one chunk at a time");
    let mut lanes = LaneSums::<LANES>::new();
    let (mut max_ulp, mut differing, mut signed_zero) =
        ([0u32; LANES], [0u32; LANES], [0u32; LANES]);
    let mut nonfinite = [0u64; CHUNK / LANES / 64];
    let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
    let (lo, last) = window.as_u32();
    let mut rb = r.chunks_exact(4 * LANES);
    let mut cb = c.chunks_exact(4 * LANES);
    for (blk, (ra, ca)) in (&mut rb).zip(&mut cb).enumerate() {
        let mut a = [0u32; LANES];
        let mut b = [0u32; LANES];
        for i in 0..LANES {
            a[i] = u32::from_le_bytes(ra[4 * i..4 * i + 4].try_into().unwrap());
            b[i] = u32::from_le_bytes(ca[4 * i..4 * i + 4].try_into().unwrap());
        }
        let mut nonfinite_block = false;
        for i in 0..LANES {
            nonfinite_block |=
                (a[i] & 0x7f80_0000 == 0x7f80_0000) | (b[i] & 0x7f80_0000 == 0x7f80_0000);
        }
        if nonfinite_block {
            nonfinite[blk / 64] |= 1 << (blk % 64);
            continue;
        }
        let mut dist = [0u32; LANES];
        let mut diff = [false; LANES];
        for i in 0..LANES {
            let (oa, ob) = (ord32(a[i]), ord32(b[i]));
            let u = if oa >= ob {
                oa.wrapping_sub(ob) as u32
            } else {
                ob.wrapping_sub(oa) as u32
            };
            (dist[i], diff[i]) = (u, a[i] != b[i]);
            max_ulp[i] = max_ulp[i].max(u);
            differing[i] += diff[i] as u32;
            signed_zero[i] += (diff[i] & (u == 0)) as u32;
            lanes.add(i, f32::from_bits(a[i]) as f64, f32::from_bits(b[i]) as f64);
        }
        if let Some(u) = ulps.as_deref_mut() {
            for i in 0..LANES {
                u.below += (diff[i] & (dist[i] < lo)) as u64;
                let offset = dist[i].wrapping_sub(lo);
                if diff[i] & (offset <= last) {
                    u.bump((offset >> window.shift) as usize, i);
                }
            }
        }
    }
    lanes.fold_into(&mut s);
    for i in 0..LANES {
        s.max_ulp = s.max_ulp.max(max_ulp[i] as u64);
        s.differing += differing[i] as u64;
        s.signed_zero += signed_zero[i] as u64;
    }
    let done = n - n % LANES;
    s.first = r[..4 * done]
        .chunks_exact(4)
        .zip(c[..4 * done].chunks_exact(4))
        .position(|(x, y)| x != y)
        .map(|i| base + i as u64);
    finish_chunk(
        s,
        &nonfinite,
        (r, c),
        (4, 4),
        base,
        ulps,
        scan_chunk::<F32K>,
    )
}

/// f32 against bf16 (either side), the pair of a bf16 port: AVX2 intrinsics where the CPU
/// has them, else a portable kernel with the same arithmetic lane for lane (the same sums to
/// the bit; a test checks it). The compiler vectorised the portable one only in part, keeping
/// its accumulators in memory, hence the intrinsics. Blocks holding a NaN or an infinity take
/// the careful path, [`scan_chunk_mixed`].
fn scan_f32_bf16<const REF_F32: bool>(
    r: &[u8],
    c: &[u8],
    window: Option<Window>,
) -> (Stats, Option<UlpCounts>) {
    let sizes = if REF_F32 { (4, 2) } else { (2, 4) };
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::is_x86_feature_detected!("avx2")
        && std::is_x86_feature_detected!("fma")
        && std::is_x86_feature_detected!("popcnt");
    scan_chunks(r, c, sizes, window, |a, b, base, ulps| {
        #[cfg(target_arch = "x86_64")]
        if avx2 {
            // SAFETY: the CPU has every feature the kernel enables (checked above).
            return unsafe {
                match ulps {
                    Some(u) => avx2::scan_chunk_f32_bf16::<REF_F32, true>(a, b, base, Some(u)),
                    None => avx2::scan_chunk_f32_bf16::<REF_F32, false>(a, b, base, None),
                }
            };
        }
        scan_chunk_f32_bf16::<REF_F32>(a, b, base, ulps)
    })
}

/// One chunk of f32 against bf16 (`REF_F32`: the reference is the f32 side). With no NaN or
/// infinity in a block, the bf16 value's f32 bits are its bits shifted up 16 (exact), so an
/// element differs when those differ from the f32's, and its distance is between the f32
/// rounded to bf16 ([`f32_to_bf16`]) and the bf16, as ordered 16-bit integers.
#[inline(always)]
fn scan_chunk_f32_bf16<const REF_F32: bool>(
    r: &[u8],
    c: &[u8],
    base: u64,
    mut ulps: Option<&mut UlpCounts>,
) -> Stats {
    let (wide, short) = if REF_F32 { (r, c) } else { (c, r) };
    let n = short.len() / 2;
    assert!(
        n <= CHUNK && wide.len() == 4 * n,
        "one chunk of equal element counts at a time"
    );
    let mut lanes = LaneSums::<MIXED_LANES>::new();
    let (mut max_ulp, mut differing, mut signed_zero) = (
        [0u32; MIXED_LANES],
        [0u32; MIXED_LANES],
        [0u32; MIXED_LANES],
    );
    let mut nonfinite = [0u64; CHUNK / LANES / 64];
    let mut first = None;
    let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
    let (lo, last) = window.as_u32();
    for (blk, (wa, sa)) in wide
        .chunks_exact(4 * LANES)
        .zip(short.chunks_exact(2 * LANES))
        .enumerate()
    {
        let mut a = [0u32; LANES];
        let mut h = [0u32; LANES];
        for i in 0..LANES {
            a[i] = u32::from_le_bytes(wa[4 * i..4 * i + 4].try_into().unwrap());
            h[i] = u16::from_le_bytes(sa[2 * i..2 * i + 2].try_into().unwrap()) as u32;
        }
        let mut nonfinite_block = false;
        for i in 0..LANES {
            nonfinite_block |= (a[i] & 0x7f80_0000 == 0x7f80_0000) | (h[i] & 0x7f80 == 0x7f80);
        }
        if nonfinite_block {
            nonfinite[blk / 64] |= 1 << (blk % 64);
            continue;
        }
        let mut dist = [0u32; LANES];
        let mut diff = [false; LANES];
        // Four at a time in index order, lane j of every accumulator taking element 4g + j,
        // as the AVX2 kernel adds them.
        for g in 0..LANES / MIXED_LANES {
            let (mut x, mut y) = ([0f64; MIXED_LANES], [0f64; MIXED_LANES]);
            for j in 0..MIXED_LANES {
                let i = MIXED_LANES * g + j;
                let w = h[i] << 16;
                let u = ord16(f32_to_bf16(a[i])).abs_diff(ord16(h[i]));
                (dist[i], diff[i]) = (u, a[i] != w);
                max_ulp[j] = max_ulp[j].max(u);
                differing[j] += diff[i] as u32;
                signed_zero[j] += (diff[i] & ((a[i] | w) & 0x7fff_ffff == 0)) as u32;
                let (fa, fh) = (f32::from_bits(a[i]) as f64, f32::from_bits(w) as f64);
                (x[j], y[j]) = if REF_F32 { (fa, fh) } else { (fh, fa) };
            }
            for j in 0..MIXED_LANES {
                lanes.add(j, x[j], y[j]);
            }
        }
        if first.is_none() {
            first = diff
                .iter()
                .position(|&d| d)
                .map(|i| base + (LANES * blk + i) as u64);
        }
        if let Some(u) = ulps.as_deref_mut() {
            for i in 0..LANES {
                u.below += (diff[i] & (dist[i] < lo)) as u64;
                let offset = dist[i].wrapping_sub(lo);
                if diff[i] & (offset <= last) {
                    u.bump((offset >> window.shift) as usize, i);
                }
            }
        }
    }
    let mut s = Stats::new();
    lanes.fold_into(&mut s);
    for j in 0..MIXED_LANES {
        s.max_ulp = s.max_ulp.max(max_ulp[j] as u64);
        s.differing += differing[j] as u64;
        s.signed_zero += signed_zero[j] as u64;
    }
    s.first = first;
    finish_f32_bf16_chunk::<REF_F32>(s, &nonfinite, r, c, base, ulps)
}

/// [`finish_chunk`] for f32 against bf16, in either order.
fn finish_f32_bf16_chunk<const REF_F32: bool>(
    s: Stats,
    nonfinite: &[u64; CHUNK / LANES / 64],
    r: &[u8],
    c: &[u8],
    base: u64,
    ulps: Option<&mut UlpCounts>,
) -> Stats {
    if REF_F32 {
        finish_chunk(
            s,
            nonfinite,
            (r, c),
            (4, 2),
            base,
            ulps,
            scan_chunk_mixed::<F32K, BF16K>,
        )
    } else {
        finish_chunk(
            s,
            nonfinite,
            (r, c),
            (2, 4),
            base,
            ulps,
            scan_chunk_mixed::<BF16K, F32K>,
        )
    }
}

/// The f32/bf16 kernel in AVX2 intrinsics: the portable kernel's arithmetic lane for lane (so
/// the same sums to the bit), 8 elements per step, each accumulator one vector. When no
/// distances are counted, blocks are not checked for a NaN or an infinity: one makes the
/// chunk's Σx² or Σy² non-finite (the square of a finite f32 cannot overflow an f64, nor a
/// chunk's sum of them), and then the chunk is scanned again by the portable kernel.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Unsigned `a < b` per 32-bit lane, as a movemask (AVX2 compares only signed).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn lt_u32(a: __m256i, b: __m256i) -> u32 {
        let flip = _mm256_set1_epi32(i32::MIN);
        _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
            _mm256_xor_si256(b, flip),
            _mm256_xor_si256(a, flip),
        ))) as u32
    }

    /// Lanes whose f32 exponent bits are all set: an infinity or a NaN.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn nonfinite(v: __m256i) -> __m256i {
        let e = _mm256_set1_epi32(0x7f80_0000);
        _mm256_cmpeq_epi32(_mm256_and_si256(v, e), e)
    }

    #[target_feature(enable = "avx2,fma,popcnt")]
    pub(super) fn scan_chunk_f32_bf16<const REF_F32: bool, const COUNT: bool>(
        r: &[u8],
        c: &[u8],
        base: u64,
        mut ulps: Option<&mut UlpCounts>,
    ) -> Stats {
        let (wide, short) = if REF_F32 { (r, c) } else { (c, r) };
        let n = short.len() / 2;
        assert!(
            n <= CHUNK && wide.len() == 4 * n,
            "one chunk of equal element counts at a time"
        );
        // Counting distances cannot be undone, so that scan checks every block first.
        let mut flagged = [0u64; CHUNK / LANES / 64];
        let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
        let (lo, last) = window.as_u32();
        let (lo, last) = (_mm256_set1_epi32(lo as i32), _mm256_set1_epi32(last as i32));
        let shift = _mm_cvtsi32_si128(window.shift as i32);
        let abs = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fff_ffff_ffff_ffff));
        let (zero, one) = (_mm256_setzero_pd(), _mm256_set1_pd(1.0));
        let (mut rr, mut cc, mut rc, mut dd, mut max_abs, mut rel_num, mut rel_den) =
            (zero, zero, zero, zero, zero, zero, one);
        let mut max_ulp = _mm256_setzero_si256();
        let (mut differing, mut signed_zero) = (0u64, 0u64);
        let (mut first_step, mut first_mask) = (usize::MAX, 0u32);
        let mut buckets = [0u32; 8];
        // Elements 8·k .. 8·k + 8: the f32 bits and the bf16 bits (zero-extended), unaligned.
        let load = |k: usize| {
            // SAFETY: callers pass k < n / 8, so 32 bytes of the f32 side and 16 of the bf16
            // side lie inside the slices; unaligned loads accept any address.
            unsafe {
                (
                    _mm256_loadu_si256(wide.as_ptr().add(32 * k).cast()),
                    _mm256_cvtepu16_epi32(_mm_loadu_si128(short.as_ptr().add(16 * k).cast())),
                )
            }
        };
        // One half-block (8 elements) a step, loaded where it is used: with both halves of a
        // block in one step, the compiler moved accumulators out of their registers.
        let mut k = 0;
        while k < 2 * (n / LANES) {
            if COUNT && k % 2 == 0 {
                let ((a0, h0), (a1, h1)) = (load(k), load(k + 1));
                let (w0, w1) = (_mm256_slli_epi32(h0, 16), _mm256_slli_epi32(h1, 16));
                let any = _mm256_or_si256(
                    _mm256_or_si256(nonfinite(a0), nonfinite(a1)),
                    _mm256_or_si256(nonfinite(w0), nonfinite(w1)),
                );
                if _mm256_testz_si256(any, any) == 0 {
                    let blk = k / 2;
                    flagged[blk / 64] |= 1 << (blk % 64);
                    k += 2;
                    continue;
                }
            }
            let (a, h) = load(k);
            // The bf16 values' f32 bits: exact.
            let w = _mm256_slli_epi32(h, 16);
            // The distance between a rounded to bf16 (see f32_to_bf16; rounding is symmetric
            // in the sign, so it is done on the magnitude) and h, in sign-magnitude terms:
            // |mq − mh| when the signs agree, mq + mh when they differ (fewer operations
            // than two ordered integers).
            let ma = _mm256_and_si256(a, _mm256_set1_epi32(0x7fff_ffff));
            let mq = _mm256_srli_epi32(
                _mm256_add_epi32(
                    _mm256_add_epi32(ma, _mm256_set1_epi32(0x7fff)),
                    _mm256_and_si256(_mm256_srli_epi32(ma, 16), _mm256_set1_epi32(1)),
                ),
                16,
            );
            let mh = _mm256_and_si256(h, _mm256_set1_epi32(0x7fff));
            let signs_differ = _mm256_srai_epi32(_mm256_xor_si256(a, w), 31);
            let signed_mh = _mm256_sub_epi32(_mm256_xor_si256(mh, signs_differ), signs_differ);
            let u = _mm256_abs_epi32(_mm256_sub_epi32(mq, signed_mh));
            max_ulp = _mm256_max_epu32(max_ulp, u);
            let eq = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(a, w))) as u32;
            // Both zero, whatever their signs: no bit set but the sign bits.
            let z = _mm256_cmpeq_epi32(
                _mm256_slli_epi32(_mm256_or_si256(a, w), 1),
                _mm256_setzero_si256(),
            );
            let zeros = _mm256_movemask_ps(_mm256_castsi256_ps(z)) as u32;
            if COUNT {
                if let Some(counts) = ulps.as_deref_mut() {
                    let diff = !eq & 0xff;
                    counts.below += (diff & lt_u32(u, lo)).count_ones() as u64;
                    let offset = _mm256_sub_epi32(u, lo);
                    // offset ≤ last ⇔ not (last < offset)
                    let inside = diff & !lt_u32(last, offset);
                    // SAFETY: 8 u32 fit in `buckets`.
                    unsafe {
                        _mm256_storeu_si256(
                            buckets.as_mut_ptr().cast(),
                            _mm256_srl_epi32(offset, shift),
                        )
                    };
                    // Every lane adds 0 or 1: no branch per element (an index out of the
                    // window is masked into range and adds 0).
                    for (j, &b) in buckets.iter().enumerate() {
                        counts.bump_by(b as usize, 8 * (k % 2) + j, ((inside >> j) & 1) as u64);
                    }
                }
            }
            // The sums: elements 0–3, then 4–7, into lanes 0–3, as the portable kernel.
            // Products of two f32 are exact in f64, so a fused add rounds as the portable
            // kernel's separate add does; d·d is not, so it is not fused.
            let (fa, fw) = (_mm256_castsi256_ps(a), _mm256_castsi256_ps(w));
            for part in 0..2 {
                let (xa, xw) = if part == 0 {
                    (
                        _mm256_cvtps_pd(_mm256_castps256_ps128(fa)),
                        _mm256_cvtps_pd(_mm256_castps256_ps128(fw)),
                    )
                } else {
                    (
                        _mm256_cvtps_pd(_mm256_extractf128_ps(fa, 1)),
                        _mm256_cvtps_pd(_mm256_extractf128_ps(fw, 1)),
                    )
                };
                let (x, y) = if REF_F32 { (xa, xw) } else { (xw, xa) };
                rr = _mm256_fmadd_pd(x, x, rr);
                cc = _mm256_fmadd_pd(y, y, cc);
                rc = _mm256_fmadd_pd(x, y, rc);
                let d = _mm256_and_pd(_mm256_sub_pd(x, y), abs);
                dd = _mm256_add_pd(dd, _mm256_mul_pd(d, d));
                max_abs = _mm256_max_pd(max_abs, d);
                let ax = _mm256_and_pd(x, abs);
                let bigger = _mm256_cmp_pd::<_CMP_GT_OQ>(
                    _mm256_mul_pd(d, rel_den),
                    _mm256_mul_pd(rel_num, ax),
                );
                rel_num = _mm256_blendv_pd(rel_num, d, bigger);
                rel_den = _mm256_blendv_pd(rel_den, ax, bigger);
            }
            let diff = !eq & 0xff;
            differing += diff.count_ones() as u64;
            signed_zero += (diff & zeros).count_ones() as u64;
            if first_step == usize::MAX && diff != 0 {
                (first_step, first_mask) = (k, diff);
            }
            k += 1;
        }
        let mut lanes = LaneSums::<MIXED_LANES>::new();
        let outs = [
            &mut lanes.rr,
            &mut lanes.cc,
            &mut lanes.rc,
            &mut lanes.dd,
            &mut lanes.max_abs,
            &mut lanes.rel_num,
            &mut lanes.rel_den,
        ];
        for (v, out) in [rr, cc, rc, dd, max_abs, rel_num, rel_den]
            .into_iter()
            .zip(outs)
        {
            // SAFETY: each store writes 4 f64 into the 4 lanes of `out`.
            unsafe { _mm256_storeu_pd(out.as_mut_ptr(), v) };
        }
        if !COUNT && !(lanes.rr.iter().sum::<f64>() + lanes.cc.iter().sum::<f64>()).is_finite() {
            // A NaN or an infinity somewhere: the portable kernel sets those blocks aside.
            return super::scan_chunk_f32_bf16::<REF_F32>(r, c, base, ulps);
        }
        let mut m = [0u32; 8];
        // SAFETY: 8 u32 fit in `m`.
        unsafe { _mm256_storeu_si256(m.as_mut_ptr().cast(), max_ulp) };
        let mut s = Stats::new();
        lanes.fold_into(&mut s);
        s.max_ulp = m.into_iter().max().unwrap_or(0) as u64;
        (s.differing, s.signed_zero) = (differing, signed_zero);
        s.first = (first_step != usize::MAX)
            .then(|| base + (8 * first_step) as u64 + first_mask.trailing_zeros() as u64);
        finish_f32_bf16_chunk::<REF_F32>(s, &flagged, r, c, base, ulps)
    }
}

/// A finite f32 (bits) rounded to bf16, to nearest with ties to even: adding 0x7fff plus
/// the bit that becomes the last (bit 16) carries exactly when the dropped half is above
/// half, or at half with that bit odd; a carry into the exponent is the right result, up to
/// infinity. [`narrow`] is the general rule; a test checks that both agree.
#[inline(always)]
fn f32_to_bf16(bits: u32) -> u32 {
    (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
}

/// Float lanes of the f32/bf16 kernel (see [`LaneSums`]).
const MIXED_LANES: usize = 4;

/// 16-bit float bits (in a u32) as an ordered integer.
#[inline(always)]
fn ord16(bits: u32) -> i32 {
    let m = (bits & 0x7fff) as i32;
    let s = -(((bits >> 15) & 1) as i32);
    (m ^ s).wrapping_sub(s)
}

/// Joins the blocks flagged in `nonfinite` (a NaN or an infinity) and the tail (< 16
/// elements), both taken by the careful path, to the statistics of a chunk's other full
/// blocks. `sizes` are the two sides' element sizes.
fn finish_chunk(
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

/// The f32 kernel in AVX-512 intrinsics: the portable kernel's arithmetic lane for lane (so
/// the same sums to the bit) at about twice its speed. Distances in the window are packed
/// into a buffer and counted in batches by scalar code, which the core runs beside the
/// vector work; those outside it only cost a compare.
#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Bucket numbers gathered before a batch is counted.
    const PENDING: usize = 1024;

    /// Adds 8 pairs to one half's accumulators, as the portable kernel does lane for lane.
    /// A macro over named locals: in a struct or an array, the compiler keeps them in memory.
    macro_rules! accumulate {
        ($x:expr, $y:expr, $abs:expr, $rr:ident, $cc:ident, $rc:ident, $dd:ident, $max_abs:ident, $rel_num:ident, $rel_den:ident) => {{
            let (x, y) = ($x, $y);
            // Products of two f32 are exact in f64, so a fused add rounds as the portable
            // kernel's separate add does; d·d is not, so it is not fused.
            $rr = _mm512_fmadd_pd(x, x, $rr);
            $cc = _mm512_fmadd_pd(y, y, $cc);
            $rc = _mm512_fmadd_pd(x, y, $rc);
            let d = _mm512_and_pd(_mm512_sub_pd(x, y), $abs);
            $dd = _mm512_add_pd($dd, _mm512_mul_pd(d, d));
            $max_abs = _mm512_max_pd($max_abs, d);
            let ax = _mm512_and_pd(x, $abs);
            let bigger = _mm512_cmp_pd_mask::<_CMP_GT_OQ>(
                _mm512_mul_pd(d, $rel_den),
                _mm512_mul_pd($rel_num, ax),
            );
            $rel_num = _mm512_mask_mov_pd($rel_num, bigger, d);
            $rel_den = _mm512_mask_mov_pd($rel_den, bigger, ax);
        }};
    }

    #[target_feature(enable = "avx512f,avx512dq,popcnt")]
    pub(super) fn scan_chunk_f32<const COUNT: bool>(
        r: &[u8],
        c: &[u8],
        base: u64,
        mut ulps: Option<&mut UlpCounts>,
    ) -> Stats {
        let n = r.len() / 4;
        let blocks = n / LANES;
        assert!(n <= CHUNK, "one chunk at a time");
        // Blocks holding a NaN or an infinity, taken by the careful path after the loop (a
        // call inside it would keep every accumulator in memory).
        let mut nonfinite = [0u64; CHUNK / LANES / 64];
        let exp = _mm512_set1_epi32(0x7f80_0000);
        let mag = _mm512_set1_epi32(0x7fff_ffff);
        // The window as u32 (f32 distances fit): its start, last offset and bucket shift.
        let window = ulps.as_ref().map_or(Window::SMALL, |u| u.window);
        let (lo, last) = window.as_u32();
        let (lo, last) = (_mm512_set1_epi32(lo as i32), _mm512_set1_epi32(last as i32));
        let shift = _mm_cvtsi32_si128(window.shift as i32);
        let abs = _mm512_castsi512_pd(_mm512_set1_epi64(0x7fff_ffff_ffff_ffff));
        let (zero, one) = (_mm512_setzero_pd(), _mm512_set1_pd(1.0));
        let (mut rr0, mut cc0, mut rc0, mut dd0, mut max_abs0, mut rel_num0, mut rel_den0) =
            (zero, zero, zero, zero, zero, zero, one);
        let (mut rr1, mut cc1, mut rc1, mut dd1, mut max_abs1, mut rel_num1, mut rel_den1) =
            (zero, zero, zero, zero, zero, zero, one);
        let mut max_ulp = _mm512_setzero_si512();
        let (mut differing, mut signed_zero, mut below) = (0u64, 0u64, 0u64);
        let mut first = None;
        let mut pending = [0u32; PENDING + LANES];
        let mut queued = 0usize;
        for blk in 0..blocks {
            let at = 4 * LANES * blk;
            let (ra, ca) = (&r[at..at + 4 * LANES], &c[at..at + 4 * LANES]);
            // SAFETY: both slices hold exactly 64 bytes; unaligned loads accept any address.
            let (a, b) = unsafe {
                (
                    _mm512_loadu_si512(ra.as_ptr().cast()),
                    _mm512_loadu_si512(ca.as_ptr().cast()),
                )
            };
            let differs = _mm512_cmpneq_epi32_mask(a, b);
            if first.is_none() && differs != 0 {
                first = Some(base + (LANES * blk) as u64 + differs.trailing_zeros() as u64);
            }
            let (ma, mb) = (_mm512_and_si512(a, mag), _mm512_and_si512(b, mag));
            if _mm512_cmpge_epu32_mask(_mm512_max_epu32(ma, mb), exp) != 0 {
                nonfinite[blk / 64] |= 1 << (blk % 64);
                continue;
            }
            // The float part first: fewer values are live at once, and none spills.
            let (af, bf) = (_mm512_castsi512_ps(a), _mm512_castsi512_ps(b));
            accumulate!(
                _mm512_cvtps_pd(_mm512_castps512_ps256(af)),
                _mm512_cvtps_pd(_mm512_castps512_ps256(bf)),
                abs,
                rr0,
                cc0,
                rc0,
                dd0,
                max_abs0,
                rel_num0,
                rel_den0
            );
            accumulate!(
                _mm512_cvtps_pd(_mm512_extractf32x8_ps(af, 1)),
                _mm512_cvtps_pd(_mm512_extractf32x8_ps(bf, 1)),
                abs,
                rr1,
                cc1,
                rc1,
                dd1,
                max_abs1,
                rel_num1,
                rel_den1
            );
            // Ordered integers, and their distance as a u32 (max − min wraps correctly).
            let (sa, sb) = (_mm512_srai_epi32(a, 31), _mm512_srai_epi32(b, 31));
            let oa = _mm512_sub_epi32(_mm512_xor_si512(ma, sa), sa);
            let ob = _mm512_sub_epi32(_mm512_xor_si512(mb, sb), sb);
            let u = _mm512_sub_epi32(_mm512_max_epi32(oa, ob), _mm512_min_epi32(oa, ob));
            max_ulp = _mm512_max_epu32(max_ulp, u);
            differing += differs.count_ones() as u64;
            signed_zero += _mm512_mask_cmpeq_epi32_mask(differs, u, _mm512_setzero_si512())
                .count_ones() as u64;
            if COUNT {
                below += _mm512_mask_cmplt_epu32_mask(differs, u, lo).count_ones() as u64;
                let offset = _mm512_sub_epi32(u, lo);
                let inside = _mm512_mask_cmple_epu32_mask(differs, offset, last);
                let bucket = _mm512_srl_epi32(offset, shift);
                // SAFETY: `queued ≤ PENDING`, so 16 u32 fit from there.
                unsafe {
                    _mm512_storeu_si512(
                        pending.as_mut_ptr().add(queued).cast(),
                        _mm512_maskz_compress_epi32(inside, bucket),
                    )
                };
                queued += inside.count_ones() as usize;
                if queued >= PENDING {
                    if let Some(u) = ulps.as_deref_mut() {
                        u.add_buckets(&pending[..queued]);
                    }
                    queued = 0;
                }
            }
        }
        if let Some(u) = ulps.as_deref_mut() {
            u.add_buckets(&pending[..queued]);
            u.below += below;
        }
        // Every vector value leaves its register before the careful path's calls: one live
        // across a call keeps the compiler from holding any of them in registers in the loop.
        let mut lanes = LaneSums::<LANES>::new();
        let pairs = [
            (rr0, rr1),
            (cc0, cc1),
            (rc0, rc1),
            (dd0, dd1),
            (max_abs0, max_abs1),
            (rel_num0, rel_num1),
            (rel_den0, rel_den1),
        ];
        let outs = [
            &mut lanes.rr,
            &mut lanes.cc,
            &mut lanes.rc,
            &mut lanes.dd,
            &mut lanes.max_abs,
            &mut lanes.rel_num,
            &mut lanes.rel_den,
        ];
        for ((low, high), out) in pairs.into_iter().zip(outs) {
            // SAFETY: each store writes 8 f64 into 8 of the 16 lanes of `out`.
            unsafe {
                _mm512_storeu_pd(out.as_mut_ptr(), low);
                _mm512_storeu_pd(out.as_mut_ptr().add(8), high);
            }
        }
        let max_ulp = _mm512_reduce_max_epu32(max_ulp) as u64;
        let mut s = Stats::new();
        lanes.fold_into(&mut s);
        s.max_ulp = max_ulp;
        (s.differing, s.signed_zero, s.first) = (differing, signed_zero, first);
        finish_chunk(
            s,
            &nonfinite,
            (r, c),
            (4, 4),
            base,
            ulps,
            scan_chunk::<F32K>,
        )
    }
}

/// f32 bits as an ordered integer (any non-NaN value: |result| ≤ 0x7f800000, so two of them
/// are at most 0xff000000 apart and the distance fits a u32).
#[inline(always)]
fn ord32(bits: u32) -> i32 {
    let m = (bits & 0x7fff_ffff) as i32;
    let s = (bits as i32) >> 31;
    (m ^ s).wrapping_sub(s)
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
pub(crate) use dispatch;

/// Binds type `$A` to the float kind of `$dtype` in `$body`. Only for float dtypes: a
/// [`Pair`] of two dtypes is mixed only when both are floats.
macro_rules! with_float {
    ($dtype:expr, $A:ident => $body:expr) => {
        match $dtype {
            DType::F64 => {
                type $A = F64K;
                $body
            }
            DType::F32 => {
                type $A = F32K;
                $body
            }
            DType::F16 => {
                type $A = F16K;
                $body
            }
            DType::BF16 => {
                type $A = BF16K;
                $body
            }
            other => unreachable!("{other} is not a float dtype, and Pair::new admits only floats as a mixed pair"),
        }
    };
}

/// Scans two payloads of the same element count; with `count`, also counts the ULP distances
/// that [`median_ulp`] needs, in a window placed from a sample first.
pub(crate) fn scan(pair: Pair, r: &[u8], c: &[u8], count: bool) -> (Stats, Option<UlpCounts>) {
    scan_window(pair, r, c, count.then(|| Window::place(pair, r, c)))
}

fn scan_window(
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
fn median_search(
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

/// Raw bits of element `index` of a payload.
pub(crate) fn element_bits(dtype: DType, data: &[u8], index: u64) -> u64 {
    let size = dtype.size();
    let e = &data[index as usize * size..(index as usize + 1) * size];
    dispatch!(dtype, bits_of, e)
}

fn bits_of<K: Num>(e: &[u8]) -> u64 {
    K::bits(e)
}

/// Element `index` of a payload as a number (integers exactly up to 2^53).
pub(crate) fn element_value(dtype: DType, data: &[u8], index: u64) -> f64 {
    let bits = element_bits(dtype, data, index);
    dispatch!(dtype, value_of, bits)
}

fn value_of<K: Num>(bits: u64) -> f64 {
    K::to_f64(bits)
}

/// The ULP (or, for integers, absolute) distance between two elements, and their special kind.
pub(crate) fn element_distance(dtype: DType, a: u64, b: u64) -> (Option<Special>, Option<u64>) {
    if a == b {
        return (None, Some(0));
    }
    dispatch!(dtype, classify, a, b)
}

/// Element `index` of both payloads: its special kind and distance (in [`Pair::ulp_dtype`]'s
/// steps) when it differs, None when it does not.
pub(crate) fn pair_element(
    pair: Pair,
    r: &[u8],
    c: &[u8],
    index: u64,
) -> Option<(Option<Special>, Option<u64>)> {
    let (a, b) = (
        element_bits(pair.reference, r, index),
        element_bits(pair.candidate, c, index),
    );
    if !pair.is_mixed() {
        return (a != b).then(|| element_distance(pair.reference, a, b));
    }
    with_float!(pair.reference, A => with_float!(pair.candidate, B => mixed_pair::<A, B>(a, b)))
}

/// Hex of the raw bits at the dtype's width, e.g. `0x3f800000` for f32 1.0.
pub fn hex_bits(dtype: DType, bits: u64) -> String {
    let width = dtype.size() * 2;
    let mask = if dtype.size() == 8 {
        u64::MAX
    } else {
        (1u64 << (dtype.size() * 8)) - 1
    };
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
        DType::F16 => shortest16(
            bits as u16,
            |b| half::f16::from_bits(b).to_f64(),
            |x| half::f16::from_f64(x).to_bits(),
        ),
        DType::BF16 => shortest16(
            bits as u16,
            |b| half::bf16::from_bits(b).to_f64(),
            |x| half::bf16::from_f64(x).to_bits(),
        ),
        DType::Bool => {
            if bits & 0xff != 0 {
                "true".into()
            } else {
                "false".into()
            }
        }
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
        return if bits & 0x8000 != 0 {
            "-0".into()
        } else {
            "0".into()
        };
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

    const F32: Pair = Pair::same(DType::F32);

    fn f32_dist(a: f32, b: f32) -> (Option<Special>, Option<u64>) {
        element_distance(DType::F32, a.to_bits() as u64, b.to_bits() as u64)
    }

    #[test]
    fn ulp_crosses_zero() {
        let tiny = f32::from_bits(1);
        assert_eq!(f32_dist(tiny, -tiny), (None, Some(2)));
        assert_eq!(f32_dist(0.0, -tiny), (None, Some(1)));
        assert_eq!(
            f32_dist(1.0, f32::from_bits(1.0f32.to_bits() + 1)),
            (None, Some(1))
        );
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
        assert_eq!(
            f32_dist(f32::MAX, f32::INFINITY),
            (Some(Special::Infinity), Some(1))
        );
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
        assert_eq!(
            element_distance(DType::F64, 0, (-0.0f64).to_bits()),
            (Some(Special::SignedZero), Some(0))
        );
    }

    #[test]
    fn integers_report_absolute_difference() {
        let a = (-3i32) as u32 as u64;
        let b = 4u64;
        assert_eq!(
            element_distance(DType::I32, I32K::bits(&(a as u32).to_le_bytes()), b),
            (None, Some(7))
        );
        assert_eq!(
            element_distance(DType::I64, i64::MIN as u64, i64::MAX as u64),
            (None, Some(u64::MAX))
        );
    }

    #[test]
    fn shortest_printing() {
        assert_eq!(
            format_value(DType::BF16, half::bf16::from_f32(0.1).to_bits() as u64),
            "0.1"
        );
        assert_eq!(
            format_value(DType::F16, half::f16::from_f32(0.1).to_bits() as u64),
            "0.1"
        );
        assert_eq!(format_value(DType::F32, 0.1f32.to_bits() as u64), "0.1");
        assert_eq!(format_value(DType::F32, (-0.0f32).to_bits() as u64), "-0");
        assert_eq!(format_value(DType::F32, 1e-30f32.to_bits() as u64), "1e-30");
        assert_eq!(format_value(DType::F64, 0.1f64.to_bits()), "0.1");
        assert_eq!(hex_bits(DType::F32, 1.0f32.to_bits() as u64), "0x3f800000");
        assert_eq!(hex_bits(DType::BF16, 0x3f80), "0x3f80");
    }

    /// The lower median by sorting every distance: what `median_ulp` must match.
    fn sorted_median(pair: Pair, r: &[u8], c: &[u8]) -> Option<u64> {
        let mut d: Vec<u64> = (0..(r.len() / pair.reference.size()) as u64)
            .filter_map(|i| pair_element(pair, r, c, i)?.1)
            .collect();
        d.sort_unstable();
        (!d.is_empty()).then(|| d[(d.len() - 1) / 2])
    }

    /// The median, the passes it took beyond the scan, and the scan's window.
    fn median(pair: Pair, r: &[u8], c: &[u8]) -> (Option<u64>, u32, Window) {
        let (s, ulps) = scan(pair, r, c, true);
        let ulps = ulps.expect("counted");
        let (m, passes) = median_search(pair, r, c, &s, &ulps);
        (m, passes, ulps.window)
    }

    fn f32_pairs(n: usize, step: impl Fn(usize) -> u32) -> (Vec<u8>, Vec<u8>) {
        let (mut r, mut c) = (Vec::new(), Vec::new());
        for i in 0..n {
            let x = ((((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0).to_bits();
            r.extend_from_slice(&x.to_le_bytes());
            c.extend_from_slice(&x.wrapping_add(step(i)).to_le_bytes());
        }
        (r, c)
    }

    #[test]
    fn median_matches_a_sort() {
        let n = 2 * CHUNK + 21;
        // (case, distances, passes beyond the scan): none when the window's 1-ULP buckets hold
        // the median, one to split a wider bucket, more from scratch when the window misses.
        type Distances = Box<dyn Fn(usize) -> u32>;
        let cases: Vec<(&str, Distances, u32)> = vec![
            ("1..97 ULP", Box::new(|i| 1 + (i % 97) as u32), 0),
            ("1 ULP everywhere", Box::new(|_| 1), 0),
            (
                "half equal",
                Box::new(|i| (i % 2) as u32 * (i % 300) as u32),
                0,
            ),
            ("4000..6000 ULP", Box::new(|i| 4000 + (i % 2001) as u32), 0),
            (
                "wide: up to 10^6 ULP",
                Box::new(|i| ((i * 7919) % 1_000_003) as u32),
                1,
            ),
            (
                "huge spread",
                Box::new(|i| ((i as u32).wrapping_mul(2654435761)) >> 6),
                1,
            ),
            (
                "sparse, small",
                Box::new(|i| {
                    if i % 9973 == 0 {
                        1 + (i % 50) as u32
                    } else {
                        0
                    }
                }),
                0,
            ),
            (
                "sparse, large",
                Box::new(|i| if i % 9973 == 0 { 100_000 + i as u32 } else { 0 }),
                2,
            ),
        ];
        for (name, step, passes) in cases {
            let (r, c) = f32_pairs(n, step);
            let (m, p, window) = median(F32, &r, &c);
            assert_eq!(m, sorted_median(F32, &r, &c), "{name}");
            assert_eq!(p, passes, "{name}: window {window:?}");
        }
        // Distances 1..=1001 ULP × 1000 plus 7 (every pair sampled, window buckets wider than 1).
        let (r, c) = f32_pairs(1001, |i| (i as u32 + 1) * 1000 + 7);
        assert_eq!(median(F32, &r, &c).0, Some(501 * 1000 + 7));
    }

    #[test]
    fn median_is_exact_when_the_sample_misleads() {
        // The sampled pairs differ by 1 ULP, every other by 5000: the window, placed from the
        // sample, misses the median, and passes over [0, 2^13) find it: 4096 buckets of 2 ULP,
        // then the 2 ULP that hold it.
        let n = 64 * SAMPLE;
        let sampled = |i: usize| (0..SAMPLE).any(|k| k * n / SAMPLE == i);
        let sampled: Vec<bool> = (0..n).map(sampled).collect();
        let (r, c) = f32_pairs(n, |i| if sampled[i] { 1 } else { 5000 });
        let (m, passes, window) = median(F32, &r, &c);
        assert_eq!((m, passes), (Some(5000), 2));
        assert!(
            5000 - window.lo > window.last(),
            "the window {window:?} was meant to miss the median"
        );
    }

    #[test]
    fn median_in_every_dtype_and_with_specials() {
        // NaN pairs have no distance and are left out; signed zeros count as 0 ULP.
        let n = CHUNK + 5;
        let (mut r, mut c) = f32_pairs(n, |i| (i % 13) as u32);
        for i in (0..n).step_by(11) {
            r[4 * i..4 * i + 4].copy_from_slice(&0x7fc0_0000u32.to_le_bytes());
        }
        for i in (3..n).step_by(17) {
            r[4 * i..4 * i + 4].copy_from_slice(&0u32.to_le_bytes());
            c[4 * i..4 * i + 4].copy_from_slice(&0x8000_0000u32.to_le_bytes());
        }
        assert_eq!(median(F32, &r, &c).0, sorted_median(F32, &r, &c));
        for (dtype, size) in [
            (DType::F64, 8),
            (DType::F16, 2),
            (DType::BF16, 2),
            (DType::I32, 4),
            (DType::I8, 1),
        ] {
            let (mut r, mut c) = (Vec::new(), Vec::new());
            for i in 0..n as u64 {
                let x = (i.wrapping_mul(2654435761) >> 3) & 0x3fff;
                let y = x + (i % 29) * (i % 3);
                r.extend_from_slice(&x.to_le_bytes()[..size]);
                c.extend_from_slice(&y.to_le_bytes()[..size]);
            }
            assert_eq!(
                median(Pair::same(dtype), &r, &c).0,
                sorted_median(Pair::same(dtype), &r, &c),
                "{dtype:?}"
            );
        }
        // The widest distance there is: i64::MIN against i64::MAX, 2^64 − 1.
        let (r, c): (Vec<u8>, Vec<u8>) = (
            i64::MIN.to_le_bytes().repeat(3).into_iter().collect(),
            i64::MAX.to_le_bytes().repeat(3).into_iter().collect(),
        );
        assert_eq!(median(Pair::same(DType::I64), &r, &c).0, Some(u64::MAX));
    }

    /// CI machines may lack AVX-512: a loud line, not a silent pass and not a failure. Written
    /// to the stderr handle, which the test harness does not capture (`eprintln!` it hides).
    #[allow(dead_code)]
    fn not_checked(why: &str) {
        use std::io::Write;
        let _ = writeln!(
            std::io::stderr(),
            "NOT CHECKED: AVX-512 kernel ≡ portable kernel (diff/src/numeric.rs): {why}"
        );
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
        let counts = |u: &UlpCounts| {
            (
                u.below,
                (0..BUCKETS).map(|k| u.bucket(k)).collect::<Vec<_>>(),
            )
        };
        for window in [
            Window::place(F32, &r, &c),
            Window::SMALL,
            Window {
                lo: 100,
                shift: 3,
                buckets: 77,
            },
            Window {
                lo: 1 << 20,
                shift: 9,
                buckets: BUCKETS as u32,
            },
        ] {
            let (fast, fast_ulps) = scan_f32(&r, &c, Some(window));
            let (careful, careful_ulps) = scan_k::<F32K>(&r, &c, Some(window));
            assert_eq!(
                (
                    fast.total,
                    fast.differing,
                    fast.first,
                    fast.max_ulp,
                    fast.signed_zero,
                    fast.nan_mismatch,
                    fast.nan_payload,
                    fast.infinity
                ),
                (
                    careful.total,
                    careful.differing,
                    careful.first,
                    careful.max_ulp,
                    careful.signed_zero,
                    careful.nan_mismatch,
                    careful.nan_payload,
                    careful.infinity
                )
            );
            assert_eq!(
                (fast.max_abs, fast.max_rel),
                (careful.max_abs, careful.max_rel)
            );
            for (x, y) in [
                (fast.rr, careful.rr),
                (fast.cc, careful.cc),
                (fast.rc, careful.rc),
                (fast.dd, careful.dd),
            ] {
                assert!((x - y).abs() <= 1e-12 * y.abs(), "{x} vs {y}");
            }
            let (fast_ulps, careful_ulps) = (fast_ulps.unwrap(), careful_ulps.unwrap());
            assert_eq!(counts(&fast_ulps), counts(&careful_ulps), "{window:?}");
            assert_eq!(
                median_ulp(F32, &r, &c, &fast, &fast_ulps),
                sorted_median(F32, &r, &c)
            );
        }
        // The AVX-512 kernel and the portable one: the same statistics to the bit, chunk by chunk.
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx512f")
            && std::is_x86_feature_detected!("avx512dq")
            && std::is_x86_feature_detected!("popcnt")
        {
            let window = Window::place(F32, &r, &c);
            for (k, (a, b)) in r.chunks(4 * CHUNK).zip(c.chunks(4 * CHUNK)).enumerate() {
                let (mut u, mut v) = (UlpCounts::new(window), UlpCounts::new(window));
                // SAFETY: the CPU has the features (checked above).
                let x = unsafe { avx512::scan_chunk_f32::<true>(a, b, 0, Some(&mut u)) };
                let y = scan_chunk_f32(a, b, 0, Some(&mut v));
                let bits =
                    |s: &Stats| [s.rr, s.cc, s.rc, s.dd, s.max_abs, s.max_rel].map(f64::to_bits);
                assert_eq!(bits(&x), bits(&y), "chunk {k}");
                assert_eq!(
                    (x.differing, x.first, x.max_ulp, x.signed_zero, x.infinity),
                    (y.differing, y.first, y.max_ulp, y.signed_zero, y.infinity)
                );
                assert_eq!(counts(&u), counts(&v), "chunk {k}");
            }
        } else {
            not_checked(
                "this CPU lacks avx512f/avx512dq/popcnt, so the AVX-512 kernel cannot run here",
            );
        }
        #[cfg(not(target_arch = "x86_64"))]
        not_checked("not an x86_64 build, so there is no AVX-512 kernel");
    }

    /// Rounds bits of `K` to `to`'s format, as the mixed scan does.
    fn rnd<K: Float, T: Float>(bits: u64) -> u64 {
        round_to::<K>(T::FORMAT, bits)
    }

    #[test]
    fn rounding_is_to_nearest_even_worked_by_hand() {
        // f32 → bf16: the low 16 bits are dropped; 0x8000 is exactly half a bf16 step.
        assert_eq!(
            rnd::<F32K, BF16K>(0x3f80_8000),
            0x3f80,
            "tie, 0x3f80 even: down"
        );
        assert_eq!(
            rnd::<F32K, BF16K>(0x3f81_8000),
            0x3f82,
            "tie, 0x3f81 odd: up"
        );
        assert_eq!(rnd::<F32K, BF16K>(0x3f80_8001), 0x3f81, "above half: up");
        assert_eq!(rnd::<F32K, BF16K>(0x3f80_7fff), 0x3f80, "below half: down");
        assert_eq!(
            rnd::<F32K, BF16K>(0xbf81_8000),
            0xbf82,
            "the sign does not change the rule"
        );
        assert_eq!(
            rnd::<F32K, BF16K>(0x0000_8000),
            0x0000,
            "subnormal tie to even zero"
        );
        assert_eq!(rnd::<F32K, BF16K>(0x0001_8000), 0x0002, "subnormal tie up");
        assert_eq!(rnd::<F32K, BF16K>(0x8000_0000), 0x8000, "-0 stays -0");
        assert_eq!(
            rnd::<F32K, BF16K>(0x7f7f_7fff),
            0x7f7f,
            "below half past bf16 MAX: MAX"
        );
        assert_eq!(
            rnd::<F32K, BF16K>(0x7f7f_8000),
            0x7f80,
            "tie at the top: even, which is infinity"
        );
        assert_eq!(
            rnd::<F32K, BF16K>(0x7f7f_ffff),
            0x7f80,
            "f32 MAX overflows to +inf"
        );
        assert_eq!(rnd::<F32K, BF16K>(0xff80_0000), 0xff80, "-inf stays -inf");
        // f32 → f16: 13 bits dropped (0x1000 is half a step), 5-bit exponent.
        assert_eq!(
            rnd::<F32K, F16K>(0x3f80_1000),
            0x3c00,
            "1 + 2^-11: tie, down to even"
        );
        assert_eq!(
            rnd::<F32K, F16K>(0x3f80_3000),
            0x3c02,
            "1 + 3·2^-11: tie, up to even"
        );
        assert_eq!(
            rnd::<F32K, F16K>(0x477f_f000),
            0x7c00,
            "65520: tie between 65504 and 65536, even is infinity"
        );
        assert_eq!(rnd::<F32K, F16K>(0x477f_ef00), 0x7bff, "65519: 65504");
        assert_eq!(
            rnd::<F32K, F16K>(0x3380_0000),
            0x0001,
            "2^-24: the smallest subnormal"
        );
        assert_eq!(
            rnd::<F32K, F16K>(0x3300_0000),
            0x0000,
            "2^-25: tie between 0 and 2^-24, even 0"
        );
        assert_eq!(
            rnd::<F32K, F16K>(0x33c0_0000),
            0x0002,
            "3·2^-25: tie between 1 and 2 steps, even 2"
        );
        assert_eq!(
            rnd::<F32K, F16K>(0x3880_0000),
            0x0400,
            "2^-14: the smallest normal"
        );
        // f64 → f32 and f64 → the 16-bit formats, one rounding from the exact value.
        assert_eq!(
            rnd::<F64K, F32K>(0x3ff0_0000_1000_0000),
            0x3f80_0000,
            "1 + 2^-24: tie, down"
        );
        assert_eq!(
            rnd::<F64K, F32K>(0x3ff0_0000_1000_0010),
            0x3f80_0001,
            "1 + 2^-24 + 2^-48: up"
        );
        assert_eq!(
            rnd::<F64K, F32K>(0x36a0_0000_0000_0000),
            0x0000_0001,
            "2^-149"
        );
        assert_eq!(
            rnd::<F64K, F32K>(0x3690_0000_0000_0000),
            0x0000_0000,
            "2^-150: tie, even 0"
        );
        assert_eq!(
            rnd::<F64K, F32K>(0x47ef_ffff_f000_0000),
            0x7f80_0000,
            "halfway past f32 MAX: infinity"
        );
        // 1 + 2^-8 + 2^-40: through f32 it would tie at bf16 and go down to 1.0.
        assert_eq!(rnd::<F64K, BF16K>(0x3ff0_1000_0000_1000), 0x3f81);
        assert_eq!(
            rnd::<F64K, F16K>(0x3ff0_0200_0000_1000),
            0x3c01,
            "1 + 2^-11 + 2^-40: up"
        );
        assert_eq!(
            rnd::<F64K, F16K>(0xc0f0_0000_0000_0000),
            0xfc00,
            "-65536: -inf"
        );
        // f16 → bf16: 3 bits dropped, and f16's whole range fits bf16's.
        assert_eq!(rnd::<F16K, BF16K>(0x3c04), 0x3f80, "1 + 2^-8: tie, down");
        assert_eq!(rnd::<F16K, BF16K>(0x3c0c), 0x3f82, "1 + 3·2^-8: tie, up");
        assert_eq!(
            rnd::<F16K, BF16K>(0x7bff),
            0x4780,
            "f16 MAX 65504 rounds to 65536, finite in bf16"
        );
        assert_eq!(
            rnd::<F16K, BF16K>(0x0001),
            0x3380,
            "2^-24, a subnormal in f16, is normal in bf16"
        );
        assert_eq!(rnd::<F16K, BF16K>(0xfc00), 0xff80, "-inf");
        assert_eq!(
            rnd::<F32K, F32K>(0x3f80_0001),
            0x3f80_0001,
            "its own format: unchanged"
        );
    }

    #[test]
    fn the_bf16_kernel_rounding_is_the_general_rule() {
        // Every 997th finite f32 bit pattern, and the ties around each bf16 step boundary.
        let mut checked = 0;
        let mut check = |a: u32| {
            if a & 0x7f80_0000 != 0x7f80_0000 {
                assert_eq!(
                    f32_to_bf16(a) as u64,
                    rnd::<F32K, BF16K>(a as u64),
                    "{a:#010x}"
                );
                checked += 1;
            }
        };
        for a in (0..=u32::MAX).step_by(997) {
            check(a);
        }
        for hi in (0..=0xffffu32).step_by(61) {
            for lo in [0x7fff, 0x8000, 0x8001] {
                check(hi << 16 | lo);
            }
        }
        assert!(checked > 4_000_000);
    }

    #[test]
    fn mixed_pairs_worked_by_hand() {
        let fb = |a: u32, b: u16| mixed_pair::<F32K, BF16K>(a as u64, b as u64);
        assert_eq!(fb(0x3f80_0000, 0x3f80), None, "1.0 in both");
        assert_eq!(
            fb(0x3f80_8000, 0x3f80),
            Some((None, Some(0))),
            "a different value, the same after rounding"
        );
        assert_eq!(
            fb(0x3f81_8000, 0x3f81),
            Some((None, Some(1))),
            "rounds to 0x3f82"
        );
        assert_eq!(
            fb(0x42f6_e979, 0x42f4),
            Some((None, Some(3))),
            "123.456 rounds to 0x42f7 (123.5), 3 steps from 122"
        );
        assert_eq!(
            fb(0xbf80_0000, 0x3f80),
            Some((None, Some(2 * 0x3f80))),
            "-1 vs 1 crosses zero"
        );
        assert_eq!(
            fb(0x0000_0000, 0x8000),
            Some((Some(Special::SignedZero), Some(0)))
        );
        assert_eq!(
            fb(0x0000_0001, 0x8000),
            Some((None, Some(0))),
            "2^-149 rounds to +0: a value, not a signed zero"
        );
        assert_eq!(fb(0x7fc0_0000, 0x7fc0), None, "the same quiet NaN");
        assert_eq!(
            fb(0xffc0_0000, 0x7fc0),
            Some((Some(Special::NanPayload), None)),
            "NaNs of other signs"
        );
        assert_eq!(
            fb(0x7fc0_0001, 0x7fc0),
            Some((Some(Special::NanPayload), None)),
            "payload below bf16's, left-aligned"
        );
        assert_eq!(
            fb(0x7fc0_0000, 0x3f80),
            Some((Some(Special::NanMismatch), None))
        );
        assert_eq!(fb(0x7f80_0000, 0x7f80), None, "+inf in both");
        assert_eq!(
            fb(0x7f7f_ffff, 0x7f80),
            Some((Some(Special::Infinity), Some(0))),
            "f32 MAX rounds to the bf16 +inf"
        );
        assert_eq!(
            fb(0x7f7f_ffff, 0x7f7f),
            Some((None, Some(1))),
            "f32 MAX is a step past bf16 MAX, at infinity"
        );
        // The other way round, and the other pairs.
        assert_eq!(
            mixed_pair::<BF16K, F32K>(0x3f81, 0x3f81_8000),
            Some((None, Some(1)))
        );
        assert_eq!(
            mixed_pair::<F16K, F32K>(0x3c00, 0x3f80_3000),
            Some((None, Some(2))),
            "1 vs 1 + 3·2^-11 (f16 0x3c02)"
        );
        assert_eq!(
            mixed_pair::<F64K, F32K>(1f64.to_bits(), 0x3f80_0001),
            Some((None, Some(1)))
        );
        assert_eq!(
            mixed_pair::<BF16K, F16K>(0x3f82, 0x3c0c),
            Some((None, Some(0))),
            "f16 1 + 3·2^-8 rounds to bf16 0x3f82"
        );
        assert_eq!(
            mixed_pair::<F16K, F32K>(0x7c00, 0x477f_f000),
            Some((Some(Special::Infinity), Some(0))),
            "65520 overflows f16"
        );
    }

    #[test]
    fn pairs_compare_in_the_coarser_dtype() {
        let u = |r, c| Pair::new(r, c).and_then(Pair::ulp_dtype);
        assert_eq!(u(DType::F32, DType::BF16), Some(DType::BF16));
        assert_eq!(u(DType::BF16, DType::F32), Some(DType::BF16));
        assert_eq!(u(DType::F64, DType::F16), Some(DType::F16));
        assert_eq!(u(DType::F16, DType::BF16), Some(DType::BF16));
        assert_eq!(u(DType::F32, DType::F32), Some(DType::F32));
        assert_eq!(
            Pair::new(DType::I32, DType::I32).map(Pair::ulp_dtype),
            Some(None),
            "integers: absolute difference"
        );
        assert_eq!(Pair::new(DType::I32, DType::F32), None);
        assert_eq!(Pair::new(DType::I32, DType::I64), None);
    }

    /// f32 and bf16 payloads with every kind of element pair, the bf16 side derived from the
    /// f32 one by rounding, then perturbed.
    fn f32_bf16_pairs(n: usize) -> (Vec<u8>, Vec<u8>) {
        let (mut w, mut h) = (Vec::new(), Vec::new());
        for i in 0..n {
            let x = (((i * 2654435761usize) >> 5) % 20001) as f32 / 100.0 - 100.0;
            let mut a = x.to_bits();
            let mut b = f32_to_bf16(a) as u16;
            match i % 7 {
                0 => a = (b as u32) << 16,
                1 => {}
                2 => b = b.wrapping_add((i % 300) as u16),
                3 => b ^= 0x8000,
                4 => b = b.wrapping_sub(1),
                _ => a ^= 1,
            }
            match i % 1009 {
                0 => (a, b) = (0, 0x8000),
                1 => b = 0x7fc0,
                2 => (a, b) = (0xffc0_0000, 0x7fc0),
                3 => b = 0x7f80,
                4 => (a, b) = (0x7f7f_ffff, 0x7f7f),
                5 => (a, b) = (0x7f80_0000, 0x7f80),
                6 => (a, b) = (1, 0),
                _ => {}
            }
            w.extend_from_slice(&a.to_le_bytes());
            h.extend_from_slice(&b.to_le_bytes());
        }
        (w, h)
    }

    #[test]
    fn f32_bf16_kernel_agrees_with_the_careful_path() {
        let n = 3 * CHUNK + 37;
        let (w, h) = f32_bf16_pairs(n);
        let counts = |u: &UlpCounts| {
            (
                u.below,
                (0..BUCKETS).map(|k| u.bucket(k)).collect::<Vec<_>>(),
            )
        };
        for (pair, r, c) in [
            (
                Pair {
                    reference: DType::F32,
                    candidate: DType::BF16,
                },
                &w,
                &h,
            ),
            (
                Pair {
                    reference: DType::BF16,
                    candidate: DType::F32,
                },
                &h,
                &w,
            ),
        ] {
            for window in [
                Window::place(pair, r, c),
                Window::SMALL,
                Window {
                    lo: 100,
                    shift: 3,
                    buckets: 77,
                },
            ] {
                let (fast, fast_ulps) = scan_window(pair, r, c, Some(window));
                let (careful, careful_ulps) = if pair.reference == DType::F32 {
                    scan_chunks(r, c, (4, 2), Some(window), scan_chunk_mixed::<F32K, BF16K>)
                } else {
                    scan_chunks(r, c, (2, 4), Some(window), scan_chunk_mixed::<BF16K, F32K>)
                };
                let ints = |s: &Stats| {
                    (
                        s.total,
                        s.differing,
                        s.first,
                        s.max_ulp,
                        s.signed_zero,
                        s.nan_mismatch,
                        s.nan_payload,
                        s.infinity,
                    )
                };
                assert_eq!(ints(&fast), ints(&careful), "{pair:?}");
                assert!(
                    fast.differing > 0
                        && fast.signed_zero > 0
                        && fast.nan_payload > 0
                        && fast.infinity > 0
                );
                assert_eq!(
                    (fast.max_abs, fast.max_rel),
                    (careful.max_abs, careful.max_rel)
                );
                for (x, y) in [
                    (fast.rr, careful.rr),
                    (fast.cc, careful.cc),
                    (fast.rc, careful.rc),
                    (fast.dd, careful.dd),
                ] {
                    assert!((x - y).abs() <= 1e-12 * y.abs(), "{x} vs {y}");
                }
                assert_eq!(
                    counts(&fast_ulps.unwrap()),
                    counts(&careful_ulps.unwrap()),
                    "{pair:?} {window:?}"
                );
            }
        }
        // The AVX2 kernel and the portable one: the same statistics to the bit, chunk by chunk,
        // counting or not (without counting, a chunk holding a NaN is scanned again).
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("popcnt")
        {
            let window = Window::place(
                Pair {
                    reference: DType::F32,
                    candidate: DType::BF16,
                },
                &w,
                &h,
            );
            // One chunk with no NaN or infinity at all, beside the mixed ones.
            let (wc, hc) = (
                0x3f80_0001u32.to_le_bytes().repeat(CHUNK),
                0x3f80u16.to_le_bytes().repeat(CHUNK),
            );
            let chunks: Vec<(&[u8], &[u8])> = w
                .chunks(4 * CHUNK)
                .zip(h.chunks(2 * CHUNK))
                .chain([(&wc[..], &hc[..])])
                .collect();
            let bits = |s: &Stats| {
                (
                    [s.rr, s.cc, s.rc, s.dd, s.max_abs, s.max_rel].map(f64::to_bits),
                    (
                        s.total,
                        s.differing,
                        s.first,
                        s.max_ulp,
                        s.signed_zero,
                        s.nan_mismatch,
                        s.nan_payload,
                        s.infinity,
                    ),
                )
            };
            for (k, (a, b)) in chunks.into_iter().enumerate() {
                let (mut u, mut v) = (UlpCounts::new(window), UlpCounts::new(window));
                // SAFETY: the CPU has the features (checked above).
                let (x, x_uncounted, x_rev) = unsafe {
                    (
                        avx2::scan_chunk_f32_bf16::<true, true>(a, b, 0, Some(&mut u)),
                        avx2::scan_chunk_f32_bf16::<true, false>(a, b, 7, None),
                        avx2::scan_chunk_f32_bf16::<false, false>(b, a, 7, None),
                    )
                };
                let y = scan_chunk_f32_bf16::<true>(a, b, 0, Some(&mut v));
                assert_eq!(bits(&x), bits(&y), "chunk {k}");
                assert_eq!(counts(&u), counts(&v), "chunk {k}");
                assert_eq!(
                    bits(&x_uncounted),
                    bits(&scan_chunk_f32_bf16::<true>(a, b, 7, None)),
                    "chunk {k}, not counting"
                );
                assert_eq!(
                    bits(&x_rev),
                    bits(&scan_chunk_f32_bf16::<false>(b, a, 7, None)),
                    "chunk {k}, bf16 reference"
                );
            }
        } else {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "NOT CHECKED: AVX2 f32/bf16 kernel ≡ portable kernel (diff/src/numeric.rs): this CPU lacks avx2/fma/popcnt");
        }
    }

    #[test]
    fn median_of_mixed_pairs_matches_a_sort() {
        let n = CHUNK + 5;
        let (w, h) = f32_bf16_pairs(n);
        for (pair, r, c) in [
            (
                Pair {
                    reference: DType::F32,
                    candidate: DType::BF16,
                },
                &w,
                &h,
            ),
            (
                Pair {
                    reference: DType::BF16,
                    candidate: DType::F32,
                },
                &h,
                &w,
            ),
        ] {
            let (m, _, _) = median(pair, r, c);
            assert!(m.is_some());
            assert_eq!(m, sorted_median(pair, r, c), "{pair:?}");
        }
        // The careful path's pairs: each side's values from one sequence, in its own width.
        for (rt, ct) in [
            (DType::F16, DType::F32),
            (DType::F64, DType::F32),
            (DType::BF16, DType::F16),
            (DType::F32, DType::F64),
        ] {
            let pair = Pair::new(rt, ct).unwrap();
            let enc = |d: DType, x: f64, out: &mut Vec<u8>| match d {
                DType::F64 => out.extend_from_slice(&x.to_le_bytes()),
                DType::F32 => out.extend_from_slice(&(x as f32).to_le_bytes()),
                DType::F16 => out.extend_from_slice(&half::f16::from_f32(x as f32).to_le_bytes()),
                _ => out.extend_from_slice(&half::bf16::from_f32(x as f32).to_le_bytes()),
            };
            let (mut r, mut c) = (Vec::new(), Vec::new());
            for i in 0..n {
                let x = (((i * 2654435761usize) >> 5) % 20001) as f64 / 100.0 - 100.0;
                enc(rt, x, &mut r);
                enc(ct, x * (1.0 + (i % 13) as f64 * 1e-3), &mut c);
            }
            let (m, _, _) = median(pair, &r, &c);
            assert!(m.is_some_and(|m| m > 0), "{pair:?}");
            assert_eq!(m, sorted_median(pair, &r, &c), "{pair:?}");
        }
    }

    #[test]
    fn unravel_row_major() {
        assert_eq!(unravel(0, &[2, 3]), vec![0, 0]);
        assert_eq!(unravel(5, &[2, 3]), vec![1, 2]);
        assert_eq!(unravel(7, &[2, 3, 4]), vec![0, 1, 3]);
    }
}
