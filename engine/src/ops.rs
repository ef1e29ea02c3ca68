//! Ordered fp32 kernels, each the written definition of docs/numerics.md (section numbers in the
//! comments). Rust never contracts `a * b + c` into an FMA, so every `+`/`*` below is one rounded
//! IEEE operation. Two operations have a fast path, each tested bit for bit against its
//! definition: `matmul` (tiled, AVX2/AVX-512, in `crate::matmul`, re-exported here) against
//! `matmul_ref`, and `attention` (threaded over heads, scores through `dots_transposed`, also in
//! `crate::matmul`) against `attention_ref`. Names follow docs/numerics.md §14, the same as the
//! contract's ops.py.

use rayon::prelude::*;

pub use crate::matmul::{dots_transposed, matmul};
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
    matmul_ref_by(x, rows, w, bias, dot)
}

/// `matmul_ref` with `dot` replaced (tests plant other orders with it to show they are caught).
pub fn matmul_ref_by(
    x: &[f32],
    rows: usize,
    w: Mat,
    bias: Option<&[f32]>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
) -> Vec<f32> {
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

/// §6 RMSNorm of one vector.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for i in 0..x.len() {
        out[i] = w[i] * (x[i] * inv);
    }
}

/// §15.1 zero-centred RMSNorm of one vector (Qwen3.5): §6's `inv`, then
/// `(x[i] ⊗ inv) ⊗ (1 ⊕ w[i])`.
pub fn rmsnorm_zero_centred(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for i in 0..x.len() {
        out[i] = (x[i] * inv) * (1.0 + w[i]);
    }
}

/// §6's `1 ⊘ sqrt(mean(x²) ⊕ eps)`, the mean an ordered sum of squares divided by n.
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let mut ss = 0.0f32;
    for &v in x {
        ss += v * v;
    }
    let mean = ss / x.len() as f32;
    1.0f32 / (mean + eps).sqrt()
}

/// §15.2 gated RMSNorm (Qwen3.5's linear-attention output norm): §6 with the plain weight,
/// then times `silu(z[i])`.
pub fn gated_rmsnorm(x: &[f32], w: &[f32], z: &[f32], eps: f32, out: &mut [f32]) {
    rmsnorm(x, w, eps, out);
    for i in 0..x.len() {
        out[i] *= silu(z[i]);
    }
}

/// §18.3 L2 normalisation of one vector with transformers' fixed `1e-6`:
/// `x[i] ⊗ (1 ⊘ sqrt(Σ x² ⊕ 1e-6))`, the sum ordered.
pub fn l2norm(x: &[f32], out: &mut [f32]) {
    let mut ss = 0.0f32;
    for &v in x {
        ss += v * v;
    }
    let inv = 1.0f32 / (ss + 1e-6f32).sqrt();
    for i in 0..x.len() {
        out[i] = x[i] * inv;
    }
}

/// §18.4 PyTorch's softplus (beta 1, threshold 20): `u` above 20, else
/// `f32(log1p(E(u)))` in binary64 with libm's exp and log1p. NaN takes the second branch.
pub fn softplus(u: f32) -> f32 {
    if u > 20.0 {
        u
    } else {
        (u as f64).exp().ln_1p() as f32
    }
}

/// §18.4 one value head's decay for one row: `g = (−f32(E(A_log))) ⊗ softplus(a ⊕ dt_bias)`
/// (≤ 0, captured as `linear.g`) and the factor `alpha = f32(E(g))` the state is scaled by.
pub fn gdn_decay(a: f32, dt_bias: f32, a_log: f32) -> (f32, f32) {
    let sp = softplus(a + dt_bias);
    let g = -exp_to_f32(a_log) * sp;
    (g, exp_to_f32(g))
}

