//! Decisions are compared exactly, as ordered sequences, under every mode and policy: all
//! floats can agree to 1e-6 and the model still picks another expert. Each flipped row is
//! labelled (docs/diff.md, "Labels"): a `consequence` of the first tensor before it that is
//! outside the policy, a `near-tie` when its clean source row moved by enough to explain it, a
//! row `after-near-tie` when an earlier near-tie changed its token, a `defect` otherwise.
//! Margins are content too: compared by bits, or under a policy within [`margin_tolerance`].
//! [`own_scores`]: one side's own scores for one of its decision rows, asked alone.
//!
//! One concept a file: here, every decision compared and its findings; `source` (where a
//! decision row's numbers come from: its source tensor, row and token position); `rows` (one
//! decision compared row by row: margins, and each flip labelled).

mod diffusion;
mod own;
mod rows;
mod scores;
mod source;

use tracegate_trace::{DecisionInfo, Trace};

pub(crate) use diffusion::{one_sided_after_sampling, still_different};
pub use own::{override_gap, own_scores, OverrideGap, OwnScores};
pub use rows::margin_tolerance;
pub use scores::MARGIN_SLACK;
pub(crate) use source::source_tensor;

use crate::excuse::Excusal;
use crate::passes;
use crate::structure::order_finding;
use crate::{
    DecisionDivergence, DecisionResult, DecisionStatus, Finding, FindingKind, Margins, Options,
    Report,
};
use diffusion::RunIndex;
use rows::{compare_one, LeftOut};
use source::taken_at;

/// What `compare` found for one reference decision, in recorded order.
enum Slot<'a> {
    Missing,
    Shape(&'a DecisionInfo, &'a DecisionInfo),
    /// Boxed: the other slots are a few pointers.
    Compared(Option<Box<DecisionResult>>),
}

/// Compares every decision; true if any finding or difference that fails the verdict. Under a
/// `policy`, margins are judged by [`margin_tolerance`], near-ties are excused and the rows
/// after them leave the judgement (`excuse`).
pub fn compare(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    let selected = |name: &str| opts.selects(name);
    rep.decisions.reference_count = r.decisions().iter().filter(|i| selected(&i.name)).count();
    rep.decisions.candidate_count = c.decisions().iter().filter(|i| selected(&i.name)).count();
    let slots = compare_common(r, c, opts, rep);

    // Re-judging rows after a near-tie may have replaced value findings: count from here.
    let before = rep.findings.len();
    let mut failing = false;
    for (rd, slot) in r
        .decisions()
        .iter()
        .filter(|i| selected(&i.name))
        .zip(slots)
    {
        match slot {
            Slot::Missing => {
                rep.decisions.missing.push(rd.name.clone());
                rep.findings.push(Finding::new(
                    FindingKind::MissingDecision,
                    Some(&rd.name),
                    "in the reference, not in the candidate",
                ));
            }
            Slot::Shape(rd, cd) => shape_mismatch(rd, cd, rep),
            Slot::Compared(result) => {
                let result = *result.expect("every compared decision has a result");
                failing |= report_result(result, opts.policy.is_some(), rep);
            }
        }
    }
    extra_and_order(r, c, opts, rep);
    failing
        || rep.findings[before..]
            .iter()
            .any(|f| f.kind != FindingKind::DecisionDiffers)
        || rep.findings.iter().any(|f| {
            matches!(
                f.kind,
                FindingKind::MarginContradictsScores | FindingKind::CommitNotArgmax
            )
        })
}

/// Sorts the selected reference decisions into slots and compares those both traces hold with
/// one shape, in capture order of their sources, so that every near-tie that can reach a
/// decision's inputs is known before the decision is labelled (stable: decode steps stay in
/// order). Then the rows after a near-tie leave the tensors' judgement (`excuse`).
fn compare_common<'a>(
    r: &'a Trace,
    c: &'a Trace,
    opts: &Options,
    rep: &mut Report,
) -> Vec<Slot<'a>> {
    let policy = opts.policy.as_ref();
    let mut slots: Vec<Slot> = Vec::with_capacity(rep.decisions.reference_count);
    let mut todo = Vec::new();
    // A block-diffusion trace's sampler decisions have no source tensor: each is taken after
    // its step's tensors, by run order (`passes`).
    let run = passes::is_diffusion(r.decisions().iter().map(|d| d.name.as_str()))
        .then(|| RunIndex::new(r));
    for rd in r.decisions().iter().filter(|i| opts.selects(&i.name)) {
        match c.decision_info(&rd.name) {
            None => slots.push(Slot::Missing),
            Some(cd) if rd.shape != cd.shape => slots.push(Slot::Shape(rd, cd)),
            Some(cd) => {
                let source = source_tensor(&rd.name, r, c);
                let sampler = passes::place(&rd.name).and_then(|p| p.sampler);
                let at = match (&run, &source, sampler) {
                    (Some(run), None, Some(_)) => run.taken_at(&rd.name).unwrap_or(0),
                    _ => taken_at(&rd.name, source.as_deref(), r),
                };
                todo.push((at, slots.len(), rd, cd, source));
                slots.push(Slot::Compared(None));
            }
        }
    }
    todo.sort_by_key(|t| t.0);
    // A tensor the filter left out excuses nothing: the first one bounds which flips may be
    // near-ties and which margins may use their source's divergence.
    let first_left_out = r
        .tensors()
        .iter()
        .enumerate()
        .find(|(_, t)| !opts.selects(&t.name))
        .map(|(i, t)| (i, t.name.as_str()));
    let mut ex = Excusal::new(r, c, policy, opts.noise.as_ref().map(|n| &*n.0));
    if run.is_some() {
        if let Some(s) = diffusion::sampling_divergence(r, c, opts) {
            ex.sampling_divergence(s);
        }
    }
    let selects = |name: &str| opts.selects(name);
    for (at, slot, rd, cd, source) in todo {
        let left_out = LeftOut {
            first: first_left_out,
            source_selected: source.as_deref().is_none_or(|s| opts.selects(s)),
            selects: &selects,
        };
        let judge = (policy, opts.noise.as_ref().map(|n| &*n.0));
        let result = compare_one(r, c, rd, cd, source, at, left_out, judge, &mut ex, rep);
        slots[slot] = Slot::Compared(Some(Box::new(result)));
    }
    ex.finish(rep);
    slots
}

