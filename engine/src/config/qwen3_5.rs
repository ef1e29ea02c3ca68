//! Qwen3.5 dense and MoE (transformers' `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`), each as a
//! language model (`qwen3_5_text`, `qwen3_5_moe_text`) or inside a multimodal checkpoint
//! (`qwen3_5`, `qwen3_5_moe`, its fields under `text_config`): hybrid linear/full attention
//! (`layer_types`, else every 4th layer full), the `linear_*` sizes, `head_dim` 256 and
//! `partial_rotary_factor` 0.25 when absent, the multimodal rope's sections, the fixed choices of
//! its MoE block; and the tensors its checkpoints carry for parts the language model does not
//! run.

use serde_json::Value;

use super::fields::{field, layer_type_list, opt_bool, opt_usize, req_usize, rope_params};
use super::qwen3_moe::moe_fields;
use super::{
    dense, Family, HeadDim, LayerKind, LayerTypes, Layout, LinearSizes, ModelType, Moe, Rope,
};
use crate::{err, Result};

pub(super) const QWEN3_5_TEXT: Family = Family {
    kind: ModelType::Qwen3_5,
    model_type: "qwen3_5_text",
    layout: Layout::Text,
    architecture: "Qwen3_5ForCausalLM",
    // Required: Qwen3_5TextConfig's default (4) is no checkpoint's.
    mha_by_default: false,
    // Qwen3_5TextConfig declares head_dim = 256.
    head_dim: HeadDim::Fixed(256),
    tie_word_embeddings: false,
    reads_mlp_bias: false,
    silu_mlp: true,
    // Only the leading 2·ceil(rotary_dim/2) dims rotate (checked in `rope`).
    odd_head_dim: true,
    reads_intermediate_size: true,
    layer_types: qwen3_5_layer_types,
    moe: dense,
    rope,
    linear: |v, layer_types| Ok((linear_sizes(v, layer_types)?, 0)),
};

pub(super) const QWEN3_5_MOE_TEXT: Family = Family {
    kind: ModelType::Qwen3_5Moe,
    model_type: "qwen3_5_moe_text",
    architecture: "Qwen3_5MoeForCausalLM",
    // §13: no dense MLP, and the field is not read.
    reads_intermediate_size: false,
    moe: |v| {
        // Its router always renormalises: norm_topk_prob is true when absent, refused if false.
        let m = moe_fields(v, true)?;
        qwen3_5_moe_fixed(&m)?;
        Ok(m)
    },
    linear: |v, layer_types| {
        Ok((
            linear_sizes(v, layer_types)?,
            req_usize(v, "shared_expert_intermediate_size")?,
        ))
    },
    ..QWEN3_5_TEXT
};

/// The multimodal checkpoints: the same language model under `text_config`.
pub(super) const QWEN3_5: Family = Family {
    model_type: "qwen3_5",
    layout: Layout::Multimodal,
    architecture: "Qwen3_5ForConditionalGeneration",
    ..QWEN3_5_TEXT
};
pub(super) const QWEN3_5_MOE: Family = Family {
    model_type: "qwen3_5_moe",
    layout: Layout::Multimodal,
    architecture: "Qwen3_5MoeForConditionalGeneration",
    ..QWEN3_5_MOE_TEXT
};

/// `rope_params` with Qwen3.5's partial rotation and multimodal sections; §16: an odd rotary dim
/// rounds up to 2·ceil(d_r/2) rotated dims, as transformers does; they fit in the head unless
/// the whole (odd) head would rotate, which transformers refuses (head_dim > 4) or fails to
/// broadcast.
fn rope(v: &Value, _layers: usize, head_dim: usize) -> Result<Rope> {
    let (theta, partial, scaling) = rope_params(v, true, false)?;
    let r = Rope::whole(theta, partial, scaling, head_dim);
    let width = r.rotary_dim.div_ceil(2) * 2;
    if r.rotary_dim == 0 {
        return Err(err!(Config:
            "config.json: partial_rotary_factor = {partial} gives 0 rotary dims of head_dim {head_dim}; they must be positive"
        ));
    }
    if width > head_dim {
        return Err(err!(Config:
            "config.json: partial_rotary_factor = {partial} gives the odd rotary dim {}, which rotates {width} dims, more than head_dim {head_dim} (docs/numerics.md §16)",
            r.rotary_dim
        ));
    }
    Ok(r)
}

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
fn qwen3_5_layer_types(v: &Value, num_hidden_layers: usize) -> Result<LayerTypes> {
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
fn linear_sizes(v: &Value, layer_types: &LayerTypes) -> Result<Option<LinearSizes>> {
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
fn qwen3_5_moe_fixed(m: &Moe) -> Result<()> {
    let (num_experts, decoder_sparse_step) = (m.num_experts, m.decoder_sparse_step);
    let mlp_only_layers = &m.mlp_only_layers;
    if num_experts < 2 {
        return Err(
            err!(Config: "config.json: num_experts = {num_experts} not supported for Qwen3.5-MoE (every layer is sparse; need at least 2)"),
        );
    }
    if !m.norm_topk_prob {
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
