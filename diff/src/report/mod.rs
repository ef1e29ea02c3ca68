//! The report a comparison returns, and its JSON form (docs/diff-report.schema.json): the
//! verdict, both sides, what was compared and what was found. The per-tensor rows and the
//! first divergence are in `tensors`, the decision results in `decisions`; the words shared
//! with other crates (verdict, statuses, finding kinds, the number form [`Real`](crate::Real)) in
//! `crate::words`.

mod decisions;
mod passing;
mod tensors;

use serde::{Serialize, Serializer};

pub use decisions::{
    DecisionDivergence, DecisionResult, DecisionSummary, Flip, MarginDifference, NearTieRef,
    NearTieSummary, RowsAfter, SamplingDivergence,
};
pub use passing::PassingBounds;
pub use tensors::{
    Count, Divergence, Element, Method, NoiseRow, NoiseRows, RowSet, RuleRef, TensorRow,
    TensorSummary, TensorViolation,
};

use crate::{FilterSummary, FindingKind, Options, Rule, Verdict};
use tensors::TensorsJson;

/// The JSON report's format, its top-level `schema` (docs/diff-report.schema.json describes it).
pub const REPORT_SCHEMA: &str = "tracegate-diff-report/4";

#[derive(Clone, Debug, Serialize)]
pub struct Side {
    pub path: Option<String>,
    /// Whole-trace content digest (hex), null when the file could not be read.
    pub digest: Option<String>,
    pub producer: Option<String>,
    /// True when every digest was recomputed and matched.
    pub verified: bool,
}

/// One thing a comparison found, and the tensor or decision it is about, if any (JSON
/// `{kind, tensor, detail}`). The gate's own findings are its own type.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Finding {
    pub kind: FindingKind,
    #[serde(flatten)]
    pub about: OnTensor,
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
    /// The precision the policy's bounds are for (its `candidate_dtype`), when it says.
    pub candidate_dtype: Option<String>,
    /// The precision the candidate computed in (`policy::computes_in`), when it says.
    pub candidate_computes_in: Option<String>,
    /// `--noise-reference`: the trace the `max_noise_ratio` bounds measured against.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_reference: Option<String>,
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
        let mut st = s.serialize_struct("Report", 15)?;
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
        st.serialize_field("passing_bounds", &self.passing_bounds())?;
        st.serialize_field("first_bit_difference", &self.first_divergence)?;
        st.serialize_field("first_decision_divergence", &self.first_decision_divergence)?;
        st.serialize_field("per_tensor", &self.per_tensor)?;
        st.serialize_field("findings", &self.findings)?;
        st.end()
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

    pub(crate) fn empty(reference: Side, candidate: Side, opts: &Options) -> Report {
        Report {
            verdict: Verdict::Identical,
            reference,
            candidate,
            policy: opts.policy.as_ref().map(|p| PolicyRef {
                name: p.name.clone(),
                rules: p.rules.len(),
                bounds: p.rules.clone(),
                candidate_dtype: p.candidate_dtype.clone(),
                candidate_computes_in: None,
                noise_reference: opts
                    .noise
                    .as_ref()
                    .map(|n| n.0.path().display().to_string()),
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
