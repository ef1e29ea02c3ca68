//! A capsule's units (docs/bisect.md, "Capsules", "Heads and experts"): where a failure is
//! local to some experts or heads, which, and what of them the capsule can leave out.
//!
//! Experts: a row's MoE output reads only the experts the router sends it to, so the experts no
//! kept row routes to (by the reference's own `router.topk`) cannot change any kept output; they
//! are left out of `layer.safetensors` and read as zeros in the replay model. The router and a
//! shared expert are always kept, and so is every failing expert. Checked, not assumed: the
//! reduced capsule is replayed and kept only if it fails at the same capture point.
//!
//! Heads: every head of a row reads the same rows, and zeroing another head's weights changes
//! `attn_out` for every row, so the reference's outputs would have to be recomputed by a
//! reference producer, which a capsule does not carry. Heads are named, never cut.

use std::cell::RefCell;
use std::collections::BTreeSet;

use serde_json::{json, Value};
use tracegate_diff::numeric::Pair;
use tracegate_diff::policy::Measured;
use tracegate_diff::Policy;
use tracegate_trace::{names, Trace};

use super::{rows, weights, write_file, Replay, Replayed};
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::open;
use crate::Result;

/// What both reductions read: the bisection, the capsule, the rows kept and the full replay.
pub(super) struct Ctx<'a> {
    pub o: &'a BisectOptions,
    pub dir: &'a std::path::Path,
    pub layer: usize,
    pub keep: usize,
    /// The stage's capture point: the reduced capsule must still fail there.
    pub stage: &'a str,
    pub minimise: bool,
    pub reference: &'a Trace,
    /// The replay on every row (its isolated comparisons name the failing experts).
    pub full: &'a Replayed,
    /// The trials' directory (relative to the root): `rows.K.trace`, `rows.K.candidate.trace`.
    pub trials: &'a str,
    pub policy: &'a Option<Policy>,
    /// The manifest's `weights` (how the replay model is built: weights::materialise).
    pub weights: &'a Value,
}

/// Expert `e` of a checkpoint tensor name with an `experts.E.` component (`…mlp.experts.3.up_proj.weight`).
fn expert_of(name: &str) -> Option<usize> {
    let parts: Vec<&str> = name.split('.').collect();
    parts
        .windows(2)
        .find(|w| w[0] == "experts")
        .and_then(|w| w[1].parse().ok())
}

/// The experts kept: those the kept rows route to and every failing one (a failing expert is
/// never dropped, routed to or not).
pub(super) fn kept_experts(routed: &BTreeSet<usize>, failing: &[usize]) -> BTreeSet<usize> {
    routed.iter().chain(failing).copied().collect()
}

