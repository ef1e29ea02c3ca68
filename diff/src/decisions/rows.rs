//! One decision compared row by row: equal rows by their margins, differing rows as flips,
//! each labelled (docs/diff.md, "Labels").

use tracegate_trace::{DecisionInfo, Trace};

use tracegate_trace::names::Name;

use super::diffusion::{self, last_step};
use super::scores::{crossed_gap, margin_agrees, picks, Scores, MARGIN_SLACK};
use super::source::{decode_step, holds_scores, range_divergence, row_position, source_row};
use crate::excuse::Excusal;
use crate::passes::{self, Sampler};
use crate::{
    DecisionResult, DecisionStatus, Finding, FindingKind, Flip, Label, MarginDifference, Margins,
    NearTieRef, Policy, Real, Report,
};

/// Under a policy, the largest |reference − candidate| margin difference accepted for a row:
/// `2·d + MARGIN_SLACK·max(1, |a|, |b|)`, `d` the source row's divergence (0 without a source).
/// Why 2·d: the top-1 and top-2 (k-th, (k+1)-th) values of a row are order statistics, each
/// moving by at most the row's max |difference|, and a softmax moves no probability by more.
pub fn margin_tolerance(a: f32, b: f32, divergence: Option<f64>) -> f64 {
    let scale = 1f64.max((a as f64).abs()).max((b as f64).abs());
    2.0 * divergence.unwrap_or(0.0) + MARGIN_SLACK * scale
}

/// Labels a flip that does not come after a near-tie. `upstream`: some tensor up to the source
/// is outside the policy (differs, by bits); `no_excuse`: why the flip cannot be a near-tie
/// whatever its gap (a tensor up to the source left out by a filter, a side's scores that do
/// not pick its choice); `gap`: the gap the flip crossed in the reference's scores; `bound`:
/// `F·d` under a policy when the source holds the scores, `d` the honest noise of the row (a
/// noise reference's or the policy's, never the candidate's); `d`: the candidate's own
/// divergence in the source row, read only for a NaN or infinity there (which explains
/// nothing). A gap of 0 is an exact tie in the reference's scores: either choice is theirs.
pub fn label(
    upstream: bool,
    no_excuse: bool,
    gap: Option<f64>,
    bound: Option<f64>,
    d: Option<f64>,
) -> Label {
    if upstream {
        return Label::Consequence;
    }
    match (no_excuse, gap, bound, d) {
        (false, Some(g), Some(b), Some(d)) if d.is_finite() && b.is_finite() && g <= b => {
            Label::NearTie
        }
        _ => Label::Defect,
    }
}

/// Where a flip's honest noise `d` came from (docs/diff.md, "The near-tie rule").
#[derive(Clone, Copy)]
pub(super) enum NoiseFrom {
    NoiseReference,
    Policy,
}

impl NoiseFrom {
    pub(super) fn word(self) -> &'static str {
        match self {
            NoiseFrom::NoiseReference => "noise_reference",
            NoiseFrom::Policy => "policy",
        }
    }
}

/// The honest noise of the scores in `range` of the reference `r`'s tensor `source`: the noise
/// reference's max |difference| from the reference over the same elements (same shape and
/// positions), when it holds the source and that is finite and above 0; else the policy's
/// `near_tie.noise_abs` for the source. A measured 0 is no bound by itself (that precision
/// computes the row exactly: the policy's number is the floor). Never the candidate's own
/// difference (docs/diff.md, "The near-tie rule").
pub(super) fn honest_noise(
    r: &Trace,
    noise: Option<&Trace>,
    policy: Option<&Policy>,
    source: &str,
    range: (u64, u64),
) -> Option<(f64, NoiseFrom)> {
    let measured = noise.and_then(|n| {
        let (ri, ni) = (r.tensor_info(source)?, n.tensor_info(source)?);
        if ri.attributes.positions != ni.attributes.positions {
            return None;
        }
        range_divergence(r, n, source, Some(range))
    });
    match measured {
        Some(d) if d.is_finite() && d > 0.0 => Some((d, NoiseFrom::NoiseReference)),
        _ => policy?
            .near_tie_noise(source)
            .map(|d| (d, NoiseFrom::Policy)),
    }
}

