//! Whether two traces may be compared at all. Numbers computed on different code paths,
//! masks or positions, from different weights or prompts, or by two oracle runs on different
//! stacks are not "close" or "far": comparing them is meaningless, so the differ refuses
//! with the reason (docs/traps.md, traps 1–3 and 13). These rules run before any digest is
//! consulted.

use serde_json::Value;
use tracegate_trace::Trace;

use crate::positions::{describe, not_increasing, rerouted};
use crate::{Finding, FindingKind};

/// Provenance keys (dotted paths) that define an oracle's stack.
pub const STACK_KEYS: [&str; 6] = [
    "versions.torch",
    "versions.transformers",
    "versions.numpy",
    "dtype",
    "device",
    "attn_implementation",
];

/// Provenance keys that must agree whenever both traces record them, whatever the producers.
pub const CONTENT_KEYS: [(&str, FindingKind); 3] = [
    ("weights_digest", FindingKind::WeightsMismatch),
    ("prompt_tokens", FindingKind::PromptMismatch),
    ("seed", FindingKind::SeedMismatch),
];

fn lookup<'a>(v: &'a Value, dotted: &str) -> Option<&'a Value> {
    let mut cur = v;
    for part in dotted.split('.') {
        cur = cur.get(part)?;
    }
    (!cur.is_null()).then_some(cur)
}

/// A trace is an oracle trace when its producer says so or its stack records a torch version.
pub fn is_oracle(provenance: &Value) -> bool {
    provenance.get("producer").and_then(Value::as_str) == Some("oracle")
        || lookup(provenance, "versions.torch").is_some()
}

fn show(v: Option<&Value>) -> String {
    match v {
        None => "absent".into(),
        Some(Value::String(s)) => s.clone(),
        Some(other) => {
            // Cut at a character, never at a byte: provenance may hold any Unicode.
            let s = other.to_string();
            match s.char_indices().nth(80) {
                Some((cut, _)) => format!("{}…", &s[..cut]),
                None => s,
            }
        }
    }
}

/// A trace whose provenance says producer `oracle` without the torch version every run of the
/// oracle records: another producer using the reserved name (docs/producers.md: `producer` is
/// your engine's name, never `oracle`).
fn claims_oracle(provenance: &Value) -> bool {
    provenance.get("producer").and_then(Value::as_str) == Some("oracle")
        && lookup(provenance, "versions.torch").is_none()
}

/// Returns (refusals, downgraded stack findings).
pub fn check(r: &Trace, c: &Trace, allow_stack_mismatch: bool) -> (Vec<Finding>, Vec<Finding>) {
    check_sides(r, c, ("reference", "candidate"), allow_stack_mismatch)
}

