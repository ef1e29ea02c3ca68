//! A milestone run's report: checks, their statuses and findings, each prompt's runs by name,
//! and the verdict (docs/gate-report.schema.json). Rendering: crate::milestone::render.

use std::collections::BTreeMap;

use crate::milestone::check::{Check, FindingKind};
use serde::Serialize;
use serde_json::Value;
use tracegate_diff::string_enum;
use tracegate_producers::RunRecord;

string_enum! {
    /// A check's outcome.
    pub enum Status {
        Pass = "PASS",
        Fail = "FAIL",
        NotChecked = "NOT CHECKED",
    }
}

string_enum! {
    /// A milestone run's outcome.
    pub enum GateVerdict {
        Pass = "PASS",
        Fail = "FAIL",
        /// Nothing failed but something was NOT CHECKED.
        Incomplete = "INCOMPLETE",
    }
}

impl GateVerdict {
    /// 0 all passed; 1 something failed (or nothing ran); 4 nothing failed but not all checked.
    pub fn exit_code(self) -> i32 {
        match self {
            GateVerdict::Pass => 0,
            GateVerdict::Incomplete => 4,
            GateVerdict::Fail => 1,
        }
    }
}

/// One thing a check found, counted: excused only by a declared divergence naming all of it
/// (kind, name and count).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Finding {
    pub kind: FindingKind,
    #[serde(flatten)]
    pub about: Counted,
    pub detail: String,
}

/// What a gate finding is about: a tensor, decision, producer or count name (empty: the whole
/// comparison), and how many elements, rows or tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Counted {
    pub name: String,
    pub count: u64,
}

