//! `gate bisect`: find the first layer whose *body* is wrong, not just the first layer whose
//! output differs. Both producers write whole traces; then the candidate's `layer` verb runs
//! each layer alone on the **reference's** input to that layer, so a layer that matches in
//! isolation but differs in the whole run has inherited its difference from upstream. Within the
//! first wrong layer the capture points name the first wrong sub-stage. `--calibrate` chains the
//! reference's own layer verb over a 1-ULP perturbation of its input, to say how large the
//! candidate's difference is next to rounding noise. Before a layer body is blamed, the
//! candidate's layer verb is checked against its own whole run (`inconsistent_producer`). How it
//! judges, the rounding-level reading and the outlier flag: bisect_judge.rs. Report schema:
//! docs/bisect.md, docs/bisect-report.schema.json.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::json;
use tracegate_diff::{
    compare, string_enum, FindingKind, Label, Options, Policy, Report, RowStatus, Verdict,
};
use tracegate_trace::names::{self, Name};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

use crate::bisect_judge::{self as judge, Ask, By, Judge, Outliers, RoundingLevel};
use crate::producer::{Producer, RunRecord, Verb};
use crate::{gerr, Result};

/// The report's format (docs/bisect.md, docs/bisect-report.schema.json).
pub const SCHEMA: &str = "tracegate-bisect/3";

#[derive(Clone, Debug)]
pub struct BisectOptions {
    pub root: PathBuf,
    pub model: String,
    pub tokens: Vec<i64>,
    pub prompt: Option<String>,
    pub reference: Producer,
    pub candidate: Producer,
    /// Judge by this policy (`--policy`); None: see `exact`.
    pub policy: Option<String>,
    /// `--exact`: judge by bits. Neither: by bits for two ordered producers, else by the bundled
    /// policy for the candidate's precision (bisect_judge.rs).
    pub exact: bool,
    pub all_layers: bool,
    pub internals: bool,
    pub calibrate: bool,
    pub seed: u64,
    /// `--generate N`: decode steps in the whole runs, bisected after the prefill (bisect_decode.rs).
    pub generate: usize,
    /// Where the traces go, relative to root; kept for inspection.
    pub work: String,
    /// Each producer run is killed after this long, and the bisection refused.
    pub timeout: std::time::Duration,
    pub gate_invocation: Vec<String>,
}

/// `engine|contract|oracle|cmd` plus an optional template into a producer; usage errors as values.
pub fn producer(
    root: &Path,
    kind: &str,
    template: Option<&str>,
    side: &str,
    threads: usize,
) -> Result<Producer> {
    let cmd = |name: &str, default: String| Producer::command(name, template.unwrap_or(&default));
    match (kind, template) {
        ("engine", None) => Ok(Producer::Engine { threads }),
        ("engine", Some(_)) => Err(gerr!("--{side}-cmd: the engine is built into the gate and takes no command; use --{side} cmd to run a command")),
        ("contract", _) => cmd("contract", crate::run::default_contract_cmd(root)),
        ("oracle", _) => cmd("oracle", crate::run::default_oracle_cmd(root)),
        ("cmd", Some(_)) => cmd(&format!("{side}-cmd"), String::new()),
        ("cmd", None) => Err(gerr!("--{side} cmd needs --{side}-cmd 'TEMPLATE' (e.g. 'my-engine {{verb}} {{args}}')")),
        (other, _) => Err(gerr!("--{side} {other:?}: expected engine, contract, oracle or cmd")),
    }
}

/// Whether a producer is one of the built-in ordered ones (docs/numerics.md): the engine, or the
/// contract run by its own command. A replaced command is the user's producer.
pub fn is_ordered(root: &Path, p: &Producer) -> bool {
    match p {
        Producer::Engine { .. } => true,
        Producer::Command { name, words, .. } => {
            name == "contract"
                && matches!(Producer::command("contract", &crate::run::default_contract_cmd(root)), Ok(Producer::Command { words: w, .. }) if w == *words)
        }
    }
}

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
    }
}

impl BisectVerdict {
    /// The exit status (docs/bisect.md, "Exit codes").
    pub fn exit_code(self) -> i32 {
        match self {
            BisectVerdict::NothingWrong => 0,
            BisectVerdict::NotChecked => 4,
            BisectVerdict::CachedDecodeDiffers => crate::bisect_decode::CACHED_DECODE_EXIT,
            BisectVerdict::WrongLayer
            | BisectVerdict::InconsistentProducer
            | BisectVerdict::Accumulates
            | BisectVerdict::OutsideLayers
            | BisectVerdict::DecisionsDiffer
            | BisectVerdict::StructureDiffers => 1,
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
    /// isolated layers' (bisect_judge::OUTLIER_MEASURE; null: not checked, or zero medians);
    /// `suspicious`: flagged by the outlier check.
    pub peer_ratio: Option<f64>,
    pub suspicious: bool,
}

impl LayerRow {
    /// A layer nothing is known of yet: matching, not isolated, not checked.
    fn new(layer: usize) -> LayerRow {
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

#[derive(Clone, Debug, Serialize)]
pub struct BisectReport {
    pub schema: &'static str,
    pub summary: String,
    pub verdict: BisectVerdict,
    /// `verdict`'s exit status.
    pub exit_code: i32,
    pub model: String,
    pub prompt: Option<String>,
    pub tokens: Vec<i64>,
    pub reference: String,
    pub candidate: String,
    /// How it judged and why (the first line of the text verdict).
    pub judge: Judge,
    pub capture: Capture,
    pub layers_total: usize,
    /// Whether the candidate's decisions were forced from the reference's (null: they agreed).
    pub decisions_forced: Option<DecisionsForced>,
    pub whole_run: WholeRun,
    /// `--timeout`: seconds each producer run may take.
    pub timeout_s: u64,
    pub first_wrong_layer: Option<usize>,
    pub stage: Option<Stage>,
    pub layers: Vec<LayerRow>,
    /// Geometric mean growth of the whole-run hidden_out rel L2 per layer, over differing layers.
    pub amplification_per_layer: Option<f64>,
    pub calibration: Option<Calibration>,
    /// `--generate N`: the decode steps (bisect_decode.rs); null without it.
    pub decode: Option<crate::bisect_decode::DecodeReport>,
    /// Judged by bits with a calibrated blamed layer: whether its difference is rounding level.
    pub rounding_level: Option<RoundingLevel>,
    pub self_consistency: SelfConsistency,
    pub outliers: Outliers,
    pub work_dir: String,
    pub runs: Vec<RunRecord>,
    pub gate_invocation: Vec<String>,
}

// ------------------------------------------------------------------------------------------
// Helpers

fn is_oracle(t: &Trace) -> bool {
    tracegate_diff::comparable::is_oracle(t.provenance())
}

/// Where a capture point sits: -1 embed, NN a layer, i64::MAX the head (final norm, logits, decode).
fn location(name: &str) -> i64 {
    if name.starts_with("embed.") {
        return -1;
    }
    let n = Name::parse(name);
    match (n.decode_step, n.layer) {
        (None, Some(l)) => l as i64,
        _ => i64::MAX,
    }
}

pub(crate) fn rows(rep: &Report) -> Vec<TensorCmp> {
    rep.per_tensor
        .iter()
        .map(|r| TensorCmp {
            tensor: r.tensor.clone(),
            status: CmpStatus::Row(r.status),
            differing_elements: r.differing_elements,
            total_elements: r.total_elements,
            max_ulp: r.max_ulp,
            rel_l2: r.rel_l2.map(|x| x.0),
            cosine: r.cosine.map(|x| x.0),
        })
        // A common tensor of another dtype or shape gets no value row; it differs all the same.
        .chain(
            rep.findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::DtypeMismatch | FindingKind::ShapeMismatch
                    )
                })
                .map(|f| TensorCmp {
                    tensor: f.tensor().unwrap_or_default().to_string(),
                    status: CmpStatus::Structure(f.kind),
                    differing_elements: None,
                    total_elements: 0,
                    max_ulp: None,
                    rel_l2: None,
                    cosine: None,
                }),
        )
        .collect()
}

pub(crate) fn decisions(rep: &Report) -> Vec<DecisionCmp> {
    rep.decisions
        .results
        .iter()
        .map(|d| DecisionCmp {
            name: d.name.clone(),
            rows: d.rows,
            differing_rows: d.differing_rows,
            excused_rows: d.flips.iter().filter(|f| f.excused()).count() as u64,
        })
        .collect()
}

pub(crate) fn open(root: &Path, rel: &str) -> Result<Trace> {
    Trace::open(root.join(rel)).map_err(|e| gerr!("{rel}: {e}"))
}

pub use tracegate_diff::thousands;

pub(crate) fn sci(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(0.0) => "0".into(),
        Some(v) => format!("{v:.2e}"),
    }
}

pub(crate) fn ulps(x: Option<u64>) -> String {
    x.map(thousands).unwrap_or_else(|| "-".into())
}

fn ratio(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(v) if v >= 10.0 => format!("{}×", thousands(v.round() as u64)),
        Some(v) => format!("{v:.2}×"),
    }
}

