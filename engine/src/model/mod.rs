//! Qwen3 and Qwen3-MoE (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`): the weights the config
//! (config.rs) requires, and the forward pass of docs/numerics.md §5–§11.
//! The two families differ only in the feed-forward block of some layers (dense MLP vs sparse
//! MoE), so one file covers both. Dense llama is Qwen3 without the per-head q/k norms, with an
//! optional MLP bias and a scaled rope (§7.1): config fields, not a file of its own. The Qwen3.5 families (§§15–20) run through the same model and
//! decoder layer: their pieces — the Gated DeltaNet mixer, the attention's output gate, the
//! shared expert, zero-centred norms — are in `qwen3_5.rs` and plug in where the layer differs.

use rayon::prelude::*;
use tracegate_trace::names;

use crate::aligned::Lines;
use crate::capture::Capture;
use crate::config::{check_sizes, Config, LayerKind};
use crate::force::Forcing;
use crate::ops::{self, Rope};
use crate::qwen3_5::{GatedDeltaNet, LinearState, SharedExpert};
use crate::weights::{Mat, Store, Weight};
use crate::{err, Result};

// ---------------------------------------------------------------------------------------------
// Weights

pub(crate) struct Mlp<'a> {
    pub gate: Weight<'a>,
    pub up: Weight<'a>,
    pub down: Weight<'a>,
    /// llama's `mlp_bias`: the gate, up and down biases.
    pub bias: Option<Box<[Vec<f32>; 3]>>,
}

impl<'a> Mlp<'a> {
    fn weights(&self) -> [&Weight<'a>; 3] {
        [&self.gate, &self.up, &self.down]
    }
}

enum Ffn<'a> {
    Dense(Box<Mlp<'a>>),
    /// Router `[E, H]`, the experts in id order, and Qwen3.5-MoE's shared expert (§19).
    Moe {
        router: Weight<'a>,
        experts: Vec<Mlp<'a>>,
        shared: Option<Box<SharedExpert<'a>>>,
    },
}

struct Linear<'a> {
    w: Weight<'a>,
    b: Option<Vec<f32>>,
}

impl Linear<'_> {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        ops::matmul(x, rows, self.w.view(rows), self.b.as_deref())
    }
}

/// An RMSNorm weight: §6's plain scale, or §15.1's zero-centred `1 ⊕ w` (Qwen3.5).
pub(crate) struct Norm {
    pub w: Vec<f32>,
    pub zero_centred: bool,
}

impl Norm {
    pub fn rows(&self, x: &[f32], eps: f32) -> Vec<f32> {
        ops::rmsnorm_rows(x, &self.w, eps, self.zero_centred)
    }
    pub fn one(&self, x: &[f32], eps: f32, out: &mut [f32]) {
        match self.zero_centred {
            false => ops::rmsnorm(x, &self.w, eps, out),
            true => ops::rmsnorm_zero_centred(x, &self.w, eps, out),
        }
    }
}

/// Softmax attention (§8; Qwen3.5's §17 when `gated`: `q_proj` holds each head's query then its
/// output gate).
struct Attention<'a> {
    q: Linear<'a>,
    k: Linear<'a>,
    v: Linear<'a>,
    o: Linear<'a>,
    /// §8.2 per-head norms: the Qwen families (llama has none).
    qk_norm: Option<(Norm, Norm)>,
    gated: bool,
}

/// A layer's token mixer (`config::LayerKind`).
enum Mixer<'a> {
    Full(Attention<'a>),
    Linear(GatedDeltaNet<'a>),
}

struct Layer<'a> {
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
    mixer: Mixer<'a>,
    ffn: Ffn<'a>,
}

/// The model: matrices stay bf16/f16/f32 (in the mapped checkpoint, or bf16 repacked as panels:
/// `Weight`) and are widened tile by tile at use; only the O(hidden) vectors (norm
/// weights, biases) are widened once here.
pub struct Model<'a> {
    pub cfg: Config,
    embed: Mat<'a>,
    head: Weight<'a>,
    norm: Norm,
    layers: Vec<Layer<'a>>,
    /// `--force-decisions`: router rows at the positions it holds are taken from it.
    pub forcing: Option<Forcing>,
    /// Qwen3.5: tensors present and not run (vision tower, multi-token prediction), by prefix
    /// with their count (§20); empty for Qwen3.
    pub unused_tensors: Vec<(String, usize)>,
}

