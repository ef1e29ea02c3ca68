//! What only Gemma 3 (`gemma3_text`, transformers' `Gemma3TextConfig`) reads (docs/numerics.md
//! §22): which layers attend through a sliding window and how wide it is, the two RoPE tables
//! (the sliding layers' `rope_local_base_freq`, the full layers' `rope_theta` with their scaling),
//! the attention scale `query_pre_attn_scalar` and the final logit softcap.

use serde_json::{Map, Value};

use super::fields::{
    field, finite_rope, layer_type_list, opt_f64, opt_usize, positive_theta, req_usize,
};
use super::{dense, no_linear, Family, HeadDim, LayerTypes, Layout, ModelType, Rope};
use crate::ops::RopeScaling;
use crate::{err, Result};

pub(super) const GEMMA3_TEXT: Family = Family {
    kind: ModelType::Gemma3,
    model_type: "gemma3_text",
    layout: Layout::Text,
    architecture: "Gemma3ForCausalLM",
    // Required: Gemma3TextConfig's default (4) is no checkpoint's.
    mha_by_default: false,
    // Gemma3TextConfig declares head_dim = 256.
    head_dim: HeadDim::Fixed(256),
    // Gemma3TextConfig ties the head by default.
    tie_word_embeddings: true,
    reads_mlp_bias: false,
    // §22.1: neither `hidden_act` nor `use_sliding_window` is read (the activation is
    // `hidden_activation`, the windows `layer_types`): `gemma3_fields`.
    silu_mlp: false,
    odd_head_dim: false,
    reads_intermediate_size: true,
    // Softmax attention everywhere; `Gemma3::sliding` says which layers slide.
    layer_types: |_, _| Ok(LayerTypes::AllFull),
    moe: dense,
    rope,
    linear: no_linear,
};

/// The multimodal checkpoint keeps its language model under other names and a vision tower
/// beside it: refused, pointing at the text-only layout.
pub(super) const MULTIMODAL_REFUSAL: &str = "config.json: model_type \"gemma3\" (Gemma3ForConditionalGeneration) not supported by the bit-exact producers: they run its language model saved on its own, as a Gemma3ForCausalLM checkpoint with model_type \"gemma3_text\"";

/// Gemma 3's fields; its full layers' rope is §13's `rope_theta` and `rope_scaling`, and they
/// rotate the whole head.
fn rope(v: &Value, layers: usize, head_dim: usize) -> Result<Rope> {
    let (g, theta, scaling) = gemma3_fields(v, layers)?;
    finite_rope(g.local_rope_theta, head_dim)?;
    Ok(Rope {
        gemma3: Some(g),
        ..Rope::whole(theta, 1.0, scaling, head_dim)
    })
}

/// Gemma3TextConfig's defaults (`default_theta`, `sliding_window_pattern`, `query_pre_attn_scalar`).
const GLOBAL_THETA: f64 = 1_000_000.0;
const LOCAL_THETA: f64 = 10_000.0;
const PATTERN: usize = 6;

/// Which layers slide: the config's `layer_types`, or every layer but each `pattern`-th
/// (`sliding_window_pattern`, transformers' rule when `layer_types` is absent) — kept as a rule,
/// since the layer count is not yet bounded by the checkpoint when the config is read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Sliding {
    List(Vec<bool>),
    Pattern(usize),
}

/// Gemma 3's own fields.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3 {
    /// `sliding_window`: a sliding layer's query at position p sees the keys at p − W < q ≤ p.
    pub sliding_window: usize,
    pub sliding: Sliding,
    /// The sliding layers' RoPE base (`rope_parameters.sliding_attention.rope_theta`, else
    /// `rope_local_base_freq`, else 10000); their rope type is the default one.
    pub local_rope_theta: f64,
    /// §22.3: scores are scaled by f32(query_pre_attn_scalar^−0.5), not by head_dim's.
    pub query_pre_attn_scalar: f64,
    /// §22.5: `final_logit_softcapping` (None: the logits are the head's output).
    pub final_logit_softcapping: Option<f64>,
}

