//! Decisions are compared exactly, as ordered sequences, under every mode and policy: all
//! floats can agree to 1e-6 and the model still picks another expert. Each flipped row is
//! labelled (docs/diff.md, "Labels"): a `consequence` of the first tensor before it that is
//! outside the policy, a `near-tie` when its clean source row moved by enough to explain it, a
//! row `after-near-tie` when an earlier near-tie changed its token, a `defect` otherwise.
//! Margins are content too: compared by bits, or under a policy within [`margin_tolerance`].

use tracegate_trace::names::Name;
use tracegate_trace::{DecisionInfo, Trace};

use crate::excuse::{capture_index, Excusal};
use crate::structure::order_finding;
use crate::values::{range_divergence, row_range};
use crate::{
    numeric, DecisionDivergence, DecisionResult, DecisionStatus, Finding, FindingKind, Flip, Label,
    MarginDifference, Margins, NearTieRef, Options, Policy, Real, Report,
};

/// Under a policy, the slack a margin gets beyond what its source row explains, relative to
/// max(1, |margin|): covers rounding of the subtraction and of the softmax (≈1e-7), and router
/// margins whose traces hold no `router.logits` (the fallback source is not the scores).
pub const MARGIN_SLACK: f64 = 1e-5;

/// Under a policy, the largest |reference − candidate| margin difference accepted for a row:
/// `2·d + MARGIN_SLACK·max(1, |a|, |b|)`, `d` the source row's divergence (0 without a source).
/// Why 2·d: the top-1 and top-2 (k-th, (k+1)-th) values of a row are order statistics, each
/// moving by at most the row's max |difference|, and a softmax moves no probability by more.
pub fn margin_tolerance(a: f32, b: f32, divergence: Option<f64>) -> f64 {
    let scale = 1f64.max((a as f64).abs()).max((b as f64).abs());
    2.0 * divergence.unwrap_or(0.0) + MARGIN_SLACK * scale
}

/// The tensor a decision was taken from, if the traces hold it: `logits` for `logits.argmax`;
/// `decode.SSSS.logits`, else `logits`, for `decode.SSSS.argmax`; `layer.NN.router.logits`,
/// else `layer.NN.hidden_in`, for `layer.NN.router.topk`; `X` for any other `X.argmax`.
pub fn source_tensor(name: &str, r: &Trace, c: &Trace) -> Option<String> {
    let both = |n: &str| r.tensor_info(n).is_some() && c.tensor_info(n).is_some();
    let n = Name::parse(name);
    let at = |point| Name { point, ..n }.to_string();
    let candidates: Vec<String> = match (n.decode_step, n.layer, n.point) {
        (Some(_), None, "argmax") => vec![at("logits"), "logits".into()],
        (_, Some(_), "router.topk") => vec![at("router.logits"), at("hidden_in")],
        _ => name
            .strip_suffix(".argmax")
            .map(|base| vec![base.to_string()])
            .unwrap_or_default(),
    };
    candidates.into_iter().find(|n| both(n))
}

/// Where a decision is taken in the reference's capture order: at its source; a router without
/// `router.logits` at `layer.NN.attn_out` when later than its fallback `hidden_in` (the router
/// reads `hidden_in + attn_out`); without a source, after every tensor.
fn taken_at(name: &str, source: Option<&str>, r: &Trace) -> usize {
    let Some(source) = source else {
        return usize::MAX;
    };
    let at = capture_index(r, source).unwrap_or(usize::MAX);
    let n = Name::parse(name);
    if n.layer.is_some() && n.point == "router.topk" && Name::parse(source).point == "hidden_in" {
        let attn_out = Name {
            point: "attn_out",
            ..n
        };
        capture_index(r, &attn_out.to_string()).map_or(at, |a| a.max(at))
    } else {
        at
    }
}

/// The step of a `decode.SSSS.argmax` decision.
fn decode_step(name: &str) -> Option<u64> {
    let n = Name::parse(name);
    match (n.decode_step, n.layer, n.point) {
        (Some(step), None, "argmax") => Some(step as u64),
        _ => None,
    }
}

/// The source row a decision row was taken from, as `(row, rows)` for [`range_divergence`]:
/// row `row` of `rows`; the first decode step without its own logits is the prompt's last
/// `logits` row (step 0 is the argmax of that row).
fn source_row(name: &str, source: &str, row: u64, rows: u64, r: &Trace) -> (u64, u64) {
    if decode_step(name) == Some(0) && source == "logits" {
        if let Some(&n) = r
            .tensor_info("logits")
            .and_then(|i| i.shape.first())
            .filter(|&&n| n > 0)
        {
            return (n - 1, n);
        }
    }
    (row, rows)
}

