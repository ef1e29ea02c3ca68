//! §11 / §20 the decoder layer: norm → token mixer → residual → norm → feed-forward → residual
//! (§22.4 Gemma 3: each block's output normed too, before its residual add),
//! with the layer's capture points (`hidden_in`, `attn_out`, `mlp_out`, `hidden_out`; the
//! mixer and the feed-forward block capture their own internals).

use tracegate_trace::names;

use super::feed_forward::Ffn;
use super::mixer::Mixer;
use super::norm::Norm;
use super::Ropes;
use super::{LayerKv, Model, Rank};
use crate::capture::Capture;
use crate::config::Config;
use crate::weights::Store;
use crate::{err, Result};

pub(crate) struct Layer<'a> {
    input_layernorm: Norm,
    post_attention_layernorm: Norm,
    /// §22.4 Gemma 3's MLP input norm and MLP output norm (`post_attention_layernorm` then
    /// norms the mixer's output).
    feedforward_norms: Option<(Norm, Norm)>,
    pub mixer: Mixer<'a>,
    pub ffn: Ffn<'a>,
}

impl<'a> Layer<'a> {
    /// Layer `l`'s tensors: its mixer and feed-forward block as the config chooses them.
    pub fn load(st: &'a Store, cfg: &Config, l: usize, comm: &Rank) -> Result<Layer<'a>> {
        let p = format!("{}layers.{l}", cfg.layout.prefix());
        let h = cfg.hidden_size;
        let ffn = Ffn::load(st, cfg, l, &p, comm)?;
        let mixer = Mixer::load(st, cfg, l, &p, comm)?;
        let norm = |name: &str| Norm::load(st, cfg, &format!("{p}.{name}.weight"), h);
        let feedforward_norms = match cfg.model_type.sandwich_norms() {
            true => Some((
                norm("pre_feedforward_layernorm")?,
                norm("post_feedforward_layernorm")?,
            )),
            false => None,
        };
        Ok(Layer {
            feedforward_norms,
            input_layernorm: Norm::load(st, cfg, &format!("{p}.input_layernorm.weight"), h)?,
            post_attention_layernorm: Norm::load(
                st,
                cfg,
                &format!("{p}.post_attention_layernorm.weight"),
                h,
            )?,
            mixer,
            ffn,
        })
    }
}

impl Model<'_> {
    /// §11 / §20 decoder layer `l` on rows `x` `[T, H]` at absolute positions `pos` (causal by
    /// position), attending to `kv` plus these rows (which are appended to `kv`); a
    /// linear-attention layer continues its state in `kv`, so its rows must follow on from it.
    pub fn layer(
        &self,
        l: usize,
        x: &[f32],
        pos: &[i64],
        rope: &Ropes,
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
        let rope = rope.of_layer(&self.cfg, l);
        let a = lw.mixer.forward(l, &self.cfg, &xn, pos, rope, kv, cap)?;
        cap.tensor(&name("attn_out"), &[t, h], &a, pos);
        // §22.4: with sandwich norms each block's output is normed before its residual add.
        let (a, pre_ffn) = match &lw.feedforward_norms {
            Some((pre, _)) => (lw.post_attention_layernorm.rows(&a, eps), pre),
            None => (a, &lw.post_attention_layernorm),
        };
        let h1: Vec<f32> = x.iter().zip(&a).map(|(p, q)| p + q).collect();
        let hn = pre_ffn.rows(&h1, eps);
        let m = lw
            .ffn
            .forward(l, &self.cfg, self.forcing.as_ref(), &hn, pos, cap)?;
        cap.tensor(&name("mlp_out"), &[t, h], &m, pos);
        let m = match &lw.feedforward_norms {
            Some((_, post)) => post.rows(&m, eps),
            None => m,
        };
        let out: Vec<f32> = h1.iter().zip(&m).map(|(p, q)| p + q).collect();
        cap.tensor(&name("hidden_out"), &[t, h], &out, pos);
        Ok(out)
    }
}
