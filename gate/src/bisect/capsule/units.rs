//! A capsule's units (docs/bisect.md, "Capsules", "Heads and experts"): where a failure is
//! local to some experts or heads, which, and what of them the capsule can leave out.
//!
//! Experts: a row's MoE output reads only the experts the router sends it to, so the experts no
//! kept row routes to (by the reference's own `router.topk`) cannot change any kept output; they
//! are left out of `layer.safetensors` and read as zeros in the replay model. The router and a
//! shared expert are always kept, and so is every failing expert. Checked, not assumed: the
//! reduced capsule is replayed and kept only if it fails at the same capture point.
//!
//! Heads: before o_proj mixes them, a query head's points (q, attn_probs) read only its own rows
//! of q_proj and its key/value head's rows of k_proj/v_proj (k, v), besides the shared norms and
//! the input rows. Where the stage is such a point and the failure is local to some heads, the
//! other heads' rows are zeroed, o_proj and everything after it left out, and the capsule judges
//! only the kept heads' slices of the per-head points up to the stage (`Cut`, one slicing
//! function for the reference's rows and the candidate's output): the reference's later points
//! are not the reduced layer's. Checked as the experts are: replayed, else undone.

use std::cell::RefCell;
use std::collections::BTreeSet;

use serde_json::{json, Value};
use std::path::Path;
use tracegate_diff::numeric::Pair;
use tracegate_diff::policy::Measured;
use tracegate_diff::Policy;

use tracegate_trace::{names, Trace, TraceWriter};

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
/// the kept rows' replay.
fn named(c: &Ctx) -> Result<Value> {
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
    }))
}

/// The per-head points before o_proj mixes the heads, in the registry's order, and whether each
/// is sliced by query heads (true) or by key/value heads.
const PER_HEAD: [(&str, bool); 4] = [
    ("q", true),
    ("k", false),
    ("v", false),
    ("attn_probs", true),
];

/// What a head-reduced capsule judges: the kept query heads, the key/value heads they read, and
/// the per-head points up to the stage (full names), each sliced to its kept heads.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct Cut {
    pub layer: usize,
    pub query: Vec<usize>,
    pub kv: Vec<usize>,
    pub points: Vec<String>,
}

impl Cut {
    /// The cut a manifest's `units.heads` records (None: the capsule keeps every head).
    pub(super) fn of_manifest(layer: usize, units: &Value) -> Result<Option<Cut>> {
        let h = &units["heads"];
        if h["reduced"] != json!(true) {
            return Ok(None);
        }
        let j = &h["judged"];
        let list = |v: &Value| -> Option<Vec<usize>> {
            v.as_array()?
                .iter()
                .map(|x| x.as_u64().map(|x| x as usize))
                .collect()
        };
        let points: Option<Vec<String>> = j["points"]
            .as_array()
            .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect());
        match (list(&j["query_heads"]), list(&j["kv_heads"]), points) {
            (Some(query), Some(kv), Some(points)) if !points.is_empty() => Ok(Some(Cut {
                layer,
                query,
                kv,
                points,
            })),
            _ => Err(crate::gerr!(
                "capsule: manifest units.heads is reduced but judged is not {{points, query_heads, kv_heads}}: {j}"
            )),
        }
    }

    /// Each judged point with its head axis (the registry's) and the heads kept of it: what the
    /// manifest's `judged.slices` and the generated tests cut a candidate's output by.
    pub(super) fn slices(&self) -> Vec<(String, usize, Vec<usize>)> {
        self.points
            .iter()
            .filter_map(|name| {
                let axis = names::point(name).and_then(|p| p.shard.slice_axis)?;
                Some((name.clone(), axis, self.heads_of(name)?.to_vec()))
            })
            .collect()
    }

    /// The heads kept of per-head point `name` (None: not a judged point).
    fn heads_of(&self, name: &str) -> Option<&[usize]> {
        if !self.points.iter().any(|p| p == name) {
            return None;
        }
        let short = names::Name::parse(name).point;
        PER_HEAD
            .iter()
            .find(|(p, _)| *p == short)
            .map(|(_, by_query)| {
                if *by_query {
                    &self.query[..]
                } else {
                    &self.kv[..]
                }
            })
    }

    /// The one slicing function, for the reference's rows and the candidate's output alike:
    /// `t`'s layer input (`hidden_in`, whole) and the judged per-head points holding only the
    /// kept heads along the registry's slice axis, written to `out`; nothing else of `t`.
    pub(super) fn write(&self, t: &Trace, out: &Path) -> Result<()> {
        let io = |e: tracegate_trace::Error| crate::gerr!(File: "{}: {e}", out.display());
        let mut w = TraceWriter::create(out, t.provenance().clone()).map_err(io)?;
        let input = names::layer(self.layer, "hidden_in");
        for info in t.tensors() {
            if info.name == input {
                w.tensor(
                    &info.name,
                    info.dtype,
                    &info.shape,
                    t.data(info),
                    &info.attributes,
                )
                .map_err(io)?;
                continue;
            }
            let Some(keep) = self.heads_of(&info.name) else {
                continue;
            };
            let axis = names::point(&info.name)
                .and_then(|p| p.shard.slice_axis)
                .ok_or_else(|| crate::gerr!("capsule: {} has no head axis", info.name))?;
            let (shape, bytes) =
                slice_heads(&info.shape, info.dtype.size(), axis, keep, t.data(info)).map_err(
                    |e| crate::gerr!("capsule: {} in {}: {e}", info.name, t.path().display()),
                )?;
            w.tensor(&info.name, info.dtype, &shape, &bytes, &info.attributes)
                .map_err(io)?;
        }
        w.finish().map_err(io)?;
        Ok(())
    }
}