/// Whether `source` holds the decision's own scores, so that its divergence bounds how far a
/// margin can move. Not for a router's fallback `hidden_in` (an activation, not the router's
/// scores), nor for a decode step after the first without its own logits (the prompt's
/// `logits` did not produce it).
fn holds_scores(name: &str, source: &str) -> bool {
    if let Some(step) = decode_step(name) {
        step == 0 || source != "logits"
    } else if Name::parse(name).point == "router.topk" {
        Name::parse(source).point == "router.logits"
    } else {
        true
    }
}

/// The token position of a decision row: the source's `positions` entry when it has one per
/// decision row, else the row index; decode step s is the prompt's last position + s (step 0
/// decides from that position's logits).
fn row_position(name: &str, source: Option<&str>, row: u64, rows: u64, r: &Trace) -> Option<i64> {
    if let Some(step) = decode_step(name) {
        let logits = r.tensor_info("logits")?;
        let last = match &logits.attributes.positions {
            Some(p) => *p.last()?,
            None => (*logits.shape.first()? as i64).checked_sub(1)?,
        };
        return last.checked_add(step as i64);
    }
    let positions = source
        .and_then(|s| r.tensor_info(s))
        .and_then(|i| i.attributes.positions.as_ref())
        .filter(|p| p.len() as u64 == rows);
    Some(positions.map_or(row as i64, |p| p[row as usize]))
}

/// The reference gap a reordered row crossed: the largest score gap between two chosen values
/// whose order the candidate inverted, read from the reference's source row (`range`).
fn reorder_gap(r: &Trace, source: &str, range: (u64, u64), a: &[i64], b: &[i64]) -> Option<f64> {
    let info = r.tensor_info(source)?;
    let (start, end) = row_range(info, Some(range));
    let data = r.data(info);
    let score = |v: i64| {
        u64::try_from(v)
            .ok()
            .filter(|&i| i < end - start)
            .map(|i| numeric::element_value(info.dtype, data, start + i))
    };
    let rank = |v: i64| b.iter().position(|&x| x == v);
    let mut gap: Option<f64> = None;
    for (i, &hi) in a.iter().enumerate() {
        for &lo in &a[i + 1..] {
            if rank(hi) > rank(lo) {
                let g = (score(hi)? - score(lo)?).abs();
                gap = Some(gap.map_or(g, |x| x.max(g)));
            }
        }
    }
    gap
}

