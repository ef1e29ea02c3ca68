//! Qwen2 and Qwen2.5 (`model_type` "qwen2", `Qwen2ForCausalLM`; transformers' `Qwen2Config`):
//! llama's layer with a bias on q, k and v that no field turns off (and none on o_proj:
//! `ModelType::fixed_qkv_bias`), the default rope type only, no sliding window.

use super::qwen3::QWEN3;
use super::{Family, HeadDim, ModelType};

pub(super) const QWEN2: Family = Family {
    kind: ModelType::Qwen2,
    model_type: "qwen2",
    architecture: "Qwen2ForCausalLM",
    // Qwen2Config has no head_dim: the model falls back to hidden_size / num_attention_heads.
    head_dim: HeadDim::HiddenOverHeads,
    // Otherwise as Qwen3: num_key_value_heads required (Qwen2Config's default, 32, is no
    // checkpoint's), an untied head, SiLU, full attention only, the default rope type.
    ..QWEN3
};
