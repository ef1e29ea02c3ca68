//! The avx2 (+f16c) kernel: 16-output tiles as two ymm accumulators per row over packed row
//! panels, and the in-register widening of 8×8 weight blocks. Never FMA.

use super::{KB, NR};
#[cfg(target_arch = "x86_64")]
use super::{MRA, MRP};
#[cfg(target_arch = "x86_64")]
use crate::matmul::layout::Mat;

/// Full 16-output tiles, 8 columns at a time: for each half of the tile load 8 rows × 8 values,
/// widen in registers, transpose 8×8, store 8 lanes per k. Returns the columns done (a multiple
/// of 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn widen_transposed_avx2(
    w: Mat,
    o0: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) -> usize {
    use std::arch::x86_64::*;
    let es = w.dtype.size();
    let base = w.bytes.as_ptr();
    // In bounds: rows o0..o0+16 ≤ rows (valid == NR) and columns k0+kc+8 ≤ k0+kb ≤ cols.
    let row_ptr = |j: usize, kc: usize| base.add(((o0 + j) * w.cols + k0 + kc) * es);
    let out = wt.as_mut_ptr();
    let mut kc = 0;
    while kc + 8 <= kb {
        for half in 0..2 {
            let mut r: [__m256; 8] = [_mm256_setzero_ps(); 8];
            for (j, rj) in r.iter_mut().enumerate() {
                *rj = load8(w.dtype, row_ptr(half * 8 + j, kc));
            }
            transpose8(&mut r);
            for (kk, rk) in r.iter().enumerate() {
                _mm256_storeu_ps(out.add((kc + kk) * NR + half * 8), *rk);
            }
        }
        kc += 8;
    }
    kc
}

/// A `Layout::Panels` block into `wt` (as `widen_panels`, which says why it is already
/// transposed): per column pair the panel's two halves loaded, widened without a shuffle, four
/// stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn widen_panels_avx2(
    w: Mat,
    o0: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) {
    use std::arch::x86_64::*;
    assert!(k0.is_multiple_of(2) && kb.is_multiple_of(2) && kb <= KB);
    let src = w.panels_from(o0, 1)[k0 / 2 * 64..(k0 + kb) / 2 * 64].as_ptr();
    let (high, out) = (_mm256_set1_epi32(0xFFFF_0000u32 as i32), wt.as_mut_ptr());
    for q in 0..kb / 2 {
        // The next block's line (this panel's next columns, or the next panel: contiguous), so
        // the next call finds it cached. A quarter less time widening on the development
        // machine (docs/benchmarks.md); not measured on AVX-512, whose widening has none.
        _mm_prefetch::<_MM_HINT_T0>(src.wrapping_add(q * 64 + kb * 32) as *const i8);
        for h in 0..2 {
            let d = _mm256_loadu_si256(src.add(q * 64 + h * 32) as *const _);
            let (even, odd) = (
                out.add(2 * q * NR + h * 8),
                out.add((2 * q + 1) * NR + h * 8),
            );
            _mm256_storeu_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32::<16>(d)));
            _mm256_storeu_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(d, high)));
        }
    }
}

/// 8 consecutive weights at `p` widened to f32 (exact).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn load8(dtype: crate::matmul::layout::WDType, p: *const u8) -> std::arch::x86_64::__m256 {
    use crate::matmul::layout::WDType;
    use std::arch::x86_64::*;
    match dtype {
        WDType::F32 => _mm256_loadu_ps(p as *const f32),
        WDType::BF16 => {
            let h = _mm_loadu_si128(p as *const __m128i);
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
        WDType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
    }
}