/// §18.2 causal depthwise conv1d + SiLU of one row, updating the conv state. `state` holds
/// each channel's K−1 previous pre-conv values, oldest first (`[conv_dim, K−1]`, channel-major);
/// `w` is `conv1d.weight` as `[conv_dim, K]`; `mixed` the row's pre-conv values. Every channel:
/// `acc = Σ_j win[j] ⊗ w[c, j]` over the window (state, then this row) from +0.0 in j order, the
/// output `silu(acc)`; then the window, less its oldest value, becomes the state.
pub fn causal_conv1d(mixed: &[f32], w: &[f32], k: usize, state: &mut [f32], out: &mut [f32]) {
    let keep = k - 1;
    for c in 0..mixed.len() {
        let st = &mut state[c * keep..(c + 1) * keep];
        let wc = &w[c * k..(c + 1) * k];
        let mut acc = 0.0f32;
        for j in 0..keep {
            acc += st[j] * wc[j];
        }
        acc += mixed[c] * wc[keep];
        out[c] = silu(acc);
        if keep > 0 {
            st.copy_within(1.., 0);
            st[keep - 1] = mixed[c];
        }
    }
}

/// §18.5 the delta rule for one row and one value head, on its state `s` (`[dk, dv]`,
/// row-major): decay by `alpha`, read `mem = Sᵀk`, `d = (v ⊖ mem) ⊗ beta`, write `S ⊕= k dᵀ`,
/// then `out = Sᵀq` (the query already scaled); every sum over i ascending from +0.0.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: f32,
    beta: f32,
    mem: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    for x in s.iter_mut() {
        *x *= alpha;
    }
    mem.fill(0.0);
    for i in 0..dk {
        for j in 0..dv {
            mem[j] += s[i * dv + j] * k[i];
        }
    }
    for j in 0..dv {
        mem[j] = (v[j] - mem[j]) * beta; // d[j], in mem's place
    }
    for i in 0..dk {
        for j in 0..dv {
            s[i * dv + j] += k[i] * mem[j];
        }
    }
    out.fill(0.0);
    for i in 0..dk {
        for j in 0..dv {
            out[j] += s[i * dv + j] * q[i];
        }
    }
}