/// `units.experts` of the manifest, and the tensors `layer.safetensors` now holds when experts
/// were removed (None: it is unchanged). `digest` is the replay model's weights digest, which
/// the capsule's traces record; `provenance` writes it into a trace's provenance.
pub(super) fn experts(
    c: &Ctx,
    replay: &Replay,
    digest: &RefCell<String>,
    provenance: &dyn Fn(&Trace, usize) -> Value,
) -> Result<(Value, Option<Vec<String>>)> {
    let topk = names::layer(c.layer, "router.topk");
    let Some(d) = c.reference.decisions().iter().find(|d| d.name == topk) else {
        return Ok((Value::Null, None)); // no routed experts in this layer
    };
    let values = c.reference.decision_values(d);
    let per = values.len() / (d.rows() as usize).max(1);
    let kept_rows = c.keep.min(d.rows() as usize);
    let routed: BTreeSet<usize> = values[..kept_rows * per]
        .iter()
        .filter_map(|&e| usize::try_from(e).ok())
        .collect();
    let pfx = names::layer_prefix(c.layer);
    let expert_points: Vec<_> = c
        .full
        .isolated
        .iter()
        .filter(|t| t.tensor.starts_with(&pfx))
        .filter_map(|t| names::Name::parse(&t.tensor).expert.map(|e| (e, t)))
        .collect();
    let failing: Vec<usize> = expert_points
        .iter()
        .filter(|(_, t)| t.status.is_bad())
        .map(|(e, _)| *e)
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let exercised: Vec<usize> = failing
        .iter()
        .filter(|e| routed.contains(e))
        .copied()
        .collect();
    let mut out = json!({
        "routed_by_kept_rows": routed,
        "failing": if expert_points.is_empty() { Value::Null } else { json!(failing) },
        "failing_not_checked": expert_points.is_empty().then_some(
            "no per-expert capture point (layer.LL.expert.EEE.out) was compared: --capture internals records them"),
        "failing_not_exercised": failing.iter().filter(|e| !routed.contains(e)).collect::<Vec<_>>(),
        "rows": if exercised.is_empty() { Value::Null } else { json!(format!(
            "rows at positions 0..{} kept (the shortest failing prefix); a row of it not routed to expert(s) {exercised:?} cannot be cut, as attention at a later kept row reads it", c.keep - 1
        )) },
        "removed": [], "kept": Value::Null, "still_fails": Value::Null, "not_minimised": Value::Null,
    });
    if c.weights["format"] == "gguf" {
        let why = "a GGUF model stores a layer's experts packed (ffn_*_exps): every expert kept";
        out["not_minimised"] = json!(why);
        return Ok((out, None));
    }
    let model_dir = c.o.root.join(&c.o.model);
    let all = weights::checkpoint(&model_dir)?;
    let mine: Vec<&weights::Entry> = all
        .iter()
        .filter(|e| weights::of_layer(&e.name, c.layer))
        .collect();
    let stored: BTreeSet<usize> = mine.iter().filter_map(|e| expert_of(&e.name)).collect();
    let kept = kept_experts(&routed, &failing);
    let removed: Vec<usize> = stored.difference(&kept).copied().collect();
    let not = |out: &mut Value, why: String| {
        out["not_minimised"] = json!(why);
        out["kept"] = json!(stored);
    };
    if !c.minimise {
        not(&mut out, "--capsule-full: every expert kept".into());
        return Ok((out, None));
    }
    if stored.is_empty() {
        let why = "the layer's experts are not stored one per tensor (packed experts.gate_up_proj): every expert kept";
        not(&mut out, why.into());
        return Ok((out, None));
    }
    if removed.is_empty() {
        not(&mut out, "every expert is routed to by a kept row".into());
        return Ok((out, None));
    }
    // The layer without the removed experts' tensors: zero in the replay model (the replay
    // header, the checkpoint's, still names them).
    let fewer: Vec<weights::Entry> = all
        .iter()
        .filter(|e| {
            !(weights::of_layer(&e.name, c.layer)
                && expert_of(&e.name).is_some_and(|x| removed.contains(&x)))
        })
        .cloned()
        .collect();
    let lw = weights::layer_weights(&fewer, c.layer, &model_dir)?;
    let full_file = std::fs::read(c.dir.join("layer.safetensors"))
        .map_err(|e| crate::gerr!(File: "{}: {e}", c.dir.join("layer.safetensors").display()))?;
    let original = digest.borrow().clone();
    let header = c.weights;
    let model = c.o.root.join(&replay.model);
    write_file(&c.dir.join("layer.safetensors"), &lw.layer_file)?;
    *digest.borrow_mut() = weights::materialise(c.dir, header, &model)?;
    let input = format!("{}/units.trace", c.trials);
    rows::write(
        c.reference,
        c.layer,
        c.keep,
        provenance(c.reference, c.keep),
        &c.o.root.join(&input),
    )?;
    let noise = match &c.o.noise {
        Some(nz) => {
            let rel = format!("{}/units.noise.trace", c.trials);
            rows::write(
                &nz.0,
                c.layer,
                c.keep,
                provenance(&nz.0, c.keep),
                &c.o.root.join(&rel),
            )?;
            Some(rel)
        }
        None => None,
    };
    let r = replay.run(&input, noise.as_deref(), "units")?;
    if r.fails_at(c.stage) {
        out["removed"] = json!(removed);
        out["kept"] = json!(kept);
        out["still_fails"] = json!(true);
        let names = lw.replay["tensors"].as_array().cloned().unwrap_or_default();
        let names = names
            .iter()
            .filter_map(|n| n.as_str().map(str::to_string))
            .collect();
        return Ok((out, Some(names)));
    }
    // Undone: the capsule keeps every expert, and says why.
    write_file(&c.dir.join("layer.safetensors"), &full_file)?;
    let back = weights::materialise(c.dir, header, &model)?;
    if back != original {
        return Err(crate::gerr!(
            "capsule: restoring every expert gave the replay model weights digest {back}, not {original}"
        ));
    }
    *digest.borrow_mut() = back;
    out["still_fails"] = json!(false);
    not(
        &mut out,
        format!(
            "undone: without experts {removed:?} the layer did not fail at {} when replayed ({}): every expert kept",
            c.stage,
            r.stage.as_ref().map_or("it passes".to_string(), |s| s.detail.clone())
        ),
    );
    Ok((out, None))
}

