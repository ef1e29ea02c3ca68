//! The layers isolated at the first diverging decode step (`layer --decode-from P`).

use std::path::Path;

use serde_json::{json, Value};
use tracegate_producers::{RunRecord, Verb};
use tracegate_trace::names;
use tracegate_trace::{Attributes, Trace, TraceWriter};

use super::{Context, DecodeReport};
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::layers::settle_statuses;
use crate::bisect::prefill::{self as b, Isolated, LayerStatus, TensorCmp};
use crate::{gerr, Result};

/// The capture points of a decode step's layer, in computation order.
const BODY: [&str; 4] = ["hidden_in", "attn_out", "mlp_out", "hidden_out"];

/// Writes the isolation inputs of step `s` from the reference: `decode.SSSS.input.trace`, per
/// layer `layer.LL.hidden_in` at positions 0..=P (the prefill's rows, then steps 1..=s), and
/// `decode.SSSS.reference.trace`, per layer the step's `layer.LL.*` row as the candidate's
/// `layer --decode-from P` writes it (one row at P, attribute `decode_from`).
fn write_step_inputs(
    o: &BisectOptions,
    c: &Context,
    s: usize,
    p: i64,
    input_rel: &str,
    view_rel: &str,
) -> Result<()> {
    let r = c.reference;
    let mut prov = r.provenance().clone();
    if let Some(x) = prov.as_object_mut() {
        x.insert(
            "bisect_decode_step".into(),
            json!({ "step": s, "position": p, "from": r.path().display().to_string() }),
        );
    }
    step_rows(
        r,
        s,
        p,
        0..c.layers,
        &prov,
        &o.root.join(input_rel),
        &o.root.join(view_rel),
    )
}

/// The rows of step `s` (position `p`) of `layers` in reference `r`, with `provenance`: into
/// `input` each layer's `layer.LL.hidden_in` at positions 0..=p, into `view` its step row at
/// every decode capture point, `path=layer` and `decode_from` = p, and for an MoE layer the
/// prompt's `layer.LL.router.topk` (it names the feed-forward block MoE in the stage; a
/// `--decode-from` trace holds no decisions, so it is never compared). The bisection's decode
/// isolation and a decode capsule (../capsule/decode.rs) both write them here.
pub(crate) fn step_rows(
    r: &Trace,
    s: usize,
    p: i64,
    layers: std::ops::Range<usize>,
    provenance: &Value,
    input_path: &Path,
    view_path: &Path,
) -> Result<()> {
    let create = |path: &Path| {
        TraceWriter::create(path, provenance.clone())
            .map_err(|e| gerr!(File: "{}: {e}", path.display()))
    };
    let (input_rel, view_rel) = (input_path.display(), view_path.display());
    let (mut input, mut view) = (create(input_path)?, create(view_path)?);
    for l in layers {
        let pre = names::layer(l, "hidden_in");
        let mut x = r
            .f32_slice(&pre)
            .map_err(|e| gerr!(File: "the reference's {pre}: {e}"))?
            .to_vec();
        let info = r
            .tensor_info(&pre)
            .ok_or_else(|| gerr!(Producer: "the reference has no {pre}"))?;
        let h = *info.shape.last().unwrap_or(&0);
        for t in 1..=s {
            let name = names::decode(t, &pre);
            x.extend_from_slice(
                r.f32_slice(&name)
                    .map_err(|e| gerr!(File: "the reference's {name}: {e}"))?,
            );
        }
        let attrs = Attributes {
            positions: Some((0..=p).collect()),
            ..info.attributes.clone()
        };
        input
            .tensor_f32(&pre, &[p as u64 + 1, h], &x, &attrs)
            .map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
        for point in BODY {
            let name = names::decode(s, &names::layer(l, point));
            let info = r
                .tensor_info(&name)
                .ok_or_else(|| gerr!(Producer: "the reference has no {name}"))?;
            let mut attrs = info.attributes.clone();
            attrs.path = Some("layer".into());
            attrs.extra.insert("decode_from".into(), p.to_string());
            let data = r
                .f32_slice(&name)
                .map_err(|e| gerr!(File: "the reference's {name}: {e}"))?;
            view.tensor_f32(&names::layer(l, point), &info.shape, data, &attrs)
                .map_err(|e| gerr!(File: "{view_rel}: {e}"))?;
        }
        if let Some(d) = r.decision_info(&names::layer(l, "router.topk")) {
            let margins = r.decision_margins(d);
            view.decision(&d.name, &d.shape, &r.decision_values(d), margins.as_deref())
                .map_err(|e| gerr!(File: "{view_rel}: {e}"))?;
        }
    }
    input
        .finish()
        .map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
    view.finish().map_err(|e| gerr!(File: "{view_rel}: {e}"))?;
    Ok(())
}

