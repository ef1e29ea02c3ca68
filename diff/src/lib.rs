//! How two traces compare. [`compare`] runs the checks in a fixed order — readable and
//! verified, comparable, structure, values, decisions — and returns a [`Report`] that the CLI
//! prints (human or JSON) and the gate and bisect read directly. Semantics are specified in
//! `docs/diff.md`; the JSON form in `docs/diff-report.schema.json`.

pub mod comparable;
mod decisions;
mod excuse;
pub mod filter;
pub mod html;
pub mod measures;
pub mod numeric;
pub mod policy;
mod render;
mod reroute;
pub mod stats;
mod vocab;
mod worst;

#[doc(hidden)]
pub use serde as __serde;

use std::path::Path;

use serde::{Serialize, Serializer};
use tracegate_trace::{DType, TensorInfo, Trace};

pub use decisions::{margin_tolerance, MARGIN_SLACK};
pub use filter::{Filter, FilterSummary};
pub use html::write_html;
pub use numeric::{Pair, Special};
pub use policy::{glob_match, Amount, NearTie, Policy, Rule, Violation, DEFAULT_NEAR_TIE_FACTOR};
pub use render::{
    label_text, render_human, render_show, terminal_safe, thousands, write_human, write_json,
    write_show, write_show_json,
};
pub use vocab::{DecisionStatus, FindingKind, Label, Margins, RowStatus};

string_enum! {
    /// The outcome, one word; [`Verdict::exit_code`] is the CLI's exit status.
    pub enum Verdict {
        Identical = "identical",
        Different = "different",
        WithinPolicy = "within_policy",
        Incomparable = "incomparable",
        Unreadable = "unreadable",
    }
}

impl Verdict {
    pub fn exit_code(self) -> i32 {
        match self {
            Verdict::Identical | Verdict::WithinPolicy => 0,
            Verdict::Different => 1,
            Verdict::Unreadable => 2,
            Verdict::Incomparable => 3,
        }
    }
}

#[derive(Clone, Debug)]
pub struct Options {
    /// Recompute every digest of both traces first. Without it the per-tensor digests are not
    /// trusted either, so every common tensor is compared element by element.
    pub verify: bool,
    /// Downgrade the oracle stack rule (versions, dtype, device, attention) to a finding.
    pub allow_stack_mismatch: bool,
    /// Keep scanning values after the first differing tensor.
    pub all: bool,
    /// Judge numeric differences by this policy (implies scanning every tensor).
    pub policy: Option<Policy>,
    /// `--only` / `--skip`: the tensors and decisions compared; the rest are left out.
    pub filter: Filter,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            verify: true,
            allow_stack_mismatch: false,
            all: false,
            policy: None,
            filter: Filter::default(),
        }
    }
}

impl Options {
    /// Whether the tensor or decision `name` is compared (see [`Filter`]).
    pub fn selects(&self, name: &str) -> bool {
        self.filter.selects(name)
    }
}

/// The JSON report's format, its top-level `schema` (docs/diff-report.schema.json describes it).
pub const REPORT_SCHEMA: &str = "tracegate-diff-report/3";

/// An f64 that serialises non-finite values as the strings "inf", "-inf", "nan" (JSON has no
/// such numbers, and null would read as "not measured").
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Real(pub f64);

impl Serialize for Real {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let v = self.0;
        if v.is_finite() {
            s.serialize_f64(v)
        } else if v.is_nan() {
            s.serialize_str("nan")
        } else if v > 0.0 {
            s.serialize_str("inf")
        } else {
            s.serialize_str("-inf")
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Side {
    pub path: Option<String>,
    /// Whole-trace content digest (hex), null when the file could not be read.
    pub digest: Option<String>,
    pub producer: Option<String>,
    /// True when every digest was recomputed and matched.
    pub verified: bool,
}

/// How the common tensors were compared. The four per-method sets are counts: their names
/// are the `per_tensor` rows with that method (and status), which the JSON lists
/// ([`Report::names`]); a second copy of every name would double the memory per tensor.
#[derive(Clone, Debug, Default)]
pub struct TensorSummary {
    pub reference_count: usize,
    pub candidate_count: usize,
    /// Tensors whose elements were compared one by one (method "elementwise").
    pub compared_elementwise: Count,
    /// Tensors judged identical because their verified xxh3-128 digests are equal ("digest").
    pub matched_by_digest: Count,
    /// Common tensors not compared element by element (scanning stopped at the first
    /// difference, "not_scanned"); `known_different` counts those that differ by digest.
    pub not_scanned: Count,
    pub known_different: Count,
    pub missing: Vec<String>,
    pub extra: Vec<String>,
}

/// A number of `per_tensor` rows.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Count(usize);

impl Count {
    pub fn len(self) -> usize {
        self.0
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    fn add(&mut self) {
        self.0 += 1;
    }
}

/// Which `per_tensor` rows a [`TensorSummary`] set holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowSet {
    CompareElementwise,
    MatchedByDigest,
    NotScanned,
    KnownDifferent,
}

impl RowSet {
    fn holds(self, r: &TensorRow) -> bool {
        match self {
            RowSet::CompareElementwise => r.method == Method::Elementwise,
            RowSet::MatchedByDigest => r.method == Method::Digest,
            RowSet::NotScanned => r.method == Method::NotScanned,
            RowSet::KnownDifferent => {
                r.method == Method::NotScanned && r.status == RowStatus::DiffersByDigest
            }
        }
    }
}

/// Serialises a [`RowSet`] as the list of its names, straight from the rows.
struct NamesJson<'a>(&'a [TensorRow], RowSet);

impl Serialize for NamesJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(self.0.iter().filter(|r| self.1.holds(r)).map(|r| &r.tensor))
    }
}

