//! Tolerance policies: which numeric difference is acceptable for which tensor, written as
//! data. Rules are tried in file order and the first whose pattern matches a tensor's name
//! judges it; a tensor no rule matches is a finding, never a silent pass. Decisions are not
//! covered by policies: they are always compared exactly.

use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};
use tracegate_trace::DType;

use crate::Real;

pub const POLICY_FORMAT: &str = "tracegate-policy/1";

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    /// Must be `tracegate-policy/1`.
    pub format: String,
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// Where the bounds came from (runs, versions, observed maxima).
    #[serde(default)]
    pub measurements: serde_json::Value,
    pub rules: Vec<Rule>,
    /// When a flipped decision counts as a near-tie (docs/diff.md, "Labels"); absent: the
    /// default factor.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub near_tie: Option<NearTie>,
    /// With a noise reference: every tensor whose rule sets no `max_noise_ratio` is also held to
    /// relative L2 <= `max_ratio` times the noise reference's on the same elements, where that is
    /// measurable and above 0 (a measured 0 is no bound: the rule's own bounds stand alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub noise_ratio: Option<NoiseRatio>,
    /// The precision the bounds were measured for, the candidate's (`f32`, `bf16`, `f16`):
    /// a bf16 policy on an f32 candidate passes what f32 rounding never makes, an f32 one on
    /// a bf16 candidate fails honest rounding. The report names both and warns when they differ.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate_dtype: Option<String>,
    /// A claim per capture-point pattern (`layer.*.attn_probs=f16,**=f32`; [`Policy::claimed`]):
    /// the patterns in order. A tensor is judged by the rules of the first pattern that covers
    /// it, and no other; one no pattern covers has no rule. Empty for a policy file.
    #[serde(skip)]
    pub scopes: Vec<String>,
}

/// The precisions a candidate computes in, finest first; each is a bundled policy's name. q8:
/// float weights and activations whose matmul inputs are rounded to 8 bits (docs/diff.md, q8).
pub const PRECISIONS: [&str; 4] = ["f32", "f16", "bf16", "q8"];

/// The precision a trace's producer computes in: the one reading of it, by trace-diff (the
/// report's `candidate_computes_in`), `gate bisect` (the judge line's remarks) and the port
/// gate (a milestone's `auto` policy from its golden traces). `tensors`: each tensor's name and
/// dtype.
/// - Its declaration (provenance `precision`, the coarsest it names; [`checked_declaration`]):
///   one naming no precision, or with a pattern that matches none of `tensors`, is refused
///   (Err), never passed over for the dtype: `"fp32"` is not read as "nothing declared".
/// - Else the finer of its provenance `dtype` (`f32` or `float32`, `bf16` or `bfloat16`, `f16`
///   or `float16`) and its tensors' ([`stored_precision`]): where the two differ the stricter,
///   so one tensor written as bf16 does not make an f32 producer read as bf16, nor a `dtype`
///   of bf16 a trace whose every tensor is f32 (issue 50: a candidate never makes itself
///   looser).
/// - Ok(None) when it declares nothing and records no dtype: its tensors alone never name one.
pub fn computes_in<'a>(
    provenance: &serde_json::Value,
    tensors: impl Iterator<Item = (&'a str, DType)> + Clone,
) -> Result<Option<&'static str>, String> {
    if let Some(p) = checked_declaration(provenance, tensors.clone().map(|(n, _)| n))? {
        return Ok(Some(p));
    }
    let dtype = provenance
        .get("dtype")
        .and_then(serde_json::Value::as_str)
        .and_then(dtype_precision);
    Ok(dtype.map(|d| finest([d, stored_precision(tensors.map(|(_, t)| t))])))
}

/// The coarsest float dtype among a trace's tensors, as a precision: bf16 if any is bf16, else
/// f16 if any is f16, else f32.
pub fn stored_precision(dtypes: impl Iterator<Item = DType>) -> &'static str {
    let floats = dtypes.filter_map(|d| match d {
        DType::BF16 => Some("bf16"),
        DType::F16 => Some("f16"),
        _ => None,
    });
    coarsest(floats).unwrap_or("f32")
}

/// The precision a name that is none of [`PRECISIONS`] was likely meant as (`fp32`, `float32`
/// and `F32` for f32; `fp16`, `half`; `bfloat16`; `int8`, `q8_0`), as words to append to a
/// refusal: ` (did you mean "f32"?)`, or nothing.
pub fn did_you_mean(name: &str) -> String {
    let n = name.trim().to_ascii_lowercase();
    let meant = match n.as_str() {
        "f32" | "fp32" | "float32" | "float" | "single" | "torch.float32" => "f32",
        "f16" | "fp16" | "float16" | "half" | "torch.float16" => "f16",
        "bf16" | "bfloat16" | "bfp16" | "torch.bfloat16" => "bf16",
        "q8" | "q8_0" | "int8" | "i8" | "8bit" => "q8",
        _ => return String::new(),
    };
    format!(" (did you mean {meant:?}?)")
}

/// The precision a provenance `dtype` names (`f32` or `float32`, `bf16` or `bfloat16`, `f16`
/// or `float16`); None for anything else.
pub fn dtype_precision(dtype: &str) -> Option<&'static str> {
    match dtype {
        "f32" | "float32" => Some("f32"),
        "bf16" | "bfloat16" => Some("bf16"),
        "f16" | "float16" => Some("f16"),
        _ => None,
    }
}

/// What a producer declares it computes in (provenance `precision`, docs/trace-format.md): one
/// of `PRECISIONS` for the whole trace, or an object from capture-point patterns to them (an
/// engine that keeps its KV cache in f16: `{"*": "f32", "layer.*.attn_probs": "f16"}`). The
/// coarsest named; Ok(None) when nothing is declared; Err names the bad value.
pub fn declared_precision(provenance: &serde_json::Value) -> Result<Option<&'static str>, String> {
    let Some(d) = provenance.get("precision") else {
        return Ok(None);
    };
    let one = |v: &serde_json::Value, at: &str| -> Result<&'static str, String> {
        let name = v.as_str().unwrap_or_default();
        PRECISIONS
            .iter()
            .find(|p| **p == name)
            .copied()
            .ok_or_else(|| {
                format!(
                    "provenance precision{at} is {v}: expected one of {}{}",
                    PRECISIONS.join(", "),
                    did_you_mean(name)
                )
            })
    };
    let named: Vec<&'static str> = match d {
        serde_json::Value::Object(m) if !m.is_empty() => m
            .iter()
            .map(|(k, v)| one(v, &format!("[{k:?}]")))
            .collect::<Result<_, _>>()?,
        serde_json::Value::Object(_) => {
            return Err("provenance precision is an empty object: name a precision per capture-point pattern, or one for the whole trace".into())
        }
        v => vec![one(v, "")?],
    };
    Ok(coarsest(named))
}

