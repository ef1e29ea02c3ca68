//! The bisect report's types: what `run` returns, `render` prints and `--json` serialises.

use super::*;

// ------------------------------------------------------------------------------------------
// Report

/// How a tensor compared: the differ's row status, or for a common tensor of another dtype or
/// shape (no value row) the differ's finding kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CmpStatus {
    Row(RowStatus),
    Structure(FindingKind),
}

impl CmpStatus {
    /// Neither identical nor within the policy.
    pub fn is_bad(self) -> bool {
        match self {
            CmpStatus::Row(s) => !s.agrees(),
            CmpStatus::Structure(_) => true,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            CmpStatus::Row(s) => s.as_str(),
            CmpStatus::Structure(k) => k.as_str(),
        }
    }
}

impl std::fmt::Display for CmpStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.as_str())
    }
}

impl Serialize for CmpStatus {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

/// How a place first diverges: its values differ, or the differ states it as a finding (a
/// tensor or decision on one side only, margins, order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum How {
    Differs,
    Finding(FindingKind),
}

impl How {
    pub fn as_str(self) -> &'static str {
        match self {
            How::Differs => "differs",
            How::Finding(k) => k.as_str(),
        }
    }

    /// In words: "values differ", "missing from the candidate", ….
    pub fn words(self) -> String {
        match self {
            How::Differs => "values differ".into(),
            How::Finding(FindingKind::MissingTensor | FindingKind::MissingDecision) => {
                "missing from the candidate".into()
            }
            How::Finding(FindingKind::ExtraTensor | FindingKind::ExtraDecision) => {
                "only in the candidate".into()
            }
            How::Finding(k) => k.as_str().replace('_', " "),
        }
    }
}

impl Serialize for How {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

string_enum! {
    /// A layer's tensors in the whole runs.
    pub enum WholeRunState {
        Match = "match",
        Differs = "differs",
    }
}

string_enum! {
    /// A layer's isolation: the candidate's layer verb on the reference's input.
    pub enum Isolated {
        Match = "match",
        Wrong = "wrong",
        NotChecked = "not_checked",
        /// Not needed (see the layer's status).
        NotRun = "not_run",
    }
}

string_enum! {
    /// A layer's status from its isolation and its whole-run comparison.
    pub enum LayerStatus {
        Ok = "ok",
        Wrong = "wrong",
        Inherits = "inherits",
        /// Differs in the whole run, not isolated.
        Downstream = "downstream",
        NotChecked = "not_checked",
        /// Its layer verb disagrees with the candidate's own whole run.
        Inconsistent = "inconsistent",
    }
}

string_enum! {
    /// The candidate's layer verb on its own input vs its own whole run.
    pub enum SelfCheck {
        NotRun = "not_run",
        Consistent = "consistent",
        Inconsistent = "inconsistent",
        NotChecked = "not_checked",
    }
}

string_enum! {
    /// Where in a layer a stage sits.
    pub enum Block {
        Input = "input",
        Attention = "attention",
        Mlp = "mlp",
        MoeRouter = "moe_router",
        MoeExpert = "moe_expert",
        MoeCombine = "moe_combine",
        Moe = "moe",
        Residual = "residual",
        /// Outside the ordered capture points (an extra tensor, a structure finding).
        Other = "other",
    }
}

impl Block {
    pub fn words(self) -> &'static str {
        match self {
            Block::Input => "the layer verb did not take its input as given",
            Block::Attention => "attention block",
            Block::Mlp => "MLP block",
            Block::MoeRouter => "MoE router",
            Block::MoeExpert => "MoE expert",
            Block::MoeCombine => {
                "MoE combine (routing weights × expert outputs; router and experts match)"
            }
            Block::Moe => "MoE block",
            Block::Residual => "residual add (both blocks match; their sum with the input differs)",
            Block::Other => "other",
        }
    }
}

string_enum! {
    /// Whether the candidate re-ran with the reference's decisions.
    pub enum Forcing {
        /// `whole_run`, the isolation and the verdict are about the forced run.
        Forced = "forced",
        /// The candidate could not be forced (`reason`): everything is unforced.
        NotForced = "not_forced",
    }
}

string_enum! {
    /// Which element of an inconsistency is shown.
    pub enum Which {
        /// By bits: the first differing element.
        FirstDiffering = "first_differing",
        /// Under a policy: the worst element of the tensor outside it.
        WorstOutsidePolicy = "worst_outside_policy",
    }
}

