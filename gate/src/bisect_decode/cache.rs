//! The cached decode path against the candidate's own full recompute.

use tracegate_diff::compare;

use super::{decode_only, step_of, CacheCheck, CacheStatus, Context};
use crate::bisect::{self as b, BisectOptions};
use crate::producer::{RunRecord, Verb};

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
    };
    let rec = o.candidate.run(&o.root, &verb, o.timeout);
    runs.push(rec.clone());
    crate::progress::step("decode: candidate traced with --cache off");
    if !rec.ok {
        check.reason = Some(format!(
            "the candidate's trace verb failed with --cache off: {}",
            rec.why()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" | ")
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
    check.trace = Some(rel);
    // The full recompute is the reference side: the cached path is what is being checked.
    let opts = decode_only(c.policy);
    let rep = compare(&uncached, c.candidate, &opts);
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