/// A producer's declaration checked against its tensors: each pattern of an object declaration
/// must match one of `names` (a pattern that matches nothing is no declaration about this trace,
/// and was how a port once chose a looser judge); Err names the pattern. Ok: the coarsest
/// declared, as [`declared_precision`].
pub fn checked_declaration<'a>(
    provenance: &serde_json::Value,
    names: impl Iterator<Item = &'a str> + Clone,
) -> Result<Option<&'static str>, String> {
    let declared = declared_precision(provenance)?;
    if let Some(serde_json::Value::Object(m)) = provenance.get("precision") {
        if let Some(k) = m.keys().find(|k| !names.clone().any(|n| glob_match(k, n))) {
            return Err(format!(
                "provenance precision names the pattern {k:?}, which matches no tensor of the trace: a declaration says what its tensors are, and one about no tensor is refused"
            ));
        }
    }
    Ok(declared)
}

/// The coarsest of some precisions (`PRECISIONS` order; a name outside it counts as finest).
pub fn coarsest<'a>(precisions: impl IntoIterator<Item = &'a str>) -> Option<&'a str> {
    precisions
        .into_iter()
        .max_by_key(|p| PRECISIONS.iter().position(|q| q == p))
}

/// The finest of two precisions of `PRECISIONS` (the stricter judge).
fn finest([a, b]: [&str; 2]) -> &str {
    if coarsest([a, b]) == Some(a) {
        b
    } else {
        a
    }
}

/// The near-tie calibration (docs/diff.md, "The near-tie rule"): a flip whose gap in the
/// reference's own scores is at most `margin_factor` times the honest noise `d` of those scores
/// is a near-tie. `d` is measured by tracegate (the noise reference's row), else read here
/// (`noise_abs`): never the candidate's own difference, which the candidate sizes itself.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NearTie {
    pub margin_factor: f64,
    /// The honest per-element noise of decision scores, by source-tensor pattern (first match):
    /// `d` for a flip when no noise reference measures its row.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub noise_abs: Vec<NoiseAbs>,
    /// Why this factor (free text).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// One `near_tie.noise_abs` entry: the largest |reference − honest run| an element of a
/// matching score tensor (`logits`, `router.logits`, ...) shows, from measured runs.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NoiseAbs {
    pub pattern: String,
    pub max_abs: f64,
    /// In a claimed policy: the scope (claim pattern) it serves.
    #[serde(skip)]
    pub scope: Option<usize>,
    /// Where the number came from (free text).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// The policy-wide noise-relative bound (`noise_ratio`), read only with a noise reference.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct NoiseRatio {
    pub max_ratio: f64,
    /// Where the number came from (free text).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// Without a `near_tie` entry: an order of two scores inverts only if they moved by at least
/// their gap, and each moved by at most the row's divergence d, so a flip needs margin ≤ 2·d.
pub const DEFAULT_NEAR_TIE_FACTOR: f64 = 2.0;

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Rule {
    /// Glob over the tensor name: `*` = any run of characters without `.`, `**` = any run,
    /// `?` = one character.
    pub pattern: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_ulp: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_abs: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rel: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_rel_l2: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cosine: Option<f64>,
    /// Bound on |⟨c, r⟩ / ⟨r, r⟩ − 1|: how far the candidate's least-squares scale against the
    /// reference is from 1. Rounding noise is unbiased and leaves it near 0; a scale error moves
    /// all of it (docs/diff.md, "Scale error").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_scale_error: Option<f64>,
    /// Bound on the candidate's relative L2 against the reference divided by the noise
    /// reference's (`--noise-reference`: the reference model run in the candidate's own
    /// precision): at most k times the error that precision makes honestly (docs/diff.md,
    /// "Noise-relative bound").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_noise_ratio: Option<f64>,
    /// Set from the policy's `noise_ratio` (never read from a file): an undefined ratio (no
    /// noise to measure) breaks no bound, since a measured 0 is no bound by itself.
    #[serde(skip)]
    pub noise_ratio_from_policy: bool,
    /// In a claimed policy: the index of the scope (claim pattern) this rule judges under, and
    /// the noise ratio of the policy it came from.
    #[serde(skip)]
    pub scope: Option<usize>,
    #[serde(skip)]
    pub part_noise_ratio: Option<f64>,
    /// The rule judges only tensors whose candidate's `path` attribute is this (e.g. `layer`: a layer run
    /// alone on the reference's input, where no upstream drift is mixed in); absent: any path.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// Why this bound (free text, shown in `--json`).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub why: String,
}

/// The measured quantities a rule can bound (None = undefined, e.g. cosine of zero vectors).
#[derive(Clone, Copy, Debug, Default)]
pub struct Measured {
    pub max_ulp: Option<u64>,
    pub max_abs: f64,
    pub max_rel: f64,
    pub rel_l2: Option<f64>,
    pub cosine: Option<f64>,
    pub scale_error: Option<f64>,
    /// The candidate's relative L2 over the noise reference's, for the same elements; None
    /// when undefined (no noise reference, the tensor absent from it, its relative L2 0 while
    /// the candidate's is not, or undefined).
    pub noise_ratio: Option<f64>,
    /// The same ratio per token row, where the tensor has rows and the noise measure is
    /// defined; bounded by the same `max_noise_ratio`.
    pub noise_rows: Option<RowRatios>,
    /// Elements whose bits differ but have no numeric distance (NaN on either side), or an
    /// infinity against something else: no tolerance covers these.
    pub nonfinite_differences: u64,
}

/// The token rows' noise ratios a bound reads: the row with the largest defined ratio, and the
/// first row whose ratio is undefined (the noise reference exact there while the candidate is
/// not, or a side's relative L2 undefined), by position.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RowRatios {
    pub worst: Option<(i64, f64)>,
    pub first_undefined: Option<i64>,
}