struct TensorsJson<'a>(&'a Report);

impl Serialize for TensorsJson<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let (t, rows) = (&self.0.tensors, &self.0.per_tensor[..]);
        let mut st = s.serialize_struct("TensorSummary", 8)?;
        st.serialize_field("reference_count", &t.reference_count)?;
        st.serialize_field("candidate_count", &t.candidate_count)?;
        st.serialize_field(
            "compared_elementwise",
            &NamesJson(rows, RowSet::CompareElementwise),
        )?;
        st.serialize_field(
            "matched_by_digest",
            &NamesJson(rows, RowSet::MatchedByDigest),
        )?;
        st.serialize_field("not_scanned", &NamesJson(rows, RowSet::NotScanned))?;
        st.serialize_field("known_different", &NamesJson(rows, RowSet::KnownDifferent))?;
        st.serialize_field("missing", &t.missing)?;
        st.serialize_field("extra", &t.extra)?;
        st.end()
    }
}

/// One row of the layer curve: how one common tensor compared.
#[derive(Clone, Debug, Serialize)]
pub struct TensorRow {
    pub tensor: String,
    pub dtype: &'static str,
    /// The candidate's dtype: another float dtype than `dtype` for a mixed-precision pair.
    /// A DType (one byte), not a name: a trace may hold a million rows.
    #[serde(serialize_with = "dtype_name")]
    pub candidate_dtype: DType,
    /// The dtype whose steps `max_ulp` and `median_ulp` count: the coarser of the two
    /// ([`Pair::ulp_dtype`]); null for integers, whose distance is the absolute difference.
    #[serde(serialize_with = "opt_dtype_name")]
    pub ulp_dtype: Option<DType>,
    pub shape: Vec<u64>,
    pub method: Method,
    pub status: RowStatus,
    pub total_elements: u64,
    /// Null when the elements were not compared one by one.
    pub differing_elements: Option<u64>,
    pub max_ulp: Option<u64>,
    /// Computed for the first differing tensor only (null elsewhere).
    pub median_ulp: Option<u64>,
    pub max_abs: Option<Real>,
    pub max_rel: Option<Real>,
    pub cosine: Option<Real>,
    pub rel_l2: Option<Real>,
    /// ⟨c, r⟩ / ⟨r, r⟩ − 1 (signed; docs/diff.md, "Scale error").
    pub scale_error: Option<Real>,
    pub signed_zero: u64,
    pub nan_mismatch: u64,
    pub nan_payload: u64,
    pub infinity: u64,
    /// The policy rule that judged this tensor (index into the policy's rules and its pattern).
    /// Boxed: set only under a policy, and 24 bytes a row otherwise (a trace may hold a million).
    pub rule: Option<Box<RuleRef>>,
    /// Every bound of that rule this tensor breaks (status "outside_policy"). A boxed slice, not
    /// a Vec: with `worst_element` it takes the 24 bytes `violations` took before it.
    pub violations: Box<[Violation]>,
    /// Where an "outside_policy" tensor differs most (see [`Element`]); boxed as `rule` is.
    pub worst_element: Option<Box<Element>>,
}

/// One element of a tensor present in both traces, as both sides hold it. As a worst element
/// (docs/diff.md, "Policies"): a NaN or infinity difference first, else the largest
/// |reference − candidate|, the first in index order on ties.
#[derive(Clone, Debug, Serialize)]
pub struct Element {
    pub flat_index: u64,
    pub coords: Vec<u64>,
    pub reference_value: String,
    pub candidate_value: String,
    pub reference_bits: String,
    pub candidate_bits: String,
    /// Distance in the stored dtype's ULPs (integers: absolute difference); null for a NaN pair.
    pub ulp: Option<u64>,
    /// Set when the element differs as a signed zero, NaN or infinity.
    pub special: Option<Special>,
}

fn dtype_name<S: Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(d.name())
}

fn opt_dtype_name<S: Serializer>(d: &Option<DType>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_str(d.name()),
        None => s.serialize_none(),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct RuleRef {
    pub index: usize,
    pub pattern: String,
}

/// The first differing element of the first differing tensor (reference capture order): the
/// first *bit* difference, which under a policy may be within it (the JSON's
/// `first_bit_difference`; [`Report::first_violation`] is the first tensor outside it).
#[derive(Clone, Debug, Serialize)]
pub struct Divergence {
    pub tensor: String,
    /// The reference's dtype; `candidate_dtype` differs for a mixed-precision pair, and each
    /// value and its bits are printed in its own side's dtype.
    pub dtype: String,
    pub candidate_dtype: String,
    /// The dtype whose steps `ulp`, `max_ulp` and `median_ulp` count; null for integers.
    pub ulp_dtype: Option<String>,
    pub shape: Vec<u64>,
    pub flat_index: u64,
    pub coords: Vec<u64>,
    pub reference_value: String,
    pub candidate_value: String,
    pub reference_bits: String,
    pub candidate_bits: String,
    /// Distance of this element in `ulp_dtype`'s ULPs (integers: absolute difference); null
    /// for a NaN pair.
    pub ulp: Option<u64>,
    /// Set when the element differs as a signed zero, NaN or infinity.
    pub special: Option<Special>,
    pub differing_elements: u64,
    pub total_elements: u64,
    pub max_ulp: Option<u64>,
    pub median_ulp: Option<u64>,
    pub max_abs: Real,
    pub max_rel: Real,
    pub cosine: Option<Real>,
    pub rel_l2: Option<Real>,
}

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
    /// Under a policy, `F·d` when the source row holds the decision's own scores; else null.
    pub noise_bound: Option<Real>,
    pub label: Label,
    /// For a consequence: the first tensor up to the source outside the policy (differing by
    /// bits without one).
    pub upstream: Option<String>,
    /// For a row after a near-tie: that near-tie, "DECISION row N".
    pub after: Option<String>,
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

/// One thing a comparison found. `About` names what it is about: for the differ a tensor or
/// decision, if any ([`OnTensor`], JSON `{kind, tensor, detail}`); the gate counts its findings,
/// so that a declared divergence names exactly what it excuses (`tracegate_gate::run::Counted`,
/// JSON `{kind, name, count, detail}`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Finding<About = OnTensor> {
    pub kind: FindingKind,
    #[serde(flatten)]
    pub about: About,
    pub detail: String,
}

