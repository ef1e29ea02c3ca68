//! What the fast kernels share: their per-lane float accumulators ([`LaneSums`]), the block
//! width ([`LANES`]) the careful path also takes flagged blocks by, and the bit arithmetic of
//! f32 and bf16 lanes.

use super::pair_stats::Stats;

pub(super) const LANES: usize = 16;

/// Per-lane float accumulators of the fast kernels. The f32 kernels use 16 (LANES): lane `i`
/// takes the elements at `i` mod 16, whatever the vector width, so every f32 kernel gives the
/// same sums to the bit. The f32/bf16 kernel uses 4, one AVX2 vector each: sixteen would not
/// fit the sixteen AVX2 registers.
pub(super) struct LaneSums<const N: usize> {
    pub(super) rr: [f64; N],
    pub(super) cc: [f64; N],
    pub(super) rc: [f64; N],
    pub(super) dd: [f64; N],
    pub(super) max_abs: [f64; N],
    // The largest d/|x| is kept as a fraction (num/den) and divided once at the end: a
    // comparison by cross-multiplication costs far less than a division per element.
    pub(super) rel_num: [f64; N],
    pub(super) rel_den: [f64; N],
}

impl<const N: usize> LaneSums<N> {
    pub(super) fn new() -> LaneSums<N> {
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
    pub(super) fn add(&mut self, i: usize, x: f64, y: f64) {
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
    pub(super) fn fold_into(&self, s: &mut Stats) {
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

/// A finite f32 (bits) rounded to bf16, to nearest with ties to even: adding 0x7fff plus
/// the bit that becomes the last (bit 16) carries exactly when the dropped half is above
/// half, or at half with that bit odd; a carry into the exponent is the right result, up to
/// infinity. [`narrow`] is the general rule; a test checks that both agree.
#[inline(always)]
pub(super) fn f32_to_bf16(bits: u32) -> u32 {
    (bits + 0x7fff + ((bits >> 16) & 1)) >> 16
}

/// Float lanes of the f32/bf16 kernel (see [`LaneSums`]).
pub(super) const MIXED_LANES: usize = 4;

/// 16-bit float bits (in a u32) as an ordered integer.
#[inline(always)]
pub(super) fn ord16(bits: u32) -> i32 {
    let m = (bits & 0x7fff) as i32;
    let s = -(((bits >> 15) & 1) as i32);
    (m ^ s).wrapping_sub(s)
}

/// f32 bits as an ordered integer (any non-NaN value: |result| ≤ 0x7f800000, so two of them
/// are at most 0xff000000 apart and the distance fits a u32).
#[inline(always)]
pub(super) fn ord32(bits: u32) -> i32 {
    let m = (bits & 0x7fff_ffff) as i32;
    let s = (bits as i32) >> 31;
    (m ^ s).wrapping_sub(s)
}