/// The matvec kernel (`matvec.rs`): 8 outputs from `o0` for `R` rows of x (`[R, K]`), into
/// `out[r * 8 + j]`. Per 8 columns of k: 8 rows × 8 weights loaded, widened and transposed
/// in registers, then 8 steps (k ascending) of each output's own chain (bf16: 16 columns at a
/// time, transposed as bf16 pairs before widening); the k tail (k mod 8)
/// through the same steps from a small stack block. Never FMA. Each row's stream is prefetched
/// `PREFETCH` bytes ahead: the add chain lets the core run only a few blocks ahead by itself.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn matvec_avx2<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o0: usize,
    out: &mut [f32],
) {
    use super::step::{split_at, PLANT_SPLIT, PREFETCH};
    use std::arch::x86_64::*;
    let k = w.cols;
    assert!(x.len() == R * k && o0 + 8 <= w.rows && out.len() >= R * 8);
    let ks = if P == PLANT_SPLIT { split_at(k) } else { 0 };
    let (es, base, xp) = (w.dtype.size(), w.bytes.as_ptr(), x.as_ptr());
    let mut acc = [_mm256_setzero_ps(); R];
    let mut saved = acc;
    let bf16 = w.dtype == crate::matmul::layout::WDType::BF16;
    let mut kc = 0;
    while kc + 8 <= k {
        if ks > 0 && kc == ks {
            saved = acc;
            acc = [_mm256_setzero_ps(); R];
        }
        // In bounds: rows o0..o0+8 ≤ w.rows (asserted) and columns kc+8 ≤ k (kc+16 ≤ k for
        // the bf16 pairs). A prefetch past the end of the weights is a hint only (never faults).
        let row = |j: usize| base.add(((o0 + j) * k + kc) * es);
        if (kc * es) % 64 == 0 {
            for j in 0..8 {
                _mm_prefetch::<_MM_HINT_T0>(row(j).wrapping_add(PREFETCH) as *const i8);
            }
        }
        if bf16 && kc + 16 <= k {
            // 16 columns as 8 dwords per row, each the bf16 pair (k, k+1): transposed as
            // 32-bit lanes, lane j of t[m] holds output j's pair at k = kc+2m, which widens
            // without a shuffle (the low half shifted up; the high half with the low cleared).
            // Half the shuffles of widening first, then transposing.
            let mut t: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(row(j) as *const f32));
            transpose8(&mut t);
            let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
            for (m, pair) in t.iter().enumerate() {
                let d = _mm256_castps_si256(*pair);
                let w0 = _mm256_castsi256_ps(_mm256_slli_epi32::<16>(d));
                let w1 = _mm256_castsi256_ps(_mm256_and_si256(d, high));
                for (r, ar) in acc.iter_mut().enumerate() {
                    let xr = xp.add(r * k + kc + 2 * m);
                    *ar = vstep::<P>(*ar, _mm256_set1_ps(*xr), w0);
                    *ar = vstep::<P>(*ar, _mm256_set1_ps(*xr.add(1)), w1);
                }
            }
            kc += 16;
            continue;
        }
        let mut t: [__m256; 8] = std::array::from_fn(|j| load8(w.dtype, row(j)));
        transpose8(&mut t);
        for (kk, wv) in t.iter().enumerate() {
            for (r, ar) in acc.iter_mut().enumerate() {
                *ar = vstep::<P>(*ar, _mm256_set1_ps(*xp.add(r * k + kc + kk)), *wv);
            }
        }
        kc += 8;
    }
    if kc < k {
        tail_avx2::<R, P>(x, w, o0, kc, &mut acc);
    }
    for (r, ar) in acc.iter().enumerate() {
        let v = if ks > 0 {
            _mm256_add_ps(*ar, saved[r])
        } else {
            *ar
        };
        _mm256_storeu_ps(out.as_mut_ptr().add(r * 8), v);
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn matvec_avx2<const R: usize, const P: u8>(
    _x: &[f32],
    _w: crate::matmul::layout::Mat,
    _o0: usize,
    _out: &mut [f32],
) {
    unreachable!("avx2 is x86_64 only")
}

/// The matvec kernel on panels (`Layout::Panels`, `matvec.rs`): the panel from output `o0` (a
/// panel boundary) for `R` rows of x (`[R, K]`), into `out[r * 16 + j]`. Per column pair: the
/// panel's two halves loaded (16 outputs' pairs, already transposed), widened without a
/// shuffle, then two steps (k ascending) of each output's own chain. Never FMA. The panel's
/// stream is prefetched `PANEL_PREFETCH` bytes ahead; the two halves are two chains per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn matvec_panels_avx2<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o0: usize,
    out: &mut [f32],
) {
    use super::step::{split_at, PANEL_PREFETCH, PLANT_SPLIT};
    use std::arch::x86_64::*;
    let k = w.cols;
    assert!(x.len() == R * k && out.len() >= R * 16);
    let qs = if P == PLANT_SPLIT { split_at(k) / 2 } else { 0 };
    let (base, xp) = (w.panels_from(o0, 1).as_ptr(), x.as_ptr());
    let high = _mm256_set1_epi32(0xFFFF_0000u32 as i32);
    let mut acc = [[_mm256_setzero_ps(); 2]; R];
    let mut saved = acc;
    for q in 0..k / 2 {
        if qs > 0 && q == qs {
            saved = acc;
            acc = [[_mm256_setzero_ps(); 2]; R];
        }
        // In bounds: pair q < k/2 of panel o0/PANEL (asserted). A prefetch past the end of the
        // panels is a hint only (never faults).
        let p = base.add(q * 64);
        _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PANEL_PREFETCH) as *const i8);
        let d: [__m256i; 2] =
            std::array::from_fn(|h| _mm256_loadu_si256(p.add(32 * h) as *const _));
        let w0: [__m256; 2] =
            std::array::from_fn(|h| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(d[h])));
        let w1: [__m256; 2] =
            std::array::from_fn(|h| _mm256_castsi256_ps(_mm256_and_si256(d[h], high)));
        for (r, ar) in acc.iter_mut().enumerate() {
            let x0 = _mm256_set1_ps(*xp.add(r * k + 2 * q));
            let x1 = _mm256_set1_ps(*xp.add(r * k + 2 * q + 1));
            for (a, wv) in ar.iter_mut().zip(&w0) {
                *a = vstep::<P>(*a, x0, *wv);
            }
            for (a, wv) in ar.iter_mut().zip(&w1) {
                *a = vstep::<P>(*a, x1, *wv);
            }
        }
    }
    for (r, ar) in acc.iter().enumerate() {
        for (h, a) in ar.iter().enumerate() {
            let v = if qs > 0 {
                _mm256_add_ps(*a, saved[r][h])
            } else {
                *a
            };
            _mm256_storeu_ps(out.as_mut_ptr().add(r * 16 + h * 8), v);
        }
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn matvec_panels_avx2<const R: usize, const P: u8>(
    _x: &[f32],
    _w: crate::matmul::layout::Mat,
    _o0: usize,
    _out: &mut [f32],
) {
    unreachable!("avx2 is x86_64 only")
}

/// The k tail (k mod 8 columns from `kc`) of outputs `o..o+8`, widened to a small stack
/// block, through the same steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn tail_avx2<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o: usize,
    kc: usize,
    acc: &mut [std::arch::x86_64::__m256; R],
) {
    use std::arch::x86_64::*;
    let (k, kt) = (w.cols, w.cols - kc);
    let mut blk = [[0.0f32; 8]; 8];
    let mut row = [0.0f32; 8];
    for j in 0..8 {
        w.widen_row(o + j, kc, &mut row[..kt]);
        for kk in 0..kt {
            blk[kk][j] = row[kk];
        }
    }
    for (kk, bk) in blk.iter().enumerate().take(kt) {
        let wv = _mm256_loadu_ps(bk.as_ptr());
        for (r, ar) in acc.iter_mut().enumerate() {
            *ar = vstep::<P>(*ar, _mm256_set1_ps(x[r * k + kc + kk]), wv);
        }
    }
}

