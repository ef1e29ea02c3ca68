//! The fast matmul of docs/numerics.md §2 and the attention scores' column dots: same
//! arithmetic as the definitions in `ops` (`dot`, `matmul_ref`), each output from +0.0 with k
//! ascending and one rounded multiply then one rounded add per step (no FMA, no split-K); only
//! the grouping across outputs and rows changes. Runtime-detected SIMD kernels beside a portable
//! one; every path is tested bit-for-bit against the definitions.

use rayon::prelude::*;

use crate::weights::Mat;

/// `out[c] = dot(x, column c of kt)` for `c < out.len()`, where `kt[j*stride + c]` holds `w_c[j]`
/// and `out.len()` is a multiple of 16 no larger than `stride`. Each column is exactly `dot`
/// (from +0.0, j ascending, separate multiply and add); columns are independent, so 16-wide
/// vectors of them advance side by side (64 at a time to hide the add latency).
pub fn dots_transposed(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    assert!(out.len().is_multiple_of(16) && out.len() <= stride && kt.len() >= x.len() * stride);
    if avx512_available() {
        // SAFETY: the CPU supports avx512f (checked at runtime).
        unsafe { dots_transposed_avx512(x, kt, stride, out) }
    } else {
        dots_transposed_generic(x, kt, stride, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dots_transposed_avx512(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dots_transposed_avx512(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}

#[inline(always)]
fn dots_transposed_generic(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    let mut c0 = 0;
    while c0 + 64 <= out.len() {
        dots_block::<64>(x, kt, stride, c0, &mut out[c0..c0 + 64]);
        c0 += 64;
    }
    while c0 < out.len() {
        dots_block::<16>(x, kt, stride, c0, &mut out[c0..c0 + 16]);
        c0 += 16;
    }
}

#[inline(always)]
fn dots_block<const N: usize>(x: &[f32], kt: &[f32], stride: usize, c0: usize, out: &mut [f32]) {
    let mut acc = [0.0f32; N];
    for (j, &xj) in x.iter().enumerate() {
        let col: &[f32; N] = kt[j * stride + c0..j * stride + c0 + N]
            .try_into()
            .expect("N lanes");
        for i in 0..N {
            acc[i] += xj * col[i];
        }
    }
    out.copy_from_slice(&acc);
}

/// Outputs per tile: one 512-bit vector of accumulators per row.
const NR: usize = 16;
/// k per widened block: `KB × NR` f32 (16 KiB) stays in L1 while every row block streams it.
const KB: usize = 256;
/// Rows per micro-kernel call (independent accumulators per (row, output)).
const MR: usize = 8;
/// Rows per packed micro-kernel call on the avx512 path (one zmm accumulator per row).
const MRP: usize = 16;

/// §2, fast: `y = x·Wᵀ (+ b)`, `x` is `[rows, K]`, result `[rows, N]`. Tiles of NR outputs are
/// spread over the rayon pool; within a tile every (row, output) has its own accumulator that
/// starts at +0.0 and adds `x[r,k] ⊗ w[o,k]` for k ascending, across k-blocks, exactly as `dot`
/// does. Only the grouping across outputs and rows changes, so bits equal `matmul_ref`.
pub fn matmul(x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    debug_assert_eq!(x.len(), rows * k);
    let tiles = n.div_ceil(NR);
    let mut y = vec![0.0f32; rows * n];
    let use_avx512 = avx512_available();
    // The avx512 path reads x from k-major panels of MRP rows (pure data movement).
    let xp = if use_avx512 {
        pack_rows(x, rows, k)
    } else {
        Vec::new()
    };
    let yp = SyncPtr(y.as_mut_ptr());
    // Each task keeps its tile's [rows][NR] accumulators in a scratch buffer of its own and
    // writes the finished tile straight into its columns of y.
    (0..tiles).into_par_iter().for_each_init(
        || vec![0.0f32; rows * NR],
        |tile_acc, t| {
            tile_acc.fill(0.0);
            let o0 = t * NR;
            let valid = NR.min(n - o0);
            let mut wt = [0.0f32; KB * NR];
            let mut k0 = 0;
            while k0 < k {
                let kb = KB.min(k - k0);
                widen_transposed(w, o0, valid, k0, kb, &mut wt);
                if use_avx512 {
                    // SAFETY: the CPU supports avx512f (checked at runtime above); `xp` is `x` packed.
                    unsafe { tile_avx512_packed(&xp, k, rows, k0, kb, &wt, tile_acc) }
                } else {
                    tile_portable(x, k, rows, k0, kb, &wt, tile_acc)
                }
                k0 += kb;
            }
            for r in 0..rows {
                let src = &tile_acc[r * NR..r * NR + valid];
                // SAFETY: in bounds of y (r < rows, o0 + valid ≤ n); tile t is the only writer of
                // columns o0..o0+valid, and y outlives the parallel loop.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(yp.get().add(r * n + o0), valid) };
                match bias {
                    // The bias is added once, after the whole accumulation.
                    Some(b) => dst
                        .iter_mut()
                        .zip(src)
                        .zip(&b[o0..o0 + valid])
                        .for_each(|((d, &s), &bb)| *d = s + bb),
                    None => dst.copy_from_slice(src),
                }
            }
        },
    );
    y
}

/// The output pointer shared by the tile tasks (each writes disjoint columns).
struct SyncPtr(*mut f32);
// SAFETY: only used for disjoint writes inside `matmul` while the Vec it points into is alive.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// `x [rows, K]` as panels: rows `b*MRP..b*MRP+MRP` stored k-major (`[K][MRP]`) at `b*MRP*K`,
/// then the `rows % MRP` tail rows k-major (`[K][rem]`). Pure data movement.
fn pack_rows(x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    let mut xp = vec![0.0f32; rows * k];
    let mut r0 = 0;
    while r0 < rows {
        let m = MRP.min(rows - r0);
        let dst = &mut xp[r0 * k..(r0 + m) * k];
        for i in 0..m {
            let src = &x[(r0 + i) * k..(r0 + i + 1) * k];
            for (kk, &v) in src.iter().enumerate() {
                dst[kk * m + i] = v;
            }
        }
        r0 += m;
    }
    xp
}

/// One k-block of a tile for all rows from the packed panels, MRP rows per micro-kernel call.
/// (Software prefetch of the next weight block was measured: no prefill gain, decode 10–20% slower.)
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512_packed(
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
unsafe fn tile_avx512_packed(
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

/// Widen `W[o0..o0+valid, k0..k0+kb]` into `wt[k*NR + j]` (lanes past `valid` are zero and their
/// results discarded). Pure data movement: every path stores the same exact values.
fn widen_transposed(
    w: Mat,
    o0: usize,
    valid: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) {
    #[cfg(target_arch = "x86_64")]
    if valid == NR && kb >= 16 && avx512_available() {
        // SAFETY: avx512f checked; the block's rows/columns are in bounds of `w` (valid == NR).
        let done = unsafe { widen_transposed_avx512(w, o0, k0, kb, wt) };
        if done < kb {
            widen_transposed_scalar(w, o0, valid, k0 + done, kb - done, &mut wt[done * NR..]);
        }
        return;
    }
    widen_transposed_scalar(w, o0, valid, k0, kb, &mut wt[..]);
}

fn widen_transposed_scalar(w: Mat, o0: usize, valid: usize, k0: usize, kb: usize, wt: &mut [f32]) {
    let mut row = [0.0f32; KB];
    for j in 0..NR {
        if j < valid {
            w.widen_row(o0 + j, k0, &mut row[..kb]);
            for kk in 0..kb {
                wt[kk * NR + j] = row[kk];
            }
        } else {
            for kk in 0..kb {
                wt[kk * NR + j] = 0.0;
            }
        }
    }
}

/// Full 16-output tiles, 16 columns at a time: load 16 rows × 16 values, widen in registers,
/// transpose 16×16 with shuffles, store 16 lanes per k. Returns the columns done (a multiple
/// of 16).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn widen_transposed_avx512(
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

/// avx512f present and not disabled: `TRACEGATE_ENGINE_PORTABLE` (any value) forces the portable
/// kernels, so tests can check that both paths give the same digest.
pub fn avx512_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static FORCE_PORTABLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let off =
            *FORCE_PORTABLE.get_or_init(|| std::env::var_os("TRACEGATE_ENGINE_PORTABLE").is_some());
        !off && std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// One k-block of a tile for all rows, in blocks of MR rows then single rows.
#[inline(always)]
fn tile_generic(
    x: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    let mut r = 0;
    while r + MR <= rows {
        micro::<MR>(x, k, r, k0, kb, wt, acc);
        r += MR;
    }
    while r < rows {
        micro::<1>(x, k, r, k0, kb, wt, acc);
        r += 1;
    }
}

/// `M` rows × NR outputs: `acc[m][j] = acc[m][j] ⊕ (x[r+m, k0+kk] ⊗ wt[kk][j])`, kk ascending.
#[inline(always)]
fn micro<const M: usize>(
    x: &[f32],
    k: usize,
    r0: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    let mut a = [[0.0f32; NR]; M];
    for m in 0..M {
        a[m].copy_from_slice(&acc[(r0 + m) * NR..(r0 + m + 1) * NR]);
    }
    let xs: [&[f32]; M] = std::array::from_fn(|m| &x[(r0 + m) * k + k0..(r0 + m) * k + k0 + kb]);
    for kk in 0..kb {
        let wv: &[f32; NR] = wt[kk * NR..(kk + 1) * NR].try_into().expect("NR lanes");
        for m in 0..M {
            let xv = xs[m][kk];
            for j in 0..NR {
                a[m][j] += xv * wv[j];
            }
        }
    }
    for m in 0..M {
        acc[(r0 + m) * NR..(r0 + m + 1) * NR].copy_from_slice(&a[m]);
    }
}

fn tile_portable(
    x: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    tile_generic(x, k, rows, k0, kb, wt, acc)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::{dot, matmul_ref};
    use crate::weights::WDType;

    fn bytes_of(dtype: WDType, v: &[f32]) -> Vec<u8> {
        match dtype {
            WDType::F32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            WDType::BF16 => v
                .iter()
                .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
                .collect(),
            WDType::F16 => v
                .iter()
                .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
                .collect(),
        }
    }

    /// Deterministic pseudo-random values with a wide exponent range, signed zeros included.
    fn vals(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|i| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 33) as f32) / (1u64 << 31) as f32 - 0.5;
                match i % 37 {
                    0 => -0.0,
                    1 => 0.0,
                    _ => u * (1 << (s % 7)) as f32,
                }
            })
            .collect()
    }

    /// The avx512 kernels cannot be compared on a CPU without them: say so instead of passing.
    /// Written to the stderr handle itself, which the test harness does not capture (eprintln!
    /// of a passing test is swallowed).
    fn note_if_avx512_not_checked(what: &str) {
        if !avx512_available() {
            use std::io::Write;
            let _ = writeln!(std::io::stderr(), "NOT CHECKED: {what}: the avx512 kernel did not run (avx512f absent on this CPU, or TRACEGATE_ENGINE_PORTABLE set); only the portable kernel was compared");
        }
    }

    #[test]
    fn matmul_fast_equals_definition_bits() {
        note_if_avx512_not_checked("matmul_fast_equals_definition_bits");
        // Shapes hitting every tail: N not a multiple of NR, K = 1 and not a multiple of KB,
        // one row, rows not a multiple of MR; each storage dtype; with and without bias.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for dtype in [WDType::F32, WDType::BF16, WDType::F16] {
            for &(rows, n, k) in &[
                (1, 1, 1),
                (1, 17, 5),
                (3, 33, 1),
                (9, 15, 257),
                (17, 40, 300),
                (8, 16, 256),
                (1, 5, 600),
                (1, 48, 16),
                (2, 32, 47),
                (1, 16, 1000),
                (3, 16, 560),
                (64, 33, 300),
                (33, 17, 257),
                (31, 48, 1),
            ] {
                let x = vals(rows * k, 1 + rows as u64);
                let wb = bytes_of(dtype, &vals(n * k, 7 + n as u64));
                let w = Mat {
                    dtype,
                    rows: n,
                    cols: k,
                    bytes: &wb,
                };
                let b = vals(n, 99);
                for bias in [None, Some(&b[..])] {
                    let want = matmul_ref(&x, rows, w, bias);
                    let got = pool.install(|| matmul(&x, rows, w, bias));
                    let wb: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                    let gb: Vec<u32> = got.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(
                        wb,
                        gb,
                        "dtype {dtype:?} rows {rows} n {n} k {k} bias {}",
                        bias.is_some()
                    );
                }
            }
        }
    }

    #[test]
    fn transposed_widening_is_exact_for_every_16_bit_pattern() {
        note_if_avx512_not_checked("transposed_widening_is_exact_for_every_16_bit_pattern");
        // Every bf16 and f16 bit pattern (subnormals, infinities, NaN payloads) through the
        // vectorised transpose-widen equals the scalar widening.
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        for dtype in [WDType::BF16, WDType::F16] {
            let w = Mat {
                dtype,
                rows: 16,
                cols: 4096,
                bytes: &bytes,
            };
            let mut wt = [0.0f32; KB * NR];
            let mut row = vec![0.0f32; 4096];
            for k0 in (0..4096).step_by(KB) {
                widen_transposed(w, 0, 16, k0, KB, &mut wt);
                for j in 0..16 {
                    w.widen_row(j, 0, &mut row);
                    for kk in 0..KB {
                        assert_eq!(
                            wt[kk * NR + j].to_bits(),
                            row[k0 + kk].to_bits(),
                            "{dtype:?} row {j} col {}",
                            k0 + kk
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_portable_path_equals_definition_bits() {
        // Exercise the non-avx512 micro-kernels directly on a shape with all tails.
        let (rows, n, k) = (11, 19, 261);
        let x = vals(rows * k, 3);
        let wb = bytes_of(WDType::BF16, &vals(n * k, 4));
        let w = Mat {
            dtype: WDType::BF16,
            rows: n,
            cols: k,
            bytes: &wb,
        };
        let want = matmul_ref(&x, rows, w, None);
        let mut acc = vec![0.0f32; rows * NR];
        let mut wt = [0.0f32; KB * NR];
        let mut got = vec![0.0f32; rows * n];
        for t in 0..n.div_ceil(NR) {
            acc.iter_mut().for_each(|a| *a = 0.0);
            let valid = NR.min(n - t * NR);
            let mut k0 = 0;
            while k0 < k {
                let kb = KB.min(k - k0);
                widen_transposed(w, t * NR, valid, k0, kb, &mut wt);
                tile_portable(&x, k, rows, k0, kb, &wt, &mut acc);
                k0 += kb;
            }
            for r in 0..rows {
                got[r * n + t * NR..r * n + t * NR + valid]
                    .copy_from_slice(&acc[r * NR..r * NR + valid]);
            }
        }
        assert_eq!(
            want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
            got.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        );
    }

    #[test]
    fn transposed_dots_equal_dot_bits() {
        note_if_avx512_not_checked("transposed_dots_equal_dot_bits");
        // Column counts hitting the 64- and 16-wide blocks, d odd and 1; both code paths.
        for &(d, cols, stride) in &[(1, 16, 16), (64, 80, 96), (7, 128, 144), (33, 48, 48)] {
            let x = vals(d, d as u64);
            let kt = vals(d * stride, 5 + cols as u64);
            let mut got = vec![0.0f32; cols];
            dots_transposed(&x, &kt, stride, &mut got);
            let mut portable = vec![0.0f32; cols];
            dots_transposed_generic(&x, &kt, stride, &mut portable);
            for c in 0..cols {
                let w: Vec<f32> = (0..d).map(|j| kt[j * stride + c]).collect();
                let want = dot(&x, &w).to_bits();
                assert_eq!(got[c].to_bits(), want, "d {d} col {c}");
                assert_eq!(portable[c].to_bits(), want, "portable d {d} col {c}");
            }
        }
    }
}
