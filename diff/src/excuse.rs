//! Rows after a near-tie (docs/diff.md, "Near-ties under a policy"). A flip labelled near-tie
//! sends its token down another path, as honest as the reference's, and everything that token
//! computes afterwards differs for no defect. So under a policy the token's rows in every
//! tensor captured after the decision's source, and its rows of later decisions, are left out
//! of the judgement; every other row is still judged, and every row left out is counted.

use std::collections::{BTreeSet, HashMap};

use tracegate_trace::{TensorInfo, Trace};

use crate::rows::{element, judge_row, noise_rows, set_stats, worst, TokenRows};
use crate::{
    noise, numeric, passes, positions, Finding, FindingKind, Flip, NearTieRef, NearTieSummary,
    Policy, Real, Report, RowStatus, RowsAfter, SamplingDivergence, TensorRow,
};

/// A tensor's capture index in `t`: the reader hands out references into its capture-ordered
/// index, so the place is the reference's offset in that slice (no name map for a million
/// tensors).
pub(crate) fn capture_index(t: &Trace, name: &str) -> Option<usize> {
    let info: *const TensorInfo = t.tensor_info(name)?;
    let all = t.tensors().as_ptr_range();
    all.contains(&info)
        .then(|| (info as usize - all.start as usize) / std::mem::size_of::<TensorInfo>())
}

/// The labelling state: which per-tensor rows are settled, the first of them outside the
/// policy, and the tokens and decode steps that come after a near-tie.
pub(crate) struct Excusal<'a> {
    r: &'a Trace,
    c: &'a Trace,
    policy: Option<&'a Policy>,
    /// The noise reference, measured again over the rows left in.
    noise: Option<&'a Trace>,
    /// `per_tensor` rows before this one are settled: their statuses are final.
    settled: usize,
    /// The first settled row outside the policy (differing, by bits, without one).
    first_bad: Option<usize>,
    /// Tokens after a near-tie: position, the capture index after which the token's rows are
    /// excused, and the near-tie ("DECISION row N").
    tokens: Vec<(i64, usize, String)>,
    /// Decode steps from this one on run on another sequence (a near-tie chose the token).
    decode_from: Option<(u64, String)>,
    summary: NearTieSummary,
    /// The sampling divergence (docs/diff.md, "Sampling divergence"): the draw, and what was
    /// left out after it.
    sampling: Option<SamplingDivergence>,
    /// Near-ties at a diffusion step's argmax, as (block, step, "DECISION row N"): the argmax
    /// canvas enters no tensor, only the stability of that step's and later steps' `stop`.
    argmax_near_ties: Vec<(usize, usize, String)>,
    /// The flips of every diffusion argmax, by decision name: a block's commit row takes its
    /// last step's argmax row's label.
    argmax_flips: HashMap<String, Vec<Flip>>,
}

impl<'a> Excusal<'a> {
    pub(crate) fn new(
        r: &'a Trace,
        c: &'a Trace,
        policy: Option<&'a Policy>,
        noise: Option<&'a Trace>,
    ) -> Self {
        let summary = NearTieSummary {
            margin_factor: policy.map_or(0.0, Policy::near_tie_factor),
            ..NearTieSummary::default()
        };
        Excusal {
            r,
            c,
            policy,
            noise,
            settled: 0,
            first_bad: None,
            tokens: Vec::new(),
            decode_from: None,
            summary,
            sampling: None,
            argmax_near_ties: Vec::new(),
            argmax_flips: HashMap::new(),
        }
    }

    /// From here on, what comes after the draw `s.decision` leaves the judgement.
    pub(crate) fn sampling_divergence(&mut self, s: SamplingDivergence) {
        self.sampling = Some(s);
    }

    /// The sampling divergence a tensor or decision name comes after, if any.
    pub(crate) fn after_sampling(&self, name: &str) -> Option<&str> {
        self.sampling
            .as_ref()
            .filter(|s| passes::after_draw(&s.decision, name))
            .map(|s| s.decision.as_str())
    }

    /// Whether `name` is the draw of the sampling divergence.
    pub(crate) fn is_sampling_draw(&self, name: &str) -> bool {
        self.sampling.as_ref().is_some_and(|s| s.decision == name)
    }

