//! How the common tensors compared: the summary of how each was compared, one row per tensor
//! (the layer curve), an element as both sides hold it, the first divergence, and a tensor
//! outside the policy.

use serde::{Serialize, Serializer};
use tracegate_trace::DType;

use crate::{Real, Report, RowStatus, Special, Violation};

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
    pub(crate) fn add(&mut self) {
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
    pub(super) fn holds(self, r: &TensorRow) -> bool {
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

pub(super) struct TensorsJson<'a>(pub(super) &'a Report);

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
    /// A mixed pair counted in the candidate's coarser dtype: this element's distance in the
    /// reference dtype's ULPs too (an f16 candidate at 0 f16 ULP can be thousands of f32 ULP,
    /// which an f32 policy judges); absent otherwise (numeric::reference_dtype_distance).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_dtype_ulp: Option<u64>,
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

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RuleRef {
    pub index: usize,
    pub pattern: String,
    /// Under a rule with `max_noise_ratio`: the noise reference's relative L2 against the
    /// reference over the elements judged (null when it has none for them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_rel_l2: Option<Option<Real>>,
    /// Under a rule with `max_noise_ratio`, for a tensor that differs and whose noise measure is
    /// defined: the same ratio per token row (docs/diff.md, "Noise-relative bound"), or that the
    /// tensor has no row layout and the whole-tensor ratio alone judged it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub noise_rows: Option<NoiseRows>,
}

/// The noise-relative bound per token row: a defect confined to one row is diluted in the
/// tensor's relative L2, never in its own row's.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(tag = "layout", rename_all = "snake_case")]
pub enum NoiseRows {
    /// One row per position of the tensor's token axis (`attn_probs`: axis 1).
    Rows {
        /// Rows measured (those a near-tie left in).
        rows: u64,
        /// The row with the largest defined ratio; null when no row has one.
        worst: Option<NoiseRow>,
        /// Rows whose ratio is undefined (the noise reference exact on the row while the
        /// candidate is not, or a side's relative L2 undefined there), and the first of them:
        /// the rule's own `max_noise_ratio` fails such a row, the policy's `noise_ratio` is no
        /// bound on it by itself.
        undefined: u64,
        first_undefined: Option<i64>,
    },
    /// No token axis by name, or not one position per row of it: the whole-tensor ratio alone.
    None,
}

/// One token row's noise-relative measure.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct NoiseRow {
    pub position: i64,
    /// The candidate's relative L2 over the noise reference's, on this row.
    pub ratio: Real,
    pub rel_l2: Real,
    pub noise_rel_l2: Real,
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
    /// A mixed pair counted in the candidate's coarser dtype: this element's distance in the
    /// reference dtype's ULPs too (an f16 candidate at 0 f16 ULP can be thousands of f32 ULP,
    /// which an f32 policy judges); absent otherwise (numeric::reference_dtype_distance).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference_dtype_ulp: Option<u64>,
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
            reference_dtype_ulp: self.reference_dtype_ulp,
            special: self.special,
        }
    }
}

/// A tensor outside the policy, as every report states it: trace-diff's `first_violation`,
/// the gate's `oracle.first_violation`, bisect's `whole_run.first_violation`. Its `Display`,
/// the one line the gate and bisect print after the tensor's name, is "relative L2 0.23 >
/// 0.0001 (rule #3 layer.*.mlp_out); worst at [0,0]: …" (written in `render/human.rs`, beside
/// the element's line it ends with).
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

#[cfg(test)]
mod tests {
    /// docs/diff.md ("Memory") states what a row costs; a field must not grow it unnoticed.
    #[test]
    fn a_row_costs_what_the_docs_say() {
        assert_eq!(std::mem::size_of::<super::TensorRow>(), 272);
    }
}
