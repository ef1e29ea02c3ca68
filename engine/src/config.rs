//! The model's `config.json` (docs/numerics.md §13): the fields that change the forward pass, one
//! struct field per JSON field (flat, as in the file), with transformers' defaults and the
//! refusals of §7/§13. The contract's mirror is contract/tracegate_contract/config.py.

use std::path::Path;

use serde_json::Value;

use crate::weights::Store;
use crate::{err, Result};

/// Positions are absolute token indices below 2^24 (f32 holds every integer up to it, §7).
pub const MAX_POSITIONS: usize = 1 << 24;

/// `model_type`s of the oracle's family table (oracle/tracegate_oracle/families.py; equality
/// checked by oracle/tests/test_families.py): the refusal tells their users where to go.
pub const ORACLE_FAMILIES: [&str; 14] = [
    "gemma3_text",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_5_text",
    "qwen3_moe",
];

/// Why a `model_type` is refused; same text as the contract's (contract/tracegate_contract/qwen3.py).
pub fn unsupported_family(model_type: &str) -> String {
    if ORACLE_FAMILIES.contains(&model_type) {
        "not supported by the bit-exact producers (engine, contract: qwen3, qwen3_moe and the Qwen3.5 families); the oracle supports it: \
         python -m tracegate_oracle, trace-diff and gate bisect --reference oracle (docs/capture-points.md)"
            .to_string()
    } else {
        "not supported (engine, contract: qwen3, qwen3_moe and the Qwen3.5 families; oracle: the families of docs/capture-points.md)".to_string()
    }
}

/// The families this engine computes (a `model_type` of either layout names one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    Qwen3,
    Qwen3Moe,
    /// Qwen3.5 dense: `qwen3_5_text`, or `qwen3_5` with `text_config`.
    Qwen3_5,
    /// Qwen3.5-MoE: `qwen3_5_moe_text`, or `qwen3_5_moe` with `text_config`.
    Qwen3_5Moe,
}

impl ModelType {
    /// The Qwen3.5 families: hybrid linear/full attention, zero-centred norms, gated attention.
    pub fn is_qwen3_5(self) -> bool {
        matches!(self, ModelType::Qwen3_5 | ModelType::Qwen3_5Moe)
    }
}

/// Where the language model's tensors are: `model.*` (a ForCausalLM checkpoint) or
/// `model.language_model.*` (a ForConditionalGeneration checkpoint, vision tower beside it).
/// The head is `lm_head.weight` in both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    Text,
    Multimodal,
}

impl Layout {
    /// Prefix of the language model's tensors (`{prefix}embed_tokens.weight`, `{prefix}layers.N.…`).
    pub fn prefix(self) -> &'static str {
        match self {
            Layout::Text => "model.",
            Layout::Multimodal => "model.language_model.",
        }
    }
}

/// A layer's token mixer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Softmax attention over the cached keys (Qwen3's §8; Qwen3.5's gated, partially rotated).
    Full,
    /// Qwen3.5's Gated DeltaNet: causal conv1d and the delta-rule recurrence over a state.
    Linear,
}

/// Which layers are linear attention: none (Qwen3), the config's `layer_types` list, or every
/// `interval`-th layer full (`full_attention_interval`, transformers' default when
/// `layer_types` is absent) — kept as a rule, since the layer count is not yet bounded by the
/// checkpoint when the config is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LayerTypes {
    AllFull,
    List(Vec<LayerKind>),
    Interval(usize),
}

/// Qwen3.5's Gated DeltaNet sizes (`linear_*` fields).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinearSizes {
    pub conv_kernel: usize,
    pub key_head_dim: usize,
    pub value_head_dim: usize,
    pub num_key_heads: usize,
    pub num_value_heads: usize,
}

impl LinearSizes {
    /// Width of `in_proj_qkv`'s output and of the conv: q and k (`num_key_heads · key_head_dim`
    /// each), then v (`num_value_heads · value_head_dim`).
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    pub fn key_dim(&self) -> usize {
        self.num_key_heads * self.key_head_dim
    }
    pub fn value_dim(&self) -> usize {
        self.num_value_heads * self.value_head_dim
    }
}

