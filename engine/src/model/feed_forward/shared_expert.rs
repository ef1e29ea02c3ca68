//! §19 Qwen3.5-MoE's shared expert, added to the routed experts' sum.

use tracegate_trace::names;

use super::mlp::{gated_mlp, Mlp};
use crate::capture::Capture;
use crate::config::Config;
use crate::model::Rank;
use crate::ops;
use crate::weights::{Store, Weight};
use crate::Result;

/// §19 Qwen3.5-MoE's shared expert: a gated MLP beside the routed experts, scaled by the sigmoid
/// of its own one-output gate.
pub(crate) struct SharedExpert<'a> {
    pub(crate) mlp: Mlp<'a>,
    /// `mlp.shared_expert_gate.weight` `[1, H]`.
    pub(crate) gate: Weight<'a>,
}

impl<'a> SharedExpert<'a> {
    /// The shared expert of the MoE block under `p` (`…layers.N.mlp`), `si` wide.
    pub fn load(
        st: &'a Store,
        cfg: &Config,
        p: &str,
        si: usize,
        comm: &Rank,
    ) -> Result<SharedExpert<'a>> {
        let h = cfg.hidden_size;
        Ok(SharedExpert {
            mlp: Mlp::load(st, cfg, &format!("{p}.shared_expert"), si, comm)?,
            gate: st.weight(&format!("{p}.shared_expert_gate.weight"), &[1, h])?,
        })
    }

    /// §19.3–4 `mlp_out = routed ⊕ (sigmoid(sg) ⊗ sh)`, the routed sum complete first; captures
    /// `shared_expert.gate` (before the sigmoid) and `shared_expert.out`.
    pub fn add_to(
        &self,
        l: usize,
        mut routed: Vec<f32>,
        xn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Vec<f32> {
        let t = pos.len();
        let h = xn.len() / t;
        let sh = gated_mlp(&self.mlp, xn, t);
        let sg = ops::matmul(xn, t, self.gate.view(t), None);
        cap.internal(&names::layer(l, "shared_expert.gate"), &[t, 1], &sg, pos);
        cap.internal(&names::layer(l, "shared_expert.out"), &[t, h], &sh, pos);
        for r in 0..t {
            let sigma = ops::sigmoid(sg[r]);
            for i in 0..h {
                routed[r * h + i] += sigma * sh[r * h + i];
            }
        }
        routed
    }
}
