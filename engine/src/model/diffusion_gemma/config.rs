//! Diffusion Gemma's config and generation knobs (docs/diffusion-gemma.md DG0): the fields the
//! forward and the block loop read, transformers' defaults, and one-line refusals naming the
//! field for what this implementation does not run.

use std::path::Path;

use serde_json::{json, Value};

use crate::config::fields::{field, opt_f64};
use crate::config::MAX_POSITIONS;
use crate::{err, Result};

/// One layer type's attention shape and RoPE (DG4, DG5).
#[derive(Clone, Debug)]
pub struct Attn {
    pub head_dim: usize,
    pub kv_heads: usize,
    pub theta: f64,
    /// Proportional RoPE (full layers): the rotated pairs `[0, a)`; sliding layers rotate all.
    pub rotated: usize,
}

#[derive(Clone, Debug)]
pub struct DgConfig {
    pub vocab: usize,
    pub hidden: usize,
    /// F: the dense MLP's and the self-conditioning MLP's width.
    pub intermediate: usize,
    pub layers: usize,
    pub eps: f64,
    pub softcap: f64,
    pub window: usize,
    /// Per layer: sliding (true) or full attention.
    pub sliding: Vec<bool>,
    pub heads: usize,
    pub sliding_attn: Attn,
    pub full_attn: Attn,
    pub experts: usize,
    pub top_k: usize,
    pub moe_intermediate: usize,
    pub canvas: usize,
    pub tied: bool,
    pub max_positions: usize,
}

fn refuse(field: &str, what: impl std::fmt::Display) -> crate::Error {
    err!(Config: "config.json: {field}: {what} (not supported for diffusion_gemma)")
}