/// §6 RMSNorm (or, `zero_centred`, §15.1's) of every `n`-wide row of `x`.
pub fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, zero_centred: bool) -> Vec<f32> {
    let n = w.len();
    let mut out = vec![0.0f32; x.len()];
    // Rows are independent; each row's arithmetic is the same whichever thread runs it.
    out.par_chunks_exact_mut(n)
        .zip(x.par_chunks_exact(n))
        .for_each(|(or, xr)| match zero_centred {
            false => rmsnorm(xr, w, eps, or),
            true => rmsnorm_zero_centred(xr, w, eps, or),
        });
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

// The speed-up of attention: scores SC at a time through `dots_transposed` (crate::matmul),
// each lane its own ordered `dot`.

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
    use crate::matmul::tests::{note_unchecked_kernels, vals};

    #[test]
    fn attention_fast_equals_definition_bits() {
        note_unchecked_kernels("attention_fast_equals_definition_bits");
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
    fn rmsnorm_zero_centred_and_gated_hand_cases() {
        // §15.1: x = [3, 4], w = [0, 1]: u = [1, 2], y = (x ⊗ inv) ⊗ u.
        let eps = 1e-6f32;
        let inv = 1.0f32 / (12.5f32 + eps).sqrt();
        let mut out = [0.0f32; 2];
        rmsnorm_zero_centred(&[3.0, 4.0], &[0.0, 1.0], eps, &mut out);
        assert_eq!(out, [3.0 * inv, (4.0 * inv) * 2.0]);
        // Control: the plain norm with the same stored weight is another function.
        let mut plain = [0.0f32; 2];
        rmsnorm(&[3.0, 4.0], &[0.0, 1.0], eps, &mut plain);
        assert_ne!(plain, out);
        // §15.2: plain weight, then times silu(z); silu(0) = 0 zeroes its element.
        gated_rmsnorm(&[3.0, 4.0], &[1.0, 2.0], &[0.0, 2.0], eps, &mut out);
        let sig2 = (1.0f64 / (1.0 + (-2.0f64).exp())) as f32;
        assert_eq!(out, [0.0, (2.0 * (4.0 * inv)) * (2.0 * sig2)]);
    }

    #[test]
    fn l2norm_uses_the_fixed_epsilon() {
        // §18.3 on a small vector, where the epsilon shows: t = ss ⊕ f32(1e-6), ordered ss.
        let x = [3e-4f32, 4e-4];
        let mut out = [0.0f32; 2];
        l2norm(&x, &mut out);
        let ss = (0.0f32 + x[0] * x[0]) + x[1] * x[1];
        let inv = 1.0f32 / (ss + 1e-6f32).sqrt();
        assert_eq!(out, [x[0] * inv, x[1] * inv]);
        // Control: without the epsilon (or with rms_norm_eps 1e-5) the result is another one.
        for eps in [0.0f32, 1e-5] {
            let inv = 1.0f32 / (ss + eps).sqrt();
            assert_ne!(out, [x[0] * inv, x[1] * inv]);
        }
    }

    #[test]
    fn softplus_threshold_and_decay() {
        // §18.4: above 20 the input itself; at 20 and below libm's log1p(exp(u)) in binary64.
        assert_eq!(softplus(21.0), 21.0);
        assert_eq!(softplus(20.0), (20.0f64.exp().ln_1p()) as f32);
        // Control: the threshold keeps a large input finite where log1p(exp(u)) overflows.
        assert_eq!(softplus(1000.0), 1000.0);
        assert!((1000.0f64.exp().ln_1p() as f32).is_infinite());
        assert_eq!(softplus(0.0), std::f64::consts::LN_2 as f32);
        assert_eq!(softplus(f32::NEG_INFINITY), 0.0);
        assert!(softplus(f32::NAN).is_nan());
        // g = (−f32(E(A_log))) ⊗ softplus(a ⊕ dt_bias); alpha = f32(E(g)).
        let (g, alpha) = gdn_decay(0.5, 0.25, 0.0);
        let sp = (0.75f64.exp().ln_1p()) as f32;
        assert_eq!(g, -sp);
        assert_eq!(alpha, ((g as f64).exp()) as f32);
        let (g2, _) = gdn_decay(0.5, 0.25, std::f32::consts::LN_2);
        assert_eq!(g2, -(((std::f32::consts::LN_2 as f64).exp()) as f32) * sp);
        assert!(g2 < g && g < 0.0);
    }

    #[test]
    fn causal_conv1d_reads_the_state_then_the_row() {
        // §18.2, K = 3, two channels (taps [1, 2, 3] and [0.5, 0, -1]), rows 1, 10, 100 and 2, 4, 8.
        let w = [1.0f32, 2.0, 3.0, 0.5, 0.0, -1.0];
        let mut state = [0.0f32; 4]; // [conv_dim 2, K-1 2], zeros before position 0
        let mut out = [0.0f32; 2];
        let rows = [[1.0f32, 2.0], [10.0, 4.0], [100.0, 8.0]];
        // acc, row t, channel 0: Σ win[j] ⊗ w[j] with win = (state, row).
        let want0 = [3.0f32, 2.0 + 30.0, 1.0 + 20.0 + 300.0];
        let want1 = [-2.0f32, -4.0, 1.0 + 0.0 - 8.0];
        for (t, row) in rows.iter().enumerate() {
            causal_conv1d(row, &w, 3, &mut state, &mut out);
            assert_eq!(out, [silu(want0[t]), silu(want1[t])], "row {t}");
        }
        assert_eq!(state, [10.0, 100.0, 4.0, 8.0]);
        // K = 1: no state, the row times its one tap.
        causal_conv1d(&[2.0], &[3.0], 1, &mut [], &mut out[..1]);
        assert_eq!(out[0], silu(6.0));
    }

    #[test]
    fn delta_rule_step_hand_case() {
        // §18.5, dk = dv = 2, S = [[1, 2], [3, 4]] (i rows, j columns): every value exact.
        let mut s = [1.0f32, 2.0, 3.0, 4.0];
        let (mut mem, mut out) = ([9.0f32; 2], [9.0f32; 2]);
        delta_rule_step(
            &mut s,
            &[1.0, 1.0],
            &[1.0, 0.0],
            &[2.0, 3.0],
            0.5,
            0.5,
            &mut mem,
            &mut out,
        );
        // decay: [[.5, 1], [1.5, 2]]; mem = [.5, 1]; d = [(2 − .5)·.5, (3 − 1)·.5] = [.75, 1];
        // write row 0 (k = [1, 0]): [[1.25, 2], [1.5, 2]]; out = S₀ + S₁ = [2.75, 4].
        assert_eq!(s, [1.25, 2.0, 1.5, 2.0]);
        assert_eq!(out, [2.75, 4.0]);
        // Control: the output reads the state after the write (before it, out would be [2, 3]).
        assert_ne!(out, [2.0, 3.0]);
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
