//! Qwen3 and Qwen3-MoE (`Qwen3ForCausalLM`, `Qwen3MoeForCausalLM`): the config as in the HF
//! `config.json`, the weights it requires, and the forward pass of docs/numerics.md §5–§11.
//! The two families differ only in the feed-forward block of some layers (dense MLP vs sparse
//! MoE), so one file covers both.

use rayon::prelude::*;
use serde_json::Value;

use crate::capture::Capture;
use crate::force::Forcing;
use crate::ops::{self, Rope};
use crate::weights::{Mat, Store};
use crate::{err, Result};

// ---------------------------------------------------------------------------------------------
// Config

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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    Qwen3,
    Qwen3Moe,
}

#[derive(Clone, Debug)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    pub norm_topk_prob: bool,
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
}

/// The computation-changing fields of a Qwen3 / Qwen3-MoE `config.json` (numerics.md §13).
#[derive(Clone, Debug)]
pub struct Config {
    pub family: Family,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense MLP width; `None` only for an all-sparse MoE model that does not declare it.
    pub intermediate_size: Option<usize>,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub moe: Option<MoeConfig>,
}

fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}
fn req_usize(v: &Value, key: &str) -> Result<usize> {
    let x = field(v, key).ok_or_else(|| err!("config.json: missing field {key}"))?;
    x.as_u64()
        .filter(|&n| n >= 1)
        .map(|n| n as usize)
        .ok_or_else(|| err!("config.json: {key} = {x} is not a positive integer"))
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
            .ok_or_else(|| err!("config.json: {key} = {x} is not a boolean")),
    }
}
fn opt_f64(v: &Value, key: &str, default: f64) -> Result<f64> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| err!("config.json: {key} = {x} is not a finite number")),
    }
}