/// `units.heads` of the manifest: per capture point with one slice per head (the registry's
/// slice axis: q, k, v, attn_probs, the linear-attention points), the heads whose slice alone
/// breaks the point's rule (any differing bit when judged by bits), on the capsule's rows, from
/// the kept rows' replay. Named only (the module's comment says why).
pub(super) fn heads(c: &Ctx) -> Result<Value> {
    let reference = open(&c.o.root, &format!("{}/rows.{}.trace", c.trials, c.keep))?;
    let candidate = open(
        &c.o.root,
        &format!("{}/rows.{}.candidate.trace", c.trials, c.keep),
    )?;
    let pfx = names::layer_prefix(c.layer);
    let (mut failing, mut checked, mut not_checked) = (Vec::new(), Vec::new(), Vec::new());
    for r in reference
        .tensors()
        .iter()
        .filter(|i| i.name.starts_with(&pfx))
    {
        let Some(axis) = names::point(&r.name)
            .filter(|p| p.scope == names::Scope::Layer)
            .and_then(|p| p.shard.slice_axis)
        else {
            continue;
        };
        let name = &r.name;
        let Some(cd) = candidate.tensor_info(name) else {
            not_checked.push(format!("{name}: the candidate did not record it"));
            continue;
        };
        let (Some(pair), true) = (Pair::new(r.dtype, cd.dtype), cd.shape == r.shape) else {
            not_checked.push(format!(
                "{name}: shapes {:?} and {:?} (dtypes {:?}, {:?}) do not pair",
                r.shape, cd.shape, r.dtype, cd.dtype
            ));
            continue;
        };
        let rule = match c.policy {
            Some(p) => match p.rule_for(name, Some("layer")) {
                Some((_, rule)) => Some(rule),
                None => {
                    not_checked.push(format!("{name}: no rule of the policy matches it"));
                    continue;
                }
            },
            None => None,
        };
        let Some(&h) = r.shape.get(axis) else {
            not_checked.push(format!("{name}: shape {:?} has no axis {axis}", r.shape));
            continue;
        };
        let h = h as usize;
        let outer: u64 = r.shape[..axis].iter().product();
        let inner: u64 = r.shape[axis + 1..].iter().product();
        let slice = |data: &[u8], size: usize, head: usize| -> Vec<u8> {
            let step = inner as usize * size;
            (0..outer as usize)
                .flat_map(|o| {
                    let at = (o * h + head) * step;
                    data[at..at + step].iter().copied()
                })
                .collect()
        };
        let (rd, cdata) = (reference.data(r), candidate.data(cd));
        let mut bad = Vec::new();
        for head in 0..h {
            let a = slice(rd, r.dtype.size(), head);
            let b = slice(cdata, cd.dtype.size(), head);
            let s = tracegate_diff::measures::measure(pair, &a, &b)
                .map_err(|e| crate::gerr!("capsule: {name} head {head}: {e}"))?;
            let wrong = match rule {
                None => s.differing() > 0,
                Some(rule) => !rule
                    .violations(&Measured {
                        max_ulp: s.max_ulp(),
                        max_abs: s.max_abs(),
                        max_rel: s.max_rel(),
                        rel_l2: s.rel_l2(),
                        cosine: s.cosine(),
                        scale_error: s.scale_error(),
                        noise_ratio: None,
                        noise_rows: None,
                        nonfinite_differences: s.nan_mismatch() + s.nan_payload() + s.infinity(),
                    })
                    .is_empty(),
            };
            if wrong {
                bad.push(head);
            }
        }
        checked.push(name.clone());
        if !bad.is_empty() {
            failing.push(json!({"point": name, "heads": bad, "of": h}));
        }
    }
    let local = !failing.is_empty()
        && failing.iter().all(|f| {
            f["heads"].as_array().map_or(0, Vec::len) < f["of"].as_u64().unwrap_or(0) as usize
        });
    Ok(json!({
        "checked": checked,
        "not_checked": if checked.is_empty() && not_checked.is_empty() {
            vec!["no per-head capture point in the kept rows' reference (--capture internals records q, k, v, attn_probs)".to_string()]
        } else { not_checked },
        "failing": failing,
        "local": local,
        "reduced": false,
        "why_not_reduced": "heads are named, not cut: zeroing another head's weights changes attn_out for every row, and the reference's outputs would then need recomputing by a reference producer, which a capsule does not carry",
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_of_reads_the_experts_component() {
        assert_eq!(
            expert_of("model.layers.1.mlp.experts.3.up_proj.weight"),
            Some(3)
        );
        assert_eq!(expert_of("model.layers.1.mlp.experts.gate_up_proj"), None);
        assert_eq!(
            expert_of("model.layers.1.mlp.shared_expert.up_proj.weight"),
            None
        );
        assert_eq!(expert_of("model.layers.1.mlp.gate.weight"), None);
    }

    /// Negative control of the reduction: a failing expert no kept row routes to is kept.
    #[test]
    fn a_failing_expert_is_never_dropped() {
        let routed: BTreeSet<usize> = [0, 3].into();
        let kept = kept_experts(&routed, &[5]);
        assert!(kept.contains(&5), "{kept:?}");
        assert_eq!(kept, [0, 3, 5].into());
    }
}