    /// Counts a decision of `rows` rows taken after the sampling divergence.
    pub(crate) fn count_after_sampling(&mut self, rows: u64) {
        if let Some(s) = self.sampling.as_mut() {
            s.decisions_not_judged += 1;
            s.decision_rows_not_judged += rows;
        }
    }

    /// A near-tie at row `row` of diffusion step `step` of block `block`'s argmax.
    pub(crate) fn argmax_near_tie(&mut self, block: usize, step: usize, origin: &str) {
        self.argmax_near_ties
            .push((block, step, origin.to_string()));
    }

    /// The argmax near-tie a `stop` of step `step` of block `block` comes after: one at this
    /// step or an earlier one of the block changes the argmax canvases its stability compares.
    pub(crate) fn stop_after(&self, block: usize, step: usize) -> Option<&str> {
        self.argmax_near_ties
            .iter()
            .find(|(b, s, _)| *b == block && *s <= step)
            .map(|t| t.2.as_str())
    }

    /// Keeps a diffusion argmax's flips for its block's commit.
    pub(crate) fn keep_argmax_flips(&mut self, name: &str, flips: &[Flip]) {
        self.argmax_flips.insert(name.to_string(), flips.to_vec());
    }

    /// The flip of row `row` of a diffusion argmax, if it flipped.
    pub(crate) fn argmax_flip(&self, name: &str, row: u64) -> Option<&Flip> {
        self.argmax_flips.get(name)?.iter().find(|f| f.row == row)
    }

    /// Settles every row captured at or before `until` and names the first of them outside the
    /// policy (differing, by bits, without one). Called in nondecreasing `until`: a near-tie
    /// excuses only rows captured after its own source, so a settled row never changes again.
    pub(crate) fn upstream(&mut self, rep: &mut Report, until: usize) -> Option<String> {
        while self.settled < rep.per_tensor.len() {
            let at =
                capture_index(self.r, &rep.per_tensor[self.settled].tensor).unwrap_or(usize::MAX);
            if at > until {
                break;
            }
            self.settle(rep, self.settled, at);
            let row = &rep.per_tensor[self.settled];
            let bad = match self.policy {
                // A tensor without a rule is unjudged: outside when its bits differ.
                Some(_) => {
                    matches!(row.status, RowStatus::OutsidePolicy | RowStatus::Rerouted)
                        || (row.status == RowStatus::NoRule && row.differing_elements != Some(0))
                }
                None => row.status != RowStatus::Identical,
            };
            if bad && self.first_bad.is_none() {
                self.first_bad = Some(self.settled);
            }
            self.settled += 1;
        }
        self.first_bad.map(|i| rep.per_tensor[i].tensor.clone())
    }

    /// The near-tie a decision row comes after: a decode step at or after `decode_from`, or a
    /// row whose token was excused by a near-tie captured before the decision's source `at`.
    pub(crate) fn after(
        &self,
        position: Option<i64>,
        at: usize,
        step: Option<u64>,
    ) -> Option<&str> {
        if let (Some(s), Some((from, origin))) = (step, &self.decode_from) {
            if s >= *from {
                return Some(origin);
            }
        }
        let p = position?;
        self.tokens
            .iter()
            .find(|(tp, after, _)| *tp == p && *after < at)
            .map(|t| t.2.as_str())
    }

    /// Records a near-tie at `position` of a decision whose source is at capture index `at`.
    pub(crate) fn near_tie(
        &mut self,
        position: Option<i64>,
        at: usize,
        origin: &str,
        excused: NearTieRef,
    ) {
        self.token_after(position, at, origin);
        self.excused(excused);
    }

    /// The token at `position` takes another path after capture index `at` (the near-tie
    /// `origin`): its rows of later tensors and decisions leave the judgement.
    pub(crate) fn token_after(&mut self, position: Option<i64>, at: usize, origin: &str) {
        if let Some(p) = position {
            self.tokens.push((p, at, origin.to_string()));
        }
    }

    /// Lists an excused near-tie.
    pub(crate) fn excused(&mut self, excused: NearTieRef) {
        self.summary.excused.push(excused);
    }

    /// Decode steps from `step` on come after the near-tie `origin`.
    pub(crate) fn decode_from(&mut self, step: u64, origin: &str) {
        if self.decode_from.as_ref().is_none_or(|(s, _)| step < *s) {
            self.decode_from = Some((step, origin.to_string()));
        }
    }

