//! The f32/bf16 kernel in AVX2 intrinsics: the portable kernel's arithmetic lane for lane (so
//! the same sums to the bit), 8 elements per step, each accumulator one vector. When no
//! distances are counted, blocks are not checked for a NaN or an infinity: one makes the
//! chunk's Σx² or Σy² non-finite (the square of a finite f32 cannot overflow an f64, nor a
//! chunk's sum of them), and then the chunk is scanned again by the portable kernel.

use super::chunk::CHUNK;
use super::counts::{UlpCounts, Window};
use super::kernels::finish_f32_bf16_chunk;
use super::lanes::{LaneSums, LANES, MIXED_LANES};
use super::pair_stats::Stats;
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
            let bigger =
                _mm256_cmp_pd::<_CMP_GT_OQ>(_mm256_mul_pd(d, rel_den), _mm256_mul_pd(rel_num, ax));
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
        return super::kernels::scan_chunk_f32_bf16::<REF_F32>(r, c, base, ulps);
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