impl Gemma3 {
    pub fn is_sliding(&self, l: usize) -> bool {
        match &self.sliding {
            Sliding::List(s) => s[l],
            // transformers: sliding unless (l + 1) % pattern == 0.
            Sliding::Pattern(p) => !(l + 1).is_multiple_of(*p),
        }
    }
}

/// Gemma 3's fields, with the full layers' rope (theta and scaling) as §13's `rope_theta` and
/// `rope_scaling`. Refused, naming the field: anything transformers would read differently
/// from what is computed here (bidirectional attention, an activation other than
/// gelu_pytorch_tanh, attention-score softcapping, a rope type other than default/linear).
fn gemma3_fields(v: &Value, num_hidden_layers: usize) -> Result<(Gemma3, f64, RopeScaling)> {
    if let Some(act) = field(v, "hidden_activation") {
        if act.as_str() != Some("gelu_pytorch_tanh") {
            return Err(err!(Config:
                "config.json: hidden_activation = {act} not supported (only \"gelu_pytorch_tanh\")"
            ));
        }
    }
    if let Some(b) = field(v, "use_bidirectional_attention") {
        if b.as_bool() != Some(false) {
            return Err(err!(Config:
                "config.json: use_bidirectional_attention = {b} not supported (only false: a causal decoder)"
            ));
        }
    }
    if let Some(c) = field(v, "attn_logit_softcapping") {
        return Err(err!(Config:
            "config.json: attn_logit_softcapping = {c} not supported (only null, as every Gemma 3 checkpoint ships it: transformers' Gemma3Attention keeps the field and never applies it)"
        ));
    }
    let final_logit_softcapping = match field(v, "final_logit_softcapping") {
        None => None,
        Some(c) => Some(c.as_f64().filter(|f| f.is_finite() && *f > 0.0).ok_or_else(
            || err!(Config: "config.json: final_logit_softcapping = {c} is not a positive number"),
        )?),
    };
    let query_pre_attn_scalar = opt_f64(v, "query_pre_attn_scalar", 256.0)?;
    if query_pre_attn_scalar <= 0.0 {
        return Err(err!(Config:
            "config.json: query_pre_attn_scalar = {query_pre_attn_scalar} is not positive"
        ));
    }
    let kinds = [("sliding_attention", true), ("full_attention", false)];
    let sliding = match layer_type_list(v, num_hidden_layers, kinds)? {
        Some(list) => Sliding::List(list),
        None => Sliding::Pattern(opt_usize(v, "sliding_window_pattern")?.unwrap_or(PATTERN)),
    };
    let any_sliding = match &sliding {
        Sliding::List(s) => s.contains(&true),
        Sliding::Pattern(p) => *p > 1, // layer 0 slides unless every layer is full
    };
    let sliding_window = match (field(v, "sliding_window"), any_sliding) {
        (_, false) => 0,
        (None, true) => 4096, // Gemma3TextConfig's default
        (Some(_), true) => req_usize(v, "sliding_window")?,
    };
    let (full_theta, scaling, local_rope_theta) = gemma3_rope(v)?;
    Ok((
        Gemma3 {
            sliding_window,
            sliding,
            local_rope_theta,
            query_pre_attn_scalar,
            final_logit_softcapping,
        },
        full_theta,
        scaling,
    ))
}