string_enum! {
    /// Which layers the self-consistency check covers.
    pub enum Scope {
        /// Only a layer about to be blamed.
        FirstWrongLayer = "first_wrong_layer",
        /// `--all-layers`: every isolated layer.
        AllLayers = "all_layers",
    }
}

string_enum! {
    /// What was captured.
    pub enum Capture {
        Default = "default",
        Internals = "internals",
    }
}

string_enum! {
    /// A bisection's outcome (docs/bisect.md, "Verdicts").
    pub enum BisectVerdict {
        NothingWrong = "nothing_wrong",
        WrongLayer = "wrong_layer",
        InconsistentProducer = "inconsistent_producer",
        Accumulates = "accumulates",
        OutsideLayers = "outside_layers",
        DecisionsDiffer = "decisions_differ",
        StructureDiffers = "structure_differs",
        NotChecked = "not_checked",
        CachedDecodeDiffers = "cached_decode_differs",
        /// `--ranks N`: the merge refused the candidate's rank traces (a rank that skipped the
        /// carry, a slice at the wrong offset, an expert on two ranks or none), naming the rank.
        RankTracesRefused = "rank_traces_refused",
    }
}

/// The exit code of `cached_decode_differs` (docs/bisect.md, "Exit codes").
pub const CACHED_DECODE_EXIT: i32 = 6;

impl BisectVerdict {
    /// The exit status (docs/bisect.md, "Exit codes").
    pub fn exit_code(self) -> i32 {
        match self {
            BisectVerdict::NothingWrong => 0,
            BisectVerdict::NotChecked => 4,
            BisectVerdict::CachedDecodeDiffers => CACHED_DECODE_EXIT,
            BisectVerdict::WrongLayer
            | BisectVerdict::InconsistentProducer
            | BisectVerdict::Accumulates
            | BisectVerdict::OutsideLayers
            | BisectVerdict::DecisionsDiffer
            | BisectVerdict::StructureDiffers
            | BisectVerdict::RankTracesRefused => 1,
        }
    }
}

/// A verdict and its summary line.
pub type Said = (BisectVerdict, String);