/// The heads `keep` of a tensor of `shape` (elements of `size` bytes) along `axis`: its new
/// shape and bytes.
fn slice_heads(
    shape: &[u64],
    size: usize,
    axis: usize,
    keep: &[usize],
    data: &[u8],
) -> std::result::Result<(Vec<u64>, Vec<u8>), String> {
    let Some(&h) = shape.get(axis) else {
        return Err(format!("shape {shape:?} has no axis {axis}"));
    };
    let h = h as usize;
    if let Some(bad) = keep.iter().find(|&&k| k >= h) {
        return Err(format!("head {bad} of {h} (shape {shape:?})"));
    }
    let outer: u64 = shape[..axis].iter().product();
    let step = shape[axis + 1..].iter().product::<u64>() as usize * size;
    if data.len() != outer as usize * h * step {
        return Err(format!("{} bytes for shape {shape:?}", data.len()));
    }
    let mut bytes = Vec::with_capacity(outer as usize * keep.len() * step);
    for o in 0..outer as usize {
        for &k in keep {
            let at = (o * h + k) * step;
            bytes.extend_from_slice(&data[at..at + step]);
        }
    }
    let mut out = shape.to_vec();
    out[axis] = keep.len() as u64;
    Ok((out, bytes))
}

/// The query heads kept and the key/value heads they read: every failing query head (at q or
/// attn_probs), every query head reading a failing key/value head (at k or v), and their
/// key/value heads (query head h reads key/value head h / (heads / kv_heads), as the
/// checkpoint's grouped-query attention does). A failing head is never dropped.
pub(super) fn kept_heads(
    heads: usize,
    kv_heads: usize,
    failing_query: &BTreeSet<usize>,
    failing_kv: &BTreeSet<usize>,
) -> (Vec<usize>, Vec<usize>) {
    let group = (heads / kv_heads.max(1)).max(1);
    let query: BTreeSet<usize> = (0..heads)
        .filter(|q| failing_query.contains(q) || failing_kv.contains(&(q / group)))
        .collect();
    let kv: BTreeSet<usize> = query
        .iter()
        .map(|q| q / group)
        .chain(failing_kv.iter().copied())
        .collect();
    (query.into_iter().collect(), kv.into_iter().collect())
}

/// What a head-reduced layer keeps of its tensors: the attention's (o_proj's aside) and the
/// input norm; o_proj, the post-attention norm, the MLP and the experts are left out (the
/// judged points do not read them).
fn kept_by_heads(name: &str) -> bool {
    (name.contains(".self_attn.") && !name.contains(".o_proj."))
        || name.contains(".input_layernorm.")
}

