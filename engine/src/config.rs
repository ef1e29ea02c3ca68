//! The model's `config.json` (docs/numerics.md §13): the fields that change the forward pass, one
//! struct field per JSON field (flat, as in the file), with transformers' defaults and the
//! refusals of §7/§13. The contract's mirror is contract/tracegate_contract/config.py.
//!
//! Here: the parsed types and `Config::from_json`, which reads the fields every family shares and
//! takes each family's defaults and refusals from its own file, one per transformers
//! configuration class (`llama`, `qwen2`, `qwen3`, `qwen3_moe`, `qwen3_5` with its MoE and
//! multimodal forms, `gemma3`); `fields` holds the JSON field readers and what several families
//! share (the rope resolution), `sizes` the sizes checked against the checkpoint.

pub(crate) mod fields;
mod gemma3;
mod llama;
mod qwen2;
mod qwen3;
mod qwen3_5;
mod qwen3_moe;
mod sizes;

use std::path::Path;

use serde_json::Value;

use crate::ops::RopeScaling;
use crate::{err, Result};
use fields::{field, finite_rope, opt_bool, opt_f64, opt_usize, req_usize};
pub use gemma3::{Gemma3, Sliding};
use qwen3_5::text_config;
pub use sizes::check_sizes;

/// Positions are absolute token indices below 2^24 (f32 holds every integer up to it, §7).
pub const MAX_POSITIONS: usize = 1 << 24;

/// The `model_type`s the bit-exact producers (engine, contract) compute: a language model's
/// (`text_config.model_type` of a multimodal layout included) or a block-diffusion checkpoint's.
/// A gate checks it before any producer runs, so a refusal does not wait for the others.
pub const BIT_EXACT_FAMILIES: [&str; 10] = [
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "gemma3_text",
    "qwen3_5_text",
    "qwen3_5_moe_text",
    "qwen3_5",
    "qwen3_5_moe",
    "diffusion_gemma",
];

/// Why a `model_type` is refused; same text as the contract's (contract/tracegate_contract/config.py).
pub fn unsupported_family(model_type: &str) -> String {
    // The registry's families are the oracle's (oracle/tests/test_capture_registry.py).
    if tracegate_trace::names::family_features(model_type).is_some() {
        "not supported by the bit-exact producers (engine, contract: llama, qwen2, qwen3, qwen3_moe, gemma3_text, the Qwen3.5 families and diffusion_gemma); the oracle supports it: \
         python -m tracegate_oracle, trace-diff and gate bisect --reference oracle (docs/capture-points.md)"
            .to_string()
    } else {
        "not supported (engine, contract: llama, qwen2, qwen3, qwen3_moe, gemma3_text, the Qwen3.5 families and diffusion_gemma; oracle: the families of docs/capture-points.md)".to_string()
    }
}

/// The families this engine computes (a `model_type` of either layout names one).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ModelType {
    /// Dense llama (`LlamaForCausalLM`): no q/k norm, optional attention and MLP biases, scaled
    /// rope types (§7.1).
    Llama,
    /// Qwen2 (`Qwen2ForCausalLM`, Qwen2 and Qwen2.5): llama's layer with a bias on q, k and v
    /// (fixed: o_proj has none, and no config field says otherwise), no q/k norm.
    Qwen2,
    Qwen3,
    Qwen3Moe,
    /// Qwen3.5 dense: `qwen3_5_text`, or `qwen3_5` with `text_config`.
    Qwen3_5,
    /// Qwen3.5-MoE: `qwen3_5_moe_text`, or `qwen3_5_moe` with `text_config`.
    Qwen3_5Moe,
    /// Gemma 3 text (`gemma3_text`, `Gemma3ForCausalLM`, §22): a scaled embedding, `1 ⊕ w`
    /// norms (four per layer: around the attention and around the MLP), q/k norms, sliding and
    /// full layers with their own RoPE bases, a gelu_pytorch_tanh MLP.
    Gemma3,
}

impl ModelType {
    /// The Qwen3.5 families: hybrid linear/full attention, zero-centred norms, gated attention.
    pub fn is_qwen3_5(self) -> bool {
        matches!(self, ModelType::Qwen3_5 | ModelType::Qwen3_5Moe)
    }

    /// §15.1: every RMSNorm scales by `1 ⊕ w` (the Qwen3.5 families, Gemma 3).
    pub fn zero_centred_norms(self) -> bool {
        self.is_qwen3_5() || self == ModelType::Gemma3
    }

    /// §22.4: the mixer's and the MLP's outputs are each normed before their residual add
    /// (`post_attention_layernorm`, `post_feedforward_layernorm`), and the MLP's input by
    /// `pre_feedforward_layernorm` (Gemma 3); elsewhere `post_attention_layernorm` is the MLP's
    /// input norm.
    pub fn sandwich_norms(self) -> bool {
        self == ModelType::Gemma3
    }

