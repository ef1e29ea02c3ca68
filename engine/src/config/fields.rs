//! The JSON field readers (a null field is an absent one) and what several families share: the
//! full-attention-only `layer_types`, the rope resolution (§7, §13).

use serde_json::Value;

use super::{LayerTypes, Rope};
use crate::ops::RopeScaling;
use crate::{err, Result};

/// A field; JSON null is an absent one (§13, DG0).
pub(crate) fn field<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.get(key).filter(|x| !x.is_null())
}
pub(super) fn req_usize(v: &Value, key: &str) -> Result<usize> {
    let x = field(v, key).ok_or_else(|| err!(Config: "config.json: missing field {key}"))?;
    x.as_u64()
        .filter(|&n| n >= 1)
        .map(|n| n as usize)
        .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a positive integer"))
}
pub(super) fn opt_usize(v: &Value, key: &str) -> Result<Option<usize>> {
    match field(v, key) {
        None => Ok(None),
        Some(_) => req_usize(v, key).map(Some),
    }
}
pub(super) fn opt_bool(v: &Value, key: &str, default: bool) -> Result<bool> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_bool()
            .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a boolean")),
    }
}
pub(crate) fn opt_f64(v: &Value, key: &str, default: f64) -> Result<f64> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| err!(Config: "config.json: {key} = {x} is not a finite number")),
    }
}

