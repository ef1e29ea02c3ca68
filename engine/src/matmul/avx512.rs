//! The avx512f kernel: 16-output tiles in zmm registers over packed row panels, and the
//! in-register widening of 16×16 weight blocks. Never FMA.

#[cfg(target_arch = "x86_64")]
use super::MRP;
use super::{KB, NR};
#[cfg(target_arch = "x86_64")]
use crate::matmul::layout::Mat;

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
            MRP => micro_packed::<MRP>(xb, kb, wtp, ab, k0 == 0),
            1 => micro_packed::<1>(xb, kb, wtp, ab, k0 == 0),
            2 => micro_packed::<2>(xb, kb, wtp, ab, k0 == 0),
            3 => micro_packed::<3>(xb, kb, wtp, ab, k0 == 0),
            4 => micro_packed::<4>(xb, kb, wtp, ab, k0 == 0),
            5 => micro_packed::<5>(xb, kb, wtp, ab, k0 == 0),
            6 => micro_packed::<6>(xb, kb, wtp, ab, k0 == 0),
            7 => micro_packed::<7>(xb, kb, wtp, ab, k0 == 0),
            8 => micro_packed::<8>(xb, kb, wtp, ab, k0 == 0),
            9 => micro_packed::<9>(xb, kb, wtp, ab, k0 == 0),
            10 => micro_packed::<10>(xb, kb, wtp, ab, k0 == 0),
            11 => micro_packed::<11>(xb, kb, wtp, ab, k0 == 0),
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
/// multiply and add per step (no FMA), accumulators in zmm registers across the block. `fresh`
/// (the first k-block): they start at +0.0 instead of `acc`'s values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn micro_packed<const M: usize>(
    xp: *const f32,
    kb: usize,
    wt: *const f32,
    acc: *mut f32,
    fresh: bool,
) {
    use std::arch::x86_64::*;
    let mut a = [_mm512_setzero_ps(); M];
    if !fresh {
        for (m, am) in a.iter_mut().enumerate() {
            *am = _mm512_loadu_ps(acc.add(m * NR));
        }
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
            *rj = load16(w.dtype, row_ptr(j, kc));
        }
        transpose16(&mut r);
        for (kk, rk) in r.iter().enumerate() {
            _mm512_storeu_ps(out.add((kc + kk) * NR), *rk);
        }
        kc += 16;
    }
    kc
}

/// A `Layout::Panels` block into `wt` (as `widen_panels`, which says why it is already
/// transposed): per column pair one load, the pair widened without a shuffle, two stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn widen_panels_avx512(
    w: Mat,
    o0: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) {
    use std::arch::x86_64::*;
    assert!(k0.is_multiple_of(2) && kb.is_multiple_of(2) && kb <= KB);
    let src = w.panels_from(o0, 1)[k0 / 2 * 64..(k0 + kb) / 2 * 64].as_ptr();
    let (high, out) = (_mm512_set1_epi32(0xFFFF_0000u32 as i32), wt.as_mut_ptr());
    for q in 0..kb / 2 {
        let d = _mm512_loadu_si512(src.add(q * 64) as *const _);
        _mm512_storeu_ps(
            out.add(2 * q * NR),
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(d)),
        );
        _mm512_storeu_ps(
            out.add((2 * q + 1) * NR),
            _mm512_castsi512_ps(_mm512_and_si512(d, high)),
        );
    }
}

/// 16 consecutive weights at `p` widened to f32 (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn load16(dtype: crate::matmul::layout::WDType, p: *const u8) -> std::arch::x86_64::__m512 {
    use crate::matmul::layout::WDType;
    use std::arch::x86_64::*;
    match dtype {
        WDType::F32 => _mm512_loadu_ps(p as *const f32),
        WDType::BF16 => {
            let h = _mm256_loadu_si256(p as *const __m256i);
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
        }
        WDType::F16 => _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)),
    }
}

