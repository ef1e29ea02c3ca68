//! §8 softmax attention over the cached keys; §17 (Qwen3.5) its gated form, `q_proj` holding
//! each head's query then its output gate; §16 partial rotation through the config's rotary dims.

use tracegate_trace::names;

use crate::capture::Capture;
use crate::config::Config;
use crate::model::norm::Norm;
use crate::model::{vec_part, weight_part, LayerKv, Rank};
use crate::ops::{self, Rope};
use crate::weights::{Store, Weight};
use crate::Result;

struct Linear<'a> {
    w: Weight<'a>,
    b: Option<Vec<f32>>,
    /// Row-parallel (§23.3): this rank holds columns of W, the sum is carried over the ranks.
    carry: Rank,
}

impl Linear<'_> {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        match &self.carry {
            None => ops::matmul(x, rows, self.w.view(rows), self.b.as_deref()),
            Some(c) => c.row_parallel(x, rows, self.w.view(rows), self.b.as_deref()),
        }
    }
}

/// Softmax attention (§8; Qwen3.5's §17 when `gated`: `q_proj` holds each head's query then its
/// output gate).
pub(crate) struct Attention<'a> {
    q: Linear<'a>,
    k: Linear<'a>,
    v: Linear<'a>,
    o: Linear<'a>,
    /// §8.2 per-head norms: the Qwen3 families (llama and qwen2 have none).
    qk_norm: Option<(Norm, Norm)>,
    gated: bool,
    /// The query and key/value heads held (§23.2: a rank's blocks; unsharded all of them).
    qh: std::ops::Range<usize>,
    kh: std::ops::Range<usize>,
    comm: Rank,
}