/// Rope theta and the refusals of §7/§13, following transformers' resolution: a non-empty
/// legacy `rope_scaling` replaces `rope_parameters`; theta comes from that dict, else the
/// top-level `rope_theta`, else 10000.
fn rope_theta(v: &Value) -> Result<f64> {
    let (dict, dict_name) = match field(v, "rope_scaling") {
        Some(x) if x.as_object().is_some_and(|m| !m.is_empty()) => (Some(x), "rope_scaling"),
        Some(x) if !x.is_object() => {
            return Err(err!(
                "config.json: rope_scaling = {x} is not an object or null"
            ))
        }
        _ => (field(v, "rope_parameters"), "rope_parameters"),
    };
    let top_theta = opt_f64(v, "rope_theta", 10000.0)?;
    if let Some(f) = field(v, "partial_rotary_factor") {
        if f.as_f64() != Some(1.0) {
            return Err(err!(
                "config.json: partial_rotary_factor = {f} not supported (only 1)"
            ));
        }
    }
    let Some(d) = dict else {
        return positive_theta(top_theta);
    };
    let obj = d
        .as_object()
        .ok_or_else(|| err!("config.json: {dict_name} is not an object"))?;
    for key in ["rope_type", "type"] {
        if let Some(t) = obj.get(key).filter(|x| !x.is_null()) {
            if t.as_str() != Some("default") {
                return Err(err!(
                    "config.json: {dict_name}.{key} = {t} not supported (only \"default\")"
                ));
            }
        }
    }
    if let Some(f) = obj.get("partial_rotary_factor").filter(|x| !x.is_null()) {
        if f.as_f64() != Some(1.0) {
            return Err(err!(
                "config.json: {dict_name}.partial_rotary_factor = {f} not supported (only 1)"
            ));
        }
    }
    let known = ["rope_type", "type", "rope_theta", "partial_rotary_factor"];
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(err!(
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
        Err(err!("config.json: rope_theta = {theta} is not positive"))
    }
}

impl Config {
    pub fn from_json(v: &Value) -> Result<Config> {
        if !v.is_object() {
            return Err(err!("config.json: not a JSON object"));
        }
        let model_type = field(v, "model_type")
            .and_then(|m| m.as_str())
            .unwrap_or("");
        let family = match model_type {
            "qwen3" => Family::Qwen3,
            "qwen3_moe" => Family::Qwen3Moe,
            other => {
                return Err(err!(
                    "config.json: model_type {other:?} {}",
                    unsupported_family(other)
                ))
            }
        };
        let want_arch = match family {
            Family::Qwen3 => "Qwen3ForCausalLM",
            Family::Qwen3Moe => "Qwen3MoeForCausalLM",
        };
        if let Some(a) = field(v, "architectures") {
            let ok = a
                .as_array()
                .is_some_and(|l| l.len() == 1 && l[0].as_str() == Some(want_arch));
            if !ok {
                return Err(err!("config.json: architectures = {a} not supported for model_type {model_type} (expected [\"{want_arch}\"])"));
            }
        }
        if let Some(act) = field(v, "hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(err!(
                    "config.json: hidden_act = {act} not supported (only \"silu\")"
                ));
            }
        }
        if opt_bool(v, "use_sliding_window", false)? {
            return Err(err!("config.json: use_sliding_window = true not supported"));
        }
        let num_hidden_layers = req_usize(v, "num_hidden_layers")?;
        if let Some(lt) = field(v, "layer_types") {
            let ok = lt
                .as_array()
                .is_some_and(|l| l.iter().all(|t| t.as_str() == Some("full_attention")));
            if !ok {
                return Err(err!(
                    "config.json: layer_types = {lt} not supported (only \"full_attention\")"
                ));
            }
        }
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_attention_heads = req_usize(v, "num_attention_heads")?;
        let num_key_value_heads = req_usize(v, "num_key_value_heads")?;
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(err!("config.json: num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"));
        }
        // transformers: Qwen3Config declares head_dim = 128; Qwen3MoeConfig has no such field and
        // the model falls back to hidden_size / num_attention_heads.
        let head_dim = match (opt_usize(v, "head_dim")?, family) {
            (Some(d), _) => d,
            (None, Family::Qwen3) => 128,
            (None, Family::Qwen3Moe) => hidden_size / num_attention_heads,
        };
        if head_dim % 2 != 0 || head_dim == 0 {
            let from = if field(v, "head_dim").is_some() {
                String::new()
            } else {
                format!(" (hidden_size {hidden_size} / num_attention_heads {num_attention_heads})")
            };
            return Err(err!(
                "config.json: head_dim = {head_dim}{from} must be even and positive"
            ));
        }
        // Not used by the forward, but a size all the same: positions must stay below 2^24 (§7).
        if let Some(m) = opt_usize(v, "max_position_embeddings")? {
            if m > MAX_POSITIONS {
                return Err(err!("config.json: max_position_embeddings = {m} exceeds the position limit 2^24 = {MAX_POSITIONS}"));
            }
        }
        let moe = match family {
            Family::Qwen3 => None,
            Family::Qwen3Moe => {
                let ne = match (field(v, "num_experts"), field(v, "num_local_experts")) {
                    (Some(_), Some(_))
                        if opt_usize(v, "num_experts")? != opt_usize(v, "num_local_experts")? =>
                    {
                        return Err(err!(
                            "config.json: num_experts and num_local_experts disagree"
                        ));
                    }
                    (Some(x), _) | (None, Some(x)) => x.as_u64().ok_or_else(|| {
                        err!("config.json: num_experts = {x} is not a non-negative integer")
                    })? as usize,
                    (None, None) => return Err(err!("config.json: missing field num_experts")),
                };
                let k = field(v, "num_experts_per_tok")
                    .ok_or_else(|| err!("config.json: missing field num_experts_per_tok"))?
                    .as_u64()
                    .ok_or_else(|| err!("config.json: num_experts_per_tok is not an integer"))?
                    as usize;
                if ne > 0 && (k < 1 || k >= ne) {
                    return Err(err!("config.json: num_experts_per_tok = {k} not supported with num_experts = {ne} (need 1 ≤ k < num_experts)"));
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
                            err!(
                                "config.json: mlp_only_layers = {x} is not a list of layer indices"
                            )
                        })?,
                };
                Some(MoeConfig {
                    num_experts: ne,
                    num_experts_per_tok: k,
                    moe_intermediate_size: if ne > 0 {
                        req_usize(v, "moe_intermediate_size")?
                    } else {
                        0
                    },
                    norm_topk_prob: opt_bool(v, "norm_topk_prob", false)?,
                    decoder_sparse_step: opt_usize(v, "decoder_sparse_step")?.unwrap_or(1),
                    mlp_only_layers,
                })
            }
        };
        let cfg = Config {
            family,
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
            moe,
        };
        if cfg.vocab_size < 2 {
            return Err(err!(
                "config.json: vocab_size = {} (argmax margins need at least 2)",
                cfg.vocab_size
            ));
        }
        if cfg.intermediate_size.is_none() && cfg.has_dense_layer() {
            return Err(err!("config.json: missing field intermediate_size"));
        }
        Ok(cfg)
    }

    /// §10: layer `l` uses the sparse MoE block.
    pub fn is_sparse(&self, l: usize) -> bool {
        match &self.moe {
            None => false,
            Some(m) => {
                m.num_experts > 0
                    && !m.mlp_only_layers.contains(&l)
                    && (l + 1).is_multiple_of(m.decoder_sparse_step)
            }
        }
    }

    /// Some layer uses the dense MLP. Decided without visiting every layer: the count is not yet
    /// checked against the checkpoint here, and may be 2^62.
    fn has_dense_layer(&self) -> bool {
        let n = self.num_hidden_layers;
        match &self.moe {
            None => n > 0,
            // Layer 0 is dense when the step is above 1 ((0 + 1) % step ≠ 0).
            Some(m) => {
                n > 0
                    && (m.num_experts == 0
                        || m.decoder_sparse_step > 1
                        || m.mlp_only_layers.iter().any(|&l| l < n))
            }
        }
    }

    pub fn eps_f32(&self) -> f32 {
        // §6: the config's number (binary64 as parsed) rounded once to f32.
        self.rms_norm_eps as f32
    }
}