/// The differ's findings name the tensor or decision they are about (null: the whole trace).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct OnTensor {
    pub tensor: Option<String>,
}

impl Finding {
    pub fn new(kind: FindingKind, tensor: Option<&str>, detail: impl Into<String>) -> Finding {
        Finding {
            kind,
            about: OnTensor {
                tensor: tensor.map(str::to_string),
            },
            detail: detail.into(),
        }
    }

    /// The tensor or decision it is about.
    pub fn tensor(&self) -> Option<&str> {
        self.about.tensor.as_deref()
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct PolicyRef {
    pub name: String,
    pub rules: usize,
    /// The rules themselves, in file order (`per_tensor[].rule.index` indexes them): the bounds
    /// the HTML report draws, from the report like every other number in it.
    pub bounds: Vec<Rule>,
}

#[derive(Clone, Debug)]
pub struct Report {
    pub verdict: Verdict,
    pub reference: Side,
    pub candidate: Side,
    pub policy: Option<PolicyRef>,
    /// "first" (stop at the first differing tensor) or "all".
    pub scan: &'static str,
    /// What `--only` / `--skip` left out; None without a filter.
    pub filter: Option<FilterSummary>,
    pub tensors: TensorSummary,
    pub decisions: DecisionSummary,
    /// The first bit difference (JSON `first_bit_difference`), whatever a policy says of it.
    pub first_divergence: Option<Divergence>,
    pub first_decision_divergence: Option<DecisionDivergence>,
    /// One row per common tensor (same name, dtype and shape), in reference order.
    pub per_tensor: Vec<TensorRow>,
    pub findings: Vec<Finding>,
}

impl Serialize for Report {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("Report", 14)?;
        st.serialize_field("schema", REPORT_SCHEMA)?;
        st.serialize_field("verdict", &self.verdict)?;
        st.serialize_field("reference", &self.reference)?;
        st.serialize_field("candidate", &self.candidate)?;
        st.serialize_field("policy", &self.policy)?;
        st.serialize_field("scan", &self.scan)?;
        st.serialize_field("filter", &self.filter)?;
        st.serialize_field("tensors", &TensorsJson(self))?;
        st.serialize_field("decisions", &self.decisions)?;
        st.serialize_field("first_violation", &self.first_violation())?;
        st.serialize_field("first_bit_difference", &self.first_divergence)?;
        st.serialize_field("first_decision_divergence", &self.first_decision_divergence)?;
        st.serialize_field("per_tensor", &self.per_tensor)?;
        st.serialize_field("findings", &self.findings)?;
        st.end()
    }
}

/// A tensor outside the policy, as every report states it: trace-diff's `first_violation`,
/// the gate's `oracle.first_violation`, bisect's `whole_run.first_violation`. Its `Display`,
/// the one line the gate and bisect print after the tensor's name, is "relative L2 0.23 >
/// 0.0001 (rule #3 layer.*.mlp_out); worst at [0,0]: …".
#[derive(Clone, Debug, Serialize)]
pub struct TensorViolation {
    pub tensor: String,
    /// The reference's dtype; `candidate_dtype` differs for a mixed-precision pair.
    pub dtype: &'static str,
    pub candidate_dtype: &'static str,
    /// The dtype whose steps the worst element's `ulp` counts; null for integers.
    pub ulp_dtype: Option<&'static str>,
    pub shape: Vec<u64>,
    pub rule: Option<RuleRef>,
    pub violations: Vec<Violation>,
    pub worst_element: Option<Element>,
}

impl std::fmt::Display for TensorViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let broken: Vec<String> = self.violations.iter().map(|v| v.to_string()).collect();
        write!(f, "{}", broken.join("; "))?;
        if let Some(r) = &self.rule {
            write!(f, " (rule #{} {})", r.index, r.pattern)?;
        }
        if let Some(e) = &self.worst_element {
            write!(
                f,
                "; worst at {}",
                render::element_words(self.ulp_dtype.unwrap_or(self.dtype), e)
            )?;
        }
        Ok(())
    }
}

impl TensorRow {
    /// This tensor's violation, when it is outside the policy.
    pub fn violation(&self) -> Option<TensorViolation> {
        (self.status == RowStatus::OutsidePolicy).then(|| TensorViolation {
            tensor: self.tensor.clone(),
            dtype: self.dtype,
            candidate_dtype: self.candidate_dtype.name(),
            ulp_dtype: self.ulp_dtype.map(DType::name),
            shape: self.shape.clone(),
            rule: self.rule.as_deref().cloned(),
            violations: self.violations.to_vec(),
            worst_element: self.worst_element.as_deref().cloned(),
        })
    }
}

