//! Positioned tensors: a tensor whose rows are tokens lists them in its `positions` attribute,
//! one absolute position a row. Here: how a list of positions is shown, the rule that a list
//! names each position once (strictly increasing), and experts matched by position.
//!
//! Rerouted experts (docs/diff.md, "Rerouted experts"). An expert's tensor
//! `layer.NN.expert.EEE.*` holds one row per token routed to it, listed in its `positions`. A
//! router row that differs sends its token to other experts, so the two traces' lists differ:
//! that follows from the decision, it is not another computation. Such a pair is compared on
//! the positions both hold (row by row, matched by position); a position only one side holds
//! is excused when its token comes after a near-tie, and is otherwise a `rerouted` finding.

use std::collections::{BTreeSet, HashMap};

use tracegate_trace::names::{self, Name};
use tracegate_trace::{TensorInfo, Trace};

use crate::rows::{judge_row, row_for, set_stats};
use crate::{numeric, Finding, FindingKind, Method, Policy, RowStatus, RuleRef, TensorRow};

/// A list of positions in a finding: whole up to 8, else its ends and its length.
pub(crate) fn describe(p: &Option<Vec<i64>>) -> String {
    match p {
        None => "absent".into(),
        Some(v) if v.len() <= 8 => format!("{v:?}"),
        Some(v) => format!(
            "[{}, {}, … {} positions, …, {}]",
            v[0],
            v[1],
            v.len(),
            v[v.len() - 1]
        ),
    }
}

/// Rows are indexed by absolute position, one position a row: the first `i` whose next entry
/// `p[i + 1]` does not come after `p[i]` (a repeat, or a step back), if any.
pub(crate) fn not_increasing(p: &[i64]) -> Option<usize> {
    p.windows(2).position(|w| w[0] >= w[1])
}

/// `layer.NN.expert.EEE.<point>` of the prefill (docs/capture-points.md).
pub(crate) fn is_expert(name: &str) -> bool {
    let n = Name::parse(name);
    n.decode_step.is_none() && n.expert.is_some() && !n.point.is_empty()
}

/// An expert tensor whose two sides hold different positions, each token-major with one row
/// per listed position and rows of one shape: comparable on the positions both hold. Any other
/// positions mismatch is still a refusal. The dtypes are Structure's question (two float dtypes
/// compare by value), not this one.
pub(crate) fn rerouted(r: &TensorInfo, c: &TensorInfo) -> bool {
    let (Some(rp), Some(cp)) = (&r.attributes.positions, &c.attributes.positions) else {
        return false;
    };
    rp != cp
        && is_expert(&r.name)
        && r.shape.first() == Some(&(rp.len() as u64))
        && c.shape.first() == Some(&(cp.len() as u64))
        && r.shape[1..] == c.shape[1..]
}

