//! §7 RoPE and §8 attention: the definition (`attention_ref`) and its fast path (`attention`:
//! heads on the rayon pool, query rows in blocks, keys and values vectorised), bit-equal for
//! every kernel family (tested in `ops`'s tests).

use rayon::prelude::*;

use super::{dot, exp_shifted, softmax};
use crate::aligned::Lines;
use crate::matmul::Kernel;

/// §7 RoPE tables for a list of absolute positions: `cos[p][i]`, `sin[p][i]`, i < `half` =
/// ceil(d/2) (§16: an odd rotary dim rounds up, so `apply` rotates 2·half dims).
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// §7 `inv_freq[i] = f32(1 / pow(base, (2i)/d))`, all in binary64, for i < ceil(d/2): an odd d
/// (§16's rotary dim) keeps i = (d−1)/2, as transformers' `arange(0, d, 2)` does.
pub fn inv_freq(base: f64, d: usize) -> Vec<f32> {
    inv_freq_scaled(base, d, RopeScaling::Default)
}

/// §7.1 the rope types that rescale the frequencies (llama's `rope_parameters`); positions and
/// the rotation stay §7's.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    Default,
    /// `linear`: every frequency divided by `factor`.
    Linear {
        factor: f64,
    },
    /// `llama3`: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: f64,
    },
}

/// §7.1 `inv_freq` of a rope type, each frequency computed in binary64 and rounded once to f32.
pub fn inv_freq_scaled(base: f64, d: usize, scaling: RopeScaling) -> Vec<f32> {
    (0..d.div_ceil(2))
        .map(|i| {
            let f = 1.0f64 / base.powf((2 * i) as f64 / d as f64);
            let scaled = match scaling {
                RopeScaling::Default => f,
                RopeScaling::Linear { factor } => f / factor,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor: low,
                    high_freq_factor: high,
                    original_max_position_embeddings: old,
                } => {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < old / high {
                        f
                    } else if wavelen > old / low {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                }
            };
            scaled as f32
        })
        .collect()
}

impl Rope {
    pub fn new(base: f64, d: usize, positions: &[i64]) -> Rope {
        Rope::scaled(base, d, RopeScaling::Default, positions)
    }

    pub fn scaled(base: f64, d: usize, scaling: RopeScaling, positions: &[i64]) -> Rope {
        Rope::from_inv_freq(&inv_freq_scaled(base, d, scaling), positions)
    }

    /// §7's tables for given frequencies (half = their count): diffusion Gemma's proportional
    /// RoPE zeroes the tail of §7's frequencies (DG4.2) and rotates the whole head.
    pub fn from_inv_freq(inv: &[f32], positions: &[i64]) -> Rope {
        let half = inv.len();
        let mut cos = Vec::with_capacity(positions.len() * half);
        let mut sin = Vec::with_capacity(positions.len() * half);
        for &p in positions {
            for &f in inv {
                let angle = (p as f32) * f;
                cos.push((angle as f64).cos() as f32);
                sin.push((angle as f64).sin() as f32);
            }
        }
        Rope { half, cos, sin }
    }

