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
pub const ORACLE_FAMILIES: [&str; 10] = [
    "gemma3_text",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
];

/// Why a `model_type` is refused; same text as the contract's (contract/tracegate_contract/qwen3.py).
pub fn unsupported_family(model_type: &str) -> String {
    if ORACLE_FAMILIES.contains(&model_type) {
        "not supported by the bit-exact producers (engine, contract: qwen3, qwen3_moe); the oracle supports it: \
         python -m tracegate_oracle, trace-diff and gate bisect --reference oracle (docs/capture-points.md)"
            .to_string()
    } else {
        "not supported (engine, contract: qwen3, qwen3_moe; oracle: the families of docs/capture-points.md)".to_string()
    }
}

/// `model_type`: the two families this engine computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    Qwen3,
    Qwen3Moe,
}

/// The computation-changing fields of a Qwen3 / Qwen3-MoE `config.json` (numerics.md §13).
/// The MoE fields are 0 / false / empty for `qwen3`, as in the contract's `Config`.
#[derive(Clone, Debug)]
pub struct Config {
    pub model_type: ModelType,
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

/// Rope theta and the refusals of §7/§13, following transformers' resolution: a non-empty
/// legacy `rope_scaling` replaces `rope_parameters`; theta comes from that dict, else the
/// top-level `rope_theta`, else 10000.
fn rope_theta(v: &Value) -> Result<f64> {
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
    if let Some(f) = field(v, "partial_rotary_factor") {
        if f.as_f64() != Some(1.0) {
            return Err(err!(Config:
                "config.json: partial_rotary_factor = {f} not supported (only 1)"
            ));
        }
    }
    let Some(d) = dict else {
        return positive_theta(top_theta);
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
        if f.as_f64() != Some(1.0) {
            return Err(err!(Config:
                "config.json: {dict_name}.partial_rotary_factor = {f} not supported (only 1)"
            ));
        }
    }
    let known = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(err!(Config:
            "config.json: {dict_name}.{k} not supported with the default rope type"
        ));
    }
    positive_theta(opt_f64(d, "rope_theta", top_theta)?)
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

impl Config {
    pub fn from_json(v: &Value) -> Result<Config> {
        if !v.is_object() {
            return Err(err!(Config: "config.json: not a JSON object"));
        }
        let model_type = field(v, "model_type")
            .and_then(|m| m.as_str())
            .unwrap_or("");
        let family = match model_type {
            "qwen3" => ModelType::Qwen3,
            "qwen3_moe" => ModelType::Qwen3Moe,
            other => {
                return Err(err!(Config:
                    "config.json: model_type {other:?} {}",
                    unsupported_family(other)
                ))
            }
        };
        let want_arch = match family {
            ModelType::Qwen3 => "Qwen3ForCausalLM",
            ModelType::Qwen3Moe => "Qwen3MoeForCausalLM",
        };
        if let Some(a) = field(v, "architectures") {
            let ok = a
                .as_array()
                .is_some_and(|l| l.len() == 1 && l[0].as_str() == Some(want_arch));
            if !ok {
                return Err(
                    err!(Config: "config.json: architectures = {a} not supported for model_type {model_type} (expected [\"{want_arch}\"])"),
                );
            }
        }
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
        let head_dim = match (opt_usize(v, "head_dim")?, family) {
            (Some(d), _) => d,
            (None, ModelType::Qwen3) => 128,
            (None, ModelType::Qwen3Moe) => hidden_size / num_attention_heads,
        };
        if head_dim % 2 != 0 || head_dim == 0 {
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
            ModelType::Qwen3 => (0, 0, 0, false, 1, vec![]),
            ModelType::Qwen3Moe => {
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
                (
                    ne,
                    k,
                    moe_intermediate_size,
                    opt_bool(v, "norm_topk_prob", false)?,
                    opt_usize(v, "decoder_sparse_step")?.unwrap_or(1),
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
        let cfg = Config {
            model_type: family,
            vocab_size: req_usize(v, "vocab_size")?,
            hidden_size,
            intermediate_size: opt_usize(v, "intermediate_size")?,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps: opt_f64(v, "rms_norm_eps", 1e-6)?,
            rope_theta: rope_theta(v)?,
            tie_word_embeddings: opt_bool(v, "tie_word_embeddings", false)?,
            attention_bias: opt_bool(v, "attention_bias", false)?,
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            norm_topk_prob,
            decoder_sparse_step,
            mlp_only_layers,
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

    /// §10: layer `l` uses the sparse MoE block.
    pub fn is_sparse(&self, l: usize) -> bool {
        self.model_type == ModelType::Qwen3Moe
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
            && (self.model_type == ModelType::Qwen3
                || self.num_experts == 0
                || self.decoder_sparse_step > 1
                || self.mlp_only_layers.iter().any(|&l| l < n))
    }

    pub fn eps_f32(&self) -> f32 {
        // §6: the config's number (binary64 as parsed) rounded once to f32.
        self.rms_norm_eps as f32
    }
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
    let emb = "model.embed_tokens.weight";
    dim(emb, 0, v as u64, &|| format!("vocab_size = {v}"))?;
    dim(emb, 1, h as u64, &|| format!("hidden_size = {h}"))?;
    let have = st.layer_count();
    if c.num_hidden_layers > have {
        return Err(err!(Config:
            "config.json: num_hidden_layers = {} but the checkpoint holds {have} layers (model.layers.N tensors for N < {have})",
            c.num_hidden_layers
        ));
    }
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let a = "model.layers.0.self_attn";
    dim(&format!("{a}.q_norm.weight"), 0, d as u64, &|| {
        format!("head_dim = {d}")
    })?;
    let q_rows = product("num_attention_heads", nq, "head_dim", d)?;
    let kv_rows = product("num_key_value_heads", nkv, "head_dim", d)?;
    dim(&format!("{a}.q_proj.weight"), 0, q_rows, &|| {
        format!("num_attention_heads = {nq} (× head_dim {d} = {q_rows} rows)")
    })?;
    dim(&format!("{a}.k_proj.weight"), 0, kv_rows, &|| {
        format!("num_key_value_heads = {nkv} (× head_dim {d} = {kv_rows} rows)")
    })?;
    let layers = 0..c.num_hidden_layers; // bounded by the checkpoint now
    if let (Some(i), Some(l)) = (
        c.intermediate_size,
        layers.clone().find(|&l| !c.is_sparse(l)),
    ) {
        dim(
            &format!("model.layers.{l}.mlp.gate_proj.weight"),
            0,
            i as u64,
            &|| format!("intermediate_size = {i}"),
        )?;
    }
    if let Some(l) = layers.clone().find(|&l| c.is_sparse(l)) {
        let (ne, mi) = (c.num_experts, c.moe_intermediate_size);
        let p = format!("model.layers.{l}.mlp");
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
