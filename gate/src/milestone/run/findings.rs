//! How a check's findings are made and judged: the differ's findings as gate findings, runs
//! that are not comparable, tokens that differ, and the milestone's declared divergences that
//! excuse a finding.
//!
//! Below every check (checks.rs, agrees.rs, port.rs), which share these; it imports none of
//! them.

use tracegate_diff::RowStatus;
use tracegate_trace::Trace;

use super::report::{finding, CheckResult, Finding, Status};
use crate::milestone::check::{Check, FindingKind};
use crate::milestone::milestones::MilestoneModel;

/// Splits findings into failing and excused by the milestone's declared divergences.
pub(super) fn judge(
    m: &MilestoneModel,
    prompt: &str,
    mut c: CheckResult,
    found: Vec<Finding>,
) -> CheckResult {
    for f in found {
        let declared = m.declared_divergences.iter().any(|d| {
            d.prompt == prompt
                && d.check == c.check
                && d.kind == f.kind
                && d.name == f.about.name
                && d.count == f.about.count
        });
        if declared {
            c.excused.push(f);
        } else {
            c.findings.push(f);
        }
    }
    if c.status == Status::Pass && !c.findings.is_empty() {
        c.status = Status::Fail;
    }
    c
}

/// The differ's own findings (structure, comparability), one gate finding each. Differing
/// values, decisions and policy breaks are left out: the gate states each of those itself with
/// its exact count, so a declared divergence must name the count and cannot excuse more.
pub(super) fn diff_findings(rep: &tracegate_diff::Report) -> Vec<Finding> {
    rep.findings
        .iter()
        // A note says how the comparison ran, not that anything differs.
        .filter(|f| {
            crate::bisect::judge::finding_class(f.kind) != crate::bisect::judge::FindingClass::Note
        })
        .filter(|f| {
            !matches!(
                f.kind,
                tracegate_diff::FindingKind::ValuesDiffer
                    | tracegate_diff::FindingKind::DecisionDiffers
                    | tracegate_diff::FindingKind::OutsidePolicy
            )
        })
        .map(|f| {
            finding(
                f.kind.into(),
                f.tensor().unwrap_or_default(),
                1,
                f.detail.clone(),
            )
        })
        .collect()
}

/// The gate finding kind of a tensor outside the policy or without a rule.
pub(super) fn policy_kind(status: RowStatus) -> Option<FindingKind> {
    match status {
        RowStatus::OutsidePolicy => Some(FindingKind::OutsidePolicy),
        RowStatus::NoRule => Some(FindingKind::NoRule),
        RowStatus::Identical
        | RowStatus::Different
        | RowStatus::WithinPolicy
        | RowStatus::DiffersByDigest
        | RowStatus::Unknown
        | RowStatus::Rerouted
        | RowStatus::AfterNearTie
        | RowStatus::AfterSamplingDivergence => None,
    }
}

/// Comparability comes before the tokens: equal tokens from runs on other weights, of another
/// prompt or seed, or by two oracles on different stacks (the differ's rule, docs/diff.md,
/// "Comparable") say nothing about the claim. Each refusal is a finding naming the other run
/// (or its tensor) and the reason; `(name, this, other)` per pair, `this` the run named `this`
/// (the engine; a port's candidate).
pub(super) fn incomparable(this: &str, pairs: &[(&str, &Trace, &Trace)]) -> Vec<Finding> {
    let mut found = Vec::new();
    for (name, a, b) in pairs {
        // Each side named as it is (`this` and `name`), never as a reference and a candidate:
        // a port's run against its golden trace once read "the reference's weights digest".
        let (refused, _) = tracegate_diff::comparable::check_sides(a, b, (this, name), false);
        found.extend(refused.into_iter().map(|f| {
            let about = f.tensor().map_or_else(|| name.to_string(), str::to_string);
            finding(
                f.kind.into(),
                about,
                1,
                format!("{this} vs {name}: {}", f.detail),
            )
        }));
    }
    found
}

/// A check whose runs are not comparable FAILS (never NOT CHECKED: the gate ran every producer
/// on the same checkpoint and prompt, so a trace that says otherwise is a producer gone wrong,
/// and a gate must not end "nothing failed" on it). No declared divergence excuses it.
pub(super) fn not_comparable(check: Check, refused: Vec<Finding>) -> CheckResult {
    let why: Vec<&str> = refused.iter().map(|f| f.detail.as_str()).collect();
    let mut c = CheckResult::new(
        check,
        Status::Fail,
        format!(
            "runs not comparable, tokens not compared: {}",
            why.join("; ")
        ),
    );
    c.findings = refused;
    c
}

/// The tokens of the run named `this` (`a`) against run `name`'s (`b`), counted by position.
pub(super) fn tokens_finding(this: &str, name: &str, a: &[i64], b: &[i64]) -> Option<Finding> {
    if a == b {
        return None;
    }
    let differ = a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    Some(finding(
        FindingKind::TokensDiffer,
        name,
        differ as u64,
        format!("{this} {a:?} vs {name} {b:?}"),
    ))
}
