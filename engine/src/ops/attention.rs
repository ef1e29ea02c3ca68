//! §7 RoPE and §8 attention: the definition (`attention_ref`) and its threaded, column-dot fast
//! path (`attention`), bit-equal (tested in `ops`'s tests).

use rayon::prelude::*;

use super::{dot, dots_transposed, softmax};

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