/// A decision whose shapes differ: its finding, and a result that says so.
fn shape_mismatch(rd: &DecisionInfo, cd: &DecisionInfo, rep: &mut Report) {
    rep.findings.push(Finding::new(
        FindingKind::DecisionShapeMismatch,
        Some(&rd.name),
        format!("reference {:?} vs candidate {:?}", rd.shape, cd.shape),
    ));
    rep.decisions.results.push(DecisionResult {
        name: rd.name.clone(),
        shape: rd.shape.clone(),
        status: DecisionStatus::ShapeMismatch,
        rows: rd.rows(),
        differing_rows: 0,
        reordered_rows: 0,
        source: None,
        flips: Vec::new(),
        margins: Margins::NotCompared,
        margin_differing_rows: 0,
        margin_outside_rows: 0,
        first_margin_difference: None,
        rows_after_near_tie: 0,
    });
}

/// A compared decision's findings (margins, differing rows), the first decision divergence,
/// and the result itself; true when a flip that is not excused fails the verdict.
fn report_result(result: DecisionResult, under_policy: bool, rep: &mut Report) -> bool {
    let name = &result.name;
    rep.decisions.compared += 1;
    match (result.margins, &result.first_margin_difference) {
        (Margins::ReferenceOnly | Margins::CandidateOnly, _) => {
            let (has, lacks) = if result.margins == Margins::ReferenceOnly {
                ("reference", "candidate")
            } else {
                ("candidate", "reference")
            };
            rep.findings.push(Finding::new(
                FindingKind::MarginPresenceMismatch,
                Some(name),
                format!("margins recorded in the {has}, none in the {lacks}"),
            ));
        }
        (Margins::Different, Some(m)) => {
            let bound = m
                .tolerance
                .map(|t| format!(" (outside the tolerance {:e})", t.0))
                .unwrap_or_default();
            let counted = if under_policy {
                result.margin_outside_rows
            } else {
                result.margin_differing_rows
            };
            rep.findings.push(Finding::new(
                FindingKind::MarginDiffers,
                Some(name),
                format!(
                    "margins differ in {counted} of {} rows whose values are equal; first at row {}: {:e} ({}) vs {:e} ({}){bound}",
                    result.rows, m.row, m.reference.0, m.reference_bits, m.candidate.0, m.candidate_bits
                ),
            ));
        }
        _ => {}
    }
    let mut failing = false;
    if result.differing_rows > 0 {
        rep.decisions.differing += 1;
        let f = &result.flips[0];
        // Near-ties and the rows after them are reported (decisions, near_ties), not failed.
        if result.flips.iter().any(|f| !f.excused()) {
            failing = true;
            rep.findings.push(Finding::new(
                FindingKind::DecisionDiffers,
                Some(name),
                format!(
                    "{} of {} rows differ{}; first at row {}: {:?} vs {:?}",
                    result.differing_rows,
                    result.rows,
                    if result.reordered_rows > 0 {
                        format!(" ({} same values, different order)", result.reordered_rows)
                    } else {
                        String::new()
                    },
                    f.row,
                    f.reference,
                    f.candidate
                ),
            ));
        }
        if rep.first_decision_divergence.is_none() {
            rep.first_decision_divergence = Some(DecisionDivergence {
                name: name.clone(),
                row: f.row,
                reference: f.reference.clone(),
                candidate: f.candidate.clone(),
                same_values_different_order: f.same_values_different_order,
                reference_margin: f.reference_margin,
                candidate_margin: f.candidate_margin,
            });
        }
    }
    rep.decisions.results.push(result);
    failing
}

/// Decisions in the candidate only, and the first out of the reference's order.
fn extra_and_order(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) {
    let selected = |name: &str| opts.selects(name);
    for cd in c.decisions().iter().filter(|i| selected(&i.name)) {
        if r.decision_info(&cd.name).is_none() {
            rep.decisions.extra.push(cd.name.clone());
            rep.findings.push(Finding::new(
                FindingKind::ExtraDecision,
                Some(&cd.name),
                "in the candidate, not in the reference",
            ));
        }
    }
    let rn = r
        .decisions()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| selected(n) && c.decision_info(n).is_some());
    let cn = c
        .decisions()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| selected(n) && r.decision_info(n).is_some());
    if let Some(f) = order_finding(FindingKind::DecisionOrderMismatch, rn, cn) {
        rep.findings.push(f);
    }
}
