//! The f32 kernel in AVX-512 intrinsics: the portable kernel's arithmetic lane for lane (so
//! the same sums to the bit) at about twice its speed. Distances in the window are packed
//! into a buffer and counted in batches by scalar code, which the core runs beside the
//! vector work; those outside it only cost a compare.

use super::chunk::{finish_chunk, scan_chunk, CHUNK};
use super::counts::{UlpCounts, Window};
use super::lanes::{LaneSums, LANES};
use super::ordering::F32K;
use super::pair_stats::Stats;
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
        signed_zero +=
            _mm512_mask_cmpeq_epi32_mask(differs, u, _mm512_setzero_si512()).count_ones() as u64;
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
