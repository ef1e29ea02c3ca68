//! Diffusion Gemma (`diffusion_gemma`, docs/diffusion-gemma.md): a block-diffusion model whose
//! encoder (the prompt, then each committed canvas: causal, writing the KV cache) and decoder
//! (the canvas of the block being denoised: bidirectional, reading the cache) share one set of
//! layers. Here: the weights and the forward passes, in ordered fp32 with the ops of
//! docs/numerics.md. `config` reads the config and the generation knobs; `run` is the block
//! loop and its decisions. What they record goes through the engine's one recorder
//! (`crate::capture`), streamed to the trace as it is produced.

pub mod config;
pub mod run;

use rayon::prelude::*;
use tracegate_trace::names;

use crate::capture::{Capture, MaskOf};
use crate::force::Forcing;
use crate::matmul::layout::{Mat, WDType};
use crate::ops::{self, Heads, KeyRows, Rope};
use crate::weights::{Store, Weight};
use crate::{err, Result};
use config::DgConfig;

/// Tensors a checkpoint carries and token ids never run (DG0 "Weights"): listed in provenance.
const UNUSED_PREFIXES: [&str; 2] = ["model.encoder.vision_tower.", "model.encoder.embed_vision."];

/// Which pass a forward is: it sets the names' prefix, the `path` and `mask` attributes, the
/// key set and `layer_scalar` (DG6, DG9, DG16).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    /// The encoder over the prompt (names unprefixed).
    Prompt,
    /// The encoder over block b's committed canvas (`encode.BBBB.`).
    Encode(usize),
    /// Denoise step s of block b (`denoise.BBBB.SSSS.`).
    Denoise(usize, usize),
}

impl Pass {
    /// The pass a parsed name belongs to (None: a block's own decisions, a decode step).
    pub fn of(n: &names::Name) -> Option<Pass> {
        match (n.decode_step, n.diffusion) {
            (None, None) => Some(Pass::Prompt),
            (None, Some(names::Diffusion::Encode { block })) => Some(Pass::Encode(block)),
            (None, Some(names::Diffusion::Denoise { block, step })) => {
                Some(Pass::Denoise(block, step))
            }
            _ => None,
        }
    }
    pub fn name(self, rest: &str) -> String {
        match self {
            Pass::Prompt => rest.to_string(),
            Pass::Encode(b) => names::encode(b, rest),
            Pass::Denoise(b, s) => names::denoise(b, s, rest),
        }
    }
    fn encoder(self) -> bool {
        !matches!(self, Pass::Denoise(..))
    }
    pub fn path(self) -> &'static str {
        if self.encoder() {
            "encode"
        } else {
            "denoise"
        }
    }
    /// The `mask` attribute: `layer` is Some(sliding) inside a layer, None outside.
    pub fn mask(self, layer: Option<bool>, window: usize) -> String {
        match (self.encoder(), layer) {
            (true, Some(true)) => format!("sliding:{window}"),
            (true, _) => "causal".into(),
            (false, Some(true)) => format!("bidirectional,sliding:{window}"),
            (false, _) => "bidirectional".into(),
        }
    }
}

/// The `mask` attribute of a tensor by its name: its pass's, and inside a layer that layer's
/// (`Pass::mask`), as the capture writes it.
pub fn mask_of(cfg: &DgConfig) -> Box<MaskOf> {
    let (sliding, window) = (cfg.sliding.clone(), cfg.window);
    Box::new(move |n| {
        let layer = n.layer.map(|l| sliding.get(l).copied().unwrap_or(false));
        Pass::of(n).unwrap_or(Pass::Prompt).mask(layer, window)
    })
}

struct Expert<'a> {
    gate: Weight<'a>,
    up: Weight<'a>,
    down: Weight<'a>,
}