/// `acc ⊕ (x ⊗ w)` lane by lane: a multiply then an add, or the planted fused step.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn vstep<const P: u8>(
    acc: std::arch::x86_64::__m256,
    x: std::arch::x86_64::__m256,
    w: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use super::step::{step, EXACT};
    use std::arch::x86_64::*;
    if P == EXACT {
        return _mm256_add_ps(acc, _mm256_mul_ps(x, w));
    }
    let (mut a, mut xs, mut ws) = ([0.0f32; 8], [0.0f32; 8], [0.0f32; 8]);
    _mm256_storeu_ps(a.as_mut_ptr(), acc);
    _mm256_storeu_ps(xs.as_mut_ptr(), x);
    _mm256_storeu_ps(ws.as_mut_ptr(), w);
    for i in 0..8 {
        a[i] = step::<P>(a[i], xs[i], ws[i]);
    }
    _mm256_loadu_ps(a.as_ptr())
}

/// In-register 8×8 f32 transpose: rows `r[j]` (8 columns each) become columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn transpose8(r: &mut [std::arch::x86_64::__m256; 8]) {
    use std::arch::x86_64::*;
    // Pairs of rows interleaved, then 4×4 blocks within each 128-bit lane, then the lanes.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[2 * (i / 2)], r[2 * (i / 2) + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // s[q]: columns q and q+4 of rows 0..3; s[4+q]: the same of rows 4..7.
    let mut s = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        let (t0, t1, t2, t3) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        s[4 * g] = _mm256_shuffle_ps::<0x44>(t0, t2);
        s[4 * g + 1] = _mm256_shuffle_ps::<0xEE>(t0, t2);
        s[4 * g + 2] = _mm256_shuffle_ps::<0x44>(t1, t3);
        s[4 * g + 3] = _mm256_shuffle_ps::<0xEE>(t1, t3);
    }
    for q in 0..4 {
        r[q] = _mm256_permute2f128_ps::<0x20>(s[q], s[4 + q]);
        r[4 + q] = _mm256_permute2f128_ps::<0x31>(s[q], s[4 + q]);
    }
}