/// The computation-changing fields of a Qwen3 / Qwen3-MoE `config.json` (numerics.md §13).
/// The MoE fields are 0 / false / empty for `qwen3`, as in the contract's `Config`.
#[derive(Clone, Debug)]
pub struct Config {
    pub model_type: ModelType,
    pub layout: Layout,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense MLP width; `None` only for an all-sparse MoE model that does not declare it.
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// binary64 as parsed; the forward uses `eps_f32` (§6).
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// Which layers are linear attention (all full for Qwen3).
    pub layer_types: LayerTypes,
    /// Leading dims of each q/k head that RoPE rotates: `head_dim` for Qwen3,
    /// `int(head_dim · partial_rotary_factor)` for Qwen3.5.
    pub rotary_dim: usize,
    /// Qwen3.5's Gated DeltaNet sizes (`None` for Qwen3).
    pub linear: Option<LinearSizes>,
    /// Qwen3.5-MoE's shared expert width (0: no shared expert).
    pub shared_expert_intermediate_size: usize,
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}
fn req_usize(v: &Value, key: &str) -> Result<usize> {
    let x = field(v, key).ok_or_else(|| err!(Config: "config.json: missing field {key}"))?;
    x.as_u64()
        .filter(|&n| n >= 1)
        .map(|n| n as usize)
        .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a positive integer"))
}
fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match field(v, key) {
        None => Ok(None),
        Some(_) => req_usize(v, key).map(Some),
    }
}
fn opt_bool(v: &Value, key: &str, default: bool) -> Result<bool> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a boolean")),
    }
}
fn opt_f64(v: &Value, key: &str, default: f64) -> Result<f64> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a finite number")),
    }
}

/// Rope theta, `partial_rotary_factor` and the refusals of §7/§13, following transformers'
/// resolution: a non-empty legacy `rope_scaling` replaces `rope_parameters`; theta comes from that
/// dict, else the top-level `rope_theta`, else 10000; the factor from that dict, else the
/// top-level field, else the family's default (1 for Qwen3, where only 1 is accepted; 0.25 for
/// Qwen3.5). Qwen3.5 also accepts the multimodal rope's `mrope_section` (three non-negative
/// integers) and `mrope_interleaved` (a boolean): with text-only input the three position rows
/// transformers builds are equal, so every section rotates by the same 1-D position and the
/// sections change nothing.
fn rope_params(v: &Value, qwen3_5: bool) -> Result<(f64, f64)> {
    let (dict, dict_name) = match field(v, "rope_scaling") {
        Some(x) if x.as_object().is_some_and(|m| !m.is_empty()) => (Some(x), "rope_scaling"),
        Some(x) if !x.is_object() => {
            return Err(err!(Config:
                "config.json: rope_scaling = {x} is not an object or null"
            ))
        }
        _ => (field(v, "rope_parameters"), "rope_parameters"),
    };
    let top_theta = opt_f64(v, "rope_theta", 10000.0)?;
    let factor = |x: &Value, name: &str| -> Result<f64> {
        match x.as_f64() {
            Some(f) if qwen3_5 && f > 0.0 && f <= 1.0 => Ok(f),
            Some(f) if f == 1.0 => Ok(f),
            _ if qwen3_5 => Err(err!(Config:
                "config.json: {name} = {x} not supported (need 0 < factor ≤ 1)"
            )),
            _ => Err(err!(Config: "config.json: {name} = {x} not supported (only 1)")),
        }
    };
    let mut partial = if qwen3_5 { 0.25 } else { 1.0 };
    if let Some(f) = field(v, "partial_rotary_factor") {
        partial = factor(f, "partial_rotary_factor")?;
    }
    let Some(d) = dict else {
        return Ok((positive_theta(top_theta)?, partial));
    };
    let obj = d
        .as_object()
        .ok_or_else(|| err!(Config: "config.json: {dict_name} is not an object"))?;
    for key in ["rope_type", "type"] {
        if let Some(t) = obj.get(key).filter(|x| !x.is_null()) {
            if t.as_str() != Some("default") {
                return Err(err!(Config:
                    "config.json: {dict_name}.{key} = {t} not supported (only \"default\")"
                ));
            }
        }
    }
    if let Some(f) = obj.get("partial_rotary_factor").filter(|x| !x.is_null()) {
        partial = factor(f, &format!("{dict_name}.partial_rotary_factor"))?;
    }
    if qwen3_5 {
        if let Some(m) = obj.get("mrope_section").filter(|x| !x.is_null()) {
            if !m
                .as_array()
                .is_some_and(|l| l.len() == 3 && l.iter().all(|i| i.is_u64()))
            {
                return Err(err!(Config:
                    "config.json: {dict_name}.mrope_section = {m} is not three non-negative integers"
                ));
            }
        }
        if let Some(m) = obj.get("mrope_interleaved").filter(|x| !x.is_null()) {
            if !m.is_boolean() {
                return Err(err!(Config:
                    "config.json: {dict_name}.mrope_interleaved = {m} is not a boolean"
                ));
            }
        }
    }
    let known: &[&str] = if qwen3_5 {
        &[
            "rope_type",
            "type",
            "rope_theta",
            "partial_rotary_factor",
            "mrope_section",
            "mrope_interleaved",
        ]
    } else {
        &["rope_type", "type", "rope_theta", "partial_rotary_factor"]
    };
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(err!(Config:
            "config.json: {dict_name}.{k} not supported with the default rope type"
        ));
    }
    Ok((
        positive_theta(opt_f64(d, "rope_theta", top_theta)?)?,
        partial,
    ))
}

