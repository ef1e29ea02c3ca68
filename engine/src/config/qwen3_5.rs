//! What only Qwen3.5 reads: the multimodal layout's `text_config`, `layer_types`, the
//! `linear_*` sizes and the fixed choices of its MoE block; and the tensors its checkpoints
//! carry for parts the language model does not run.

use serde_json::Value;

use super::fields::{field, layer_type_list, opt_bool, opt_usize, req_usize};
use super::{LayerKind, LayerTypes, LinearSizes, ModelType};
use crate::{err, Result};

/// Prefixes of the tensors a Qwen3.5 checkpoint carries and the language model does not run:
/// the vision tower and the multi-token-prediction head (§20).
pub(super) const UNUSED_PREFIXES: [&str; 2] = ["model.visual.", "mtp."];

/// The multimodal layout's language-model fields: `text_config` (an object whose `model_type`,
/// when given, is the family's text model type), and the head's tying from the top level. A
/// `text_config.tie_word_embeddings` that disagrees with it is refused: transformers would
/// silently follow the top level.
pub(super) fn text_config(root: &Value, family: ModelType) -> Result<(&Value, bool)> {
    let tc = field(root, "text_config")
        .filter(|t| t.is_object())
        .ok_or_else(|| err!(Config: "config.json: text_config missing or not an object"))?;
    let want = match family {
        ModelType::Qwen3_5Moe => "qwen3_5_moe_text",
        _ => "qwen3_5_text",
    };
    if let Some(m) = field(tc, "model_type") {
        if m.as_str() != Some(want) {
            return Err(err!(Config:
                "config.json: text_config.model_type = {m} not supported here (expected \"{want}\")"
            ));
        }
    }
    let tie = opt_bool(root, "tie_word_embeddings", false)?;
    if let Some(inner) = field(tc, "tie_word_embeddings") {
        if inner.as_bool() != Some(tie) {
            return Err(err!(Config:
                "config.json: text_config.tie_word_embeddings = {inner} disagrees with tie_word_embeddings = {tie} (transformers ties the head by the top-level field)"
            ));
        }
    }
    Ok((tc, tie))
}

/// Qwen3.5's `layer_types`: one of `linear_attention` / `full_attention` per layer, or, when
/// absent, every `full_attention_interval`-th layer full (default 4), as transformers builds it.
pub(super) fn qwen3_5_layer_types(v: &Value, num_hidden_layers: usize) -> Result<LayerTypes> {
    let kinds = [
        ("linear_attention", LayerKind::Linear),
        ("full_attention", LayerKind::Full),
    ];
    Ok(match layer_type_list(v, num_hidden_layers, kinds)? {
        Some(list) => LayerTypes::List(list),
        None => LayerTypes::Interval(opt_usize(v, "full_attention_interval")?.unwrap_or(4)),
    })
}

/// Qwen3.5's `linear_*` sizes (§13: required, as every size is, when some layer is linear
/// attention; not read otherwise); each value head reads key head
/// `h / (num_value_heads / num_key_heads)`, so the value heads must be a multiple.
pub(super) fn linear_sizes(v: &Value, layer_types: &LayerTypes) -> Result<Option<LinearSizes>> {
    let any_linear = match layer_types {
        LayerTypes::AllFull => false,
        LayerTypes::List(kinds) => kinds.contains(&LayerKind::Linear),
        // Layer 0 is linear unless every layer is full (the count is at least 1).
        LayerTypes::Interval(n) => *n > 1,
    };
    if !any_linear {
        return Ok(None);
    }
    let s = LinearSizes {
        conv_kernel: req_usize(v, "linear_conv_kernel_dim")?,
        key_head_dim: req_usize(v, "linear_key_head_dim")?,
        value_head_dim: req_usize(v, "linear_value_head_dim")?,
        num_key_heads: req_usize(v, "linear_num_key_heads")?,
        num_value_heads: req_usize(v, "linear_num_value_heads")?,
    };
    if !s.num_value_heads.is_multiple_of(s.num_key_heads) {
        return Err(err!(Config:
            "config.json: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}",
            s.num_value_heads,
            s.num_key_heads
        ));
    }
    Ok(Some(s))
}

/// Qwen3.5-MoE's block is sparse in every layer and always renormalises the top-k weights
/// (transformers' `Qwen3_5MoeSparseMoeBlock` reads no field for either): a config asking for
/// anything else is refused rather than ignored.
pub(super) fn qwen3_5_moe_fixed(
    num_experts: usize,
    norm_topk_prob: bool,
    decoder_sparse_step: usize,
    mlp_only_layers: &[usize],
) -> Result<()> {
    if num_experts < 2 {
        return Err(
            err!(Config: "config.json: num_experts = {num_experts} not supported for Qwen3.5-MoE (every layer is sparse; need at least 2)"),
        );
    }
    if !norm_topk_prob {
        return Err(
            err!(Config: "config.json: norm_topk_prob = false not supported for Qwen3.5-MoE (its router always renormalises)"),
        );
    }
    if decoder_sparse_step != 1 {
        return Err(
            err!(Config: "config.json: decoder_sparse_step = {decoder_sparse_step} not supported for Qwen3.5-MoE (only 1: every layer is sparse)"),
        );
    }
    if !mlp_only_layers.is_empty() {
        return Err(
            err!(Config: "config.json: mlp_only_layers = {mlp_only_layers:?} not supported for Qwen3.5-MoE (only []: every layer is sparse)"),
        );
    }
    Ok(())
}