/// Isolates layers at step `s` (up to the first diverging one, or all with `--all-layers`).
/// `step_all`: the whole runs' comparison of every tensor of step `s`.
pub(super) fn isolate_step(
    o: &BisectOptions,
    c: &Context,
    s: usize,
    p: i64,
    step_all: &[TensorCmp],
    d: &mut DecodeReport,
    runs: &mut Vec<RunRecord>,
) {
    // A reference recorded with the default capture (`gate init`'s golden traces) holds a
    // decode step's logits and token, not its layers' points: the step is named, not isolated.
    let first_point = names::decode(s, &names::layer(0, "hidden_in"));
    if c.reference.tensor_info(&first_point).is_none() {
        d.isolation_not_checked = Some(format!(
            "the reference has no {first_point}: its decode steps hold their logits and token only (recorded with --capture default, docs/producers.md), so the step's layers are not isolated; a reference recorded with --capture internals isolates them (a port's golden traces: `gate init --capture internals`)"
        ));
        return;
    }
    let input_rel = format!("{}/decode.{s:04}.input.trace", o.work);
    let view_rel = format!("{}/decode.{s:04}.reference.trace", o.work);
    if let Err(e) = write_step_inputs(o, c, s, p, &input_rel, &view_rel) {
        d.isolation_not_checked = Some(e.to_string());
        return;
    }
    let view = match b::open(&o.root, &view_rel) {
        Ok(t) => t,
        Err(e) => {
            d.isolation_not_checked = Some(e.to_string());
            return;
        }
    };
    let whole = |l: usize| {
        step_all
            .iter()
            .find(|t| t.tensor == names::decode(s, &names::layer(l, "hidden_out")))
            .cloned()
    };
    let differs = |l: usize| {
        d.step_tensors.iter().any(|t| {
            t.tensor
                .starts_with(&names::decode(s, &names::layer_prefix(l)))
        })
    };
    let first_layer = (0..c.layers).find(|&l| differs(l));
    let upto = if o.all_layers {
        c.layers
    } else {
        first_layer.map_or(0, |l| l + 1)
    };
    crate::progress::plan(upto as u64);
    for l in 0..upto {
        let h = whole(l);
        let mut row = b::layer_row(l, differs(l), h.as_ref());
        let run = b::LayerRun {
            verb: Verb::Layer {
                model: o.model.clone(),
                layer: l,
                input: input_rel.clone(),
                input_name: names::layer(l, "hidden_in"),
                out: format!("{}/decode.{s:04}.candidate.layer.{l:02}.trace", o.work),
                internals: o.internals,
                force: None,
                decode_from: Some(p),
            },
            layer: l,
            slice_rel: format!("{}/decode.{s:04}.reference.layer.{l:02}.trace", o.work),
            whose: "the reference's",
            pass: None,
            // The decode steps' layer rows are not in a default noise trace: the policy judges.
            noise: None,
            cut: None,
        };
        match b::isolate_with(o, &run, c.policy, runs, |cand, out| {
            b::write_slice(&view, cand, l, out, None)
        }) {
            Ok(iso) => b::fill_isolated(&mut row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.status = LayerStatus::NotChecked;
                let why = format!("{why} (--decode-from is part of the decode extension, docs/producers.md; a producer without it cannot be isolated at a decode step)");
                row.reason = Some(why.clone());
                d.isolation_not_checked = Some(format!("layer {l:02}: {why}"));
                crate::progress::step(format_args!("decode step {s}: layer {l:02} not checked"));
                d.layers.push(row);
                break;
            }
        }
        crate::progress::step(format_args!(
            "decode step {s}: layer {l:02} in isolation: {}",
            row.isolation
        ));
        d.layers.push(row);
    }
    d.first_wrong_layer = settle_statuses(&mut d.layers);
    d.stage = d.first_wrong_layer.map(|l| {
        b::stage(
            l,
            &d.layers[l],
            c.reference
                .decision_info(&names::layer(l, "router.topk"))
                .is_some(),
            "differs in isolation",
        )
    });
}