// ---------------------------------------------------------------------------------------------
// Weights

struct Mlp<'a> {
    gate: Mat<'a>,
    up: Mat<'a>,
    down: Mat<'a>,
}

enum Ffn<'a> {
    Dense(Mlp<'a>),
    /// Router `[E, H]` and the experts in id order.
    Moe {
        router: Mat<'a>,
        experts: Vec<Mlp<'a>>,
    },
}

struct Linear<'a> {
    w: Mat<'a>,
    b: Option<Vec<f32>>,
}

impl Linear<'_> {
    fn apply(&self, x: &[f32], rows: usize) -> Vec<f32> {
        ops::matmul(x, rows, self.w, self.b.as_deref())
    }
}

struct Layer<'a> {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    q: Linear<'a>,
    k: Linear<'a>,
    v: Linear<'a>,
    o: Linear<'a>,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    ffn: Ffn<'a>,
}

/// The model: matrices stay in the mapped checkpoint and are widened tile by tile at use; only
/// the O(hidden) vectors (norm weights, biases) are widened once here.
pub struct Model<'a> {
    pub cfg: Config,
    embed: Mat<'a>,
    head: Mat<'a>,
    norm: Vec<f32>,
    layers: Vec<Layer<'a>>,
    /// `--force-decisions`: router rows at the positions it holds are taken from it.
    pub forcing: Option<Forcing>,
}

/// Attention scores computed together (one `dot` per lane of an array).
const SC: usize = 16;

/// Per-layer KV cache: k (normed, rotated) and v rows `[n, kv, d]` with their positions.
#[derive(Clone, Default)]
pub struct LayerKv {
    k: Vec<f32>,
    v: Vec<f32>,
    pos: Vec<i64>,
}