/// A gate finding.
pub fn finding(
    kind: FindingKind,
    name: impl Into<String>,
    count: u64,
    detail: impl Into<String>,
) -> Finding {
    Finding {
        kind,
        about: Counted {
            name: name.into(),
            count,
        },
        detail: detail.into(),
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CheckResult {
    pub check: Check,
    pub status: Status,
    /// For PASS/FAIL what was measured; for NOT CHECKED the reason.
    pub detail: String,
    pub findings: Vec<Finding>,
    /// Findings that a declared divergence excuses (reported, not failed).
    pub excused: Vec<Finding>,
    /// A baseline's observations (seconds, KiB) against their recorded values; empty for
    /// every other check.
    pub observed: Vec<Observed>,
}

/// One observation of a baseline: the recorded value, this run's, and the relative change
/// (`(now - baseline) / baseline`, 0 when the baseline is 0), which `--assert-observed` bounds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Observed {
    pub key: String,
    pub baseline: f64,
    pub now: f64,
    pub delta: f64,
}

impl CheckResult {
    pub(crate) fn new(check: Check, status: Status, detail: impl Into<String>) -> CheckResult {
        CheckResult {
            check,
            status,
            detail: detail.into(),
            findings: vec![],
            excused: vec![],
            observed: vec![],
        }
    }
    pub(crate) fn not_checked(check: Check, why: impl Into<String>) -> CheckResult {
        CheckResult::new(check, Status::NotChecked, why)
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Generated {
    pub engine_cached: Option<Vec<i64>>,
    pub engine_uncached: Option<Vec<i64>>,
    pub contract: Option<Vec<i64>>,
    pub oracle: Option<Vec<i64>>,
    /// A port milestone's: the candidate's, with and without its KV cache, and the golden
    /// trace's (the reference's).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidate_cached: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub candidate_uncached: Option<Vec<i64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<Vec<i64>>,
}

#[derive(Clone, Debug, Serialize)]
pub struct OracleSummary {
    pub smallest_margin: Option<f64>,
    pub smallest_margin_at: Option<String>,
    pub worst_max_rel: Option<f64>,
    pub worst_max_rel_tensor: Option<String>,
    pub worst_rel_l2: Option<f64>,
    pub worst_rel_l2_tensor: Option<String>,
    /// Near-ties the policy excused, "DECISION[row]" (docs/diff.md, "Labels").
    pub near_ties: Vec<String>,
    /// Token rows after those near-ties, tensors and decisions, not judged.
    pub rows_after_near_tie: u64,
    /// The first tensor in capture order outside the policy (the differ's `first_violation`).
    pub first_violation: Option<tracegate_diff::TensorViolation>,
}

#[derive(Clone, Debug, Serialize)]
pub struct PromptResult {
    pub id: String,
    pub tokens: usize,
    pub runs: PromptRuns,
    pub digests: BTreeMap<String, String>,
    pub checks: Vec<CheckResult>,
    pub counts: Value,
    pub generated: Generated,
    pub oracle: Option<OracleSummary>,
    /// What was seen and is reported, never asserted (a port's digest when it does not declare
    /// itself deterministic).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub observations: Vec<String>,
    /// A port whose `agrees` failed: the bisection against its golden trace, summarised
    /// (docs/gate.md, "Gate your own engine").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub localised: Option<Value>,
    /// A sharded port (docs/producers.md, "Sharded engines"): per run (`candidate`,
    /// `candidate_uncached`), its rank traces and their merge, or why they were refused.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub sharded: BTreeMap<String, ShardedRun>,
}

impl PromptResult {
    /// The localisation of a failing `agrees` in one line (the one line a failing porter needs):
    /// "localised by gate bisect against the golden trace: SUMMARY (report PATH)". First in the
    /// text output, in the JUnit failure message and the ::error annotation of that `agrees`,
    /// at the top of the HTML page (docs/gate.md, "Gate your own engine").
    pub fn localisation_line(&self) -> Option<String> {
        let l = self.localised.as_ref()?;
        Some(format!(
            "localised by {}: {}{}{}",
            Self::localised_by(l),
            l["summary"].as_str().unwrap_or("-"),
            l["report"]
                .as_str()
                .map(|r| format!(" (report {r})"))
                .unwrap_or_default(),
            Self::capsule_words(l)
                .map(|c| format!("; {c}"))
                .unwrap_or_default()
        ))
    }

    /// The localisation's repro capsule (bisect::capsule::for_report): "capsule PATH, replay:
    /// COMMAND", or "capsule NOT WRITTEN: why".
    pub fn capsule_words(l: &Value) -> Option<String> {
        let c = l.get("capsule")?;
        Some(match (c["path"].as_str(), c["replay"].as_str()) {
            (Some(path), Some(replay)) => format!("capsule {path}, replay: {replay}"),
            _ => format!("capsule NOT WRITTEN: {}", c["why"].as_str().unwrap_or("-")),
        })
    }

    /// How a localisation was found: a bisection, of a sharded port's merged rank traces too.
    pub fn localised_by(l: &Value) -> String {
        match l["sharded"]["world"].as_u64() {
            Some(n) => format!(
                "gate bisect --ranks {n} (the {n} rank traces merged) against the golden trace"
            ),
            None => "gate bisect against the golden trace".to_string(),
        }
    }

    /// The merge of a sharded candidate's rank traces in one line per run, for the reports.
    pub fn sharded_lines(&self) -> Vec<String> {
        self.sharded
            .iter()
            .map(|(role, s)| format!("{role} {}", s.line()))
            .collect()
    }

    /// The findings of `check`, failing and excused, of `kind`; None when it did not run (absent
    /// or NOT CHECKED).
    pub fn found(&self, check: Check, kind: FindingKind) -> Option<Vec<&Finding>> {
        self.checks
            .iter()
            .find(|c| c.check == check && c.status != Status::NotChecked)
            .map(|c| {
                c.findings
                    .iter()
                    .chain(&c.excused)
                    .filter(|f| f.kind == kind)
                    .collect()
            })
    }
}

pub use crate::ranks::{RankTrace, Refusal, ShardedRun};

/// One run of a prompt: the engine (with and without its KV cache), the contract, the oracle;
/// for a port milestone (docs/gate.md, "Gate your own engine") the candidate, with and without
/// its KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Engine,
    EngineUncached,
    Contract,
    Oracle,
    Candidate,
    CandidateUncached,
    /// A port's noise run (`--bless`, `gate init`): tracegate's own reference run in the claimed
    /// precision, recorded beside the golden trace.
    Noise,
    /// A sharded milestone's runs (run/sharded.rs): each writes one trace per rank.
    EngineSharded,
    ContractSharded,
    OracleSharded,
}

impl Role {
    /// The roles of a milestone of tracegate's own producers, in run order.
    pub const ALL: [Role; 4] = [
        Role::Engine,
        Role::EngineUncached,
        Role::Contract,
        Role::Oracle,
    ];

    /// Its key in a prompt's `digests` and in a baseline's observations.
    pub fn key(self) -> &'static str {
        match self {
            Role::Engine => "engine",
            Role::EngineUncached => "engine_uncached",
            Role::Contract => "contract",
            Role::Oracle => "oracle",
            Role::Candidate => "candidate",
            Role::CandidateUncached => "candidate_uncached",
            Role::Noise => "noise",
            Role::EngineSharded => "engine_sharded",
            Role::ContractSharded => "contract_sharded",
            Role::OracleSharded => "oracle_sharded",
        }
    }

    /// Its name in messages.
    pub fn label(self) -> &'static str {
        match self {
            Role::EngineUncached => "engine (uncached)",
            Role::CandidateUncached => "candidate (uncached)",
            other => other.key(),
        }
    }

    /// Its trace, in the prompt's directory.
    pub fn file(self) -> &'static str {
        match self {
            Role::Engine => "engine.trace",
            Role::EngineUncached => "engine-uncached.trace",
            Role::Contract => "contract.trace",
            Role::Oracle => "oracle.trace",
            Role::Candidate => "candidate.trace",
            Role::CandidateUncached => "candidate-uncached.trace",
            Role::Noise => "noise.trace",
            // The merged trace, in its split's directory; the ranks' beside it (ranks.rs).
            Role::EngineSharded => "engine.trace",
            Role::ContractSharded => "contract.trace",
            Role::OracleSharded => "oracle.trace",
        }
    }
}

