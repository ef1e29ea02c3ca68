//! Qwen2 and Qwen2.5 (`model_type` "qwen2", `Qwen2ForCausalLM`; transformers' `Qwen2Config`):
//! llama's layer with a bias on q, k and v that no field turns off (and none on o_proj:
//! `ModelType::fixed_qkv_bias`), the default rope type only, no sliding window.

use super::fields::{full_attention_only, plain_rope};
use super::{dense, no_linear, Family, HeadDim, Layout, ModelType};

pub(super) const QWEN2: Family = Family {
    kind: ModelType::Qwen2,
    model_type: "qwen2",
    layout: Layout::Text,
    architecture: "Qwen2ForCausalLM",
    // Required: Qwen2Config's default (32, or one per query head when null) is no checkpoint's.
    mha_by_default: false,
    // Qwen2Config has no head_dim: the model falls back to hidden_size / num_attention_heads.
    head_dim: HeadDim::HiddenOverHeads,
    tie_word_embeddings: false,
    reads_mlp_bias: false,
    silu_mlp: true,
    odd_head_dim: false,
    reads_intermediate_size: true,
    layer_types: full_attention_only,
    moe: dense,
    rope: plain_rope,
    linear: no_linear,
};