impl Report {
    /// The first tensor in reference capture order that is outside the policy: what a policy
    /// failure is reported by (the first bit difference may be rounding noise within it). The
    /// gate and bisect name it too.
    pub fn first_violation(&self) -> Option<TensorViolation> {
        self.per_tensor.iter().find_map(TensorRow::violation)
    }

    /// The names of one of [`TensorSummary`]'s sets, in reference order.
    pub fn names(&self, set: RowSet) -> impl Iterator<Item = &str> {
        self.per_tensor
            .iter()
            .filter(move |r| set.holds(r))
            .map(|r| r.tensor.as_str())
    }

    fn empty(reference: Side, candidate: Side, opts: &Options) -> Report {
        Report {
            verdict: Verdict::Identical,
            reference,
            candidate,
            policy: opts.policy.as_ref().map(|p| PolicyRef {
                name: p.name.clone(),
                rules: p.rules.len(),
                bounds: p.rules.clone(),
            }),
            scan: if opts.all || opts.policy.is_some() {
                "all"
            } else {
                "first"
            },
            filter: None,
            tensors: TensorSummary::default(),
            decisions: DecisionSummary::default(),
            first_divergence: None,
            first_decision_divergence: None,
            per_tensor: Vec::new(),
            findings: Vec::new(),
        }
    }

    pub fn exit_code(&self) -> i32 {
        self.verdict.exit_code()
    }

    /// The total differing elements among tensors compared element by element.
    pub fn differing_elements(&self) -> u64 {
        self.per_tensor
            .iter()
            .filter_map(|r| r.differing_elements)
            .sum()
    }
}

fn side(t: Option<&Trace>, path: Option<&Path>, verified: bool) -> Side {
    Side {
        path: path.map(|p| p.display().to_string()),
        digest: t.map(|t| t.digest().hex()),
        producer: t
            .and_then(|t| t.provenance().get("producer"))
            .and_then(|v| v.as_str())
            .map(str::to_string),
        verified,
    }
}

/// Opens both files and compares them; an unopenable file gives an `unreadable` report.
pub fn compare_files(reference: &Path, candidate: &Path, opts: &Options) -> Report {
    let (r, c) = rayon::join(|| Trace::open(reference), || Trace::open(candidate));
    match (r, c) {
        (Ok(r), Ok(c)) => compare(&r, &c, opts),
        (r, c) => {
            let mut rep = Report::empty(
                side(r.as_ref().ok(), Some(reference), false),
                side(c.as_ref().ok(), Some(candidate), false),
                opts,
            );
            rep.verdict = Verdict::Unreadable;
            for (label, res) in [("reference", &r), ("candidate", &c)] {
                if let Err(e) = res {
                    rep.findings.push(Finding::new(
                        FindingKind::Unreadable,
                        None,
                        format!("{label}: {e}"),
                    ));
                }
            }
            rep
        }
    }
}

/// Compares two opened traces: verify, comparability, structure, values, decisions.
pub fn compare(reference: &Trace, candidate: &Trace, opts: &Options) -> Report {
    // A filter that selects nothing is bad usage, known from the indexes alone: no hashing first.
    let filter = opts.filter.summary(&[reference, candidate]);
    if let Some(why) = filter.as_ref().and_then(FilterSummary::nothing_selected) {
        let mut rep = Report::empty(
            side(Some(reference), Some(reference.path()), false),
            side(Some(candidate), Some(candidate.path()), false),
            opts,
        );
        (rep.verdict, rep.filter) = (Verdict::Unreadable, filter);
        rep.findings
            .push(Finding::new(FindingKind::NothingSelected, None, why));
        return rep;
    }
    // 1. Readable and verified. Both files are hashed at once (each verify is itself parallel
    // across tensors, but one large tensor hashes on one core).
    let (vr, vc) = if opts.verify {
        rayon::join(|| reference.verify(), || candidate.verify())
    } else {
        (Ok(()), Ok(()))
    };
    let mut rep = Report::empty(
        side(
            Some(reference),
            Some(reference.path()),
            opts.verify && vr.is_ok(),
        ),
        side(
            Some(candidate),
            Some(candidate.path()),
            opts.verify && vc.is_ok(),
        ),
        opts,
    );
    rep.filter = filter;
    if vr.is_err() || vc.is_err() {
        rep.verdict = Verdict::Unreadable;
        for (label, res) in [("reference", &vr), ("candidate", &vc)] {
            if let Err(e) = res {
                rep.findings.push(Finding::new(
                    FindingKind::Unreadable,
                    None,
                    format!("{label}: {e}"),
                ));
            }
        }
        return rep;
    }

    // 2. Comparable: runs before any digest is looked at.
    let (refusals, allowed) = comparable::check(reference, candidate, opts.allow_stack_mismatch);
    rep.findings.extend(allowed);
    if !refusals.is_empty() {
        rep.findings.extend(refusals);
        rep.verdict = Verdict::Incomparable;
        return rep;
    }

    // 3. Structure.
    let mut different = structure(reference, candidate, opts, &mut rep);
    let forced = forced_note(reference, candidate);
    let forced_from_other = forced.is_some();
    rep.findings.extend(forced);

    // 4. Values.
    let values_different = values(reference, candidate, opts, &mut rep);

    // 5. Decisions (every one the filter selects), each flip labelled; under a policy the rows
    // after a near-tie leave the judgement and their tensors are judged again without them.
    different |= decisions::compare(reference, candidate, opts, &mut rep);
    let rejudged = rep
        .decisions
        .near_ties
        .as_ref()
        .is_some_and(|n| !n.tensors.is_empty());
    different |= if rejudged {
        rep.per_tensor.iter().any(|r| {
            matches!(
                r.status,
                RowStatus::OutsidePolicy | RowStatus::NoRule | RowStatus::Rerouted
            )
        })
    } else {
        values_different
    };

    let any_value_difference = rep
        .per_tensor
        .iter()
        .any(|r| r.status != RowStatus::Identical)
        || rep
            .decisions
            .results
            .iter()
            .any(|d| d.margin_differing_rows > 0 || d.differing_rows > 0);
    rep.verdict = if different {
        Verdict::Different
    } else if opts.policy.is_some() && any_value_difference {
        Verdict::WithinPolicy
    } else {
        Verdict::Identical
    };
    // IDENTICAL claims equal content, and two verified digests decide that on their own: a
    // disagreement means a check above misses some content, which must not pass as identical.
    // Under a filter that left something out, IDENTICAL covers what was compared only; a side
    // forced from the other differs from it in that attribute, so its digest cannot match (the
    // decisions_forced note says so instead).
    let whole = rep.filter.as_ref().is_none_or(|f| !f.left_out_any());
    if rep.verdict == Verdict::Identical
        && whole
        && rep.reference.verified
        && rep.candidate.verified
        && reference.digest() != candidate.digest()
        && !forced_from_other
    {
        rep.verdict = Verdict::Different;
        rep.findings.push(Finding::new(
            FindingKind::ContentDigestDiffers,
            None,
            format!(
                "no difference was found, but the verified content digests differ ({} vs {}): a content field this differ does not compare",
                reference.digest().hex(),
                candidate.digest().hex()
            ),
        ));
    }
    rep
}