/// Labels a flip that does not come after a near-tie. `upstream`: some tensor up to the source
/// is outside the policy (differs, by bits); `gap`: the reference gap the flip crossed;
/// `bound`: `F·d` under a policy when the source holds the scores; `d`: the source row's
/// divergence. With `d = 0` the scores are bit-identical, so the decision rule itself differs.
pub fn label(upstream: bool, gap: Option<f64>, bound: Option<f64>, d: Option<f64>) -> Label {
    if upstream {
        return Label::Consequence;
    }
    match (gap, bound, d) {
        (Some(g), Some(b), Some(d)) if d > 0.0 && g <= b => Label::NearTie,
        _ => Label::Defect,
    }
}

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
    for rd in r.decisions().iter().filter(|i| opts.selects(&i.name)) {
        match c.decision_info(&rd.name) {
            None => slots.push(Slot::Missing),
            Some(cd) if rd.shape != cd.shape => slots.push(Slot::Shape(rd, cd)),
            Some(cd) => {
                let source = source_tensor(&rd.name, r, c);
                let at = taken_at(&rd.name, source.as_deref(), r);
                todo.push((at, slots.len(), rd, cd, source));
                slots.push(Slot::Compared(None));
            }
        }
    }
    todo.sort_by_key(|t| t.0);
    let mut ex = Excusal::new(r, c, policy);
    for (at, slot, rd, cd, source) in todo {
        let result = compare_one(r, c, rd, cd, source, at, policy, &mut ex, rep);
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

/// Compares one decision present in both traces with the same shape, row by row: equal rows by
/// their margins ([`Rows::margins`]), differing rows as labelled flips ([`Rows::flip`]).
#[allow(clippy::too_many_arguments)]
fn compare_one(
    r: &Trace,
    c: &Trace,
    rd: &DecisionInfo,
    cd: &DecisionInfo,
    source: Option<String>,
    at: usize,
    policy: Option<&Policy>,
    ex: &mut Excusal,
    rep: &mut Report,
) -> DecisionResult {
    let (rv, cv) = (r.decision_values(rd), c.decision_values(cd));
    let (rm, cm) = (r.decision_margins(rd), c.decision_margins(cd));
    let rows = rd.rows();
    let width = rd.count().checked_div(rows).unwrap_or(0) as usize;
    let mut out = DecisionResult {
        name: rd.name.clone(),
        shape: rd.shape.clone(),
        status: DecisionStatus::Identical,
        rows,
        differing_rows: 0,
        reordered_rows: 0,
        source: source.clone(),
        flips: Vec::new(),
        margins: match (&rm, &cm) {
            (None, None) => Margins::Absent,
            (Some(_), None) => Margins::ReferenceOnly,
            (None, Some(_)) => Margins::CandidateOnly,
            (Some(_), Some(_)) => Margins::Identical,
        },
        margin_differing_rows: 0,
        margin_outside_rows: 0,
        first_margin_difference: None,
        rows_after_near_tie: 0,
    };
    if width == 0 {
        return out;
    }
    let d = Rows {
        r,
        c,
        name: &rd.name,
        source: source.as_deref(),
        rows,
        at,
        step: decode_step(&rd.name),
        policy,
        margins: (rm.as_deref(), cm.as_deref()),
    };
    for (row, (a, b)) in rv.chunks(width).zip(cv.chunks(width)).enumerate() {
        let row = row as u64;
        let position = row_position(&rd.name, source.as_deref(), row, rows, r);
        // A row after a near-tie is not judged: its token took another, honest path.
        let after = ex.after(position, at, d.step).map(str::to_string);
        out.rows_after_near_tie += after.is_some() as u64;
        if a == b {
            // Equal choices: the margins must be equal too (a flipped row shows both instead).
            if let (Some(rm), Some(cm), None) = (&rm, &cm, &after) {
                d.margins(row, rm[row as usize], cm[row as usize], &mut out);
            }
            continue;
        }
        let flip = d.flip(row, (a, b), position, after, ex, rep);
        out.differing_rows += 1;
        out.reordered_rows += flip.same_values_different_order as u64;
        out.flips.push(flip);
    }
    ex.count_decision_rows(out.rows_after_near_tie);
    if out.differing_rows > 0 {
        out.status = DecisionStatus::Different;
    }
    if out.margin_outside_rows > 0 {
        out.margins = Margins::Different;
    } else if out.margin_differing_rows > 0 {
        out.margins = Margins::WithinTolerance;
    }
    out
}

/// One decision pair under comparison: what judging each of its rows reads.
struct Rows<'a> {
    r: &'a Trace,
    c: &'a Trace,
    name: &'a str,
    source: Option<&'a str>,
    rows: u64,
    /// Where the decision is taken in the reference's capture order ([`taken_at`]).
    at: usize,
    step: Option<u64>,
    policy: Option<&'a Policy>,
    /// Each side's margins, one a row.
    margins: (Option<&'a [f32]>, Option<&'a [f32]>),
}

