//! From a GGUF file's names and metadata to the Hugging Face checkpoint transformers' own GGUF
//! loader builds (`transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`, transformers
//! 5.x): the tensor names, llama's q/k un-permutation, gemma3's norm weights (stored plus one),
//! and `config.json` (docs/numerics.md §21.3–5).

use serde_json::{json, Map, Value as Json};

use super::parse::{Array, Header, Value};
use crate::{err, Result};

/// The GGUF architectures mapped here.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
    Gemma3,
}

impl Arch {
    pub fn from_name(name: &str) -> Option<Arch> {
        match name {
            "llama" => Some(Arch::Llama),
            "qwen3" => Some(Arch::Qwen3),
            "gemma3" => Some(Arch::Gemma3),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
        }
    }
    /// The names `from_name` takes, for messages.
    pub const NAMES: &'static str = "llama, qwen3, gemma3";
}

/// The Hugging Face name of GGUF tensor `name`, or `None` when it is not one of the family's.
pub fn hf_name(arch: Arch, name: &str) -> Option<String> {
    let global = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(g) = global {
        return Some(g.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    // Canonical decimal only: transformers' name table has `blk.1`, never `blk.01`.
    let n: usize = layer.parse().ok()?;
    if n.to_string() != layer {
        return None;
    }
    let (module, kind) = part.rsplit_once('.')?;
    let gemma3 = arch == Arch::Gemma3;
    let hf = match (module, kind) {
        ("attn_norm", "weight") => "input_layernorm",
        ("attn_q", _) => "self_attn.q_proj",
        ("attn_k", _) => "self_attn.k_proj",
        ("attn_v", _) => "self_attn.v_proj",
        ("attn_output", _) => "self_attn.o_proj",
        ("attn_q_norm", "weight") if arch != Arch::Llama => "self_attn.q_norm",
        ("attn_k_norm", "weight") if arch != Arch::Llama => "self_attn.k_norm",
        // Gemma 3's four norms a layer: around attention, then around the feed-forward (§21.3).
        ("ffn_norm", "weight") if gemma3 => "pre_feedforward_layernorm",
        ("post_attention_norm", "weight") if gemma3 => "post_attention_layernorm",
        ("post_ffw_norm", "weight") if gemma3 => "post_feedforward_layernorm",
        ("ffn_norm", "weight") => "post_attention_layernorm",
        ("ffn_gate", "weight") => "mlp.gate_proj",
        ("ffn_up", "weight") => "mlp.up_proj",
        ("ffn_down", "weight") => "mlp.down_proj",
        // llama's `mlp_bias` (§21.5).
        ("ffn_gate", "bias") if arch == Arch::Llama => "mlp.gate_proj",
        ("ffn_up", "bias") if arch == Arch::Llama => "mlp.up_proj",
        ("ffn_down", "bias") if arch == Arch::Llama => "mlp.down_proj",
        _ => return None,
    };
    if kind != "weight" && kind != "bias" {
        return None;
    }
    Some(format!("model.layers.{n}.{hf}.{kind}"))
}

/// Whether GGUF tensor `name` holds llama.cpp's `w + 1` of a gemma3 norm weight `w`: its
/// converter adds one to every Gemma norm (the model multiplies by `1 + w`), and transformers'
/// `Gemma2TensorProcessor` (which the GGUF architecture `gemma3` gets) subtracts it again from
/// every tensor whose name contains `norm.weight`, in f32: the Hugging Face value is
/// `stored ⊖ 1` (§21.3), which is not always the `w` the converter started from.
pub fn stored_plus_one(arch: Arch, name: &str) -> bool {
    arch == Arch::Gemma3 && name.contains("norm.weight")
}

/// For llama's `attn_q`/`attn_k` (weight or bias): the head count of the permutation
/// llama.cpp's converter applied, which `unpermuted_row` undoes (transformers'
/// `LlamaTensorProcessor`, which only the GGUF architecture `llama` gets). `None`: stored as is.
pub fn permuted_heads(arch: Arch, name: &str, config: &Json) -> Result<Option<usize>> {
    if arch != Arch::Llama {
        return Ok(None);
    }
    let key = if name.contains(".attn_q.") {
        "num_attention_heads"
    } else if name.contains(".attn_k.") {
        "num_key_value_heads"
    } else {
        return Ok(None);
    };
    let gguf_key = match key {
        "num_attention_heads" => "llama.attention.head_count",
        _ => "llama.attention.head_count_kv",
    };
    match config.get(key) {
        Some(v) => v
            .as_u64()
            .filter(|&n| n >= 1)
            .map(|n| Some(n as usize))
            .ok_or_else(|| err!(Checkpoint:
                "{gguf_key} = {v} is not a positive integer (needed to undo the q/k permutation of {name})"
            )),
        // transformers skips the un-permutation when either count is missing and so loads the
        // rows in llama.cpp's order: refused rather than reproduced.
        None => Err(err!(Checkpoint:
            "{gguf_key} is missing: transformers would load {name} without undoing llama.cpp's q/k permutation; refused"
        )),
    }
}

/// The stored row of un-permuted row `r`: llama.cpp stored each head's rows `[h, i, j]`
/// (`i < dim = rows / heads / 2`, `j < 2`) at `h·2·dim + 2i + j`; transformers reads them back
/// as `[h, j, i]` (`reshape(heads, dim, 2, …).swapaxes(1, 2)`), so row `h·2·dim + j·dim + i`
/// comes from `h·2·dim + 2i + j`.
#[inline]
pub fn unpermuted_row(r: usize, rows: usize, heads: usize) -> usize {
    let dim = rows / heads / 2;
    let (h, rem) = (r / (2 * dim), r % (2 * dim));
    let (j, i) = (rem / dim, rem % dim);
    h * 2 * dim + 2 * i + j
}

/// Metadata key suffixes (after `{arch}.`) and the config field each sets, as transformers'
/// `GGUF_CONFIG_MAPPING`; llama reads `rope.dimension_count` as `head_dim`, qwen3 and gemma3 do
/// not; gemma3 alone reads `attention.key_length` (`head_dim`) and `attention.sliding_window`
/// (`config_field`).
const CONFIG_KEYS: [(&str, &str); 12] = [
    ("context_length", "max_position_embeddings"),
    ("block_count", "num_hidden_layers"),
    ("feed_forward_length", "intermediate_size"),
    ("embedding_length", "hidden_size"),
    ("rope.dimension_count", "head_dim"),
    ("rope.freq_base", "rope_theta"),
    ("attention.head_count", "num_attention_heads"),
    ("attention.head_count_kv", "num_key_value_heads"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps"),
    ("vocab_size", "vocab_size"),
    ("attention.key_length", "head_dim"),
    ("attention.sliding_window", "sliding_window"),
];

/// The config field metadata key `suffix` (after `{arch}.`) sets in transformers' GGUF config
/// for `arch`, if any.
fn config_field(arch: Arch, suffix: &str) -> Option<&'static str> {
    let (_, field) = CONFIG_KEYS.iter().find(|(s, _)| *s == suffix)?;
    let read = match suffix {
        "rope.dimension_count" => arch == Arch::Llama,
        "attention.key_length" | "attention.sliding_window" => arch == Arch::Gemma3,
        _ => true,
    };
    read.then_some(*field)
}

/// Gemma 3's layer pattern, as transformers' `Gemma3TextConfig` makes it when no `layer_types`
/// is given (a GGUF file gives none: llama.cpp fixes the same pattern in code): every 6th layer
/// `full_attention`, the others `sliding_attention`.
pub const GEMMA3_PATTERN: usize = 6;
/// `Gemma3TextConfig.default_theta`: the sliding layers' rope theta, which a GGUF file does not
/// state (llama.cpp uses the same 10000 in code), and the global one when `rope.freq_base` is
/// absent.
pub const GEMMA3_THETA_LOCAL: f64 = 10_000.0;
pub const GEMMA3_THETA_GLOBAL: f64 = 1_000_000.0;

/// A metadata value as transformers' `_gguf_parse_value` makes it: integers stay integers, f32
/// and f64 become the binary64 of the same value, strings and bools stay; an array is refused
/// (no field read here is one).
fn config_value(key: &str, v: &Value) -> Result<Json> {
    Ok(match v {
        Value::F32(x) => finite(key, *x as f64)?,
        Value::F64(x) => finite(key, *x)?,
        Value::Bool(b) => json!(b),
        Value::Str(s) => json!(s),
        Value::Array(_) => {
            return Err(err!(Checkpoint:
                "metadata {key} is an array (per-layer values?); a single value is needed"
            ))
        }
        other => match other.as_int().expect("the remaining types are integers") {
            i if i < 0 => json!(i as i64),
            i => json!(i as u64),
        },
    })
}

fn finite(key: &str, x: f64) -> Result<Json> {
    serde_json::Number::from_f64(x)
        .map(Json::Number)
        .ok_or_else(|| err!(Checkpoint: "metadata {key} = {x} is not a finite number"))
}

/// What transformers' `Gemma3TextConfig` derives from a GGUF file's config and the file cannot
/// state, spelled as transformers saves it (§21.5): `rope_parameters` (the global theta from
/// `rope_theta`, which it replaces, the local one `GEMMA3_THETA_LOCAL`), `layer_types` (every
/// `GEMMA3_PATTERN`th layer global), and the class defaults that llama.cpp's Gemma 3 also
/// computes with: `query_pre_attn_scalar` 256, `hidden_activation` gelu_pytorch_tanh, no logit
/// soft-capping.
fn gemma3_fields(cfg: &mut Map<String, Json>) -> Result<()> {
    let global = match cfg.shift_remove("rope_theta") {
        None => GEMMA3_THETA_GLOBAL,
        Some(v) => v.as_f64().ok_or_else(
            || err!(Checkpoint: "metadata gemma3.rope.freq_base = {v} is not a number"),
        )?,
    };
    let layers = match cfg.get("num_hidden_layers") {
        None => 26, // Gemma3TextConfig's default
        Some(v) => v.as_u64().filter(|&n| n <= 1 << 20).ok_or_else(
            || err!(Checkpoint: "metadata gemma3.block_count = {v} is not a layer count"),
        )? as usize,
    };
    let kinds: Vec<&str> = (0..layers)
        .map(|i| {
            if (i + 1) % GEMMA3_PATTERN == 0 {
                "full_attention"
            } else {
                "sliding_attention"
            }
        })
        .collect();
    cfg.insert(
        "rope_parameters".into(),
        json!({
            "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_THETA_LOCAL},
            "full_attention": {"rope_type": "default", "rope_theta": global},
        }),
    );
    cfg.insert("layer_types".into(), json!(kinds));
    cfg.insert("query_pre_attn_scalar".into(), json!(256));
    cfg.insert("hidden_activation".into(), json!("gelu_pytorch_tanh"));
    cfg.insert("final_logit_softcapping".into(), Json::Null);
    cfg.insert("attn_logit_softcapping".into(), Json::Null);
    Ok(())
}

/// The `config.json` transformers' GGUF loader builds for this file (its `config` dict, in its
/// order: `tie_word_embeddings`, then the mapped keys in file order, then `vocab_size` from the
/// tokenizer when no key gave it), plus `architectures`, which transformers adds when it saves a
/// model, and what the file states that transformers does not read (the head size from any of
/// `rope.dimension_count`, `key_length`, `value_length`, which must agree; the biases it holds).
/// Computation-changing keys no producer honours (rope scaling, experts) are refused.
pub fn config(h: &Header, arch: Arch) -> Result<Json> {
    let mut cfg = Map::new();
    // transformers: tied exactly when no tensor is named `output.weight`.
    let tied = !h.tensors.iter().any(|t| t.name == "output.weight");
    cfg.insert("tie_word_embeddings".into(), json!(tied));
    // transformers loads a `llama` file whose `general.name` is exactly "mistral" as mistral
    // (same keys under the `mistral.` prefix).
    let mistral =
        arch == Arch::Llama && h.get("general.name").and_then(Value::as_str) == Some("mistral");
    let prefix = format!("{}.", arch.name());
    for (key, v) in &h.metadata {
        let field = match key.as_str() {
            "general.architecture" => Some("model_type"),
            "general.name" => Some("_model_name_or_path"),
            k => k
                .strip_prefix(&prefix)
                .and_then(|suffix| config_field(arch, suffix)),
        };
        let Some(field) = field else { continue };
        let mut value = config_value(key, v)?;
        if field == "model_type" && mistral {
            value = json!("mistral");
        }
        // transformers: a gemma3 file holds the text model only.
        if field == "model_type" && arch == Arch::Gemma3 {
            value = json!("gemma3_text");
        }
        cfg.insert(field.into(), value);
    }
    if !cfg.contains_key("vocab_size") {
        if let Some(Value::Array(Array::Str(tokens))) = h.get("tokenizer.ggml.tokens") {
            cfg.insert("vocab_size".into(), json!(tokens.len()));
        }
    }
    let model_type = cfg.get("model_type").and_then(Json::as_str).unwrap_or("");
    let architecture = match model_type {
        "llama" => "LlamaForCausalLM",
        "mistral" => "MistralForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "gemma3_text" => "Gemma3ForCausalLM",
        other => {
            return Err(
                err!(Checkpoint: "general.architecture = {other:?}: expected {}", arch.name()),
            )
        }
    };

    if let Some(t) = h.get(&format!("{prefix}rope.scaling.type")) {
        if t.as_str() != Some("none") {
            return Err(err!(Checkpoint:
                "metadata {prefix}rope.scaling.type = {t:?}: rope scaling from GGUF metadata is not supported (transformers' GGUF loader ignores it: its model would not be this file's)"
            ));
        }
    }
    if let Some(n) = h.get(&format!("{prefix}expert_count")) {
        if n.as_int() != Some(0) {
            return Err(err!(Checkpoint:
                "metadata {prefix}expert_count = {n:?}: experts are not supported in a GGUF checkpoint"
            ));
        }
    }
    // What the file states and transformers does not read (§21.5), so that the model is the
    // file's: the head size (every one of these keys the file has must agree; qwen3's from
    // key_length, where transformers would keep Qwen3Config's 128), and the biases it holds.
    let dims = [
        "rope.dimension_count",
        "attention.key_length",
        "attention.value_length",
    ];
    let given: Vec<(&str, &Value)> = dims
        .iter()
        .filter_map(|k| h.get(&format!("{prefix}{k}")).map(|v| (*k, v)))
        .collect();
    let sizes: Vec<Option<i128>> = given.iter().map(|(_, v)| v.as_int()).collect();
    if let Some((k, v)) = given
        .iter()
        .zip(&sizes)
        .find(|(_, s)| s.is_none())
        .map(|(g, _)| g)
    {
        return Err(err!(Checkpoint: "metadata {prefix}{k} = {v:?} is not an integer"));
    }
    if sizes.windows(2).any(|w| w[0] != w[1]) {
        let shown: Vec<String> = given
            .iter()
            .map(|(k, v)| format!("{prefix}{k} = {v:?}"))
            .collect();
        return Err(err!(Checkpoint: "head sizes disagree: {}", shown.join(", ")));
    }
    if let (Some(d), false) = (
        sizes.first().copied().flatten(),
        cfg.contains_key("head_dim"),
    ) {
        cfg.insert("head_dim".into(), json!(d));
    }
    let holds = |modules: &[&str]| {
        h.tensors.iter().any(|t| {
            t.name.strip_prefix("blk.").is_some_and(|rest| {
                rest.split_once('.')
                    .is_some_and(|(_, part)| modules.iter().any(|m| part == format!("{m}.bias")))
            })
        })
    };
    if holds(&["attn_q", "attn_k", "attn_v", "attn_output"]) {
        cfg.insert("attention_bias".into(), json!(true));
    }
    if arch == Arch::Llama && holds(&["ffn_gate", "ffn_up", "ffn_down"]) {
        cfg.insert("mlp_bias".into(), json!(true));
    }
    if arch == Arch::Gemma3 {
        gemma3_fields(&mut cfg)?;
    }
    // `architectures` last, as transformers writes it when it saves the model.
    cfg.insert("architectures".into(), json!([architecture]));
    Ok(Json::Object(cfg))
}
