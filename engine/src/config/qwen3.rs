//! Qwen3 dense (`model_type` "qwen3", `Qwen3ForCausalLM`; transformers' `Qwen3Config`): q/k
//! norms, `head_dim` 128 when absent, the default rope type only, no sliding window.

use super::fields::{full_attention_only, plain_rope};
use super::{dense, no_linear, Family, HeadDim, Layout, ModelType};

pub(super) const QWEN3: Family = Family {
    kind: ModelType::Qwen3,
    model_type: "qwen3",
    layout: Layout::Text,
    architecture: "Qwen3ForCausalLM",
    // Required: Qwen3Config's default (32, or one per query head when null) is no checkpoint's.
    mha_by_default: false,
    // Qwen3Config declares head_dim = 128.
    head_dim: HeadDim::Fixed(128),
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