    /// §22.2: the gated MLP's activation is gelu_pytorch_tanh (Gemma 3), not SiLU.
    pub fn gelu_mlp(self) -> bool {
        self == ModelType::Gemma3
    }

    /// §8.2: q_norm / k_norm on every head before RoPE: the Qwen3 and Qwen3.5 families (not
    /// llama, not qwen2).
    pub fn qk_norm(self) -> bool {
        !matches!(self, ModelType::Llama | ModelType::Qwen2)
    }

    /// §8.1: qwen2's q, k and v projections always carry a bias and its o_proj never does
    /// (transformers' Qwen2Attention; Qwen2Config has no `attention_bias`, and a config that
    /// states one is not read). The other families: `attention_bias` on all four.
    pub fn fixed_qkv_bias(self) -> bool {
        self == ModelType::Qwen2
    }

    /// §17: full attention's `q_proj` holds each head's query then its output gate (Qwen3.5).
    pub fn gated_attention(self) -> bool {
        self.is_qwen3_5()
    }

    /// Prefixes of the tensors a checkpoint of this family carries and the language model does
    /// not run (§20: Qwen3.5's vision tower and multi-token-prediction head); listed, not refused.
    pub fn unused_prefixes(self) -> &'static [&'static str] {
        match self.is_qwen3_5() {
            true => &qwen3_5::UNUSED_PREFIXES,
            false => &[],
        }
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

/// The computation-changing fields of a model's `config.json` (numerics.md §13).
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
    /// q_proj, k_proj and v_proj carry a bias: the config's `attention_bias`; always for qwen2.
    pub attention_bias: bool,
    /// o_proj carries a bias: `attention_bias` too, except for qwen2 (never).
    pub o_proj_bias: bool,
    /// llama's `mlp_bias`: gate, up and down projections carry a bias (false elsewhere).
    pub mlp_bias: bool,
    /// q_norm / k_norm on every head before RoPE (§8.2): the Qwen3 families; not llama, qwen2.
    pub qk_norm: bool,
    /// §7.1 the rope type's frequency scaling (llama; `Default` for the Qwen families).
    pub rope_scaling: RopeScaling,
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
    /// The positions a run may use (`--tokens` plus `--generate`), when the config says.
    pub max_position_embeddings: Option<usize>,
    /// Gemma 3's own fields (§22; None for the other families).
    pub gemma3: Option<Gemma3>,
}

/// One family's reading of `config.json`, as transformers' configuration class holds it: the
/// `model_type` and architecture that name it, its defaults, and the readers of what only it
/// has. Each family's is in its own file (`config/<family>.rs`); `Config::from_json` reads the
/// shared fields and asks the family where they differ.
#[derive(Clone, Copy)]
struct Family {
    kind: ModelType,
    model_type: &'static str,
    layout: Layout,
    /// The one `architectures` entry a config may name.
    architecture: &'static str,
    /// An absent `num_key_value_heads`: one per query head (true), or refused as missing.
    mha_by_default: bool,
    /// `head_dim` when absent.
    head_dim: HeadDim,
    /// `tie_word_embeddings` when absent.
    tie_word_embeddings: bool,
    /// Reads `mlp_bias` (else no MLP bias).
    reads_mlp_bias: bool,
    /// Reads `hidden_act` (only "silu") and `use_sliding_window` (only false).
    silu_mlp: bool,
    /// An odd `head_dim` is allowed (only part of it rotates).
    odd_head_dim: bool,
    /// Reads `intermediate_size` (the dense MLP's width).
    reads_intermediate_size: bool,
    /// `layer_types` (and its siblings), given `num_hidden_layers`.
    layer_types: fn(&Value, usize) -> Result<LayerTypes>,
    moe: fn(&Value) -> Result<Moe>,
    /// The rope given `num_hidden_layers` and `head_dim`.
    rope: fn(&Value, usize, usize) -> Result<Rope>,
    linear: fn(&Value, &LayerTypes) -> Result<Linear>,
}

/// The linear-attention sizes and the shared expert's width (0: none).
type Linear = (Option<LinearSizes>, usize);

/// Every family `from_json` reads, by `model_type`.
const FAMILIES: [Family; 9] = [
    llama::LLAMA,
    qwen2::QWEN2,
    qwen3::QWEN3,
    qwen3_moe::QWEN3_MOE,
    qwen3_5::QWEN3_5_TEXT,
    qwen3_5::QWEN3_5_MOE_TEXT,
    gemma3::GEMMA3_TEXT,
    qwen3_5::QWEN3_5,
    qwen3_5::QWEN3_5_MOE,
];

