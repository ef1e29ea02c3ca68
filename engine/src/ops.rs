//! Ordered fp32 kernels, each the written definition of docs/numerics.md (section numbers in the
//! comments). Rust never contracts `a * b + c` into an FMA, so every `+`/`*` below is one rounded
//! IEEE operation. Two operations have a fast path beside their definition, each tested bit for
//! bit against it: `matmul` (tiled, AVX-512) against `matmul_ref`, and `attention` (threaded
//! over heads, scores through `dots_transposed`) against `attention_ref`. Names follow
//! docs/numerics.md §14, the same as the contract's ops.py.

use rayon::prelude::*;

use crate::weights::Mat;

/// §2: `acc = +0.0; acc = acc ⊕ (x[k] ⊗ w[k])` for k ascending.
#[inline]
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for k in 0..x.len() {
        acc += x[k] * w[k];
    }
    acc
}

/// §3: ordered sum from +0.0.
pub fn ordered_sum(v: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for &x in v {
        acc += x;
    }
    acc
}

/// §2, the plain definition: `y[r,o] = dot(x[r,:], W[o,:]) (⊕ b[o])`. The reference for tests.
pub fn matmul_ref(x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let mut wr = vec![0.0f32; k];
    let mut y = vec![0.0f32; rows * n];
    for o in 0..n {
        w.widen_row(o, 0, &mut wr);
        for r in 0..rows {
            let mut v = dot(&x[r * k..(r + 1) * k], &wr);
            if let Some(b) = bias {
                v += b[o];
            }
            y[r * n + o] = v;
        }
    }
    y
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

/// §6 RMSNorm of one vector.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let mut ss = 0.0f32;
    for &v in x {
        ss += v * v;
    }
    let mean = ss / x.len() as f32;
    let inv = 1.0f32 / (mean + eps).sqrt();
    for i in 0..x.len() {
        out[i] = w[i] * (x[i] * inv);
    }
}

/// §6 RMSNorm of every `n`-wide row of `x`.
pub fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = vec![0.0f32; x.len()];
    // Rows are independent; each row's arithmetic is the same whichever thread runs it.
    out.par_chunks_exact_mut(n)
        .zip(x.par_chunks_exact(n))
        .for_each(|(or, xr)| rmsnorm(xr, w, eps, or));
    out
}

/// §4 `f32(E(binary64(x)))`: libm's binary64 exp, rounded to f32 once.
pub fn exp_to_f32(x: f32) -> f32 {
    (x as f64).exp() as f32
}

/// §8.6 / §10.2 softmax over the entries with `visible[c]`; masked entries get +0.0.
/// `m` is the max of the visible scores; `e = f32(exp_f64(s ⊖ m))`; ordered sum; divide.
pub fn softmax(s: &[f32], visible: impl Fn(usize) -> bool, out: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    for (c, &v) in s.iter().enumerate() {
        if visible(c) && v > m {
            m = v;
        }
    }
    let mut z = 0.0f32;
    for (c, &v) in s.iter().enumerate() {
        if visible(c) {
            let e = exp_to_f32(v - m);
            out[c] = e;
            z += e;
        } else {
            out[c] = 0.0;
        }
    }
    for (c, o) in out.iter_mut().enumerate() {
        if visible(c) {
            *o /= z;
        }
    }
}

/// §7 RoPE tables for a list of absolute positions: `cos[p][i]`, `sin[p][i]`, i < d/2.
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// §7 `inv_freq[i] = f32(1 / pow(base, (2i)/d))`, all in binary64.
pub fn inv_freq(base: f64, d: usize) -> Vec<f32> {
    (0..d / 2)
        .map(|i| (1.0f64 / base.powf((2 * i) as f64 / d as f64)) as f32)
        .collect()
}