/// `units.heads` of the manifest: the failing heads named (`named`) and, where the stage is a
/// per-head point and the failure local to some heads, the capsule reduced to them (`Cut`):
/// the other heads' rows of q_proj (k_proj, v_proj) zeroed in `layer.safetensors`, o_proj and
/// what follows left out, replayed and kept only if it still fails at the stage. Returns the
/// cut and the tensors `layer.safetensors` then holds.
pub(super) fn heads(
    c: &Ctx,
    replay: &Replay,
    digest: &RefCell<String>,
    provenance: &dyn Fn(&Trace, usize) -> Value,
) -> Result<(Value, Option<Kept>)> {
    let mut out = named(c)?;
    for k in [
        "kept",
        "removed",
        "kv_kept",
        "kv_removed",
        "judged",
        "not_judged",
        "weights",
        "still_fails",
    ] {
        out[k] = Value::Null;
    }
    out["reduced"] = json!(false);
    let plan = match plan(c, &out)? {
        Ok(p) => p,
        Err(why) => {
            out["why_not_reduced"] = json!(why);
            return Ok((out, None));
        }
    };
    let Plan {
        cut,
        heads,
        kv_heads,
        layer_file,
        tensors,
    } = plan;
    let model = c.o.root.join(&replay.model);
    let full_file = std::fs::read(c.dir.join("layer.safetensors"))
        .map_err(|e| crate::gerr!(File: "{}: {e}", c.dir.join("layer.safetensors").display()))?;
    let original = digest.borrow().clone();
    write_file(&c.dir.join("layer.safetensors"), &layer_file)?;
    *digest.borrow_mut() = weights::materialise(c.dir, c.weights, &model)?;
    let rows_rel = format!("{}/units.heads.rows.trace", c.trials);
    rows::write(
        c.reference,
        c.layer,
        c.keep,
        provenance(c.reference, c.keep),
        &c.o.root.join(&rows_rel),
    )?;
    let input = format!("{}/units.heads.trace", c.trials);
    cut.write(&open(&c.o.root, &rows_rel)?, &c.o.root.join(&input))?;
    let mut reduced = replay.clone();
    reduced.heads = Some(cut.clone());
    let r = reduced.run(&input, None, "units.heads")?;
    let removed =
        |kept: &[usize], of: usize| (0..of).filter(|h| !kept.contains(h)).collect::<Vec<_>>();
    out["kept"] = json!(cut.query);
    out["kv_kept"] = json!(cut.kv);
    if r.fails_at(c.stage) {
        out["reduced"] = json!(true);
        out["removed"] = json!(removed(&cut.query, heads));
        out["kv_removed"] = json!(removed(&cut.kv, kv_heads));
        let slices: serde_json::Map<String, Value> = cut
            .slices()
            .into_iter()
            .map(|(name, axis, heads)| (name, json!({"axis": axis, "heads": heads})))
            .collect();
        out["judged"] = json!({"points": cut.points, "query_heads": cut.query, "kv_heads": cut.kv,
            "slices": slices});
        out["not_judged"] = json!(format!(
            "every other point of layer {:02} (attn_out, mlp_out, hidden_out, and the per-head points after {}) and the other heads' slices: the reference's are not the reduced layer's",
            c.layer, c.stage
        ));
        out["weights"] = json!(format!(
            "q_proj rows of query heads {:?} and k_proj/v_proj rows of key/value heads {:?} zeroed in layer.safetensors; o_proj, the post-attention norm and the MLP left out (zero in the replay model): the judged points do not read them",
            removed(&cut.query, heads), removed(&cut.kv, kv_heads)
        ));
        out["still_fails"] = json!(true);
        out["why_not_reduced"] = Value::Null;
        return Ok((out, Some((cut, tensors))));
    }
    // Undone: every head kept, and why.
    write_file(&c.dir.join("layer.safetensors"), &full_file)?;
    let back = weights::materialise(c.dir, c.weights, &model)?;
    if back != original {
        return Err(crate::gerr!(
            "capsule: restoring every head gave the replay model weights digest {back}, not {original}"
        ));
    }
    *digest.borrow_mut() = back;
    out["still_fails"] = json!(false);
    out["why_not_reduced"] = json!(format!(
        "undone: with query heads {:?} only the layer did not fail at {} when replayed ({}): every head kept",
        cut.query,
        c.stage,
        r.stage.as_ref().map_or("it passes".to_string(), |s| s.detail.clone())
    ));
    Ok((out, None))
}

