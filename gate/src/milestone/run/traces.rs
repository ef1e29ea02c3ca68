//! A prompt's traces, each opened by the run that wrote it (or why it cannot be read), and what
//! is read off one trace: its generated tokens and the counts a baseline asserts.
//!
//! Below the checks that read them (checks.rs, agrees.rs), prompt.rs and port.rs: it imports
//! none of them.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tracegate_producers::RunRecord;
use tracegate_trace::{names, Trace};

use super::report::{PromptRuns, Role};

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
    pub(super) fn open(
        root: &Path,
        runs: &PromptRuns,
        oracle_probe: &crate::Result<Value>,
    ) -> Traces {
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
    pub(super) fn get(&self, role: Role) -> Option<&Opened> {
        match role {
            Role::Engine => Some(&self.engine),
            Role::EngineUncached => Some(&self.engine_uncached),
            Role::Contract => Some(&self.contract),
            Role::Oracle => Some(&self.oracle),
            _ => None,
        }
    }
}

/// The generated tokens: the greedy steps' `decode.SSSS.argmax`, or a block-diffusion trace's
/// committed canvases (`denoise.BBBB.commit`), in step and block order.
pub(super) fn decode_tokens(t: &Trace) -> Vec<i64> {
    // Ordered by the number, not the name: `decode.10000` comes after `decode.9999`.
    let mut steps: Vec<(usize, Vec<i64>)> = t
        .decisions()
        .iter()
        .filter_map(|d| {
            let n = names::Name::parse(&d.name);
            let at = match (n.decode_step, n.diffusion, n.layer, n.point) {
                (Some(step), None, None, "argmax") => step,
                (None, Some(names::Diffusion::Block { block }), None, "commit") => block,
                _ => return None,
            };
            let values = t.decision_values(d);
            let values = if n.decode_step.is_some() {
                values.first().map(|&v| vec![v])?
            } else {
                values.to_vec()
            };
            Some((at, values))
        })
        .collect();
    steps.sort_by_key(|(s, _)| *s);
    steps.into_iter().flat_map(|(_, v)| v).collect()
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