/// One layer's weights (shared by encoder and decoder) and its two `layer_scalar`s.
struct Layer<'a> {
    sliding: bool,
    q: Weight<'a>,
    k: Weight<'a>,
    /// Sliding layers only; full layers take v from the raw k projection (DG5).
    v: Option<Weight<'a>>,
    o: Weight<'a>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    input_norm: Vec<f32>,
    post_attn_norm: Vec<f32>,
    pre_ff_norm: Vec<f32>,
    post_ff_norm: Vec<f32>,
    post_ff_norm_1: Vec<f32>,
    pre_ff_norm_2: Vec<f32>,
    post_ff_norm_2: Vec<f32>,
    mlp: Expert<'a>,
    router: Weight<'a>,
    router_scale: Vec<f32>,
    per_expert_scale: Vec<f32>,
    experts: Vec<Expert<'a>>,
    scalar_encoder: f32,
    scalar_decoder: f32,
}

/// The encoder's KV cache of one layer: every position's k (normed, rotated) and v (normed),
/// `[n, kv, d]`, positions ascending.
#[derive(Clone, Default)]
pub struct LayerCache {
    k: Vec<f32>,
    v: Vec<f32>,
    pos: Vec<i64>,
}

pub struct DgModel<'a> {
    pub cfg: DgConfig,
    embed: Mat<'a>,
    head: Weight<'a>,
    /// `embed_tokens.weight` widened and transposed to `[H, V]` (f32 bytes): the self-
    /// conditioning product runs as a §2 matmul over the vocabulary.
    embed_t: Vec<u8>,
    final_norm: Vec<f32>,
    sc_pre_norm: Vec<f32>,
    sc: Expert<'a>,
    layers: Vec<Layer<'a>>,
    /// DG2 `s_e = f32(pow(H, 0.5))`.
    embed_scale: f32,
    /// DG8 `ρ = f32(pow(H, −0.5))`.
    router_root: f32,
    pub unused_tensors: Vec<(String, usize)>,
}