    /// Rotate one head vector in place with the tables of row `row` ("rotate half" pairing);
    /// `x` holds at least 2·half dims (the config's check, §16), the rest are left alone.
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

/// §8.3–§8.7 with a visibility rule of the caller's (`visible(r, c)`: key c for query row r),
/// otherwise `attention_ref`: scores `dot ⊗ scale`, §8.6 softmax over the visible keys in key
/// order, §8.7 weighted sum ascending. Heads on the rayon pool (each head's arithmetic is the same
/// whichever thread runs it). Returns `o` `[T, nq, d]` and the probabilities `[nq, T, S]`
/// (masked entries +0.0). Diffusion Gemma's bidirectional and windowed masks (DG6).
pub fn attention_masked(
    q: &[f32],
    t: usize,
    keys: &KeyRows,
    hs: Heads,
    scale: f32,
    visible: &(dyn Fn(usize, usize) -> bool + Sync),
) -> (Vec<f32>, Vec<f32>) {
    let (s_len, d) = (keys.pos.len(), hs.d);
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..hs.nq)
        .into_par_iter()
        .map(|hq| {
            let hk = hq / (hs.nq / hs.nkv); // §8.3
            let mut o = vec![0.0f32; t * d];
            let mut probs = vec![0.0f32; t * s_len];
            let mut s = vec![0.0f32; s_len];
            for r in 0..t {
                let qv = &q[(r * hs.nq + hq) * d..(r * hs.nq + hq + 1) * d];
                for c in 0..s_len {
                    let kv = &keys.k[(c * hs.nkv + hk) * d..(c * hs.nkv + hk + 1) * d];
                    s[c] = if visible(r, c) {
                        dot(qv, kv) * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                let p = &mut probs[r * s_len..(r + 1) * s_len];
                softmax(&s, |c| visible(r, c), p);
                let orow = &mut o[r * d..(r + 1) * d];
                for c in (0..s_len).filter(|&c| visible(r, c)) {
                    let vv = &keys.v[(c * hs.nkv + hk) * d..(c * hs.nkv + hk + 1) * d];
                    for j in 0..d {
                        orow[j] += p[c] * vv[j];
                    }
                }
            }
            (o, probs)
        })
        .collect();
    let mut o = vec![0.0f32; t * hs.nq * d];
    for (hq, (oh, _)) in per_head.iter().enumerate() {
        for r in 0..t {
            o[(r * hs.nq + hq) * d..(r * hs.nq + hq + 1) * d]
                .copy_from_slice(&oh[r * d..(r + 1) * d]);
        }
    }
    let probs = per_head.into_iter().flat_map(|(_, p)| p).collect();
    (o, probs)
}

/// Query rows per block: their scores share each loaded key column and their P·V each loaded
/// value row (4 rows × 64 lanes are 16 zmm accumulators on AVX-512).
const RB: usize = 4;

/// The fast path exactly as written (`PLANT_*`: test-only faults for the negative control).
pub(super) const PLANT_NONE: u8 = 0;
/// Every score's dot summed as two halves of the head dimension, then added (split-K).
pub(super) const PLANT_SPLIT: u8 = 1;
/// P·V's multiply and add fused (`mul_add`: one rounding).
pub(super) const PLANT_FMA: u8 = 2;
/// The softmax's sums of rows with sorted keys taken c descending.
pub(super) const PLANT_SUM_ORDER: u8 = 3;

/// §8.3–§8.7, fast: `attention_ref` with heads spread over the rayon pool and, per head, query
/// rows in blocks of RB (the last rows one at a time). Keys are transposed per head (`kt[j][c]`), so one vector holds one
/// dimension of 16 (AVX-512) / 8 (AVX2) keys and those keys' dots advance together, each still
/// its own ordered `dot`; P·V advances a vector of the value dimension per step, c ascending.
/// Every (head, row, output) does the same operations in the same order as the definition, so
/// the bits are equal (tested for every kernel family). `probs` is empty unless `want_probs`.
pub fn attention(
    q: &[f32],
    q_pos: &[i64],
    keys: &KeyRows,
    hs: Heads,
    scale: f32,
    want_probs: bool,
) -> (Vec<f32>, Vec<f32>) {
    let job = Job {
        q,
        q_pos,
        keys,
        hs,
        scale,
    };
    attention_with::<PLANT_NONE>(Kernel::detect(), &job, want_probs)
}

/// One attention's inputs (the arguments of `attention`).
pub(super) struct Job<'a> {
    pub q: &'a [f32],
    pub q_pos: &'a [i64],
    pub keys: &'a KeyRows<'a>,
    pub hs: Heads,
    pub scale: f32,
}

/// `attention` on a given kernel family (tests run every family the CPU has).
pub(super) fn attention_with<const PLANT: u8>(
    kernel: Kernel,
    job: &Job,
    want_probs: bool,
) -> (Vec<f32>, Vec<f32>) {
    assert!(
        kernel.supported(),
        "{kernel:?} kernels need CPU features this CPU lacks"
    );
    let (t, tk, d, nq) = (job.q_pos.len(), job.keys.pos.len(), job.hs.d, job.hs.nq);
    // Heads are independent; each head's arithmetic is the same whichever thread runs it.
    let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..nq)
        .into_par_iter()
        .map(|hq| {
            let mut o = vec![0.0f32; t * d];
            let mut probs = vec![0.0f32; if want_probs { t * tk } else { 0 }];
            head::<PLANT>(kernel, job, hq, &mut o, &mut probs);
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

/// Key columns are padded to a multiple of this (the widest family's score block).
const KPAD: usize = 64;

/// One query head over all rows: `o` `[T, d]`, `probs` `[T, S]` (or empty). Blocks of RB rows,
/// the last rows one at a time.
fn head<const PLANT: u8>(kernel: Kernel, job: &Job, hq: usize, o: &mut [f32], probs: &mut [f32]) {
    let (t, tk, d) = (job.q_pos.len(), job.keys.pos.len(), job.hs.d);
    // §8.3 the head's kv head; its keys transposed to `kt[j][c]`, columns padded with zeros to
    // a multiple of KPAD.
    let hk = hq / (job.hs.nq / job.hs.nkv);
    let tkp = tk.div_ceil(KPAD) * KPAD;
    // Keys in position order (every cache this engine builds): row i then sees exactly the keys
    // before the first one past its position.
    let sorted = job.keys.pos.is_sorted();
    let mut kt = Lines::zeros(d * tkp);
    for c in 0..tk {
        let kr = &job.keys.k[(c * job.hs.nkv + hk) * d..][..d];
        for (j, &kj) in kr.iter().enumerate() {
            kt[j * tkp + c] = kj;
        }
    }
    // Scores, then probabilities, of the block's rows (row i at `s[i * tkp..]`).
    let mut s = Lines::zeros(RB * tkp);
    let mut r0 = 0;
    while r0 < t {
        let b = Block {
            kernel,
            job,
            hq,
            hk,
            r0,
            kt: &kt,
            tkp,
            sorted,
        };
        if r0 + RB <= t {
            b.run::<RB, PLANT>(&mut s, &mut o[r0 * d..(r0 + RB) * d], probs);
            r0 += RB;
        } else {
            b.run::<1, PLANT>(&mut s, &mut o[r0 * d..(r0 + 1) * d], probs);
            r0 += 1;
        }
    }
}

/// Rows `r0..r0+R` of one head.
struct Block<'a> {
    kernel: Kernel,
    job: &'a Job<'a>,
    hq: usize,
    hk: usize,
    r0: usize,
    kt: &'a [f32],
    tkp: usize,
    /// `keys.pos` is ascending: each row's visible keys are a prefix.
    sorted: bool,
}

impl Block<'_> {
    /// Scores, softmax and P·V of R rows; `o` holds their outputs `[R, d]`, `probs` all rows'.
    fn run<const R: usize, const PLANT: u8>(
        &self,
        s: &mut [f32],
        o: &mut [f32],
        probs: &mut [f32],
    ) {
        let Job {
            q,
            q_pos,
            keys,
            hs,
            scale,
        } = *self.job;
        let (tk, d, tkp) = (keys.pos.len(), hs.d, self.tkp);
        let qp: [i64; R] = std::array::from_fn(|i| q_pos[self.r0 + i]);
        // Keys past a row's last visible one are not needed (they become -inf, then +0).
        let cend: [usize; R] = std::array::from_fn(|i| match self.sorted {
            true => keys.pos.partition_point(|&p| p <= qp[i]),
            false => (0..tk)
                .rev()
                .find(|&c| keys.pos[c] <= qp[i])
                .map_or(0, |c| c + 1),
        });
        let cmax = cend.iter().copied().max().unwrap_or(0);
        // The block's query rows interleaved, `qk[j * R + i] = q_i[j]`: one base for the loads.
        let mut qk = vec![0.0f32; d * R];
        for i in 0..R {
            let qi = &q[((self.r0 + i) * hs.nq + self.hq) * d..][..d];
            for (j, &x) in qi.iter().enumerate() {
                qk[j * R + i] = x;
            }
        }
        scores::<R, PLANT>(self.kernel, &qk, self.kt, tkp, cmax, s);
        // §8.4 scale and mask, §8.6 softmax: each row its own ordered sum. `all_visible`: the
        // keys every row of the block sees.
        let mut all_visible = cmax;
        if self.sorted {
            softmax_prefix_rows::<R, PLANT>(s, tkp, &cend, scale);
            all_visible = cend.iter().copied().min().unwrap_or(0);
        } else {
            for i in 0..R {
                let (ce, pos) = (cend[i], &keys.pos[..cend[i]]);
                let sr = &mut s[i * tkp..i * tkp + ce];
                for (v, &p) in sr.iter_mut().zip(pos) {
                    *v = if p <= qp[i] {
                        *v * scale
                    } else {
                        f32::NEG_INFINITY
                    };
                }
                softmax_row(sr, pos, qp[i]);
                all_visible = all_visible.min(pos.iter().position(|&p| p > qp[i]).unwrap_or(ce));
            }
        }
        if !probs.is_empty() {
            for (i, &ce) in cend.iter().enumerate() {
                probs[(self.r0 + i) * tk..][..ce].copy_from_slice(&s[i * tkp..][..ce]);
            }
        }
        // §8.7 P·V: keys every row sees, all rows together; then each row's own rest, c ascending.
        let (vstride, voff) = (hs.nkv * d, self.hk * d);
        // The shared keys' probabilities interleaved, `pk[c * R + i] = p_i[c]`: one base.
        let mut pk = vec![0.0f32; all_visible * R];
        for i in 0..R {
            for (c, &pc) in s[i * tkp..][..all_visible].iter().enumerate() {
                pk[c * R + i] = pc;
            }
        }
        pv::<R, PLANT>(self.kernel, &pk, &keys.v[voff..], vstride, o, d);
        for i in 0..R {
            let orow = &mut o[i * d..(i + 1) * d];
            for c in all_visible..cend[i] {
                if keys.pos[c] <= qp[i] {
                    let (pc, vv) = (s[i * tkp + c], &keys.v[c * vstride + voff..][..d]);
                    for (oj, &vj) in orow.iter_mut().zip(vv) {
                        *oj += pc * vj;
                    }
                }
            }
        }
    }
}

// The two kernels, the same generic loops compiled for each family's vectors (the compiler
// may not fuse, and does not: Rust never contracts `a * b + c`): scores N keys per block (NS
// for the last ones), P·V DJ value lanes per block (then 8, then 1). Only these are compiled
// per family (the softmax's exponentials are `exp_shifted`'s, vectorised on their own): a whole
// head body per family tripled the crate's build time.

/// `s[i][c] = dot(q_i, column c of kt)` for the R rows of `qk` and every column below `cmax`
/// rounded up to the family's small block (at most `tkp`).
fn scores<const R: usize, const PLANT: u8>(
    kernel: Kernel,
    qk: &[f32],
    kt: &[f32],
    tkp: usize,
    cmax: usize,
    s: &mut [f32],
) {
    match kernel {
        // SAFETY: `attention_with` asserted the CPU supports the family.
        Kernel::Avx512 => unsafe { scores_avx512::<R, PLANT>(qk, kt, tkp, cmax, s) },
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { scores_avx2::<R, PLANT>(qk, kt, tkp, cmax, s) },
        Kernel::Portable => scores_generic::<R, 8, 8, PLANT>(qk, kt, tkp, cmax, s),
    }
}

/// `o[i][j] = Σ_c pk[c * R + i] ⊗ v[c * vstride + j]` for the R rows and every j < d.
fn pv<const R: usize, const PLANT: u8>(
    kernel: Kernel,
    pk: &[f32],
    v: &[f32],
    vstride: usize,
    o: &mut [f32],
    d: usize,
) {
    match kernel {
        // SAFETY: `attention_with` asserted the CPU supports the family.
        Kernel::Avx512 => unsafe { pv_avx512::<R, PLANT>(pk, v, vstride, o, d) },
        // SAFETY: as above.
        Kernel::Avx2 => unsafe { pv_avx2::<R, PLANT>(pk, v, vstride, o, d) },
        Kernel::Portable => pv_generic::<R, 8, PLANT>(pk, v, vstride, o, d),
    }
}

/// One kernel compiled for one family: the family's widths under its `target_feature` on
/// x86_64; elsewhere the baseline widths (never called there: `Kernel::supported` is false).
macro_rules! family_kernel {
    ($name:ident, $feat:literal, $generic:ident, [$($w:literal),+], [$($bw:literal),+],
     ($($arg:ident: $ty:ty),*)) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feat)]
        unsafe fn $name<const R: usize, const PLANT: u8>($($arg: $ty),*) {
            $generic::<R, $($w,)+ PLANT>($($arg),*)
        }
        #[cfg(not(target_arch = "x86_64"))]
        unsafe fn $name<const R: usize, const PLANT: u8>($($arg: $ty),*) {
            $generic::<R, $($bw,)+ PLANT>($($arg),*)
        }
    };
}