    pub(crate) fn count_decision_rows(&mut self, rows: u64) {
        self.summary.decision_rows += rows;
    }

    /// Settles every remaining row and puts the summary in the report (under a policy).
    pub(crate) fn finish(mut self, rep: &mut Report) {
        self.upstream(rep, usize::MAX);
        if self.policy.is_some() {
            rep.decisions.near_ties = Some(self.summary);
        }
        if let Some(s) = self.sampling {
            let step = s.step.map(|x| format!(" step {x}")).unwrap_or_default();
            rep.findings.push(Finding::new(
                FindingKind::SamplingDivergence,
                Some(&s.decision),
                format!(
                    "block {}{step}: rows {:?} differ between rng {:?} (reference) and {:?} (candidate), and the candidate was not forced: a sampling divergence, not a defect by itself. {} tensors, {} decisions after the sampling divergence at block {}{step}: not judged; force the candidate with --force-decisions REF to compare them",
                    s.block, s.rows, s.reference_rng, s.candidate_rng, s.tensors_not_judged, s.decisions_not_judged, s.block
                ),
            ));
            rep.decisions.sampling_divergence = Some(s);
        }
    }

    /// Judges row `j` (capture index `at`) again without the rows of tokens after a near-tie.
    fn settle(&mut self, rep: &mut Report, j: usize, at: usize) {
        let Some(policy) = self.policy else { return };
        if self.after_sampling(&rep.per_tensor[j].tensor).is_some() {
            if self.after_whole(rep, j, RowStatus::AfterSamplingDivergence) {
                if let Some(s) = self.sampling.as_mut() {
                    s.tensors_not_judged += 1;
                }
            }
            return;
        }
        let step = tracegate_trace::names::Name::parse(&rep.per_tensor[j].tensor).decode_step;
        if let (Some(s), Some((from, _))) = (step, &self.decode_from) {
            if s as u64 >= *from {
                if self.after_whole(rep, j, RowStatus::AfterNearTie) {
                    let row = &rep.per_tensor[j];
                    let rows = self
                        .r
                        .tensor_info(&row.tensor)
                        .and_then(|i| i.attributes.positions.as_ref())
                        .map_or(1, |p| p.len() as u64);
                    self.summary.tensors.push(RowsAfter {
                        tensor: row.tensor.clone(),
                        rows,
                    });
                }
                return;
            }
        }
        let excused: BTreeSet<i64> = self
            .tokens
            .iter()
            .filter(|(_, after, _)| *after < at)
            .map(|t| t.0)
            .collect();
        let row = &rep.per_tensor[j];
        // Identical stays identical without any rows; a tensor without a rule has nothing to re-judge.
        if excused.is_empty()
            || !matches!(
                row.status,
                RowStatus::WithinPolicy | RowStatus::OutsidePolicy | RowStatus::Rerouted
            )
        {
            return;
        }
        let (Some(ri), Some(ci)) = (
            self.r.tensor_info(&row.tensor),
            self.c.tensor_info(&row.tensor),
        ) else {
            return;
        };
        if let Some(pair) =
            numeric::Pair::new(ri.dtype, ci.dtype).filter(|_| positions::rerouted(ri, ci))
        {
            let (row, findings, left_out) =
                positions::judge(self.r, self.c, ri, ci, pair, Some(policy), &excused);
            rep.findings.retain(|f| {
                !(matches!(f.kind, FindingKind::Rerouted | FindingKind::OutsidePolicy)
                    && f.tensor() == Some(row.tensor.as_str()))
            });
            rep.findings.extend(findings);
            if left_out > 0 {
                self.summary.tensors.push(RowsAfter {
                    tensor: row.tensor.clone(),
                    rows: left_out,
                });
            }
            rep.per_tensor[j] = row;
            return;
        }
        let Some(rule) = row
            .rule
            .as_ref()
            .and_then(|x| policy.rules.get(x.index).map(|rule| (x.index, rule)))
        else {
            return;
        };
        // A tensor without token rows (a port's own capture point, whose layout may be
        // `[heads, tokens, …]`, or one without a position per row) has no rows to excuse:
        // reading its first axis as tokens could excuse a head whole, or a token before the
        // near-tie.
        let Some(layout) = TokenRows::of(ri) else {
            return;
        };
        let keep: Vec<bool> = layout
            .positions
            .iter()
            .map(|p| !excused.contains(p))
            .collect();
        let left_out = keep.iter().filter(|&&k| !k).count() as u64;
        if left_out == 0 {
            return;
        }
        let (rd, cd) = (self.r.data(ri), self.c.data(ci));
        let Some(pair) = numeric::Pair::new(ri.dtype, ci.dtype) else {
            return;
        };
        let kept = layout.ranges(&keep);
        let mut stats = numeric::Stats::default();
        for &range in &kept {
            stats = stats.merge(numeric::scan_range(pair, rd, cd, range, range));
        }
        let row: &mut TensorRow = &mut rep.per_tensor[j];
        // A non-finite difference is never excused (docs/diff.md, "Near-ties under a policy"):
        // no honest path after a near-tie makes a NaN or an infinity, so the whole tensor's
        // counts stay in its row and fail its rule, wherever they are.
        let whole = (row.nan_mismatch, row.nan_payload, row.infinity);
        set_stats(row, &stats);
        let hidden = (row.nan_mismatch, row.nan_payload, row.infinity) != whole;
        (row.nan_mismatch, row.nan_payload, row.infinity) = whole;
        // The median is measured once, over the whole first differing tensor.
        row.median_ulp = None;
        // The noise reference on the same rows as the candidate, or undefined; per token row
        // over the rows left in, so an excused row does not fail on its ratio.
        if let Some(r) = row.rule.as_mut().filter(|r| r.noise_rel_l2.is_some()) {
            let measured = self.noise.and_then(|n| noise::rel_l2(n, ri, rd, &kept));
            r.noise_rel_l2 = Some(measured.map(Real));
            r.noise_rows = match (self.noise, measured) {
                (Some(n), Some(_)) => Some(noise_rows(n, ri, pair, (rd, cd), Some(&keep))),
                _ => None,
            };
        }
        let finding = judge_row(row, rule.0, rule.1);
        if finding.is_some() {
            // The worst element is the first non-finite one, in an excused row when it is there.
            let whole_range = [(0, ri.element_count())];
            let ranges: &[(u64, u64)] = if hidden { &whole_range } else { &kept };
            row.worst_element = worst::locate_in(pair, rd, cd, ranges)
                .map(|i| Box::new(element(pair, &ri.shape, rd, cd, i)));
        }
        let name = row.tensor.clone();
        let old = rep.findings.iter().position(|f| {
            f.kind == FindingKind::OutsidePolicy && f.tensor() == Some(name.as_str())
        });
        match (old, finding) {
            (Some(i), Some(f)) => rep.findings[i] = f,
            (Some(i), None) => {
                rep.findings.remove(i);
            }
            (None, Some(f)) => rep.findings.push(f),
            (None, None) => {}
        }
        self.summary.tensors.push(RowsAfter {
            tensor: name,
            rows: left_out,
        });
    }

    /// Row `j` computes on another sequence or canvas as a whole: a decode step after a
    /// near-tie chose another token (`after_near_tie`), or a tensor after a sampling divergence
    /// (`after_sampling_divergence`); it leaves the judgement with `status`. A non-finite
    /// difference stays judged, as in `settle`; a bit-identical tensor stays identical and one
    /// without a rule stays a finding. True when the row was left out (the caller counts it).
    fn after_whole(&mut self, rep: &mut Report, j: usize, status: RowStatus) -> bool {
        let row = &mut rep.per_tensor[j];
        if !matches!(
            row.status,
            RowStatus::WithinPolicy | RowStatus::OutsidePolicy | RowStatus::Rerouted
        ) || row.nan_mismatch + row.nan_payload + row.infinity > 0
        {
            return false;
        }
        if self.r.tensor_info(&row.tensor).is_none() {
            return false;
        }
        row.status = status;
        row.violations = Box::default();
        row.worst_element = None;
        let name = row.tensor.clone();
        rep.findings.retain(|f| {
            !(matches!(f.kind, FindingKind::OutsidePolicy | FindingKind::Rerouted)
                && f.tensor() == Some(name.as_str()))
        });
        true
    }
}