impl<'a> DgModel<'a> {
    pub fn load(cfg: DgConfig, st: &'a Store) -> Result<DgModel<'a>> {
        let (h, v, f) = (cfg.hidden, cfg.vocab, cfg.intermediate);
        let dec = "model.decoder.";
        let vec = |name: &str, n: usize| st.take(name, &[n]).map(|m| m.to_vec());
        let embed_name = format!("{dec}embed_tokens.weight");
        let embed = st.take(&embed_name, &[v, h])?;
        let head = if cfg.tied {
            st.weight_of(&embed_name, embed)
        } else {
            st.weight("lm_head.weight", &[v, h])?
        };
        let mut embed_t = vec![0u8; h * v * 4];
        let mut row = vec![0.0f32; h];
        for t in 0..v {
            embed.widen_row(t, 0, &mut row);
            for (i, x) in row.iter().enumerate() {
                embed_t[(i * v + t) * 4..(i * v + t + 1) * 4].copy_from_slice(&x.to_le_bytes());
            }
        }
        let mlp = |p: &str, inter: usize| -> Result<Expert<'a>> {
            Ok(Expert {
                gate: st.weight(&format!("{p}.gate_proj.weight"), &[inter, h])?,
                up: st.weight(&format!("{p}.up_proj.weight"), &[inter, h])?,
                down: st.weight(&format!("{p}.down_proj.weight"), &[h, inter])?,
            })
        };
        let scalar = |name: &str| -> Result<f32> { Ok(vec(name, 1)?[0]) };
        let mut layers = Vec::with_capacity(cfg.layers);
        for l in 0..cfg.layers {
            let p = format!("{dec}layers.{l}.");
            let a = cfg.attn(l);
            let (nh, d, kv) = (cfg.heads, a.head_dim, a.kv_heads);
            let (ne, mi) = (cfg.experts, cfg.moe_intermediate);
            let sliding = cfg.sliding[l];
            let gu_name = format!("{p}experts.gate_up_proj");
            let dn_name = format!("{p}experts.down_proj");
            let gu = st.take(&gu_name, &[ne, 2 * mi, h])?;
            let dn = st.take(&dn_name, &[ne, h, mi])?;
            layers.push(Layer {
                sliding,
                q: st.weight(&format!("{p}self_attn.q_proj.weight"), &[nh * d, h])?,
                k: st.weight(&format!("{p}self_attn.k_proj.weight"), &[kv * d, h])?,
                v: if sliding {
                    Some(st.weight(&format!("{p}self_attn.v_proj.weight"), &[kv * d, h])?)
                } else {
                    None
                },
                o: st.weight(&format!("{p}self_attn.o_proj.weight"), &[h, nh * d])?,
                q_norm: vec(&format!("{p}self_attn.q_norm.weight"), d)?,
                k_norm: vec(&format!("{p}self_attn.k_norm.weight"), d)?,
                input_norm: vec(&format!("{p}input_layernorm.weight"), h)?,
                post_attn_norm: vec(&format!("{p}post_attention_layernorm.weight"), h)?,
                pre_ff_norm: vec(&format!("{p}pre_feedforward_layernorm.weight"), h)?,
                post_ff_norm: vec(&format!("{p}post_feedforward_layernorm.weight"), h)?,
                post_ff_norm_1: vec(&format!("{p}post_feedforward_layernorm_1.weight"), h)?,
                pre_ff_norm_2: vec(&format!("{p}pre_feedforward_layernorm_2.weight"), h)?,
                post_ff_norm_2: vec(&format!("{p}post_feedforward_layernorm_2.weight"), h)?,
                mlp: mlp(&format!("{p}mlp"), f)?,
                router: st.weight(&format!("{p}router.proj.weight"), &[ne, h])?,
                router_scale: vec(&format!("{p}router.scale"), h)?,
                per_expert_scale: vec(&format!("{p}router.per_expert_scale"), ne)?,
                // Expert e: its I gate rows, then its I up rows (chunk(2) of the output).
                experts: (0..ne)
                    .map(|e| Expert {
                        gate: st.weight_of(&gu_name, gu.row_block(e * 2 * mi, mi)),
                        up: st.weight_of(&gu_name, gu.row_block(e * 2 * mi + mi, mi)),
                        down: st.weight_of(&dn_name, dn.row_block(e * h, h)),
                    })
                    .collect(),
                // DG9: the encoder's own buffer, not tied to the decoder's.
                scalar_encoder: scalar(&format!(
                    "model.encoder.language_model.layers.{l}.layer_scalar"
                ))?,
                scalar_decoder: scalar(&format!("{p}layer_scalar"))?,
            });
        }
        let sc_p = format!("{dec}self_conditioning");
        let model = DgModel {
            embed,
            head,
            embed_t,
            final_norm: vec(&format!("{dec}norm.weight"), h)?,
            sc_pre_norm: vec(&format!("{sc_p}.pre_norm.weight"), h)?,
            sc: mlp(&sc_p, f)?,
            layers,
            embed_scale: (h as f64).powf(0.5) as f32,
            router_root: (h as f64).powf(-0.5) as f32,
            unused_tensors: st.set_aside(&UNUSED_PREFIXES),
            cfg,
        };
        st.finish_claims()?;
        Ok(model)
    }

    pub fn new_cache(&self) -> Vec<LayerCache> {
        vec![LayerCache::default(); self.cfg.layers]
    }

