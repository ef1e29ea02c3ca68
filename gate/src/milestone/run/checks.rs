//! The checks against the contract and the engine's own record: stable, matches, generation.
//! Their findings are judged by findings.rs, below this file and agrees.rs.

use tracegate_diff::{Options, RowStatus, Verdict};
use tracegate_trace::Trace;

use super::findings::{diff_findings, incomparable, judge, not_comparable, tokens_finding};
use super::report::{finding, CheckResult, Finding, Generated, Status};
use super::traces::{Opened, Traces};
use crate::milestone::check::{Check, FindingKind};
use crate::milestone::milestones::{Expectation, MilestoneModel};
use crate::prompts::Prompt;

/// stable: the run named `who` (the engine; a port's candidate) reproduces its recorded digest
/// (`recorded`: the digest, or why none is held to it).
pub(super) fn check_stable(
    who: &str,
    run: &Opened,
    recorded: std::result::Result<&str, &str>,
) -> CheckResult {
    match (run, recorded) {
        (Err(e), _) => CheckResult::new(Check::Stable, Status::Fail, e.to_string()),
        (Ok(_), Err(why)) => CheckResult::not_checked(Check::Stable, why),
        (Ok(t), Ok(d)) if t.digest().hex() == d => CheckResult::new(
            Check::Stable,
            Status::Pass,
            format!("{who} digest {} as recorded", t.digest().short()),
        ),
        (Ok(t), Ok(d)) => {
            let mut c = CheckResult::new(
                Check::Stable,
                Status::Fail,
                format!(
                    "{who} digest {} but recorded {}",
                    t.digest().short(),
                    &d[..16.min(d.len())]
                ),
            );
            c.findings.push(finding(
                FindingKind::DigestChanged,
                who,
                1,
                c.detail.clone(),
            ));
            c
        }
    }
}

/// matches: engine ≡ contract, bit for bit, with the recorded counts.
pub(super) fn check_matches(
    m: &MilestoneModel,
    p: &Prompt,
    traces: &Traces,
    expect: std::result::Result<&Expectation, &str>,
) -> CheckResult {
    match (&traces.engine, &traces.contract) {
        (Ok(e), Ok(c)) => compare_matches(Check::Matches, m, p, e, c, expect),
        (Err(e), _) | (_, Err(e)) => CheckResult::new(Check::Matches, Status::Fail, e.to_string()),
    }
}

/// `eng` ≡ `con` bit for bit, as `check` (`matches`; a sharded milestone's merged traces), with
/// `eng`'s recorded counts.
pub(super) fn compare_matches(
    check: Check,
    m: &MilestoneModel,
    p: &Prompt,
    eng: &Trace,
    con: &Trace,
    expect: std::result::Result<&Expectation, &str>,
) -> CheckResult {
    // Every tensor scanned, so each differing one is a finding with its exact count.
    let rep = tracegate_diff::compare(
        eng,
        con,
        &Options {
            all: true,
            ..Options::default()
        },
    );
    let mut found = diff_findings(&rep);
    for row in rep
        .per_tensor
        .iter()
        .filter(|r| r.status == RowStatus::Different)
    {
        let count = row.differing_elements.unwrap_or(0);
        let detail = match &rep.first_divergence {
            Some(d) if d.tensor == row.tensor => format!(
                "first at {}{:?}: {} vs {} ({} ULP; {count}/{} elements differ)",
                d.tensor,
                d.coords,
                d.reference_value,
                d.candidate_value,
                d.ulp.map(|u| u.to_string()).unwrap_or("NaN".into()),
                row.total_elements
            ),
            _ => format!(
                "{count}/{} elements differ, max {} ULP",
                row.total_elements,
                row.max_ulp.map(|u| u.to_string()).unwrap_or("NaN".into())
            ),
        };
        found.push(finding(
            FindingKind::TensorDiffers,
            row.tensor.clone(),
            count,
            detail,
        ));
    }
    for r in rep
        .decisions
        .results
        .iter()
        .filter(|r| r.differing_rows > 0)
    {
        found.push(finding(
            FindingKind::DecisionDiffers,
            r.name.clone(),
            r.differing_rows,
            format!("{}/{} rows differ", r.differing_rows, r.rows),
        ));
    }
    let differing = rep.differing_elements();
    let mut detail = format!(
        "{} — {} tensors ({} by digest, {} element-wise), {} differing elements, {} decisions",
        match rep.verdict {
            Verdict::Identical => "IDENTICAL",
            _ => "DIFFERENT",
        },
        rep.tensors.reference_count,
        rep.tensors.matched_by_digest.len(),
        rep.tensors.compared_elementwise.len(),
        differing,
        rep.decisions.compared
    );
    if rep.verdict != Verdict::Identical && found.is_empty() {
        found.push(finding(
            FindingKind::Different,
            "",
            1,
            format!("verdict {:?}", rep.verdict),
        ));
    }
    match expect {
        Ok(e) => {
            for (what, want, have) in [
                ("tensors", e.tensors as u64, eng.tensors().len() as u64),
                (
                    "decisions",
                    e.decisions as u64,
                    eng.decisions().len() as u64,
                ),
                ("differing_elements", e.differing_elements, differing),
            ] {
                if want != have {
                    found.push(finding(
                        FindingKind::CountChanged,
                        what,
                        have,
                        format!("{what}: recorded {want}, now {have}"),
                    ));
                }
            }
            detail.push_str("; counts as recorded");
        }
        Err(why) => detail.push_str(&format!("; counts NOT CHECKED ({why})")),
    }
    judge(
        m,
        &p.id,
        CheckResult::new(check, Status::Pass, detail),
        found,
    )
}