/// One k-block of a tile for all rows from the packed panels, MRA rows per micro-kernel call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn tile_avx2_packed(
    xp: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    assert!(xp.len() == rows * k && acc.len() == rows * NR);
    let xpp = xp.as_ptr();
    let wtp = wt.as_ptr();
    let accp = acc.as_mut_ptr();
    let mut r0 = 0;
    while r0 < rows {
        // Panel r0..r0+m holds x[r0+i, k0+kk] at xb + kk*m + i.
        let m = MRP.min(rows - r0);
        let xb = xpp.add(r0 * k + k0 * m);
        let mut i = 0;
        while i < m {
            let (xq, aq) = (xb.add(i), accp.add((r0 + i) * NR));
            let h = MRA.min(m - i);
            match h {
                MRA => micro_avx2::<MRA>(xq, m, kb, wtp, aq, k0 == 0),
                1 => micro_avx2::<1>(xq, m, kb, wtp, aq, k0 == 0),
                2 => micro_avx2::<2>(xq, m, kb, wtp, aq, k0 == 0),
                3 => micro_avx2::<3>(xq, m, kb, wtp, aq, k0 == 0),
                4 => micro_avx2::<4>(xq, m, kb, wtp, aq, k0 == 0),
                5 => micro_avx2::<5>(xq, m, kb, wtp, aq, k0 == 0),
                _ => unreachable!("block height ≤ MRA"),
            }
            i += h;
        }
        r0 += m;
    }
}
#[cfg(not(target_arch = "x86_64"))]
pub(super) unsafe fn tile_avx2_packed(
    _xp: &[f32],
    _k: usize,
    _rows: usize,
    _k0: usize,
    _kb: usize,
    _wt: &[f32; KB * NR],
    _acc: &mut [f32],
) {
    unreachable!("avx2 is x86_64 only")
}

/// `M` rows × NR outputs, two ymm accumulators per row: `x[m]` at `xp + kk*xs + m` (kb values of
/// k), the widened block `wt[kk*NR + j]`; `acc[m][j] = acc[m][j] ⊕ (x ⊗ w)`, kk ascending, one
/// separately rounded multiply and add per step (no FMA). `fresh` (the first k-block): the
/// accumulators start at +0.0 instead of `acc`'s values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn micro_avx2<const M: usize>(
    xp: *const f32,
    xs: usize,
    kb: usize,
    wt: *const f32,
    acc: *mut f32,
    fresh: bool,
) {
    use std::arch::x86_64::*;
    let mut lo = [_mm256_setzero_ps(); M];
    let mut hi = [_mm256_setzero_ps(); M];
    if !fresh {
        for m in 0..M {
            lo[m] = _mm256_loadu_ps(acc.add(m * NR));
            hi[m] = _mm256_loadu_ps(acc.add(m * NR + 8));
        }
    }
    let (mut xq, mut wq) = (xp, wt);
    for _ in 0..kb {
        let (w0, w1) = (_mm256_loadu_ps(wq), _mm256_loadu_ps(wq.add(8)));
        for m in 0..M {
            let xv = _mm256_set1_ps(*xq.add(m));
            lo[m] = _mm256_add_ps(lo[m], _mm256_mul_ps(xv, w0));
            hi[m] = _mm256_add_ps(hi[m], _mm256_mul_ps(xv, w1));
        }
        xq = xq.add(xs);
        wq = wq.add(NR);
    }
    for m in 0..M {
        _mm256_storeu_ps(acc.add(m * NR), lo[m]);
        _mm256_storeu_ps(acc.add(m * NR + 8), hi[m]);
    }
}
