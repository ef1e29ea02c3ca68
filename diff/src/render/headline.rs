//! The summary line every human report starts with: the verdict and what decided it.

use super::{coords, thousands};
use crate::{FindingKind, Report, RowStatus, TensorRow, Verdict};

/// " (block 0 step 3 layer 01)" for a name of a block-diffusion trace, as its place in the run.
fn place(name: &str) -> String {
    crate::passes::in_words(name)
        .map(|w| format!(" ({w})"))
        .unwrap_or_default()
}

/// The sampling divergence, loudly: what was not judged after it and how to judge it.
pub(super) fn sampling_note(rep: &Report) -> Option<String> {
    let s = rep.decisions.sampling_divergence.as_ref()?;
    let step = s.step.map(|x| format!(" step {x}")).unwrap_or_default();
    Some(format!(
        "sampling divergence at {} rows {:?} (rng {:?} vs {:?}): {} tensors, {} decisions after the sampling divergence at block {}{step}: not judged; force the candidate with --force-decisions REF to compare them",
        s.decision, s.rows, s.reference_rng, s.candidate_rng, s.tensors_not_judged, s.decisions_not_judged, s.block
    ))
}

fn decisions_clause(rep: &Report) -> String {
    let d = &rep.decisions;
    let n = d.reference_count;
    if d.differing == 0 && d.missing.is_empty() && d.extra.is_empty() && d.compared == n {
        format!("{n} decision{}", if n == 1 { "" } else { "s" })
    } else {
        let mut s = format!("{} of {} decisions differ", d.differing, n);
        let mut notes = Vec::new();
        let uncompared = n.saturating_sub(d.compared + d.missing.len());
        if uncompared > 0 {
            notes.push(format!("{uncompared} not compared: shape differs"));
        }
        if !d.missing.is_empty() || !d.extra.is_empty() {
            notes.push(format!(
                "{} missing, {} extra",
                d.missing.len(),
                d.extra.len()
            ));
        }
        notes.extend(near_ties_note(rep));
        if !notes.is_empty() {
            s += &format!(" ({})", notes.join("; "));
        }
        s
    }
}

/// "2 near-ties excused: layer.00.router.topk row 5, …; 14 rows after a near-tie not judged",
/// so a verdict never hides what it excused.
fn near_ties_note(rep: &Report) -> Option<String> {
    let n = rep
        .decisions
        .near_ties
        .as_ref()
        .filter(|n| !n.excused.is_empty())?;
    const SHOWN: usize = 3;
    let mut which: Vec<String> = n
        .excused
        .iter()
        .take(SHOWN)
        .map(|e| format!("{} row {}", e.decision, e.row))
        .collect();
    if n.excused.len() > SHOWN {
        which.push(format!("{} more", n.excused.len() - SHOWN));
    }
    let k = n.excused.len();
    let rows = n.rows_after();
    Some(format!(
        "{k} near-tie{} excused: {}; {rows} row{} after a near-tie not judged",
        if k == 1 { "" } else { "s" },
        which.join(", "),
        if rows == 1 { "" } else { "s" }
    ))
}