    /// DG2 `widen(embed_tokens[t]) ⊗ s_e` per row.
    fn embed(&self, tokens: &[i64]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            if t < 0 || t as u64 >= self.cfg.vocab as u64 {
                return Err(err!(Input:
                    "token id {t} outside the vocabulary [0, {})",
                    self.cfg.vocab
                ));
            }
            let row = &mut x[r * h..(r + 1) * h];
            self.embed.widen_row(t as usize, 0, row);
            for v in row.iter_mut() {
                *v *= self.embed_scale;
            }
        }
        Ok(x)
    }

    /// RoPE tables of layer type `sliding` at these positions (DG4: §7 on sliding layers, the
    /// proportional frequencies — §7's, zero past the rotated pairs — on full layers).
    fn rope(&self, sliding: bool, pos: &[i64]) -> Rope {
        let a = if sliding {
            &self.cfg.sliding_attn
        } else {
            &self.cfg.full_attn
        };
        let mut inv = ops::inv_freq(a.theta, a.head_dim);
        for f in inv.iter_mut().skip(a.rotated) {
            *f = 0.0;
        }
        Rope::from_inv_freq(&inv, pos)
    }

    /// The encoder over `tokens` at positions `pos` (the prompt, or a committed canvas),
    /// appending every layer's k and v to `cache`.
    pub fn encode(
        &self,
        pass: Pass,
        tokens: &[i64],
        pos: &[i64],
        cache: &mut [LayerCache],
        cap: &mut Capture,
        forcing: Option<&Forcing>,
    ) -> Result<()> {
        let h = self.cfg.hidden;
        let mut x = self.embed(tokens)?;
        cap.tensor(&pass.name("embed.out"), &[tokens.len(), h], &x, pos);
        for (l, kv) in cache.iter_mut().enumerate() {
            x = self.layer(pass, l, &x, pos, kv, cap, forcing)?;
        }
        Ok(())
    }

    /// The decoder over `canvas` at positions `pos` with the previous step's tempered logits
    /// `prev` (None at step 0); returns the logits after the softcap `[C, V]` (DG10, DG11).
    #[allow(clippy::too_many_arguments)]
    pub fn denoise(
        &self,
        pass: Pass,
        canvas: &[i64],
        pos: &[i64],
        prev: Option<&[f32]>,
        cache: &mut [LayerCache],
        cap: &mut Capture,
        forcing: Option<&Forcing>,
    ) -> Result<Vec<f32>> {
        let (h, v, t) = (self.cfg.hidden, self.cfg.vocab, canvas.len());
        let eps = self.cfg.eps_f32();
        let e = self.embed(canvas)?;
        cap.tensor(&pass.name("embed.out"), &[t, h], &e, pos);
        // DG10: soft = softmax(prev)·E ⊗ s_e, or +0.0 at step 0.
        let soft = match prev {
            None => vec![0.0f32; t * h],
            Some(prev) => {
                let mut q = vec![0.0f32; t * v];
                q.par_chunks_mut(v)
                    .zip(prev.par_chunks(v))
                    .for_each(|(qr, pr)| qr.copy_from_slice(&softmax_row(pr).0));
                let et = Mat::rows(WDType::F32, h, v, &self.embed_t);
                let mut s = ops::matmul(&q, t, et, None);
                for x in s.iter_mut() {
                    *x *= self.embed_scale;
                }
                s
            }
        };
        cap.tensor(&pass.name("sc.soft"), &[t, h], &soft, pos);
        let sc_in = ops::rmsnorm_rows(&soft, &self.sc_pre_norm, eps, false);
        let sc_mlp = gelu_mlp(&self.sc, &sc_in, t);
        cap.internal(&pass.name("sc.mlp_out"), &[t, h], &sc_mlp, pos);
        let sum: Vec<f32> = e.iter().zip(&sc_mlp).map(|(a, b)| a + b).collect();
        let mut x = plain_rows(&sum, h, eps);
        cap.tensor(&pass.name("sc.out"), &[t, h], &x, pos);
        for (l, kv) in cache.iter_mut().enumerate() {
            x = self.layer(pass, l, &x, pos, kv, cap, forcing)?;
        }
        let xn = ops::rmsnorm_rows(&x, &self.final_norm, eps, false);
        cap.tensor(&pass.name("final_norm.out"), &[t, h], &xn, pos);
        let z = ops::matmul(&xn, t, self.head.view(t), None);
        cap.internal(&pass.name("logits.uncapped"), &[t, v], &z, pos);
        // DG11: f32(tanh(binary64(z ⊘ c))) ⊗ c.
        let c = self.cfg.softcap as f32;
        let mut logits = z;
        logits.par_chunks_mut(v).for_each(|row| {
            for x in row {
                *x = ops::tanh_to_f32(*x / c) * c;
            }
        });
        cap.tensor(&pass.name("logits"), &[t, v], &logits, pos);
        Ok(logits)
    }

    /// DG9 one layer, encoder or decoder by `pass`; the encoder appends this call's k and v to
    /// `kv`, the decoder only reads it.
    #[allow(clippy::too_many_arguments)]
    fn layer(
        &self,
        pass: Pass,
        l: usize,
        x: &[f32],
        pos: &[i64],
        kv: &mut LayerCache,
        cap: &mut Capture,
        forcing: Option<&Forcing>,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let lw = &self.layers[l];
        let (t, h, eps) = (pos.len(), c.hidden, c.eps_f32());
        let a = c.attn(l);
        let (nh, d, nkv) = (c.heads, a.head_dim, a.kv_heads);
        let name = |p: &str| names::layer(l, p);
        cap.tensor(&pass.name(&name("hidden_in")), &[t, h], x, pos);
        // DG5
        let xn = ops::rmsnorm_rows(x, &lw.input_norm, eps, false);
        let mut q = ops::matmul(&xn, t, lw.q.view(t), None);
        let kr = ops::matmul(&xn, t, lw.k.view(t), None);
        let vr = match &lw.v {
            Some(wv) => ops::matmul(&xn, t, wv.view(t), None),
            None => kr.clone(),
        };
        let rope = self.rope(lw.sliding, pos);
        let mut normed = vec![0.0f32; d];
        for (i, head) in q.chunks_exact_mut(d).enumerate() {
            ops::rmsnorm(head, &lw.q_norm, eps, &mut normed);
            head.copy_from_slice(&normed);
            rope.apply(i / nh, head);
        }
        let mut k = kr;
        for (i, head) in k.chunks_exact_mut(d).enumerate() {
            ops::rmsnorm(head, &lw.k_norm, eps, &mut normed);
            head.copy_from_slice(&normed);
            rope.apply(i / nkv, head);
        }
        let v = plain_rows(&vr, d, eps);
        cap.internal(&pass.name(&name("q")), &[t, nh, d], &q, pos);
        cap.internal(&pass.name(&name("k")), &[t, nkv, d], &k, pos);
        cap.internal(&pass.name(&name("v")), &[t, nkv, d], &v, pos);
        // DG6: the keys, cached rows first, then this call's.
        let w = c.window as i64;
        let (keys_k, keys_v, keys_pos);
        let (ks, vs, ps): (&[f32], &[f32], &[i64]) = if pass.encoder() {
            kv.k.extend_from_slice(&k);
            kv.v.extend_from_slice(&v);
            kv.pos.extend_from_slice(pos);
            (&kv.k, &kv.v, &kv.pos)
        } else {
            // Sliding: what the dynamic cache keeps, the last W−1 cached positions.
            let n = kv.pos.len();
            let start = if lw.sliding {
                n.saturating_sub(c.window.saturating_sub(1))
            } else {
                0
            };
            let row = nkv * d;
            keys_k = [&kv.k[start * row..], &k[..]].concat();
            keys_v = [&kv.v[start * row..], &v[..]].concat();
            keys_pos = [&kv.pos[start..], pos].concat();
            (&keys_k, &keys_v, &keys_pos)
        };
        let keys = KeyRows {
            k: ks,
            v: vs,
            pos: ps,
        };
        let (enc, sliding) = (pass.encoder(), lw.sliding);
        let visible = |r: usize, cc: usize| -> bool {
            if !enc {
                return true;
            }
            let (p, kp) = (pos[r], ps[cc]);
            kp <= p && (!sliding || kp > p - w)
        };
        let hs = Heads { nq: nh, nkv, d };
        // DG5.6: scale 1.0.
        let (o, probs) = ops::attention_masked(&q, t, &keys, hs, 1.0, &visible);
        cap.internal(
            &pass.name(&name("attn_probs")),
            &[nh, t, ps.len()],
            &probs,
            pos,
        );
        let attn = ops::matmul(&o, t, lw.o.view(t), None);
        cap.tensor(&pass.name(&name("attn_out")), &[t, h], &attn, pos);
        let an = ops::rmsnorm_rows(&attn, &lw.post_attn_norm, eps, false);
        let h1: Vec<f32> = x.iter().zip(&an).map(|(a, b)| a + b).collect();
        cap.internal(&pass.name(&name("attn_residual")), &[t, h], &h1, pos);
        // DG7 dense MLP: its output replaces its input.
        let x2 = ops::rmsnorm_rows(&h1, &lw.pre_ff_norm, eps, false);
        let dense = gelu_mlp(&lw.mlp, &x2, t);
        cap.internal(&pass.name(&name("dense_mlp.out")), &[t, h], &dense, pos);
        let d1 = ops::rmsnorm_rows(&dense, &lw.post_ff_norm_1, eps, false);
        cap.tensor(&pass.name(&name("dense_mlp.branch")), &[t, h], &d1, pos);
        let moe = self.moe(pass, l, &h1, pos, cap, forcing)?;
        let d2 = ops::rmsnorm_rows(&moe, &lw.post_ff_norm_2, eps, false);
        cap.tensor(&pass.name(&name("moe.branch")), &[t, h], &d2, pos);
        let s: Vec<f32> = d1.iter().zip(&d2).map(|(a, b)| a + b).collect();
        let m = ops::rmsnorm_rows(&s, &lw.post_ff_norm, eps, false);
        cap.tensor(&pass.name(&name("mlp_out")), &[t, h], &m, pos);
        let lambda = if pass.encoder() {
            lw.scalar_encoder
        } else {
            lw.scalar_decoder
        };
        let out: Vec<f32> = h1.iter().zip(&m).map(|(a, b)| (a + b) * lambda).collect();
        cap.tensor(&pass.name(&name("hidden_out")), &[t, h], &out, pos);
        Ok(out)
    }

    /// DG8 router (on the residual h1) and experts (on `pre_feedforward_layernorm_2(h1)`);
    /// records `router.topk` (forced rows keyed by row index within the pass).
    fn moe(
        &self,
        pass: Pass,
        l: usize,
        h1: &[f32],
        pos: &[i64],
        cap: &mut Capture,
        forcing: Option<&Forcing>,
    ) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let lw = &self.layers[l];
        let (t, h, ne, k, eps) = (pos.len(), c.hidden, c.experts, c.top_k, c.eps_f32());
        let rn = plain_rows(h1, h, eps);
        let xr: Vec<f32> = rn
            .chunks_exact(h)
            .flat_map(|row| {
                row.iter()
                    .zip(&lw.router_scale)
                    .map(|(a, s)| (a * s) * self.router_root)
            })
            .collect();
        let g = ops::matmul(&xr, t, lw.router.view(t), None);
        cap.internal(
            &pass.name(&names::layer(l, "router.logits")),
            &[t, ne],
            &g,
            pos,
        );
        let name = pass.name(&names::layer(l, "router.topk"));
        let forced = match forcing {
            Some(f) => {
                f.require(&name, Some(t), Some(k), ne)?;
                f.values(&name)
            }
            None => None,
        };
        let mut weight: Vec<Vec<Option<f32>>> = vec![vec![None; ne]; t];
        let (mut chosen_all, mut margins, mut overridden) = (vec![], vec![], vec![]);
        let mut p = vec![0.0f32; ne];
        for r in 0..t {
            ops::softmax(&g[r * ne..(r + 1) * ne], |_| true, &mut p);
            if p.iter().any(|x| x.is_nan()) {
                return Err(
                    err!(NaN: "{name}: NaN router probability at row {r} (position {})", pos[r]),
                );
            }
            let (own, next) = ops::topk(&p, k);
            let chosen: Vec<usize> = match forced {
                Some(f) => {
                    let row: Vec<usize> =
                        f[r * k..(r + 1) * k].iter().map(|&e| e as usize).collect();
                    if row != own {
                        overridden.push(r as u64);
                    }
                    margins.push(ops::margin_of(&p, &row));
                    row
                }
                None => {
                    let next = next.ok_or_else(|| err!(Internal: "top-k: k ≥ num_experts"))?;
                    margins.push(p[own[k - 1]] - p[next]);
                    own
                }
            };
            // DG8: renormalised in rank order, then the per-expert scale.
            let den = ops::ordered_sum(&chosen.iter().map(|&e| p[e]).collect::<Vec<_>>());
            for &e in &chosen {
                weight[r][e] = Some((p[e] / den) * lw.per_expert_scale[e]);
                chosen_all.push(e as i64);
            }
        }
        let overridden = forced.map(|_| overridden);
        cap.decided(&name, &[t, k], chosen_all, Some(margins), overridden);
        let x3 = ops::rmsnorm_rows(h1, &lw.pre_ff_norm_2, eps, false);
        let mut out = vec![0.0f32; t * h];
        for (e, ex) in lw.experts.iter().enumerate() {
            let rows: Vec<usize> = (0..t).filter(|&r| weight[r][e].is_some()).collect();
            if rows.is_empty() {
                continue;
            }
            let xe: Vec<f32> = rows
                .iter()
                .flat_map(|&r| x3[r * h..(r + 1) * h].iter().copied())
                .collect();
            let ye = gelu_mlp(ex, &xe, rows.len());
            let epos: Vec<i64> = rows.iter().map(|&r| pos[r]).collect();
            cap.internal(
                &pass.name(&names::expert(l, e, "out")),
                &[rows.len(), h],
                &ye,
                &epos,
            );
            for (i, &r) in rows.iter().enumerate() {
                let w = weight[r][e].unwrap_or(0.0);
                for j in 0..h {
                    out[r * h + j] += ye[i * h + j] * w;
                }
            }
        }
        cap.internal(&pass.name(&names::layer(l, "moe.out")), &[t, h], &out, pos);
        Ok(out)
    }
}