impl<'a> Attention<'a> {
    /// Takes the layer's tensors (`p` = `…layers.N.self_attn`).
    pub fn load(st: &'a Store, cfg: &Config, p: &str, comm: &Rank) -> Result<Attention<'a>> {
        let (h, d) = (cfg.hidden_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let gated = cfg.model_type.gated_attention();
        // §8.1: q, k, v carry `attention_bias`, o_proj `o_proj_bias` (qwen2: the first only).
        let qkv_bias = cfg.attention_bias;
        // §23.2: a rank's q, k, v are the rows of its heads (column-parallel), its o_proj the
        // columns of its query heads (row-parallel, the bias whole: added once by the last rank).
        let heads = |n: usize| comm.as_ref().map_or(0..n, |c| c.block(n));
        let (qh, kh) = (heads(nq), heads(nkv));
        let part = |b: &std::ops::Range<usize>, per: usize| {
            comm.as_ref().map(|_| b.start * per..b.end * per)
        };
        let lin = |name: &str,
                   out: usize,
                   inp: usize,
                   bias: bool,
                   rows: Option<std::ops::Range<usize>>,
                   cols: Option<std::ops::Range<usize>>|
         -> Result<Linear<'a>> {
            let w = weight_part(
                st,
                &format!("{p}.{name}.weight"),
                &[out, inp],
                rows.clone(),
                cols.clone(),
            )?;
            let b = if bias {
                Some(vec_part(st, &format!("{p}.{name}.bias"), out, rows)?)
            } else {
                None
            };
            let carry = cols.and(comm.clone());
            Ok(Linear { w, b, carry })
        };
        let qd = d * (1 + gated as usize);
        Ok(Attention {
            // §17: a gated q_proj holds each head's query and its gate.
            q: lin("q_proj", nq * qd, h, qkv_bias, part(&qh, qd), None)?,
            k: lin("k_proj", nkv * d, h, qkv_bias, part(&kh, d), None)?,
            v: lin("v_proj", nkv * d, h, qkv_bias, part(&kh, d), None)?,
            o: lin("o_proj", h, nq * d, cfg.o_proj_bias, None, part(&qh, d))?,
            qk_norm: if cfg.qk_norm {
                Some((
                    Norm::load(st, cfg, &format!("{p}.q_norm.weight"), d)?,
                    Norm::load(st, cfg, &format!("{p}.k_norm.weight"), d)?,
                ))
            } else {
                None
            },
            gated,
            qh,
            kh,
            comm: comm.clone(),
        })
    }

    /// Its matrices (`Model::pack_panels`).
    pub fn weights(&self) -> [&Weight<'a>; 4] {
        [&self.q.w, &self.k.w, &self.v.w, &self.o.w]
    }

    /// §8 (§17 when gated) attention of the new rows over `kv` ++ new rows; returns attn_out
    /// (after o_proj).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        l: usize,
        c: &Config,
        xn: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Vec<f32> {
        let lw = self;
        let (t, d, eps) = (pos.len(), c.head_dim, c.eps_f32());
        let (nq, nkv) = (lw.qh.len(), lw.kh.len());
        // §23.2 what a rank records of q, k, v, attn_gate (axis 1) and attn_probs (axis 0).
        let slice = |axis: usize, b: &std::ops::Range<usize>, n: usize| {
            lw.comm.as_ref().map(|cm| cm.slice(axis, b.clone(), n))
        };
        let (qs, ks) = (
            slice(1, &lw.qh, c.num_attention_heads),
            slice(1, &lw.kh, c.num_key_value_heads),
        );
        // §8.1 projections; §17.1 a gated q_proj's head h is [query | gate], d each.
        let (mut q, gate) = match lw.gated {
            false => (lw.q.apply(xn, t), None),
            true => {
                let qg = lw.q.apply(xn, t);
                let halves = |half: usize| -> Vec<f32> {
                    qg.chunks_exact(2 * d)
                        .flat_map(|hd| hd[half * d..(half + 1) * d].iter().copied())
                        .collect()
                };
                (halves(0), Some(halves(1)))
            }
        };
        let mut k = lw.k.apply(xn, t);
        let v = lw.v.apply(xn, t);
        // §8.2 q_norm / k_norm on every head vector (not llama, qwen2), then RoPE at the row's
        // position (§16: the leading rotary dims only).
        let norms = lw.qk_norm.as_ref();
        for (x, norm, heads) in [
            (&mut q, norms.map(|n| &n.0), nq),
            (&mut k, norms.map(|n| &n.1), nkv),
        ] {
            let mut normed = vec![0.0f32; d];
            for (i, head) in x.chunks_exact_mut(d).enumerate() {
                if let Some(norm) = norm {
                    norm.one(head, eps, &mut normed);
                    head.copy_from_slice(&normed);
                }
                rope.apply(i / heads, head);
            }
        }
        cap.internal_as(&names::layer(l, "q"), &[t, nq, d], &q, pos, qs.clone());
        cap.internal_as(&names::layer(l, "k"), &[t, nkv, d], &k, pos, ks.clone());
        cap.internal_as(&names::layer(l, "v"), &[t, nkv, d], &v, pos, ks);
        if let Some(g) = &gate {
            cap.internal_as(&names::layer(l, "attn_gate"), &[t, nq, d], g, pos, qs);
        }
        kv.k.extend_from_slice(&k);
        kv.v.extend_from_slice(&v);
        kv.pos.extend_from_slice(pos);
        // §8.3–§8.7 over the cached rows and these.
        let keys = ops::KeyRows {
            k: &kv.k,
            v: &kv.v,
            pos: &kv.pos,
        };
        let shape = ops::Heads { nq, nkv, d };
        // §8.4: scale = f32(1 / sqrt(d)) in binary64 (§22.3: Gemma 3's query_pre_attn_scalar).
        let scale = c.attn_scale();
        let (mut o, probs) = match c.window(l) {
            None => ops::attention(&q, pos, &keys, shape, scale, cap.internals()),
            // §22.3 a sliding layer: key c visible to row r iff p − W < pos[c] ≤ p.
            Some(w) => {
                let w = w as i64;
                let visible = |r: usize, c: usize| {
                    let (p, kp) = (pos[r], keys.pos[c]);
                    kp <= p && kp > p - w
                };
                ops::attention_masked(&q, t, &keys, shape, scale, &visible)
            }
        };
        if cap.internals() {
            let tk = kv.pos.len();
            let ps = slice(0, &lw.qh, c.num_attention_heads);
            cap.internal_as(
                &names::layer(l, "attn_probs"),
                &[nq, t, tk],
                &probs,
                pos,
                ps,
            );
        }
        // §17.3 the output gate, elementwise on o `[T, nq, d]`.
        if let Some(g) = &gate {
            for (x, &gi) in o.iter_mut().zip(g) {
                *x *= ops::sigmoid(gi);
            }
        }
        // §8.8
        lw.o.apply(&o, t)
    }
}
