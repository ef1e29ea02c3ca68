//! The layers isolated at the first diverging pass: the candidate's `layer` verb on the
//! reference's whole trace, input `P.layer.LL.hidden_in` (the verb reads the earlier encoder
//! passes' keys from the same trace), compared with the reference's `P.layer.LL.*`; then the
//! blamed layer's verb on the candidate's own whole run (self-consistency).

use tracegate_producers::{RunRecord, Verb};
use tracegate_trace::names;
use tracegate_trace::Trace;

use super::{Context, DiffusionReport};
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::layers::settle_statuses;
use crate::bisect::prefill::{self as b, Isolated, Isolation, TensorCmp};
use crate::Result;

/// The pass to isolate at and what is known of it.
pub(super) struct Pass<'a> {
    /// `denoise.BBBB.SSSS.` or `encode.BBBB.`.
    pub prefix: &'a str,
    /// The first layer that differs in the whole runs.
    pub first_layer: usize,
    /// The candidate took the reference's decisions: its layer verb takes its router's too.
    pub forced: bool,
    /// The candidate's whole run (forced, if it was) for the self-consistency check.
    pub candidate: &'a Trace,
    pub cand_rel: &'a str,
    /// The whole runs' rows of this pass.
    pub rows: &'a [TensorCmp],
}

/// The candidate's layer verb at pass `x` on `src`'s input to `layer`, compared with `src`'s own
/// outputs there. `stem`: "candidate" (on the reference's input) or "candidate.self" (its own).
fn isolate_one(
    o: &BisectOptions,
    c: &Context,
    x: &Pass,
    (src, src_rel, whose, stem): (&Trace, &str, &str, &str),
    layer: usize,
    runs: &mut Vec<RunRecord>,
) -> Result<Isolation> {
    let tag = x.prefix.trim_end_matches('.');
    let run = b::LayerRun {
        verb: Verb::Layer {
            model: o.model.clone(),
            layer,
            input: src_rel.to_string(),
            input_name: format!("{}{}", x.prefix, names::layer(layer, "hidden_in")),
            out: format!("{}/{tag}.{stem}.layer.{layer:02}.trace", o.work),
            internals: o.internals,
            force: x.forced.then(|| src_rel.to_string()),
            decode_from: None,
        },
        layer,
        slice_rel: format!("{}/{tag}.{stem}.slice.layer.{layer:02}.trace", o.work),
        whose,
        pass: Some(x.prefix.to_string()),
        // The noise run holds the prompt's rows, not a pass's: no ratio to hold a pass to.
        noise: None,
        cut: None,
    };
    b::isolate_with(o, &run, c.policy, runs, |cand, out| {
        b::write_slice(src, cand, layer, out, Some(x.prefix))
    })
}

/// Isolates the layers of pass `x` up to its first differing one (all with `--all-layers`),
/// names the first wrong layer and its stage, and checks the blamed layer's verb against the
/// candidate's own whole run.
pub(super) fn isolate_pass(
    o: &BisectOptions,
    c: &Context,
    x: &Pass,
    d: &mut DiffusionReport,
    runs: &mut Vec<RunRecord>,
) {
    let in_layer =
        |name: &str, l: usize| name.starts_with(&format!("{}{}", x.prefix, names::layer_prefix(l)));
    let differs = |l: usize| {
        d.pass_tensors.iter().any(|t| in_layer(&t.tensor, l))
            || d.pass_decisions.iter().any(|t| in_layer(&t.name, l))
    };
    let upto = if o.all_layers {
        c.layers
    } else {
        x.first_layer + 1
    };
    let place = d.place.clone().unwrap_or_default();
    crate::progress::plan(upto as u64);
    for l in 0..upto {
        let hidden = format!("{}{}", x.prefix, names::layer(l, "hidden_out"));
        let h = x.rows.iter().find(|t| t.tensor == hidden);
        let mut row = b::layer_row(l, differs(l), h);
        let on_reference = (c.reference, c.ref_rel, "the reference's", "candidate");
        match isolate_one(o, c, x, on_reference, l, runs) {
            Ok(iso) => b::fill_isolated(&mut row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.reason = Some(why.to_string());
                d.isolation_not_checked = Some(format!("layer {l:02}: {why}"));
                d.layers.push(row);
                crate::progress::step(format_args!("{place}: layer {l:02} not checked"));
                break;
            }
        }
        crate::progress::step(format_args!(
            "{place}: layer {l:02} in isolation: {}",
            row.isolation
        ));
        d.layers.push(row);
        if runs.last().is_some_and(|r| r.timed_out) {
            break;
        }
    }
    d.first_wrong_layer = settle_statuses(&mut d.layers);
    let Some(l) = d.first_wrong_layer.or_else(|| unexplained(x, d)) else {
        return;
    };
    let moe = b::is_moe(c.reference, l);
    if d.first_wrong_layer.is_some() {
        d.stage = Some(b::stage(l, &d.layers[l], moe, "differs in isolation"));
    }
    // Before the layer body is blamed (or a difference it cannot have inherited is called
    // accumulated): does the candidate's layer verb agree with its own run?
    let own = (
        x.candidate,
        x.cand_rel,
        "its own whole run's",
        "candidate.self",
    );
    match isolate_one(o, c, x, own, l, runs) {
        Ok(iso) if iso.wrong => {
            d.layers[l].self_check = b::SelfCheck::Inconsistent;
            d.layers[l].status = b::LayerStatus::Inconsistent;
            d.inconsistent = Some(b::inconsistency(l, &iso, moe));
        }
        Ok(_) => d.layers[l].self_check = b::SelfCheck::Consistent,
        Err(why) => {
            d.layers[l].self_check = b::SelfCheck::NotChecked;
            d.self_check_not_checked = Some(format!("layer {l:02}: {why}"));
        }
    }
}

/// The pass's first differing layer when no layer is wrong in isolation although that layer's
/// input agrees in the whole runs (its `hidden_in` is not among the pass's differing tensors)
/// and its body matches on the reference's input: it cannot have inherited the difference, so
/// its whole run read something else than its isolation did — in a denoise step or a commit
/// pass, the earlier encoder passes' keys, which the layer verb reads from the trace.
fn unexplained(x: &Pass, d: &DiffusionReport) -> Option<usize> {
    let l = x.first_layer;
    let input = format!("{}{}", x.prefix, names::layer(l, "hidden_in"));
    let row = d.layers.get(l)?;
    let agrees = !d.pass_tensors.iter().any(|t| t.tensor == input);
    (agrees && row.isolation == Isolated::Match && row.status == b::LayerStatus::Inherits)
        .then_some(l)
}