/// generation: cached, uncached and contract tokens identical (a block-diffusion model: the
/// engine's and the contract's committed tokens).
pub(super) fn check_generation(
    m: &MilestoneModel,
    p: &Prompt,
    traces: &Traces,
    generated: &Generated,
    expect: std::result::Result<&Expectation, &str>,
) -> CheckResult {
    if crate::prompts::samples(&m.family) {
        return check_committed(m, p, traces, generated, expect);
    }
    match (
        &generated.engine_cached,
        &generated.engine_uncached,
        &generated.contract,
    ) {
        (Some(a), _, _) if a.is_empty() => {
            CheckResult::not_checked(Check::Generation, "no tokens generated (--generate 0)")
        }
        (Some(a), Some(b), Some(c)) => {
            if let (Ok(eng), Ok(unc), Ok(con)) =
                (&traces.engine, &traces.engine_uncached, &traces.contract)
            {
                let refused = incomparable(
                    "engine",
                    &[("engine-uncached", eng, unc), ("contract", eng, con)],
                );
                if !refused.is_empty() {
                    return not_comparable(Check::Generation, refused);
                }
            }
            let found = [
                tokens_finding("engine", "engine-uncached", a, b),
                tokens_finding("engine", "contract", a, c),
            ];
            let detail = format!(
                "{} tokens: engine cached = uncached = contract: {a:?}",
                a.len()
            );
            judge_tokens(
                m,
                p,
                a,
                expect,
                detail,
                found.into_iter().flatten().collect(),
            )
        }
        _ => {
            let why: Vec<String> = [&traces.engine, &traces.engine_uncached, &traces.contract]
                .iter()
                .filter_map(|t| t.as_ref().err().map(ToString::to_string))
                .collect();
            CheckResult::new(Check::Generation, Status::Fail, why.join("; "))
        }
    }
}

/// generation for block diffusion: the engine's committed canvases equal the contract's and
/// the recorded ones. It has no uncached path (every step re-reads the prompt's cache), so the
/// uncached engine did not run.
fn check_committed(
    m: &MilestoneModel,
    p: &Prompt,
    traces: &Traces,
    generated: &Generated,
    expect: std::result::Result<&Expectation, &str>,
) -> CheckResult {
    let (Some(a), Some(c), Ok(eng), Ok(con)) = (
        &generated.engine_cached,
        &generated.contract,
        &traces.engine,
        &traces.contract,
    ) else {
        let why: Vec<String> = [&traces.engine, &traces.contract]
            .iter()
            .filter_map(|t| t.as_ref().err().map(ToString::to_string))
            .collect();
        return CheckResult::new(Check::Generation, Status::Fail, why.join("; "));
    };
    if a.is_empty() {
        return CheckResult::not_checked(Check::Generation, "no tokens generated (--generate 0)");
    }
    let refused = incomparable("engine", &[("contract", eng, con)]);
    if !refused.is_empty() {
        return not_comparable(Check::Generation, refused);
    }
    let detail = format!(
        "{} committed tokens: engine = contract: {a:?} (block diffusion: no uncached path)",
        a.len()
    );
    let found = tokens_finding("engine", "contract", a, c)
        .into_iter()
        .collect();
    judge_tokens(m, p, a, expect, detail, found)
}

/// generation's verdict on the engine's tokens `a`: the findings between producers, and the
/// recorded tokens when they differ.
fn judge_tokens(
    m: &MilestoneModel,
    p: &Prompt,
    a: &[i64],
    expect: std::result::Result<&Expectation, &str>,
    mut detail: String,
    mut found: Vec<Finding>,
) -> CheckResult {
    if let Some(e) = expect.ok().filter(|e| e.generated != a) {
        detail = format!("{} tokens {a:?}, recorded {:?}", a.len(), e.generated);
        found.push(finding(
            FindingKind::TokensChanged,
            "engine",
            a.len() as u64,
            detail.clone(),
        ));
    }
    judge(
        m,
        &p.id,
        CheckResult::new(Check::Generation, Status::Pass, detail),
        found,
    )
}