/// Missing, extra, dtype, shape and order findings; true if there is any.
fn structure(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    rep.tensors.reference_count = r.tensors().iter().filter(|i| opts.selects(&i.name)).count();
    rep.tensors.candidate_count = c.tensors().iter().filter(|i| opts.selects(&i.name)).count();
    let before = rep.findings.len();
    let digests = [r.digest().hex(), c.digest().hex()];
    for info in r.tensors().iter().filter(|i| opts.selects(&i.name)) {
        match c.tensor_info(&info.name) {
            None => {
                rep.tensors.missing.push(info.name.clone());
                rep.findings.push(Finding::new(
                    FindingKind::MissingTensor,
                    Some(&info.name),
                    "in the reference, not in the candidate",
                ));
            }
            // Two float dtypes are compared by value (Values); anything else cannot be.
            Some(ci) if Pair::new(info.dtype, ci.dtype).is_none() => {
                rep.findings.push(Finding::new(
                    FindingKind::DtypeMismatch,
                    Some(&info.name),
                    format!("reference {} vs candidate {}", info.dtype, ci.dtype),
                ));
            }
            Some(ci) if ci.shape != info.shape && !reroute::rerouted(info, ci) => {
                let same_count = ci.element_count() == info.element_count();
                let note = if same_count {
                    " (same element count: transposed or reshaped)"
                } else {
                    ""
                };
                rep.findings.push(Finding::new(
                    FindingKind::ShapeMismatch,
                    Some(&info.name),
                    format!(
                        "reference {:?} vs candidate {:?}{note}",
                        info.shape, ci.shape
                    ),
                ));
            }
            Some(ci) => attribute_findings(info, ci, &digests, rep),
        }
    }
    for info in c.tensors().iter().filter(|i| opts.selects(&i.name)) {
        if r.tensor_info(&info.name).is_none() {
            rep.tensors.extra.push(info.name.clone());
            rep.findings.push(Finding::new(
                FindingKind::ExtraTensor,
                Some(&info.name),
                "in the candidate, not in the reference",
            ));
        }
    }
    let rn = r
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| opts.selects(n) && c.tensor_info(n).is_some());
    let cn = c
        .tensors()
        .iter()
        .map(|i| i.name.as_str())
        .filter(|n| opts.selects(n) && r.tensor_info(n).is_some());
    if let Some(f) = order_finding(FindingKind::OrderMismatch, rn, cn) {
        rep.findings.push(f);
    }
    rep.findings.len() > before
}

/// `step` and extra attributes are content compared exactly (path, mask and positions decide
/// comparability instead, `comparable::check`); absent and empty are different — except a
/// `forced` attribute naming the other side (`forced_from_other`), noted once by `forced_note`.
fn attribute_findings(r: &TensorInfo, c: &TensorInfo, digests: &[String; 2], rep: &mut Report) {
    let (ra, ca) = (&r.attributes, &c.attributes);
    let show = |v: Option<String>| v.unwrap_or_else(|| "absent".into());
    if ra.step != ca.step {
        let detail = format!(
            "attribute step: {} in the reference, {} in the candidate",
            show(ra.step.map(|s| s.to_string())),
            show(ca.step.map(|s| s.to_string()))
        );
        rep.findings.push(Finding::new(
            FindingKind::AttributeDiffers,
            Some(&r.name),
            detail,
        ));
    }
    let keys: std::collections::BTreeSet<&String> =
        ra.extra.keys().chain(ca.extra.keys()).collect();
    for key in keys {
        let (a, b) = (ra.extra.get(key), ca.extra.get(key));
        if a != b && !forced_from_other(key, a, b, digests) {
            let q = |v: Option<&String>| show(v.map(|s| format!("{s:?}")));
            let detail = format!(
                "attribute {key:?}: {} in the reference, {} in the candidate",
                q(a),
                q(b)
            );
            rep.findings.push(Finding::new(
                FindingKind::AttributeDiffers,
                Some(&r.name),
                detail,
            ));
        }
    }
}