impl Rows<'_> {
    /// The source tensor and the row of it that decision row `row` was taken from.
    fn src_row(&self, row: u64) -> Option<(&str, (u64, u64))> {
        self.source
            .map(|s| (s, source_row(self.name, s, row, self.rows, self.r)))
    }

    /// The source row's divergence ([`range_divergence`]).
    fn divergence(&self, row: u64) -> Option<f64> {
        self.src_row(row)
            .and_then(|(s, range)| range_divergence(self.r, self.c, s, Some(range)))
    }

    /// A row whose choices are equal: its margins `ma`, `mb` compared by bits, or under a
    /// policy within [`margin_tolerance`]; a difference is counted in `out`, and the first kept.
    fn margins(&self, row: u64, ma: f32, mb: f32, out: &mut DecisionResult) {
        if ma.to_bits() == mb.to_bits() {
            return;
        }
        out.margin_differing_rows += 1;
        let tolerance = self
            .policy
            .map(|_| margin_tolerance(ma, mb, self.divergence(row)));
        // NaN never lies within a tolerance; only equal bits match it.
        let outside = tolerance.is_none_or(|t| {
            !matches!(
                ((ma as f64) - (mb as f64)).abs().partial_cmp(&t),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            )
        });
        out.margin_outside_rows += outside as u64;
        // Keep the first row outside the tolerance, else the first that differs at all.
        let keep = match &out.first_margin_difference {
            None => true,
            Some(m) => outside && !m.outside,
        };
        if keep {
            out.first_margin_difference = Some(MarginDifference {
                row,
                reference: Real(ma as f64),
                candidate: Real(mb as f64),
                reference_bits: format!("{:#010x}", ma.to_bits()),
                candidate_bits: format!("{:#010x}", mb.to_bits()),
                tolerance: tolerance.map(Real),
                outside,
            });
        }
    }

    /// A row whose choices differ, labelled (docs/diff.md, "Labels"): `after` names the
    /// near-tie it follows, if any. A near-tie it finds, and the decode steps an excused flip
    /// sends down another sequence, are recorded in `ex`.
    fn flip(
        &self,
        row: u64,
        (a, b): (&[i64], &[i64]),
        position: Option<i64>,
        after: Option<String>,
        ex: &mut Excusal,
        rep: &mut Report,
    ) -> Flip {
        let mut sa = a.to_vec();
        let mut sb = b.to_vec();
        sa.sort_unstable();
        sb.sort_unstable();
        let reordered = sa == sb;
        let margin_of = |m: Option<&[f32]>| m.and_then(|m| m.get(row as usize).copied());
        let (ref_margin, cand_margin) = (margin_of(self.margins.0), margin_of(self.margins.1));
        let d = self.divergence(row);
        let scores = self
            .src_row(row)
            .filter(|(s, _)| holds_scores(self.name, s));
        // The margin is the gap between the k-th and (k+1)-th score: a reorder within the
        // chosen crossed another gap, which only the scores tell.
        let gap = match (reordered, scores) {
            (true, Some((s, range))) => reorder_gap(self.r, s, range, a, b),
            (true, None) => None,
            (false, _) => ref_margin.map(|m| (m as f64).abs()),
        };
        let bound = match (self.policy, scores, d) {
            (Some(p), Some(_), Some(d)) => Some(p.near_tie_factor() * d),
            _ => None,
        };
        let (label, upstream) = match &after {
            Some(_) => (Label::AfterNearTie, None),
            None => {
                let upstream = ex.upstream(rep, self.at);
                (label(upstream.is_some(), gap, bound, d), upstream)
            }
        };
        let origin = after
            .clone()
            .unwrap_or_else(|| format!("{} row {row}", self.name));
        if label == Label::NearTie {
            ex.near_tie(
                position,
                self.at,
                &origin,
                NearTieRef {
                    decision: self.name.to_string(),
                    row,
                    position: position.unwrap_or(row as i64),
                },
            );
        }
        // A different next token: every later decode step runs on another sequence.
        if label.excused() {
            let next = match self.step {
                Some(s) => Some(s + 1),
                None if self.name == "logits.argmax" && row + 1 == self.rows => Some(0),
                None => None,
            };
            if let Some(next) = next {
                ex.decode_from(next, &origin);
            }
        }
        Flip {
            row,
            reference: a.to_vec(),
            candidate: b.to_vec(),
            same_values_different_order: reordered,
            reference_margin: ref_margin.map(|m| Real(m as f64)),
            candidate_margin: cand_margin.map(|m| Real(m as f64)),
            source_divergence: d.map(Real),
            gap: gap.map(Real),
            noise_bound: bound.map(Real),
            label,
            upstream,
            after,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        // Upstream outside the policy wins over everything.
        assert_eq!(
            label(true, Some(1e-9), Some(1.0), Some(0.5)),
            Label::Consequence
        );
        assert_eq!(
            label(false, Some(1e-7), Some(2e-5), Some(1e-5)),
            Label::NearTie
        );
        assert_eq!(
            label(false, Some(2e-5), Some(2e-5), Some(1e-5)),
            Label::NearTie
        );
        assert_eq!(
            label(false, Some(2.1e-5), Some(2e-5), Some(1e-5)),
            Label::Defect
        );
        // Bit-identical scores: the rule differs, even for a tie.
        assert_eq!(label(false, Some(0.0), Some(0.0), Some(0.0)), Label::Defect);
        // No bound (no policy, or the source is not the scores), or no gap: no near-tie.
        assert_eq!(label(false, Some(1e-9), None, Some(1.0)), Label::Defect);
        assert_eq!(label(false, None, Some(1.0), Some(1.0)), Label::Defect);
        assert_eq!(
            label(false, Some(f64::NAN), Some(1.0), Some(1.0)),
            Label::Defect
        );
    }

    #[test]
    fn decode_steps() {
        assert_eq!(decode_step("decode.0000.argmax"), Some(0));
        assert_eq!(decode_step("decode.0012.argmax"), Some(12));
        assert_eq!(decode_step("logits.argmax"), None);
        assert!(holds_scores("decode.0000.argmax", "logits"));
        assert!(!holds_scores("decode.0001.argmax", "logits"));
        assert!(holds_scores("decode.0001.argmax", "decode.0001.logits"));
        assert!(holds_scores(
            "layer.00.router.topk",
            "layer.00.router.logits"
        ));
        assert!(!holds_scores("layer.00.router.topk", "layer.00.hidden_in"));
        assert!(holds_scores("logits.argmax", "logits"));
    }
}
