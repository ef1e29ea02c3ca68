//! One prompt judged: its runs' traces opened by name, the expectation it is held to, and the
//! checks in order (stable, matches, generation, agrees, generation_oracle).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tracegate_diff::Policy;
use tracegate_producers::RunRecord;
use tracegate_trace::{names, Trace};

use super::agrees::check_oracle;
use super::checks::{check_generation, check_matches, check_stable};
use super::{GateOptions, PromptResult, PromptRuns, Role};
use crate::milestone::milestones::{Expectation, Milestone, MilestoneModel};
use crate::prompts::Prompt;

/// A trace, or why it cannot be read: its run failed (Producer), its file is unreadable (File),
/// or, for the oracle, it could not run at all (Unavailable).
pub(super) type Opened = crate::Result<Trace>;

/// A prompt's traces, each by the run that wrote it.
pub(super) struct Traces {
    pub engine: Opened,
    pub engine_uncached: Opened,
    pub contract: Opened,
    pub oracle: Opened,
}

impl Traces {
    /// `oracle_probe`: why the oracle did not run, when it did not.
    fn open(root: &Path, runs: &PromptRuns, oracle_probe: &crate::Result<Value>) -> Traces {
        let oracle = match runs.get(Role::Oracle) {
            Some(rec) => open(root, rec),
            None => Err(crate::Error::Unavailable(
                oracle_probe
                    .as_ref()
                    .err()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
            )),
        };
        let of = |role: Role| match runs.get(role) {
            Some(rec) => open(root, rec),
            None => Err(crate::gerr!(Producer: "{} did not run", role.label())),
        };
        Traces {
            engine: of(Role::Engine),
            engine_uncached: of(Role::EngineUncached),
            contract: of(Role::Contract),
            oracle,
        }
    }

    /// None for a port's roles, which this milestone does not run.
    fn get(&self, role: Role) -> Option<&Opened> {
        match role {
            Role::Engine => Some(&self.engine),
            Role::EngineUncached => Some(&self.engine_uncached),
            Role::Contract => Some(&self.contract),
            Role::Oracle => Some(&self.oracle),
            Role::Candidate | Role::CandidateUncached => None,
        }
    }
}

/// The expectation a prompt is held to, or why there is none to hold it to. Expectations hold
/// for the milestone's own --generate: another N changes the digest, the decision count and the
/// tokens, so those comparisons are NOT CHECKED, not failed.
fn expectation<'m>(
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
    let generated = super::Generated {
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
    }
}

pub(super) fn decode_tokens(t: &Trace) -> Vec<i64> {
    // Ordered by the step number, not the name: `decode.10000` comes after `decode.9999`.
    let mut steps: Vec<(usize, i64)> = t
        .decisions()
        .iter()
        .filter_map(|d| {
            let n = names::Name::parse(&d.name);
            let step = n
                .decode_step
                .filter(|_| n.layer.is_none() && n.point == "argmax")?;
            t.decision_values(d).first().map(|&v| (step, v))
        })
        .collect();
    steps.sort_by_key(|&(s, _)| s);
    steps.into_iter().map(|(_, v)| v).collect()
}

/// Deterministic counts of an engine (or a port's candidate) trace, asserted by baselines.
pub(super) fn counts(t: &Trace) -> Value {
    let mut router = serde_json::Map::new();
    for d in t.decisions() {
        if let Some(layer) = d.name.strip_suffix(".router.topk") {
            let mut hist: BTreeMap<i64, u64> = BTreeMap::new();
            for v in t.decision_values(d) {
                *hist.entry(v).or_default() += 1;
            }
            let hist: serde_json::Map<String, Value> = hist
                .into_iter()
                .map(|(k, v)| (format!("{k:03}"), json!(v)))
                .collect();
            router.insert(layer.to_string(), Value::Object(hist));
        }
    }
    json!({
        // Tensor payload, not the file size: the file also holds provenance (the command line,
        // with its --out path), which says where a run wrote, not what it computed.
        "tensor_bytes": t.tensors().iter().map(|i| i.nbytes).sum::<u64>(),
        "tensors": t.tensors().len(),
        "decisions": t.decisions().len(),
        "router_selections": router,
        "tokens_generated": decode_tokens(t).len(),
    })
}

pub(super) fn open(root: &Path, rec: &RunRecord) -> Opened {
    if !rec.ok {
        return Err(crate::gerr!(
            Producer:
            "{} {} failed: {}",
            rec.producer,
            rec.verb,
            rec.why()
        ));
    }
    Trace::open(root.join(&rec.out))
        .map_err(|e| crate::gerr!(File: "{} trace unreadable: {e}", rec.producer))
}