/// `forced=D` on one side only, D the other side's content digest: that side took its decisions
/// from this very trace (`--force-decisions`, docs/producers.md), which is not a difference.
fn forced_from_other(
    key: &str,
    r: Option<&String>,
    c: Option<&String>,
    digests: &[String; 2],
) -> bool {
    key == "forced"
        && match (r, c) {
            (None, Some(d)) => *d == digests[0],
            (Some(d), None) => *d == digests[1],
            _ => false,
        }
}

/// The one informational `decisions_forced` finding (not a difference): how many common tensors
/// carry a `forced` attribute naming the other side.
fn forced_note(r: &Trace, c: &Trace) -> Option<Finding> {
    let digests = [r.digest().hex(), c.digest().hex()];
    let mut sides = [0usize; 2];
    for ri in r.tensors() {
        if let Some(ci) = c.tensor_info(&ri.name) {
            let (a, b) = (
                ri.attributes.extra.get("forced"),
                ci.attributes.extra.get("forced"),
            );
            if a != b && forced_from_other("forced", a, b, &digests) {
                sides[usize::from(a.is_none())] += 1;
            }
        }
    }
    let (forced, from, n, digest) = if sides[1] > 0 {
        ("candidate", "reference", sides[1], &digests[0])
    } else {
        ("reference", "candidate", sides[0], &digests[1])
    };
    (n > 0).then(|| Finding::new(FindingKind::DecisionsForced, None, format!("the {forced}'s decisions were forced from the {from} (--force-decisions): {n} tensors carry forced={digest}")))
}

/// Compares the relative order of the names both sides share (each iterator already keeps
/// only those); names the first out of place. Allocates nothing: traces hold a million names.
pub(crate) fn order_finding<'a>(
    kind: FindingKind,
    r_common: impl Iterator<Item = &'a str>,
    c_common: impl Iterator<Item = &'a str>,
) -> Option<Finding> {
    let (i, (a, b)) = r_common
        .zip(c_common)
        .enumerate()
        .find(|(_, (a, b))| a != b)?;
    Some(Finding::new(kind, Some(a), format!("capture order differs at common position {i}: reference has {a:?}, candidate has {b:?}")))
}

/// How a row's tensor was compared. An enum, not a string: a row per tensor of a trace that may
/// hold a million (docs/diff.md, "Memory").
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Verified xxh3-128 digests equal: identical without reading the elements.
    Digest,
    /// Every element compared.
    Elementwise,
    /// Not read (after the first difference, without `--all`).
    NotScanned,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Digest => "digest",
            Method::Elementwise => "elementwise",
            Method::NotScanned => "not_scanned",
        }
    }
}

impl PartialEq<&str> for Method {
    fn eq(&self, other: &&str) -> bool {
        self.as_str() == *other
    }
}

impl std::fmt::Display for Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

fn row_for(info: &TensorInfo, pair: Pair, method: Method, status: RowStatus) -> TensorRow {
    TensorRow {
        tensor: info.name.clone(),
        dtype: info.dtype.name(),
        candidate_dtype: pair.candidate,
        ulp_dtype: pair.ulp_dtype(),
        shape: info.shape.clone(),
        method,
        status,
        total_elements: info.element_count(),
        differing_elements: None,
        max_ulp: None,
        median_ulp: None,
        max_abs: None,
        max_rel: None,
        cosine: None,
        rel_l2: None,
        scale_error: None,
        signed_zero: 0,
        nan_mismatch: 0,
        nan_payload: 0,
        infinity: 0,
        rule: None,
        violations: Box::default(),
        worst_element: None,
    }
}

