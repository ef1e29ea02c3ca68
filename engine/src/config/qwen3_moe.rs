//! Qwen3-MoE (`model_type` "qwen3_moe", `Qwen3MoeForCausalLM`; transformers' `Qwen3MoeConfig`):
//! Qwen3's attention with a sparse MoE block in every `decoder_sparse_step`-th layer not in
//! `mlp_only_layers`; `head_dim` is hidden_size / num_attention_heads when absent. Its MoE
//! fields are read here for Qwen3.5-MoE too, which fixes some of them (`qwen3_5`).

use serde_json::Value;

use super::fields::{field, opt_bool, opt_usize, req_usize};
use super::qwen3::QWEN3;
use super::{Family, HeadDim, ModelType, Moe};
use crate::{err, Result};

pub(super) const QWEN3_MOE: Family = Family {
    kind: ModelType::Qwen3Moe,
    model_type: "qwen3_moe",
    architecture: "Qwen3MoeForCausalLM",
    // Qwen3MoeConfig has no head_dim: the model falls back to hidden_size / num_attention_heads.
    head_dim: HeadDim::HiddenOverHeads,
    // Qwen3MoeConfig: norm_topk_prob = False.
    moe: |v| moe_fields(v, false),
    // Otherwise as Qwen3: num_key_value_heads required (Qwen3MoeConfig's default, 4, is no
    // checkpoint's), an untied head, SiLU, full attention only, the default rope type.
    ..QWEN3
};

/// The MoE fields, read (and refused) in this order, so the first refusal named is the same as
/// ever: the expert count (`num_experts`, or `num_local_experts`, equal when both are given), the
/// top-k, `mlp_only_layers`, the experts' width, then `norm_topk_prob` (absent:
/// `norm_topk_prob`), `decoder_sparse_step` (absent: 1).
pub(super) fn moe_fields(v: &Value, norm_topk_prob: bool) -> Result<Moe> {
    let ne = match (field(v, "num_experts"), field(v, "num_local_experts")) {
        (Some(_), Some(_))
            if opt_usize(v, "num_experts")? != opt_usize(v, "num_local_experts")? =>
        {
            return Err(err!(Config:
                "config.json: num_experts and num_local_experts disagree"
            ));
        }
        (Some(x), _) | (None, Some(x)) => x.as_u64().ok_or_else(
            || err!(Config: "config.json: num_experts = {x} is not a non-negative integer"),
        )? as usize,
        (None, None) => return Err(err!(Config: "config.json: missing field num_experts")),
    };
    let k = field(v, "num_experts_per_tok")
        .ok_or_else(|| err!(Config: "config.json: missing field num_experts_per_tok"))?
        .as_u64()
        .ok_or_else(|| err!(Config: "config.json: num_experts_per_tok is not an integer"))?
        as usize;
    if ne > 0 && (k < 1 || k >= ne) {
        return Err(
            err!(Config: "config.json: num_experts_per_tok = {k} not supported with num_experts = {ne} (need 1 ≤ k < num_experts)"),
        );
    }
    let mlp_only_layers = match field(v, "mlp_only_layers") {
        None => vec![],
        Some(x) => x
            .as_array()
            .and_then(|l| {
                l.iter()
                    .map(|i| i.as_u64().map(|i| i as usize))
                    .collect::<Option<Vec<_>>>()
            })
            .ok_or_else(|| {
                err!(Config:
                    "config.json: mlp_only_layers = {x} is not a list of layer indices"
                )
            })?,
    };
    let moe_intermediate_size = if ne > 0 {
        req_usize(v, "moe_intermediate_size")?
    } else {
        0
    };
    Ok(Moe {
        num_experts: ne,
        num_experts_per_tok: k,
        moe_intermediate_size,
        norm_topk_prob: opt_bool(v, "norm_topk_prob", norm_topk_prob)?,
        decoder_sparse_step: opt_usize(v, "decoder_sparse_step")?.unwrap_or(1),
        mlp_only_layers,
    })
}