pub(super) fn summary(rep: &Report) -> String {
    let t = &rep.tensors;
    let common = rep.per_tensor.len();
    let judged = |word: &str| {
        let count = |s: RowStatus| rep.per_tensor.iter().filter(|r| r.status == s).count();
        let (within, left_out) = (
            count(RowStatus::WithinPolicy),
            count(RowStatus::AfterNearTie),
        );
        let sampled = count(RowStatus::AfterSamplingDivergence);
        let after = if left_out > 0 {
            format!(", {left_out} after a near-tie not judged")
        } else {
            String::new()
        };
        let after = if sampled > 0 {
            format!("{after}, {sampled} after the sampling divergence not judged")
        } else {
            after
        };
        let sampling = sampling_note(rep)
            .map(|n| format!("; {n}"))
            .unwrap_or_default();
        format!(
            "{word} — {common} tensors judged by policy {:?}{} ({} bit-identical, {within} within bounds{after}), {}{sampling}{}",
            rep.policy.as_ref().map(|p| p.name.as_str()).unwrap_or(""),
            rep.policy.as_ref().map(precision_clause).unwrap_or_default(),
            common - within - left_out - sampled,
            decisions_clause(rep),
            claim_notes(rep)
        )
    };
    match rep.verdict {
        // What came before the first differing draw is within the policy; what came after was
        // not compared (docs/diff.md, "Sampling divergence").
        Verdict::Incomparable if rep.decisions.sampling_divergence.is_some() => {
            judged("INCOMPARABLE past the sampling divergence")
        }
        Verdict::Unreadable | Verdict::Incomparable => {
            let word = if rep.verdict == Verdict::Unreadable { "UNREADABLE" } else { "INCOMPARABLE" };
            let refusals: Vec<_> = rep.findings.iter().filter(|f| f.kind != FindingKind::StackMismatchAllowed).collect();
            let first = refusals.first().map(|f| match f.tensor() {
                Some(t) => format!("{} ({t}): {}", f.kind, f.detail),
                None => format!("{}: {}", f.kind, f.detail),
            });
            let more = if refusals.len() > 1 { format!(" (+{} more)", refusals.len() - 1) } else { String::new() };
            format!("{word} — {}{more}", first.unwrap_or_default())
        }
        Verdict::Identical => format!(
            "IDENTICAL — {common} tensors ({} by digest, {} element-wise), 0 differing elements, {}",
            t.matched_by_digest.len(),
            t.compared_elementwise.len(),
            decisions_clause(rep)
        ),
        Verdict::WithinPolicy => judged("WITHIN POLICY"),
        // Exit 4: nothing judged failed, but the rows after an excused near-tie were not
        // judged; forcing the reference's decisions compares them (docs/diff.md).
        Verdict::NotChecked => format!(
            "{}; to judge them, re-run the candidate with the reference's decisions forced (--force-decisions REFERENCE)",
            judged("NOT CHECKED past a near-tie")
        ),
        Verdict::Different => {
            let mut parts = Vec::new();
            if let Some(p) = &rep.policy {
                // Under a policy bits are not the question (the first bit difference may be
                // rounding noise within it): the headline names the first tensor outside it.
                parts.extend(policy_clauses(rep));
                if p.candidate_dtype.is_some()
                    && p.candidate_computes_in.is_some()
                    && p.candidate_dtype != p.candidate_computes_in
                {
                    parts.push(format!("policy {:?}{}", p.name, precision_clause(p)));
                }
            } else if let Some(d) = &rep.first_divergence {
                let dist = match (d.special, d.ulp) {
                    (Some(s), _) if d.ulp.is_none() || d.ulp == Some(0) => s.describe().to_string(),
                    // Across dtypes the unit is named: the coarser dtype's ULPs.
                    (_, Some(u)) if d.candidate_dtype != d.dtype => format!("{} ULP ({})", thousands(u), d.ulp_dtype.as_deref().unwrap_or("-")),
                    (_, Some(u)) if d.ulp_dtype.is_some() => format!("{} ULP", thousands(u)),
                    (_, Some(u)) => format!("|diff| {}", thousands(u)),
                    _ => String::new(),
                };
                parts.push(format!(
                    "first at {}[{}]{}: {} ({}) vs {} ({}), {} ({}/{} elements differ)",
                    d.tensor,
                    coords(&d.coords),
                    place(&d.tensor),
                    d.reference_value,
                    d.reference_bits,
                    d.candidate_value,
                    d.candidate_bits,
                    dist,
                    thousands(d.differing_elements),
                    thousands(d.total_elements)
                ));
            } else if common > 0 && rerouted_clause(rep).is_none() {
                // Equal values in two dtypes are not identical: say so, not "identical".
                match rep.per_tensor.iter().filter(|r| r.candidate_dtype.name() != r.dtype).count() {
                    0 => parts.push(format!("values identical in all {common} common tensors")),
                    mixed => parts.push(format!("values equal in all {common} common tensors, {mixed} of them in two dtypes (never bit-identical)")),
                }
            }
            if rep.policy.is_none() {
                parts.extend(rerouted_clause(rep));
            }
            let structural = rep
                .findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::MissingTensor
                            | FindingKind::ExtraTensor
                            | FindingKind::DtypeMismatch
                            | FindingKind::ShapeMismatch
                            | FindingKind::OrderMismatch
                            | FindingKind::DecisionOrderMismatch
                            | FindingKind::DecisionShapeMismatch
                            | FindingKind::PrecisionDeclarationRefused
                    )
                })
                .count();
            if structural > 0 {
                parts.push(format!("{structural} structure finding{}", if structural == 1 { "" } else { "s" }));
            }
            // Content beyond values and decision rows: otherwise this line could read as equal.
            let content: Vec<&str> = rep
                .findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::AttributeDiffers
                            | FindingKind::MarginDiffers
                            | FindingKind::MarginPresenceMismatch
                            | FindingKind::ContentDigestDiffers
                    )
                })
                .map(|f| f.kind.as_str())
                .collect();
            if let Some(first) = content.first() {
                parts.push(format!("{} content finding{} (first: {})", content.len(), if content.len() == 1 { "" } else { "s" }, first.replace('_', " ")));
            }
            parts.extend(crate::rounding::headline(rep));
            parts.push(decisions_clause(rep));
            parts.extend(sampling_note(rep));
            format!("DIFFERENT — {}{}", parts.join("; "), claim_notes(rep))
        }
    }
}