#[derive(Clone, Copy)]
enum HeadDim {
    Fixed(usize),
    /// The model's fallback when the config class has no such field.
    HiddenOverHeads,
}

/// The MoE block's fields (0 / false / empty for a dense family, as in the contract's `Config`).
struct Moe {
    num_experts: usize,
    num_experts_per_tok: usize,
    moe_intermediate_size: usize,
    norm_topk_prob: bool,
    decoder_sparse_step: usize,
    mlp_only_layers: Vec<usize>,
}

fn dense(_: &Value) -> Result<Moe> {
    Ok(Moe {
        num_experts: 0,
        num_experts_per_tok: 0,
        moe_intermediate_size: 0,
        norm_topk_prob: false,
        decoder_sparse_step: 1,
        mlp_only_layers: vec![],
    })
}

fn no_linear(_: &Value, _: &LayerTypes) -> Result<Linear> {
    Ok((None, 0))
}

/// The (full layers') rope: theta, the rotated leading dims of each head, the frequency scaling,
/// and Gemma 3's own fields, which its rope reading yields.
struct Rope {
    theta: f64,
    rotary_dim: usize,
    scaling: RopeScaling,
    gemma3: Option<Gemma3>,
}

impl Rope {
    fn whole(theta: f64, partial: f64, scaling: RopeScaling, head_dim: usize) -> Rope {
        Rope {
            theta,
            rotary_dim: (head_dim as f64 * partial) as usize, // transformers: int(head_dim * factor)
            scaling,
            gemma3: None,
        }
    }
}