/// A prompt's runs, each with its role, in run order; a role that did not run (the oracle
/// without torch) is absent. In the report, the list of the records.
#[derive(Clone, Debug, Default)]
pub struct PromptRuns(pub Vec<(Role, RunRecord)>);

impl PromptRuns {
    /// The runs that happened, in run order, with their roles.
    pub fn by_role(&self) -> impl Iterator<Item = (Role, &RunRecord)> {
        self.0.iter().map(|(role, r)| (*role, r))
    }

    /// The run of `role`, if it ran.
    pub fn get(&self, role: Role) -> Option<&RunRecord> {
        self.by_role().find(|(r, _)| *r == role).map(|(_, rec)| rec)
    }

    /// The runs that happened, as the report lists them.
    pub fn iter(&self) -> impl Iterator<Item = &RunRecord> {
        self.by_role().map(|(_, r)| r)
    }
}

impl Serialize for PromptRuns {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_seq(self.iter())
    }
}

/// The JSON report's format, its top-level `schema` (docs/gate-report.schema.json describes it).
pub const REPORT_SCHEMA: &str = "tracegate-gate-report/3";

#[derive(Clone, Debug, Serialize)]
pub struct MilestoneReport {
    /// Always [`REPORT_SCHEMA`].
    pub schema: &'static str,
    pub milestone: String,
    pub claim: String,
    pub model: String,
    pub family: String,
    pub prompt_file: String,
    pub prompt_sha256: String,
    pub generate: usize,
    pub threads: usize,
    /// `--timeout`: seconds each producer run may take.
    pub timeout_s: u64,
    pub policy: String,
    pub gate_invocation: Vec<String>,
    pub stack: Value,
    pub prompts: Vec<PromptResult>,
    pub baselines: Vec<CheckResult>,
    /// Baselines of prompts this run did not select (`--only`): not checks, so neither passed
    /// nor NOT CHECKED.
    pub baselines_not_selected: Vec<String>,
    pub totals: BTreeMap<Status, usize>,
    /// The gate's own wall seconds per phase (`setup`: checks, oracle probe, worker start-up;
    /// `producers`: the prompts' runs; `judge`: the checks; `total`): observed, never asserted.
    pub wall_s: BTreeMap<&'static str, f64>,
    pub verdict: GateVerdict,
    /// A sharded milestone's split this report judges (`tp=2`; docs/gate.md, "m2").
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<String>,
}

impl MilestoneReport {
    pub fn all_checks(&self) -> impl Iterator<Item = &CheckResult> {
        self.prompts
            .iter()
            .flat_map(|p| p.checks.iter())
            .chain(self.baselines.iter())
    }
    pub fn exit_code(&self) -> i32 {
        self.verdict.exit_code()
    }
}
