//! The fast path of §4's `exp_to_f32` (softmax) and of §9's SiLU (the gated MLP): four binary64
//! lanes at once (AVX2), `exp` from a polynomial instead of libm, then every lane checked to round
//! to the f32 that libm's value rounds to; a lane that cannot be shown to is recomputed with
//! libm. The bits are the definition's (tested on sampled f32 inputs here and, `--ignored`, on
//! every one of them).
//!
//! Why the check is sound (docs/numerics.md §4, "Fast paths"):
//! - `exp4`'s value is within 2^-47 (relative) of exp(x) for x in [-87, 0]: exact reduction
//!   `r = x − k·ln2` (|r| ≤ 0.347, the high part of ln2 has 32 significant bits, so `k·LN2_HI` is
//!   exact and the subtraction is exact by Sterbenz), degree-12 Taylor polynomial (truncation
//!   below 2^-52) evaluated by Horner (under 2^-47.5 of rounding), an exact scaling by 2^k.
//! - libm's binary64 `exp` is within 1 ulp (2^-52) of exp(x) (the largest error glibc's manual
//!   lists for it on x86-64).
//! - So the two differ by less than 2^-46 relative, fewer than 2^7 binary64 ulps. SiLU's
//!   `1 ⊘ (1 ⊕ e)` or `e ⊘ (1 ⊕ e)` does not enlarge a relative difference of `e` and adds two
//!   roundings on each side (2^-51): still under 2^8 ulps.
//! - An f32 rounding changes only at a midpoint between two f32s. A binary64 value whose 29
//!   dropped bits are more than GUARD = 2^10 ulps from the midpoint pattern rounds to the same
//!   f32 as every value within 2^8 ulps of it, libm's included. Inputs are limited to [-87, 0]
//!   (and SiLU's to |g| ≤ 87), where every result is a normal f32: the dropped-bits test holds
//!   only there.
//!
//! Lanes recomputed: about 2·GUARD / 2^29 of them (4 in a million), plus the out-of-range ones.

use super::{exp_to_f32, silu};
use crate::matmul::Kernel;

/// Binary64 ulps around an f32 midpoint within which a lane is recomputed with libm.
pub(super) const GUARD: i64 = 1 << 10;
/// The smallest argument the polynomial takes: exp(-87) and SiLU's results above it are normal.
const LO: f64 = -87.0;
/// The polynomial's degree; the tests plant a shorter one to show a bad exp is caught.
pub(super) const DEGREE: usize = 12;

/// `s[i] = f32(E(s[i] ⊖ m))`: §8.6's exponentials of one softmax row.
pub fn exp_shifted(s: &mut [f32], m: f32) {
    exp_shifted_with::<DEGREE>(Kernel::detect(), s, m)
}

/// `h[i] = silu(g[i]) ⊗ u[i]`: §9's gated product.
pub fn silu_mul(g: &[f32], u: &[f32], h: &mut [f32]) {
    silu_mul_with::<DEGREE>(Kernel::detect(), g, u, h)
}

/// `exp_shifted` on a kernel family (the portable one is the definition itself).
pub(super) fn exp_shifted_with<const D: usize>(kernel: Kernel, s: &mut [f32], m: f32) {
    #[cfg(target_arch = "x86_64")]
    if kernel != Kernel::Portable && Kernel::Avx2.supported() {
        // SAFETY: AVX2 is present (checked above).
        unsafe { avx2::exp_shifted::<D>(s, m) };
        return;
    }
    let _ = kernel;
    for v in s {
        *v = exp_to_f32(*v - m);
    }
}

