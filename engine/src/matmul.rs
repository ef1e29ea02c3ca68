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
    dots_transposed_with(Kernel::detect(), x, kt, stride, out)
}

fn dots_transposed_with(kernel: Kernel, x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    assert!(out.len().is_multiple_of(16) && out.len() <= stride && kt.len() >= x.len() * stride);
    assert!(
        kernel.supported(),
        "{kernel:?} kernels need CPU features this CPU lacks"
    );
    match kernel {
        // SAFETY: the CPU supports avx512f (asserted above).
        Kernel::Avx512 => unsafe { dots_transposed_avx512(x, kt, stride, out) },
        // SAFETY: the CPU supports avx2 (asserted above).
        Kernel::Avx2 => unsafe { dots_transposed_avx2(x, kt, stride, out) },
        Kernel::Portable => dots_transposed_generic(x, kt, stride, out),
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
/// The same loops compiled for 256-bit vectors (avx2 alone: the compiler may not fuse, and does
/// not, since Rust never contracts `a * b + c`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn dots_transposed_avx2(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
    dots_transposed_generic(x, kt, stride, out)
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn dots_transposed_avx2(x: &[f32], kt: &[f32], stride: usize, out: &mut [f32]) {
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
/// Rows per packed panel, and per micro-kernel call on the avx512 path (one zmm accumulator per
/// row).
const MRP: usize = 16;
/// Rows per micro-kernel call on the avx2 path (two ymm accumulators per row: 12 of 16 registers).
const MRA: usize = 6;

/// The kernel family a matmul runs. Every family computes the same bits (tested); they differ in
/// vector width only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Scalar code for baseline x86-64 (and other targets).
    Portable,
    /// 256-bit vectors: avx2 (plus f16c to widen f16 weights). Never FMA.
    Avx2,
    /// 512-bit vectors: avx512f. Never FMA.
    Avx512,
}

impl Kernel {
    /// The widest family this CPU supports; `TRACEGATE_ENGINE_PORTABLE` (any value) forces the
    /// portable one, so tests can check that every path gives the same digest.
    pub fn detect() -> Kernel {
        static DETECTED: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            if std::env::var_os("TRACEGATE_ENGINE_PORTABLE").is_some() {
                Kernel::Portable
            } else if Kernel::Avx512.supported() {
                Kernel::Avx512
            } else if Kernel::Avx2.supported() {
                Kernel::Avx2
            } else {
                Kernel::Portable
            }
        })
    }

    /// Whether this CPU can run the family (the environment variable aside).
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Kernel::Portable => true,
                Kernel::Avx2 => {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("f16c")
                }
                Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Kernel::Portable
        }
    }

    /// Every family this CPU can run, portable first (the tests compare them all).
    pub fn all_supported() -> Vec<Kernel> {
        [Kernel::Portable, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }
}

/// §2, fast: `y = x·Wᵀ (+ b)`, `x` is `[rows, K]`, result `[rows, N]`. Tiles of NR outputs are
/// spread over the rayon pool; within a tile every (row, output) has its own accumulator that
/// starts at +0.0 and adds `x[r,k] ⊗ w[o,k]` for k ascending, across k-blocks, exactly as `dot`
/// does. Only the grouping across outputs and rows changes, so bits equal `matmul_ref`.
pub fn matmul(x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    matmul_with(Kernel::detect(), x, rows, w, bias)
}