/// "00-01", "03", or "00, 02" for a set of layers (sorted).
fn span(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            format!("{:02}", layers[i])
        } else {
            format!("{:02}-{:02}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// "layer 03 inherits" / "layers 03-04 inherit".
pub(crate) fn say(layers: &[usize], one: &str, many: &str) -> String {
    if layers.len() == 1 {
        format!("layer {} {one}", span(layers))
    } else {
        format!("layers {} {many}", span(layers))
    }
}

/// rel L2 (vs `reference`), max ULP and differing count: trace-diff's measures
/// (`tracegate_diff::measures`, docs/diff.md "Measures"), the ones the layer rows carry, since
/// calibration divides those by these. NaN and infinity pairs are counted there, not summed; a
/// row whose differing pairs are all NaN pairs (no distance) has max ULP 0 here.
pub fn f32_stats(
    reference: &[f32],
    candidate: &[f32],
) -> std::result::Result<CalibrationRow, String> {
    let m =
        tracegate_diff::measures::measure_f32(reference, candidate).map_err(|e| e.to_string())?;
    Ok(CalibrationRow {
        layer: 0,
        rel_l2: m.rel_l2(),
        max_ulp: m.max_ulp().unwrap_or(0),
        differing_elements: m.differing(),
        total_elements: m.total(),
    })
}

/// Moves every finite element one ULP up or down in magnitude, the direction from a seeded
/// splitmix64 stream, so the calibration is reproducible bit for bit.
fn perturb(data: &[f32], seed: u64) -> Vec<f32> {
    let mut s = seed;
    data.iter()
        .map(|&x| {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            let up = (z ^ (z >> 31)) & 1 == 1;
            let b = x.to_bits();
            let mag = b & 0x7fff_ffff;
            if !x.is_finite() {
                x
            } else if mag == 0 {
                f32::from_bits(b | 1) // ±0 → ±smallest subnormal
            } else if up && mag < 0x7f7f_ffff {
                f32::from_bits(b + 1)
            } else {
                f32::from_bits(b - 1)
            }
        })
        .collect()
}

// ------------------------------------------------------------------------------------------
// Isolation

pub(crate) struct Isolation {
    pub tensors: Vec<TensorCmp>,
    pub decisions: Vec<DecisionCmp>,
    pub wrong: bool,
    pub report: Report,
    /// The candidate's layer trace.
    pub out: String,
}

/// Where one isolation reads and writes: the whole trace whose `layer.LL.hidden_in` is the
/// input and whose `layer.LL.*` the output is compared with (the reference's, or for the
/// self-consistency check the candidate's own), and the file names under the work dir.
struct Source<'a> {
    trace: &'a Trace,
    rel: &'a str,
    /// "the reference's" / "its own whole run's", for messages.
    whose: &'a str,
    /// The candidate's layer trace and the rewritten slice, `{stem}.LL.trace`.
    out_stem: &'a str,
    slice_stem: &'a str,
}

/// The reference's whole-run `layer.LL.*` tensors (those the candidate's layer trace also has)
/// rewritten with path=layer, so the differ compares them with the candidate's layer verb
/// under its usual rules (positions and masks must still agree).
pub(crate) fn write_slice(reference: &Trace, cand: &Trace, layer: usize, out: &Path) -> Result<()> {
    let pfx = names::layer_prefix(layer);
    let mut prov = reference.provenance().clone();
    if let Some(o) = prov.as_object_mut() {
        o.insert(
            "bisect_slice".into(),
            json!({ "layer": layer, "from": reference.path().display().to_string() }),
        );
    }
    let mut w = TraceWriter::create(out, prov).map_err(|e| gerr!("{}: {e}", out.display()))?;
    let same_rows = |name: &str, a: &Attributes| {
        cand.tensor_info(name)
            .is_some_and(|c| !name.contains(".expert.") || c.attributes.positions == a.positions)
    };
    // A candidate forced from the reference marks its tensors forced=<the reference's digest>;
    // this slice stands for that reference, so it carries the same mark.
    let digest = reference.digest().hex();
    for info in reference
        .tensors()
        .iter()
        .filter(|t| t.name.starts_with(&pfx) && same_rows(&t.name, &t.attributes))
    {
        let mut attrs = Attributes {
            path: Some("layer".into()),
            ..info.attributes.clone()
        };
        if cand
            .tensor_info(&info.name)
            .is_some_and(|c| c.attributes.extra.get("forced") == Some(&digest))
        {
            attrs.extra.insert("forced".into(), digest.clone());
        }
        w.tensor(
            &info.name,
            info.dtype,
            &info.shape,
            reference.data(info),
            &attrs,
        )
        .map_err(|e| gerr!("{}: {e}", out.display()))?;
    }
    for d in reference
        .decisions()
        .iter()
        .filter(|d| d.name.starts_with(&pfx) && cand.decision_info(&d.name).is_some())
    {
        let margins = reference.decision_margins(d);
        w.decision(
            &d.name,
            &d.shape,
            &reference.decision_values(d),
            margins.as_deref(),
        )
        .map_err(|e| gerr!("{}: {e}", out.display()))?;
    }
    w.finish().map_err(|e| gerr!("{}: {e}", out.display()))?;
    Ok(())
}

/// The candidate's layer verb on `src`'s input to `layer`, compared with `src`'s own outputs.
/// `forced`: the layer verb takes `src`'s router choices too.
fn isolate(
    o: &BisectOptions,
    src: &Source,
    layer: usize,
    policy: &Option<Policy>,
    forced: bool,
    runs: &mut Vec<RunRecord>,
) -> std::result::Result<Isolation, String> {
    let out = format!("{}/{}.{layer:02}.trace", o.work, src.out_stem);
    let verb = Verb::Layer {
        model: o.model.clone(),
        layer,
        input: src.rel.into(),
        input_name: names::layer(layer, "hidden_in"),
        out,
        internals: o.internals,
        force: forced.then(|| src.rel.to_string()),
        decode_from: None,
    };
    let slice_rel = format!("{}/{}.{layer:02}.trace", o.work, src.slice_stem);
    isolate_with(
        o,
        &verb,
        layer,
        &slice_rel,
        src.whose,
        policy,
        runs,
        |cand, out| write_slice(src.trace, cand, layer, out),
    )
}

/// Runs the candidate's layer `verb` and compares its trace with the reference's rows of that
/// layer, which `slice` writes (given the candidate's trace) to `slice_rel`; `whose` names
/// their source in messages ("the reference's").
#[allow(clippy::too_many_arguments)] // one call site per verb kind; a struct would only rename them
pub(crate) fn isolate_with(
    o: &BisectOptions,
    verb: &Verb,
    layer: usize,
    slice_rel: &str,
    whose: &str,
    policy: &Option<Policy>,
    runs: &mut Vec<RunRecord>,
    slice: impl FnOnce(&Trace, &Path) -> Result<()>,
) -> std::result::Result<Isolation, String> {
    let rec = o.candidate.run(&o.root, verb, o.timeout);
    runs.push(rec.clone());
    if !rec.ok {
        return Err(format!(
            "the candidate's layer verb failed: {} ($ {})",
            rec.why()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" | "),
            rec.invocation
        ));
    }
    let cand = open(&o.root, verb.out()).map_err(|e| e.to_string())?;
    for need in ["attn_out", "mlp_out", "hidden_out"] {
        let name = names::layer(layer, need);
        if cand.tensor_info(&name).is_none() {
            return Err(format!("the candidate's layer trace has no {name}"));
        }
    }
    slice(&cand, &o.root.join(slice_rel)).map_err(|e| e.to_string())?;
    let slice = open(&o.root, slice_rel).map_err(|e| e.to_string())?;
    let rep = compare(
        &slice,
        &cand,
        &Options {
            all: true,
            policy: policy.clone(),
            ..Options::default()
        },
    );
    if matches!(rep.verdict, Verdict::Incomparable | Verdict::Unreadable) {
        let why: Vec<String> = rep.findings.iter().map(describe).collect();
        return Err(format!(
            "the candidate's layer trace is not comparable with {}: {}",
            whose,
            why.join("; ")
        ));
    }
    let tensors = rows(&rep);
    let decisions = decisions(&rep);
    let wrong =
        tensors.iter().any(|t| t.status.is_bad()) || decisions.iter().any(|d| d.judged_rows() > 0);
    Ok(Isolation {
        tensors,
        decisions,
        wrong,
        report: rep,
        out: verb.out().to_string(),
    })
}

/// A layer's row before isolation: `differs` in the whole run, `h` its hidden_out there.
pub(crate) fn layer_row(layer: usize, differs: bool, h: Option<&TensorCmp>) -> LayerRow {
    LayerRow {
        whole_run: if differs {
            WholeRunState::Differs
        } else {
            WholeRunState::Match
        },
        whole_max_ulp: h.and_then(|t| t.max_ulp),
        whole_rel_l2: h.and_then(|t| t.rel_l2),
        ..LayerRow::new(layer)
    }
}

