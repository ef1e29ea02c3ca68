//! A tensor's row of the report (`per_tensor`), the unit every phase above fills in and judges:
//! made empty ([`row_for`]), given a scan's statistics ([`set_stats`]), judged by a policy rule
//! ([`judge_row`]); an element of it shown with both values and bits ([`element`]), and where
//! its difference is worst (`worst`). Values makes the rows, positioned tensors (`positions`)
//! and the excusal (`excuse`) judge them again on fewer rows of tokens.

pub(crate) mod worst;

use tracegate_trace::TensorInfo;

use tracegate_trace::Trace;

use crate::report::{Element, Method, NoiseRow, NoiseRows, TensorRow};
use crate::{noise, numeric, policy, Finding, FindingKind, Pair, Real, RowStatus, Rule};

/// A tensor's token rows: its token axis by name (`names::token_axis`; `attn_probs` rows are
/// axis 1) and one position per row of it. A name outside the documented capture points (a
/// port's own, whose layout may be `[heads, tokens, …]`), or a tensor without one position per
/// row, has none: reading its first axis as tokens could take a head for a token.
pub(crate) struct TokenRows<'a> {
    /// Elements of the axes before the token axis, and after it.
    outer: u64,
    inner: u64,
    pub(crate) positions: &'a [i64],
}

impl<'a> TokenRows<'a> {
    pub(crate) fn of(ri: &'a TensorInfo) -> Option<TokenRows<'a>> {
        let axis = tracegate_trace::names::token_axis(&ri.name)?;
        let tokens = *ri.shape.get(axis)?;
        let positions = ri
            .attributes
            .positions
            .as_deref()
            .filter(|p| p.len() as u64 == tokens)?;
        Some(TokenRows {
            outer: ri.shape[..axis].iter().product(),
            inner: ri.shape[axis + 1..].iter().product(),
            positions,
        })
    }

    fn tokens(&self) -> u64 {
        self.positions.len() as u64
    }

    /// The element ranges of the rows `keep` holds (one flag per row), runs of kept rows
    /// merged, for every index of the axes before the token axis.
    pub(crate) fn ranges(&self, keep: &[bool]) -> Vec<(u64, u64)> {
        let tokens = self.tokens();
        let mut out = Vec::new();
        for o in 0..self.outer {
            let mut i = 0;
            while i < tokens {
                if !keep[i as usize] {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < tokens && keep[i as usize] {
                    i += 1;
                }
                let base = o * tokens;
                out.push(((base + start) * self.inner, (base + i) * self.inner));
            }
        }
        out
    }

    /// The element ranges of row `t` alone.
    fn row(&self, t: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let (tokens, inner) = (self.tokens(), self.inner);
        (0..self.outer).map(move |o| ((o * tokens + t) * inner, (o * tokens + t + 1) * inner))
    }
}

/// The noise-relative measure per token row (docs/diff.md, "Noise-relative bound") of the rows
/// `keep` holds (all, or those a near-tie left in): each row's candidate relative L2 over the
/// noise reference's on the same row. `NoiseRows::None` for a tensor without token rows.
pub(crate) fn noise_rows(
    noise: &Trace,
    ri: &TensorInfo,
    pair: Pair,
    (rd, cd): (&[u8], &[u8]),
    keep: Option<&[bool]>,
) -> NoiseRows {
    let Some(layout) = TokenRows::of(ri) else {
        return NoiseRows::None;
    };
    let (mut rows, mut undefined) = (0, 0);
    let (mut worst, mut first_undefined): (Option<NoiseRow>, Option<i64>) = (None, None);
    for (t, &position) in layout.positions.iter().enumerate() {
        if keep.is_some_and(|k| !k[t]) {
            continue;
        }
        rows += 1;
        let ranges: Vec<(u64, u64)> = layout.row(t as u64).collect();
        let mut s = numeric::Stats::default();
        for &r in &ranges {
            s = s.merge(numeric::scan_range(pair, rd, cd, r, r));
        }
        let (c, n) = (s.rel_l2(), noise::rel_l2(noise, ri, rd, &ranges));
        match (noise::ratio(c, n), c, n) {
            (Some(ratio), Some(c), Some(n)) => {
                if worst.is_none_or(|w| ratio > w.ratio.0) {
                    worst = Some(NoiseRow {
                        position,
                        ratio: Real(ratio),
                        rel_l2: Real(c),
                        noise_rel_l2: Real(n),
                    });
                }
            }
            _ => {
                undefined += 1;
                first_undefined = first_undefined.or(Some(position));
            }
        }
    }
    NoiseRows::Rows {
        rows,
        worst,
        undefined,
        first_undefined,
    }
}

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
    let noise_rows = match row.rule.as_ref().and_then(|r| r.noise_rows.as_ref()) {
        Some(NoiseRows::Rows {
            worst,
            first_undefined,
            ..
        }) => Some(policy::RowRatios {
            worst: worst.map(|w| (w.position, w.ratio.0)),
            first_undefined: *first_undefined,
        }),
        _ => None,
    };
    let m = policy::Measured {
        noise_ratio: noise::ratio(row.rel_l2.map(|x| x.0), noise_rel_l2.map(|x| x.0)),
        noise_rows,
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
