//! One prompt judged: its runs' traces opened by name, the expectation it is held to, and the
//! checks in order (stable, matches, generation, agrees, generation_oracle).

use std::collections::BTreeMap;

use serde_json::Value;
use tracegate_diff::Policy;

use super::agrees::check_oracle;
use super::checks::{check_generation, check_matches, check_stable};
use super::plan::GateOptions;
use super::report::{Generated, PromptResult, PromptRuns, Role};
use super::traces::{counts, decode_tokens, Traces};
use crate::milestone::milestones::{Expectation, Milestone, MilestoneModel};
use crate::prompts::Prompt;

/// The expectation a prompt is held to, or why there is none to hold it to. Expectations hold
/// for the milestone's own --generate: another N changes the digest, the decision count and the
/// tokens, so those comparisons are NOT CHECKED, not failed.
pub(super) fn expectation<'m>(
    m: &Milestone,
    mm: &'m MilestoneModel,
    p: &Prompt,
    generate: usize,
) -> std::result::Result<&'m Expectation, String> {
    if generate != m.generate {
        Err(format!(
            "expectations are recorded for --generate {}, this run generates {generate}",
            m.generate
        ))
    } else {
        mm.expect.get(&p.id).ok_or_else(|| {
            format!(
                "no expectation recorded for prompt {:?}: run with --bless",
                p.id
            )
        })
    }
}

pub(super) fn judge_prompt(
    o: &GateOptions,
    m: &Milestone,
    mm: &MilestoneModel,
    p: &Prompt,
    runs: PromptRuns,
    policy: &Policy,
    oracle_probe: &crate::Result<Value>,
) -> PromptResult {
    let traces = Traces::open(&o.root, &runs, oracle_probe);
    let expect = expectation(m, mm, p, o.generate.unwrap_or(m.generate));
    let expect = expect.as_ref().copied().map_err(String::as_str);
    let mut digests = BTreeMap::new();
    for role in Role::ALL {
        if let Some(Ok(t)) = traces.get(role) {
            digests.insert(role.key().to_string(), t.digest().hex());
        }
    }
    let generated = Generated {
        engine_cached: traces.engine.as_ref().ok().map(decode_tokens),
        engine_uncached: traces.engine_uncached.as_ref().ok().map(decode_tokens),
        contract: traces.contract.as_ref().ok().map(decode_tokens),
        oracle: traces.oracle.as_ref().ok().map(decode_tokens),
        ..Default::default()
    };
    let mut checks = vec![
        check_stable(
            "engine",
            &traces.engine,
            expect.map(|e| e.engine_digest.as_str()),
        ),
        check_matches(mm, p, &traces, expect),
        check_generation(mm, p, &traces, &generated, expect),
    ];
    let (oracle_checks, oracle_summary) = check_oracle(mm, p, &traces, policy, expect);
    checks.extend(oracle_checks);
    let counts = match &traces.engine {
        Ok(t) => counts(t),
        Err(_) => Value::Null,
    };
    PromptResult {
        id: p.id.clone(),
        tokens: p.tokens.len(),
        runs,
        digests,
        checks,
        counts,
        generated,
        oracle: oracle_summary,
        observations: Vec::new(),
        localised: None,
        sharded: BTreeMap::new(),
    }
}