/// Scans common tensors in reference order; true if any is different (or fails the policy).
fn values(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
    let scan_all = opts.all || opts.policy.is_some();
    // Without verification a recorded digest proves nothing about the bytes.
    let trust_digests = opts.verify;
    let mut different = false;
    let mut stopped = false;
    // One row per common tensor, allocated once: doubling a million-row Vec holds both copies.
    rep.per_tensor.reserve_exact(
        r.tensors()
            .iter()
            .filter(|ri| opts.selects(&ri.name) && c.tensor_info(&ri.name).is_some())
            .count(),
    );
    for ri in r.tensors().iter().filter(|ri| opts.selects(&ri.name)) {
        let Some(ci) = c.tensor_info(&ri.name) else {
            continue;
        };
        if reroute::rerouted(ri, ci) {
            // Other tokens routed to this expert: compared on the positions both sides hold.
            let Some(pair) = Pair::new(ri.dtype, ci.dtype) else {
                continue;
            };
            let (row, findings, _) = reroute::judge(
                r,
                c,
                ri,
                ci,
                pair,
                opts.policy.as_ref(),
                &Default::default(),
            );
            different |= !row.status.agrees();
            rep.tensors.compared_elementwise.add();
            rep.findings.extend(findings);
            rep.per_tensor.push(row);
            continue;
        }
        let Some(pair) = Pair::new(ri.dtype, ci.dtype).filter(|_| ci.shape == ri.shape) else {
            continue;
        };
        let rule = opts
            .policy
            .as_ref()
            .map(|p| p.rule_for(&ri.name, ci.attributes.path.as_deref()));
        let digest_equal = trust_digests && !pair.is_mixed() && ri.digest == ci.digest;
        let mut row;
        if digest_equal {
            // Verified equal bytes: every statistic is known without reading them.
            row = row_for(ri, pair, Method::Digest, RowStatus::Identical);
            row.differing_elements = Some(0);
            row.max_ulp = Some(0);
            (
                row.max_abs,
                row.max_rel,
                row.cosine,
                row.rel_l2,
                row.scale_error,
            ) = (
                Some(Real(0.0)),
                Some(Real(0.0)),
                Some(Real(1.0)),
                Some(Real(0.0)),
                Some(Real(0.0)),
            );
            rep.tensors.matched_by_digest.add();
        } else if stopped {
            let status = if trust_digests {
                RowStatus::DiffersByDigest
            } else {
                RowStatus::Unknown
            };
            row = row_for(ri, pair, Method::NotScanned, status);
            rep.tensors.not_scanned.add();
            // What follows a divergence is noise: a later change is not a finding by default
            // (--all scans and reports it); the JSON still lists which digests differ.
            if trust_digests {
                rep.tensors.known_different.add();
            }
        } else {
            let (rd, cd) = (r.data(ri), c.data(ci));
            // Only the first divergence reports a median: only its scan counts distances.
            let (s, ulps) = numeric::scan(pair, rd, cd, rep.first_divergence.is_none());
            rep.tensors.compared_elementwise.add();
            // Across dtypes nothing is bit-identical: equal values are still judged (policy) or
            // different (by bits).
            let identical = s.differing == 0 && !pair.is_mixed();
            row = row_for(
                ri,
                pair,
                Method::Elementwise,
                if identical {
                    RowStatus::Identical
                } else {
                    RowStatus::Different
                },
            );
            set_stats(&mut row, &s);
            if s.differing > 0 {
                if rep.first_divergence.is_none() {
                    row.median_ulp = ulps
                        .as_ref()
                        .and_then(|u| numeric::median_ulp(pair, rd, cd, &s, u));
                    rep.first_divergence = Some(divergence(ri, pair, rd, cd, &s, &row));
                    specials_findings(ri, &s, rep);
                }
                if !scan_all {
                    stopped = true;
                }
            }
        }
        if let Some(rule) = rule {
            match rule {
                None => {
                    rep.findings.push(Finding::new(
                        FindingKind::NoPolicyRule,
                        Some(&ri.name),
                        "no rule in the policy matches this tensor",
                    ));
                    row.status = RowStatus::NoRule;
                    different = true;
                }
                Some((idx, rule)) => {
                    row.rule = Some(Box::new(RuleRef {
                        index: idx,
                        pattern: rule.pattern.clone(),
                    }));
                    if row.status == RowStatus::Different {
                        if let Some(f) = judge_row(&mut row, idx, rule) {
                            different = true;
                            rep.findings.push(f);
                            // One more pass, over failing tensors only: where it fails most.
                            let (rd, cd) = (r.data(ri), c.data(ci));
                            row.worst_element = worst::locate(pair, rd, cd)
                                .map(|i| Box::new(element(pair, &ri.shape, rd, cd, i)));
                        }
                    }
                }
            }
        } else if row.status == RowStatus::Different {
            different = true;
            let counts = format!(
                "{} of {} elements differ",
                row.differing_elements.unwrap_or(0),
                row.total_elements
            );
            let detail = match pair.ulp_dtype().filter(|_| pair.is_mixed()) {
                Some(unit) => format!(
                    "reference {} vs candidate {}, compared in {unit} ULPs: {counts} in value (bit-identical does not exist across dtypes)",
                    pair.reference, pair.candidate
                ),
                None => counts,
            };
            rep.findings.push(Finding::new(
                FindingKind::ValuesDiffer,
                Some(&ri.name),
                detail,
            ));
        }
        rep.per_tensor.push(row);
    }
    different
}

/// A row's statistics from a scan (the median is the caller's: only the first divergence has one).
pub(crate) fn set_stats(row: &mut TensorRow, s: &numeric::Stats) {
    row.differing_elements = Some(s.differing);
    row.max_abs = Some(Real(s.max_abs));
    row.max_rel = Some(Real(s.max_rel));
    row.cosine = s.cosine().map(Real);
    row.rel_l2 = s.rel_l2().map(Real);
    row.scale_error = s.scale_error().map(Real);
    (
        row.signed_zero,
        row.nan_mismatch,
        row.nan_payload,
        row.infinity,
    ) = (s.signed_zero, s.nan_mismatch, s.nan_payload, s.infinity);
    row.max_ulp = s.max_ulp();
}

/// Judges a differing row by its rule from the row's statistics: sets `violations` and the
/// status, and returns the `outside_policy` finding when a bound is broken.
pub(crate) fn judge_row(row: &mut TensorRow, idx: usize, rule: &Rule) -> Option<Finding> {
    let m = policy::Measured {
        max_ulp: row.max_ulp,
        max_abs: row.max_abs.map_or(0.0, |x| x.0),
        max_rel: row.max_rel.map_or(0.0, |x| x.0),
        rel_l2: row.rel_l2.map(|x| x.0),
        cosine: row.cosine.map(|x| x.0),
        scale_error: row.scale_error.map(|x| x.0),
        nonfinite_differences: row.nan_mismatch + row.nan_payload + row.infinity,
    };
    row.violations = rule.violations(&m).into_boxed_slice();
    if row.violations.is_empty() {
        row.status = RowStatus::WithinPolicy;
        row.worst_element = None;
        return None;
    }
    row.status = RowStatus::OutsidePolicy;
    let broken: Vec<String> = row.violations.iter().map(|v| v.to_string()).collect();
    Some(Finding::new(
        FindingKind::OutsidePolicy,
        Some(&row.tensor),
        format!("rule {idx} ({}): {}", rule.pattern, broken.join("; ")),
    ))
}