impl Policy {
    /// A policy file: one regular file of at most [`tracegate_trace::json::MAX_JSON_LEN`] bytes
    /// (a FIFO or `/dev/zero` is refused before it is read), then [`Policy::parse`].
    pub fn load(path: &Path) -> Result<Policy, String> {
        let bytes = tracegate_trace::json::read_bytes(path, tracegate_trace::json::MAX_JSON_LEN)?;
        let text = std::str::from_utf8(&bytes)
            .map_err(|e| format!("{}: not a policy: not UTF-8: {e}", path.display()))?;
        Policy::parse(text).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// A policy's text. Refused: a repeated key in any object (serde keeps the last, so a
    /// second `max_rel_l2` in a rule would silently loosen it), an unknown field, a rule with
    /// no bound or a bound outside its quantity's range.
    pub fn parse(text: &str) -> Result<Policy, String> {
        let p: Policy = tracegate_trace::json::parse(text.as_bytes())
            .map_err(|e| {
                // serde names one missing field at a time: point at a whole example instead.
                let hint = if e.to_string().contains("missing field") {
                    format!(" (a policy needs format {POLICY_FORMAT:?}, name and rules; the bundled fixtures/policy/oracle-default.json is a complete one, docs/diff.md \"Policies\")")
                } else {
                    String::new()
                };
                format!("not a policy: {e}{hint}")
            })?;
        if p.format != POLICY_FORMAT {
            return Err(format!(
                "format is {:?}, expected {POLICY_FORMAT:?}",
                p.format
            ));
        }
        for (i, r) in p.rules.iter().enumerate() {
            if r.max_ulp.is_none()
                && r.max_abs.is_none()
                && r.max_rel.is_none()
                && r.max_rel_l2.is_none()
                && r.min_cosine.is_none()
                && r.max_scale_error.is_none()
                && r.max_noise_ratio.is_none()
            {
                return Err(format!("rule {i} ({:?}) sets no bound", r.pattern));
            }
            // Each bound within its quantity's range: a negative maximum fails every tensor,
            // `min_cosine` 2 fails all and -5 passes all while reading as a bound.
            let ranged = [
                ("max_abs", r.max_abs, 0.0, f64::INFINITY, "a magnitude"),
                ("max_rel", r.max_rel, 0.0, f64::INFINITY, "a magnitude"),
                (
                    "max_rel_l2",
                    r.max_rel_l2,
                    0.0,
                    f64::INFINITY,
                    "a magnitude",
                ),
                (
                    "max_scale_error",
                    r.max_scale_error,
                    0.0,
                    f64::INFINITY,
                    "a magnitude",
                ),
                ("min_cosine", r.min_cosine, -1.0, 1.0, "a cosine"),
                (
                    "max_noise_ratio",
                    r.max_noise_ratio,
                    0.0,
                    f64::INFINITY,
                    "a ratio",
                ),
            ];
            for (key, v, lo, hi, what) in ranged {
                if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= lo && *v <= hi)) {
                    let range = if hi.is_finite() {
                        format!("[{lo}, {hi}]")
                    } else {
                        format!("a finite number >= {lo}")
                    };
                    return Err(format!(
                        "rule {i} ({:?}): {key} is {v}, outside its range: {range} ({what})",
                        r.pattern
                    ));
                }
            }
        }
        if let Some(d) = p
            .candidate_dtype
            .as_deref()
            .filter(|d| !PRECISIONS.contains(d))
        {
            return Err(format!(
                "candidate_dtype is {d:?}, expected one of {}{}",
                PRECISIONS.join(", "),
                did_you_mean(d)
            ));
        }
        if let Some(k) = p.noise_ratio.as_ref().map(|n| n.max_ratio) {
            if !(k.is_finite() && k >= 1.0) {
                return Err(format!(
                    "noise_ratio.max_ratio is {k}, expected a finite number >= 1 (below 1 fails the noise run itself)"
                ));
            }
        }
        if let Some(n) = &p.near_tie {
            if !(n.margin_factor.is_finite() && n.margin_factor >= 0.0) {
                return Err(format!(
                    "near_tie.margin_factor is {}, expected a finite number >= 0",
                    n.margin_factor
                ));
            }
            for (i, e) in n.noise_abs.iter().enumerate() {
                // Zero would make every tie but an exact one a defect: a bound measured as 0
                // is no bound (docs/diff.md, "The near-tie rule").
                if !(e.max_abs.is_finite() && e.max_abs > 0.0) || e.pattern.is_empty() {
                    return Err(format!(
                        "near_tie.noise_abs[{i}] ({:?}): max_abs is {}, expected a finite number > 0 and a pattern",
                        e.pattern, e.max_abs
                    ));
                }
            }
        }
        Ok(p)
    }

    /// This policy as it judges beside a noise reference: each rule without its own
    /// `max_noise_ratio` takes the policy's `noise_ratio.max_ratio` (docs/diff.md, "Policies").
    pub fn with_noise(&self) -> Policy {
        let mut p = self.clone();
        let k = self.noise_ratio.as_ref().map(|n| n.max_ratio);
        for r in p.rules.iter_mut().filter(|r| r.max_noise_ratio.is_none()) {
            if let Some(k) = r.part_noise_ratio.or(k) {
                r.max_noise_ratio = Some(k);
                r.noise_ratio_from_policy = true;
            }
        }
        p
    }

    /// The first rule that sets `max_noise_ratio`, which a noise reference must then measure.
    pub fn noise_rule(&self) -> Option<(usize, &Rule)> {
        self.rules
            .iter()
            .enumerate()
            .find(|(_, r)| r.max_noise_ratio.is_some())
    }

    /// The near-tie factor: the policy's `near_tie.margin_factor`, else [`DEFAULT_NEAR_TIE_FACTOR`].
    pub fn near_tie_factor(&self) -> f64 {
        self.near_tie
            .as_ref()
            .map_or(DEFAULT_NEAR_TIE_FACTOR, |n| n.margin_factor)
    }

    /// The policy's honest per-element noise for the scores in tensor `source`: the first
    /// `near_tie.noise_abs` entry whose pattern matches it.
    pub fn near_tie_noise(&self, source: &str) -> Option<f64> {
        let scope = self.scope_of(source)?;
        self.near_tie.as_ref().and_then(|n| {
            n.noise_abs
                .iter()
                .find(|e| e.scope == scope && glob_match(&e.pattern, source))
                .map(|e| e.max_abs)
        })
    }

    /// The scope (claim pattern) covering `name`: Some(None) for a policy file (one scope),
    /// Some(Some(i)) for the first claim pattern that matches, None where none does.
    fn scope_of(&self, name: &str) -> Option<Option<usize>> {
        if self.scopes.is_empty() {
            return Some(None);
        }
        self.scopes
            .iter()
            .position(|s| glob_match(s, name))
            .map(Some)
    }

    /// A claim per capture-point pattern, `PATTERN=NAME,PATTERN=NAME,...` (NAME a bundled
    /// policy: f32, bf16, f16, q8), first match wins: a port that keeps its KV cache in f16
    /// claims `layer.*.attn_probs=f16,**=f32`. Each tensor is judged by the rules of the claim
    /// that covers it and no other (Policy::rule_for); one that no pattern covers has no rule.
    pub fn claimed(arg: &str) -> Result<Policy, String> {
        let mut parts = Vec::new();
        for (i, item) in arg.split(',').enumerate() {
            let Some((pattern, name)) = item.split_once('=') else {
                return Err(format!(
                    "precision claim {arg:?}: part {i} ({item:?}) is not PATTERN=NAME"
                ));
            };
            let (pattern, name) = (pattern.trim(), name.trim());
            if pattern.is_empty() {
                return Err(format!(
                    "precision claim {arg:?}: part {i} has an empty pattern"
                ));
            }
            let policy = Policy::bundled(name).unwrap_or_else(|| {
                Err(format!(
                    "precision claim {arg:?}: {name:?} is not one of {}{}",
                    BUNDLED
                        .iter()
                        .map(|(n, _)| *n)
                        .collect::<Vec<_>>()
                        .join(", "),
                    did_you_mean(name)
                ))
            })?;
            parts.push((pattern.to_string(), policy));
        }
        let first = parts
            .first()
            .map(|p| p.1.clone())
            .ok_or("an empty precision claim")?;
        let mut out = Policy {
            name: arg.to_string(),
            description: format!("the claim {arg}: each tensor judged by the bundled policy of the first pattern that covers it"),
            measurements: serde_json::Value::Null,
            rules: Vec::new(),
            near_tie: Some(NearTie {
                margin_factor: parts
                    .iter()
                    .map(|p| p.1.near_tie_factor())
                    .fold(f64::INFINITY, f64::min),
                noise_abs: Vec::new(),
                why: String::new(),
            }),
            noise_ratio: None,
            // One precision for every part is that precision's claim; mixed parts name none.
            candidate_dtype: first
                .candidate_dtype
                .clone()
                .filter(|d| parts.iter().all(|p| p.1.candidate_dtype.as_ref() == Some(d))),
            scopes: parts.iter().map(|p| p.0.clone()).collect(),
            ..first
        };
        for (i, (_, p)) in parts.iter().enumerate() {
            let k = p.noise_ratio.as_ref().map(|n| n.max_ratio);
            out.rules.extend(p.rules.iter().cloned().map(|mut r| {
                r.scope = Some(i);
                r.part_noise_ratio = k;
                r
            }));
            if let (Some(n), Some(to)) = (&p.near_tie, out.near_tie.as_mut()) {
                to.noise_abs
                    .extend(n.noise_abs.iter().cloned().map(|mut e| {
                        e.scope = Some(i);
                        e
                    }));
            }
        }
        Ok(out)
    }

    /// The first rule matching `name` (and, for a rule that names one, `path`: the candidate
    /// tensor's `path` attribute), with its index.
    pub fn rule_for(&self, name: &str, path: Option<&str>) -> Option<(usize, &Rule)> {
        let scope = self.scope_of(name)?;
        self.rules.iter().enumerate().find(|(_, r)| {
            r.scope == scope
                && glob_match(&r.pattern, name)
                && r.path.as_deref().is_none_or(|p| path == Some(p))
        })
    }
}