impl Config {
    /// The fields shared by every family, read in one order (the first refusal named stays the
    /// same), each family's defaults and refusals taken from its `Family`.
    pub fn from_json(root: &Value) -> Result<Config> {
        if !root.is_object() {
            return Err(err!(Config: "config.json: not a JSON object"));
        }
        let model_type = field(root, "model_type")
            .and_then(|m| m.as_str())
            .unwrap_or("");
        let Some(fam) = FAMILIES.iter().find(|f| f.model_type == model_type) else {
            return Err(match model_type {
                "gemma3" => err!(Config: "{}", gemma3::MULTIMODAL_REFUSAL),
                other => err!(Config:
                    "config.json: model_type {other:?} {}",
                    unsupported_family(other)
                ),
            });
        };
        let (family, layout, want_arch) = (fam.kind, fam.layout, fam.architecture);
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
        if let Some(act) = field(v, "hidden_act").filter(|_| fam.silu_mlp) {
            if act.as_str() != Some("silu") {
                return Err(err!(Config:
                    "config.json: hidden_act = {act} not supported (only \"silu\")"
                ));
            }
        }
        if fam.silu_mlp && opt_bool(v, "use_sliding_window", false)? {
            return Err(err!(Config: "config.json: use_sliding_window = true not supported"));
        }
        let num_hidden_layers = req_usize(v, "num_hidden_layers")?;
        let layer_types = (fam.layer_types)(v, num_hidden_layers)?;
        let hidden_size = req_usize(v, "hidden_size")?;
        let num_attention_heads = req_usize(v, "num_attention_heads")?;
        let num_key_value_heads = match fam.mha_by_default {
            true => opt_usize(v, "num_key_value_heads")?.unwrap_or(num_attention_heads),
            false => req_usize(v, "num_key_value_heads")?,
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(
                err!(Config: "config.json: num_attention_heads {num_attention_heads} is not a multiple of num_key_value_heads {num_key_value_heads}"),
            );
        }
        let head_dim = match (opt_usize(v, "head_dim")?, fam.head_dim) {
            (Some(d), _) => d,
            (None, HeadDim::Fixed(d)) => d,
            (None, HeadDim::HiddenOverHeads) => hidden_size / num_attention_heads,
        };
        if !fam.odd_head_dim && (head_dim % 2 != 0 || head_dim == 0) {
            let from = if field(v, "head_dim").is_some() {
                String::new()
            } else {
                format!(" (hidden_size {hidden_size} / num_attention_heads {num_attention_heads})")
            };
            return Err(err!(Config:
                "config.json: head_dim = {head_dim}{from} must be even and positive"
            ));
        }
        // Not used by the forward, but a bound all the same: positions must stay below 2^24
        // (§7), and a run past it is refused as the oracle and the gate refuse it.
        let max_position_embeddings = opt_usize(v, "max_position_embeddings")?;
        if let Some(m) = max_position_embeddings {
            if m > MAX_POSITIONS {
                return Err(
                    err!(Config: "config.json: max_position_embeddings = {m} exceeds the position limit 2^24 = {MAX_POSITIONS}"),
                );
            }
        }
        // Read before the sizes below, so the first refusal named is the same as ever.
        let moe = (fam.moe)(v)?;
        let vocab_size = req_usize(v, "vocab_size")?;
        let intermediate_size = match fam.reads_intermediate_size {
            true => opt_usize(v, "intermediate_size")?,
            false => None,
        };
        // Every family's config class: 1e-6.
        let rms_norm_eps = opt_f64(v, "rms_norm_eps", 1e-6)?;
        let rope = (fam.rope)(v, num_hidden_layers, head_dim)?;
        finite_rope(rope.theta, rope.rotary_dim)?;
        let (linear, shared_expert_intermediate_size) = (fam.linear)(v, &layer_types)?;
        // §8.1: qwen2's q/k/v bias is fixed (its config's `attention_bias`, if any, is not read).
        let attention_bias = match family.fixed_qkv_bias() {
            true => true,
            false => opt_bool(v, "attention_bias", false)?,
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
            rope_theta: rope.theta,
            tie_word_embeddings: match outer_tie {
                Some(t) => t,
                None => opt_bool(v, "tie_word_embeddings", fam.tie_word_embeddings)?,
            },
            attention_bias,
            o_proj_bias: attention_bias && !family.fixed_qkv_bias(),
            mlp_bias: fam.reads_mlp_bias && opt_bool(v, "mlp_bias", false)?,
            qk_norm: family.qk_norm(),
            rope_scaling: rope.scaling,
            num_experts: moe.num_experts,
            num_experts_per_tok: moe.num_experts_per_tok,
            moe_intermediate_size: moe.moe_intermediate_size,
            norm_topk_prob: moe.norm_topk_prob,
            decoder_sparse_step: moe.decoder_sparse_step,
            mlp_only_layers: moe.mlp_only_layers,
            layer_types,
            rotary_dim: rope.rotary_dim,
            linear,
            shared_expert_intermediate_size,
            max_position_embeddings,
            gemma3: rope.gemma3,
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
            && (matches!(
                self.model_type,
                ModelType::Llama
                    | ModelType::Qwen2
                    | ModelType::Qwen3
                    | ModelType::Qwen3_5
                    | ModelType::Gemma3
            ) || self.num_experts == 0
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

    /// §22.3 layer `l`'s attention window W (a query at p sees the keys at p − W < q ≤ p); None:
    /// causal over every earlier key.
    pub fn window(&self, l: usize) -> Option<usize> {
        self.gemma3
            .as_ref()
            .filter(|g| g.is_sliding(l))
            .map(|g| g.sliding_window)
    }

    /// The `mask` attribute of layer `l`'s tensors: `sliding:W` or `causal` (as the oracle
    /// writes it, docs/trace-format.md).
    pub fn mask(&self, l: usize) -> String {
        match self.window(l) {
            Some(w) => format!("sliding:{w}"),
            None => "causal".to_string(),
        }
    }

    /// §8.4 the scores' scale: f32(1 / sqrt(head_dim)) in binary64; Gemma 3 (§22.3)
    /// f32(query_pre_attn_scalar^−0.5), transformers' `query_pre_attn_scalar**-0.5`.
    pub fn attn_scale(&self) -> f32 {
        match &self.gemma3 {
            Some(g) => g.query_pre_attn_scalar.powf(-0.5) as f32,
            None => (1.0f64 / (self.head_dim as f64).sqrt()) as f32,
        }
    }

    pub fn eps_f32(&self) -> f32 {
        // §6: the config's number (binary64 as parsed) rounded once to f32.
        self.rms_norm_eps as f32
    }
}

/// Read and validate `<dir>/config.json`; returns the parsed config and the raw JSON. For a GGUF
/// file, or a directory holding one and no safetensors (`gguf::model_file`), the config is the
/// one transformers builds from its metadata (docs/numerics.md §21.5).
pub fn load_config(dir: &Path) -> Result<(Config, Value)> {
    if let Some(file) = crate::gguf::model_file(dir)? {
        let raw = crate::gguf::load(&file)?.config;
        let cfg = Config::from_json(&raw).map_err(
            |e| err!(Config: "{}: the config made from its GGUF metadata: {e}", file.display()),
        )?;
        return Ok((cfg, raw));
    }
    let p = dir.join("config.json");
    // One regular file, bounded, no repeated key (serde keeps the last of two `num_experts`).
    let bytes = tracegate_trace::json::read_bytes(&p, tracegate_trace::json::MAX_JSON_LEN)
        .map_err(|e| err!(Config: "{e}"))?;
    let raw: Value = tracegate_trace::json::parse(&bytes)
        .map_err(|e| err!(Config: "{}: invalid JSON: {e}", p.display()))?;
    Ok((Config::from_json(&raw)?, raw))
}