/// A rerouted tensor's row and findings, its rows of tokens in `excused` left out of the
/// judgement; and how many positions were left out that way.
pub(crate) fn judge(
    r: &Trace,
    c: &Trace,
    ri: &TensorInfo,
    ci: &TensorInfo,
    pair: numeric::Pair,
    policy: Option<&Policy>,
    excused: &BTreeSet<i64>,
) -> (TensorRow, Vec<Finding>, u64) {
    let (rp, cp) = (
        ri.attributes.positions.as_deref().unwrap_or_default(),
        ci.attributes.positions.as_deref().unwrap_or_default(),
    );
    let width: u64 = ri.shape[1..].iter().product();
    let (rd, cd) = (r.data(ri), c.data(ci));
    let in_c: HashMap<i64, u64> = cp.iter().enumerate().map(|(j, &p)| (p, j as u64)).collect();
    let in_r: BTreeSet<i64> = rp.iter().copied().collect();
    let mut stats = numeric::Stats::default();
    // Non-finite differences in the rows left out: never excused (docs/diff.md, "Near-ties
    // under a policy"), so counted into the row whatever the near-tie says.
    let mut hidden = numeric::Stats::default();
    let (mut only_r, mut only_c, mut left_out) = (Vec::new(), Vec::new(), 0u64);
    for (i, p) in rp.iter().enumerate() {
        let i = i as u64;
        match in_c.get(p) {
            Some(&j) => {
                let scanned = numeric::scan_range(
                    pair,
                    rd,
                    cd,
                    (i * width, (i + 1) * width),
                    (j * width, (j + 1) * width),
                );
                if excused.contains(p) {
                    left_out += 1;
                    hidden = hidden.merge(scanned);
                } else {
                    stats = stats.merge(scanned);
                }
            }
            None if excused.contains(p) => left_out += 1,
            None => only_r.push(*p),
        }
    }
    for (j, p) in cp.iter().enumerate().filter(|(_, p)| !in_r.contains(p)) {
        if excused.contains(p) {
            left_out += 1;
            // A row only the candidate holds has no reference value: a NaN or an infinity in
            // it is a difference all the same.
            let j = j as u64;
            for k in j * width..(j + 1) * width {
                let v = numeric::element_value(ci.dtype, cd, k);
                hidden.nan_mismatch += v.is_nan() as u64;
                hidden.infinity += v.is_infinite() as u64;
            }
        } else {
            only_c.push(*p);
        }
    }
    let nonfinite = hidden.nan_mismatch + hidden.nan_payload + hidden.infinity;

    let mut row = row_for(
        ri,
        pair,
        Method::Elementwise,
        if stats.differing == 0 && nonfinite == 0 {
            RowStatus::Identical
        } else {
            RowStatus::Different
        },
    );
    set_stats(&mut row, &stats);
    row.nan_mismatch += hidden.nan_mismatch;
    row.nan_payload += hidden.nan_payload;
    row.infinity += hidden.infinity;
    let mut findings = Vec::new();
    let rule = policy.map(|p| p.rule_for(&ri.name, ci.attributes.path.as_deref()));
    if let Some(Some((idx, rule))) = &rule {
        row.rule = Some(Box::new(RuleRef {
            index: *idx,
            pattern: rule.pattern.clone(),
            // Rows routed by position on each side: no noise measure pairs with them, so a
            // noise-relative bound is undefined here (fails), never assumed.
            noise_rel_l2: rule.max_noise_ratio.map(|_| None),
            noise_rows: None,
        }));
    }
    if !only_r.is_empty() || !only_c.is_empty() {
        // Tokens routed differently and not after a near-tie: the router decision of this
        // layer (or an earlier one) differs there, and these rows cannot be compared.
        row.status = RowStatus::Rerouted;
        let layer = Name::parse(&ri.name).layer.unwrap_or_default();
        let router = names::layer(layer, "router.topk");
        let detail = format!(
            "other tokens routed here ({router} or an earlier router differs): positions {} only in the reference, {} only in the candidate{}",
            show(&only_r),
            show(&only_c),
            if policy.is_some() { ", not after a near-tie" } else { "" }
        );
        findings.push(Finding::new(FindingKind::Rerouted, Some(&ri.name), detail));
    } else if let Some(rule) = rule {
        match rule {
            None => {
                row.status = RowStatus::NoRule;
                findings.push(Finding::new(
                    FindingKind::NoPolicyRule,
                    Some(&ri.name),
                    "no rule in the policy matches this tensor",
                ));
            }
            Some((idx, rule)) if row.status == RowStatus::Different => {
                findings.extend(judge_row(&mut row, idx, rule))
            }
            Some(_) => {}
        }
    } else if row.status == RowStatus::Different {
        findings.push(Finding::new(
            FindingKind::ValuesDiffer,
            Some(&ri.name),
            format!(
                "{} elements differ in the rows of the positions both sides hold",
                stats.differing
            ),
        ));
    }
    // Rows matched by position on each side: no single element index names the worst.
    row.worst_element = None;
    (row, findings, left_out)
}

fn show(p: &[i64]) -> String {
    describe(&Some(p.to_vec()))
}