impl Rule {
    /// Every bound this rule sets that `m` violates, in the rule's key order after the NaN /
    /// infinity check (empty = pass).
    pub fn violations(&self, m: &Measured) -> Vec<Violation> {
        let mut out = Vec::new();
        let mut broken_at = |bound, limit, value, position| {
            out.push(Violation {
                bound,
                limit,
                value,
                position,
            })
        };
        let mut broken = |bound, limit, value| broken_at(bound, limit, value, None);
        if m.nonfinite_differences > 0 {
            broken(
                NONFINITE,
                Amount::Count(0),
                Some(Amount::Count(m.nonfinite_differences)),
            );
        }
        if let Some(b) = self.max_ulp {
            match m.max_ulp {
                Some(u) if u > b => broken("max_ulp", Amount::Count(b), Some(Amount::Count(u))),
                _ => {}
            }
        }
        if let Some(b) = self.max_abs {
            if m.max_abs > b || m.max_abs.is_nan() {
                broken("max_abs", Amount::real(b), Some(Amount::real(m.max_abs)));
            }
        }
        if let Some(b) = self.max_rel {
            if m.max_rel > b || m.max_rel.is_nan() {
                broken("max_rel", Amount::real(b), Some(Amount::real(m.max_rel)));
            }
        }
        if let Some(b) = self.max_rel_l2 {
            match m.rel_l2 {
                Some(v) if v <= b => {}
                v => broken("max_rel_l2", Amount::real(b), v.map(Amount::real)),
            }
        }
        if let Some(b) = self.min_cosine {
            match m.cosine {
                Some(v) if v >= b => {}
                v => broken("min_cosine", Amount::real(b), v.map(Amount::real)),
            }
        }
        if let Some(b) = self.max_scale_error {
            match m.scale_error {
                Some(v) if v.abs() <= b => {}
                v => broken("max_scale_error", Amount::real(b), v.map(Amount::real)),
            }
        }
        if let Some(b) = self.max_noise_ratio {
            match m.noise_ratio {
                Some(v) if v <= b => {}
                None if self.noise_ratio_from_policy => {}
                v => broken("max_noise_ratio", Amount::real(b), v.map(Amount::real)),
            }
            // Per token row, as per tensor: an undefined row breaks the rule's own bound and is
            // no bound by itself for the policy's.
            let rows = m.noise_rows.unwrap_or_default();
            match (rows.first_undefined, rows.worst) {
                (Some(p), _) if !self.noise_ratio_from_policy => {
                    broken_at("max_noise_ratio", Amount::real(b), None, Some(p))
                }
                (_, Some((p, v))) if v > b || v.is_nan() => broken_at(
                    "max_noise_ratio",
                    Amount::real(b),
                    Some(Amount::real(v)),
                    Some(p),
                ),
                _ => {}
            }
        }
        out
    }
}

/// The bound every rule sets implicitly: no element may differ by NaN or infinity.
pub const NONFINITE: &str = "nonfinite_differences";

/// A measured or limiting quantity: counts (ULPs, elements) stay exact integers, the rest are
/// reals (JSON: a number, or "inf" / "-inf" / "nan").
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum Amount {
    Count(u64),
    Real(Real),
}

impl Amount {
    fn real(v: f64) -> Amount {
        Amount::Real(Real(v))
    }
}

impl fmt::Display for Amount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Amount::Count(n) => write!(f, "{n}"),
            Amount::Real(Real(v)) => write!(f, "{v}"),
        }
    }
}

/// One broken bound of the rule that judged a tensor.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Violation {
    /// The rule's key (`max_ulp`, `max_abs`, `max_rel`, `max_rel_l2`, `min_cosine`,
    /// `max_scale_error`, `max_noise_ratio`), or
    /// [`NONFINITE`].
    pub bound: &'static str,
    pub limit: Amount,
    /// What was measured; None when it is undefined (relative L2 of an all-zero reference,
    /// cosine with an all-zero side), which no bound accepts.
    pub value: Option<Amount>,
    /// Set when the bound was measured on one token row (`max_noise_ratio` per row): the row's
    /// position.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<i64>,
}

/// The sentence the findings and the human report print.
impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (limit, value) = (&self.limit, self.value.as_ref());
        if let Some(p) = self.position {
            return match value {
                Some(v) => write!(
                    f,
                    "the row at position {p}: relative L2 {v}× the noise reference's on that row > {limit}×"
                ),
                None => write!(
                    f,
                    "the row at position {p}: noise ratio undefined (the noise reference is exact on that row while the candidate is not, or a side's relative L2 is undefined there)"
                ),
            };
        }
        match (self.bound, value) {
            (NONFINITE, Some(n)) => write!(f, "{n} element(s) differ by NaN or infinity"),
            ("max_ulp", Some(v)) => write!(f, "max ULP {v} > {limit}"),
            ("max_abs", Some(v)) => write!(f, "max abs {v} > {limit}"),
            ("max_rel", Some(v)) => write!(f, "max rel {v} > {limit}"),
            ("max_rel_l2", Some(v)) => write!(f, "relative L2 {v} > {limit}"),
            ("max_rel_l2", None) => write!(f, "relative L2 undefined (reference is all zero)"),
            ("min_cosine", Some(v)) => write!(f, "cosine {v} < {limit}"),
            ("min_cosine", None) => write!(f, "cosine undefined (a side is all zero)"),
            ("max_scale_error", Some(v)) => {
                write!(f, "scale error {v} (|⟨c,r⟩/⟨r,r⟩ − 1|) > {limit}")
            }
            ("max_scale_error", None) => write!(f, "scale error undefined (reference is all zero)"),
            ("max_noise_ratio", Some(v)) => write!(
                f,
                "relative L2 {v}× the noise reference's > {limit}×"
            ),
            ("max_noise_ratio", None) => write!(
                f,
                "noise ratio undefined (no noise reference for this tensor, or its relative L2 is 0 or undefined while the candidate's is not)"
            ),
            (bound, v) => write!(
                f,
                "{bound} {} vs limit {limit}",
                v.map_or("undefined".to_string(), |v| v.to_string())
            ),
        }
    }
}