fn usize_or(v: &Value, key: &str, default: usize) -> Result<usize> {
    match field(v, key) {
        None => Ok(default),
        Some(x) => x
            .as_u64()
            .filter(|n| (1..(1 << 40)).contains(n))
            .map(|n| n as usize)
            .ok_or_else(
                || err!(Config: "config.json: text_config.{key} = {x} is not a positive integer"),
            ),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize> {
    if field(v, key).is_none() {
        return Err(err!(Config: "config.json: missing field text_config.{key}"));
    }
    usize_or(v, key, 0)
}

impl DgConfig {
    pub fn from_json(root: &Value) -> Result<DgConfig> {
        if let Some(a) = field(root, "architectures") {
            let ok = a.as_array().is_some_and(|l| {
                l.len() == 1 && l[0].as_str() == Some("DiffusionGemmaForBlockDiffusion")
            });
            if !ok {
                return Err(refuse("architectures", a));
            }
        }
        let t = field(root, "text_config")
            .filter(|t| t.is_object())
            .ok_or_else(|| err!(Config: "config.json: missing object text_config"))?;
        let canvas = match field(root, "canvas_length") {
            None => 256,
            Some(x) => x
                .as_u64()
                .filter(|n| (1..(1 << 24)).contains(n))
                .ok_or_else(
                    || err!(Config: "config.json: canvas_length = {x} is not a positive integer"),
                )? as usize,
        };
        let tied = match field(root, "tie_word_embeddings") {
            None => true,
            Some(x) => x.as_bool().ok_or_else(
                || err!(Config: "config.json: tie_word_embeddings = {x} is not a boolean"),
            )?,
        };
        let layers = usize_or(t, "num_hidden_layers", 30)?;
        if layers > 1 << 16 {
            return Err(
                err!(Config: "config.json: text_config.num_hidden_layers = {layers} is too large"),
            );
        }
        if let Some(x) = field(t, "hidden_activation") {
            if x.as_str() != Some("gelu_pytorch_tanh") {
                return Err(refuse("text_config.hidden_activation", x));
            }
        }
        if field(t, "attention_bias").is_some_and(|x| x != &json!(false)) {
            return Err(refuse("text_config.attention_bias", &t["attention_bias"]));
        }
        if field(t, "use_clipped_linears").is_some_and(|x| x != &json!(false)) {
            return Err(refuse(
                "text_config.use_clipped_linears",
                &t["use_clipped_linears"],
            ));
        }
        match field(t, "use_bidirectional_attention").map(|x| x.as_str()) {
            None | Some(Some("vision")) => {}
            _ => {
                return Err(refuse(
                    "text_config.use_bidirectional_attention",
                    &t["use_bidirectional_attention"],
                ))
            }
        }
        // A class attribute transformers always has; null would turn the cap off.
        let softcap = match t.get("final_logit_softcapping") {
            None => 30.0,
            Some(x) => x
                .as_f64()
                .filter(|c| c.is_finite() && *c > 0.0)
                .ok_or_else(|| {
                    refuse(
                        "text_config.final_logit_softcapping",
                        format!("{x} (must be a number > 0)"),
                    )
                })?,
        };
        let max_positions = usize_or(t, "max_position_embeddings", 131072)?;
        if max_positions > MAX_POSITIONS {
            return Err(
                err!(Config: "config.json: text_config.max_position_embeddings = {max_positions} exceeds 2^24"),
            );
        }
        // Layer types; the last layer is full whatever the list says (transformers rewrites it).
        let mut sliding: Vec<bool> = match field(t, "layer_types") {
            None => (0..layers).map(|l| !(l + 1).is_multiple_of(6)).collect(),
            Some(x) => {
                let list = x.as_array().filter(|l| l.len() == layers).ok_or_else(|| {
                    err!(Config: "config.json: text_config.layer_types: not a list of {layers} layer types")
                })?;
                list.iter()
                    .map(|k| match k.as_str() {
                        Some("sliding_attention") => Ok(true),
                        Some("full_attention") => Ok(false),
                        _ => Err(refuse("text_config.layer_types", k)),
                    })
                    .collect::<Result<_>>()?
            }
        };
        if let Some(last) = sliding.last_mut() {
            *last = false;
        }
        let heads = usize_or(t, "num_attention_heads", 8)?;
        let (d, kv) = (
            usize_or(t, "head_dim", 256)?,
            usize_or(t, "num_key_value_heads", 4)?,
        );
        // An entry of per_layer_config overrides the config's own head_dim / num_key_value_heads
        // (a key it omits keeps the config's value, as transformers' per-layer view does); a full
        // layer without an entry keeps both. Without per_layer_config, full layers take the
        // global values.
        let (dd, kk) = match field(t, "per_layer_config") {
            None => (
                usize_or(t, "global_head_dim", 512)?,
                match field(t, "num_global_key_value_heads") {
                    None => kv,
                    Some(_) => usize_or(t, "num_global_key_value_heads", kv)?,
                },
            ),
            Some(plc) => {
                let map = plc.as_object().ok_or_else(
                    || err!(Config: "config.json: text_config.per_layer_config is not an object"),
                )?;
                for (k, entry) in map {
                    let l: usize = k.parse().ok().filter(|&l| l < layers).ok_or_else(|| {
                        refuse(
                            "text_config.per_layer_config",
                            format!("key {k:?} is not a layer index"),
                        )
                    })?;
                    let e = entry.as_object().ok_or_else(|| {
                        refuse(
                            "text_config.per_layer_config",
                            format!("{k}: not an object"),
                        )
                    })?;
                    if let Some(other) = e
                        .keys()
                        .find(|f| *f != "head_dim" && *f != "num_key_value_heads")
                    {
                        return Err(refuse(
                            "text_config.per_layer_config",
                            format!("{k}.{other}"),
                        ));
                    }
                    if sliding[l]
                        && (
                            usize_or(entry, "head_dim", d)?,
                            usize_or(entry, "num_key_value_heads", kv)?,
                        ) != (d, kv)
                    {
                        return Err(refuse(
                            "text_config.per_layer_config",
                            format!("{k}: overrides a sliding layer"),
                        ));
                    }
                }
                let mut full: Option<(usize, usize)> = None;
                for l in (0..layers).filter(|&l| !sliding[l]) {
                    let pair = match map.get(&l.to_string()) {
                        None => (d, kv),
                        Some(entry) => (
                            usize_or(entry, "head_dim", d)?,
                            usize_or(entry, "num_key_value_heads", kv)?,
                        ),
                    };
                    if full.is_some_and(|f| f != pair) {
                        return Err(refuse(
                            "text_config.per_layer_config",
                            "two full layers with different head_dim or num_key_value_heads",
                        ));
                    }
                    full = Some(pair);
                }
                // The last layer is always full, so there is one.
                full.unwrap_or((d, kv))
            }
        };
        for (name, hd, nk) in [("head_dim", d, kv), ("full-layer head_dim", dd, kk)] {
            if !hd.is_multiple_of(2) {
                return Err(refuse(
                    &format!("text_config.{name}"),
                    format!("{hd} is odd"),
                ));
            }
            if !heads.is_multiple_of(nk) {
                return Err(refuse(
                    "text_config.num_attention_heads",
                    format!("{heads} is not a multiple of {nk} key/value heads"),
                ));
            }
        }
        let (st, ft) = rope(t)?;
        let full_rot = {
            let (f, _) = ft;
            // `int(f · D // 2)`: the binary64 product floor-divided by 2.
            ((f * dd as f64) / 2.0).floor() as usize
        };
        let experts = req_usize(t, "num_experts")?;
        let top_k = req_usize(t, "top_k_experts")?;
        if top_k >= experts {
            return Err(refuse(
                "text_config.top_k_experts",
                format!("{top_k} must be below num_experts {experts}"),
            ));
        }
        let vocab = usize_or(t, "vocab_size", 262144)?;
        if vocab < 2 {
            // An argmax margin needs a second token (§12).
            return Err(refuse(
                "text_config.vocab_size",
                format!("{vocab} (at least 2)"),
            ));
        }
        Ok(DgConfig {
            vocab,
            hidden: usize_or(t, "hidden_size", 2304)?,
            intermediate: usize_or(t, "intermediate_size", 9216)?,
            layers,
            eps: opt_f64(t, "rms_norm_eps", 1e-6)?,
            softcap,
            window: usize_or(t, "sliding_window", 512)?,
            sliding,
            heads,
            sliding_attn: Attn {
                head_dim: d,
                kv_heads: kv,
                theta: st,
                rotated: d / 2,
            },
            full_attn: Attn {
                head_dim: dd,
                kv_heads: kk,
                theta: ft.1,
                rotated: full_rot.min(dd / 2),
            },
            experts,
            top_k,
            moe_intermediate: req_usize(t, "moe_intermediate_size")?,
            canvas,
            tied,
            max_positions,
        })
    }

    pub fn attn(&self, l: usize) -> &Attn {
        if self.sliding[l] {
            &self.sliding_attn
        } else {
            &self.full_attn
        }
    }

    pub fn eps_f32(&self) -> f32 {
        self.eps as f32
    }
}

/// `rope_parameters`: (sliding θ, (full f, full θ)); other types and keys refused (DG0).
fn rope(t: &Value) -> Result<(f64, (f64, f64))> {
    let rp = field(t, "rope_parameters");
    let part = |kind: &str| rp.and_then(|r| field(r, kind));
    let check = |kind: &str, want_type: &str| -> Result<(f64, f64)> {
        let field = format!("text_config.rope_parameters.{kind}");
        let (f_default, theta_default) = match kind {
            "sliding_attention" => (1.0, 10000.0),
            _ => (0.25, 1_000_000.0),
        };
        let Some(p) = part(kind) else {
            return Ok((f_default, theta_default));
        };
        let obj = p
            .as_object()
            .ok_or_else(|| refuse(&field, "not an object"))?;
        for (k, v) in obj {
            match k.as_str() {
                "rope_type" => {
                    if v.as_str() != Some(want_type) {
                        return Err(refuse(&format!("{field}.rope_type"), v));
                    }
                }
                "rope_theta" | "partial_rotary_factor" => {}
                "factor" if v.as_f64() == Some(1.0) => {}
                _ => return Err(refuse(&format!("{field}.{k}"), v)),
            }
        }
        let theta = opt_f64(p, "rope_theta", theta_default)?;
        if theta <= 0.0 {
            return Err(refuse(&format!("{field}.rope_theta"), theta));
        }
        let f = opt_f64(p, "partial_rotary_factor", f_default)?;
        if kind == "sliding_attention" && f != 1.0 {
            return Err(refuse(&format!("{field}.partial_rotary_factor"), f));
        }
        if !(0.0..=1.0).contains(&f) {
            return Err(refuse(&format!("{field}.partial_rotary_factor"), f));
        }
        Ok((f, theta))
    };
    if let Some(r) = rp {
        let obj = r
            .as_object()
            .ok_or_else(|| refuse("text_config.rope_parameters", "not an object"))?;
        if let Some(k) = obj
            .keys()
            .find(|k| *k != "sliding_attention" && *k != "full_attention")
        {
            return Err(refuse(&format!("text_config.rope_parameters.{k}"), &r[k]));
        }
    }
    let (_, st) = check("sliding_attention", "default")?;
    let full = check("full_attention", "proportional")?;
    Ok((st, full))
}

/// The generation knobs of DG0, resolved: checkpoint, then transformers' global defaults, then
/// the command line.
#[derive(Clone, Debug)]
pub struct Knobs {
    pub max_new_tokens: usize,
    pub steps: usize,
    pub entropy_bound: f64,
    pub t_max: f64,
    pub t_min: f64,
    pub stability: usize,
    pub confidence: f64,
    /// As given (an int or a list); `eos` holds the ids.
    pub eos_json: Value,
    pub eos: Vec<i64>,
    pub pad: Option<i64>,
}

/// The command line's knobs (None: not given).
#[derive(Clone, Debug, Default)]
pub struct DiffusionOptions {
    pub seed: Option<u64>,
    pub denoising_steps: Option<usize>,
    pub t_max: Option<f64>,
    pub t_min: Option<f64>,
    pub entropy_bound: Option<f64>,
    pub stability_threshold: Option<usize>,
    pub confidence_threshold: Option<f64>,
    pub eos: Option<Vec<i64>>,
    pub pad: Option<i64>,
}

impl DiffusionOptions {
    /// The flags given, by name (other families refuse them).
    pub fn given(&self) -> Vec<&'static str> {
        let mut v = vec![];
        let flags: [(&str, bool); 9] = [
            ("--seed", self.seed.is_some()),
            ("--denoising-steps", self.denoising_steps.is_some()),
            ("--t-max", self.t_max.is_some()),
            ("--t-min", self.t_min.is_some()),
            ("--entropy-bound", self.entropy_bound.is_some()),
            ("--stability-threshold", self.stability_threshold.is_some()),
            (
                "--confidence-threshold",
                self.confidence_threshold.is_some(),
            ),
            ("--eos", self.eos.is_some()),
            ("--pad", self.pad.is_some()),
        ];
        for (f, on) in flags {
            if on {
                v.push(f);
            }
        }
        v
    }
}

impl Knobs {
    /// `generation_config.json` in `dir` (optional), the global defaults, then `o`; checked.
    pub fn resolve(
        dir: &Path,
        max_new_tokens: usize,
        o: &DiffusionOptions,
        vocab: usize,
    ) -> Result<Knobs> {
        let p = dir.join("generation_config.json");
        let g: Value = if p.exists() {
            let bytes = tracegate_trace::json::read_bytes(&p, tracegate_trace::json::MAX_JSON_LEN)
                .map_err(|e| err!(Config: "{e}"))?;
            tracegate_trace::json::parse(&bytes)
                .map_err(|e| err!(Config: "{}: invalid JSON: {e}", p.display()))?
        } else {
            json!({})
        };
        let gen_err = |k: &str, x: &Value, want: &str| err!(Config: "generation_config.json: {k} = {x} is not {want}");
        if let Some(x) = field(&g, "max_length") {
            return Err(
                err!(Config: "generation_config.json: max_length = {x}: not supported for diffusion_gemma (use --generate)"),
            );
        }
        let num = |v: &Value, k: &str, default: f64| -> Result<f64> {
            match field(v, k) {
                None => Ok(default),
                Some(x) => x
                    .as_f64()
                    .filter(|f| f.is_finite())
                    .ok_or_else(|| gen_err(k, x, "a finite number")),
            }
        };
        let int = |k: &str, default: u64| -> Result<u64> {
            match field(&g, k) {
                None => Ok(default),
                Some(x) => x.as_u64().ok_or_else(|| gen_err(k, x, "an integer ≥ 0")),
            }
        };
        let sampler = field(&g, "sampler_config").cloned().unwrap_or(json!({}));
        let ids = |k: &str, x: &Value| -> Result<Vec<i64>> {
            let list: Vec<&Value> = match x.as_array() {
                Some(a) => a.iter().collect(),
                None => vec![x],
            };
            list.iter()
                .map(|v| {
                    v.as_i64()
                        .filter(|&t| t >= 0 && (t as u64) < vocab as u64)
                        .ok_or_else(|| gen_err(k, x, "a token id or a list of them"))
                })
                .collect()
        };
        let (eos_json, eos) = match (&o.eos, field(&g, "eos_token_id")) {
            (Some(list), _) => (
                if list.len() == 1 {
                    json!(list[0])
                } else {
                    json!(list)
                },
                list.clone(),
            ),
            (None, Some(x)) => (x.clone(), ids("eos_token_id", x)?),
            (None, None) => (Value::Null, vec![]),
        };
        let pad = match (o.pad, field(&g, "pad_token_id")) {
            (Some(p), _) => Some(p),
            (None, Some(x)) => Some(ids("pad_token_id", x)?[0]),
            (None, None) => None,
        };
        let k = Knobs {
            max_new_tokens,
            steps: match o.denoising_steps {
                Some(n) => n,
                None => int("max_denoising_steps", 48)? as usize,
            },
            entropy_bound: o
                .entropy_bound
                .map_or_else(|| num(&sampler, "entropy_bound", 0.1), Ok)?,
            t_max: o.t_max.map_or_else(|| num(&g, "t_max", 0.8), Ok)?,
            t_min: o.t_min.map_or_else(|| num(&g, "t_min", 0.4), Ok)?,
            stability: match o.stability_threshold {
                Some(n) => n,
                None => int("stability_threshold", 1)? as usize,
            },
            confidence: o
                .confidence_threshold
                .map_or_else(|| num(&g, "confidence_threshold", 0.005), Ok)?,
            eos_json,
            eos,
            pad,
        };
        k.check(vocab)?;
        Ok(k)
    }

    fn check(&self, vocab: usize) -> Result<()> {
        let bad =
            |what: String| err!(Input: "{what} (diffusion_gemma, docs/diffusion-gemma.md DG0)");
        if self.steps == 0 || self.steps >= 1 << 32 {
            return Err(bad(format!(
                "max_denoising_steps (--denoising-steps) = {} must be an integer in [1, 2^32)",
                self.steps
            )));
        }
        if !(self.entropy_bound.is_finite() && self.entropy_bound > 0.0) {
            return Err(bad(format!(
                "entropy_bound (--entropy-bound) = {} must be > 0",
                self.entropy_bound
            )));
        }
        if !(self.t_min.is_finite() && self.t_max.is_finite() && self.t_min >= 0.0) {
            return Err(bad(format!("t_min (--t-min) = {} must be ≥ 0", self.t_min)));
        }
        if self.t_max <= self.t_min {
            return Err(bad(format!(
                "t_max (--t-max) = {} must be above t_min = {}",
                self.t_max, self.t_min
            )));
        }
        if !(self.confidence.is_finite() && self.confidence > 0.0) {
            return Err(bad(format!(
                "confidence_threshold (--confidence-threshold) = {} must be > 0",
                self.confidence
            )));
        }
        if self.stability >= 1 << 32 {
            return Err(bad(format!(
                "stability_threshold (--stability-threshold) = {} is too large",
                self.stability
            )));
        }
        for &t in self.eos.iter().chain(self.pad.iter()) {
            if t < 0 || t as u64 >= vocab as u64 {
                return Err(bad(format!(
                    "--eos/--pad token {t} outside the vocabulary [0, {vocab})"
                )));
            }
        }
        Ok(())
    }

    /// Provenance `generation` (DG16).
    pub fn provenance(&self, canvas: usize) -> Value {
        json!({
            "max_new_tokens": self.max_new_tokens,
            "canvas_length": canvas,
            "max_denoising_steps": self.steps,
            "entropy_bound": self.entropy_bound,
            "t_max": self.t_max,
            "t_min": self.t_min,
            "stability_threshold": self.stability,
            "confidence_threshold": self.confidence,
            "eos_token_id": self.eos_json,
            "pad_token_id": self.pad,
        })
    }
}
