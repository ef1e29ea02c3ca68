//! How the decisions compared: the summary, one result per decision with its labelled flips,
//! the near-ties a policy excused, and the first decision divergence.

use serde::Serialize;

use crate::{DecisionStatus, Label, Margins, Real};

#[derive(Clone, Debug, Default, Serialize)]
pub struct DecisionSummary {
    pub reference_count: usize,
    pub candidate_count: usize,
    /// Decisions present in both with the same shape, compared value by value.
    pub compared: usize,
    /// How many of those differ in at least one row.
    pub differing: usize,
    pub missing: Vec<String>,
    pub extra: Vec<String>,
    pub results: Vec<DecisionResult>,
    /// Under a policy: the near-ties excused and the rows after them (null without a policy).
    pub near_ties: Option<NearTieSummary>,
    /// Under a policy: the first draw that differs between producers of different `rng`, the
    /// candidate not forced, and what was left out after it (docs/diff.md, "Sampling
    /// divergence"); null when there is none.
    pub sampling_divergence: Option<SamplingDivergence>,
}

/// The first draw (`init_canvas`, `sampled`, `renoise`, in recorded order) whose values differ
/// between traces of different `rng`, the candidate not forced: not a defect, and everything
/// after it computes on another canvas, so it is counted here and not judged.
#[derive(Clone, Debug, Serialize)]
pub struct SamplingDivergence {
    pub decision: String,
    pub block: u64,
    /// The step of a `sampled` or `renoise` draw; null for `init_canvas`.
    pub step: Option<u64>,
    /// The draw's rows whose values differ.
    pub rows: Vec<u64>,
    pub reference_rng: String,
    pub candidate_rng: String,
    /// Tensors captured after the draw that differ and were not judged (status
    /// `after_sampling_divergence`); a NaN or infinity difference stays judged and is not counted.
    pub tensors_not_judged: u64,
    /// Decisions taken after the draw (compared, not judged: neither values nor margins).
    pub decisions_not_judged: u64,
    /// Their rows.
    pub decision_rows_not_judged: u64,
}

/// What near-ties excused under a policy (docs/diff.md, "Near-ties under a policy"): nothing
/// is hidden, every excused flip and every row left out of the judgement is counted here.
#[derive(Clone, Debug, Default, Serialize)]
pub struct NearTieSummary {
    /// The factor F of the near-tie bound `|margin| ≤ F·d`.
    pub margin_factor: f64,
    /// Flips labelled near-tie, in capture order of their sources: they do not fail the verdict.
    pub excused: Vec<NearTieRef>,
    /// Tensors with token rows after a near-tie, left out of the bound judgement, in reference order.
    pub tensors: Vec<RowsAfter>,
    /// Decision rows after a near-tie (not judged: neither their values nor their margins).
    pub decision_rows: u64,
}

impl NearTieSummary {
    /// Token rows after a near-tie, tensors and decisions together.
    pub fn rows_after(&self) -> u64 {
        self.tensors.iter().map(|t| t.rows).sum::<u64>() + self.decision_rows
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct NearTieRef {
    pub decision: String,
    pub row: u64,
    /// The token position of the row (its source tensor's `positions`, else the row index).
    pub position: i64,
}

#[derive(Clone, Debug, Serialize)]
pub struct RowsAfter {
    pub tensor: String,
    /// Token rows (indices along the token axis) left out of the judgement.
    pub rows: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecisionResult {
    pub name: String,
    pub shape: Vec<u64>,
    pub status: DecisionStatus,
    pub rows: u64,
    pub differing_rows: u64,
    /// Differing rows holding the same values in another order (a reordered top-k).
    pub reordered_rows: u64,
    /// The tensor whose numbers this decision was taken from, when both traces have it.
    pub source: Option<String>,
    pub flips: Vec<Flip>,
    /// Margins of the rows whose values are equal.
    pub margins: Margins,
    /// Rows with equal values whose margins differ in bits.
    pub margin_differing_rows: u64,
    /// Of those, rows outside the policy's margin tolerance (all of them without a policy).
    pub margin_outside_rows: u64,
    /// The first row outside the tolerance, else the first whose margin bits differ.
    pub first_margin_difference: Option<MarginDifference>,
    /// Rows after a near-tie (policy only): neither their values nor their margins are judged.
    pub rows_after_near_tie: u64,
}

/// A margin that differs on a row whose decision values are equal.
#[derive(Clone, Debug, Serialize)]
pub struct MarginDifference {
    pub row: u64,
    pub reference: Real,
    pub candidate: Real,
    pub reference_bits: String,
    pub candidate_bits: String,
    /// The accepted |difference| under a policy (`decisions::margin_tolerance`); null when exact.
    pub tolerance: Option<Real>,
    pub outside: bool,
}

/// One differing decision row, labelled (docs/diff.md, "Labels").
#[derive(Clone, Debug, Serialize)]
pub struct Flip {
    pub row: u64,
    pub reference: Vec<i64>,
    pub candidate: Vec<i64>,
    pub same_values_different_order: bool,
    pub reference_margin: Option<Real>,
    pub candidate_margin: Option<Real>,
    /// Max |reference − candidate| over the source tensor's matching row (or whole tensor).
    pub source_divergence: Option<Real>,
    /// The reference gap the flip crossed: |reference margin|, or for a reordered row the
    /// largest gap in the reference's scores between two chosen values whose order inverted;
    /// null when unknown.
    pub gap: Option<Real>,
    /// The honest noise `d` of the decision's scores in this row: the noise reference's
    /// max |difference| from the reference there, else the policy's `near_tie.noise_abs`;
    /// null when neither measures it. Never the candidate's own divergence.
    pub honest_noise: Option<Real>,
    /// Where `honest_noise` came from: `noise_reference` or `policy`.
    pub honest_noise_from: Option<String>,
    /// Under a policy, `F·honest_noise` when the source row holds the decision's own scores;
    /// else null.
    pub noise_bound: Option<Real>,
    pub label: Label,
    /// For a consequence: the first tensor up to the source outside the policy (differing by
    /// bits without one).
    pub upstream: Option<String>,
    /// For a row after a near-tie: that near-tie, "DECISION row N".
    pub after: Option<String>,
    /// For a defect that no gap could excuse: why (a tensor up to the source left out by the
    /// filter, or a side whose own scores do not pick its choice).
    pub why: Option<String>,
}

impl Flip {
    /// A near-tie, or a row after one: under a policy it does not fail the verdict.
    pub fn excused(&self) -> bool {
        self.label.excused()
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct DecisionDivergence {
    pub name: String,
    pub row: u64,
    pub reference: Vec<i64>,
    pub candidate: Vec<i64>,
    pub same_values_different_order: bool,
    pub reference_margin: Option<Real>,
    pub candidate_margin: Option<Real>,
}
