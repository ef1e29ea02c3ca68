//! Element types as raw bits, and ULP distance: each float dtype's bits map to an ordered
//! integer (see the module comment of [`crate::numeric`]); mixed-precision pairs are rounded to
//! the coarser format first.

use serde::Serialize;
use tracegate_trace::DType;

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

pub(super) fn format_of(dtype: DType) -> Option<Format> {
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
pub(super) fn widen<K: Float>(bits: u64) -> u64 {
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
pub(super) fn narrow(to: Format, x: u64) -> u64 {
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
pub(super) fn round_to<K: Float>(to: Format, bits: u64) -> u64 {
    if K::FORMAT == to {
        bits
    } else {
        narrow(to, widen::<K>(bits))
    }
}

/// Ordered integer of bits in format `f` (see the module comment).
#[inline(always)]
pub(super) fn ord_in(f: Format, bits: u64) -> i64 {
    let sign = 1u64 << (f.exp + f.frac);
    let mag = (bits & (sign - 1)) as i64;
    if bits & sign != 0 {
        -mag
    } else {
        mag
    }
}

/// The format with fewer significand bits: the comparison dtype's (see [`Pair::ulp_dtype`]).
pub(super) const fn coarser(a: Format, b: Format) -> Format {
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
pub(super) fn mixed_pair<A: Float, B: Float>(
    a: u64,
    b: u64,
) -> Option<(Option<Special>, Option<u64>)> {
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
pub(crate) use with_float;

#[cfg(test)]
mod tests;