pub(crate) fn fill_isolated(row: &mut LayerRow, iso: Isolation) {
    let h = iso
        .tensors
        .iter()
        .find(|t| t.tensor == names::layer(row.layer, "hidden_out"));
    row.isolated_max_ulp = h.and_then(|t| t.max_ulp);
    row.isolated_rel_l2 = h.and_then(|t| t.rel_l2);
    row.isolation = if iso.wrong {
        Isolated::Wrong
    } else {
        Isolated::Match
    };
    row.isolated = iso.tensors;
    row.isolated_decisions = iso.decisions;
}

/// A layer's status from its isolation and its whole-run comparison.
pub(crate) fn layer_status(isolation: Isolated, whole_run: WholeRunState) -> LayerStatus {
    match (isolation, whole_run) {
        (Isolated::Wrong, _) => LayerStatus::Wrong,
        (Isolated::NotChecked, _) => LayerStatus::NotChecked,
        (Isolated::Match, WholeRunState::Differs) => LayerStatus::Inherits,
        (Isolated::NotRun, WholeRunState::Differs) => LayerStatus::Downstream,
        (Isolated::Match | Isolated::NotRun, WholeRunState::Match) => LayerStatus::Ok,
    }
}

/// Where the layer verb and the whole run disagree first (`stage` names the capture point) and
/// the element that shows it: by bits the first differing one, under a policy the worst.
fn inconsistency(layer: usize, iso: &Isolation, moe: bool) -> Inconsistency {
    let probe = LayerRow {
        isolated: iso.tensors.clone(),
        isolated_decisions: iso.decisions.clone(),
        ..LayerRow::new(layer)
    };
    let s = stage(layer, &probe, moe, "differs from the whole run");
    let rep = &iso.report;
    let first = rep
        .first_divergence
        .as_ref()
        .filter(|d| d.tensor == s.tensor && rep.policy.is_none())
        .map(|d| ElementDiff {
            which: Which::FirstDiffering,
            coords: d.coords.clone(),
            whole_run_value: d.reference_value.clone(),
            layer_verb_value: d.candidate_value.clone(),
            ulp: d.ulp,
        });
    let worst = || {
        rep.per_tensor
            .iter()
            .find(|r| r.tensor == s.tensor)
            .and_then(|r| r.worst_element.as_ref())
            .map(|e| ElementDiff {
                which: Which::WorstOutsidePolicy,
                coords: e.coords.clone(),
                whole_run_value: e.reference_value.clone(),
                layer_verb_value: e.candidate_value.clone(),
                ulp: e.ulp,
            })
    };
    Inconsistency {
        layer,
        element: first.or_else(worst),
        tensor: s.tensor,
        detail: s.detail,
        trace: iso.out.clone(),
    }
}

/// The first wrong capture point of a layer in isolation, in computation order; `differs`:
/// how a wrong one is said ("differs in isolation").
pub(crate) fn stage(layer: usize, row: &LayerRow, moe: bool, differs: &str) -> Stage {
    let pfx = names::layer_prefix(layer);
    let short = |n: &str| n.strip_prefix(&pfx).unwrap_or(n).to_string();
    let mut order: Vec<(String, Block)> = [
        "hidden_in",
        "q",
        "k",
        "v",
        "attn_probs",
        "attn_out",
        "router.logits",
    ]
    .iter()
    .map(|s| {
        (
            format!("{pfx}{s}"),
            if *s == "hidden_in" {
                Block::Input
            } else if s.starts_with("router") {
                Block::MoeRouter
            } else {
                Block::Attention
            },
        )
    })
    .collect();
    order.push((format!("{pfx}router.topk"), Block::MoeRouter));
    let mut experts: Vec<String> = row
        .isolated
        .iter()
        .map(|t| t.tensor.clone())
        .filter(|n| n.starts_with(&format!("{pfx}expert.")))
        .collect();
    experts.sort();
    order.extend(experts.into_iter().map(|n| (n, Block::MoeExpert)));
    let has_router = row.isolated.iter().any(|t| {
        t.tensor.starts_with(&format!("{pfx}router."))
            || t.tensor.starts_with(&format!("{pfx}expert."))
    });
    let mlp_block = if !moe {
        Block::Mlp
    } else if has_router {
        Block::MoeCombine
    } else {
        Block::Moe
    };
    order.push((format!("{pfx}mlp_out"), mlp_block));
    order.push((format!("{pfx}hidden_out"), Block::Residual));

    let mut matching = Vec::new();
    for (name, block) in order {
        if let Some(d) = row.isolated_decisions.iter().find(|d| d.name == name) {
            if d.judged_rows() > 0 {
                let detail = format!(
                    "{} {differs} ({}/{} rows choose other experts)",
                    short(&name),
                    d.differing_rows,
                    d.rows
                );
                return Stage {
                    layer,
                    block,
                    tensor: name,
                    detail,
                    matching,
                };
            }
            matching.push(short(&name));
        } else if let Some(t) = row.isolated.iter().find(|t| t.tensor == name) {
            if t.status.is_bad() {
                let how = if t.status == CmpStatus::Row(RowStatus::Different) {
                    String::new()
                } else {
                    format!(", {}", t.status.as_str().replace('_', " "))
                };
                let detail = format!(
                    "{} {differs} ({}/{} elements, max {} ULP, rel L2 {}{how})",
                    short(&name),
                    thousands(t.differing_elements.unwrap_or(0)),
                    thousands(t.total_elements),
                    ulps(t.max_ulp),
                    sci(t.rel_l2)
                );
                return Stage {
                    layer,
                    block,
                    tensor: name,
                    detail,
                    matching,
                };
            }
            matching.push(short(&name));
        }
    }
    // Only something outside the ordered capture points differs (an extra tensor, a structure finding).
    let other = row
        .isolated
        .iter()
        .find(|t| t.status.is_bad())
        .map(|t| t.tensor.clone())
        .unwrap_or_default();
    Stage {
        layer,
        block: Block::Other,
        detail: format!("{} {differs}", short(&other)),
        tensor: other,
        matching,
    }
}

fn is_moe(t: &Trace, layer: usize) -> bool {
    t.decision_info(&names::layer(layer, "router.topk"))
        .is_some()
}

/// The self-consistency check (`SelfConsistency`), lazily: only the first layer wrong in
/// isolation, the one about to be blamed (a clean run costs nothing), or under `--all-layers`
/// every isolated layer (one more layer-verb run each). Sets each checked row's `self_check`.
fn self_check(
    o: &BisectOptions,
    own: &Trace,
    own_rel: &str,
    layers: &mut [LayerRow],
    policy: &Option<Policy>,
    forced: bool,
    runs: &mut Vec<RunRecord>,
) -> SelfConsistency {
    let mut sc = SelfConsistency {
        scope: if o.all_layers {
            Scope::AllLayers
        } else {
            Scope::FirstWrongLayer
        },
        checked_layers: Vec::new(),
        inconsistent: None,
        not_checked: Vec::new(),
    };
    let todo: Vec<usize> = if o.all_layers {
        layers
            .iter()
            .filter(|r| matches!(r.isolation, Isolated::Match | Isolated::Wrong))
            .map(|r| r.layer)
            .collect()
    } else {
        layers
            .iter()
            .find(|r| r.isolation == Isolated::Wrong)
            .map(|r| r.layer)
            .into_iter()
            .collect()
    };
    let src = Source {
        trace: own,
        rel: own_rel,
        whose: "its own whole run's",
        out_stem: "candidate.self.layer",
        slice_stem: "candidate.slice.layer",
    };
    crate::progress::plan(todo.len() as u64);
    for l in todo {
        match isolate(o, &src, l, policy, forced, runs) {
            Ok(iso) => {
                sc.checked_layers.push(l);
                layers[l].self_check = if iso.wrong {
                    SelfCheck::Inconsistent
                } else {
                    SelfCheck::Consistent
                };
                if iso.wrong && sc.inconsistent.is_none() {
                    sc.inconsistent = Some(inconsistency(l, &iso, is_moe(own, l)));
                }
            }
            Err(why) => {
                layers[l].self_check = SelfCheck::NotChecked;
                sc.not_checked.push(format!("layer {l:02}: {why}"));
            }
        }
        crate::progress::step(format_args!(
            "layer {l:02} against the candidate's own whole run: {}",
            layers[l].self_check
        ));
        if runs.last().is_some_and(|r| r.timed_out) {
            break; // refused right after
        }
    }
    sc
}