/// A `layer_types` list (one entry per layer, each one of `kinds`' names, `kinds` read in order
/// for the refusal's words), or None when the field is absent.
pub(super) fn layer_type_list<T: Copy>(
    v: &Value,
    num_hidden_layers: usize,
    kinds: [(&str, T); 2],
) -> Result<Option<Vec<T>>> {
    let Some(lt) = field(v, "layer_types") else {
        return Ok(None);
    };
    let list = lt
        .as_array()
        .and_then(|l| {
            l.iter()
                .map(|t| kinds.iter().find(|k| t.as_str() == Some(k.0)).map(|k| k.1))
                .collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| {
            err!(Config:
                "config.json: layer_types = {lt} not supported (only \"{}\" and \"{}\")",
                kinds[0].0,
                kinds[1].0
            )
        })?;
    if list.len() != num_hidden_layers {
        return Err(err!(Config:
            "config.json: layer_types has {} entries for num_hidden_layers = {num_hidden_layers}",
            list.len()
        ));
    }
    Ok(Some(list))
}

/// `layer_types` of a family whose layers all use full attention (llama, qwen2, the Qwen3
/// families): absent, or every entry `full_attention`.
pub(super) fn full_attention_only(v: &Value, _num_hidden_layers: usize) -> Result<LayerTypes> {
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
    Ok(LayerTypes::AllFull)
}

/// The default rope type only, rotating the whole head (qwen2, the Qwen3 families).
pub(super) fn plain_rope(v: &Value, _layers: usize, head_dim: usize) -> Result<Rope> {
    let (theta, partial, scaling) = rope_params(v, false, false)?;
    Ok(Rope::whole(theta, partial, scaling, head_dim))
}

/// Rope theta, `partial_rotary_factor` and the refusals of §7/§13, following transformers'
/// resolution: a non-empty legacy `rope_scaling` replaces `rope_parameters`; theta comes from that
/// dict, else the top-level `rope_theta`, else 10000; the factor from that dict, else the
/// top-level field, else the family's default (1 for Qwen3, where only 1 is accepted; 0.25 for
/// Qwen3.5). Qwen3.5 also accepts the multimodal rope's `mrope_section` (three non-negative
/// integers) and `mrope_interleaved` (a boolean): with text-only input the three position rows
/// transformers builds are equal, so every section rotates by the same 1-D position and the
/// sections change nothing.
pub(super) fn rope_params(
    v: &Value,
    qwen3_5: bool,
    llama: bool,
) -> Result<(f64, f64, RopeScaling)> {
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
        return Ok((positive_theta(top_theta)?, partial, RopeScaling::Default));
    };
    let obj = d
        .as_object()
        .ok_or_else(|| err!(Config: "config.json: {dict_name} is not an object"))?;
    // §7.1: llama also scales its frequencies (`linear`, `llama3`); the Qwen families take only
    // the default type.
    let mut rope_type = "default";
    for key in ["rope_type", "type"] {
        if let Some(t) = obj.get(key).filter(|x| !x.is_null()) {
            match t.as_str() {
                Some(name @ ("linear" | "llama3")) if llama => rope_type = name,
                Some("default") => {}
                _ if llama => {
                    return Err(err!(Config:
                        "config.json: {dict_name}.{key} = {t} not supported (only \"default\", \"linear\" and \"llama3\")"
                    ))
                }
                _ => {
                    return Err(err!(Config:
                        "config.json: {dict_name}.{key} = {t} not supported (only \"default\")"
                    ))
                }
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
    let scaled: &[&str] = match rope_type {
        "linear" => &["factor"],
        "llama3" => &[
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ],
        _ => &[],
    };
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
    if let Some(k) = obj
        .keys()
        .find(|k| !known.contains(&k.as_str()) && !scaled.contains(&k.as_str()))
    {
        return Err(err!(Config:
            "config.json: {dict_name}.{k} not supported with the {rope_type} rope type"
        ));
    }
    // Each scaling number is required, finite and positive (a zero factor divides by zero).
    let num = |key: &str| -> Result<f64> {
        let x = obj.get(key).filter(|x| !x.is_null()).ok_or_else(
            || err!(Config: "config.json: {dict_name}.{key} missing for the {rope_type} rope type"),
        )?;
        x.as_f64().filter(|f| f.is_finite() && *f > 0.0).ok_or_else(
            || err!(Config: "config.json: {dict_name}.{key} = {x} is not a positive number"),
        )
    };
    let scaling = match rope_type {
        "linear" => RopeScaling::Linear {
            factor: num("factor")?,
        },
        "llama3" => {
            let factor = num("factor")?;
            let (low, high) = (num("low_freq_factor")?, num("high_freq_factor")?);
            let old = num("original_max_position_embeddings")?;
            if high <= low {
                return Err(err!(Config:
                    "config.json: {dict_name}.high_freq_factor = {high} must exceed low_freq_factor = {low} (the blend divides by their difference)"
                ));
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: old,
            }
        }
        _ => RopeScaling::Default,
    };
    Ok((
        positive_theta(opt_f64(d, "rope_theta", top_theta)?)?,
        partial,
        scaling,
    ))
}

/// A theta ≤ 0 makes every inverse frequency NaN or infinite: refuse it here rather than
/// produce NaN logits later.
pub(super) fn positive_theta(theta: f64) -> Result<f64> {
    if theta > 0.0 {
        Ok(theta)
    } else {
        Err(err!(Config: "config.json: rope_theta = {theta} is not positive"))
    }
}

/// §7: the largest rope frequency must be a finite f32. With `d` rotated dims the frequencies
/// are f32(1/θ^(2i/d)) for i < ⌈d/2⌉ (`ops::inv_freq`), monotone in i: the largest is i = 0 (1)
/// for θ ≥ 1, else the last. A θ so small that it overflows (1e-60; an f32 subnormal with a
/// wide head) gives infinite angles and NaN logits: refused here, naming the numbers, rather
/// than after the whole forward pass (the contract applies the same rule).
pub(super) fn finite_rope(theta: f64, d: usize) -> Result<()> {
    if d == 0 {
        return Ok(());
    }
    let last = 2 * (d.div_ceil(2) - 1);
    let f = 1.0f64 / theta.powf(last as f64 / d as f64);
    if (f as f32).is_finite() {
        Ok(())
    } else {
        Err(err!(Config:
            "config.json: rope_theta = {theta:e} gives the rope frequency 1/θ^({last}/{d}) = {f:e}, beyond f32 (its angles would be infinite, the logits NaN)"
        ))
    }
}