#[rustfmt::skip]
family_kernel!(scores_avx512, "avx512f", scores_generic, [64, 16], [8, 8],
               (qk: &[f32], kt: &[f32], tkp: usize, cmax: usize, s: &mut [f32]));
#[rustfmt::skip]
family_kernel!(scores_avx2, "avx2", scores_generic, [16, 8], [8, 8],
               (qk: &[f32], kt: &[f32], tkp: usize, cmax: usize, s: &mut [f32]));
#[rustfmt::skip]
family_kernel!(pv_avx512, "avx512f", pv_generic, [64], [8],
               (pk: &[f32], v: &[f32], vstride: usize, o: &mut [f32], d: usize));
#[rustfmt::skip]
family_kernel!(pv_avx2, "avx2", pv_generic, [16], [8],
               (pk: &[f32], v: &[f32], vstride: usize, o: &mut [f32], d: usize));

#[inline(always)]
fn scores_generic<const R: usize, const N: usize, const NS: usize, const PLANT: u8>(
    qk: &[f32],
    kt: &[f32],
    tkp: usize,
    cmax: usize,
    s: &mut [f32],
) {
    let (cpad, mut c0) = (cmax.div_ceil(NS) * NS, 0);
    while c0 + N <= cpad {
        score_cols::<R, N, PLANT>(qk, kt, tkp, c0, s);
        c0 += N;
    }
    while c0 < cpad {
        score_cols::<R, NS, PLANT>(qk, kt, tkp, c0, s);
        c0 += NS;
    }
}