/// §8.6 softmax of one row over all its entries, with its max `m` and sum `z` (DG12.2's
/// `m_r`, `z_r`): `e = f32(E(ℓ ⊖ m))` by `ops::exp_shifted` (bit-equal to the libm rule),
/// summed ascending, divided.
fn softmax_row(l: &[f32]) -> (Vec<f32>, f32, f32) {
    let mut m = f32::NEG_INFINITY;
    for &v in l {
        if v > m {
            m = v;
        }
    }
    let mut p = l.to_vec();
    ops::exp_shifted(&mut p, m);
    let z = ops::ordered_sum(&p);
    for o in p.iter_mut() {
        *o /= z;
    }
    (p, m, z)
}

/// DG7 `(gelu(x·Wgᵀ) ⊗ (x·Wuᵀ))·Wdᵀ`.
fn gelu_mlp(m: &Expert, x: &[f32], rows: usize) -> Vec<f32> {
    let g = ops::matmul(x, rows, m.gate.view(rows), None);
    let u = ops::matmul(x, rows, m.up.view(rows), None);
    let mid: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&a, &b)| ops::gelu_tanh(a) * b)
        .collect();
    ops::matmul(&mid, rows, m.down.view(rows), None)
}

/// DG3 `rmsnorm_plain` of every `n`-wide row.
fn plain_rows(x: &[f32], n: usize, eps: f32) -> Vec<f32> {
    let mut out = vec![0.0f32; x.len()];
    for (o, r) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
        ops::rmsnorm_plain(r, eps, o);
    }
    out
}