/// Matches `name` against a glob where `*` stops at `.`, `**` crosses it, `?` is one char.
///
/// A run of stars is one token (`*` alone stops at `.`; two or more cross it, as `**` followed
/// by `*` matches exactly what `**` does), and the match is a simulation of the pattern's
/// automaton over the set of token positions reachable so far: each character of `name` is
/// looked at once against at most every token, so the cost is at most
/// (tokens + 1) × (chars + 1) steps, with no recursion and no backtracking. A 200,000-star
/// pattern is one token; a backtracking shape (`*a*a*…b`) on a 4096-byte name is a few million
/// steps, not exponential.
pub fn glob_match(pattern: &str, name: &str) -> bool {
    // Names are ASCII in practice: match bytes without allocating for a short pattern (a
    // filter or policy runs this once per tensor of a million-tensor trace); `?` is one
    // character, so others go by char.
    if pattern.is_ascii() && name.is_ascii() {
        return glob_run(pattern.as_bytes(), name.as_bytes(), b'*', b'?', b'.');
    }
    let p: Vec<char> = pattern.chars().collect();
    let n: Vec<char> = name.chars().collect();
    glob_run(&p, &n, '*', '?', '.')
}

#[derive(Clone, Copy)]
enum Tok<T> {
    Lit(T),
    /// `?`: any one character.
    One,
    /// `*`: any run without the separator.
    Star,
    /// `**` (or a longer run of stars): any run.
    Any,
}

/// Tokens and position sets this short live on the stack (no allocation per match).
const INLINE: usize = 64;