#[inline(always)]
fn pv_generic<const R: usize, const DJ: usize, const PLANT: u8>(
    pk: &[f32],
    v: &[f32],
    vstride: usize,
    o: &mut [f32],
    d: usize,
) {
    let mut j0 = 0;
    while j0 + DJ <= d {
        pv_cols::<R, DJ, PLANT>(pk, &v[j0..], vstride, &mut o[j0..], d);
        j0 += DJ;
    }
    while j0 + 8 <= d {
        pv_cols::<R, 8, PLANT>(pk, &v[j0..], vstride, &mut o[j0..], d);
        j0 += 8;
    }
    while j0 < d {
        pv_cols::<R, 1, PLANT>(pk, &v[j0..], vstride, &mut o[j0..], d);
        j0 += 1;
    }
}

/// `s[i][c0..c0+W] = dot(q_i, column c of kt)` for the R rows of `qk` (`qk[j * R + i]`): per
/// column j ascending from +0.0, one rounded multiply then one rounded add (the planted split
/// aside).
#[inline(always)]
fn score_cols<const R: usize, const W: usize, const PLANT: u8>(
    qk: &[f32],
    kt: &[f32],
    tkp: usize,
    c0: usize,
    s: &mut [f32],
) {
    let d = qk.len() / R;
    let half = if PLANT == PLANT_SPLIT { d / 2 } else { d };
    let mut acc = [[0.0f32; W]; R];
    for j in 0..half {
        score_step(&mut acc, qk, kt, tkp, c0, j);
    }
    if PLANT == PLANT_SPLIT {
        let mut hi = [[0.0f32; W]; R];
        for j in half..d {
            score_step(&mut hi, qk, kt, tkp, c0, j);
        }
        for (a, h) in acc.iter_mut().zip(&hi) {
            for (ai, &hv) in a.iter_mut().zip(h) {
                *ai += hv;
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        s[i * tkp + c0..][..W].copy_from_slice(a);
    }
}

/// One step j of `score_cols`: `acc[i][c] ⊕= q_i[j] ⊗ kt[j][c0 + c]`. A function, not a
/// closure, so that it is inlined into the family's `target_feature` body: a closure there was
/// compiled on its own, at the baseline's 128-bit width with the accumulators in memory.
#[inline(always)]
fn score_step<const R: usize, const W: usize>(
    acc: &mut [[f32; W]; R],
    qk: &[f32],
    kt: &[f32],
    tkp: usize,
    c0: usize,
    j: usize,
) {
    let col: &[f32; W] = kt[j * tkp + c0..][..W].try_into().expect("W lanes");
    let xs: &[f32; R] = qk[j * R..][..R].try_into().expect("R rows");
    for (a, &x) in acc.iter_mut().zip(xs) {
        for (ai, &ki) in a.iter_mut().zip(col) {
            *ai += x * ki;
        }
    }
}

/// §8.6 on one row's first `ce` scores (masked ones already -inf): `softmax` with the max taken
/// lane-wise. `>` keeps the first of equal values in each lane and the lanes are then combined by
/// `>` too, so the result is the definition's max up to the sign of a zero max, which no `s ⊖ m`
/// can tell (`±0 ⊖ ±0` is ±0 and `f32(exp(±0))` is 1); -inf and NaN never win a `>`.
fn softmax_row(s: &mut [f32], pos: &[i64], qp: i64) {
    // Every entry's f32(E(s ⊖ m)) (vectorised; a masked -inf gives +0), then the ordered sum of
    // the visible ones with the masked set to +0.
    exp_shifted(s, row_max(s));
    let mut z = 0.0f32;
    for (v, &p) in s.iter_mut().zip(pos) {
        if p <= qp {
            z += *v;
        } else {
            *v = 0.0;
        }
    }
    for (v, &p) in s.iter_mut().zip(pos) {
        *v = if p <= qp { *v / z } else { 0.0 };
    }
}

/// The definition's max of `s`, taken lane-wise (`softmax_row` says why that is the same).
fn row_max(s: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = s.chunks_exact(16);
    let rest = chunks.remainder();
    for ch in chunks {
        for (m, &v) in lanes.iter_mut().zip(ch) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut m = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(rest) {
        if v > m {
            m = v;
        }
    }
    m
}

/// §8.4 and §8.6 for R rows (row i at `s[i * tkp..]`) that see exactly their first `cend[i]`
/// keys: scale, then `softmax_row` with nothing masked. The rows' ordered sums advance together
/// (R independent add chains; one row's chain alone is bound by the add latency), each still
/// from +0.0 with c ascending.
fn softmax_prefix_rows<const R: usize, const PLANT: u8>(
    s: &mut [f32],
    tkp: usize,
    cend: &[usize; R],
    scale: f32,
) {
    for (i, &ce) in cend.iter().enumerate() {
        let sr = &mut s[i * tkp..][..ce];
        for v in sr.iter_mut() {
            *v *= scale;
        }
        exp_shifted(sr, row_max(sr));
    }
    let mut z = [0.0f32; R];
    if PLANT == PLANT_SUM_ORDER {
        for (i, zi) in z.iter_mut().enumerate() {
            *zi = s[i * tkp..][..cend[i]]
                .iter()
                .rev()
                .fold(0.0, |a, &v| a + v);
        }
    } else {
        let common = cend.iter().copied().min().unwrap_or(0);
        for c in 0..common {
            for (i, zi) in z.iter_mut().enumerate() {
                *zi += s[i * tkp + c];
            }
        }
        for (i, zi) in z.iter_mut().enumerate() {
            for &v in &s[i * tkp..][common..cend[i]] {
                *zi += v;
            }
        }
    }
    for (i, &ce) in cend.iter().enumerate() {
        for v in s[i * tkp..][..ce].iter_mut() {
            *v /= z[i];
        }
    }
}

/// `o[i * d..][..W] = Σ_c pk[c * R + i] ⊗ v[c * vstride..][..W]` over the keys of `pk`, c
/// ascending from +0.0, one rounded multiply then one rounded add (the planted FMA aside): the
/// R rows share each value load.
#[inline(always)]
fn pv_cols<const R: usize, const W: usize, const PLANT: u8>(
    pk: &[f32],
    v: &[f32],
    vstride: usize,
    o: &mut [f32],
    d: usize,
) {
    let mut acc = [[0.0f32; W]; R];
    for (ps, vc) in pk.chunks_exact(R).zip(v.chunks(vstride)) {
        let vr: &[f32; W] = vc[..W].try_into().expect("W lanes");
        for (a, &pc) in acc.iter_mut().zip(ps) {
            for (ai, &vj) in a.iter_mut().zip(vr) {
                *ai = if PLANT == PLANT_FMA {
                    pc.mul_add(vj, *ai)
                } else {
                    *ai + pc * vj
                };
            }
        }
    }
    for (i, a) in acc.iter().enumerate() {
        o[i * d..][..W].copy_from_slice(a);
    }
}