/// What a comparison's filter left out, as the labels and margins need it: a left-out tensor
/// never excuses anything (docs/diff.md, "Filters").
pub(super) struct LeftOut<'a> {
    /// The first reference tensor in capture order the filter left out, with its index.
    pub first: Option<(usize, &'a str)>,
    /// Whether the decision's source tensor was compared.
    pub source_selected: bool,
    /// Whether the filter selects a name.
    pub selects: &'a dyn Fn(&str) -> bool,
}

/// What a row comes after, when it is not judged: a near-tie, or the sampling divergence.
#[derive(Clone)]
enum After {
    NearTie(String),
    Sampling(String),
}

/// Compares one decision present in both traces with the same shape, row by row: equal rows by
/// their margins ([`Rows::margins`]), differing rows as labelled flips ([`Rows::flip`]); every
/// recorded margin is checked against its own side's scores ([`Rows::check_margins`]).
#[allow(clippy::too_many_arguments)]
pub(super) fn compare_one(
    r: &Trace,
    c: &Trace,
    rd: &DecisionInfo,
    cd: &DecisionInfo,
    source: Option<String>,
    at: usize,
    left_out: LeftOut,
    (policy, noise): (Option<&Policy>, Option<&Trace>),
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
    let place = passes::place(&rd.name);
    let sampler = place.and_then(|p| p.sampler);
    let d = Rows {
        r,
        c,
        name: &rd.name,
        source: source.as_deref(),
        rows,
        at,
        step: decode_step(&rd.name),
        policy,
        noise,
        margins: (rm.as_deref(), cm.as_deref()),
        left_out,
        sampler,
        stable: (sampler == Some(Sampler::Stop))
            .then(|| rv.first().copied())
            .flatten(),
    };
    // Taken after the sampling divergence: every row computes on another canvas, not judged.
    let after_sampling = ex.after_sampling(&rd.name).map(str::to_string);
    if after_sampling.is_some() {
        ex.count_after_sampling(rows);
    }
    for (row, (a, b)) in rv.chunks(width).zip(cv.chunks(width)).enumerate() {
        let row = row as u64;
        let position = match diffusion::row_position(&rd.name, row, rows, r) {
            Some(p) => p,
            None => row_position(&rd.name, source.as_deref(), row, rows, r),
        };
        // A row after a near-tie is not judged: its token took another, honest path. A
        // `stop`'s stability (rows 0 and 2) reads the argmax canvases of its block's steps.
        let near = match (sampler, place) {
            (Some(Sampler::Stop), Some(p)) if row != 1 => ex
                .stop_after(p.block, p.step.unwrap_or(0))
                .map(str::to_string),
            _ => None,
        }
        .or_else(|| ex.after(position, at, d.step).map(str::to_string));
        let after = match (&after_sampling, near) {
            (Some(s), _) => Some(After::Sampling(s.clone())),
            (None, Some(n)) => {
                out.rows_after_near_tie += 1;
                Some(After::NearTie(n))
            }
            (None, None) => None,
        };
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
    d.check_margins(width, (&rv, &cv), rep);
    if sampler == Some(Sampler::Commit) {
        d.check_commit(width, (&rv, &cv), rep);
    }
    if sampler == Some(Sampler::Argmax) {
        ex.keep_argmax_flips(&rd.name, &out.flips);
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
    /// Where the decision is taken in the reference's capture order
    /// ([`taken_at`](super::source::taken_at)).
    at: usize,
    step: Option<u64>,
    policy: Option<&'a Policy>,
    /// The noise reference, which measures the honest noise of a flip's scores.
    noise: Option<&'a Trace>,
    /// Each side's margins, one a row.
    margins: (Option<&'a [f32]>, Option<&'a [f32]>),
    left_out: LeftOut<'a>,
    /// The sampler decision of a diffusion trace this is, if one.
    sampler: Option<Sampler>,
    /// For a `stop`: the reference's stability (row 0), which says what row 2's margin counts.
    stable: Option<i64>,
}

impl Rows<'_> {
    /// The source tensor and the row of it that decision row `row` was taken from.
    fn src_row(&self, row: u64) -> Option<(&str, (u64, u64))> {
        self.source
            .map(|s| (s, source_row(self.name, s, row, self.rows, self.r)))
    }

    /// The source row, when it holds the decision's own scores.
    fn scores_row(&self, row: u64) -> Option<(&str, (u64, u64))> {
        self.src_row(row)
            .filter(|(s, _)| holds_scores(self.name, s))
    }

    /// The honest noise of the scores in row `row` ([`honest_noise`]).
    fn honest_noise(&self, row: u64) -> Option<(f64, NoiseFrom)> {
        let (s, range) = self.scores_row(row)?;
        honest_noise(self.r, self.noise, self.policy, s, range)
    }

    fn router(&self) -> bool {
        Name::parse(self.name).point == "router.topk"
    }

    /// The source row's divergence ([`range_divergence`]).
    fn divergence(&self, row: u64) -> Option<f64> {
        self.src_row(row)
            .and_then(|(s, range)| range_divergence(self.r, self.c, s, Some(range)))
    }

    /// The divergence a margin's tolerance may use: only from a compared source that holds the
    /// decision's scores (a router's fallback `hidden_in` is in other units; a left-out tensor
    /// excuses nothing).
    fn margin_divergence(&self, row: u64) -> Option<f64> {
        if !self.left_out.source_selected {
            return None;
        }
        self.scores_row(row)
            .and_then(|(s, range)| range_divergence(self.r, self.c, s, Some(range)))
    }

    /// A router whose trace holds no `router.logits`: the policy's honest noise for those scores
    /// (`near_tie.noise_abs`), never the candidate's own difference. Without it an honest f32
    /// router margin, a probability gap, fails its tolerance deep in a model (1.5e-5 at layer 7
    /// of a clean 8-layer engine-vs-oracle pair, docs/diff.md "Margins").
    fn uncaptured_scores_noise(&self) -> Option<f64> {
        let scores = format!("{}router.logits", self.name.strip_suffix("router.topk")?);
        match self.r.tensor_info(&scores) {
            Some(_) => None,
            None => self.policy?.near_tie_noise(&scores),
        }
    }

    /// A row whose choices are equal: its margins `ma`, `mb` compared by bits, or under a
    /// policy within [`margin_tolerance`]; a difference is counted in `out`, and the first kept.
    fn margins(&self, row: u64, ma: f32, mb: f32, out: &mut DecisionResult) {
        if ma.to_bits() == mb.to_bits() {
            return;
        }
        out.margin_differing_rows += 1;
        // The sampler's margins are probabilities, nats and whole steps: their own tolerance.
        let tolerance = self.policy.map(|_| {
            diffusion::margin_tolerance(
                self.r,
                self.c,
                self.name,
                row,
                (ma, mb),
                self.stable,
                self.left_out.selects,
            )
            .unwrap_or_else(|| {
                let d = self
                    .margin_divergence(row)
                    .or_else(|| self.uncaptured_scores_noise());
                margin_tolerance(ma, mb, d)
            })
        });
        // A non-finite margin (or tolerance) is equal only by bits: ±inf minus anything finite
        // is never "within" an infinite tolerance, and NaN never lies within one.
        let outside = tolerance.is_none_or(|t| {
            !(ma.is_finite()
                && mb.is_finite()
                && t.is_finite()
                && ((ma as f64) - (mb as f64)).abs() <= t)
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

    /// Every recorded margin against the margin its own side's scores give its own choice
    /// (docs/diff.md, "The near-tie rule"): a margin is a claim about the scores, and one that
    /// contradicts them beyond rounding is a `margin_contradicts_scores` finding per side.
    fn check_margins(&self, width: usize, values: (&[i64], &[i64]), rep: &mut Report) {
        let router = self.router();
        for (side, t, margins, values) in [
            ("reference", self.r, self.margins.0, values.0),
            ("candidate", self.c, self.margins.1, values.1),
        ] {
            let Some(margins) = margins else { continue };
            let (mut count, mut first) = (0u64, None);
            for (row, chosen) in values.chunks(width).enumerate() {
                let Some((source, range)) = self.scores_row(row as u64) else {
                    continue;
                };
                let Some(scores) = Scores::of(t, source, range).filter(|s| s.len() > width as u64)
                else {
                    continue;
                };
                let got = margins[row] as f64;
                if let Some(Err(want)) = margin_agrees(&scores, chosen, router, got) {
                    count += 1;
                    first.get_or_insert((row, got, want, source.to_string()));
                }
            }
            if let Some((row, got, want, source)) = first {
                rep.findings.push(Finding::new(
                    FindingKind::MarginContradictsScores,
                    Some(self.name),
                    format!(
                        "the {side}'s recorded margins contradict its own {source} in {count} of {} rows; first at row {row}: recorded {got:e}, its scores give {want:e}{}",
                        self.rows,
                        if router { " (softmax probabilities)" } else { "" }
                    ),
                ));
            }
        }
    }

    /// The last argmax of the commit's block, when both sides ended the block at the same step.
    fn commit_argmax(&self) -> Result<String, String> {
        let p = passes::place(self.name).expect("a sampler decision has a place");
        match (last_step(self.r, p.block), last_step(self.c, p.block)) {
            (Some(x), Some(y)) if x == y => Ok(tracegate_trace::names::denoise(p.block, x, "argmax")),
            (x, y) => Err(format!(
                "the sides' last argmax of block {} differ (reference step {x:?}, candidate step {y:?}): no argmax row to take the label of",
                p.block
            )),
        }
    }

    /// The flip of the block's last argmax whose label commit row `row` takes: both sides'
    /// commit rows must be their own last argmax rows; else why the row is a defect.
    fn commit_inherits(
        &self,
        row: u64,
        (a, b): (&[i64], &[i64]),
        ex: &Excusal,
    ) -> Result<Flip, String> {
        let argmax = self.commit_argmax()?;
        for (side, t, own) in [("reference", self.r, a), ("candidate", self.c, b)] {
            if argmax_row(t, &argmax, row).as_deref() != Some(own) {
                return Err(format!(
                    "the {side}'s commit row is not its own {argmax} row: a reply taken from another canvas"
                ));
            }
        }
        ex.argmax_flip(&argmax, row).cloned().ok_or_else(|| {
            format!("{argmax} row {row} was not compared as a flip: nothing to take the label of")
        })
    }

    /// Each side's commit against its own last argmax (DG13.6), every row, flipped or not (a
    /// side without any argmax of the block has nothing to hold it to): a
    /// commit row that is not its own side's argmax row is a `commit_not_argmax` finding.
    fn check_commit(&self, width: usize, values: (&[i64], &[i64]), rep: &mut Report) {
        let p = passes::place(self.name).expect("a sampler decision has a place");
        for (side, t, values) in [
            ("reference", self.r, values.0),
            ("candidate", self.c, values.1),
        ] {
            // Each side against its own last step: the sides may end the block apart.
            let Some(argmax) = last_step(t, p.block)
                .map(|s| tracegate_trace::names::denoise(p.block, s, "argmax"))
            else {
                continue;
            };
            let bad: Vec<u64> = values
                .chunks(width)
                .enumerate()
                .filter(|(row, v)| argmax_row(t, &argmax, *row as u64).as_deref() != Some(*v))
                .map(|(row, _)| row as u64)
                .collect();
            if let Some(first) = bad.first() {
                rep.findings.push(Finding::new(
                    FindingKind::CommitNotArgmax,
                    Some(self.name),
                    format!(
                        "the {side}'s commit differs from its own {argmax} in {} of {} rows, first at row {first}: the committed canvas must be the last step's argmax canvas (docs/diffusion-gemma.md DG13.6)",
                        bad.len(),
                        self.rows
                    ),
                ));
            }
        }
    }

    /// Why a flip whose source holds the scores cannot be a near-tie, whatever its gap: a
    /// tensor up to the source was left out by a filter, or either side's scores do not pick
    /// that side's choice (a decision that does not follow its scores is a defect of its own).
    fn no_excuse(
        &self,
        scores: Option<(&str, (u64, u64))>,
        a: &[i64],
        b: &[i64],
    ) -> Option<String> {
        if let Some((_, name)) = self.left_out.first.filter(|(i, _)| *i <= self.at) {
            return Some(format!(
                "{name}, captured up to the source, was left out by the filter: a tensor not compared excuses nothing"
            ));
        }
        let (source, range) = scores?;
        for (side, t, chosen) in [("reference", self.r, a), ("candidate", self.c, b)] {
            let Some(s) = Scores::of(t, source, range) else {
                return Some(format!("the {side}'s {source} has no scores for this row"));
            };
            if let Err(e) = picks(&s, chosen, self.router()) {
                return Some(format!(
                    "the {side}'s own {source} row does not pick its choice: it {e}"
                ));
            }
        }
        None
    }

    /// A row whose choices differ, labelled (docs/diff.md, "Labels"): `after` names the
    /// near-tie it follows, if any. A near-tie it finds, and the decode steps an excused flip
    /// sends down another sequence, are recorded in `ex`.
    fn flip(
        &self,
        row: u64,
        (a, b): (&[i64], &[i64]),
        position: Option<i64>,
        after: Option<After>,
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
        let scores = self.scores_row(row);
        // The gap is read from the reference's own scores, never from a recorded margin: the
        // margin is a claim about the scores (checked in `check_margins`), and the candidate's
        // choice need not be the reference's runner-up.
        let gap = scores
            .and_then(|(s, range)| Scores::of(self.r, s, range))
            .and_then(|s| crossed_gap(&s, a, b));
        // The bound is the honest noise's (tracegate's noise run or the policy): a bound from the
        // candidate's own difference d would excuse any flip its own scores make, since such a
        // flip has gap <= 2d whatever d is (the proof below, docs/diff.md).
        let honest = self.honest_noise(row);
        let bound = match (self.policy, scores, honest) {
            (Some(p), Some(_), Some((h, _))) => Some(p.near_tie_factor() * h),
            _ => None,
        };
        // A commit row takes its block's last argmax row's label, measures and all (the
        // commit is that argmax, DG13.6), or is a defect when either side's is not its own.
        let inherited = match (&after, self.sampler) {
            (None, Some(Sampler::Commit)) => Some(self.commit_inherits(row, (a, b), ex)),
            _ => None,
        };
        let (d, gap, bound, honest_noise, honest_noise_from) = match &inherited {
            Some(Ok(f)) => (
                f.source_divergence.map(|x| x.0),
                f.gap.map(|x| x.0),
                f.noise_bound.map(|x| x.0),
                f.honest_noise,
                f.honest_noise_from.clone(),
            ),
            _ => (
                d,
                gap,
                bound,
                honest.map(|h| Real(h.0)),
                honest.map(|h| h.1.word().to_string()),
            ),
        };
        let (label, upstream, after, why) = match (after, inherited) {
            (Some(After::NearTie(s)), _) => (Label::AfterNearTie, None, Some(s), None),
            (Some(After::Sampling(s)), _) => (Label::AfterSamplingDivergence, None, Some(s), None),
            (None, Some(Ok(f))) => (f.label, f.upstream, f.after, f.why),
            (None, Some(Err(why))) => (Label::Defect, None, None, Some(why)),
            (None, None) if ex.is_sampling_draw(self.name) => {
                (Label::SamplingDivergence, None, None, None)
            }
            (None, None) => {
                let upstream = ex.upstream(rep, self.at);
                let no_excuse = match (self.policy, upstream.is_some()) {
                    (Some(_), false) => self.no_excuse(scores, a, b),
                    _ => None,
                };
                let label = label(upstream.is_some(), no_excuse.is_some(), gap, bound, d);
                // Under a policy, a flip on its scores with no honest noise to bound it says so.
                let unbounded = (self.policy.is_some()
                    && upstream.is_none()
                    && scores.is_some()
                    && honest.is_none())
                .then(|| {
                    format!(
                        "no honest noise bounds {}: no noise reference measures it and the policy's near_tie.noise_abs has no pattern for it",
                        scores.map(|s| s.0).unwrap_or_default()
                    )
                });
                (
                    label,
                    upstream,
                    None,
                    no_excuse.or(unbounded).filter(|_| label == Label::Defect),
                )
            }
        };
        let origin = after
            .clone()
            .unwrap_or_else(|| format!("{} row {row}", self.name));
        let near_tie_ref = || NearTieRef {
            decision: self.name.to_string(),
            row,
            position: position.unwrap_or(row as i64),
        };
        match (label, self.sampler) {
            // A diffusion argmax enters no tensor (the next canvas is drawn, DG13.4): its
            // near-tie excuses no token row, only the stability of its block's `stop`s and
            // the block's commit row, which takes this row's label.
            (Label::NearTie, Some(Sampler::Argmax)) => {
                let p = passes::place(self.name).expect("a sampler decision has a place");
                ex.argmax_near_tie(p.block, p.step.unwrap_or(0), &origin);
                ex.excused(near_tie_ref());
            }
            // A commit row that took its argmax's near-tie: the committed token differs, and
            // the commit pass computes on it.
            (Label::NearTie | Label::AfterNearTie, Some(Sampler::Commit)) => {
                let origin = after.clone().unwrap_or_else(|| {
                    let p = passes::place(self.name).expect("a sampler decision has a place");
                    let s = last_step(self.r, p.block).unwrap_or(0);
                    format!(
                        "{} row {row}",
                        tracegate_trace::names::denoise(p.block, s, "argmax")
                    )
                });
                ex.token_after(position, self.at, &origin);
            }
            (Label::NearTie, _) => {
                ex.near_tie(position, self.at, &origin, near_tie_ref());
            }
            _ => {}
        }
        // A different next token: every later decode step runs on another sequence.
        if label.excused() && self.sampler.is_none() {
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
            honest_noise,
            honest_noise_from,
            noise_bound: bound.map(Real),
            label,
            upstream,
            after,
            why,
        }
    }
}

/// Row `row` of decision `name` in `t`, when it holds one of that width.
fn argmax_row(t: &Trace, name: &str, row: u64) -> Option<Vec<i64>> {
    let info = t.decision_info(name)?;
    let width = info.count().checked_div(info.rows())? as usize;
    let v = t.decision_values(info);
    v.chunks(width.max(1))
        .nth(row as usize)
        .map(<[i64]>::to_vec)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels() {
        // Upstream outside the policy wins over everything.
        assert_eq!(
            label(true, false, Some(1e-9), Some(1.0), Some(0.5)),
            Label::Consequence
        );
        assert_eq!(
            label(false, false, Some(1e-7), Some(2e-5), Some(1e-5)),
            Label::NearTie
        );
        assert_eq!(
            label(false, false, Some(2e-5), Some(2e-5), Some(1e-5)),
            Label::NearTie
        );
        assert_eq!(
            label(false, false, Some(2.1e-5), Some(2e-5), Some(1e-5)),
            Label::Defect
        );
        // A reason that no gap can outweigh (a left-out tensor, scores that do not pick).
        assert_eq!(
            label(false, true, Some(1e-7), Some(2e-5), Some(1e-5)),
            Label::Defect
        );
        // An exact tie in the reference's scores is a tie, whoever broke it which way, even on
        // bit-identical scores.
        assert_eq!(
            label(false, false, Some(0.0), Some(0.0), Some(0.0)),
            Label::NearTie
        );
        // The candidate's own divergence no longer sizes the bound: a gap within the honest
        // bound is a near-tie whatever the candidate moved, a gap above it a defect however
        // far the candidate moved its scores.
        assert_eq!(
            label(false, false, Some(1e-4), Some(2e-4), Some(9.0)),
            Label::NearTie
        );
        assert_eq!(
            label(false, false, Some(8.8), Some(2e-4), Some(4.9)),
            Label::Defect
        );
        // No bound (no policy, or the source is not the scores), or no gap: no near-tie.
        assert_eq!(
            label(false, false, Some(1e-9), None, Some(1.0)),
            Label::Defect
        );
        assert_eq!(
            label(false, false, None, Some(1.0), Some(1.0)),
            Label::Defect
        );
        assert_eq!(
            label(false, false, Some(f64::NAN), Some(1.0), Some(1.0)),
            Label::Defect
        );
        // A non-finite divergence (a NaN or infinity differs in the source) explains nothing.
        assert_eq!(
            label(
                false,
                false,
                Some(8.0),
                Some(f64::INFINITY),
                Some(f64::INFINITY)
            ),
            Label::Defect
        );
    }
}