/// Every size the config declares, checked against the checkpoint's own tensors before the model
/// allocates or loops by it: 2^40 layers or 2^62 heads are refused naming the field, never turned
/// into an allocation, a long loop or an overflowing product. A representative tensor that is
/// absent is left to `Store::take`, which refuses it by name.
pub fn check_sizes(c: &Config, st: &Store) -> Result<()> {
    let dim = |name: &str, axis: usize, want: u64, field: &dyn Fn() -> String| -> Result<()> {
        match st.shape(name) {
            Some(s) if s.get(axis).is_some_and(|&g| g != want) => Err(err!(
                "config.json: {} does not match the checkpoint: {name} has shape {s:?}",
                field()
            )),
            _ => Ok(()),
        }
    };
    let product = |field: &str, x: usize, by: &str, y: usize| -> Result<u64> {
        x.checked_mul(y).map(|p| p as u64).ok_or_else(|| {
            err!("config.json: {field} = {x} overflows when multiplied by {by} ({y})")
        })
    };
    let (h, v, d) = (c.hidden_size, c.vocab_size, c.head_dim);
    let emb = "model.embed_tokens.weight";
    dim(emb, 0, v as u64, &|| format!("vocab_size = {v}"))?;
    dim(emb, 1, h as u64, &|| format!("hidden_size = {h}"))?;
    let have = st.layer_count();
    if c.num_hidden_layers > have {
        return Err(err!(
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
    if let (Some(m), Some(l)) = (&c.moe, layers.clone().find(|&l| c.is_sparse(l))) {
        let (ne, mi) = (m.num_experts, m.moe_intermediate_size);
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

impl<'a> Model<'a> {
    /// Bind every tensor the config requires (shapes checked) and refuse any the checkpoint
    /// holds that no module claims.
    pub fn load(cfg: Config, st: &'a Store) -> Result<Model<'a>> {
        check_sizes(&cfg, st)?;
        let (h, v, d) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim);
        let (nq, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let vec = |name: &str, n: usize| st.take(name, &[n]).map(|m| m.to_vec());
        let lin = |name: &str, out: usize, inp: usize, bias: bool| -> Result<Linear<'a>> {
            let w = st.take(&format!("{name}.weight"), &[out, inp])?;
            let b = if bias {
                Some(vec(&format!("{name}.bias"), out)?)
            } else {
                None
            };
            Ok(Linear { w, b })
        };
        let mlp = |p: &str, inter: usize| -> Result<Mlp<'a>> {
            Ok(Mlp {
                gate: st.take(&format!("{p}.gate_proj.weight"), &[inter, h])?,
                up: st.take(&format!("{p}.up_proj.weight"), &[inter, h])?,
                down: st.take(&format!("{p}.down_proj.weight"), &[h, inter])?,
            })
        };
        let embed = st.take("model.embed_tokens.weight", &[v, h])?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let ab = cfg.attention_bias;
            let ffn = if cfg.is_sparse(l) {
                let m = cfg.moe.as_ref().expect("sparse layer has a MoE config");
                let (ne, mi) = (m.num_experts, m.moe_intermediate_size);
                let router = st.take(&format!("{p}.mlp.gate.weight"), &[ne, h])?;
                // On disk experts are either per-expert modules (what save_pretrained writes) or
                // transformers 5's fused `gate_up_proj [E, 2I, H]` / `down_proj [E, H, I]`.
                let fused = format!("{p}.mlp.experts.gate_up_proj");
                let experts = if st.contains(&fused) {
                    let gu = st.take(&fused, &[ne, 2 * mi, h])?;
                    let dn = st.take(&format!("{p}.mlp.experts.down_proj"), &[ne, h, mi])?;
                    (0..ne)
                        .map(|e| Mlp {
                            gate: gu.row_block(e * 2 * mi, mi),
                            up: gu.row_block(e * 2 * mi + mi, mi),
                            down: dn.row_block(e * h, h),
                        })
                        .collect()
                } else {
                    (0..ne)
                        .map(|e| mlp(&format!("{p}.mlp.experts.{e}"), mi))
                        .collect::<Result<Vec<_>>>()?
                };
                Ffn::Moe { router, experts }
            } else {
                let inter = cfg.intermediate_size.expect("checked in Config::from_json");
                Ffn::Dense(mlp(&format!("{p}.mlp"), inter)?)
            };
            layers.push(Layer {
                input_norm: vec(&format!("{p}.input_layernorm.weight"), h)?,
                post_norm: vec(&format!("{p}.post_attention_layernorm.weight"), h)?,
                q: lin(&format!("{p}.self_attn.q_proj"), nq * d, h, ab)?,
                k: lin(&format!("{p}.self_attn.k_proj"), nkv * d, h, ab)?,
                v: lin(&format!("{p}.self_attn.v_proj"), nkv * d, h, ab)?,
                o: lin(&format!("{p}.self_attn.o_proj"), h, nq * d, ab)?,
                q_norm: vec(&format!("{p}.self_attn.q_norm.weight"), d)?,
                k_norm: vec(&format!("{p}.self_attn.k_norm.weight"), d)?,
                ffn,
            });
        }
        let norm = vec("model.norm.weight", h)?;
        let head = if cfg.tie_word_embeddings {
            embed
        } else {
            st.take("lm_head.weight", &[v, h])?
        };
        st.finish_claims()?;
        Ok(Model {
            cfg,
            embed,
            head,
            norm,
            layers,
            forcing: None,
        })
    }

    pub fn new_cache(&self) -> Vec<LayerKv> {
        vec![LayerKv::default(); self.cfg.num_hidden_layers]
    }

    /// §5 embedding rows.
    pub fn embed(&self, tokens: &[i64]) -> Result<Vec<f32>> {
        let h = self.cfg.hidden_size;
        let mut x = vec![0.0f32; tokens.len() * h];
        for (r, &t) in tokens.iter().enumerate() {
            if t < 0 || t as u64 >= self.cfg.vocab_size as u64 {
                return Err(err!(
                    "token id {t} outside the vocabulary [0, {})",
                    self.cfg.vocab_size
                ));
            }
            self.embed
                .widen_row(t as usize, 0, &mut x[r * h..(r + 1) * h]);
        }
        Ok(x)
    }

    /// Tokens at positions `pos0..`, appending to `cache` (empty for an uncached forward).
    /// Captures embed.out … logits into `cap`; returns logits `[T, V]`.
    pub fn forward(
        &self,
        tokens: &[i64],
        pos0: i64,
        cache: &mut [LayerKv],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let t = tokens.len();
        let (h, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let pos: Vec<i64> = (0..t as i64).map(|i| pos0 + i).collect();
        let rope = Rope::new(self.cfg.rope_theta, self.cfg.head_dim, &pos);
        let mut x = self.embed(tokens)?;
        cap.tensor("embed.out", &[t, h], &x, &pos);
        for (l, kv) in cache.iter_mut().enumerate() {
            x = self.layer(l, &x, &pos, &rope, kv, cap)?;
        }
        let xn = ops::rmsnorm_rows(&x, &self.norm, self.cfg.eps_f32());
        cap.tensor("final_norm.out", &[t, h], &xn, &pos);
        let logits = ops::matmul(&xn, t, self.head, None);
        cap.tensor("logits", &[t, v], &logits, &pos);
        Ok(logits)
    }

    /// §11 decoder layer `l` on rows `x` `[T, H]` at absolute positions `pos` (causal by
    /// position), attending to `kv` plus these rows (which are appended to `kv`).
    pub fn layer(
        &self,
        l: usize,
        x: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let lw = self
            .layers
            .get(l)
            .ok_or_else(|| err!("layer {l} out of range (model has {})", self.layers.len()))?;
        let (t, h, eps) = (pos.len(), self.cfg.hidden_size, self.cfg.eps_f32());
        let nn = format!("layer.{l:02}");
        cap.tensor(&format!("{nn}.hidden_in"), &[t, h], x, pos);
        let a = self.attention(
            lw,
            &nn,
            &ops::rmsnorm_rows(x, &lw.input_norm, eps),
            pos,
            rope,
            kv,
            cap,
        );
        cap.tensor(&format!("{nn}.attn_out"), &[t, h], &a, pos);
        let h1: Vec<f32> = x.iter().zip(&a).map(|(p, q)| p + q).collect();
        let xn = ops::rmsnorm_rows(&h1, &lw.post_norm, eps);
        let m = match &lw.ffn {
            Ffn::Dense(mlp) => gated_mlp(mlp, &xn, t),
            Ffn::Moe { router, experts } => self.moe(router, experts, &nn, &xn, pos, cap)?,
        };
        cap.tensor(&format!("{nn}.mlp_out"), &[t, h], &m, pos);
        let out: Vec<f32> = h1.iter().zip(&m).map(|(p, q)| p + q).collect();
        cap.tensor(&format!("{nn}.hidden_out"), &[t, h], &out, pos);
        Ok(out)
    }

    /// §8 attention of the new rows over `kv` ++ new rows; returns attn_out (after o_proj).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        lw: &Layer,
        nn: &str,
        xn: &[f32],
        pos: &[i64],
        rope: &Rope,
        kv: &mut LayerKv,
        cap: &mut Capture,
    ) -> Vec<f32> {
        let (t, d) = (pos.len(), self.cfg.head_dim);
        let (nq, nkv) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads);
        let eps = self.cfg.eps_f32();
        let mut q = lw.q.apply(xn, t);
        let mut k = lw.k.apply(xn, t);
        let v = lw.v.apply(xn, t);
        let mut tmp = vec![0.0f32; d];
        for (mat, norm, heads) in [(&mut q, &lw.q_norm, nq), (&mut k, &lw.k_norm, nkv)] {
            for r in 0..t {
                for hd in 0..heads {
                    let vecr = &mut mat[(r * heads + hd) * d..(r * heads + hd + 1) * d];
                    ops::rmsnorm(vecr, norm, eps, &mut tmp);
                    vecr.copy_from_slice(&tmp);
                    rope.apply(r, vecr);
                }
            }
        }
        cap.internal(&format!("{nn}.q"), &[t, nq, d], &q, pos);
        cap.internal(&format!("{nn}.k"), &[t, nkv, d], &k, pos);
        cap.internal(&format!("{nn}.v"), &[t, nkv, d], &v, pos);
        kv.k.extend_from_slice(&k);
        kv.v.extend_from_slice(&v);
        kv.pos.extend_from_slice(pos);
        let tk = kv.pos.len();
        let group = nq / nkv;
        // §8.4: scale = f32(1 / sqrt(d)) in binary64.
        let scale = (1.0f64 / (d as f64).sqrt()) as f32;
        let want_probs = cap.internals();
        let kv = &*kv;
        // Heads are independent; each head's arithmetic is the same whichever thread runs it.
        let per_head: Vec<(Vec<f32>, Vec<f32>)> = (0..nq)
            .into_par_iter()
            .map(|hq| {
                let hk = hq / group;
                let mut o = vec![0.0f32; t * d];
                let mut probs = if want_probs {
                    vec![0.0f32; t * tk]
                } else {
                    vec![]
                };
                let mut s = vec![0.0f32; tk];
                let mut p = vec![0.0f32; tk];
                // This head's keys transposed to `kt[j][c]` (columns padded with zeros to a
                // multiple of SC), so SC scores advance together, each its own ordered `dot`.
                let tkp = tk.div_ceil(SC) * SC;
                let mut kt = vec![0.0f32; d * tkp];
                let mut dots = vec![0.0f32; tkp];
                for c in 0..tk {
                    let kr = &kv.k[(c * nkv + hk) * d..(c * nkv + hk + 1) * d];
                    for j in 0..d {
                        kt[j * tkp + c] = kr[j];
                    }
                }
                for r in 0..t {
                    let qv = &q[(r * nq + hq) * d..(r * nq + hq + 1) * d];
                    let visible = |c: usize| kv.pos[c] <= pos[r];
                    // Columns past the last visible one are not needed (they become -inf).
                    let cend = (0..tk).rev().find(|&c| visible(c)).map_or(0, |c| c + 1);
                    let cpad = cend.div_ceil(SC) * SC;
                    ops::dots_transposed(qv, &kt, tkp, &mut dots[..cpad]);
                    for c in 0..tk {
                        s[c] = if visible(c) {
                            dots[c] * scale
                        } else {
                            f32::NEG_INFINITY
                        };
                    }
                    ops::softmax_masked(&s, visible, &mut p);
                    let orow = &mut o[r * d..(r + 1) * d];
                    for c in 0..tk {
                        if visible(c) {
                            let vv = &kv.v[(c * nkv + hk) * d..(c * nkv + hk + 1) * d];
                            for j in 0..d {
                                orow[j] += p[c] * vv[j];
                            }
                        }
                    }
                    if want_probs {
                        probs[r * tk..(r + 1) * tk].copy_from_slice(&p);
                    }
                }
                (o, probs)
            })
            .collect();
        let mut o = vec![0.0f32; t * nq * d];
        for (hq, (oh, _)) in per_head.iter().enumerate() {
            for r in 0..t {
                o[(r * nq + hq) * d..(r * nq + hq + 1) * d]
                    .copy_from_slice(&oh[r * d..(r + 1) * d]);
            }
        }
        if want_probs {
            let probs: Vec<f32> = per_head
                .iter()
                .flat_map(|(_, p)| p.iter().copied())
                .collect();
            cap.internal(&format!("{nn}.attn_probs"), &[nq, t, tk], &probs, pos);
        }
        lw.o.apply(&o, t)
    }

    /// §10 sparse MoE block.
    fn moe(
        &self,
        router: &Mat,
        experts: &[Mlp],
        nn: &str,
        xn: &[f32],
        pos: &[i64],
        cap: &mut Capture,
    ) -> Result<Vec<f32>> {
        let m = self.cfg.moe.as_ref().expect("MoE layer has a MoE config");
        let (t, h, ne, k) = (
            pos.len(),
            self.cfg.hidden_size,
            m.num_experts,
            m.num_experts_per_tok,
        );
        let logits = ops::matmul(xn, t, *router, None);
        cap.internal(&format!("{nn}.router.logits"), &[t, ne], &logits, pos);
        // weight[r][e] for the chosen experts of row r (None: not chosen).
        let mut weight: Vec<Vec<Option<f32>>> = vec![vec![None; ne]; t];
        let mut chosen_all = Vec::with_capacity(t * k);
        let mut margins = Vec::with_capacity(t);
        let mut p = vec![0.0f32; ne];
        let name = format!("{nn}.router.topk");
        // Forced rows are keyed by position: row i of the forcing decision is position i's.
        let forced = self.forcing.as_ref().and_then(|f| f.values(&name));
        let mut overridden = 0u64;
        for r in 0..t {
            ops::softmax_masked(&logits[r * ne..(r + 1) * ne], |_| true, &mut p);
            if p.iter().any(|x| x.is_nan()) {
                return Err(err!(
                    "{nn}.router: NaN probability at row {r} (position {})",
                    pos[r]
                ));
            }
            let (own, next) = ops::topk(&p, k);
            let next = next.expect("k < num_experts checked in config");
            let at = pos[r] as usize * k;
            let chosen: Vec<usize> = match forced.and_then(|f| f.get(at..at + k)) {
                Some(row) => {
                    let row: Vec<usize> = row.iter().map(|&e| e as usize).collect();
                    overridden += u64::from(row != own);
                    margins.push(ops::margin_of(&p, &row));
                    row
                }
                None => {
                    margins.push(p[own[k - 1]] - p[next]);
                    own
                }
            };
            // §10.4 in the chosen (rank or forced) order.
            let den = if m.norm_topk_prob {
                ops::sum(&chosen.iter().map(|&e| p[e]).collect::<Vec<_>>())
            } else {
                1.0
            };
            for &e in &chosen {
                weight[r][e] = Some(if m.norm_topk_prob { p[e] / den } else { p[e] });
                chosen_all.push(e as i64);
            }
        }
        cap.decision(&name, &[t, k], chosen_all, Some(margins));
        if forced.is_some() {
            cap.forced(&name, overridden);
        }
        let mut out = vec![0.0f32; t * h];
        // Ascending expert id, so each row accumulates its experts in ascending id.
        for (e, mlp) in experts.iter().enumerate() {
            let rows: Vec<usize> = (0..t).filter(|&r| weight[r][e].is_some()).collect();
            if rows.is_empty() {
                continue;
            }
            let xe: Vec<f32> = rows
                .iter()
                .flat_map(|&r| xn[r * h..(r + 1) * h].iter().copied())
                .collect();
            let ye = gated_mlp(mlp, &xe, rows.len());
            let epos: Vec<i64> = rows.iter().map(|&r| pos[r]).collect();
            cap.internal(
                &format!("{nn}.expert.{e:03}.out"),
                &[rows.len(), h],
                &ye,
                &epos,
            );
            for (i, &r) in rows.iter().enumerate() {
                let w = weight[r][e].expect("row routed to e");
                for j in 0..h {
                    out[r * h + j] += w * ye[i * h + j];
                }
            }
        }
        Ok(out)
    }
}

/// §9 `down(silu(gate(x)) ⊗ up(x))`.
fn gated_mlp(m: &Mlp, x: &[f32], rows: usize) -> Vec<f32> {
    let g = ops::matmul(x, rows, m.gate, None);
    let u = ops::matmul(x, rows, m.up, None);
    // Elementwise (one libm exp each), so spread over the pool in chunks; bits are per element.
    let mut hmid = vec![0.0f32; g.len()];
    hmid.par_chunks_mut(4096)
        .zip(g.par_chunks(4096).zip(u.par_chunks(4096)))
        .for_each(|(hc, (gc, uc))| {
            for ((h, &g), &u) in hc.iter_mut().zip(gc).zip(uc) {
                *h = ops::silu(g) * u;
            }
        });
    ops::matmul(&hmid, rows, m.down, None)
}
