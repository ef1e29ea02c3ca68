//! The avx512f kernel: 16-output tiles in zmm registers over packed row panels, and the
//! in-register widening of 16×16 weight blocks. Never FMA.

#[cfg(target_arch = "x86_64")]
use super::MRP;
use super::{KB, NR};
#[cfg(target_arch = "x86_64")]
use crate::weights::Mat;

/// One k-block of a tile for all rows from the packed panels, MRP rows per micro-kernel call.
/// (Software prefetch of the next weight block was measured: no prefill gain, decode 10–20% slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile_avx512_packed(
    xp: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    debug_assert!(xp.len() == rows * k && acc.len() == rows * NR);
    let xpp = xp.as_ptr();
    let wtp = wt.as_ptr();
    let accp = acc.as_mut_ptr();
    let mut r0 = 0;
    while r0 < rows {
        let m = MRP.min(rows - r0);
        let xb = xpp.add(r0 * k + k0 * m);
        let ab = accp.add(r0 * NR);
        match m {
            MRP => micro_packed::<MRP>(xb, kb, wtp, ab),
            1 => micro_packed::<1>(xb, kb, wtp, ab),
            2 => micro_packed::<2>(xb, kb, wtp, ab),
            3 => micro_packed::<3>(xb, kb, wtp, ab),
            4 => micro_packed::<4>(xb, kb, wtp, ab),
            5 => micro_packed::<5>(xb, kb, wtp, ab),
            6 => micro_packed::<6>(xb, kb, wtp, ab),
            7 => micro_packed::<7>(xb, kb, wtp, ab),
            8 => micro_packed::<8>(xb, kb, wtp, ab),
            9 => micro_packed::<9>(xb, kb, wtp, ab),
            10 => micro_packed::<10>(xb, kb, wtp, ab),
            11 => micro_packed::<11>(xb, kb, wtp, ab),
            12 => micro_packed::<12>(xb, kb, wtp, ab),
            13 => micro_packed::<13>(xb, kb, wtp, ab),
            14 => micro_packed::<14>(xb, kb, wtp, ab),
            15 => micro_packed::<15>(xb, kb, wtp, ab),
            _ => unreachable!("panel height ≤ MRP"),
        }
        r0 += m;
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn tile_avx512_packed(
    _xp: &[f32],
    _k: usize,
    _rows: usize,
    _k0: usize,
    _kb: usize,
    _wt: &[f32; KB * NR],
    _acc: &mut [f32],
) {
    unreachable!("avx512 is x86_64 only")
}

/// `M` rows × NR outputs from a k-major panel `xp[kk*M + m]` (kb values of k) and the widened
/// block `wt[kk*NR + j]`: `acc[m][j] = acc[m][j] ⊕ (x ⊗ w)`, kk ascending, one separately rounded
/// multiply and add per step (no FMA), accumulators in zmm registers across the block.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn micro_packed<const M: usize>(xp: *const f32, kb: usize, wt: *const f32, acc: *mut f32) {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_ps(); M];
    for (m, am) in a.iter_mut().enumerate() {
        *am = _mm512_loadu_ps(acc.add(m * NR));
    }
    let (mut xq, mut wq) = (xp, wt);
    for _ in 0..kb {
        let wv = _mm512_loadu_ps(wq);
        for (m, am) in a.iter_mut().enumerate() {
            let p = _mm512_mul_ps(wv, _mm512_set1_ps(*xq.add(m)));
            *am = _mm512_add_ps(*am, p);
        }
        xq = xq.add(M);
        wq = wq.add(NR);
    }
    for (m, am) in a.iter().enumerate() {
        _mm512_storeu_ps(acc.add(m * NR), *am);
    }
}

/// Full 16-output tiles, 16 columns at a time: load 16 rows × 16 values, widen in registers,
/// transpose 16×16 with shuffles, store 16 lanes per k. Returns the columns done (a multiple
/// of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn widen_transposed_avx512(
    w: Mat,
    o0: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) -> usize {
    use crate::weights::WDType;
    use std::arch::x86_64::*;
    let es = w.dtype.size();
    let base = w.bytes.as_ptr();
    // In bounds: rows o0..o0+16 ≤ rows (valid == NR) and columns k0+kc+16 ≤ k0+kb ≤ cols.
    let row_ptr = |j: usize, kc: usize| base.add(((o0 + j) * w.cols + k0 + kc) * es);
    let out = wt.as_mut_ptr();
    let mut kc = 0;
    while kc + 16 <= kb {
        let mut r: [__m512; 16] = [_mm512_setzero_ps(); 16];
        for (j, rj) in r.iter_mut().enumerate() {
            let p = row_ptr(j, kc);
            *rj = match w.dtype {
                WDType::F32 => _mm512_loadu_ps(p as *const f32),
                WDType::BF16 => {
                    let h = _mm256_loadu_si256(p as *const __m256i);
                    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
                }
                WDType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
            };
        }
        transpose16(&mut r);
        for (kk, rk) in r.iter().enumerate() {
            _mm512_storeu_ps(out.add((kc + kk) * NR), *rk);
        }
        kc += 16;
    }
    kc
}

/// In-register 16×16 f32 transpose: rows `r[j]` (16 columns each) become columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(r: &mut [std::arch::x86_64::__m512; 16]) {
    use std::arch::x86_64::*;
    let mut t = [_mm512_setzero_ps(); 16];
    // Within each 128-bit lane: pairs of rows interleaved, then 4×4 blocks transposed.
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for i in 0..4 {
        let (a, b, c, d) = (
            _mm512_castps_pd(t[4 * i]),
            _mm512_castps_pd(t[4 * i + 1]),
            _mm512_castps_pd(t[4 * i + 2]),
            _mm512_castps_pd(t[4 * i + 3]),
        );
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    // Now lane L of r[4i+m] holds column 4L+m of rows 4i..4i+3; gather the lanes across groups.
    let mut out = [_mm512_setzero_ps(); 16];
    for m in 0..4 {
        let u = _mm512_shuffle_f32x4::<0x88>(r[m], r[4 + m]);
        let v = _mm512_shuffle_f32x4::<0xDD>(r[m], r[4 + m]);
        let u2 = _mm512_shuffle_f32x4::<0x88>(r[8 + m], r[12 + m]);
        let v2 = _mm512_shuffle_f32x4::<0xDD>(r[8 + m], r[12 + m]);
        out[m] = _mm512_shuffle_f32x4::<0x88>(u, u2);
        out[8 + m] = _mm512_shuffle_f32x4::<0xDD>(u, u2);
        out[4 + m] = _mm512_shuffle_f32x4::<0x88>(v, v2);
        out[12 + m] = _mm512_shuffle_f32x4::<0xDD>(v, v2);
    }
    *r = out;
}