/// The matvec kernel (`matvec.rs`): 16 outputs from `o0` for `R` rows of x (`[R, K]`), into
/// `out[r * 16 + j]`. Per 16 columns of k: 16 rows × 16 weights loaded, widened and transposed
/// in registers, then 16 steps (k ascending) of each output's own chain (bf16: 32 columns at a
/// time, transposed as bf16 pairs before widening); the k tail (k mod 16)
/// through the same steps from a small stack block. Never FMA. Each row's stream is prefetched
/// `PREFETCH` bytes ahead: the add chain lets the core run only a few blocks ahead by itself.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn matvec_avx512<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o0: usize,
    out: &mut [f32],
) {
    use super::step::{split_at, PLANT_SPLIT, PREFETCH};
    use std::arch::x86_64::*;
    let k = w.cols;
    assert!(x.len() == R * k && o0 + 16 <= w.rows && out.len() >= R * 16);
    let ks = if P == PLANT_SPLIT { split_at(k) } else { 0 };
    let (es, base, xp) = (w.dtype.size(), w.bytes.as_ptr(), x.as_ptr());
    let mut acc = [_mm512_setzero_ps(); R];
    let mut saved = acc;
    let bf16 = w.dtype == crate::matmul::layout::WDType::BF16;
    let mut kc = 0;
    while kc + 16 <= k {
        if ks > 0 && kc == ks {
            saved = acc;
            acc = [_mm512_setzero_ps(); R];
        }
        // In bounds: rows o0..o0+16 ≤ w.rows (asserted) and columns kc+16 ≤ k (kc+32 ≤ k for
        // the bf16 pairs). A prefetch past the end of the weights is a hint only (never faults).
        let row = |j: usize| base.add(((o0 + j) * k + kc) * es);
        if (kc * es) % 64 == 0 {
            for j in 0..16 {
                _mm_prefetch::<_MM_HINT_T0>(row(j).wrapping_add(PREFETCH) as *const i8);
            }
        }
        // (A block never straddles a planted split: it starts its own chains at `ks`.)
        if bf16 && kc + 32 <= k && (ks <= kc || ks >= kc + 32) {
            // 32 columns as 16 dwords per row, each the bf16 pair (k, k+1): transposed as
            // 32-bit lanes, lane j of t[m] holds output j's pair at k = kc+2m, which widens
            // without a shuffle (the low half shifted up; the high half with the low cleared).
            // Per weight, 40% of the shuffles of widening first, then transposing: the
            // shuffle port bounds this loop at one or two threads on the 16-core Xeon.
            let mut t: [__m512; 16] =
                std::array::from_fn(|j| _mm512_loadu_ps(row(j) as *const f32));
            transpose16(&mut t);
            let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
            for (m, pair) in t.iter().enumerate() {
                let d = _mm512_castps_si512(*pair);
                let w0 = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(d));
                let w1 = _mm512_castsi512_ps(_mm512_and_si512(d, high));
                for (r, ar) in acc.iter_mut().enumerate() {
                    let xr = xp.add(r * k + kc + 2 * m);
                    *ar = vstep::<P>(*ar, _mm512_set1_ps(*xr), w0);
                    *ar = vstep::<P>(*ar, _mm512_set1_ps(*xr.add(1)), w1);
                }
            }
            kc += 32;
            continue;
        }
        let mut t: [__m512; 16] = std::array::from_fn(|j| load16(w.dtype, row(j)));
        transpose16(&mut t);
        for (kk, wv) in t.iter().enumerate() {
            for (r, ar) in acc.iter_mut().enumerate() {
                *ar = vstep::<P>(*ar, _mm512_set1_ps(*xp.add(r * k + kc + kk)), *wv);
            }
        }
        kc += 16;
    }
    if kc < k {
        tail_avx512::<R, P>(x, w, o0, kc, &mut acc);
    }
    for (r, ar) in acc.iter().enumerate() {
        let v = if ks > 0 {
            _mm512_add_ps(*ar, saved[r])
        } else {
            *ar
        };
        _mm512_storeu_ps(out.as_mut_ptr().add(r * 16), v);
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn matvec_avx512<const R: usize, const P: u8>(
    _x: &[f32],
    _w: crate::matmul::layout::Mat,
    _o0: usize,
    _out: &mut [f32],
) {
    unreachable!("avx512 is x86_64 only")
}

/// The matvec kernel on panels (`Layout::Panels`, `matvec.rs`): the `C` panels from output
/// `o0` (a panel boundary) for `R` rows of x (`[R, K]`), into `out[r * 16 * C + c * 16 + j]`.
/// Per column pair: one load per panel (16 outputs' pairs, already transposed), widened without
/// a shuffle, then two steps (k ascending) of each output's own chain. Never FMA. Each panel's
/// stream is prefetched `PANEL_PREFETCH` bytes ahead; `C` chains per row of x keep the adds'
/// latency from bounding the loop.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn matvec_panels_avx512<const R: usize, const P: u8, const C: usize>(
    x: &[f32],
    w: Mat,
    o0: usize,
    out: &mut [f32],
) {
    use super::step::{split_at, PANEL_PREFETCH, PLANT_SPLIT};
    use crate::matmul::layout::PANEL;
    use std::arch::x86_64::*;
    let (k, pb) = (w.cols, PANEL * w.cols * 2);
    assert!(x.len() == R * k && out.len() >= R * 16 * C);
    let qs = if P == PLANT_SPLIT { split_at(k) / 2 } else { 0 };
    let (base, xp) = (w.panels_from(o0, C).as_ptr(), x.as_ptr());
    let high = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let mut saved = acc;
    for q in 0..k / 2 {
        if qs > 0 && q == qs {
            saved = acc;
            acc = [[_mm512_setzero_ps(); C]; R];
        }
        // In bounds: pair q < k/2 of panels o0/PANEL .. +C (asserted). A prefetch past the end
        // of the panels is a hint only (never faults).
        let d: [__m512i; C] = std::array::from_fn(|c| {
            let p = base.add(c * pb + q * 64);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PANEL_PREFETCH) as *const i8);
            _mm512_loadu_si512(p as *const _)
        });
        let w0: [__m512; C] =
            std::array::from_fn(|c| _mm512_castsi512_ps(_mm512_slli_epi32::<16>(d[c])));
        let w1: [__m512; C] =
            std::array::from_fn(|c| _mm512_castsi512_ps(_mm512_and_si512(d[c], high)));
        for (r, ar) in acc.iter_mut().enumerate() {
            let x0 = _mm512_set1_ps(*xp.add(r * k + 2 * q));
            let x1 = _mm512_set1_ps(*xp.add(r * k + 2 * q + 1));
            for (a, wv) in ar.iter_mut().zip(&w0) {
                *a = vstep::<P>(*a, x0, *wv);
            }
            for (a, wv) in ar.iter_mut().zip(&w1) {
                *a = vstep::<P>(*a, x1, *wv);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (c, a) in ar.iter().enumerate() {
            let v = if qs > 0 {
                _mm512_add_ps(*a, saved[r][c])
            } else {
                *a
            };
            _mm512_storeu_ps(out.as_mut_ptr().add(r * 16 * C + c * 16), v);
        }
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn matvec_panels_avx512<const R: usize, const P: u8, const C: usize>(
    _x: &[f32],
    _w: crate::matmul::layout::Mat,
    _o0: usize,
    _out: &mut [f32],
) {
    unreachable!("avx512 is x86_64 only")
}

/// The k tail (k mod 16 columns from `kc`) of outputs `o..o+16`, widened to a small stack
/// block, through the same steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tail_avx512<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o: usize,
    kc: usize,
    acc: &mut [std::arch::x86_64::__m512; R],
) {
    use std::arch::x86_64::*;
    let (k, kt) = (w.cols, w.cols - kc);
    let mut blk = [[0.0f32; 16]; 16];
    let mut row = [0.0f32; 16];
    for j in 0..16 {
        w.widen_row(o + j, kc, &mut row[..kt]);
        for kk in 0..kt {
            blk[kk][j] = row[kk];
        }
    }
    for (kk, bk) in blk.iter().enumerate().take(kt) {
        let wv = _mm512_loadu_ps(bk.as_ptr());
        for (r, ar) in acc.iter_mut().enumerate() {
            *ar = vstep::<P>(*ar, _mm512_set1_ps(x[r * k + kc + kk]), wv);
        }
    }
}

/// `acc ⊕ (x ⊗ w)` lane by lane: a multiply then an add, or the planted fused step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn vstep<const P: u8>(
    acc: std::arch::x86_64::__m512,
    x: std::arch::x86_64::__m512,
    w: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use super::step::{step, EXACT};
    use std::arch::x86_64::*;
    if P == EXACT {
        return _mm512_add_ps(acc, _mm512_mul_ps(x, w));
    }
    let (mut a, mut xs, mut ws) = ([0.0f32; 16], [0.0f32; 16], [0.0f32; 16]);
    _mm512_storeu_ps(a.as_mut_ptr(), acc);
    _mm512_storeu_ps(xs.as_mut_ptr(), x);
    _mm512_storeu_ps(ws.as_mut_ptr(), w);
    for i in 0..16 {
        a[i] = step::<P>(a[i], xs[i], ws[i]);
    }
    _mm512_loadu_ps(a.as_ptr())
}

/// In-register 16×16 f32 transpose: rows `r[j]` (16 columns each) become columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
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