/// Per-layer cache: for a full-attention layer the k (normed, rotated) and v rows `[n, kv, d]`
/// with their positions (cache-line aligned: P·V loads value rows a vector at a time); for a
/// linear-attention layer its conv and recurrent state (§18.7).
#[derive(Clone, Default)]
pub struct LayerKv {
    k: Lines,
    v: Lines,
    pos: Vec<i64>,
    pub linear: LinearState,
}

impl<'a> Model<'a> {
    /// Bind every tensor the config requires (shapes checked) and refuse any the checkpoint
    /// holds that no module claims.
    pub fn load(cfg: Config, st: &'a Store) -> Result<Model<'a>> {
        check_sizes(&cfg, st)?;
        let (h, v, d) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let q35 = cfg.model_type.is_qwen3_5();
        let m = cfg.layout.prefix();
        let vec = |name: &str, n: usize| st.take(name, &[n]).map(|m| m.to_vec());
        let norm = |name: &str, n: usize| -> Result<Norm> {
            Ok(Norm {
                w: vec(name, n)?,
                zero_centred: q35,
            })
        };
        let lin = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear<'a>> {
            let w = st.weight(&format!("{name}.weight"), &[out, inp])?;
            let b = if bias {
                Some(vec(&format!("{name}.bias"), out)?)
            } else {
                None
            };
            Ok(Linear { w, b })
        };
        let mlp = |p: &str, inter: usize| -> Result<Mlp<'a>> {
            let bias = if cfg.mlp_bias {
                Some(Box::new([
                    vec(&format!("{p}.gate_proj.bias"), inter)?,
                    vec(&format!("{p}.up_proj.bias"), inter)?,
                    vec(&format!("{p}.down_proj.bias"), h)?,
                ]))
            } else {
                None
            };
            Ok(Mlp {
                gate: st.weight(&format!("{p}.gate_proj.weight"), &[inter, h])?,
                up: st.weight(&format!("{p}.up_proj.weight"), &[inter, h])?,
                down: st.weight(&format!("{p}.down_proj.weight"), &[h, inter])?,
                bias,
            })
        };
        let embed_name = format!("{m}embed_tokens.weight");
        let embed = st.take(&embed_name, &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("{m}layers.{l}");
            let ab = cfg.attention_bias;
            let ffn = if cfg.is_sparse(l) {
                let (ne, mi) = (cfg.num_experts, cfg.moe_intermediate_size);
                let router = st.weight(&format!("{p}.mlp.gate.weight"), &[ne, h])?;
                // On disk experts are either per-expert modules (what save_pretrained writes) or
                // transformers 5's fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`.
                let fused = format!("{p}.mlp.experts.gate_up_proj");
                let experts = if st.contains(&fused) {
                    let gu = st.take(&fused, &[ne, 2 * mi, h])?;
                    let dn = st.take(&format!("{p}.mlp.experts.down_proj"), &[ne, h, mi])?;
                    let dn_name = format!("{p}.mlp.experts.down_proj");
                    (0..ne)
                        .map(|e| Mlp {
                            gate: st.weight_of(&fused, gu.row_block(e * 2 * mi, mi)),
                            up: st.weight_of(&fused, gu.row_block(e * 2 * mi + mi, mi)),
                            down: st.weight_of(&dn_name, dn.row_block(e * h, h)),
                            bias: None,
                        })
                        .collect()
                } else {
                    (0..ne)
                        .map(|e| mlp(&format!("{p}.mlp.experts.{e}"), mi))
                        .collect::<Result<Vec<_>>>()?
                };
                let shared = match cfg.shared_expert_intermediate_size {
                    0 => None,
                    si => Some(Box::new(SharedExpert {
                        mlp: mlp(&format!("{p}.mlp.shared_expert"), si)?,
                        gate: st.weight(&format!("{p}.mlp.shared_expert_gate.weight"), &[1, h])?,
                    })),
                };
                Ffn::Moe {
                    router,
                    experts,
                    shared,
                }
            } else {
                let inter = cfg.intermediate_size.expect("checked in Config::from_json");
                Ffn::Dense(Box::new(mlp(&format!("{p}.mlp"), inter)?))
            };
            let mixer = match cfg.layer_kind(l) {
                LayerKind::Full => Mixer::Full(Attention {
                    // §17: a Qwen3.5 q_proj holds each head's query and its gate.
                    q: lin(
                        &format!("{p}.self_attn.q_proj"),
                        nq * d * (1 + q35 as usize),
                        h,
                        ab,
                    )?,
                    k: lin(&format!("{p}.self_attn.k_proj"), nkv * d, h, ab)?,
                    v: lin(&format!("{p}.self_attn.v_proj"), nkv * d, h, ab)?,
                    o: lin(&format!("{p}.self_attn.o_proj"), h, nq * d, ab)?,
                    qk_norm: if cfg.qk_norm {
                        Some((
                            norm(&format!("{p}.self_attn.q_norm.weight"), d)?,
                            norm(&format!("{p}.self_attn.k_norm.weight"), d)?,
                        ))
                    } else {
                        None
                    },
                    gated: q35,
                }),
                LayerKind::Linear => {
                    Mixer::Linear(GatedDeltaNet::load(st, &format!("{p}.linear_attn"), &cfg)?)
                }
            };
            layers.push(Layer {
                input_layernorm: norm(&format!("{p}.input_layernorm.weight"), h)?,
                post_attention_layernorm: norm(&format!("{p}.post_attention_layernorm.weight"), h)?,
                mixer,
                ffn,
            });
        }
        let norm = norm(&format!("{m}norm.weight"), h)?;
        // Tied, the head is the embedding (looked up from the file's rows, multiplied by as a
        // `Weight`).
        let head = if cfg.tie_word_embeddings {
            st.weight_of(&embed_name, embed)
        } else {
            st.weight("lm_head.weight", &[v, h])?
        };
        // §20: Qwen3.5 checkpoints carry a vision tower and a multi-token-prediction head the
        // language model does not run; they are listed, not refused.
        let unused_tensors = if q35 {
            st.set_aside(&crate::qwen3_5::UNUSED_PREFIXES)
        } else {
            vec![]
        };
        st.finish_claims()?;
        Ok(Model {
            cfg,
            embed,
            head,
            norm,
            layers,
            forcing: None,
            unused_tensors,
        })
    }

    /// Makes every matrix's panels now instead of on first decode use (`Weight`): for a
    /// measurement of steady decode (the bench), packing counted as load time.
    pub fn pack_panels(&self) {
        let mut all: Vec<&Weight> = vec![&self.head];
        for l in &self.layers {
            match &l.mixer {
                Mixer::Full(a) => all.extend([&a.q.w, &a.k.w, &a.v.w, &a.o.w]),
                Mixer::Linear(g) => all.extend(g.weights()),
            }
            match &l.ffn {
                Ffn::Dense(m) => all.extend(m.weights()),
                Ffn::Moe {
                    router,
                    experts,
                    shared,
                } => {
                    all.push(router);
                    all.extend(experts.iter().flat_map(Mlp::weights));
                    if let Some(sh) = shared {
                        all.extend(sh.mlp.weights());
                        all.push(&sh.gate);
                    }
                }
            }
        }
        for w in all {
            w.pack();
        }
    }

    pub fn new_cache(&self) -> Vec<LayerKv> {
        vec![LayerKv::default(); self.cfg.num_hidden_layers]
    }

    /// §5 embedding rows.
    pub fn embed(&self, tokens: &[i64]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            if t < 0 || t as u64 >= self.cfg.vocab_size as u64 {
                return Err(err!(Input:
                    "token id {t} outside the vocabulary [0, {})",
                    self.cfg.vocab_size
                ));
            }
            self.embed
                .widen_row(t as usize, 0, &mut x[r * h..(r + 1) * h]);
        }
        Ok(x)
    }

    /// Tokens at positions `pos0..`, appending to `cache` (empty for an uncached forward).
    /// Captures embed.out … logits into `cap`; returns logits `[T, V]`.
    pub fn forward(
        &self,
        tokens: &[i64],
        pos0: i64,
        cache: &mut [LayerKv],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let t = tokens.len();
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let pos: Vec<i64> = (0..t as i64).map(|i| pos0 + i).collect();
        let rope = self.rope(&pos);
        let mut x = self.embed(tokens)?;
        cap.tensor("embed.out", &[t, h], &x, &pos);
        for (l, kv) in cache.iter_mut().enumerate() {
            x = self.layer(l, &x, &pos, &rope, kv, cap)?;
        }
        let xn = self.norm.rows(&x, self.cfg.eps_f32());
        cap.tensor("final_norm.out", &[t, h], &xn, &pos);
        let logits = ops::matmul(&xn, t, self.head.view(t), None);
        cap.tensor("logits", &[t, v], &logits, &pos);
        Ok(logits)
    }

    /// §7 / §16 RoPE tables for these positions, over the config's rotary dims.
    pub fn rope(&self, pos: &[i64]) -> Rope {
        Rope::scaled(
            self.cfg.rope_theta,
            self.cfg.rotary_dim,
            self.cfg.rope_scaling,
            pos,
        )
    }

    /// §11 / §20 decoder layer `l` on rows `x` `[T, H]` at absolute positions `pos` (causal by
    /// position), attending to `kv` plus these rows (which are appended to `kv`); a
    /// linear-attention layer continues its state in `kv`, so its rows must follow on from it.
    pub fn layer(
        &self,
        l: usize,
        x: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let lw = self.layers.get(l).ok_or_else(
            || err!(Input: "layer {l} out of range (model has {})", self.layers.len()),
        )?;
        let (t, h, eps) = (pos.len(), self.cfg.hidden_size, self.cfg.eps_f32());
        let name = |point: &str| names::layer(l, point);
        cap.tensor(&name("hidden_in"), &[t, h], x, pos);
        let xn = lw.input_layernorm.rows(x, eps);
        let a = match &lw.mixer {
            Mixer::Full(at) => self.attention(l, at, &xn, pos, rope, kv, cap),
            Mixer::Linear(gdn) => gdn.forward(l, &self.cfg, &xn, pos, &mut kv.linear, cap)?,
        };
        cap.tensor(&name("attn_out"), &[t, h], &a, pos);
        let h1: Vec<f32> = x.iter().zip(&a).map(|(p, q)| p + q).collect();
        let hn = lw.post_attention_layernorm.rows(&h1, eps);
        let m = match &lw.ffn {
            Ffn::Dense(mlp) => gated_mlp(mlp, &hn, t),
            Ffn::Moe {
                router,
                experts,
                shared,
            } => {
                let routed = self.moe(l, router, experts, &hn, pos, cap)?;
                match shared {
                    None => routed,
                    Some(se) => se.add_to(l, routed, &hn, pos, cap),
                }
            }
        };
        cap.tensor(&name("mlp_out"), &[t, h], &m, pos);
        let out: Vec<f32> = h1.iter().zip(&m).map(|(p, q)| p + q).collect();
        cap.tensor(&name("hidden_out"), &[t, h], &out, pos);
        Ok(out)
    }

    /// §8 (§17 when gated) attention of the new rows over `kv` ++ new rows; returns attn_out
    /// (after o_proj).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        l: usize,
        lw: &Attention,
        xn: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Vec<f32> {
        let c = &self.cfg;
        let (t, d, eps) = (pos.len(), c.head_dim, c.eps_f32());
        let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
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
        // §8.2 q_norm / k_norm on every head vector (not llama), then RoPE at the row's
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
        cap.internal(&names::layer(l, "q"), &[t, nq, d], &q, pos);
        cap.internal(&names::layer(l, "k"), &[t, nkv, d], &k, pos);
        cap.internal(&names::layer(l, "v"), &[t, nkv, d], &v, pos);
        if let Some(g) = &gate {
            cap.internal(&names::layer(l, "attn_gate"), &[t, nq, d], g, pos);
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
        // §8.4: scale = f32(1 / sqrt(d)) in binary64.
        let scale = (1.0f64 / (d as f64).sqrt()) as f32;
        let (mut o, probs) = ops::attention(&q, pos, &keys, shape, scale, cap.internals());
        if cap.internals() {
            let tk = kv.pos.len();
            cap.internal(&names::layer(l, "attn_probs"), &[nq, t, tk], &probs, pos);
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

    /// §10 sparse MoE block.
    fn moe(
        &self,
        l: usize,
        router: &Weight,
        experts: &[Mlp],
        xn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let (t, h, ne, k) = (
            pos.len(),
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
        );
        let logits = ops::matmul(xn, t, router.view(t), None);
        cap.internal(&names::layer(l, "router.logits"), &[t, ne], &logits, pos);
        // weight[r][e] for the chosen experts of row r (None: not chosen).
        let mut weight: Vec<Vec<Option<f32>>> = vec![vec![None; ne]; t];
        let mut chosen_all = Vec::with_capacity(t * k);
        let mut margins = Vec::with_capacity(t);
        let mut p = vec![0.0f32; ne];
        let name = names::layer(l, "router.topk");
        // Forced rows are keyed by position: row i of the forcing decision is position i's.
        let forced = self.forcing.as_ref().and_then(|f| f.values(&name));
        let mut overridden = 0u64;
        for r in 0..t {
            ops::softmax(&logits[r * ne..(r + 1) * ne], |_| true, &mut p);
            if p.iter().any(|x| x.is_nan()) {
                return Err(err!(NaN:
                    "{}: NaN probability at row {r} (position {})",
                    names::layer(l, "router"),
                    pos[r]
                ));
            }
            let (own, next) = ops::topk(&p, k);
            let next = next.expect("k < num_experts checked in config");
            let at = pos[r] as usize * k;
            let chosen: Vec<usize> = match forced.and_then(|f| f.get(at..at + k)) {
                Some(row) => {
                    let row: Vec<usize> = row.iter().map(|&e| e as usize).collect();
                    overridden += u64::from(row != own);
                    margins.push(ops::margin_of(&p, &row));
                    row
                }
                None => {
                    margins.push(p[own[k - 1]] - p[next]);
                    own
                }
            };
            // §10.4 in the chosen (rank or forced) order.
            let den = if c.norm_topk_prob {
                ops::ordered_sum(&chosen.iter().map(|&e| p[e]).collect::<Vec<_>>())
            } else {
                1.0
            };
            for &e in &chosen {
                weight[r][e] = Some(if c.norm_topk_prob { p[e] / den } else { p[e] });
                chosen_all.push(e as i64);
            }
        }
        cap.decision(&name, &[t, k], chosen_all, Some(margins));
        if forced.is_some() {
            cap.forced(&name, overridden);
        }
        let mut out = vec![0.0f32; t * h];
        // Ascending expert id, so each row accumulates its experts in ascending id.
        for (e, mlp) in experts.iter().enumerate() {
            let rows: Vec<usize> = (0..t).filter(|&r| weight[r][e].is_some()).collect();
            if rows.is_empty() {
                continue;
            }
            let xe: Vec<f32> = rows
                .iter()
                .flat_map(|&r| xn[r * h..(r + 1) * h].iter().copied())
                .collect();
            let ye = gated_mlp(mlp, &xe, rows.len());
            let epos: Vec<i64> = rows.iter().map(|&r| pos[r]).collect();
            cap.internal(&names::expert(l, e, "out"), &[rows.len(), h], &ye, &epos);
            for (i, &r) in rows.iter().enumerate() {
                let w = weight[r][e].expect("row routed to e");
                for j in 0..h {
                    out[r * h + j] += w * ye[i * h + j];
                }
            }
        }
        Ok(out)
    }
}

/// §9 `down(silu(gate(x)) ⊗ up(x))` (each projection with its bias under llama's `mlp_bias`).
pub(crate) fn gated_mlp(m: &Mlp, x: &[f32], rows: usize) -> Vec<f32> {
    let bias = |i: usize| m.bias.as_ref().map(|b| b[i].as_slice());
    let g = ops::matmul(x, rows, m.gate.view(rows), bias(0));
    let u = ops::matmul(x, rows, m.up.view(rows), bias(1));
    // Elementwise, so spread over the pool in chunks; bits are per element.
    let mut hmid = vec![0.0f32; g.len()];
    hmid.par_chunks_mut(4096)
        .zip(g.par_chunks(4096).zip(u.par_chunks(4096)))
        .for_each(|(hc, (gc, uc))| ops::silu_mul(gc, uc, hc));
    ops::matmul(&hmid, rows, m.down.view(rows), bias(2))
}
