//! A decoder layer's token mixer, chosen per layer by the config (`Config::layer_kind`): softmax
//! attention (§8; §17 gated) or Gated DeltaNet (§18).

mod attention;
mod gated_deltanet;

use super::{LayerKv, Rank};
use crate::capture::Capture;
use crate::config::{Config, LayerKind};
use crate::ops::Rope;
use crate::weights::{Store, Weight};
use crate::Result;
use attention::Attention;
use gated_deltanet::GatedDeltaNet;
pub use gated_deltanet::LinearState;

/// A layer's token mixer (`config::LayerKind`).
pub(crate) enum Mixer<'a> {
    Full(Attention<'a>),
    Linear(GatedDeltaNet<'a>),
}

impl<'a> Mixer<'a> {
    /// Layer `l`'s mixer (`p` = `…layers.N`).
    pub fn load(st: &'a Store, cfg: &Config, l: usize, p: &str, comm: &Rank) -> Result<Mixer<'a>> {
        Ok(match cfg.layer_kind(l) {
            LayerKind::Full => {
                Mixer::Full(Attention::load(st, cfg, &format!("{p}.self_attn"), comm)?)
            }
            LayerKind::Linear => {
                Mixer::Linear(GatedDeltaNet::load(st, &format!("{p}.linear_attn"), cfg)?)
            }
        })
    }

    /// Its matrices (`Model::pack_panels`).
    pub fn weights<'s>(&'s self, all: &mut Vec<&'s Weight<'a>>) {
        match self {
            Mixer::Full(a) => all.extend(a.weights()),
            Mixer::Linear(g) => all.extend(g.weights()),
        }
    }

    /// The mixer on `xn` (`input_layernorm`'s output, `[T, H]`); returns attn_out.
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        l: usize,
        cfg: &Config,
        xn: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        Ok(match self {
            Mixer::Full(at) => at.forward(l, cfg, xn, pos, rope, kv, cap),
            Mixer::Linear(gdn) => gdn.forward(l, cfg, xn, pos, &mut kv.linear, cap)?,
        })
    }
}