/// A theta ≤ 0 makes every inverse frequency NaN or infinite: refuse it here rather than
/// produce NaN logits later.
fn positive_theta(theta: f64) -> Result<f64> {
    if theta > 0.0 {
        Ok(theta)
    } else {
        Err(err!(Config: "config.json: rope_theta = {theta} is not positive"))
    }
}

/// The multimodal layout's language-model fields: `text_config` (an object whose `model_type`,
/// when given, is the family's text model type), and the head's tying from the top level. A
/// `text_config.tie_word_embeddings` that disagrees with it is refused: transformers would
/// silently follow the top level.
fn text_config(root: &Value, family: ModelType) -> Result<(&Value, bool)> {
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
    let Some(lt) = field(v, "layer_types") else {
        return Ok(LayerTypes::Interval(
            opt_usize(v, "full_attention_interval")?.unwrap_or(4),
        ));
    };
    let kinds = lt
        .as_array()
        .and_then(|l| {
            l.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Some(LayerKind::Full),
                    Some("linear_attention") => Some(LayerKind::Linear),
                    _ => None,
                })
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            err!(Config:
                "config.json: layer_types = {lt} not supported (only \"linear_attention\" and \"full_attention\")"
            )
        })?;
    if kinds.len() != num_hidden_layers {
        return Err(err!(Config:
            "config.json: layer_types has {} entries for num_hidden_layers = {num_hidden_layers}",
            kinds.len()
        ));
    }
    Ok(LayerTypes::List(kinds))
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
fn qwen3_5_moe_fixed(
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

impl Config {
    pub fn from_json(root: &Value) -> Result<Config> {
        if !root.is_object() {
            return Err(err!(Config: "config.json: not a JSON object"));
        }
        let model_type = field(root, "model_type")
            .and_then(|m| m.as_str())
            .unwrap_or("");
        let (family, layout, want_arch) = match model_type {
            "qwen3" => (ModelType::Qwen3, Layout::Text, "Qwen3ForCausalLM"),
            "qwen3_moe" => (ModelType::Qwen3Moe, Layout::Text, "Qwen3MoeForCausalLM"),
            "qwen3_5_text" => (ModelType::Qwen3_5, Layout::Text, "Qwen3_5ForCausalLM"),
            "qwen3_5_moe_text" => (ModelType::Qwen3_5Moe, Layout::Text, "Qwen3_5MoeForCausalLM"),
            "qwen3_5" => (
                ModelType::Qwen3_5,
                Layout::Multimodal,
                "Qwen3_5ForConditionalGeneration",
            ),
            "qwen3_5_moe" => (
                ModelType::Qwen3_5Moe,
                Layout::Multimodal,
                "Qwen3_5MoeForConditionalGeneration",
            ),
            other => {
                return Err(err!(Config:
                    "config.json: model_type {other:?} {}",
                    unsupported_family(other)
                ))
            }
        };
        if let Some(a) = field(root, "architectures") {
            let ok = a
                .as_array()
                .is_some_and(|l| l.len() == 1 && l[0].as_str() == Some(want_arch));
            if !ok {
                return Err(
                    err!(Config: "config.json: architectures = {a} not supported for model_type {model_type} (expected [\"{want_arch}\"])"),
                );
            }
        }
        // The multimodal layout keeps the language model's fields under `text_config`; the head's
        // tying is the top-level field there (transformers ties `lm_head` by the outer config).
        let (v, outer_tie) = match layout {
            Layout::Text => (root, None),
            Layout::Multimodal => {
                let (tc, tie) = text_config(root, family)?;
                (tc, Some(tie))
            }
        };
        let qwen3_5 = family.is_qwen3_5();
        if let Some(act) = field(v, "hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(err!(Config:
                    "config.json: hidden_act = {act} not supported (only \"silu\")"
                ));
            }
        }
        if opt_bool(v, "use_sliding_window", false)? {
            return Err(err!(Config: "config.json: use_sliding_window = true not supported"));
        }
        let num_hidden_layers = req_usize(v, "num_hidden_layers")?;
        let layer_types = if qwen3_5 {
            qwen3_5_layer_types(v, num_hidden_layers)?
        } else {
            if let Some(lt) = field(v, "layer_types") {
                let ok = lt
                    .as_array()
                    .is_some_and(|l| l.iter().all(|t| t.as_str() == Some("full_attention")));
                if !ok {
                    return Err(err!(Config:
                        "config.json: layer_types = {lt} not supported (only \"full_attention\")"
                    ));
                }
            }
            LayerTypes::AllFull
        };
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_attention_heads = req_usize(v, "num_attention_heads")?;
        let num_key_value_heads = req_usize(v, "num_key_value_heads")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(
                err!(Config: "config.json: num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"),
            );
        }
        // transformers: Qwen3Config declares head_dim = 128; Qwen3MoeConfig has no such field and
        // the model falls back to hidden_size / num_attention_heads.
        // Qwen3_5TextConfig and Qwen3_5MoeTextConfig declare head_dim = 256.
        let head_dim = match (opt_usize(v, "head_dim")?, family) {
            (Some(d), _) => d,
            (None, ModelType::Qwen3) => 128,
            (None, ModelType::Qwen3Moe) => hidden_size / num_attention_heads,
            (None, ModelType::Qwen3_5 | ModelType::Qwen3_5Moe) => 256,
        };
        // Qwen3.5 rotates only the leading `rotary_dim` dims (checked below), which must pair up;
        // its head_dim itself may be odd.
        if !qwen3_5 && (head_dim % 2 != 0 || head_dim == 0) {
            let from = if field(v, "head_dim").is_some() {
                String::new()
            } else {
                format!(" (hidden_size {hidden_size} / num_attention_heads {num_attention_heads})")
            };
            return Err(err!(Config:
                "config.json: head_dim = {head_dim}{from} must be even and positive"
            ));
        }
        // Not used by the forward, but a size all the same: positions must stay below 2^24 (§7).
        if let Some(m) = opt_usize(v, "max_position_embeddings")? {
            if m > MAX_POSITIONS {
                return Err(
                    err!(Config: "config.json: max_position_embeddings = {m} exceeds the position limit 2^24 = {MAX_POSITIONS}"),
                );
            }
        }
        // (num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
        // decoder_sparse_step, mlp_only_layers): read (and refused) before the sizes below, in
        // this order, so the first refusal named is the same as ever.
        let moe = match family {
            ModelType::Qwen3 | ModelType::Qwen3_5 => (0, 0, 0, false, 1, vec![]),
            ModelType::Qwen3Moe | ModelType::Qwen3_5Moe => {
                let ne = match (field(v, "num_experts"), field(v, "num_local_experts")) {
                    (Some(_), Some(_))
                        if opt_usize(v, "num_experts")? != opt_usize(v, "num_local_experts")? =>
                    {
                        return Err(err!(Config:
                            "config.json: num_experts and num_local_experts disagree"
                        ));
                    }
                    (Some(x), _) | (None, Some(x)) => x.as_u64().ok_or_else(|| {
                        err!(Config: "config.json: num_experts = {x} is not a non-negative integer")
                    })? as usize,
                    (None, None) => return Err(err!(Config: "config.json: missing field num_experts")),
                };
                let k = field(v, "num_experts_per_tok")
                    .ok_or_else(|| err!(Config: "config.json: missing field num_experts_per_tok"))?
                    .as_u64()
                    .ok_or_else(
                        || err!(Config: "config.json: num_experts_per_tok is not an integer"),
                    )? as usize;
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
                let norm_topk_prob = opt_bool(v, "norm_topk_prob", qwen3_5)?;
                let decoder_sparse_step = opt_usize(v, "decoder_sparse_step")?.unwrap_or(1);
                if qwen3_5 {
                    qwen3_5_moe_fixed(ne, norm_topk_prob, decoder_sparse_step, &mlp_only_layers)?;
                }
                (
                    ne,
                    k,
                    moe_intermediate_size,
                    norm_topk_prob,
                    decoder_sparse_step,
                    mlp_only_layers,
                )
            }
        };
        let (
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            norm_topk_prob,
            decoder_sparse_step,
            mlp_only_layers,
        ) = moe;
        // Read in this order (the first refusal named stays the same).
        let vocab_size = req_usize(v, "vocab_size")?;
        // §13: the Qwen3.5-MoE family has no dense MLP and does not read the field.
        let intermediate_size = match family {
            ModelType::Qwen3_5Moe => None,
            _ => opt_usize(v, "intermediate_size")?,
        };
        let rms_norm_eps = opt_f64(v, "rms_norm_eps", 1e-6)?;
        let (rope_theta, partial) = rope_params(v, qwen3_5)?;
        let rotary_dim = (head_dim as f64 * partial) as usize; // transformers: int(head_dim * factor)
        if qwen3_5 && (!rotary_dim.is_multiple_of(2) || rotary_dim == 0) {
            return Err(err!(Config:
                "config.json: partial_rotary_factor = {partial} gives {rotary_dim} rotary dims of head_dim {head_dim}; they must be even and positive"
            ));
        }
        let (linear, shared_expert_intermediate_size) = match family {
            ModelType::Qwen3 | ModelType::Qwen3Moe => (None, 0),
            ModelType::Qwen3_5 => (linear_sizes(v, &layer_types)?, 0),
            ModelType::Qwen3_5Moe => (
                linear_sizes(v, &layer_types)?,
                req_usize(v, "shared_expert_intermediate_size")?,
            ),
        };
        let cfg = Config {
            model_type: family,
            layout,
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            tie_word_embeddings: match outer_tie {
                Some(t) => t,
                None => opt_bool(v, "tie_word_embeddings", false)?,
            },
            attention_bias: opt_bool(v, "attention_bias", false)?,
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            norm_topk_prob,
            decoder_sparse_step,
            mlp_only_layers,
            layer_types,
            rotary_dim,
            linear,
            shared_expert_intermediate_size,
        };
        if cfg.vocab_size < 2 {
            return Err(err!(Config:
                "config.json: vocab_size = {} (argmax margins need at least 2)",
                cfg.vocab_size
            ));
        }
        if cfg.intermediate_size.is_none() && cfg.has_dense_layer() {
            return Err(err!(Config: "config.json: missing field intermediate_size"));
        }
        Ok(cfg)
    }

    /// §10: layer `l` uses the sparse MoE block (Qwen3.5-MoE: every layer, refused otherwise).
    pub fn is_sparse(&self, l: usize) -> bool {
        matches!(self.model_type, ModelType::Qwen3Moe | ModelType::Qwen3_5Moe)
            && self.num_experts > 0
            && !self.mlp_only_layers.contains(&l)
            && (l + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Some layer uses the dense MLP. Decided without visiting every layer: the count is not yet
    /// checked against the checkpoint here, and may be 2^62.
    fn has_dense_layer(&self) -> bool {
        let n = self.num_hidden_layers;
        // Layer 0 is dense when the step is above 1 ((0 + 1) % step ≠ 0).
        n > 0
            && (matches!(self.model_type, ModelType::Qwen3 | ModelType::Qwen3_5)
                || self.num_experts == 0
                || self.decoder_sparse_step > 1
                || self.mlp_only_layers.iter().any(|&l| l < n))
    }

    /// Layer `l`'s token mixer.
    pub fn layer_kind(&self, l: usize) -> LayerKind {
        match &self.layer_types {
            LayerTypes::AllFull => LayerKind::Full,
            LayerTypes::List(kinds) => kinds[l],
            // transformers: linear unless (l + 1) % interval == 0.
            LayerTypes::Interval(n) if (l + 1).is_multiple_of(*n) => LayerKind::Full,
            LayerTypes::Interval(_) => LayerKind::Linear,
        }
    }

    pub fn eps_f32(&self) -> f32 {
        // §6: the config's number (binary64 as parsed) rounded once to f32.
        self.rms_norm_eps as f32
    }
}

/// The `linear_*` sizes against a linear-attention layer's tensors (`a` its `linear_attn`
/// prefix), products checked for overflow: `in_proj_qkv` has `2·num_key_heads·key_head_dim +
/// num_value_heads·value_head_dim` rows, `in_proj_a` one per value head, `conv1d` the kernel's
/// width, the gated norm `value_head_dim`.
type DimCheck<'a> = dyn Fn(&str, usize, u64, &dyn Fn() -> String) -> Result<()> + 'a;
fn check_linear_sizes(s: &LinearSizes, a: &str, dim: &DimCheck) -> Result<()> {
    let over = || err!(Config: "config.json: linear_num_key_heads, linear_key_head_dim, linear_num_value_heads, linear_value_head_dim = {}, {}, {}, {} overflow the projection width", s.num_key_heads, s.key_head_dim, s.num_value_heads, s.value_head_dim);
    let kd = s
        .num_key_heads
        .checked_mul(s.key_head_dim)
        .ok_or_else(over)?;
    let vd = s
        .num_value_heads
        .checked_mul(s.value_head_dim)
        .ok_or_else(over)?;
    let conv = kd
        .checked_mul(2)
        .and_then(|x| x.checked_add(vd))
        .ok_or_else(over)?;
    dim(&format!("{a}.in_proj_qkv.weight"), 0, conv as u64, &|| {
        format!(
            "linear_num_key_heads = {} × linear_key_head_dim = {} (× 2) + linear_num_value_heads = {} × linear_value_head_dim = {} (= {conv} rows)",
            s.num_key_heads, s.key_head_dim, s.num_value_heads, s.value_head_dim
        )
    })?;
    dim(
        &format!("{a}.in_proj_a.weight"),
        0,
        s.num_value_heads as u64,
        &|| format!("linear_num_value_heads = {}", s.num_value_heads),
    )?;
    dim(
        &format!("{a}.conv1d.weight"),
        2,
        s.conv_kernel as u64,
        &|| format!("linear_conv_kernel_dim = {}", s.conv_kernel),
    )?;
    dim(
        &format!("{a}.norm.weight"),
        0,
        s.value_head_dim as u64,
        &|| format!("linear_value_head_dim = {}", s.value_head_dim),
    )?;
    Ok(())
}

/// Read and validate `<dir>/config.json`; returns the parsed config and the raw JSON.
pub fn load_config(dir: &Path) -> Result<(Config, Value)> {
    let p = dir.join("config.json");
    crate::weights::regular_file(&p)?;
    let text = std::fs::read_to_string(&p).map_err(|e| err!(Config: "{}: {e}", p.display()))?;
    let raw: Value = serde_json::from_str(&text)
        .map_err(|e| err!(Config: "{}: invalid JSON: {e}", p.display()))?;
    Ok((Config::from_json(&raw)?, raw))
}

/// Every size the config declares, checked against the checkpoint's own tensors before the model
/// allocates or loops by it: 2^40 layers or 2^62 heads are refused naming the field, never turned
/// into an allocation, a long loop or an overflowing product. A representative tensor that is
/// absent is left to `Store::take`, which refuses it by name.
pub fn check_sizes(c: &Config, st: &Store) -> Result<()> {
    let dim = |name: &str, axis: usize, want: u64, field: &dyn Fn() -> String| -> Result<()> {
        match st.shape(name) {
            Some(s) if s.get(axis).is_some_and(|&g| g != want) => Err(err!(Config:
                "config.json: {} does not match the checkpoint: {name} has shape {s:?}",
                field()
            )),
            _ => Ok(()),
        }
    };
    let product = |field: &str, x: usize, by: &str, y: usize| -> Result<u64> {
        x.checked_mul(y).map(|p| p as u64).ok_or_else(
            || err!(Config: "config.json: {field} = {x} overflows when multiplied by {by} ({y})"),
        )
    };
    let (h, v, d) = (c.hidden_size, c.vocab_size, c.head_dim);
    let m = c.layout.prefix(); // "model." or "model.language_model."
    let emb = format!("{m}embed_tokens.weight");
    dim(&emb, 0, v as u64, &|| format!("vocab_size = {v}"))?;
    dim(&emb, 1, h as u64, &|| format!("hidden_size = {h}"))?;
    let have = st.layer_count(m);
    if c.num_hidden_layers > have {
        return Err(err!(Config:
            "config.json: num_hidden_layers = {} but the checkpoint holds {have} layers ({m}layers.N tensors for N < {have})",
            c.num_hidden_layers
        ));
    }
    let layers = 0..c.num_hidden_layers; // bounded by the checkpoint now
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    if let Some(l) = layers.clone().find(|&l| c.layer_kind(l) == LayerKind::Full) {
        let a = format!("{m}layers.{l}.self_attn");
        dim(&format!("{a}.q_norm.weight"), 0, d as u64, &|| {
            format!("head_dim = {d}")
        })?;
        let q_rows = product("num_attention_heads", nq, "head_dim", d)?;
        let kv_rows = product("num_key_value_heads", nkv, "head_dim", d)?;
        // Qwen3.5's q_proj holds each head's query and output gate: twice the rows.
        let (gated, times) = if c.model_type.is_qwen3_5() {
            (q_rows.checked_mul(2), " × 2")
        } else {
            (Some(q_rows), "")
        };
        let q_rows = gated.ok_or_else(|| {
            err!(Config: "config.json: num_attention_heads = {nq} overflows when multiplied by head_dim ({d}) and 2")
        })?;
        dim(&format!("{a}.q_proj.weight"), 0, q_rows, &|| {
            format!("num_attention_heads = {nq} (× head_dim {d}{times} = {q_rows} rows)")
        })?;
        dim(&format!("{a}.k_proj.weight"), 0, kv_rows, &|| {
            format!("num_key_value_heads = {nkv} (× head_dim {d} = {kv_rows} rows)")
        })?;
    }
    if let (Some(s), Some(l)) = (
        c.linear,
        layers
            .clone()
            .find(|&l| c.layer_kind(l) == LayerKind::Linear),
    ) {
        check_linear_sizes(&s, &format!("{m}layers.{l}.linear_attn"), &dim)?;
    }
    if let (Some(i), Some(l)) = (
        c.intermediate_size,
        layers.clone().find(|&l| !c.is_sparse(l)),
    ) {
        dim(
            &format!("{m}layers.{l}.mlp.gate_proj.weight"),
            0,
            i as u64,
            &|| format!("intermediate_size = {i}"),
        )?;
    }
    if let Some(l) = layers.clone().find(|&l| c.is_sparse(l)) {
        let (ne, mi) = (c.num_experts, c.moe_intermediate_size);
        let p = format!("{m}layers.{l}.mlp");
        if c.shared_expert_intermediate_size > 0 {
            let si = c.shared_expert_intermediate_size;
            dim(
                &format!("{p}.shared_expert.gate_proj.weight"),
                0,
                si as u64,
                &|| format!("shared_expert_intermediate_size = {si}"),
            )?;
        }
        dim(&format!("{p}.gate.weight"), 0, ne as u64, &|| {
            format!("num_experts = {ne}")
        })?;
        let gu_rows = product("moe_intermediate_size", mi, "2 (gate and up rows)", 2)?;
        dim(&format!("{p}.experts.gate_up_proj"), 0, ne as u64, &|| {
            format!("num_experts = {ne}")
        })?;
        dim(&format!("{p}.experts.gate_up_proj"), 1, gu_rows, &|| {
            format!("moe_intermediate_size = {mi} (× 2 = {gu_rows} rows)")
        })?;
        dim(
            &format!("{p}.experts.0.gate_proj.weight"),
            0,
            mi as u64,
            &|| format!("moe_intermediate_size = {mi}"),
        )?;
    }
    Ok(())
}