/// Names signed-zero / NaN / infinity differences of the first differing tensor as findings.
fn specials_findings(info: &TensorInfo, s: &numeric::Stats, rep: &mut Report) {
    for (count, kind, what) in [
        (s.signed_zero, FindingKind::SignedZero, Special::SignedZero),
        (
            s.nan_mismatch,
            FindingKind::NanMismatch,
            Special::NanMismatch,
        ),
        (s.nan_payload, FindingKind::NanPayload, Special::NanPayload),
        (s.infinity, FindingKind::Infinity, Special::Infinity),
    ] {
        if count > 0 {
            rep.findings.push(Finding::new(
                kind,
                Some(&info.name),
                format!("{count} element(s): {}", what.describe()),
            ));
        }
    }
}

/// Element `idx` of a tensor both traces hold with the same shape: each value and its bits in
/// its own dtype, the distance in the pair's ULPs (the coarser dtype's for a mixed pair).
fn element(pair: Pair, shape: &[u64], rd: &[u8], cd: &[u8], idx: u64) -> Element {
    let (rt, ct) = (pair.reference, pair.candidate);
    let (a, b) = (
        numeric::element_bits(rt, rd, idx),
        numeric::element_bits(ct, cd, idx),
    );
    let (special, ulp) = numeric::pair_element(pair, rd, cd, idx).unwrap_or((None, Some(0)));
    Element {
        flat_index: idx,
        coords: numeric::unravel(idx, shape),
        reference_value: numeric::format_value(rt, a),
        candidate_value: numeric::format_value(ct, b),
        reference_bits: numeric::hex_bits(rt, a),
        candidate_bits: numeric::hex_bits(ct, b),
        ulp,
        special,
    }
}

impl Divergence {
    /// The element itself, without its tensor's statistics.
    pub fn element(&self) -> Element {
        Element {
            flat_index: self.flat_index,
            coords: self.coords.clone(),
            reference_value: self.reference_value.clone(),
            candidate_value: self.candidate_value.clone(),
            reference_bits: self.reference_bits.clone(),
            candidate_bits: self.candidate_bits.clone(),
            ulp: self.ulp,
            special: self.special,
        }
    }
}

fn divergence(
    info: &TensorInfo,
    pair: Pair,
    rd: &[u8],
    cd: &[u8],
    s: &numeric::Stats,
    row: &TensorRow,
) -> Divergence {
    let idx = s.first.expect("a differing tensor has a first difference");
    let e = element(pair, &info.shape, rd, cd, idx);
    Divergence {
        tensor: info.name.clone(),
        dtype: pair.reference.name().to_string(),
        candidate_dtype: pair.candidate.name().to_string(),
        ulp_dtype: pair.ulp_dtype().map(|d| d.name().to_string()),
        shape: info.shape.clone(),
        flat_index: e.flat_index,
        coords: e.coords,
        reference_value: e.reference_value,
        candidate_value: e.candidate_value,
        reference_bits: e.reference_bits,
        candidate_bits: e.candidate_bits,
        ulp: e.ulp,
        special: e.special,
        differing_elements: s.differing,
        total_elements: s.total,
        max_ulp: row.max_ulp,
        median_ulp: row.median_ulp,
        max_abs: Real(s.max_abs),
        max_rel: Real(s.max_rel),
        cosine: row.cosine,
        rel_l2: row.rel_l2,
    }
}

/// Max |reference − candidate| over elements `[start, end)` of a tensor present in both with
/// the same shape and comparable dtypes (the same, or two floats: real values, each in its
/// own dtype); infinite when a NaN or infinity differs there.
pub(crate) fn range_divergence(
    r: &Trace,
    c: &Trace,
    name: &str,
    rows: Option<(u64, u64)>,
) -> Option<f64> {
    let (ri, ci) = (r.tensor_info(name)?, c.tensor_info(name)?);
    let pair = Pair::new(ri.dtype, ci.dtype).filter(|_| ri.shape == ci.shape)?;
    let (rs, cs) = (ri.dtype.size(), ci.dtype.size());
    let (start, end) = row_range(ri, rows);
    let (a, b) = (
        &r.data(ri)[start as usize * rs..end as usize * rs],
        &c.data(ci)[start as usize * cs..end as usize * cs],
    );
    let (s, _) = numeric::scan(pair, a, b, false);
    if s.nan_mismatch + s.nan_payload + s.infinity > 0 {
        return Some(f64::INFINITY);
    }
    Some(s.max_abs)
}

/// The elements `[start, end)` of row `row` of `count` rows, when the tensor's first axis has
/// that many rows; else of the whole tensor.
pub(crate) fn row_range(info: &TensorInfo, rows: Option<(u64, u64)>) -> (u64, u64) {
    let n = info.element_count();
    match rows {
        Some((row, count)) if info.shape.first() == Some(&count) && count > 0 => {
            let width = n / count;
            (row * width, (row + 1) * width)
        }
        _ => (0, n),
    }
}

/// Exposed for tests and tools: the dtype's printed value for raw bits.
pub fn describe_bits(dtype: DType, bits: u64) -> (String, String) {
    (
        numeric::format_value(dtype, bits),
        numeric::hex_bits(dtype, bits),
    )
}

#[cfg(test)]
mod tests {
    /// docs/diff.md ("Memory") states what a row costs; a field must not grow it unnoticed.
    #[test]
    fn a_row_costs_what_the_docs_say() {
        assert_eq!(std::mem::size_of::<super::TensorRow>(), 272);
    }
}