/// `matmul` on a given kernel family (tests run every family the CPU has). Panics if the CPU
/// cannot run it.
pub fn matmul_with(
    kernel: Kernel,
    x: &[f32],
    rows: usize,
    w: Mat,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    assert!(
        kernel.supported(),
        "{kernel:?} kernels need CPU features this CPU lacks"
    );
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), rows * k, "x is [rows, K]");
    let tiles = n.div_ceil(NR);
    let mut y = vec![0.0f32; rows * n];
    // The SIMD paths read x from k-major panels of MRP rows (pure data movement).
    let xp = match kernel {
        Kernel::Portable => Vec::new(),
        Kernel::Avx2 | Kernel::Avx512 => pack_rows(x, rows, k),
    };
    let yp = SyncPtr(y.as_mut_ptr());
    // Each task keeps its tile's [rows][NR] accumulators and the widened weight block in scratch
    // of its own (not zeroed per tile: every value read is written first), and writes the
    // finished tile straight into its columns of y. With rows = 1 (cached decode) this streams
    // each weight once, widened block by block in L1: never a whole f32 copy.
    (0..tiles).into_par_iter().for_each_init(
        || (vec![0.0f32; rows * NR], Box::new([0.0f32; KB * NR])),
        |(tile_acc, wt), t| {
            tile_acc.fill(0.0);
            let o0 = t * NR;
            let valid = NR.min(n - o0);
            let mut k0 = 0;
            while k0 < k {
                let kb = KB.min(k - k0);
                widen_transposed(kernel, w, o0, valid, k0, kb, wt);
                match kernel {
                    // SAFETY: the CPU supports avx512f (asserted above); `xp` is `x` packed.
                    Kernel::Avx512 => unsafe {
                        tile_avx512_packed(&xp, k, rows, k0, kb, wt, tile_acc)
                    },
                    // SAFETY: the CPU supports avx2 (asserted above); `xp` is `x` packed.
                    Kernel::Avx2 => unsafe { tile_avx2_packed(&xp, k, rows, k0, kb, wt, tile_acc) },
                    Kernel::Portable => tile_portable(x, k, rows, k0, kb, wt, tile_acc),
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
    kernel: Kernel,
    w: Mat,
    o0: usize,
    valid: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) {
    #[cfg(target_arch = "x86_64")]
    if valid == NR {
        // SAFETY: the family's CPU features were checked by the caller (`matmul_with` asserts
        // `supported`); the block's rows/columns are in bounds of `w` (valid == NR).
        let done = match kernel {
            Kernel::Avx512 if kb >= 16 => unsafe { widen_transposed_avx512(w, o0, k0, kb, wt) },
            Kernel::Avx2 if kb >= 8 => unsafe { widen_transposed_avx2(w, o0, k0, kb, wt) },
            _ => 0,
        };
        if done < kb {
            widen_transposed_scalar(w, o0, valid, k0 + done, kb - done, &mut wt[done * NR..]);
        }
        return;
    }
    let _ = kernel;
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

/// Full 16-output tiles, 8 columns at a time: for each half of the tile load 8 rows × 8 values,
/// widen in registers, transpose 8×8, store 8 lanes per k. Returns the columns done (a multiple
/// of 8).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_transposed_avx2(
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
    // In bounds: rows o0..o0+16 ≤ rows (valid == NR) and columns k0+kc+8 ≤ k0+kb ≤ cols.
    let row_ptr = |j: usize, kc: usize| base.add(((o0 + j) * w.cols + k0 + kc) * es);
    let out = wt.as_mut_ptr();
    let mut kc = 0;
    while kc + 8 <= kb {
        for half in 0..2 {
            let mut r: [__m256; 8] = [_mm256_setzero_ps(); 8];
            for (j, rj) in r.iter_mut().enumerate() {
                let p = row_ptr(half * 8 + j, kc);
                *rj = match w.dtype {
                    WDType::F32 => _mm256_loadu_ps(p as *const f32),
                    WDType::BF16 => {
                        let h = _mm_loadu_si128(p as *const __m128i);
                        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                    }
                    WDType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                };
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
unsafe fn tile_avx2_packed(
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
                MRA => micro_avx2::<MRA>(xq, m, kb, wtp, aq),
                1 => micro_avx2::<1>(xq, m, kb, wtp, aq),
                2 => micro_avx2::<2>(xq, m, kb, wtp, aq),
                3 => micro_avx2::<3>(xq, m, kb, wtp, aq),
                4 => micro_avx2::<4>(xq, m, kb, wtp, aq),
                5 => micro_avx2::<5>(xq, m, kb, wtp, aq),
                _ => unreachable!("block height ≤ MRA"),
            }
            i += h;
        }
        r0 += m;
    }
}
#[cfg(not(target_arch = "x86_64"))]
unsafe fn tile_avx2_packed(
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
/// separately rounded multiply and add per step (no FMA).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn micro_avx2<const M: usize>(
    xp: *const f32,
    xs: usize,
    kb: usize,
    wt: *const f32,
    acc: *mut f32,
) {
    use std::arch::x86_64::*;
    let mut lo = [_mm256_setzero_ps(); M];
    let mut hi = [_mm256_setzero_ps(); M];
    for m in 0..M {
        lo[m] = _mm256_loadu_ps(acc.add(m * NR));
        hi[m] = _mm256_loadu_ps(acc.add(m * NR + 8));
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
pub(crate) mod tests {
    use super::*;
    use crate::ops::{dot, matmul_ref, matmul_ref_by};
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
    pub(crate) fn vals(n: usize, seed: u64) -> Vec<f32> {
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

    /// A SIMD family this CPU lacks cannot be compared here: say so instead of passing quietly.
    /// Written to the stderr handle itself, which the test harness does not capture (eprintln!
    /// of a passing test is swallowed).
    pub(crate) fn note_unchecked_kernels(what: &str) {
        for k in [Kernel::Avx2, Kernel::Avx512] {
            if !k.supported() {
                use std::io::Write;
                let _ = writeln!(std::io::stderr(), "NOT CHECKED: {what}: the {k:?} kernels did not run (this CPU lacks their features); the others were compared");
            }
        }
    }

    /// The first index where the bits differ, if any (what every bit-equality check asserts).
    fn first_mismatch(want: &[f32], got: &[f32]) -> Option<usize> {
        assert_eq!(want.len(), got.len());
        (0..want.len()).find(|&i| want[i].to_bits() != got[i].to_bits())
    }

    /// Shapes hitting every tail: N not a multiple of NR, K = 1 and not a multiple of KB or of
    /// the 8/16-column widening steps, one row (cached decode), rows not a multiple of the
    /// micro-kernel heights (MR, MRA) or of the panel height MRP, many rows (prefill).
    const SHAPES: &[(usize, usize, usize)] = &[
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
        (6, 16, 9),
        (1, 64, 1024),
        (13, 32, 7),
        (1, 32, 13),
        (1, 16, 1003),
        (1, 48, 7),
    ];

    /// One case: (dtype, rows, n, k, x, weight bytes, bias).
    type Case = (WDType, usize, usize, usize, Vec<f32>, Vec<u8>, Vec<f32>);

    /// Every shape × dtype of `SHAPES`, with a bias vector each.
    fn cases() -> Vec<Case> {
        let mut v = vec![];
        for dtype in [WDType::F32, WDType::BF16, WDType::F16] {
            for &(rows, n, k) in SHAPES {
                let x = vals(rows * k, 1 + rows as u64);
                let wb = bytes_of(dtype, &vals(n * k, 7 + n as u64));
                v.push((dtype, rows, n, k, x, wb, vals(n, 99)));
            }
        }
        v
    }

    fn mat(dtype: WDType, n: usize, k: usize, bytes: &[u8]) -> Mat<'_> {
        Mat {
            dtype,
            rows: n,
            cols: k,
            bytes,
        }
    }

    #[test]
    fn matmul_every_kernel_equals_definition_bits() {
        note_unchecked_kernels("matmul_every_kernel_equals_definition_bits");
        // Three threads, so tiles of one matmul run on different threads.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        let kernels = Kernel::all_supported();
        for (dtype, rows, n, k, x, wb, b) in cases() {
            let w = mat(dtype, n, k, &wb);
            for bias in [None, Some(&b[..])] {
                let want = matmul_ref(&x, rows, w, bias);
                for &kernel in &kernels {
                    let got = pool.install(|| matmul_with(kernel, &x, rows, w, bias));
                    assert_eq!(
                        first_mismatch(&want, &got),
                        None,
                        "{kernel:?} dtype {dtype:?} rows {rows} n {n} k {k} bias {}",
                        bias.is_some()
                    );
                }
            }
        }
    }

    /// Negative control for the test above: the same cases through a planted reorder (split-K:
    /// the two halves of k summed separately, then added) and a planted FMA are caught.
    #[test]
    fn bit_equality_check_catches_planted_reorder_and_fma() {
        let split_k = |x: &[f32], w: &[f32]| {
            let h = x.len() / 2;
            dot(&x[..h], &w[..h]) + dot(&x[h..], &w[h..])
        };
        let fma =
            |x: &[f32], w: &[f32]| x.iter().zip(w).fold(0.0f32, |a, (&p, &q)| p.mul_add(q, a));
        // Deterministic data, so the counts are fixed: every case with K ≥ 16 is caught (with a
        // few steps only, a reorder can round the same by chance; with K = 1 it cannot differ).
        let (mut missed_split, mut missed_fma, mut long) = (vec![], vec![], 0);
        for (dtype, rows, n, k, x, wb, _) in cases() {
            let w = mat(dtype, n, k, &wb);
            let want = matmul_ref(&x, rows, w, None);
            if k >= 16 {
                long += 1;
                if first_mismatch(&want, &matmul_ref_by(&x, rows, w, None, split_k)).is_none() {
                    missed_split.push((dtype, rows, n, k));
                }
                if first_mismatch(&want, &matmul_ref_by(&x, rows, w, None, fma)).is_none() {
                    missed_fma.push((dtype, rows, n, k));
                }
            }
        }
        assert!(long >= 30, "{long} cases with K ≥ 16");
        assert_eq!(missed_split, vec![], "split-K not caught");
        assert_eq!(missed_fma, vec![], "FMA not caught");
    }

    #[test]
    fn transposed_widening_is_exact_for_every_16_bit_pattern() {
        note_unchecked_kernels("transposed_widening_is_exact_for_every_16_bit_pattern");
        // Every bf16 and f16 bit pattern (subnormals, infinities, NaN payloads) through each
        // family's transpose-widen equals the scalar widening.
        let bytes: Vec<u8> = (0..=u16::MAX).flat_map(|b| b.to_le_bytes()).collect();
        for kernel in Kernel::all_supported() {
            for dtype in [WDType::BF16, WDType::F16] {
                let w = mat(dtype, 16, 4096, &bytes);
                let mut wt = [0.0f32; KB * NR];
                let mut row = vec![0.0f32; 4096];
                for k0 in (0..4096).step_by(KB) {
                    widen_transposed(kernel, w, 0, 16, k0, KB, &mut wt);
                    for j in 0..16 {
                        w.widen_row(j, 0, &mut row);
                        for kk in 0..KB {
                            assert_eq!(
                                wt[kk * NR + j].to_bits(),
                                row[k0 + kk].to_bits(),
                                "{kernel:?} {dtype:?} row {j} col {}",
                                k0 + kk
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn transposed_dots_equal_dot_bits() {
        note_unchecked_kernels("transposed_dots_equal_dot_bits");
        // Column counts hitting the 64- and 16-wide blocks, d odd and 1; every family.
        for &(d, cols, stride) in &[(1, 16, 16), (64, 80, 96), (7, 128, 144), (33, 48, 48)] {
            let x = vals(d, d as u64);
            let kt = vals(d * stride, 5 + cols as u64);
            for kernel in Kernel::all_supported() {
                let mut got = vec![0.0f32; cols];
                dots_transposed_with(kernel, &x, &kt, stride, &mut got);
                for c in 0..cols {
                    let w: Vec<f32> = (0..d).map(|j| kt[j * stride + c]).collect();
                    let want = dot(&x, &w).to_bits();
                    assert_eq!(got[c].to_bits(), want, "{kernel:?} d {d} col {c}");
                }
            }
        }
    }
}