#[derive(Clone, Debug, Serialize)]
pub struct TensorCmp {
    pub tensor: String,
    pub status: CmpStatus,
    pub differing_elements: Option<u64>,
    pub total_elements: u64,
    pub max_ulp: Option<u64>,
    pub rel_l2: Option<f64>,
    pub cosine: Option<f64>,
    /// ⟨c, r⟩ / ⟨r, r⟩ − 1 (docs/diff.md, "Scale error").
    pub scale_error: Option<f64>,
    /// Every bound of the tensor's rule that it broke (empty when within the policy or judged
    /// by bits): what puts an isolated layer outside the policy, named.
    pub violations: Vec<tracegate_diff::Violation>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecisionCmp {
    pub name: String,
    pub rows: u64,
    pub differing_rows: u64,
    /// Of those, rows a policy excused: near-ties and the rows after them (docs/diff.md, "Labels").
    pub excused_rows: u64,
}

impl DecisionCmp {
    /// Differing rows a near-tie does not excuse: only these make a decision diverge.
    pub fn judged_rows(&self) -> u64 {
        self.differing_rows - self.excused_rows
    }
}

/// The first element whose bits differ (whatever a policy says of it).
#[derive(Clone, Debug, Serialize)]
pub struct FirstBitDifference {
    pub tensor: String,
    pub coords: Vec<u64>,
    pub reference_value: String,
    pub candidate_value: String,
    pub ulp: Option<u64>,
    pub differing_elements: u64,
    pub total_elements: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct WholeRun {
    /// The differ's verdict on the two whole traces.
    pub verdict: Verdict,
    /// The first place that differs (or is outside policy, or is missing from one side):
    /// "embed.out", "layer.NN.*", or the head.
    pub first_diverging: Option<String>,
    pub first_diverging_how: Option<How>,
    pub first_diverging_layer: Option<usize>,
    /// Under a policy: the first tensor outside it, with its broken bounds and worst element.
    pub first_violation: Option<tracegate_diff::TensorViolation>,
    /// The first differing element (by bits, whatever the policy says).
    pub first_bit_difference: Option<FirstBitDifference>,
    pub differing_decisions: Vec<DecisionCmp>,
    /// The differ's other findings, each "kind name: detail" (structure: a tensor or decision
    /// on one side only, order; and notes such as expert rows set aside).
    pub findings: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct LayerRow {
    pub layer: usize,
    pub whole_run: WholeRunState,
    /// layer.NN.hidden_out in the whole runs.
    pub whole_max_ulp: Option<u64>,
    pub whole_rel_l2: Option<f64>,
    pub isolation: Isolated,
    /// layer.NN.hidden_out, candidate's layer verb on the reference's input vs the reference.
    pub isolated_max_ulp: Option<u64>,
    pub isolated_rel_l2: Option<f64>,
    pub isolated: Vec<TensorCmp>,
    pub isolated_decisions: Vec<DecisionCmp>,
    pub status: LayerStatus,
    pub reason: Option<String>,
    /// rel L2 of hidden_out after a 1-ULP perturbation of the calibration layer's input.
    pub calibration_rel_l2: Option<f64>,
    /// whole_rel_l2 / calibration_rel_l2.
    pub whole_vs_calibration: Option<f64>,
    /// isolated_rel_l2 / calibration_rel_l2 (at the calibration layer only: same input perturbed).
    pub isolated_vs_calibration: Option<f64>,
    /// self_consistency says why when not checked.
    pub self_check: SelfCheck,
    /// The largest ratio of this layer's isolated error to the median of the other matching
    /// isolated layers' (judge::OUTLIER_MEASURE; null: not checked, or zero medians);
    /// `suspicious`: flagged by the outlier check.
    pub peer_ratio: Option<f64>,
    pub suspicious: bool,
}

impl LayerRow {
    /// A layer nothing is known of yet: matching, not isolated, not checked.
    pub(crate) fn new(layer: usize) -> LayerRow {
        LayerRow {
            layer,
            whole_run: WholeRunState::Match,
            whole_max_ulp: None,
            whole_rel_l2: None,
            isolation: Isolated::NotRun,
            isolated_max_ulp: None,
            isolated_rel_l2: None,
            isolated: Vec::new(),
            isolated_decisions: Vec::new(),
            status: LayerStatus::Ok,
            reason: None,
            calibration_rel_l2: None,
            whole_vs_calibration: None,
            isolated_vs_calibration: None,
            self_check: SelfCheck::NotRun,
            peer_ratio: None,
            suspicious: false,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Stage {
    pub layer: usize,
    pub block: Block,
    pub tensor: String,
    pub detail: String,
    /// The capture points before it in this layer that match in isolation.
    pub matching: Vec<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct CalibrationRow {
    pub layer: usize,
    pub rel_l2: Option<f64>,
    pub max_ulp: u64,
    pub differing_elements: u64,
    pub total_elements: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Calibration {
    /// Run without `--calibrate`: judged by bits, a layer about to be blamed, a pair that is not
    /// two ordered producers; one layer only (the blamed one), to say whether it is rounding.
    pub automatic: bool,
    pub from_layer: usize,
    pub seed: u64,
    pub perturbation: String,
    pub input_rel_l2: Option<f64>,
    pub rows: Vec<CalibrationRow>,
    pub not_checked: Option<String>,
}

/// Judged by policy: each isolated layer's error against its own response to one ULP of the
/// candidate's precision at its input (docs/bisect.md, "Rounding response"). A defect under the
/// policy in every layer is named where its layer stands far above what that precision rounds.
#[derive(Clone, Debug, Serialize)]
pub struct RoundingResponse {
    /// The candidate's precision, whose ULP perturbs: f32, bf16 or f16.
    pub precision: &'static str,
    pub perturbation: String,
    /// RESPONSE_FACTOR: a layer whose ratio is above it is far above rounding.
    pub factor: f64,
    pub rows: Vec<ResponseRow>,
    /// The first layer whose ratio is above the factor (or whose reference did not move while
    /// the candidate differs: then `ratio` is null), and that ratio.
    pub first_far_above: Option<usize>,
    pub ratio: Option<f64>,
    pub not_checked: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ResponseRow {
    pub layer: usize,
    /// The block outputs read: attn_out, and mlp_out where the layer has no router (as the
    /// outlier check reads them).
    pub tensors: Vec<ResponseTensor>,
    /// The largest of the tensors' ratios; null where none is defined.
    pub ratio: Option<f64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct ResponseTensor {
    pub tensor: String,
    /// rel L2: the candidate's layer alone on the reference's input.
    pub isolated_rel_l2: Option<f64>,
    /// rel L2: the reference's layer alone on that input moved one ULP.
    pub response_rel_l2: Option<f64>,
    /// isolated / response; null where `undefined` says why.
    pub ratio: Option<f64>,
    pub undefined: Option<Undefined>,
}

string_enum! {
    /// Why a block output has no rounding-response ratio.
    pub enum Undefined {
        /// The reference's layer did not move with its input while the candidate's differs:
        /// no ratio bounds it, so the layer counts as far above.
        ZeroResponse = "zero_response",
        /// Neither moved: the candidate's layer is the reference's bit for bit there.
        BothZero = "both_zero",
        /// A rel L2 could not be measured (the tensor missing from the isolated run).
        NotMeasured = "not_measured",
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct UnforcedDecision {
    pub name: String,
    pub rows: u64,
    pub differing_rows: u64,
    /// How many of the differing rows trace-diff labels "consequence", "near-tie", "after-near-tie" or "defect".
    pub labels: std::collections::BTreeMap<Label, u64>,
}

/// Present when the whole runs' decisions differ: the candidate re-ran with the reference's
/// decisions (`--force-decisions`, docs/producers.md), so its numbers compare past the flips.
#[derive(Clone, Debug, Serialize)]
pub struct DecisionsForced {
    pub status: Forcing,
    pub reason: Option<String>,
    /// The reference whole trace the decisions came from, and its content digest.
    pub from: String,
    pub from_digest: String,
    /// The candidate's forced whole trace.
    pub candidate_trace: Option<String>,
    /// The unforced whole runs' differing decisions.
    pub unforced: Vec<UnforcedDecision>,
    /// From the forced trace's provenance: rows where the candidate would have decided otherwise
    /// given the reference's decisions upstream (a flip, not its consequences), in all and per
    /// decision.
    pub rows_overridden: Option<u64>,
    pub overridden: Option<serde_json::Value>,
    /// From the same provenance: the rows of each decision it would have decided otherwise
    /// (`{decision: [row, …]}`, as recorded).
    pub overridden_rows: Option<serde_json::Value>,
    /// Why its overrides were not judged (a record missing or contradicting itself, a row that
    /// could not be told), or null: then every argmax and router row it overrode was judged by
    /// its own margin (overrides.rs).
    pub overrides_not_checked: Option<String>,
    /// The argmax and router rows it overrode that its own numbers do not explain.
    pub overrides_unexplained: Vec<super::overrides::Unexplained>,
    /// Rows it overrode that are exact ties (a top-k in another order among equal scores), per
    /// decision: said, not failed.
    pub overrides_ties: std::collections::BTreeMap<String, u64>,
    /// Rows it overrode that are near-ties (a top-k in its own scores' order, which the
    /// reference's scores put within the honest-noise bound of theirs), per decision: said, not
    /// failed.
    pub overrides_near_ties: std::collections::BTreeMap<String, u64>,
    /// Every argmax and router row it overrode, judged: its own margin, the outcome, and for a
    /// top-k it ordered otherwise the near-tie rule's measures (overrides.rs).
    pub overrides_rows: Vec<super::overrides::JudgedRow>,
}

/// The first element of an inconsistency: by bits the first differing element, under a policy
/// the worst element of the tensor outside it.
#[derive(Clone, Debug, Serialize)]
pub struct ElementDiff {
    pub which: Which,
    pub coords: Vec<u64>,
    pub whole_run_value: String,
    pub layer_verb_value: String,
    pub ulp: Option<u64>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Inconsistency {
    pub layer: usize,
    /// The first capture point of the layer, in computation order, where the layer verb and the
    /// whole run disagree, and how.
    pub tensor: String,
    pub detail: String,
    pub element: Option<ElementDiff>,
    /// The candidate's layer verb on its own input.
    pub trace: String,
}

/// The candidate's `layer` verb on its own whole run's `layer.LL.hidden_in`, against that whole
/// run's `layer.LL.*`, judged as the pair is: bisect's isolation runs the layer verb, so a layer
/// verb that disagrees with its own whole run would be blamed for a body the engine does not run.
#[derive(Clone, Debug, Serialize)]
pub struct SelfConsistency {
    pub scope: Scope,
    pub checked_layers: Vec<usize>,
    /// The first layer whose layer verb disagrees with its own whole run.
    pub inconsistent: Option<Inconsistency>,
    /// Layers whose check could not run, each "layer NN: why".
    pub not_checked: Vec<String>,
}

/// A stored reference trace: the path as given, its verified content digest, its producer.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceTrace {
    pub path: String,
    pub digest: String,
    pub producer: String,
}