impl Rope {
    pub fn new(base: f64, d: usize, positions: &[i64]) -> Rope {
        let half = d / 2;
        let inv = inv_freq(base, d);
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in &inv {
                let angle = (p as f32) * f;
                cos.push((angle as f64).cos() as f32);
                sin.push((angle as f64).sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotate one head vector in place with the tables of row `row` ("rotate half" pairing).
    pub fn apply(&self, row: usize, x: &mut [f32]) {
        let h = self.half;
        let (c, s) = (
            &self.cos[row * h..(row + 1) * h],
            &self.sin[row * h..(row + 1) * h],
        );
        for i in 0..h {
            let (a, b) = (x[i], x[i + h]);
            x[i] = a * c[i] - b * s[i];
            x[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// The key/value rows attention reads (`[S, nkv, d]` each) with their absolute positions.
pub struct KeyRows<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub pos: &'a [i64],
}

/// Head counts and width of one attention: `nq` query heads, `nkv` kv heads, `d` per head.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub nq: usize,
    pub nkv: usize,
    pub d: usize,
}

/// §8.3–§8.7, the plain definition: causal GQA attention of query rows `q` `[T, nq, d]` at
/// positions `q_pos` over `keys` (key c visible to row r iff `pos[c] ≤ q_pos[r]`). Returns
/// `o` `[T, nq, d]` and the probabilities `[nq, T, S]`. The reference for `attention`.
pub fn attention_ref(
    q: &[f32],
    q_pos: &[i64],
    keys: &KeyRows,
    hs: Heads,
    scale: f32,
) -> (Vec<f32>, Vec<f32>) {
    let (t, s_len, d) = (q_pos.len(), keys.pos.len(), hs.d);
    let mut o = vec![0.0f32; t * hs.nq * d];
    let mut probs = vec![0.0f32; hs.nq * t * s_len];
    let mut s = vec![0.0f32; s_len];
    for hq in 0..hs.nq {
        let hk = hq / (hs.nq / hs.nkv); // §8.3
        for r in 0..t {
            let visible = |c: usize| keys.pos[c] <= q_pos[r]; // §8.5
            let qv = &q[(r * hs.nq + hq) * d..(r * hs.nq + hq + 1) * d];
            for c in 0..s_len {
                let kv = &keys.k[(c * hs.nkv + hk) * d..(c * hs.nkv + hk + 1) * d];
                s[c] = if visible(c) {
                    dot(qv, kv) * scale // §8.4
                } else {
                    f32::NEG_INFINITY
                };
            }
            let p = &mut probs[(hq * t + r) * s_len..(hq * t + r + 1) * s_len];
            softmax(&s, visible, p); // §8.6
            let orow = &mut o[(r * hs.nq + hq) * d..(r * hs.nq + hq + 1) * d];
            for c in (0..s_len).filter(|&c| visible(c)) {
                let vv = &keys.v[(c * hs.nkv + hk) * d..(c * hs.nkv + hk + 1) * d];
                for j in 0..d {
                    orow[j] += p[c] * vv[j]; // §8.7
                }
            }
        }
    }
    (o, probs)
}

/// Attention scores computed together (one `dot` per lane of an array).
const SC: usize = 16;

// The speed-ups of attention: scores SC at a time, each lane its own ordered `dot`.

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

/// §8.3–§8.7, fast: `attention_ref` with heads spread over the rayon pool and each head's
/// scores computed SC at a time from its keys transposed (`dots_transposed`, each lane its own
/// ordered `dot`). Every (head, row) does the same operations in the same order as the
/// definition, so the bits are equal (tested). `probs` is empty unless `want_probs`.
pub fn attention(
    q: &[f32],
    q_pos: &[i64],
    keys: &KeyRows,
    hs: Heads,
    scale: f32,
    want_probs: bool,
) -> (Vec<f32>, Vec<f32>) {
    let (t, tk, d, nq, nkv) = (q_pos.len(), keys.pos.len(), hs.d, hs.nq, hs.nkv);
    let group = nq / nkv;
    // Heads are independent; each head's arithmetic is the same whichever thread runs it.
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..nq)
        .into_par_iter()
        .map(|hq| {
            let hk = hq / group;
            let mut o = vec![0.0f32; t * d];
            let mut probs = if want_probs {
                vec![0.0f32; t * tk]
            } else {
                vec![]
            };
            let mut s = vec![0.0f32; tk];
            let mut p = vec![0.0f32; tk];
            // This head's keys transposed to `kt[j][c]` (columns padded with zeros to a
            // multiple of SC), so SC scores advance together, each its own ordered `dot`.
            let tkp = tk.div_ceil(SC) * SC;
            let mut kt = vec![0.0f32; d * tkp];
            let mut dots = vec![0.0f32; tkp];
            for c in 0..tk {
                let kr = &keys.k[(c * nkv + hk) * d..(c * nkv + hk + 1) * d];
                for j in 0..d {
                    kt[j * tkp + c] = kr[j];
                }
            }
            for r in 0..t {
                let qv = &q[(r * nq + hq) * d..(r * nq + hq + 1) * d];
                let visible = |c: usize| keys.pos[c] <= q_pos[r];
                // Columns past the last visible one are not needed (they become -inf).
                let cend = (0..tk).rev().find(|&c| visible(c)).map_or(0, |c| c + 1);
                let cpad = cend.div_ceil(SC) * SC;
                dots_transposed(qv, &kt, tkp, &mut dots[..cpad]);
                for c in 0..tk {
                    s[c] = if visible(c) {
                        dots[c] * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                softmax(&s, visible, &mut p);
                let orow = &mut o[r * d..(r + 1) * d];
                for c in 0..tk {
                    if visible(c) {
                        let vv = &keys.v[(c * nkv + hk) * d..(c * nkv + hk + 1) * d];
                        for j in 0..d {
                            orow[j] += p[c] * vv[j];
                        }
                    }
                }
                if want_probs {
                    probs[r * tk..(r + 1) * tk].copy_from_slice(&p);
                }
            }
            (o, probs)
        })
        .collect();
    let mut o = vec![0.0f32; t * nq * d];
    for (hq, (oh, _)) in per_head.iter().enumerate() {
        for r in 0..t {
            o[(r * nq + hq) * d..(r * nq + hq + 1) * d].copy_from_slice(&oh[r * d..(r + 1) * d]);
        }
    }
    let probs = if want_probs {
        per_head.into_iter().flat_map(|(_, p)| p).collect()
    } else {
        vec![]
    };
    (o, probs)
}

/// §9 sigmoid with the stated branch, binary64 throughout, rounded once. NaN takes `g < 0`.
pub fn sigmoid(g: f32) -> f32 {
    let g64 = g as f64;
    if g >= 0.0 {
        (1.0 / (1.0 + (-g64).exp())) as f32
    } else {
        let e = g64.exp();
        (e / (1.0 + e)) as f32
    }
}

/// §9 `silu(g) = g ⊗ sigmoid(g)`.
pub fn silu(g: f32) -> f32 {
    g * sigmoid(g)
}

/// §10.3 the k largest entries ordered by (descending value, ascending index), plus the
/// (k+1)-th in that order when it exists. IEEE `>`; callers refuse NaN first.
pub fn topk(p: &[f32], k: usize) -> (Vec<usize>, Option<usize>) {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    // Stable sort by descending value keeps ascending index among equals.
    idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap_or(std::cmp::Ordering::Equal));
    let next = idx.get(k).copied();
    idx.truncate(k);
    (idx, next)
}

/// §12 argmax (ties to the lowest index, IEEE `>`) and margin `top1 ⊖ top2`. Requires no NaN
/// and length ≥ 2 (checked by the caller).
pub fn argmax_margin(v: &[f32]) -> (usize, f32) {
    let mut best = 0;
    for i in 1..v.len() {
        if v[i] > v[best] {
            best = i;
        }
    }
    let mut second = f32::NEG_INFINITY;
    for (i, &x) in v.iter().enumerate() {
        if i != best && x > second {
            second = x;
        }
    }
    (best, v[best] - second)
}

/// The margin of a given choice (docs/producers.md, forced decisions): the value of the chosen
/// index that comes last in rank order (descending value, ascending index) ⊖ the value of the
/// unchosen index that comes first. For the producer's own choice this is the margin above
/// (`argmax_margin`, and `p[k-th] ⊖ p[(k+1)-th]` of `topk`); for another choice it is what this
/// producer's numbers say about it, negative where they rank an unchosen index higher.
/// Requires no NaN and at least one unchosen index.
pub fn margin_of(v: &[f32], chosen: &[usize]) -> f32 {
    // a before b in rank order (IEEE equality: ±0 tie and go by index).
    let before = |a: usize, b: usize| v[a] > v[b] || (v[a] == v[b] && a < b);
    let mut weakest = chosen[0];
    for &c in &chosen[1..] {
        if before(weakest, c) {
            weakest = c;
        }
    }
    let mut strongest: Option<usize> = None;
    for i in 0..v.len() {
        if !chosen.contains(&i) && strongest.is_none_or(|s| before(i, s)) {
            strongest = Some(i);
        }
    }
    v[weakest] - v[strongest.expect("an unchosen index exists")]
}

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn attention_fast_equals_definition_bits() {
        note_if_avx512_not_checked("attention_fast_equals_definition_bits");
        // GQA groups of 1 and 3, key counts around the SC-wide blocks, cached rows (key
        // positions before the query rows) and a query row that sees only some of the keys.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(3)
            .build()
            .unwrap();
        for &(nq, nkv, d, s_len, t) in &[(2, 2, 4, 1, 1), (6, 2, 8, 17, 5), (3, 1, 6, 33, 33)] {
            let k_pos: Vec<i64> = (0..s_len as i64).collect();
            let q_pos: Vec<i64> = k_pos[s_len - t..].to_vec();
            let q = vals(t * nq * d, 11);
            let (k, v) = (vals(s_len * nkv * d, 12), vals(s_len * nkv * d, 13));
            let keys = KeyRows {
                k: &k,
                v: &v,
                pos: &k_pos,
            };
            let hs = Heads { nq, nkv, d };
            let (want_o, want_p) = attention_ref(&q, &q_pos, &keys, hs, 0.375);
            let (got_o, got_p) = pool.install(|| attention(&q, &q_pos, &keys, hs, 0.375, true));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&want_o),
                bits(&got_o),
                "o: nq {nq} nkv {nkv} s {s_len}"
            );
            assert_eq!(
                bits(&want_p),
                bits(&got_p),
                "p: nq {nq} nkv {nkv} s {s_len}"
            );
            let (o2, p2) = attention(&q, &q_pos, &keys, hs, 0.375, false);
            assert_eq!(bits(&o2), bits(&want_o));
            assert!(p2.is_empty());
        }
    }

    #[test]
    fn dot_starts_from_positive_zero() {
        // -0 ⊗ 1 = -0, and +0 ⊕ -0 = +0: the accumulator's +0 start is visible.
        assert_eq!(dot(&[-0.0], &[1.0]).to_bits(), 0.0f32.to_bits());
        // Order matters: (1e8 + 1) - 1e8 = 0 in f32, left to right.
        assert_eq!(dot(&[1e8, 1.0, -1e8], &[1.0, 1.0, 1.0]), 0.0);
        assert_eq!(ordered_sum(&[1.0, 1e8, -1e8]), 0.0);
        assert_eq!(ordered_sum(&[1e8, -1e8, 1.0]), 1.0);
    }

    #[test]
    fn rmsnorm_hand_case() {
        // x = [3, 4]: ss = 25, mean = 12.5, t = 12.5 + eps, inv = 1/sqrt(t).
        let eps = 1e-6f32;
        let mut out = [0.0f32; 2];
        rmsnorm(&[3.0, 4.0], &[1.0, 2.0], eps, &mut out);
        let inv = 1.0f32 / (12.5f32 + eps).sqrt();
        assert_eq!(out, [1.0 * (3.0 * inv), 2.0 * (4.0 * inv)]);
        // Zero vector: inv = 1/sqrt(eps), output zeros keep their sign.
        rmsnorm(&[0.0, -0.0], &[1.0, 1.0], eps, &mut out);
        assert_eq!(out[0].to_bits(), 0.0f32.to_bits());
        assert_eq!(out[1].to_bits(), (-0.0f32).to_bits());
    }

    #[test]
    fn softmax_with_masked_and_neg_inf() {
        let s = [1.0f32, f32::NEG_INFINITY, 3.0, 100.0];
        let mut p = [9.0f32; 4];
        softmax(&s, |c| c < 3, &mut p);
        // m = 3; e = [exp(-2), exp(-inf)=0, 1]; masked entry 3 → +0.
        let e0 = ((-2.0f64).exp()) as f32;
        let z = (e0 + 0.0) + 1.0;
        assert_eq!(p, [e0 / z, 0.0, 1.0 / z, 0.0]);
        assert_eq!(p[3].to_bits(), 0);
    }

    #[test]
    fn rope_table_entries_match_f64_formula() {
        let (base, d) = (10000.0f64, 12usize);
        let inv = inv_freq(base, d);
        for i in 0..d / 2 {
            let want = (1.0 / base.powf(2.0 * i as f64 / 12.0)) as f32;
            assert_eq!(inv[i].to_bits(), want.to_bits());
        }
        assert_eq!(inv[0], 1.0);
        let rope = Rope::new(base, d, &[0, 5, 1000]);
        for (row, p) in [0i64, 5, 1000].iter().enumerate() {
            for i in 0..6 {
                let angle = (*p as f32) * inv[i];
                assert_eq!(
                    rope.cos[row * 6 + i].to_bits(),
                    ((angle as f64).cos() as f32).to_bits()
                );
                assert_eq!(
                    rope.sin[row * 6 + i].to_bits(),
                    ((angle as f64).sin() as f32).to_bits()
                );
            }
        }
        // Position 0 is the identity.
        let mut x: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
        let x0 = x.clone();
        rope.apply(0, &mut x);
        assert_eq!(x, x0);
        // Hand case: d = 2, angle = π/2-ish: out = (a·c − b·s, b·c + a·s).
        let r = Rope {
            half: 1,
            cos: vec![0.5],
            sin: vec![0.25],
        };
        let mut v = [2.0f32, 4.0];
        r.apply(0, &mut v);
        assert_eq!(v, [2.0 * 0.5 - 4.0 * 0.25, 4.0 * 0.5 + 2.0 * 0.25]);
    }

    #[test]
    fn silu_both_branches() {
        let g = 1.5f32;
        assert_eq!(sigmoid(g), (1.0 / (1.0 + (-1.5f64).exp())) as f32);
        let g = -1.5f32;
        let e = (-1.5f64).exp();
        assert_eq!(sigmoid(g), (e / (1.0 + e)) as f32);
        assert_eq!(sigmoid(0.0), 0.5);
        assert_eq!(sigmoid(-0.0), 0.5);
        assert_eq!(
            sigmoid(-200.0),
            ((-200.0f64).exp() / (1.0 + (-200.0f64).exp())) as f32
        );
        assert_eq!(silu(2.0), 2.0 * sigmoid(2.0));
        assert!(silu(f32::NAN).is_nan());
        assert!(silu(f32::NEG_INFINITY).is_nan()); // -inf ⊗ 0: IEEE NaN, left as is
    }

    #[test]
    fn topk_ties_go_to_lowest_index() {
        let p = [0.1f32, 0.3, 0.3, 0.2, 0.3];
        let (c, next) = topk(&p, 2);
        assert_eq!(c, vec![1, 2]);
        assert_eq!(next, Some(4));
        let (c, next) = topk(&p, 5);
        assert_eq!(c, vec![1, 2, 4, 3, 0]);
        assert_eq!(next, None);
    }

    #[test]
    fn argmax_margin_ties_and_values() {
        assert_eq!(argmax_margin(&[1.0, 3.0, 3.0, 2.0]), (1, 0.0));
        assert_eq!(argmax_margin(&[5.0, 3.0, -1.0]), (0, 2.0));
        assert_eq!(
            argmax_margin(&[-1.0, f32::NEG_INFINITY]),
            (0, f32::INFINITY)
        );
    }
}