/// `silu_mul` on a kernel family (the portable one is the definition itself).
pub(super) fn silu_mul_with<const D: usize>(kernel: Kernel, g: &[f32], u: &[f32], h: &mut [f32]) {
    assert!(
        g.len() == u.len() && g.len() == h.len(),
        "silu_mul: lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if kernel != Kernel::Portable && Kernel::Avx2.supported() {
        // SAFETY: AVX2 is present (checked above).
        unsafe { avx2::silu_mul::<D>(g, u, h) };
        return;
    }
    let _ = kernel;
    for ((h, &g), &u) in h.iter_mut().zip(g).zip(u) {
        *h = silu(g) * u;
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
pub(super) use avx2::{exp_f64, recomputed_exp, recomputed_silu};

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{exp_to_f32, silu, GUARD, LO};

    const LOG2E: f64 = std::f64::consts::LOG2_E;
    /// ln 2 split so that `k·LN2_HI` is exact for |k| < 2^21 (fdlibm's split).
    const LN2_HI: f64 = f64::from_bits(0x3FE6_2E42_FEE0_0000);
    const LN2_LO: f64 = f64::from_bits(0x3DEA_39EF_3579_3C76);
    /// 1/i!, i = 0..=12.
    const TAYLOR: [f64; 13] = [
        1.0,
        1.0,
        1.0 / 2.0,
        1.0 / 6.0,
        1.0 / 24.0,
        1.0 / 120.0,
        1.0 / 720.0,
        1.0 / 5040.0,
        1.0 / 40320.0,
        1.0 / 362880.0,
        1.0 / 3628800.0,
        1.0 / 39916800.0,
        1.0 / 479001600.0,
    ];

    /// exp(x) to 2^-47 relative for x in [LO, 0] (module comment) in each lane of N vectors;
    /// other lanes are garbage. The N Horner chains advance together: one chain is ~26
    /// dependent operations, too long for the scheduler to overlap many on its own.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp4<const D: usize, const N: usize>(x: [__m256d; N]) -> [__m256d; N] {
        let k = x.map(|x| {
            _mm256_round_pd::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_pd(
                x,
                _mm256_set1_pd(LOG2E),
            ))
        });
        let r: [__m256d; N] = std::array::from_fn(|i| {
            _mm256_sub_pd(
                _mm256_sub_pd(x[i], _mm256_mul_pd(k[i], _mm256_set1_pd(LN2_HI))),
                _mm256_mul_pd(k[i], _mm256_set1_pd(LN2_LO)),
            )
        });
        let mut p = [_mm256_set1_pd(TAYLOR[D]); N];
        for &c in TAYLOR[..D].iter().rev() {
            for (pi, &ri) in p.iter_mut().zip(&r) {
                *pi = _mm256_add_pd(_mm256_mul_pd(*pi, ri), _mm256_set1_pd(c));
            }
        }
        // 2^k: adding 1.5·2^52 leaves the integer k in the low mantissa bits.
        let magic = _mm256_set1_pd(6755399441055744.0);
        std::array::from_fn(|i| {
            let ki = _mm256_sub_epi64(
                _mm256_castpd_si256(_mm256_add_pd(k[i], magic)),
                _mm256_castpd_si256(magic),
            );
            let scale = _mm256_castsi256_pd(_mm256_slli_epi64::<52>(_mm256_add_epi64(
                ki,
                _mm256_set1_epi64x(1023),
            )));
            _mm256_mul_pd(p[i], scale)
        })
    }

    /// Lanes (bit i) whose input is outside [LO, 0] or NaN.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn outside(x: __m256d) -> i32 {
        let inside = _mm256_and_pd(
            _mm256_cmp_pd::<_CMP_GE_OQ>(x, _mm256_set1_pd(LO)),
            _mm256_cmp_pd::<_CMP_LE_OQ>(x, _mm256_setzero_pd()),
        );
        !_mm256_movemask_pd(inside) & 0xF
    }

    /// Lanes (bit i) of positive normal-range `v` whose 29 bits below an f32's precision lie
    /// within GUARD of the midpoint pattern 2^28.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn near_midpoint(v: __m256d) -> i32 {
        let low = _mm256_and_si256(_mm256_castpd_si256(v), _mm256_set1_epi64x((1 << 29) - 1));
        let d = _mm256_sub_epi64(low, _mm256_set1_epi64x(1 << 28));
        let near = _mm256_and_si256(
            _mm256_cmpgt_epi64(d, _mm256_set1_epi64x(-GUARD - 1)),
            _mm256_cmpgt_epi64(_mm256_set1_epi64x(GUARD + 1), d),
        );
        _mm256_movemask_pd(_mm256_castsi256_pd(near))
    }

    /// Vectors per step of the loops below (16 values).
    const N: usize = 4;

    #[target_feature(enable = "avx2")]
    pub(super) fn exp_shifted<const D: usize>(s: &mut [f32], m: f32) {
        let mut wide = s.chunks_exact_mut(4 * N);
        for ch in &mut wide {
            exp_block::<D, N>(ch, m);
        }
        let mut narrow = wide.into_remainder().chunks_exact_mut(4);
        for ch in &mut narrow {
            exp_block::<D, 1>(ch, m);
        }
        for v in narrow.into_remainder() {
            *v = exp_to_f32(*v - m);
        }
    }

    /// `exp_shifted` on 4·V values; returns how many lanes it recomputed with libm.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn exp_block<const D: usize, const V: usize>(vals: &mut [f32], m: f32) -> u32 {
        assert_eq!(vals.len(), 4 * V);
        // SAFETY: 4 f32s at 4·i < vals.len().
        let t: [__m128; V] = std::array::from_fn(|i| {
            _mm_sub_ps(
                unsafe { _mm_loadu_ps(vals.as_ptr().add(4 * i)) },
                _mm_set1_ps(m),
            )
        });
        let x = t.map(|t| _mm256_cvtps_pd(t));
        let e = exp4::<D, V>(x);
        let mut recomputed = 0;
        for i in 0..V {
            let lanes = &mut vals[4 * i..4 * i + 4];
            // SAFETY: `lanes` is 4 f32s.
            unsafe { _mm_storeu_ps(lanes.as_mut_ptr(), _mm256_cvtpd_ps(e[i])) };
            let redo = outside(x[i]) | near_midpoint(e[i]);
            recomputed += redo.count_ones();
            if redo != 0 {
                let mut ts = [0.0f32; 4];
                // SAFETY: `ts` is 4 f32s.
                unsafe { _mm_storeu_ps(ts.as_mut_ptr(), t[i]) };
                for (j, v) in lanes.iter_mut().enumerate() {
                    if redo >> j & 1 == 1 {
                        *v = exp_to_f32(ts[j]);
                    }
                }
            }
        }
        recomputed
    }

    /// (exp's arguments -|g|, §9's sigmoid(g) in binary64 before its rounding to f32).
    #[inline]
    #[target_feature(enable = "avx2")]
    fn sigmoid4<const D: usize, const V: usize>(g: [__m256d; V]) -> ([__m256d; V], [__m256d; V]) {
        // Both of §9's branches take exp of -|g|.
        let x = g.map(|g| _mm256_or_pd(g, _mm256_set1_pd(-0.0)));
        let e = exp4::<D, V>(x);
        let one = _mm256_set1_pd(1.0);
        // g ≥ 0: 1 ⊘ (1 ⊕ e); otherwise (NaN too) e ⊘ (1 ⊕ e).
        let y = std::array::from_fn(|i| {
            let nonneg = _mm256_cmp_pd::<_CMP_GE_OQ>(g[i], _mm256_setzero_pd());
            _mm256_div_pd(
                _mm256_blendv_pd(e[i], one, nonneg),
                _mm256_add_pd(one, e[i]),
            )
        });
        (x, y)
    }

    #[target_feature(enable = "avx2")]
    pub(super) fn silu_mul<const D: usize>(g: &[f32], u: &[f32], h: &mut [f32]) {
        let mut done = 0;
        while done + 4 * N <= g.len() {
            let r = done..done + 4 * N;
            silu_block::<D, N>(&g[r.clone()], &u[r.clone()], &mut h[r]);
            done += 4 * N;
        }
        while done + 4 <= g.len() {
            let r = done..done + 4;
            silu_block::<D, 1>(&g[r.clone()], &u[r.clone()], &mut h[r]);
            done += 4;
        }
        for i in done..g.len() {
            h[i] = silu(g[i]) * u[i];
        }
    }

    /// `silu_mul` on 4·V values; returns how many lanes it recomputed with libm.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn silu_block<const D: usize, const V: usize>(g: &[f32], u: &[f32], h: &mut [f32]) -> u32 {
        assert!(g.len() == 4 * V && u.len() == 4 * V && h.len() == 4 * V);
        // SAFETY (all three): 4 f32s at 4·i < 4·V.
        let gf: [__m128; V] =
            std::array::from_fn(|i| unsafe { _mm_loadu_ps(g.as_ptr().add(4 * i)) });
        let (x, y) = sigmoid4::<D, V>(gf.map(|g| _mm256_cvtps_pd(g)));
        let mut recomputed = 0;
        for i in 0..V {
            let uf = unsafe { _mm_loadu_ps(u.as_ptr().add(4 * i)) };
            let silu4 = _mm_mul_ps(gf[i], _mm256_cvtpd_ps(y[i]));
            unsafe { _mm_storeu_ps(h.as_mut_ptr().add(4 * i), _mm_mul_ps(silu4, uf)) };
            let redo = outside(x[i]) | near_midpoint(y[i]);
            recomputed += redo.count_ones();
            if redo != 0 {
                for j in (0..4).filter(|j| redo >> j & 1 == 1) {
                    let k = 4 * i + j;
                    h[k] = silu(g[k]) * u[k];
                }
            }
        }
        recomputed
    }

    /// The polynomial's binary64 exp of each `x` (tests; needs AVX2).
    #[cfg(test)]
    pub(in crate::ops) fn exp_f64<const D: usize>(xs: &[f64]) -> Vec<f64> {
        assert!(super::Kernel::Avx2.supported());
        xs.chunks(4)
            .flat_map(|c| {
                let mut lanes = [0.0f64; 4];
                lanes[..c.len()].copy_from_slice(c);
                let mut out = [0.0f64; 4];
                // SAFETY: AVX2 checked above; both arrays are 4 f64s.
                unsafe {
                    _mm256_storeu_pd(
                        out.as_mut_ptr(),
                        exp4_avx2::<D>(_mm256_loadu_pd(lanes.as_ptr())),
                    )
                };
                out.into_iter().take(c.len())
            })
            .collect()
    }

    #[cfg(test)]
    #[target_feature(enable = "avx2")]
    unsafe fn exp4_avx2<const D: usize>(x: __m256d) -> __m256d {
        exp4::<D, 1>([x])[0]
    }

    /// How many lanes `exp_shifted` (m = 0) recomputes with libm: its own blocks, four values
    /// at a time (tests; needs AVX2).
    #[cfg(test)]
    pub(in crate::ops) fn recomputed_exp(ts: &[f32]) -> usize {
        assert!(super::Kernel::Avx2.supported());
        let mut vals = ts.to_vec();
        vals.chunks_exact_mut(4)
            // SAFETY: AVX2 checked above.
            .map(|c| unsafe { exp_block::<{ super::DEGREE }, 1>(c, 0.0) } as usize)
            .sum()
    }

    /// How many lanes `silu_mul` recomputes with libm, as `recomputed_exp` (tests; needs AVX2).
    #[cfg(test)]
    pub(in crate::ops) fn recomputed_silu(gs: &[f32]) -> usize {
        assert!(super::Kernel::Avx2.supported());
        let (ones, mut h) = ([1.0f32; 4], [0.0f32; 4]);
        gs.chunks_exact(4)
            // SAFETY: AVX2 checked above.
            .map(|c| unsafe { silu_block::<{ super::DEGREE }, 1>(c, &ones, &mut h) } as usize)
            .sum()
    }
}