/// The headline's account of the tensors under a policy: how many fail, and the first
/// violation with its first broken bound; else that every tensor is within it.
fn policy_clauses(rep: &Report) -> Vec<String> {
    let common = rep.per_tensor.len();
    let mut parts = Vec::new();
    let outside = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::OutsidePolicy)
        .count();
    if let Some(v) = rep.first_violation() {
        let more = match v.violations.len() {
            0 | 1 => String::new(),
            n => format!(" (+{} more bound{})", n - 1, if n == 2 { "" } else { "s" }),
        };
        let bound = v
            .violations
            .first()
            .map(|b| b.to_string())
            .unwrap_or_default();
        let rule = v
            .rule
            .as_ref()
            .map(|x| format!(" by rule #{} {}", x.index, x.pattern))
            .unwrap_or_default();
        parts.push(format!(
            "{outside} of {common} tensors outside the policy, first {}{}: {bound}{more}{rule}",
            v.tensor,
            place(&v.tensor)
        ));
    }
    let unruled: Vec<&TensorRow> = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::NoRule)
        .collect();
    if let Some(first) = unruled.first() {
        let n = unruled.len();
        parts.push(format!(
            "{n} tensor{} without a policy rule (first: {})",
            if n == 1 { "" } else { "s" },
            first.tensor
        ));
    }
    parts.extend(rerouted_clause(rep));
    if parts.is_empty() && common > 0 {
        let count = |s: RowStatus| rep.per_tensor.iter().filter(|r| r.status == s).count();
        let within = count(RowStatus::WithinPolicy);
        let left_out = count(RowStatus::AfterNearTie) + count(RowStatus::AfterSamplingDivergence);
        let after = if left_out > 0 {
            format!(", {left_out} not judged")
        } else {
            String::new()
        };
        parts.push(format!(
            "all {common} tensors within the policy ({} bit-identical, {within} within bounds{after})",
            common - within - left_out
        ));
    }
    parts
}

/// Expert tensors the routing sent other tokens (docs/diff.md, "Rerouted experts"): they fail
/// even where every row both sides hold is equal, so the headline names them.
fn rerouted_clause(rep: &Report) -> Option<String> {
    let rerouted: Vec<&TensorRow> = rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::Rerouted)
        .collect();
    let n = rerouted.len();
    rerouted.first().map(|first| {
        format!(
            "{n} expert tensor{} rerouted (first: {})",
            if n == 1 { "" } else { "s" },
            first.tensor
        )
    })
}

/// What the candidate stores against the claimed precision, said in the headline: a pass
/// judged by looser bounds than the candidate's own computation needs is no silent one.
fn claim_notes(rep: &Report) -> String {
    rep.findings
        .iter()
        .filter(|f| f.kind == FindingKind::PrecisionClaim)
        .map(|f| format!("; WARNING: {}", f.detail))
        .collect()
}

/// " (for bf16 candidates; this one computes in f32: WARNING, they differ)", from what the
/// policy and the candidate's provenance say; empty when neither says.
fn precision_clause(p: &crate::PolicyRef) -> String {
    match (
        p.candidate_dtype.as_deref(),
        p.candidate_computes_in.as_deref(),
    ) {
        (Some(w), Some(h)) if w != h => {
            format!(" (for {w} candidates; this one computes in {h}: WARNING, they differ)")
        }
        (Some(w), Some(_)) => format!(" (for {w} candidates, as this one)"),
        (Some(w), None) => format!(" (for {w} candidates; this one does not say)"),
        (None, Some(h)) => {
            format!(" (this candidate computes in {h}; the policy does not say for what)")
        }
        (None, None) => String::new(),
    }
}