/// No layer body is blamed: the first layer about to be is one whose layer verb disagrees with
/// the candidate's own whole run, so its isolation would judge the probe, not the engine.
fn inconsistent_verdict(i: &Inconsistency, layers: &[LayerRow], whole: &WholeRun) -> Said {
    let element = i
        .element
        .as_ref()
        .map(|e| {
            let which = match e.which {
                Which::FirstDiffering => "first differing element",
                Which::WorstOutsidePolicy => "worst element outside the policy",
            };
            format!(
                "; {which} {:?}: whole run {} vs layer verb {} ({} ULP)",
                e.coords,
                e.whole_run_value,
                e.layer_verb_value,
                ulps(e.ulp)
            )
        })
        .unwrap_or_default();
    let others: Vec<usize> = layers
        .iter()
        .filter(|r| r.status == LayerStatus::Inconsistent && r.layer != i.layer)
        .map(|r| r.layer)
        .collect();
    let also = if others.is_empty() {
        String::new()
    } else {
        format!("; {}", say(&others, "disagrees too", "disagree too"))
    };
    (
        BisectVerdict::InconsistentProducer,
        format!(
            "the candidate's layer verb disagrees with its own whole run at layer {:02}: {}{element}{also}; no layer body is blamed (isolation runs the layer verb, which here is not what the whole run computes); the whole runs are {}",
            i.layer,
            i.detail,
            whole.verdict.as_str().replace('_', " ")
        ),
    )
}

/// "layer 01 suspicious: isolated error 3.10× its peers' median (rel L2 of …; flagged above 2×; not a failure)".
fn suspicious_words(layers: &[LayerRow], out: &Outliers) -> String {
    let each: Vec<String> = out
        .suspicious
        .iter()
        .map(|&l| {
            let r = &layers[l];
            let how = r
                .peer_ratio
                .map(|x| format!("{} its peers' median", ratio(Some(x))))
                .unwrap_or_else(|| "above zero, its peers' median (bit-exact)".into());
            format!("layer {l:02} suspicious: isolated error {how}")
        })
        .collect();
    format!(
        "{} (rel L2 of {}; flagged above {}×; not a failure)",
        each.join("; "),
        out.measure,
        out.factor
    )
}

// ------------------------------------------------------------------------------------------
// Calibration

/// The reference's layer verb chained over a 1-ULP perturbation of layer `from`'s input, up to
/// (not including) layer `upto`.
fn calibrate(
    o: &BisectOptions,
    reference: &Trace,
    from: usize,
    upto: usize,
    runs: &mut Vec<RunRecord>,
) -> Calibration {
    let mut cal = Calibration {
        automatic: !o.calibrate,
        from_layer: from,
        seed: o.seed,
        perturbation: format!("every finite element of {} moved one f32 ULP up or down in magnitude (splitmix64, seed {})", names::layer(from, "hidden_in"), o.seed),
        input_rel_l2: None,
        rows: Vec::new(),
        not_checked: None,
    };
    let name = names::layer(from, "hidden_in");
    let input_rel = format!("{}/calibration.input.trace", o.work);
    let written = (|| -> Result<Option<f64>> {
        let info = reference
            .tensor_info(&name)
            .ok_or_else(|| gerr!("the reference has no {name}"))?;
        if info.dtype != DType::F32 {
            return Err(gerr!("{name} is {}, calibration perturbs f32", info.dtype));
        }
        let x = reference.f32_slice(&name).map_err(|e| gerr!("{e}"))?;
        let y = perturb(x, o.seed);
        let mut prov = reference.provenance().clone();
        if let Some(p) = prov.as_object_mut() {
            p.insert(
                "bisect_calibration".into(),
                json!({ "layer": from, "seed": o.seed }),
            );
        }
        let path = o.root.join(&input_rel);
        let mut w = TraceWriter::create(&path, prov).map_err(|e| gerr!("{input_rel}: {e}"))?;
        w.tensor_f32(&name, &info.shape, &y, &info.attributes)
            .map_err(|e| gerr!("{input_rel}: {e}"))?;
        w.finish().map_err(|e| gerr!("{input_rel}: {e}"))?;
        Ok(f32_stats(x, &y).map_err(|e| gerr!("{name}: {e}"))?.rel_l2)
    })();
    match written {
        Ok(r) => cal.input_rel_l2 = r,
        Err(e) => {
            cal.not_checked = Some(e.0);
            return cal;
        }
    }
    // The reference's own layer verb, chained: each layer's hidden_out is the next one's input.
    let (mut input, mut input_name) = (input_rel, name);
    crate::progress::plan((upto - from) as u64);
    for layer in from..upto {
        let out = format!("{}/calibration.layer.{layer:02}.trace", o.work);
        let verb = Verb::Layer {
            model: o.model.clone(),
            layer,
            input,
            input_name,
            out: out.clone(),
            internals: false,
            force: None,
            decode_from: None,
        };
        let rec = o.reference.run(&o.root, &verb, o.timeout);
        runs.push(rec.clone());
        crate::progress::step(format_args!(
            "calibration: layer {layer:02} on the perturbed input"
        ));
        let hidden = names::layer(layer, "hidden_out");
        let got = if rec.ok {
            open(&o.root, &out).map_err(|e| e.0)
        } else {
            Err(format!("the reference's layer verb failed: {}", rec.why()))
        };
        let stats = got.and_then(|t| {
            let c = t.f32_slice(&hidden).map_err(|e| e.to_string())?;
            let r = reference.f32_slice(&hidden).map_err(|e| e.to_string())?;
            if c.len() != r.len() {
                return Err(format!(
                    "{hidden}: {} elements vs {} in the reference",
                    c.len(),
                    r.len()
                ));
            }
            f32_stats(r, c)
        });
        match stats {
            Ok(row) => cal.rows.push(CalibrationRow { layer, ..row }),
            Err(e) => {
                cal.not_checked = Some(format!("layer {layer:02}: {e}"));
                return cal;
            }
        }
        (input, input_name) = (out, hidden);
    }
    cal
}

// ------------------------------------------------------------------------------------------
// The bisection

