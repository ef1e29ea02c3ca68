//! A decoder layer's feed-forward block, chosen per layer by the config (`Config::is_sparse`):
//! the dense gated MLP (§9) or the sparse MoE block (§10) with, where the config gives one,
//! its shared expert (§19).

mod mlp;
mod moe;
mod shared_expert;

use crate::capture::Capture;
use crate::config::Config;
use crate::force::Forcing;
use crate::model::Rank;
use crate::weights::{Store, Weight};
use crate::Result;
use mlp::{gated_mlp, Mlp};
use moe::Moe;

pub(crate) enum Ffn<'a> {
    Dense(Box<Mlp<'a>>),
    Moe(Moe<'a>),
}

impl<'a> Ffn<'a> {
    /// Layer `l`'s block (`p` = `…layers.N`; its tensors under `{p}.mlp`).
    pub fn load(st: &'a Store, cfg: &Config, l: usize, p: &str, comm: &Rank) -> Result<Ffn<'a>> {
        Ok(if cfg.is_sparse(l) {
            Ffn::Moe(Moe::load(st, cfg, &format!("{p}.mlp"), comm)?)
        } else {
            let inter = cfg.intermediate_size.expect("checked in Config::from_json");
            Ffn::Dense(Box::new(Mlp::load(
                st,
                cfg,
                &format!("{p}.mlp"),
                inter,
                comm,
            )?))
        })
    }

    /// Its matrices (`Model::pack_panels`).
    pub fn weights<'s>(&'s self, all: &mut Vec<&'s Weight<'a>>) {
        match self {
            Ffn::Dense(m) => all.extend(m.weights()),
            Ffn::Moe(moe) => moe.weights(all),
        }
    }

    /// The block on `hn` (`post_attention_layernorm`'s output, `[T, H]`); returns mlp_out.
    pub fn forward(
        &self,
        l: usize,
        cfg: &Config,
        forcing: Option<&Forcing>,
        hn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        Ok(match self {
            Ffn::Dense(mlp) => gated_mlp(mlp, hn, pos.len()),
            Ffn::Moe(moe) => moe.forward(l, cfg, forcing, hn, pos, cap)?,
        })
    }
}
