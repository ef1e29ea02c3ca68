//! Llama (`model_type` "llama", `LlamaForCausalLM`; transformers' `LlamaConfig`): the one family
//! whose absent `num_key_value_heads` is one per query head, whose rope may scale its frequencies
//! (`linear`, `llama3`, §7.1), and whose MLP may carry biases (`mlp_bias`).

use serde_json::Value;

use super::fields::{full_attention_only, rope_params};
use super::{dense, no_linear, Family, HeadDim, Layout, ModelType, Rope};
use crate::Result;

pub(super) const LLAMA: Family = Family {
    kind: ModelType::Llama,
    model_type: "llama",
    layout: Layout::Text,
    architecture: "LlamaForCausalLM",
    // LlamaConfig: an absent num_key_value_heads means one kv head per query head (MHA).
    mha_by_default: true,
    // No head_dim default: the model falls back to hidden_size / num_attention_heads.
    head_dim: HeadDim::HiddenOverHeads,
    tie_word_embeddings: false,
    reads_mlp_bias: true,
    silu_mlp: true,
    odd_head_dim: false,
    reads_intermediate_size: true,
    layer_types: full_attention_only,
    moe: dense,
    rope,
    linear: no_linear,
};

fn rope(v: &Value, _layers: usize, head_dim: usize) -> Result<Rope> {
    let (theta, partial, scaling) = rope_params(v, false, true)?;
    Ok(Rope::whole(theta, partial, scaling, head_dim))
}