/// transformers' `Gemma3TextConfig.convert_rope_params_to_dict`: `rope_parameters` keyed by
/// layer type; a legacy `rope_scaling` updates the full layers' entry; the full layers' theta is
/// that entry's, else `rope_theta`, else 1e6; the sliding layers', theirs, else
/// `rope_local_base_freq`, else 1e4. A flat `rope_parameters` (not keyed by layer type) is
/// refused: transformers keeps its keys beside the two entries and reads neither.
fn gemma3_rope(v: &Value) -> Result<(f64, RopeScaling, f64)> {
    let empty = Map::new();
    let params = match field(v, "rope_parameters") {
        None => &empty,
        Some(p) => p.as_object().ok_or_else(
            || err!(Config: "config.json: rope_parameters = {p} is not an object or null"),
        )?,
    };
    if let Some(k) = params
        .keys()
        .find(|k| !matches!(k.as_str(), "sliding_attention" | "full_attention"))
    {
        return Err(err!(Config:
            "config.json: rope_parameters.{k} not supported (Gemma 3's rope_parameters are keyed by layer type: sliding_attention, full_attention)"
        ));
    }
    let entry = |key: &str| -> Result<Map<String, Value>> {
        match params.get(key).filter(|x| !x.is_null()) {
            None => Ok(Map::new()),
            Some(e) => e.as_object().cloned().ok_or_else(
                || err!(Config: "config.json: rope_parameters.{key} = {e} is not an object"),
            ),
        }
    };
    let mut full = entry("full_attention")?;
    let sliding = entry("sliding_attention")?;
    match field(v, "rope_scaling") {
        None => {}
        Some(rs) => {
            let m = rs.as_object().ok_or_else(
                || err!(Config: "config.json: rope_scaling = {rs} is not an object or null"),
            )?;
            for (k, x) in m {
                full.insert(k.clone(), x.clone());
            }
        }
    }
    let full_theta = opt_f64(v, "rope_theta", GLOBAL_THETA)?;
    let local_theta = opt_f64(v, "rope_local_base_freq", LOCAL_THETA)?;
    let (full_theta, scaling) = rope_entry(&full, "full_attention", full_theta, true)?;
    let (local_theta, _) = rope_entry(&sliding, "sliding_attention", local_theta, false)?;
    Ok((full_theta, scaling, local_theta))
}

/// One layer type's rope entry: its theta (else `theta`) and its type — the default one, or for
/// the full layers also `linear` (every frequency divided by `factor`, §7.1).
fn rope_entry(
    e: &Map<String, Value>,
    name: &str,
    theta: f64,
    full: bool,
) -> Result<(f64, RopeScaling)> {
    let at = format!("rope_parameters.{name}");
    let mut linear = false;
    for key in ["rope_type", "type"] {
        if let Some(t) = e.get(key).filter(|x| !x.is_null()) {
            match t.as_str() {
                Some("default") => {}
                Some("linear") if full => linear = true,
                _ if full => {
                    return Err(err!(Config:
                        "config.json: {at}.{key} = {t} not supported (only \"default\" and \"linear\")"
                    ))
                }
                _ => {
                    return Err(err!(Config:
                        "config.json: {at}.{key} = {t} not supported (only \"default\")"
                    ))
                }
            }
        }
    }
    let known: &[&str] = if linear {
        &["rope_type", "type", "rope_theta", "factor"]
    } else {
        &["rope_type", "type", "rope_theta"]
    };
    if let Some(k) = e.keys().find(|k| !known.contains(&k.as_str())) {
        let kind = if linear { "linear" } else { "default" };
        return Err(err!(Config:
            "config.json: {at}.{k} not supported with the {kind} rope type"
        ));
    }
    let theta = match e.get("rope_theta").filter(|x| !x.is_null()) {
        None => theta,
        Some(x) => x.as_f64().filter(|f| f.is_finite()).ok_or_else(
            || err!(Config: "config.json: {at}.rope_theta = {x} is not a finite number"),
        )?,
    };
    let scaling = if linear {
        let f = e.get("factor").filter(|x| !x.is_null()).ok_or_else(
            || err!(Config: "config.json: {at}.factor missing for the linear rope type"),
        )?;
        let factor = f
            .as_f64()
            .filter(|x| x.is_finite() && *x > 0.0)
            .ok_or_else(
                || err!(Config: "config.json: {at}.factor = {f} is not a positive number"),
            )?;
        RopeScaling::Linear { factor }
    } else {
        RopeScaling::Default
    };
    Ok((positive_theta(theta)?, scaling))
}