/// A head cut that held: the cut, and the tensors `layer.safetensors` then holds.
pub(super) type Kept = (Cut, Vec<String>);

struct Plan {
    cut: Cut,
    heads: usize,
    kv_heads: usize,
    layer_file: Vec<u8>,
    tensors: Vec<String>,
}

/// The head reduction `named` allows, or why none (the manifest's `why_not_reduced`).
fn plan(c: &Ctx, named: &Value) -> Result<std::result::Result<Plan, String>> {
    let stage = names::Name::parse(c.stage).point;
    let Some(at) = PER_HEAD.iter().position(|(p, _)| *p == stage) else {
        return Ok(Err(format!(
            "the stage {} is not a per-head point before o_proj mixes the heads (q, k, v, attn_probs): every head kept",
            c.stage
        )));
    };
    if !c.minimise {
        return Ok(Err("--capsule-full: every head kept".into()));
    }
    if c.weights["format"] == "gguf" {
        return Ok(Err(
            "a GGUF model's heads are not cut (its blocks are kept as quantised): every head kept"
                .into(),
        ));
    }
    if c.o.noise.is_some() {
        return Ok(Err(
            "a noise run (--noise-reference): its rows are not sliced by heads: every head kept"
                .into(),
        ));
    }
    let info = |p: &str| c.reference.tensor_info(&names::layer(c.layer, p));
    if info("attn_gate").is_some() {
        return Ok(Err("an output gate (attn_gate) packed with q_proj: its heads are not sliced: every head kept".into()));
    }
    let (Some(q), Some(k)) = (info("q"), info("k")) else {
        return Ok(Err("q and k not recorded (--capture internals): the heads' counts not known: every head kept".into()));
    };
    let (Some(&heads), Some(&kv_heads), Some(&dim)) =
        (q.shape.get(1), k.shape.get(1), q.shape.get(2))
    else {
        return Ok(Err(format!(
            "q {:?} and k {:?} are not [tokens, heads, head_dim]: every head kept",
            q.shape, k.shape
        )));
    };
    let (heads, kv_heads, dim) = (heads as usize, kv_heads as usize, dim as usize);
    if kv_heads == 0 || heads % kv_heads != 0 {
        return Ok(Err(format!(
            "{heads} query heads over {kv_heads} key/value heads: every head kept"
        )));
    }
    let judged: Vec<&str> = PER_HEAD[..=at].iter().map(|(p, _)| *p).collect();
    let (mut fq, mut fkv) = (BTreeSet::new(), BTreeSet::new());
    for f in named["failing"].as_array().into_iter().flatten() {
        let point = f["point"].as_str().unwrap_or_default();
        let short = names::Name::parse(point).point;
        let Some((_, by_query)) = PER_HEAD.iter().find(|(p, _)| *p == short) else {
            continue;
        };
        if !judged.contains(&short) {
            continue;
        }
        let hs = f["heads"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|h| h.as_u64());
        if *by_query {
            fq.extend(hs.map(|h| h as usize))
        } else {
            fkv.extend(hs.map(|h| h as usize))
        }
    }
    if fq.is_empty() && fkv.is_empty() {
        return Ok(Err(format!(
            "no head's slice alone fails at {} or before: every head kept",
            c.stage
        )));
    }
    let (query, kv) = kept_heads(heads, kv_heads, &fq, &fkv);
    if query.len() == heads {
        return Ok(Err(format!(
            "the failure is not local: query heads {query:?} of {heads} fail or read a failing key/value head: every head kept"
        )));
    }
    let model_dir = c.o.root.join(&c.o.model);
    let all = weights::checkpoint(&model_dir)?;
    let mine: Vec<&weights::Entry> = all
        .iter()
        .filter(|e| weights::of_layer(&e.name, c.layer))
        .collect();
    let proj = |p: &str| format!(".self_attn.{p}_proj.");
    for p in ["q", "k", "v"] {
        if !mine
            .iter()
            .any(|e| e.name.ends_with(&format!("{}weight", proj(p))))
        {
            return Ok(Err(format!(
                "no separate {p}_proj weight in layer {} (packed qkv, or names this reduction does not know): every head kept",
                c.layer
            )));
        }
    }
    let mut layer = Vec::new();
    for e in mine.iter().filter(|e| kept_by_heads(&e.name)) {
        let mut bytes = weights::read_range(e)?;
        let rows = |p: &str| e.name.contains(&proj(p));
        let (of, keep) = if rows("q") {
            (heads, &query)
        } else if rows("k") || rows("v") {
            (kv_heads, &kv)
        } else {
            layer.push(((*e).clone(), bytes));
            continue;
        };
        let suffix = e.name.rsplit('.').next().unwrap_or_default();
        if !matches!(suffix, "weight" | "bias") || e.shape.first() != Some(&((of * dim) as u64)) {
            return Ok(Err(format!(
                "{} {:?} is not {of} heads of {dim} rows (weight or bias): every head kept",
                e.name, e.shape
            )));
        }
        let per_head = bytes.len() / of;
        for h in (0..of).filter(|h| !keep.contains(h)) {
            bytes[h * per_head..(h + 1) * per_head].fill(0);
        }
        layer.push(((*e).clone(), bytes));
    }
    let spec: Vec<(&str, &str, &[u64], u64)> = layer
        .iter()
        .map(|(e, b)| {
            (
                e.name.as_str(),
                e.dtype.as_str(),
                e.shape.as_slice(),
                b.len() as u64,
            )
        })
        .collect();
    let (text, _) = weights::header_text(&spec);
    let mut layer_file = (text.len() as u64).to_le_bytes().to_vec();
    layer_file.extend_from_slice(text.as_bytes());
    for (_, b) in &layer {
        layer_file.extend_from_slice(b);
    }
    let points = judged.iter().map(|p| names::layer(c.layer, p)).collect();
    Ok(Ok(Plan {
        cut: Cut {
            layer: c.layer,
            query,
            kv,
            points,
        },
        heads,
        kv_heads,
        layer_file,
        tensors: layer.iter().map(|(e, _)| e.name.clone()).collect(),
    }))
}

