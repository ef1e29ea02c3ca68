//! Phase 4 of [`crate::compare`], values: each common tensor's row — equal by digest, not
//! scanned, or scanned element by element — judged by the policy when there is one; the first
//! divergence with its element.

use tracegate_trace::{TensorInfo, Trace};

use crate::report::{Divergence, Method, RuleRef, TensorRow};
use crate::rows::{element, judge_row, noise_rows, row_for, set_stats, worst};
use crate::{
    noise, numeric, positions, Finding, FindingKind, Options, Pair, Real, Report, RowStatus,
    Special,
};

/// Scans common tensors in reference order; true if any is different (or fails the policy).
/// Each row is made by one of three phases — equal by digest, not scanned (after the first
/// difference), scanned — then judged.
pub(crate) fn values(r: &Trace, c: &Trace, opts: &Options, rep: &mut Report) -> bool {
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
        if positions::rerouted(ri, ci) {
            different |= rerouted_row(r, c, ri, ci, opts, rep);
            continue;
        }
        let Some(pair) = Pair::new(ri.dtype, ci.dtype).filter(|_| ci.shape == ri.shape) else {
            continue;
        };
        let digest_equal = trust_digests && !pair.is_mixed() && ri.digest == ci.digest;
        let data = (r.data(ri), c.data(ci));
        let mut row = if digest_equal {
            digest_row(ri, pair, rep)
        } else if stopped {
            not_scanned_row(ri, pair, trust_digests, rep)
        } else {
            let row = scanned_row(ri, pair, data, rep);
            // What follows a divergence is noise: a later change is not a finding by default
            // (--all scans and reports it); the JSON still lists which digests differ.
            stopped = !scan_all && row.differing_elements.is_some_and(|d| d > 0);
            row
        };
        different |= judge(ri, ci, pair, data, opts, &mut row, rep);
        rep.per_tensor.push(row);
    }
    different
}

/// Other tokens routed to this expert: compared on the positions both sides hold.
fn rerouted_row(
    r: &Trace,
    c: &Trace,
    ri: &TensorInfo,
    ci: &TensorInfo,
    opts: &Options,
    rep: &mut Report,
) -> bool {
    let Some(pair) = Pair::new(ri.dtype, ci.dtype) else {
        return false;
    };
    let (row, findings, _) = positions::judge(
        r,
        c,
        ri,
        ci,
        pair,
        opts.policy.as_ref(),
        &Default::default(),
    );
    rep.tensors.compared_elementwise.add();
    rep.findings.extend(findings);
    let different = !row.status.agrees();
    rep.per_tensor.push(row);
    different
}

/// Verified equal bytes: every statistic is known without reading them.
fn digest_row(ri: &TensorInfo, pair: Pair, rep: &mut Report) -> TensorRow {
    let mut row = row_for(ri, pair, Method::Digest, RowStatus::Identical);
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
    row
}

/// A tensor after the first difference, not read: known to differ when digests are trusted.
fn not_scanned_row(
    ri: &TensorInfo,
    pair: Pair,
    trust_digests: bool,
    rep: &mut Report,
) -> TensorRow {
    let status = if trust_digests {
        RowStatus::DiffersByDigest
    } else {
        RowStatus::Unknown
    };
    rep.tensors.not_scanned.add();
    if trust_digests {
        rep.tensors.known_different.add();
    }
    row_for(ri, pair, Method::NotScanned, status)
}

/// Every element compared; the first differing tensor also gives the first divergence, its
/// median ULP and its signed-zero / NaN / infinity findings.
fn scanned_row(
    ri: &TensorInfo,
    pair: Pair,
    (rd, cd): (&[u8], &[u8]),
    rep: &mut Report,
) -> TensorRow {
    // Only the first divergence reports a median: only its scan counts distances.
    let (s, ulps) = numeric::scan(pair, rd, cd, rep.first_divergence.is_none());
    rep.tensors.compared_elementwise.add();
    // Across dtypes nothing is bit-identical: equal values are still judged (policy) or
    // different (by bits).
    let identical = s.differing == 0 && !pair.is_mixed();
    let mut row = row_for(
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
    if s.differing > 0 && rep.first_divergence.is_none() {
        row.median_ulp = ulps
            .as_ref()
            .and_then(|u| numeric::median_ulp(pair, rd, cd, &s, u));
        rep.first_divergence = Some(divergence(ri, pair, rd, cd, &s, &row));
        specials_findings(ri, &s, rep);
    }
    row
}

/// Judges a row: by the policy's rule for the tensor under a policy (a row outside it gets its
/// worst element), else by bits. Pushes the finding and sets the status; true when it fails.
fn judge(
    ri: &TensorInfo,
    ci: &TensorInfo,
    pair: Pair,
    (rd, cd): (&[u8], &[u8]),
    opts: &Options,
    row: &mut TensorRow,
    rep: &mut Report,
) -> bool {
    let Some(policy) = opts.policy.as_ref() else {
        if row.status != RowStatus::Different {
            return false;
        }
        rep.findings.push(Finding::new(
            FindingKind::ValuesDiffer,
            Some(&ri.name),
            values_differ(pair, row),
        ));
        return true;
    };
    let Some((idx, rule)) = policy.rule_for(&ri.name, ci.attributes.path.as_deref()) else {
        rep.findings.push(Finding::new(
            FindingKind::NoPolicyRule,
            Some(&ri.name),
            "no rule in the policy matches this tensor",
        ));
        row.status = RowStatus::NoRule;
        return true;
    };
    // The noise-relative bound measures the noise reference on the same elements.
    let noise_rel_l2 = rule.max_noise_ratio.map(|_| {
        opts.noise
            .as_ref()
            .and_then(|n| noise::rel_l2(&n.0, ri, rd, &[(0, ri.element_count())]))
            .map(Real)
    });
    if row.status != RowStatus::Different {
        row.rule = Some(Box::new(RuleRef {
            index: idx,
            pattern: rule.pattern.clone(),
            noise_rel_l2,
            noise_rows: None,
        }));
        return false;
    }
    // Per token row too, where the whole tensor's noise is measured: a defect confined to one
    // row is diluted in the tensor's relative L2.
    let noise_rows = match (&opts.noise, noise_rel_l2) {
        (Some(n), Some(Some(_))) => Some(noise_rows(&n.0, ri, pair, (rd, cd), None)),
        _ => None,
    };
    row.rule = Some(Box::new(RuleRef {
        index: idx,
        pattern: rule.pattern.clone(),
        noise_rel_l2,
        noise_rows,
    }));
    let Some(f) = judge_row(row, idx, rule) else {
        return false;
    };
    rep.findings.push(f);
    // One more pass, over failing tensors only: where it fails most.
    row.worst_element =
        worst::locate(pair, rd, cd).map(|i| Box::new(element(pair, &ri.shape, rd, cd, i)));
    true
}

/// The `values_differ` finding's detail: the counts, and across dtypes the unit they compare in.
fn values_differ(pair: Pair, row: &TensorRow) -> String {
    let counts = format!(
        "{} of {} elements differ",
        row.differing_elements.unwrap_or(0),
        row.total_elements
    );
    match pair.ulp_dtype().filter(|_| pair.is_mixed()) {
        Some(unit) => format!(
            "reference {} vs candidate {}, compared in {unit} ULPs: {counts} in value (bit-identical does not exist across dtypes)",
            pair.reference, pair.candidate
        ),
        None => counts,
    }
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
        reference_dtype_ulp: e.reference_dtype_ulp,
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