fn glob_run<T: Copy + PartialEq>(p: &[T], n: &[T], star: T, one: T, dot: T) -> bool {
    // The characters before the first star and after the last take one character of the name
    // each, at its two ends: compared in place, most names are told apart here, and only the
    // part between (starting and ending with a star) needs the automaton.
    let same = |a: &[T], b: &[T]| a.iter().zip(b).all(|(&x, &y)| x == one || x == y);
    let Some(first) = p.iter().position(|&c| c == star) else {
        return p.len() == n.len() && same(p, n);
    };
    let last = p.iter().rposition(|&c| c == star).unwrap_or(first);
    let (head, tail) = (&p[..first], &p[last + 1..]);
    if head.len() + tail.len() > n.len()
        || !same(head, &n[..head.len()])
        || !same(tail, &n[n.len() - tail.len()..])
    {
        return false;
    }
    let (p, n) = (&p[first..=last], &n[head.len()..n.len() - tail.len()]);
    if p.iter().all(|&c| c == star) {
        return p.len() > 1 || !n.contains(&dot); // one run: `*` stops at a dot, `**` does not
    }
    // Tokens, star runs collapsed.
    let mut inline = [Tok::One; INLINE];
    let mut heap = Vec::new();
    let mut len = 0;
    let mut push = |t: Tok<T>| {
        if len < INLINE {
            inline[len] = t;
        } else {
            if len == INLINE {
                heap.extend_from_slice(&inline);
            }
            heap.push(t);
        }
        len += 1;
    };
    let mut i = 0;
    let mut fixed = 0usize; // characters the non-star tokens consume, exactly
    while i < p.len() {
        if p[i] == star {
            let run = p[i..].iter().take_while(|&&c| c == star).count();
            push(if run == 1 { Tok::Star } else { Tok::Any });
            i += run;
        } else {
            push(if p[i] == one {
                Tok::One
            } else {
                Tok::Lit(p[i])
            });
            fixed += 1;
            i += 1;
        }
    }
    let toks: &[Tok<T>] = if len <= INLINE { &inline[..len] } else { &heap };
    if fixed > n.len() {
        return false; // every non-star token takes one character
    }
    // live[k]: the first k tokens can match the characters read so far.
    let (mut a, mut b) = ([false; INLINE + 1], [false; INLINE + 1]);
    let (mut va, mut vb) = (Vec::new(), Vec::new());
    let (mut cur, mut next): (&mut [bool], &mut [bool]) = if len < INLINE {
        (&mut a[..=len], &mut b[..=len])
    } else {
        va.resize(len + 1, false);
        vb.resize(len + 1, false);
        (&mut va, &mut vb)
    };
    // A star token may match nothing: whoever reaches it also reaches the token after it.
    let close = |set: &mut [bool]| {
        for k in 0..toks.len() {
            if set[k] && matches!(toks[k], Tok::Star | Tok::Any) {
                set[k + 1] = true;
            }
        }
    };
    cur[0] = true;
    close(cur);
    for &c in n {
        next.fill(false);
        let mut any = false;
        for (k, t) in toks.iter().enumerate() {
            if !cur[k] {
                continue;
            }
            let (to, ok) = match *t {
                Tok::Lit(x) => (k + 1, x == c),
                Tok::One => (k + 1, true),
                Tok::Star => (k, c != dot),
                Tok::Any => (k, true),
            };
            if ok {
                next[to] = true;
                any = true;
            }
        }
        if !any {
            return false;
        }
        close(next);
        std::mem::swap(&mut cur, &mut next);
    }
    cur[len]
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_policy_missing_a_field_names_every_required_one_and_an_example() {
        let e = super::Policy::parse(r#"{"rules": [{"pattern": "**", "max_rel_l2": 1e-3}]}"#)
            .unwrap_err();
        assert!(
            e.contains("missing field `format`")
                && e.contains("needs format \"tracegate-policy/1\", name and rules")
                && e.contains("fixtures/policy/oracle-default.json"),
            "{e}"
        );
        // An unknown field is named as it is, without the hint.
        let e = super::Policy::parse(
            r#"{"format": "tracegate-policy/1", "name": "x", "rules": [], "x": 1}"#,
        )
        .unwrap_err();
        assert!(
            e.contains("unknown field `x`") && !e.contains("needs format"),
            "{e}"
        );
    }
    use super::*;

    #[test]
    fn globs() {
        assert!(glob_match("layer.*.attn_out", "layer.02.attn_out"));
        assert!(!glob_match("layer.*.attn_out", "layer.02.x.attn_out"));
        assert!(glob_match("layer.**.out", "layer.02.expert.003.out"));
        assert!(glob_match("logits", "logits"));
        assert!(!glob_match("logits", "logits.argmax"));
        assert!(glob_match("layer.0?.q", "layer.07.q"));
        assert!(glob_match("**", "anything.at.all"));
        // Beyond ASCII, `?` is one character (two bytes here), not one byte.
        assert!(glob_match("layer.?.x", "layer.é.x"));
        assert!(!glob_match("layer.??.x", "layer.é.x"));
        assert!(glob_match("*.é*", "a.éb"));
    }

    /// The recursive matcher this crate had before the automaton: exponential on backtracking
    /// shapes and one stack frame per pattern character, but a plain reading of the syntax, so
    /// it is the reference on inputs short enough for it.
    fn reference(p: &[char], n: &[char]) -> bool {
        match p {
            [] => n.is_empty(),
            ['*', '*', rest @ ..] => (0..=n.len()).any(|k| reference(rest, &n[k..])),
            ['*', rest @ ..] => {
                let limit = n.iter().position(|&c| c == '.').unwrap_or(n.len());
                (0..=limit).any(|k| reference(rest, &n[k..]))
            }
            ['?', rest @ ..] => !n.is_empty() && reference(rest, &n[1..]),
            [c, rest @ ..] => n.first() == Some(c) && reference(rest, &n[1..]),
        }
    }

    #[test]
    fn the_automaton_agrees_with_the_recursive_reading() {
        // Every pattern up to 5 characters over {a, ., *, ?} (star runs of every length among
        // them) against every name up to 5 characters over {a, b, .}, plus one non-ASCII pair.
        fn words(alphabet: &[char], max: usize) -> Vec<String> {
            let mut out = vec![String::new()];
            let mut last = vec![String::new()];
            for _ in 0..max {
                last = last
                    .iter()
                    .flat_map(|w| alphabet.iter().map(move |c| format!("{w}{c}")))
                    .collect();
                out.extend(last.iter().cloned());
            }
            out
        }
        let (patterns, names) = (words(&['a', '.', '*', '?'], 5), words(&['a', 'b', '.'], 5));
        let mut matched = 0;
        for p in &patterns {
            let pc: Vec<char> = p.chars().collect();
            for n in names.iter().chain([&"a.é".to_string()]) {
                let want = reference(&pc, &n.chars().collect::<Vec<_>>());
                assert_eq!(glob_match(p, n), want, "pattern {p:?} name {n:?}");
                matched += want as usize;
            }
        }
        // Both answers occur (a matcher that always said no would agree on most pairs).
        assert!(
            matched > 10_000 && matched < patterns.len() * names.len() / 2,
            "{matched}"
        );
    }

    #[test]
    fn a_long_star_run_is_one_token_not_200000_stack_frames() {
        // Issue 33 item 5: the recursive matcher overflowed the stack on this pattern.
        let stars = "*".repeat(200_000);
        assert!(glob_match(&stars, "layer.03.attn_out"));
        assert!(glob_match(&format!("{stars}out"), "layer.03.attn_out"));
        assert!(!glob_match(&format!("{stars}x"), "layer.03.attn_out"));
        // A single star never crosses a dot, however many tokens surround it.
        let singles = "*?".repeat(50_000);
        assert!(!glob_match(&singles, "a.b"));
        assert!(glob_match(&format!("{}*", "?".repeat(3)), "a.b"));
    }

    #[test]
    fn backtracking_shapes_answer_without_backtracking() {
        // Issue 33 item 7: `*a*a*...*b` against a long run of `a`: the recursive matcher tries
        // every way to split the run between the stars (C(4000, 20) of them) before saying no.
        let name = "a".repeat(4000);
        for star in ["*", "**"] {
            let pattern = format!("{}{star}b", format!("{star}a").repeat(20));
            assert!(!glob_match(&pattern, &name), "{pattern}");
            assert!(glob_match(&pattern, &format!("{name}b")), "{pattern}");
            assert!(!glob_match(&pattern, &format!("{name}ba")), "{pattern}");
        }
        // The dotted shape for `**`: every split point is a dot the single star cannot cross.
        let dotted = "a.".repeat(2000);
        let pattern = format!("{}**b", "**a".repeat(20));
        assert!(!glob_match(&pattern, &dotted));
        assert!(glob_match(&pattern, &format!("{dotted}b")));
        assert!(!glob_match(
            &format!("{}*b", "*a".repeat(20)),
            &format!("{dotted}b")
        ));
    }

    #[test]
    fn violations_name_the_bound_its_limit_and_the_measured_value() {
        let rule: Rule = serde_json::from_str(
            r#"{"pattern": "x", "max_ulp": 4, "max_rel_l2": 1e-4, "min_cosine": 0.9999}"#,
        )
        .unwrap();
        // On the limits: inclusive, nothing broken.
        let at = Measured {
            max_ulp: Some(4),
            rel_l2: Some(1e-4),
            cosine: Some(0.9999),
            ..Measured::default()
        };
        assert_eq!(rule.violations(&at), []);
        // Planted: one ULP over, twice the relative L2, cosine undefined, a NaN difference.
        let over = Measured {
            max_ulp: Some(5),
            rel_l2: Some(2e-4),
            cosine: None,
            nonfinite_differences: 3,
            ..Measured::default()
        };
        let v = rule.violations(&over);
        let want = [
            (NONFINITE, Amount::Count(0), Some(Amount::Count(3))),
            ("max_ulp", Amount::Count(4), Some(Amount::Count(5))),
            (
                "max_rel_l2",
                Amount::Real(Real(1e-4)),
                Some(Amount::Real(Real(2e-4))),
            ),
            ("min_cosine", Amount::Real(Real(0.9999)), None),
        ];
        assert_eq!(
            v.iter()
                .map(|v| (v.bound, v.limit, v.value))
                .collect::<Vec<_>>(),
            want
        );
        let prose: Vec<String> = v.iter().map(|v| v.to_string()).collect();
        assert_eq!(
            prose,
            [
                "3 element(s) differ by NaN or infinity",
                "max ULP 5 > 4",
                "relative L2 0.0002 > 0.0001",
                "cosine undefined (a side is all zero)"
            ]
        );
        assert_eq!(
            serde_json::to_value(&v[2]).unwrap(),
            serde_json::json!({"bound": "max_rel_l2", "limit": 1e-4, "value": 2e-4}),
            "counts stay integers, reals are numbers"
        );
    }

    #[test]
    fn a_path_rule_judges_only_its_path_and_bounds_the_scale_error_magnitude() {
        let p = Policy::parse(
            r#"{"format": "tracegate-policy/1", "name": "t", "rules": [
                {"pattern": "layer.*.mlp_out", "path": "layer", "max_scale_error": 0.005},
                {"pattern": "layer.*.mlp_out", "max_rel_l2": 0.04}]}"#,
        )
        .unwrap();
        assert_eq!(
            p.rule_for("layer.01.mlp_out", Some("layer")).map(|r| r.0),
            Some(0)
        );
        assert_eq!(
            p.rule_for("layer.01.mlp_out", Some("prefill")).map(|r| r.0),
            Some(1)
        );
        assert_eq!(p.rule_for("layer.01.mlp_out", None).map(|r| r.0), Some(1));
        let rule = &p.rules[0];
        let m = |v| Measured {
            scale_error: v,
            ..Measured::default()
        };
        assert_eq!(rule.violations(&m(Some(0.004))), []);
        assert_eq!(rule.violations(&m(Some(-0.004))), []);
        let below = rule.violations(&m(Some(-0.006)));
        assert_eq!(
            (below.len(), below[0].bound, below[0].value),
            (1, "max_scale_error", Some(Amount::Real(Real(-0.006))))
        );
        assert_eq!(
            rule.violations(&m(None))[0].to_string(),
            "scale error undefined (reference is all zero)"
        );
    }

    const HEAD: &str = r#"{"format": "tracegate-policy/1", "name": "t", "rules": ["#;

    #[test]
    fn bounds_outside_their_range_are_refused_with_rule_field_and_range() {
        // Issue 33 item 13: each of these loaded without a word on main.
        for (rule, want) in [
            (
                r#"{"pattern": "x", "max_rel_l2": -1}"#,
                "max_rel_l2 is -1, outside its range: a finite number >= 0",
            ),
            (
                r#"{"pattern": "x", "min_cosine": 2}"#,
                "min_cosine is 2, outside its range: [-1, 1]",
            ),
            (
                r#"{"pattern": "x", "min_cosine": -5}"#,
                "min_cosine is -5, outside its range: [-1, 1]",
            ),
            (r#"{"pattern": "x", "max_abs": -0.5}"#, "max_abs is -0.5"),
            (
                r#"{"pattern": "x", "max_rel": -1e-9}"#,
                "max_rel is -0.000000001",
            ),
            (
                r#"{"pattern": "x", "max_scale_error": -2}"#,
                "max_scale_error is -2",
            ),
        ] {
            let text = format!(r#"{HEAD}{{"pattern": "ok", "max_ulp": 0}}, {rule}]}}"#);
            let e = Policy::parse(&text).unwrap_err();
            assert!(
                e.starts_with(r#"rule 1 ("x"): "#) && e.contains(want),
                "{rule}: {e}"
            );
        }
        // The edges of each range are bounds (negative control: the check is not a blanket no).
        let edges = format!(
            r#"{HEAD}{{"pattern": "x", "max_abs": 0, "max_rel": 0, "max_rel_l2": 0, "max_scale_error": 0, "min_cosine": -1}}, {{"pattern": "y", "min_cosine": 1}}]}}"#
        );
        Policy::parse(&edges).unwrap();
    }

    #[test]
    fn a_repeated_key_is_refused_with_its_place() {
        // Issue 33 item 12: on main the second max_rel_l2 silently replaced the first.
        let text = format!(r#"{HEAD}{{"pattern": "x", "max_rel_l2": 1e-6, "max_rel_l2": 1e9}}]}}"#);
        let e = Policy::parse(&text).unwrap_err();
        assert!(
            e.contains(r#"duplicate key "max_rel_l2" in rules[0]"#),
            "{e}"
        );
        let text = format!(r#"{HEAD}{{"pattern": "x", "max_ulp": 0}}], "rules": []}}"#);
        let e = Policy::parse(&text).unwrap_err();
        assert!(e.contains(r#"duplicate key "rules""#), "{e}");
        // Equal keys in two rules are no repeat.
        Policy::parse(&format!(
            r#"{HEAD}{{"pattern": "x", "max_ulp": 0}}, {{"pattern": "y", "max_ulp": 0}}]}}"#
        ))
        .unwrap();
    }

    #[test]
    fn a_policy_file_is_one_bounded_regular_file() {
        // Issue 33 item 8: on main a FIFO blocked forever and /dev/zero was read until the
        // kernel killed the process. The FIFO is opened without a writer: a blocking open would
        // hang this test (the harness's timeout fails it).
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("policy.json");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.unwrap().success());
        let e = Policy::load(&fifo).unwrap_err();
        assert!(
            e.contains("policy.json") && e.contains("a FIFO, not a regular file"),
            "{e}"
        );
        let e = Policy::load(Path::new("/dev/zero")).unwrap_err();
        assert!(
            e.contains("/dev/zero") && e.contains("a device, not a regular file"),
            "{e}"
        );
        let e = Policy::load(dir.path()).unwrap_err();
        assert!(e.contains("a directory, not a regular file"), "{e}");
        // Over the size bound: a sparse file, no 64 MiB written.
        let big = dir.path().join("big.json");
        std::fs::File::create(&big)
            .unwrap()
            .set_len(tracegate_trace::json::MAX_JSON_LEN + 1)
            .unwrap();
        let e = Policy::load(&big).unwrap_err();
        assert!(
            e.contains("big.json") && e.contains("more than the limit"),
            "{e}"
        );
        // The same text as a regular file loads (negative control).
        let ok = dir.path().join("ok.json");
        std::fs::write(&ok, format!(r#"{HEAD}{{"pattern": "x", "max_ulp": 0}}]}}"#)).unwrap();
        assert_eq!(Policy::load(&ok).unwrap().rules.len(), 1);
    }

    #[test]
    fn shipped_default_policy_parses() {
        let path =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/policy/oracle-default.json");
        let p = Policy::load(&path).unwrap();
        for name in [
            "embed.out",
            "layer.00.hidden_in",
            "layer.11.attn_out",
            "layer.03.mlp_out",
            "layer.03.hidden_out",
            "final_norm.out",
            "logits",
        ] {
            assert!(
                p.rule_for(name, None).is_some(),
                "{name} has no rule in the default policy"
            );
        }
    }
}

/// The bundled policies, by the name `--policy` takes: compiled in, so every binary judges by
/// the same bounds from any directory. Their files under fixtures/policy/ are the source, with
/// the measurements behind each bound (fixtures/policy/MEASUREMENTS.md).
pub const BUNDLED: [(&str, &str); 4] = [
    (
        "f32",
        include_str!("../../fixtures/policy/oracle-default.json"),
    ),
    ("bf16", include_str!("../../fixtures/policy/bf16.json")),
    ("f16", include_str!("../../fixtures/policy/f16.json")),
    ("q8", include_str!("../../fixtures/policy/q8.json")),
];

impl Policy {
    /// A `--policy` argument: a bundled name, else the path of a policy file (a relative path is
    /// taken from `dir`). An argument with no `/` and no `.` is a name, so a mistyped name is
    /// refused with the list instead of being looked for as a file (`./NAME` reads a file).
    pub fn resolve(arg: &str, dir: &Path) -> Result<Policy, String> {
        if Policy::is_claim(arg) {
            return Policy::claimed(arg);
        }
        if let Some(bundled) = Policy::bundled(arg) {
            return bundled;
        }
        if Policy::is_name(arg) {
            let names: Vec<&str> = BUNDLED.iter().map(|(n, _)| *n).collect();
            return Err(format!("unknown policy name {arg:?}{}: the bundled policies are {} (a file is read by its path, e.g. ./{arg})", did_you_mean(arg), names.join(", ")));
        }
        Policy::load(&dir.join(arg))
    }

    /// The bundled policy `name` names, parsed; None when it names none.
    fn bundled(name: &str) -> Option<Result<Policy, String>> {
        let (_, text) = BUNDLED.iter().find(|(n, _)| *n == name)?;
        Some(Policy::parse(text).map_err(|e| format!("bundled policy {name}: {e}")))
    }

    /// Whether a `--policy` argument names a bundled policy (or a mistyped one) rather than a file.
    pub fn is_name(arg: &str) -> bool {
        !arg.is_empty() && !arg.contains(['/', '.', std::path::MAIN_SEPARATOR])
    }

    /// Whether a `--policy` or `--precision` argument is a claim per pattern (`PATTERN=NAME,…`).
    pub fn is_claim(arg: &str) -> bool {
        arg.contains('=')
    }

    /// The coarsest precision a policy argument claims (a bundled name, or each part of a claim
    /// per pattern); None for a policy file.
    pub fn claimed_precision(arg: &str) -> Option<&'static str> {
        let names: Vec<&str> = if Policy::is_claim(arg) {
            arg.split(',')
                .filter_map(|p| p.split_once('=').map(|x| x.1.trim()))
                .collect()
        } else {
            vec![arg]
        };
        let known: Vec<&'static str> = names
            .iter()
            .map(|n| PRECISIONS.iter().find(|p| *p == n).copied())
            .collect::<Option<_>>()?;
        coarsest(known)
    }
}

#[cfg(test)]
mod resolve_tests {
    use super::*;

    #[test]
    fn names_paths_and_refusals() {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        // f32 is the shipped default file, read by name and by path alike.
        let by_name = Policy::resolve("f32", Path::new("/nonexistent")).unwrap();
        assert_eq!(
            by_name,
            Policy::resolve("../fixtures/policy/oracle-default.json", here).unwrap()
        );
        assert_eq!(by_name.name, "oracle-default");
        assert_eq!(Policy::resolve("bf16", here).unwrap().name, "oracle-bf16");
        assert_eq!(Policy::resolve("f16", here).unwrap().name, "oracle-f16");
        assert_eq!(Policy::resolve("q8", here).unwrap().name, "q8-activations");
        let e = Policy::resolve("fp8", here).unwrap_err();
        assert!(
            e.contains("unknown policy name \"fp8\"") && e.contains("f32, bf16, f16, q8"),
            "{e}"
        );
        // Anything with a dot or a slash is a path, even when it is missing.
        assert!(Policy::resolve("bf16.json", here)
            .unwrap_err()
            .contains("bf16.json"));
        assert!(Policy::resolve("./f32", here).unwrap_err().contains("f32"));
    }
}

#[cfg(test)]
mod declared_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn the_coarsest_declared_precision_wins_over_the_dtype_and_bad_ones_are_named() {
        assert_eq!(declared_precision(&json!({"dtype": "f32"})), Ok(None));
        assert_eq!(
            computes_in(&json!({"dtype": "f32"}), f32s()),
            Ok(Some("f32"))
        );
        let mixed = json!({"dtype": "f32", "precision": {"*": "f32", "layer.*.attn_probs": "f16"}});
        assert_eq!(declared_precision(&mixed), Ok(Some("f16")));
        assert_eq!(computes_in(&mixed, f32s()), Ok(Some("f16")));
        let all = json!({"precision": {"a": "f16", "b": "bf16", "c": "f32"}});
        assert_eq!(declared_precision(&all), Ok(Some("bf16")));
        assert_eq!(
            declared_precision(&json!({"precision": "bf16"})),
            Ok(Some("bf16"))
        );
        let bad = declared_precision(&json!({"precision": {"layer.*.q": "int4"}})).unwrap_err();
        assert!(bad.contains(r#"precision["layer.*.q"] is "int4""#), "{bad}");
        assert!(declared_precision(&json!({"precision": {}})).is_err());
        assert!(declared_precision(&json!({"precision": 16})).is_err());
    }

    #[test]
    fn a_misspelt_precision_is_refused_wherever_it_is_read_with_the_name_meant() {
        // `fp32` was passed over for the dtype ("nothing declared") and a passing run said
        // nothing of it; docs/producers.md says a value naming no precision is refused.
        let fp32 = json!({"dtype": "float32", "precision": "fp32"});
        let want = r#"provenance precision is "fp32": expected one of f32, f16, bf16, q8 (did you mean "f32"?)"#;
        assert_eq!(declared_precision(&fp32), Err(want.to_string()));
        assert_eq!(computes_in(&fp32, f32s()), Err(want.to_string()));
        let names = ["layer.00.q"];
        assert_eq!(
            checked_declaration(&fp32, names.iter().copied()),
            Err(want.to_string())
        );
        let per = declared_precision(&json!({"precision": {"*": "bfloat16"}})).unwrap_err();
        assert!(per.ends_with(r#"(did you mean "bf16"?)"#), "{per}");
        // No guess where nothing is near.
        let fp8 = computes_in(&json!({"dtype": "bf16", "precision": "fp8"}), f32s()).unwrap_err();
        assert!(!fp8.contains("did you mean"), "{fp8}");
        // The same words for a policy's candidate_dtype, a --policy name and a claim per pattern.
        let e = Policy::resolve("fp32", Path::new("/nonexistent")).unwrap_err();
        assert!(e.contains(r#""fp32" (did you mean "f32"?)"#), "{e}");
        let e = Policy::claimed("**=half").unwrap_err();
        assert!(e.ends_with(r#"(did you mean "f16"?)"#), "{e}");
        // The control: the right names are read.
        assert_eq!(
            computes_in(&json!({"dtype": "float32", "precision": "f32"}), f32s()),
            Ok(Some("f32"))
        );
    }

    /// A trace's tensors, every one f32, as (name, dtype).
    fn f32s() -> impl Iterator<Item = (&'static str, DType)> + Clone {
        [
            ("layer.00.q", DType::F32),
            ("layer.00.attn_probs", DType::F32),
            ("logits", DType::F32),
        ]
        .into_iter()
    }

    fn of<'a>(t: &'a [(&'a str, DType)]) -> impl Iterator<Item = (&'a str, DType)> + Clone + 'a {
        t.iter().copied()
    }

    /// Issue 56: the candidate's precision had two readings, trace-diff's (declaration unchecked,
    /// else provenance `dtype`) and gate's (declaration checked, else the tensors' coarsest
    /// dtype). Where they differed, the one reading keeps the stricter: each case below is one
    /// where a reading was looser.
    #[test]
    fn where_the_two_readings_differed_the_stricter_is_kept() {
        let one_bf16 = [("embed.out", DType::BF16), ("logits", DType::F32)];
        let all_f32 = [("embed.out", DType::F32), ("logits", DType::F32)];
        // gate read bf16 off one tensor written as bf16 (issue 50's port): its dtype says f32.
        assert_eq!(
            computes_in(&json!({"dtype": "f32"}), of(&one_bf16)),
            Ok(Some("f32"))
        );
        // trace-diff read bf16 off the dtype of a trace whose every tensor is f32.
        assert_eq!(
            computes_in(&json!({"dtype": "bfloat16"}), of(&all_f32)),
            Ok(Some("f32"))
        );
        // trace-diff read q8 off a pattern that matches no tensor (issue 50's declaration).
        let about_none = json!({"dtype": "f32", "precision": {"*": "f32", "vision.tower.*": "q8"}});
        let e = computes_in(&about_none, of(&all_f32)).unwrap_err();
        assert!(
            e.contains("\"vision.tower.*\", which matches no tensor"),
            "{e}"
        );
        // gate read bf16 off the tensors of a trace that records no dtype: nothing is read.
        assert_eq!(computes_in(&json!({}), of(&one_bf16)), Ok(None));
        // Where they agreed, as before: a dtype its tensors share, and a declaration about
        // its tensors, coarser than both.
        assert_eq!(
            computes_in(&json!({"dtype": "bf16"}), of(&one_bf16)),
            Ok(Some("bf16"))
        );
        let declared = json!({"dtype": "f32", "precision": {"*": "f32", "logits": "q8"}});
        assert_eq!(computes_in(&declared, of(&all_f32)), Ok(Some("q8")));
        assert_eq!(
            stored_precision([DType::F16, DType::F32].into_iter()),
            "f16"
        );
        assert_eq!(stored_precision([DType::I64].into_iter()), "f32");
    }
}