pub fn run(o: &BisectOptions) -> Result<BisectReport> {
    crate::prompts::check_fits(
        &o.root,
        &o.model,
        o.prompt.as_deref(),
        o.tokens.len(),
        o.generate,
    )?;
    let _lock = crate::WorkLock::acquire(&o.root.join(&o.work))?;
    let _progress = crate::progress::start("bisect", 1);
    let ref_rel = format!("{}/reference.trace", o.work);
    let cand_rel = format!("{}/candidate.trace", o.work);
    let trace = |p: &Producer, out: &str, force: Option<String>| {
        p.run(
            &o.root,
            &Verb::Trace {
                model: o.model.clone(),
                tokens: o.tokens.clone(),
                out: out.into(),
                internals: o.internals,
                generate: o.generate,
                cache: true,
                force,
            },
            o.timeout,
        )
    };
    // Both whole runs at once: one is usually a subprocess.
    let (rr, cr) = std::thread::scope(|s| {
        let h = s.spawn(|| trace(&o.candidate, &cand_rel, None));
        (
            trace(&o.reference, &ref_rel, None),
            h.join().expect("candidate thread"),
        )
    });
    let mut runs = vec![rr.clone(), cr.clone()];
    crate::progress::step("whole runs of the reference and the candidate");
    for (side, rec) in [("reference", &rr), ("candidate", &cr)] {
        if !rec.ok {
            return Err(gerr!(
                "{side} ({}) trace failed: {}\n    $ {}",
                rec.producer,
                rec.why(),
                rec.invocation
            ));
        }
    }
    let reference = open(&o.root, &ref_rel)?;
    let candidate = open(&o.root, &cand_rel)?;

    // By bits for two ordered producers, else by the policy for the candidate's precision,
    // unless --exact or --policy says otherwise. An oracle's provenance is never ordered.
    let ask = match (o.exact, &o.policy) {
        (true, Some(p)) => {
            return Err(gerr!(
                "--exact judges by bits and --policy {p} by a policy: give one"
            ))
        }
        (true, None) => Ask::Exact,
        (false, Some(p)) => Ask::Policy(p.clone()),
        (false, None) => Ask::Default,
    };
    let ordered = (
        is_ordered(&o.root, &o.reference) && !is_oracle(&reference),
        is_ordered(&o.root, &o.candidate) && !is_oracle(&candidate),
    );
    let (judge, policy) = judge::choose(
        &ask,
        (&o.reference.name(), &o.candidate.name()),
        ordered,
        &candidate,
        &o.root,
    )?;

    // The decode steps are bisected after the prefill, step by step (bisect_decode.rs).
    let opts = Options {
        all: true,
        policy: policy.clone(),
        filter: crate::bisect_decode::prefill_filter(o.generate),
        ..Options::default()
    };
    let mut whole = compare_whole(&reference, &candidate, &opts)?;
    // A decision differs no later than the first differing tensor (by layer), so it may be what
    // makes the numbers differ: compare them past the flips, on the candidate forced to take the
    // reference's decisions (docs/producers.md). A flip after the numbers already diverged is
    // their consequence and changes nothing upstream. A candidate that cannot be forced is said so.
    let first_tensor = rows(&whole)
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| location(&t.tensor))
        .min();
    let first_flip = whole
        .decisions
        .results
        .iter()
        .filter(|d| d.differing_rows > 0)
        .map(|d| location(&d.name))
        .min();
    let decisions_forced = if first_flip.is_some_and(|f| first_tensor.is_none_or(|t| f <= t)) {
        let unforced = whole
            .decisions
            .results
            .iter()
            .filter(|d| d.differing_rows > 0)
            .map(|d| {
                let mut labels = std::collections::BTreeMap::new();
                for f in &d.flips {
                    *labels.entry(f.label).or_insert(0) += 1;
                }
                UnforcedDecision {
                    name: d.name.clone(),
                    rows: d.rows,
                    differing_rows: d.differing_rows,
                    labels,
                }
            })
            .collect();
        let forced_rel = format!("{}/candidate.forced.trace", o.work);
        let rec = trace(&o.candidate, &forced_rel, Some(ref_rel.clone()));
        runs.push(rec.clone());
        crate::progress::step("candidate traced with the reference's decisions forced");
        refuse_timeout(&runs, o)?;
        let mut f = DecisionsForced {
            status: Forcing::NotForced,
            reason: None,
            from: ref_rel.clone(),
            from_digest: reference.digest().hex(),
            candidate_trace: None,
            unforced,
            rows_overridden: None,
            overridden: None,
        };
        match forced_run(o, &reference, &rec, &forced_rel, &opts) {
            Ok((rep, t)) => {
                let prov = &t.provenance()["forced_decisions"];
                f.rows_overridden = prov["rows_overridden"].as_u64();
                f.overridden = Some(prov["overridden"].clone());
                f.status = Forcing::Forced;
                f.candidate_trace = Some(forced_rel);
                whole = rep;
            }
            Err(why) => f.reason = Some(why),
        }
        Some(f)
    } else {
        None
    };
    let forced = decisions_forced
        .as_ref()
        .is_some_and(|f| f.status == Forcing::Forced);
    let whole_rows = rows(&whole);
    let whole_decisions = decisions(&whole);
    let n = reference
        .tensors()
        .iter()
        .filter_map(|t| {
            let n = Name::parse(&t.name);
            (n.decode_step.is_none() && n.point == "hidden_out").then_some(n.layer?)
        })
        .map(|l| l + 1)
        .max()
        .unwrap_or(0);

    // The first diverging place, in computation order (tensors in reference order, then decisions by location).
    let mut diverging: Vec<(i64, String, How)> = whole_rows
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| (location(&t.tensor), t.tensor.clone(), How::Differs))
        .collect();
    diverging.extend(
        whole_decisions
            .iter()
            .filter(|d| d.judged_rows() > 0)
            .map(|d| (location(&d.name), d.name.clone(), How::Differs)),
    );
    // What the differ states as a finding rather than as values (a tensor or decision on one
    // side only, another order): divergence too, so the headline never calls runs matching while
    // the body lists their differences.
    let structure: Vec<&tracegate_diff::Finding> = whole
        .findings
        .iter()
        .filter(|f| is_structure(f.kind))
        .collect();
    // A decision whose values agree but whose margins do not diverges in value, not structure.
    // Forced decisions agree by construction, and their margins say where the candidate would
    // have decided otherwise: that is `decisions_forced`, not a place to bisect numbers from.
    let margins = whole
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::MarginDiffers && !forced);
    for f in structure.iter().copied().chain(margins) {
        if let Some(t) = f
            .tensor()
            .filter(|t| !diverging.iter().any(|(_, name, _)| name == t))
        {
            diverging.push((location(t), t.to_string(), How::Finding(f.kind)));
        }
    }
    let first = diverging.iter().min_by_key(|(loc, _, _)| *loc).cloned();
    let first_layer = first
        .as_ref()
        .and_then(|(loc, _, _)| (0..n as i64).contains(loc).then_some(*loc as usize));
    let whole_run = WholeRun {
        verdict: whole.verdict,
        first_diverging: first.as_ref().map(|(_, n, _)| n.clone()),
        first_diverging_how: first.as_ref().map(|(_, _, how)| *how),
        first_diverging_layer: first_layer,
        first_violation: whole.first_violation(),
        first_bit_difference: whole.first_divergence.as_ref().map(|d| FirstBitDifference {
            tensor: d.tensor.clone(),
            coords: d.coords.clone(),
            reference_value: d.reference_value.clone(),
            candidate_value: d.candidate_value.clone(),
            ulp: d.ulp,
            differing_elements: d.differing_elements,
            total_elements: d.total_elements,
        }),
        differing_decisions: whole_decisions
            .iter()
            .filter(|d| d.differing_rows > 0)
            .cloned()
            .collect(),
        findings: whole
            .findings
            .iter()
            .filter(|f| {
                !matches!(
                    f.kind,
                    FindingKind::ValuesDiffer
                        | FindingKind::OutsidePolicy
                        | FindingKind::DecisionDiffers
                )
            })
            .map(describe)
            .collect(),
    };
    let structure = summarise(&structure);

    // Isolation: layers up to and including the first diverging one, or all of them.
    let isolate_upto = if o.all_layers {
        n
    } else {
        first_layer.map_or(0, |l| l + 1)
    };
    let mut layers: Vec<LayerRow> = (0..n)
        .map(|l| {
            let pfx = names::layer_prefix(l);
            let differs = diverging.iter().any(|(_, name, _)| name.starts_with(&pfx));
            let h = whole_rows
                .iter()
                .find(|t| t.tensor == names::layer(l, "hidden_out"));
            layer_row(l, differs, h)
        })
        .collect();
    let mut failed: Option<(usize, String)> = None;
    crate::progress::plan(isolate_upto as u64);
    for (l, row) in layers.iter_mut().enumerate().take(isolate_upto) {
        if let Some((at, _)) = &failed {
            row.isolation = Isolated::NotChecked;
            row.reason = Some(format!(
                "not attempted: the candidate's layer verb failed on layer {at:02}"
            ));
            continue;
        }
        let src = Source {
            trace: &reference,
            rel: &ref_rel,
            whose: "the reference's",
            out_stem: "candidate.layer",
            slice_stem: "reference.layer",
        };
        match isolate(o, &src, l, &policy, forced, &mut runs) {
            Ok(iso) => fill_isolated(row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.reason = Some(why.clone());
                failed = Some((l, why));
            }
        }
        crate::progress::step(format_args!("layer {l:02} in isolation: {}", row.isolation));
    }
    refuse_timeout(&runs, o)?;
    // Before a layer body is blamed: does the candidate's layer verb agree with its own whole run?
    let own_rel = decisions_forced
        .as_ref()
        .and_then(|f| f.candidate_trace.clone())
        .unwrap_or_else(|| cand_rel.clone());
    let own = open(&o.root, &own_rel)?;
    let self_consistency = self_check(o, &own, &own_rel, &mut layers, &policy, forced, &mut runs);
    refuse_timeout(&runs, o)?;
    for row in &mut layers {
        row.status = if row.self_check == SelfCheck::Inconsistent {
            LayerStatus::Inconsistent
        } else {
            layer_status(row.isolation, row.whole_run)
        };
    }
    let first_wrong = layers
        .iter()
        .find(|r| r.status == LayerStatus::Wrong)
        .map(|r| r.layer);
    let stage =
        first_wrong.map(|l| stage(l, &layers[l], is_moe(&reference, l), "differs in isolation"));

    // Calibration: from the first wrong layer, else the first diverging one, else layer 0. Judged
    // by bits, a layer about to be blamed in a pair that is not two ordered producers gets it
    // without --calibrate, for that one layer: is its difference rounding?
    let auto = judge.by == By::Bits && !(ordered.0 && ordered.1) && !o.calibrate;
    let calibration = match first_wrong {
        Some(l) if auto => Some(calibrate(o, &reference, l, l + 1, &mut runs)),
        _ => (o.calibrate && n > 0).then(|| {
            calibrate(
                o,
                &reference,
                first_wrong.or(first_layer).unwrap_or(0),
                n,
                &mut runs,
            )
        }),
    };
    if let Some(cal) = &calibration {
        for c in &cal.rows {
            let row = &mut layers[c.layer];
            row.calibration_rel_l2 = c.rel_l2;
            let over = |x: Option<f64>| match (x, c.rel_l2) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            row.whole_vs_calibration = over(row.whole_rel_l2);
            if c.layer == cal.from_layer {
                row.isolated_vs_calibration = over(row.isolated_rel_l2);
            }
        }
    }

    refuse_timeout(&runs, o)?;
    let rounding_level = match (first_wrong, judge.by) {
        (Some(l), By::Bits) => RoundingLevel::new(
            l,
            layers[l].isolated_rel_l2,
            layers[l].calibration_rel_l2,
            &judge,
            o.exact,
        ),
        _ => None,
    };

    // Outliers within the policy: the matching isolated layers' errors against their peers'.
    let errors: Vec<judge::LayerErrors> = layers
        .iter()
        .filter(|r| r.isolation == Isolated::Match && r.status != LayerStatus::Inconsistent)
        .map(|r| {
            let rel = |t: &str| {
                r.isolated
                    .iter()
                    .find(|x| x.tensor == names::layer(r.layer, t))
                    .and_then(|x| x.rel_l2)
            };
            (
                r.layer,
                rel("attn_out"),
                if is_moe(&reference, r.layer) {
                    None
                } else {
                    rel("mlp_out")
                },
            )
        })
        .collect();
    let (outliers, per) = judge::outliers(&errors);
    for (l, ratio, flagged) in per {
        (layers[l].peer_ratio, layers[l].suspicious) = (ratio, flagged);
    }

    // Amplification: geometric-mean growth of the whole-run error over consecutive differing layers.
    let errs: Vec<f64> = layers
        .iter()
        .filter_map(|r| r.whole_rel_l2)
        .filter(|&e| e > 0.0)
        .collect();
    let amplification = (errs.len() >= 2)
        .then(|| (errs[errs.len() - 1] / errs[0]).powf(1.0 / (errs.len() - 1) as f64));

    let (verdict, summary) = match &self_consistency.inconsistent {
        // The first layer whose verbs disagree comes before any layer blamed: nothing is blamed.
        Some(i) if first_wrong.is_none_or(|w| i.layer < w) => {
            inconsistent_verdict(i, &layers, &whole_run)
        }
        _ => verdict(
            &layers,
            first_wrong,
            &stage,
            &first,
            n,
            &whole_run,
            &structure,
            amplification,
            &failed,
        ),
    };
    let (verdict, mut summary) = match &decisions_forced {
        Some(f) => with_forcing(f, (verdict, summary)),
        None => (verdict, summary),
    };
    if let Some(r) = &rounding_level {
        summary.push_str(&format!("; {}", r.words()));
    }
    if first_wrong.is_some() && !self_consistency.not_checked.is_empty() {
        summary.push_str(&format!(
            "; the candidate's layer verb NOT CHECKED against its own whole run: {}",
            self_consistency.not_checked.join("; ")
        ));
    }
    if !outliers.suspicious.is_empty() {
        summary.push_str(&format!("; {}", suspicious_words(&layers, &outliers)));
    }
    let (decode, (verdict, summary)) = if o.generate > 0 {
        let ctx = crate::bisect_decode::Context {
            reference: &reference,
            candidate: &candidate,
            policy: &policy,
            layers: n,
        };
        let (d, v) = crate::bisect_decode::run(o, &ctx, &mut runs, (verdict, summary));
        refuse_timeout(&runs, o)?;
        (Some(d), v)
    } else {
        (None, (verdict, summary))
    };
    Ok(BisectReport {
        schema: SCHEMA,
        summary,
        verdict,
        exit_code: verdict.exit_code(),
        model: o.model.clone(),
        prompt: o.prompt.clone(),
        tokens: o.tokens.clone(),
        reference: o.reference.name(),
        candidate: o.candidate.name(),
        judge,
        capture: if o.internals {
            Capture::Internals
        } else {
            Capture::Default
        },
        layers_total: n,
        decisions_forced,
        whole_run,
        timeout_s: o.timeout.as_secs(),
        first_wrong_layer: first_wrong,
        stage,
        layers,
        amplification_per_layer: amplification,
        calibration,
        decode,
        rounding_level,
        self_consistency,
        outliers,
        work_dir: o.work.clone(),
        runs,
        gate_invocation: o.gate_invocation.clone(),
    })
}

