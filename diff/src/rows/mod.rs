//! A tensor's row of the report (`per_tensor`), the unit every phase above fills in and judges:
//! made empty ([`row_for`]), given a scan's statistics ([`set_stats`]), judged by a policy rule
//! ([`judge_row`]); an element of it shown with both values and bits ([`element`]), and where
//! its difference is worst (`worst`). Values makes the rows, positioned tensors (`positions`)
//! and the excusal (`excuse`) judge them again on fewer rows of tokens.

pub(crate) mod worst;

use tracegate_trace::TensorInfo;

use crate::report::{Element, Method, TensorRow};
use crate::{noise, numeric, policy, Finding, FindingKind, Pair, Real, RowStatus, Rule};

/// The row of `info` compared as `pair` by `method`, with `status` and nothing measured yet.
pub(crate) fn row_for(
    info: &TensorInfo,
    pair: Pair,
    method: Method,
    status: RowStatus,
) -> TensorRow {
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
    let noise_rel_l2 = row.rule.as_ref().and_then(|r| r.noise_rel_l2.flatten());
    let m = policy::Measured {
        noise_ratio: noise::ratio(row.rel_l2.map(|x| x.0), noise_rel_l2.map(|x| x.0)),
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

/// Element `idx` of a tensor both traces hold with the same shape: each value and its bits in
/// its own dtype, the distance in the pair's ULPs (the coarser dtype's for a mixed pair).
pub(crate) fn element(pair: Pair, shape: &[u64], rd: &[u8], cd: &[u8], idx: u64) -> Element {
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
        reference_dtype_ulp: special
            .is_none()
            .then(|| numeric::reference_dtype_distance(pair, a, b))
            .flatten(),
        special,
    }
}