/// `units.experts` when the heads were cut: the MLP (its router and every expert) is left out.
pub(super) fn experts_left_out(c: &Ctx) -> Value {
    let topk = names::layer(c.layer, "router.topk");
    if !c.reference.decisions().iter().any(|d| d.name == topk) {
        return Value::Null;
    }
    json!({"removed": "all", "not_minimised": null,
        "why": "the heads were cut (units.heads): the MLP, its router and every expert are left out; the judged points do not read them"})
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

    /// Negative control of the head cut: a failing query head is always kept, with its
    /// key/value head (h / group); a failing key/value head keeps every query head that reads
    /// it. 8 query heads over 2 key/value heads (groups of 4), worked by hand.
    #[test]
    fn a_failing_head_is_never_dropped() {
        let none = BTreeSet::new();
        assert_eq!(
            kept_heads(8, 2, &[1, 6].into(), &none),
            (vec![1, 6], vec![0, 1])
        );
        assert_eq!(kept_heads(8, 2, &[5].into(), &none), (vec![5], vec![1]));
        assert_eq!(
            kept_heads(8, 2, &none, &[0].into()),
            (vec![0, 1, 2, 3], vec![0])
        );
        assert_eq!(kept_heads(4, 4, &[3].into(), &none), (vec![3], vec![3]));
    }

    /// The slice: [tokens 2, heads 3, dim 2] keeping heads 2 and 0 (in that order), and
    /// [heads 3, rows 1, keys 2] along axis 0; a head out of range is refused, not clamped.
    #[test]
    fn slice_heads_keeps_the_named_heads_along_the_axis() {
        let q: Vec<u8> = (0u8..12).collect();
        let (shape, bytes) = slice_heads(&[2, 3, 2], 1, 1, &[2, 0], &q).unwrap();
        assert_eq!(shape, [2, 2, 2]);
        assert_eq!(bytes, [4, 5, 0, 1, 10, 11, 6, 7]);
        let p: Vec<u8> = (0u8..6).collect();
        let (shape, bytes) = slice_heads(&[3, 1, 2], 1, 0, &[1], &p).unwrap();
        assert_eq!((shape, bytes), (vec![1, 1, 2], vec![2, 3]));
        assert!(slice_heads(&[3, 1, 2], 1, 0, &[3], &p)
            .unwrap_err()
            .contains("head 3 of 3"));
        assert!(slice_heads(&[3, 1, 2], 1, 0, &[0], &p[..5]).is_err());
    }
}