/// The differ's report on two whole traces, refused when they cannot be compared. An MoE
/// expert that routing sent other tokens is compared by the differ itself (status `rerouted`).
fn compare_whole(reference: &Trace, candidate: &Trace, opts: &Options) -> Result<Report> {
    let whole = compare(reference, candidate, opts);
    if matches!(whole.verdict, Verdict::Incomparable | Verdict::Unreadable) {
        let why: Vec<String> = whole.findings.iter().map(describe).collect();
        return Err(gerr!(
            "the whole traces cannot be compared ({:?}): {}",
            whole.verdict,
            why.join("; ")
        ));
    }
    Ok(whole)
}

/// The forced candidate run, checked: it must have run, recorded that it was forced from this
/// reference, and taken every decision the reference took. Else why not, in a line.
fn forced_run(
    o: &BisectOptions,
    reference: &Trace,
    rec: &RunRecord,
    rel: &str,
    opts: &Options,
) -> std::result::Result<(Report, Trace), String> {
    if !rec.ok {
        let why = rec.why();
        let said: Vec<&str> = why
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        return Err(format!("the candidate's trace verb failed with --force-decisions (a producer need not implement it): {}", said.join(" | ")));
    }
    let t = open(&o.root, rel).map_err(|e| e.0)?;
    let digest = reference.digest().hex();
    if t.provenance()["forced_decisions"]["trace_digest"].as_str() != Some(digest.as_str()) {
        return Err("the candidate's trace does not record decisions forced from the reference (provenance forced_decisions.trace_digest)".into());
    }
    let rep = compare_whole(reference, &t, opts).map_err(|e| e.0)?;
    let still: Vec<String> = rep
        .decisions
        .results
        .iter()
        .filter(|d| d.differing_rows > 0)
        .map(|d| format!("{} ({} rows)", d.name, d.differing_rows))
        .collect();
    if !still.is_empty() {
        return Err(format!(
            "the candidate's forced trace still takes other decisions: {}",
            still.join(", ")
        ));
    }
    Ok((rep, t))
}

/// The verdict on the forced runs, with the decisions said. The numbers agreeing once forced is
/// `nothing_wrong` only when no unforced flip is one trace-diff labels a defect; otherwise
/// `decisions_differ` (exit 1): the candidate decides otherwise on numbers that agree.
fn with_forcing(f: &DecisionsForced, (verdict, summary): Said) -> Said {
    let summary = summary.trim_end_matches([';', ' ']);
    let rows = |n: u64| format!("{n} row{}", if n == 1 { "" } else { "s" });
    let list: Vec<String> = f
        .unforced
        .iter()
        .map(|d| {
            let labels: Vec<String> = d.labels.iter().map(|(l, n)| format!("{n} {l}")).collect();
            format!(
                "{} {}/{} ({})",
                d.name,
                d.differing_rows,
                rows(d.rows),
                labels.join(", ")
            )
        })
        .collect();
    let unforced = format!(
        "unforced, the runs take other decisions: {}",
        list.join("; ")
    );
    if f.status != Forcing::Forced {
        return (
            verdict,
            format!(
                "{summary}; {unforced}; decisions NOT forced: {}",
                f.reason.as_deref().unwrap_or("")
            ),
        );
    }
    // Where the candidate, given the reference's decisions upstream, would itself decide
    // otherwise: the flips, without their consequences.
    let own: Vec<String> = f
        .overridden
        .as_ref()
        .and_then(|o| o.as_object())
        .map(|o| {
            o.iter()
                .map(|(name, n)| format!("{name} ({})", rows(n.as_u64().unwrap_or(0))))
                .collect()
        })
        .unwrap_or_default();
    let own = if own.is_empty() {
        String::new()
    } else {
        format!(
            "; given the reference's decisions the candidate would decide otherwise in {}",
            own.join(", ")
        )
    };
    if verdict == BisectVerdict::NothingWrong
        && f.unforced
            .iter()
            .any(|d| d.labels.contains_key(&Label::Defect))
    {
        return (BisectVerdict::DecisionsDiffer, format!("the numbers agree once decisions are forced, but the candidate decides otherwise where they do not explain it{own}; {unforced}"));
    }
    (
        verdict,
        format!("with decisions forced from the reference: {summary}{own}; {unforced}"),
    )
}

