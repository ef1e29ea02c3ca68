//! The cached decode path against the candidate's own full recompute.

use tracegate_diff::{compare, FindingKind, Report, Verdict};
use tracegate_producers::{RunRecord, Verb};

use super::{decode_view, step_of, CacheCheck, CacheStatus, Context};
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill as b;
use crate::bisect::work::candidate_trace;

/// The candidate's `--cache off` run against its own cached run, decode steps only, judged as
/// the whole runs are.
pub(super) fn cache_check(
    o: &BisectOptions,
    c: &Context,
    s: usize,
    runs: &mut Vec<RunRecord>,
) -> CacheCheck {
    let rel = format!("{}/candidate.uncached.trace", o.work);
    let mut check = CacheCheck {
        status: CacheStatus::NotChecked,
        trace: None,
        first_step: None,
        first_tensor: None,
        detail: None,
        reason: None,
    };
    let verb = Verb::Trace {
        model: o.model.clone(),
        tokens: o.tokens.clone(),
        out: rel.clone(),
        internals: o.internals,
        generate: o.generate,
        cache: false,
        force: None,
        seed: None,
        shards: None,
    };
    let (rec, _) = candidate_trace(o, &verb);
    runs.push(rec.clone());
    crate::progress::step("decode: candidate traced with --cache off");
    if !rec.ok {
        check.reason = Some(format!(
            "the candidate's trace verb failed with --cache off: {} ($ {})",
            rec.why()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" | "),
            rec.invocation
        ));
        return check;
    }
    let uncached = match b::open(&o.root, &rel) {
        Ok(t) => t,
        Err(e) => {
            check.reason = Some(e.to_string());
            return check;
        }
    };
    check.trace = Some(rel.clone());
    // The full recompute is the reference side: the cached path is what is being checked.
    let opts = decode_view(c);
    let rep = compare(&uncached, c.candidate, &opts);
    // A refused comparison compared nothing: it cannot agree.
    if matches!(rep.verdict, Verdict::Incomparable | Verdict::Unreadable) {
        let why: Vec<String> = rep.findings.iter().map(b::describe).collect();
        check.reason = Some(format!(
            "the candidate's --cache off trace {rel} cannot be compared with its cached run ({}): {}",
            rep.verdict,
            why.join("; ")
        ));
        return check;
    }
    let tensors = b::rows(&rep);
    let bad_t = tensors
        .iter()
        .filter(|t| t.status.is_bad())
        .filter_map(|t| step_of(&t.tensor).map(|s| (s, t)))
        .min_by_key(|(s, _)| *s);
    let bad_d = b::decisions(&rep)
        .into_iter()
        .filter(|x| x.judged_rows() > 0)
        .filter_map(|x| step_of(&x.name).map(|s| (s, x.name)))
        .min_by_key(|(s, _)| *s);
    let first = match (bad_t, bad_d) {
        (Some((st, t)), Some((sd, _))) if st <= sd => Some((st, t.tensor.clone(), Some(t))),
        (_, Some((sd, name))) => Some((sd, name, None)),
        (Some((st, t)), None) => Some((st, t.tensor.clone(), Some(t))),
        (None, None) => None,
    };
    match first {
        Some((at, name, t)) if at <= s => {
            check.status = CacheStatus::Disagrees;
            check.first_step = Some(at);
            check.first_tensor = Some(name);
            check.detail = t.map(|t| {
                format!(
                    "{}/{} elements, max {} ULP, rel L2 {}",
                    b::thousands(t.differing_elements.unwrap_or(0)),
                    b::thousands(t.total_elements),
                    b::ulps(t.max_ulp),
                    b::sci(t.rel_l2)
                )
            });
        }
        // Agreeing needs steps 0..=s compared on both sides: a run that holds none of them, or
        // lacks one the cached run holds, has not shown that it agrees there.
        _ if !compared_through(&rep, s) => {
            check.reason = Some(format!(
                "the candidate's --cache off trace {rel} and its cached run share no decode tensor or decision at steps 0-{s}: nothing compared"
            ));
        }
        _ if one_sided(&rep, s).is_some() => {
            let (kind, name) = one_sided(&rep, s).unwrap_or_default();
            check.reason = Some(format!(
                "{kind} {name} between the candidate's --cache off trace {rel} and its cached run: steps 0-{s} not all compared"
            ));
        }
        other => {
            check.status = CacheStatus::Agrees;
            // A later difference is a consequence of the step already diverging, not the cause.
            if let Some((at, name, _)) = other {
                check.first_step = Some(at);
                check.first_tensor = Some(name);
            }
        }
    }
    check
}

/// Whether the comparison judged any decode tensor or decision at steps 0..=s.
fn compared_through(rep: &Report, s: usize) -> bool {
    let at = |name: &str| step_of(name).is_some_and(|x| x <= s);
    rep.per_tensor.iter().any(|r| at(&r.tensor))
        || rep.decisions.results.iter().any(|d| at(&d.name))
}

/// The first tensor or decision at steps 0..=s that one side holds and the other does not.
fn one_sided(rep: &Report, s: usize) -> Option<(&'static str, String)> {
    rep.findings
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FindingKind::MissingTensor
                    | FindingKind::ExtraTensor
                    | FindingKind::MissingDecision
                    | FindingKind::ExtraDecision
            )
        })
        .filter_map(|f| f.tensor().map(|t| (f.kind.as_str(), t.to_string())))
        .find(|(_, t)| step_of(t).is_some_and(|x| x <= s))
}