/// [`check`] with each side named as its caller knows it (`sides`: the names of `r` and `c`), so
/// a refusal says which run holds what: the gate's `generation_reference` compares a port's run
/// (`r`, "candidate") with its golden trace (`c`, "golden"), not a reference with a candidate.
pub fn check_sides(
    r: &Trace,
    c: &Trace,
    sides: (&str, &str),
    allow_stack_mismatch: bool,
) -> (Vec<Finding>, Vec<Finding>) {
    let (rp, cp) = (r.provenance(), c.provenance());
    let (rs, cs) = sides;
    let mut refuse = Vec::new();
    let mut allowed = Vec::new();

    // Two oracle runs are only comparable on one stack. An engine or contract trace against
    // an oracle trace differs in stack by construction — that is what policies are for.
    let differ: Vec<&str> = STACK_KEYS
        .into_iter()
        .filter(|k| lookup(rp, k) != lookup(cp, k))
        .collect();
    // A run that only names itself the oracle against a run of the oracle: not two stacks but a
    // producer using the reserved name; no flag makes that comparison right, its provenance does.
    let impostor = [(rs, rp, cp), (cs, cp, rp)]
        .into_iter()
        .find(|(_, this, other)| claims_oracle(this) && lookup(other, "versions.torch").is_some());
    // (versions.torch then differs, so this is where the stack rule would have refused.)
    if let Some((side, _, _)) = impostor {
        refuse.push(Finding::new(
            FindingKind::StackMismatch,
            None,
            format!(
                "the {side} claims to be the oracle: its provenance says producer \"oracle\" but records no versions.torch, which every oracle run does; the name is reserved for tracegate's oracle (transformers' own classes) and this provenance is wrong: record your engine's own name as `producer` (docs/producers.md), and the run is compared as any port's, with no flag"
            ),
        ));
    } else if is_oracle(rp) && is_oracle(cp) {
        // One stack in two precisions (an fp32 oracle against its own bf16 run) is the usual
        // calibration, not two stacks: compared, and said; a reduced-precision policy judges it.
        if differ == ["dtype"] {
            allowed.push(Finding::new(
                FindingKind::StackMismatchAllowed,
                None,
                format!(
                    "oracle stack differs only in dtype: {} in the {rs}, {} in the {cs} (one stack in two precisions: compared; judge it with that precision's policy, e.g. --policy bf16)",
                    show(lookup(rp, "dtype")),
                    show(lookup(cp, "dtype"))
                ),
            ));
        } else {
            for key in differ {
                let detail = format!(
                    "oracle stack differs: {key} is {} in the {rs}, {} in the {cs}",
                    show(lookup(rp, key)),
                    show(lookup(cp, key))
                );
                if allow_stack_mismatch {
                    allowed.push(Finding::new(
                        FindingKind::StackMismatchAllowed,
                        None,
                        format!("{detail} (allowed by --allow-stack-mismatch)"),
                    ));
                } else {
                    refuse.push(Finding::new(
                        FindingKind::StackMismatch,
                        None,
                        format!("{detail} (trace-diff and gate bisect compare them anyway with --allow-stack-mismatch)"),
                    ));
                }
            }
        }
    }

    for (key, kind) in CONTENT_KEYS {
        // Nothing NOT CHECKED silently: a run without the weights' digest or the prompt could
        // be of other weights or another prompt, and only this note says the rule did not run.
        // (`seed` is recorded by sampling producers only: its absence says nothing.)
        if kind != FindingKind::SeedMismatch {
            let absent: Vec<&str> = [(rs, rp), (cs, cp)]
                .into_iter()
                .filter(|(_, p)| lookup(p, key).is_none())
                .map(|(side, _)| side)
                .collect();
            if !absent.is_empty() {
                let what = match key {
                    "weights_digest" => "whether both ran the same weights",
                    _ => "whether both ran the same prompt",
                };
                allowed.push(Finding::new(
                    FindingKind::ComparabilityNotChecked,
                    None,
                    format!(
                        "{key} absent from the {}: {what} is NOT CHECKED (record it: tracegate.weights_digest / the prompt's token ids in provenance, docs/trace-format.md)",
                        absent.join(" and the ")
                    ),
                ));
            }
        }
        if let (Some(a), Some(b)) = (lookup(rp, key), lookup(cp, key)) {
            if a != b {
                refuse.push(Finding::new(
                    kind,
                    None,
                    format!(
                        "{key} differs: {} in the {rs}, {} in the {cs}{}",
                        show(Some(a)),
                        show(Some(b)),
                        if key == "weights_digest" {
                            digest_hint(a, b, sides)
                        } else {
                            String::new()
                        }
                    ),
                ));
            }
        }
    }

    // Rows are indexed by absolute position, one position a row: a list that repeats or goes
    // back could hide a row (two rows of one position, only one of them ever matched), so
    // every positioned tensor of either trace lists its positions strictly increasing.
    for (side, t) in [(rs, r), (cs, c)] {
        for info in t.tensors() {
            if let Some(p) = &info.attributes.positions {
                if let Some(i) = not_increasing(p) {
                    refuse.push(Finding::new(
                        FindingKind::PositionsMismatch,
                        Some(&info.name),
                        format!(
                            "the {side}'s positions are not strictly increasing: entry {} is {} after {} ({})",
                            i + 1,
                            p[i + 1],
                            p[i],
                            describe(&info.attributes.positions)
                        ),
                    ));
                }
            }
        }
    }

    // Tensor attributes are content: a tensor present in both must describe the same
    // computation. Absent on one side and present on the other is a difference too.
    for ri in r.tensors() {
        let Some(ci) = c.tensor_info(&ri.name) else {
            continue;
        };
        let (ra, ca) = (&ri.attributes, &ci.attributes);
        if ra.path != ca.path {
            refuse.push(Finding::new(
                FindingKind::PathMismatch,
                Some(&ri.name),
                format!("code path {} vs {}", opt(&ra.path), opt(&ca.path)),
            ));
        }
        if ra.mask != ca.mask {
            refuse.push(Finding::new(
                FindingKind::MaskMismatch,
                Some(&ri.name),
                format!("mask {} vs {}", opt(&ra.mask), opt(&ca.mask)),
            ));
        }
        // An expert that other tokens were routed to is compared by position (`positions`). A
        // tensor whose token axis has another length (a transposed one) is Structure's shape
        // finding, never compared by value, so its positions can hide no row.
        let axis = tracegate_trace::names::token_axis(&ri.name).unwrap_or(0);
        let same_rows = ri.shape.get(axis) == ci.shape.get(axis);
        if ra.positions != ca.positions && same_rows && !rerouted(ri, ci) {
            refuse.push(Finding::new(
                FindingKind::PositionsMismatch,
                Some(&ri.name),
                format!(
                    "positions {} vs {}",
                    describe(&ra.positions),
                    describe(&ca.positions)
                ),
            ));
        }
    }
    (refuse, allowed)
}

/// Where a side's `weights_digest` is not of tracegate's form (32 lowercase hex digits: a
/// sha256 of the file is 64), the pointer to the function that makes it.
fn digest_hint(a: &Value, b: &Value, (rs, cs): (&str, &str)) -> String {
    let ours = |v: &Value| {
        v.as_str().is_some_and(|s| {
            s.len() == 32 && s.bytes().all(|c| matches!(c, b'0'..=b'9' | b'a'..=b'f'))
        })
    };
    let odd: Vec<&str> = [(rs, a), (cs, b)]
        .into_iter()
        .filter(|(_, v)| !ours(v))
        .map(|(side, _)| side)
        .collect();
    let whose = match odd.as_slice() {
        [] => return String::new(),
        [side] => format!("the {side}'s is not"),
        _ => "neither is".to_string(),
    };
    format!(" ({whose} a tracegate weights digest: record tracegate.weights_digest(model_dir) / tracegate_trace::weights_digest, xxh3-128 of the *.safetensors files in name order, 32 hex digits)")
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_else(|| "absent".into())
}