#[allow(clippy::too_many_arguments)]
fn verdict(
    layers: &[LayerRow],
    first_wrong: Option<usize>,
    stage: &Option<Stage>,
    first: &Option<(i64, String, How)>,
    n: usize,
    whole: &WholeRun,
    structure: &Option<String>,
    amplification: Option<f64>,
    failed: &Option<(usize, String)>,
) -> Said {
    let with = |status: LayerStatus| -> Vec<usize> {
        layers
            .iter()
            .filter(|r| r.status == status)
            .map(|r| r.layer)
            .collect()
    };
    let (matched, inherits, downstream, wrong) = (
        layers
            .iter()
            .filter(|r| r.isolation == Isolated::Match && r.whole_run == WholeRunState::Match)
            .map(|r| r.layer)
            .collect::<Vec<_>>(),
        with(LayerStatus::Inherits),
        with(LayerStatus::Downstream),
        with(LayerStatus::Wrong),
    );
    let also_structure = structure
        .as_ref()
        .map(|s| format!("; the whole runs also differ in structure: {s}"))
        .unwrap_or_default();
    let mut tail = Vec::new();
    if !matched.is_empty() {
        tail.push(say(&matched, "matches in isolation", "match in isolation"));
    }
    let inconsistent = with(LayerStatus::Inconsistent);
    if !inconsistent.is_empty() {
        tail.push(say(
            &inconsistent,
            "has a layer verb that disagrees with its own whole run",
            "have layer verbs that disagree with their own whole runs",
        ));
    }
    if let (Some(l), Some(s)) = (first_wrong, stage) {
        let also: Vec<usize> = wrong.iter().copied().filter(|&w| w != l).collect();
        if !also.is_empty() {
            tail.push(say(
                &also,
                "is also wrong in isolation",
                "are also wrong in isolation",
            ));
        }
        if !inherits.is_empty() {
            tail.push(say(&inherits, "inherits", "inherit"));
        }
        if !downstream.is_empty() {
            tail.push(
                say(&downstream, "differs downstream", "differ downstream")
                    + " (not isolated; --all-layers checks whether they inherit)",
            );
        }
        return (
            BisectVerdict::WrongLayer,
            format!(
                "layer {l:02} body is wrong: {} [{}]; {}{also_structure}",
                s.detail,
                s.block.words(),
                tail.join("; ")
            ),
        );
    }
    let whole_same =
        matches!(whole.verdict, Verdict::Identical | Verdict::WithinPolicy) && structure.is_none();
    if let Some((at, why)) = failed {
        let div = match (first, structure) {
            (Some((_, name, how)), _) => {
                format!("the whole runs first diverge at {name} ({})", how.words())
            }
            (None, Some(s)) => format!("the whole runs differ in structure: {s}"),
            (None, None) if whole_same => {
                format!(
                    "the whole runs are {}",
                    whole.verdict.as_str().replace('_', " ")
                )
            }
            (None, None) => format!("the whole runs differ ({})", whole.verdict),
        };
        return (
            BisectVerdict::NotChecked,
            format!("isolation NOT CHECKED from layer {at:02}: {why}; {div}"),
        );
    }
    // The first divergence is structural, or only the structure differs: no value to bisect.
    if first
        .as_ref()
        .is_some_and(|(_, _, how)| *how != How::Differs)
        || (first.is_none() && !whole_same)
    {
        let what = structure
            .clone()
            .unwrap_or_else(|| format!("verdict {}", whole.verdict));
        let iso = if tail.is_empty() {
            String::new()
        } else {
            format!("; {}", tail.join("; "))
        };
        return (
            BisectVerdict::StructureDiffers,
            format!("the whole runs differ in structure, not only in values: {what}{iso}"),
        );
    }
    match first {
        None => {
            let how = if whole.verdict == Verdict::WithinPolicy { "within policy" } else { "identical" };
            // Say so when no layer verb ran: nothing needed isolating, but nothing was isolated.
            let iso = if matched.is_empty() { "; no layer isolated (nothing diverged; --all-layers runs every layer's verb)".to_string() } else { format!("; {}", tail.join("; ")) };
            (BisectVerdict::NothingWrong, format!("nothing wrong: the whole runs are {how}{iso}"))
        }
        Some((loc, name, _)) if *loc < 0 => (BisectVerdict::OutsideLayers, format!("{name} differs before layer 00{}: the embedding is wrong (the layer verb does not isolate it)", broken(whole, name))),
        Some((loc, name, _)) if *loc as usize >= n => (
            BisectVerdict::OutsideLayers,
            format!("no layer differs in the whole run; the divergence starts at {name}{}, after the last layer (the head, which the layer verb does not isolate)", broken(whole, name)),
        ),
        Some(_) => {
            let iso_ulp = layers.iter().filter(|r| r.isolation == Isolated::Match).filter_map(|r| r.isolated_max_ulp).max().unwrap_or(0);
            let iso_rel = layers.iter().filter_map(|r| r.isolated_rel_l2).fold(0.0f64, f64::max);
            let amp = amplification.map(|a| format!(", amplification ×{a:.2} per layer")).unwrap_or_default();
            (
                BisectVerdict::Accumulates,
                format!(
                    "no layer body is wrong in isolation; the divergence accumulates: per-layer isolated error <= {} ULP (rel L2 <= {}){amp}; {}{also_structure}",
                    thousands(iso_ulp),
                    sci(Some(iso_rel)),
                    tail.join("; ")
                ),
            )
        }
    }
}

/// " (relative L2 0.2 > 0.0001)" when `name` is the whole run's first violation: under a
/// policy, the bound that puts it outside.
fn broken(whole: &WholeRun, name: &str) -> String {
    let v = whole.first_violation.as_ref().filter(|v| v.tensor == name);
    v.and_then(|v| v.violations.first())
        .map(|b| format!(" ({b})"))
        .unwrap_or_default()
}

/// A hang says nothing about the layers: the bisection cannot be judged, so it is refused.
fn refuse_timeout(runs: &[RunRecord], o: &BisectOptions) -> Result<()> {
    match runs.iter().find(|r| r.timed_out) {
        Some(r) => Err(gerr!(
            "{} {} timed out after {} s (--timeout) and was killed: $ {}",
            r.producer,
            r.verb,
            o.timeout.as_secs(),
            r.invocation
        )),
        None => Ok(()),
    }
}

/// A differ finding that states a difference of structure, not of values.
fn is_structure(kind: FindingKind) -> bool {
    use FindingKind as K;
    match kind {
        // Values, decisions and policy breaks are rows; dtype and shape mismatches are rows too
        // (`rows`), and so is an expert the routing sent other tokens (status `rerouted`); the
        // rest are notes, not differences.
        K::ValuesDiffer
        | K::OutsidePolicy
        | K::DecisionDiffers
        | K::MarginDiffers
        | K::DtypeMismatch
        | K::ShapeMismatch
        | K::Rerouted
        | K::StackMismatchAllowed
        | K::DecisionsForced => false,
        K::Unreadable
        | K::StackMismatch
        | K::WeightsMismatch
        | K::PromptMismatch
        | K::SeedMismatch
        | K::PathMismatch
        | K::MaskMismatch
        | K::PositionsMismatch
        | K::MissingTensor
        | K::ExtraTensor
        | K::OrderMismatch
        | K::AttributeDiffers
        | K::SignedZero
        | K::NanMismatch
        | K::NanPayload
        | K::Infinity
        | K::NoPolicyRule
        | K::MissingDecision
        | K::ExtraDecision
        | K::DecisionShapeMismatch
        | K::DecisionOrderMismatch
        | K::MarginPresenceMismatch
        | K::ContentDigestDiffers
        | K::NothingSelected
        | K::TensorDiffers
        | K::Different
        | K::NoRule
        | K::CountChanged
        | K::DigestChanged
        | K::TokensDiffer
        | K::TokensChanged
        | K::ObservedOutOfTolerance => true,
    }
}

/// "kind name: detail", the name left out when the finding has none.
pub(crate) fn describe(f: &tracegate_diff::Finding) -> String {
    match f.tensor() {
        Some(t) => format!("{} {t}: {}", f.kind, f.detail),
        None => format!("{}: {}", f.kind, f.detail),
    }
}

/// Structure findings by kind, each with its count and first names: "42 missing_tensor
/// (layer.00.q, layer.00.k, layer.00.v, …)".
fn summarise(findings: &[&tracegate_diff::Finding]) -> Option<String> {
    let mut kinds: Vec<(FindingKind, Vec<&tracegate_diff::Finding>)> = Vec::new();
    for f in findings {
        match kinds.iter_mut().find(|(k, _)| *k == f.kind) {
            Some((_, v)) => v.push(f),
            None => kinds.push((f.kind, vec![f])),
        }
    }
    let parts: Vec<String> = kinds
        .iter()
        .map(|(kind, fs)| {
            let names: Vec<&str> = fs.iter().filter_map(|f| f.tensor()).collect();
            let shown: Vec<&str> = names.iter().copied().take(3).collect();
            let more = if names.len() > shown.len() {
                ", …"
            } else {
                ""
            };
            match (fs.len(), shown.is_empty()) {
                (1, true) => format!("{kind}: {}", fs[0].detail),
                (1, false) => format!("{kind} {}", shown[0]),
                (count, true) => format!("{count} {kind}"),
                (count, false) => format!("{count} {kind} ({}{more})", shown.join(", ")),
            }
        })
        .collect();
    (!parts.is_empty()).then(|| parts.join("; "))
}

// ------------------------------------------------------------------------------------------
// Human output: the summary line first, then the per-layer table.

pub fn render(r: &BisectReport) -> String {
    let mut o = String::new();
    o.push_str(&r.judge.line());
    o.push('\n');
    o.push_str(&r.summary);
    o.push('\n');
    o.push_str(&format!(
        "  reference {} · candidate {} · model {} · {} tokens{} · capture {}\n",
        r.reference,
        r.candidate,
        r.model,
        r.tokens.len(),
        r.prompt
            .as_ref()
            .map(|p| format!(" (prompt {p})"))
            .unwrap_or_default(),
        r.capture
    ));
    if let Some(f) = &r.decisions_forced {
        match &f.candidate_trace {
            Some(t) => o.push_str(&format!(
                "  decisions forced: the candidate re-ran with the reference's decisions ({t}); the whole run and the isolation below are that run ({} rows it would have decided otherwise)\n",
                f.rows_overridden.unwrap_or(0)
            )),
            None => o.push_str(&format!("  decisions NOT forced: {}\n", f.reason.as_deref().unwrap_or(""))),
        }
        for d in &f.unforced {
            let labels: Vec<String> = d.labels.iter().map(|(l, n)| format!("{n} {l}")).collect();
            o.push_str(&format!(
                "  unforced: decision {} differs in {}/{} rows ({})\n",
                d.name,
                d.differing_rows,
                d.rows,
                labels.join(", ")
            ));
        }
    }
    match (
        &r.whole_run.first_diverging,
        &r.whole_run.first_bit_difference,
    ) {
        (None, _) => o.push_str(&format!("  whole run: {}\n", r.whole_run.verdict)),
        (Some(name), d) => {
            o.push_str(&format!(
                "  whole run: {}; first diverging {name}",
                r.whole_run.verdict
            ));
            if let Some(how) = r
                .whole_run
                .first_diverging_how
                .filter(|h| *h != How::Differs)
            {
                o.push_str(&format!(" ({})", how.words()));
            }
            // Under a policy the failure is its first violation; the first bit difference
            // (possibly rounding noise within the policy) follows, named as such.
            if let Some(v) = &r.whole_run.first_violation {
                o.push_str(&format!("; first outside the policy {}: {v}", v.tensor));
            }
            if let Some(d) = d {
                let what = if r.whole_run.first_violation.is_some() {
                    "first bit difference"
                } else {
                    "first differing element"
                };
                o.push_str(&format!(
                    "; {what} {}{:?}: {} vs {} ({} ULP; {}/{} elements differ)",
                    d.tensor,
                    d.coords,
                    d.reference_value,
                    d.candidate_value,
                    ulps(d.ulp),
                    thousands(d.differing_elements),
                    thousands(d.total_elements)
                ));
            }
            o.push('\n');
        }
    }
    for d in &r.whole_run.differing_decisions {
        let excused = if d.excused_rows > 0 {
            format!(
                " ({} excused: near-ties and rows after them)",
                d.excused_rows
            )
        } else {
            String::new()
        };
        o.push_str(&format!(
            "  whole run: decision {} differs in {}/{} rows{excused}\n",
            d.name,
            d.rows.min(d.differing_rows),
            d.rows
        ));
    }
    for f in &r.whole_run.findings {
        o.push_str(&format!("  whole run finding: {f}\n"));
    }
    let cal = r.calibration.is_some();
    let peers = r.outliers.checked;
    o.push_str(&format!(
        "\n  {:<5} {:<12} {:<9} {:>12} {:>11} {:>12} {:>11}{}{}\n",
        "layer",
        "status",
        "whole run",
        "isol max ULP",
        "isol rel L2",
        "whole max ULP",
        "whole rel L2",
        if cal {
            format!(" {:>11} {:>11}", "1-ULP rel L2", "whole/1-ULP")
        } else {
            String::new()
        },
        if peers { "  vs peers" } else { "" }
    ));
    for row in &r.layers {
        let vs = match (peers, row.isolation) {
            (false, _) => String::new(),
            (true, Isolated::Match) if row.status != LayerStatus::Inconsistent => format!(
                "  {:>8}{}",
                ratio(row.peer_ratio),
                if row.suspicious { " suspicious" } else { "" }
            ),
            (true, _) => format!("  {:>8}", "-"),
        };
        o.push_str(&format!(
            "  {:<5} {:<12} {:<9} {:>12} {:>11} {:>12} {:>11}{}{vs}\n",
            format!("{:02}", row.layer),
            row.status,
            row.whole_run,
            if row.isolation == Isolated::NotRun {
                "-".into()
            } else {
                ulps(row.isolated_max_ulp)
            },
            sci(row.isolated_rel_l2),
            ulps(row.whole_max_ulp),
            sci(row.whole_rel_l2),
            if cal {
                format!(
                    " {:>11} {:>11}",
                    sci(row.calibration_rel_l2),
                    ratio(row.whole_vs_calibration)
                )
            } else {
                String::new()
            }
        ));
    }
    if let Some(s) = &r.stage {
        o.push_str(&format!(
            "\n  first wrong stage in layer {:02}: {} — {}\n",
            s.layer,
            s.block.words(),
            s.detail
        ));
        if !s.matching.is_empty() {
            o.push_str(&format!(
                "    before it, matching in isolation: {}\n",
                s.matching.join(", ")
            ));
        }
        let row = &r.layers[s.layer];
        for t in row.isolated.iter().filter(|t| t.status.is_bad()) {
            o.push_str(&format!(
                "    {:<28} {:<14} {:>9}/{:<9} max {} ULP, rel L2 {}\n",
                t.tensor,
                t.status,
                thousands(t.differing_elements.unwrap_or(0)),
                thousands(t.total_elements),
                ulps(t.max_ulp),
                sci(t.rel_l2)
            ));
        }
    }
    for row in r.layers.iter().filter(|r| r.reason.is_some()).take(1) {
        o.push_str(&format!(
            "\n  layer {:02} NOT CHECKED: {}\n",
            row.layer,
            row.reason.as_deref().unwrap_or("")
        ));
    }
    o.push('\n');
    o.push_str(&self_consistency_lines(&r.self_consistency, &r.layers));
    o.push_str(&outlier_line(&r.outliers, &r.layers));
    if let Some(c) = &r.calibration {
        o.push_str(&format!(
            "\n  calibration: {} (input rel L2 {})\n",
            c.perturbation,
            sci(c.input_rel_l2)
        ));
        if let Some(row) = r.layers.get(c.from_layer) {
            if let Some(x) = row.isolated_vs_calibration {
                o.push_str(&format!(
                    "    in isolation, the candidate's layer {:02} hidden_out difference (rel L2 {}) is {} what a 1-ULP perturbation of its input produces ({})\n",
                    row.layer,
                    sci(row.isolated_rel_l2),
                    ratio(Some(x)),
                    sci(row.calibration_rel_l2)
                ));
            }
        }
        if let Some(row) = r
            .layers
            .iter()
            .rfind(|row| row.whole_vs_calibration.is_some())
        {
            o.push_str(&format!(
                "    in the whole run, the candidate's difference at layer {:02} is {} what a 1-ULP perturbation at layer {:02} grows to\n",
                row.layer,
                ratio(row.whole_vs_calibration),
                c.from_layer
            ));
        }
        if let Some(why) = &c.not_checked {
            o.push_str(&format!("    calibration NOT CHECKED: {why}\n"));
        }
    }
    if let Some(d) = &r.decode {
        o.push_str(&crate::bisect_decode::render(d));
    }
    o.push_str(&format!("\n  traces in {}\n", r.work_dir));
    o
}

fn self_consistency_lines(sc: &SelfConsistency, layers: &[LayerRow]) -> String {
    let mut o = String::new();
    let consistent: Vec<usize> = layers
        .iter()
        .filter(|r| r.self_check == SelfCheck::Consistent)
        .map(|r| r.layer)
        .collect();
    match (&sc.inconsistent, consistent.is_empty(), sc.scope) {
        (Some(i), _, _) => {
            o.push_str(&format!("  self-consistency: INCONSISTENT at layer {:02}: the candidate's layer verb on its own input: {} ({})\n", i.layer, i.detail, i.trace));
            if let Some(e) = &i.element {
                o.push_str(&format!("    {} {:?}: whole run {} vs layer verb {} ({} ULP)\n", e.which.as_str().replace('_', " "), e.coords, e.whole_run_value, e.layer_verb_value, ulps(e.ulp)));
            }
        }
        (None, true, Scope::FirstWrongLayer) if sc.not_checked.is_empty() => {
            o.push_str("  self-consistency: not run (checked only for a layer about to be blamed; --all-layers checks every isolated layer)\n")
        }
        _ => {}
    }
    if !consistent.is_empty() {
        let which = if consistent.len() == 1 {
            "layer"
        } else {
            "layers"
        };
        o.push_str(&format!("  self-consistency: the candidate's layer verb on its own input agrees with its own whole run in {which} {}\n", span(&consistent)));
    }
    for why in &sc.not_checked {
        o.push_str(&format!("  self-consistency NOT CHECKED: {why}\n"));
    }
    o
}

fn outlier_line(out: &Outliers, layers: &[LayerRow]) -> String {
    if let Some(why) = &out.not_checked {
        return format!("  outliers NOT CHECKED: {why}\n");
    }
    if !out.suspicious.is_empty() {
        return format!("  outliers: {}\n", suspicious_words(layers, out));
    }
    let largest = match (out.largest_layer, out.largest_ratio) {
        (Some(l), Some(x)) => format!(" (largest: layer {l:02}, {})", ratio(Some(x))),
        _ => String::new(),
    };
    format!("  outliers: no layer's isolated error ({}) is above {}× its peers' median, of {} matching isolated layers{largest}\n", out.measure, out.factor, out.isolated_layers)
}

#[cfg(test)]
mod tests {
    /// Before `names`, `location` read two digits: `layer.100.*` sat at layer 10.
    #[test]
    fn location_reads_every_digit_of_the_layer() {
        assert_eq!(super::location("layer.100.mlp_out"), 100);
        assert_eq!(super::location("layer.07.q"), 7);
        assert_eq!(super::location("embed.out"), -1);
        assert_eq!(super::location("logits"), i64::MAX);
        assert_eq!(super::location("decode.0001.layer.03.q"), i64::MAX);
    }
}
