//! Running a milestone: every selected prompt through the engine, the contract and the oracle,
//! then the checks — stable, matches, generation, agrees, generation_oracle — and the baselines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::{json, Value};
use tracegate_diff::{
    label_text, string_enum, FindingKind, Label, Options, Policy, RowStatus, Verdict,
};
use tracegate_trace::{names, Trace};

use crate::baselines::{Baseline, BaselineFile, Conditions};
use crate::milestones::{Expectation, Milestone, MilestoneFile};
use crate::producer::{Producer, RunRecord, Verb};
use crate::prompts::{self, Prompt, PromptSet};
use crate::{gerr, Result};

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

/// A check of a milestone run; a baseline's is `baseline ID` (`baselines` when none applied).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Check {
    Stable,
    Matches,
    Generation,
    Agrees,
    GenerationOracle,
    Baseline(String),
    Baselines,
}

impl std::fmt::Display for Check {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Check::Stable => f.pad("stable"),
            Check::Matches => f.pad("matches"),
            Check::Generation => f.pad("generation"),
            Check::Agrees => f.pad("agrees"),
            Check::GenerationOracle => f.pad("generation_oracle"),
            Check::Baseline(id) => f.pad(&format!("baseline {id}")),
            Check::Baselines => f.pad("baselines"),
        }
    }
}

impl std::str::FromStr for Check {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Check, String> {
        Ok(match s {
            "stable" => Check::Stable,
            "matches" => Check::Matches,
            "generation" => Check::Generation,
            "agrees" => Check::Agrees,
            "generation_oracle" => Check::GenerationOracle,
            "baselines" => Check::Baselines,
            _ => match s.strip_prefix("baseline ") {
                Some(id) => Check::Baseline(id.to_string()),
                None => return Err(format!("{s:?} is not a check")),
            },
        })
    }
}

impl Serialize for Check {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Check {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Check, D::Error> {
        String::deserialize(d)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}

/// One thing a check found, counted: excused only by a declared divergence naming all of it
/// (kind, name and count).
pub type Finding = tracegate_diff::Finding<Counted>;

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
    fn new(check: Check, status: Status, detail: impl Into<String>) -> CheckResult {
        CheckResult {
            check,
            status,
            detail: detail.into(),
            findings: vec![],
            excused: vec![],
            observed: vec![],
        }
    }
    fn not_checked(check: Check, why: impl Into<String>) -> CheckResult {
        CheckResult::new(check, Status::NotChecked, why)
    }
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Generated {
    pub engine_cached: Option<Vec<i64>>,
    pub engine_uncached: Option<Vec<i64>>,
    pub contract: Option<Vec<i64>>,
    pub oracle: Option<Vec<i64>>,
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
    pub runs: Vec<RunRecord>,
    pub digests: BTreeMap<String, String>,
    pub checks: Vec<CheckResult>,
    pub counts: Value,
    pub generated: Generated,
    pub oracle: Option<OracleSummary>,
}

/// The JSON report's format, its top-level `schema` (docs/gate-report.schema.json describes it).
pub const REPORT_SCHEMA: &str = "tracegate-gate-report/1";

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

pub struct GateOptions {
    pub root: PathBuf,
    pub milestone: String,
    /// A set name or path; None: the milestone's own set.
    pub prompts: Option<String>,
    pub only: Option<Vec<String>>,
    pub bless: bool,
    pub generate: Option<usize>,
    pub model: Option<PathBuf>,
    pub threads: usize,
    pub assert_observed: Option<f64>,
    pub contract_cmd: Option<String>,
    pub oracle_cmd: Option<String>,
    /// Trace directory, relative to the root (or absolute); traces go to `<work>/<milestone>/<prompt>/`.
    pub work: String,
    /// Each producer run is killed after this long, and the run refused.
    pub timeout: std::time::Duration,
    pub gate_invocation: Vec<String>,
}

fn python(root: &Path, specific: &str) -> String {
    std::env::var(specific)
        .or_else(|_| std::env::var("TRACEGATE_PYTHON"))
        .unwrap_or_else(|_| root.join(".venv/bin/python").display().to_string())
}

pub fn default_contract_cmd(root: &Path) -> String {
    // {verb|serve}: one worker answers every run of the gate (docs/producers.md, "Serving").
    format!(
        "'{}' -m tracegate_contract {{verb|serve}} {{args}}",
        python(root, "TRACEGATE_CONTRACT_PYTHON")
    )
}

pub fn default_oracle_cmd(root: &Path) -> String {
    format!(
        "'{}' -m tracegate_oracle {{verb|serve}} {{args}} --threads 1",
        python(root, "TRACEGATE_ORACLE_PYTHON")
    )
}

/// Whether the oracle's interpreter can import torch and transformers; Err carries the reason.
/// The default oracle's worker answers it (`versions`), so torch is imported once per gate run;
/// `dir`: where it writes its answer.
fn probe_oracle(
    root: &Path,
    timeout: std::time::Duration,
    oracle: Option<&Producer>,
    dir: &Path,
) -> std::result::Result<Value, String> {
    let py = python(root, "TRACEGATE_ORACLE_PYTHON");
    let unavailable = |err: String| {
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.starts_with('['))
            .unwrap_or("import failed")
            .to_string();
        format!("torch/transformers unavailable to {py}: {last}")
    };
    let answer = dir.join("oracle-versions.json");
    let served = oracle.and_then(|o| {
        o.ask_worker(
            root,
            &[
                "versions".into(),
                "--out".into(),
                answer.display().to_string(),
            ],
            timeout,
        )
    });
    let out = match served {
        Some(asked) => asked.map_err(unavailable).and_then(|()| {
            std::fs::read_to_string(&answer).map_err(|e| format!("{}: {e}", answer.display()))
        })?,
        None => {
            let code = "import json, torch, transformers, numpy; print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, 'numpy': numpy.__version__}))";
            crate::producer::run_helper(root, &[py.clone(), "-c".into(), code.into()], timeout)
                .map_err(unavailable)?
        }
    };
    serde_json::from_str(&out).map_err(|e| format!("version probe printed no JSON: {e}"))
}

fn decode_tokens(t: &Trace) -> Vec<i64> {
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

/// Deterministic counts of an engine trace, asserted by baselines.
fn counts(t: &Trace) -> Value {
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

fn open(root: &Path, rec: &RunRecord) -> std::result::Result<Trace, String> {
    if !rec.ok {
        return Err(format!(
            "{} {} failed: {}",
            rec.producer,
            rec.verb,
            rec.why()
        ));
    }
    Trace::open(root.join(&rec.out)).map_err(|e| format!("{} trace unreadable: {e}", rec.producer))
}

/// Splits findings into failing and excused by the milestone's declared divergences.
fn judge(m: &Milestone, prompt: &str, mut c: CheckResult, found: Vec<Finding>) -> CheckResult {
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
fn diff_findings(rep: &tracegate_diff::Report) -> Vec<Finding> {
    rep.findings
        .iter()
        .filter(|f| {
            !matches!(
                f.kind,
                FindingKind::ValuesDiffer
                    | FindingKind::DecisionDiffers
                    | FindingKind::OutsidePolicy
            )
        })
        .map(|f| finding(f.kind, f.tensor().unwrap_or_default(), 1, f.detail.clone()))
        .collect()
}

/// The gate finding kind of a tensor outside the policy or without a rule.
fn policy_kind(status: RowStatus) -> Option<FindingKind> {
    match status {
        RowStatus::OutsidePolicy => Some(FindingKind::OutsidePolicy),
        RowStatus::NoRule => Some(FindingKind::NoRule),
        RowStatus::Identical
        | RowStatus::Different
        | RowStatus::WithinPolicy
        | RowStatus::DiffersByDigest
        | RowStatus::Unknown
        | RowStatus::Rerouted => None,
    }
}

fn check_matches(
    m: &Milestone,
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
        CheckResult::new(Check::Matches, Status::Pass, detail),
        found,
    )
}

fn check_agrees(
    m: &Milestone,
    p: &Prompt,
    eng: &Trace,
    ora: &Trace,
    policy: &Policy,
    expect: std::result::Result<&Expectation, &str>,
) -> (CheckResult, OracleSummary) {
    let rep = tracegate_diff::compare(
        eng,
        ora,
        &Options {
            policy: Some(policy.clone()),
            ..Options::default()
        },
    );
    let mut found = diff_findings(&rep);
    for row in &rep.per_tensor {
        if let Some(kind) = policy_kind(row.status) {
            // Already reported as a diff finding when the differ emits one; keep one entry per tensor.
            if !found.iter().any(|f| f.about.name == row.tensor) {
                let detail = row.violation().map_or_else(
                    || "no rule in the policy matches this tensor".to_string(),
                    |v| v.to_string(),
                );
                found.push(finding(kind, row.tensor.clone(), 1, detail));
            }
        }
    }
    // The differ's labels: a near-tie and the rows after it are reported, not failed; each
    // decision with a consequence or defect is a finding counting those rows.
    let mut near_ties = Vec::new();
    for r in rep
        .decisions
        .results
        .iter()
        .filter(|r| r.differing_rows > 0)
    {
        near_ties.extend(
            r.flips
                .iter()
                .filter(|f| f.label == Label::NearTie)
                .map(|f| format!("{}[{}]", r.name, f.row)),
        );
        let failing = r.flips.iter().filter(|f| !f.excused()).count() as u64;
        if failing > 0 {
            let labels: Vec<String> = r
                .flips
                .iter()
                .map(|f| {
                    format!(
                        "row {} {:?}→{:?} {}",
                        f.row,
                        f.reference,
                        f.candidate,
                        label_text(f)
                    )
                })
                .collect();
            found.push(finding(
                FindingKind::DecisionDiffers,
                r.name.clone(),
                failing,
                labels.join("; "),
            ));
        }
    }
    let rows_after_near_tie = rep
        .decisions
        .near_ties
        .as_ref()
        .map_or(0, |n| n.rows_after());
    // Smallest margin among the engine's decisions; worst numeric divergences.
    let mut smallest: Option<(f64, String)> = None;
    for d in eng.decisions() {
        if let Some(ms) = eng.decision_margins(d) {
            for (row, m) in ms.iter().enumerate() {
                let m = *m as f64;
                if smallest.as_ref().is_none_or(|(s, _)| m < *s) {
                    smallest = Some((m, format!("{}[{row}]", d.name)));
                }
            }
        }
    }
    let worst = |f: fn(&tracegate_diff::TensorRow) -> Option<f64>| {
        rep.per_tensor
            .iter()
            .filter_map(|r| f(r).map(|v| (v, r.tensor.clone())))
            .fold(None, |acc: Option<(f64, String)>, x| match acc {
                Some(a) if a.0 >= x.0 => Some(a),
                _ => Some(x),
            })
    };
    let max_rel = worst(|r| r.max_rel.map(|x| x.0));
    let rel_l2 = worst(|r| r.rel_l2.map(|x| x.0));
    let summary = OracleSummary {
        smallest_margin: smallest.as_ref().map(|s| s.0),
        smallest_margin_at: smallest.map(|s| s.1),
        worst_max_rel: max_rel.as_ref().map(|x| x.0),
        worst_max_rel_tensor: max_rel.map(|x| x.1),
        worst_rel_l2: rel_l2.as_ref().map(|x| x.0),
        worst_rel_l2_tensor: rel_l2.map(|x| x.1),
        near_ties,
        rows_after_near_tie,
        first_violation: rep.first_violation(),
    };
    let mut detail = format!(
        "{} under policy {}: {} tensors judged, {}/{} decisions differ; smallest margin {} at {}; worst rel L2 {} ({})",
        match rep.verdict {
            Verdict::Identical => "IDENTICAL",
            Verdict::WithinPolicy => "WITHIN POLICY",
            Verdict::Incomparable => "INCOMPARABLE",
            _ => "DIFFERENT",
        },
        policy.name,
        rep.per_tensor.len(),
        rep.decisions.differing,
        rep.decisions.compared,
        summary.smallest_margin.map(|v| format!("{v:.3e}")).unwrap_or("n/a".into()),
        summary.smallest_margin_at.clone().unwrap_or_default(),
        summary.worst_rel_l2.map(|v| format!("{v:.2e}")).unwrap_or("n/a".into()),
        summary.worst_rel_l2_tensor.clone().unwrap_or_default(),
    );
    if !summary.near_ties.is_empty() {
        detail.push_str(&format!(
            "; {} near-tie(s) excused ({}), {} row(s) after them not judged",
            summary.near_ties.len(),
            summary.near_ties.join(", "),
            summary.rows_after_near_tie
        ));
    }
    // The policy failure is named by its first violation: the first bit difference may be
    // rounding noise within the policy.
    if let Some(v) = &summary.first_violation {
        let outside = rep
            .per_tensor
            .iter()
            .filter(|r| r.status == RowStatus::OutsidePolicy)
            .count();
        let first = v
            .violations
            .first()
            .map(|b| b.to_string())
            .unwrap_or_default();
        detail.push_str(&format!(
            "; {outside} tensor(s) outside the policy, first {}: {first}",
            v.tensor
        ));
    }
    if !matches!(rep.verdict, Verdict::Identical | Verdict::WithinPolicy) && found.is_empty() {
        found.push(finding(
            FindingKind::Different,
            "",
            1,
            format!("verdict {:?}", rep.verdict),
        ));
    }
    // Declared oracle divergences are recorded by count: a different number of differing
    // decisions is a change even when each one is declared.
    if let Ok(e) = expect {
        let have = found
            .iter()
            .filter(|f| f.kind == FindingKind::DecisionDiffers)
            .count();
        if have != e.oracle_decisions_differing {
            found.push(finding(
                FindingKind::CountChanged,
                "oracle_decisions_differing",
                have as u64,
                format!(
                    "oracle_decisions_differing: recorded {}, now {have}",
                    e.oracle_decisions_differing
                ),
            ));
        }
    }
    (
        judge(
            m,
            &p.id,
            CheckResult::new(Check::Agrees, Status::Pass, detail),
            found,
        ),
        summary,
    )
}

fn tokens_finding(name: &str, a: &[i64], b: &[i64]) -> Option<Finding> {
    if a == b {
        return None;
    }
    let differ = a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len());
    Some(finding(
        FindingKind::TokensDiffer,
        name,
        differ as u64,
        format!("engine {a:?} vs {name} {b:?}"),
    ))
}

fn stack_versions(oracle: &std::result::Result<Value, String>) -> Value {
    json!({
        "tracegate": env!("CARGO_PKG_VERSION"),
        "oracle_stack": match oracle { Ok(v) => v.clone(), Err(e) => json!({"unavailable": e}) },
    })
}

pub fn run_milestone(o: &GateOptions) -> Result<(MilestoneReport, Option<String>)> {
    let started = std::time::Instant::now();
    let ms_path = o.root.join("milestones.json");
    let mut file = MilestoneFile::load(&ms_path)?;
    let m = file.get(&o.milestone)?.clone();
    let prompt_path = prompts::resolve(&o.root, o.prompts.as_deref().unwrap_or(&m.prompts.set));
    let set: PromptSet = prompts::load(&prompt_path)?;
    if set.sha256 != m.prompts.sha256 && !o.bless {
        return Err(gerr!(
            "{}: sha256 {} differs from milestone {}'s record {} — changing prompts changes the gate; rerun with --bless to accept it",
            prompt_path.display(),
            set.sha256,
            m.id,
            m.prompts.sha256
        ));
    }
    let selected = set.select(o.only.as_deref())?;
    let model = match &o.model {
        Some(dir) => {
            // Validated as the engine would (unsupported fields are refused here, not mid-run).
            let shown = crate::paths::shown(dir);
            let (_, raw) =
                tracegate_engine::load_config(dir).map_err(|e| gerr!("--model {shown}: {e}"))?;
            let family = raw.get("model_type").and_then(Value::as_str).unwrap_or("");
            if family != m.family {
                return Err(gerr!(
                    "--model {shown}: model_type {family:?} is not milestone {}'s family {:?}",
                    m.id,
                    m.family
                ));
            }
            let canon = std::fs::canonicalize(dir).map_err(|e| gerr!("--model {shown}: {e}"))?;
            // The milestone's own checkpoint, however spelled, keeps the milestone's name, so its
            // recorded baselines still apply.
            if std::fs::canonicalize(o.root.join(&m.model)).is_ok_and(|own| own == canon) {
                m.model.clone()
            } else {
                canon.display().to_string()
            }
        }
        None => m.model.clone(),
    };
    let generate = o.generate.unwrap_or(m.generate);
    for p in &selected {
        prompts::check_fits(&o.root, &model, Some(&p.id), p.tokens.len(), generate)?;
    }
    let policy = Policy::resolve(&m.policy, &o.root).map_err(|e| gerr!("{}: {e}", m.policy))?;
    let work_rel = format!("{}/{}", o.work.trim_end_matches('/'), m.id);
    let _lock = crate::WorkLock::acquire(&o.root.join(&work_rel))?;
    let engine = Producer::Engine { threads: o.threads };
    let contract = Producer::command(
        "contract",
        &o.contract_cmd
            .clone()
            .unwrap_or_else(|| default_contract_cmd(&o.root)),
    )
    .map_err(|e| gerr!("--contract-cmd: {e}"))?;
    let oracle = Producer::command(
        "oracle",
        &o.oracle_cmd
            .clone()
            .unwrap_or_else(|| default_oracle_cmd(&o.root)),
    )
    .map_err(|e| gerr!("--oracle-cmd: {e}"))?;
    // The contract worker's start-up overlaps the oracle's, which answers the probe.
    contract.prestart(&o.root);
    let oracle_probe = probe_oracle(
        &o.root,
        o.timeout,
        o.oracle_cmd.is_none().then_some(&oracle),
        &o.root.join(&work_rel),
    );
    let oracle_runs = o.oracle_cmd.is_some() || oracle_probe.is_ok();

    let progress = crate::progress::start(format!("gate {}", m.id), selected.len() as u64);

    let mut results = Vec::new();
    let mut wall_s: BTreeMap<&'static str, f64> = BTreeMap::new();
    wall_s.insert("setup", started.elapsed().as_secs_f64());
    let (mut producing, mut judging) = (0.0, 0.0);
    for p in &selected {
        let phase = std::time::Instant::now();
        let dir_rel = format!("{work_rel}/{}", p.id);
        let dir = o.root.join(&dir_rel);
        // Never compare a stale trace: a producer that fails must leave nothing to read.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| gerr!("{}: {e}", dir.display()))?;
        let trace_verb = |out: &str, cache: bool| Verb::Trace {
            model: model.clone(),
            tokens: p.tokens.clone(),
            out: format!("{dir_rel}/{out}"),
            internals: false,
            generate,
            cache,
            force: None,
        };
        let mut runs = Vec::new();
        let mut producers = vec![
            (&engine, "engine", "engine.trace", true),
            (&engine, "engine (uncached)", "engine-uncached.trace", false),
            (&contract, "contract", "contract.trace", true),
        ];
        if oracle_runs {
            producers.push((&oracle, "oracle", "oracle.trace", true));
        }
        crate::progress::doing(format!("{}: running the producers", p.id));
        // Independent runs overlap (the Python producers are served by their own workers).
        let recs: Vec<RunRecord> = std::thread::scope(|s| {
            let handles: Vec<_> = producers
                .iter()
                .map(|&(producer, _, out, cache)| {
                    let verb = trace_verb(out, cache);
                    s.spawn(move || producer.run(&o.root, &verb, o.timeout))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("a producer run panicked"))
                .collect()
        });
        for ((_, label, _, _), rec) in producers.iter().zip(recs) {
            // A hang says nothing about the model; the gate cannot judge this run at all.
            if rec.timed_out {
                return Err(gerr!(
                    "{}: {label} {} timed out after {} s (--timeout) and was killed: $ {}",
                    p.id,
                    rec.verb,
                    o.timeout.as_secs(),
                    rec.invocation
                ));
            }
            runs.push(rec);
        }
        producing += phase.elapsed().as_secs_f64();
        let phase = std::time::Instant::now();
        let result = judge_prompt(o, &m, p, runs, &policy, &oracle_probe, oracle_runs);
        judging += phase.elapsed().as_secs_f64();
        let line = format!(
            "{}: {}",
            p.id,
            result
                .checks
                .iter()
                .map(|c| format!("{} {}", c.check, c.status))
                .collect::<Vec<_>>()
                .join(", ")
        );
        crate::progress::step(line);
        results.push(result);
    }
    drop(progress);
    wall_s.insert("producers", producing);
    wall_s.insert("judge", judging);

    let bl_path = o.root.join("baselines.json");
    let mut bl_file = BaselineFile::load(&bl_path)?;
    let conditions_of = |r: &PromptResult| -> Conditions {
        let mut c = Conditions::new();
        c.insert("prompt".into(), json!(r.id));
        c.insert("threads".into(), json!(o.threads));
        c.insert("generate".into(), json!(generate));
        c.insert("model".into(), json!(model));
        c
    };
    let (baselines, baselines_not_selected) = check_baselines(
        &m,
        &bl_file.baselines,
        &results,
        &conditions_of,
        o.assert_observed,
        &set,
        &selected,
    );

    let mut totals: BTreeMap<Status, usize> = BTreeMap::new();
    let mut report = MilestoneReport {
        schema: REPORT_SCHEMA,
        milestone: m.id.clone(),
        claim: m.claim.clone(),
        model: model.clone(),
        family: m.family.clone(),
        prompt_file: prompt_path.display().to_string(),
        prompt_sha256: set.sha256.clone(),
        generate,
        threads: o.threads,
        timeout_s: o.timeout.as_secs(),
        policy: m.policy.clone(),
        gate_invocation: o.gate_invocation.clone(),
        stack: stack_versions(&oracle_probe),
        prompts: results,
        baselines,
        baselines_not_selected,
        totals: BTreeMap::new(),
        wall_s,
        verdict: GateVerdict::Fail,
    };
    for c in report.all_checks() {
        *totals.entry(c.status).or_default() += 1;
    }
    let n = |s: Status| totals.get(&s).copied().unwrap_or(0);
    report.verdict = if n(Status::Fail) > 0 || n(Status::Pass) == 0 {
        GateVerdict::Fail
    } else if n(Status::NotChecked) > 0 {
        GateVerdict::Incomplete
    } else {
        GateVerdict::Pass
    };
    report.totals = totals;
    report
        .wall_s
        .insert("total", started.elapsed().as_secs_f64());
    let w = &report.wall_s;
    eprintln!(
        "[gate {}] wall (observed): setup {:.1} s, producers {:.1} s, judge {:.1} s, total {:.1} s",
        m.id, w["setup"], w["producers"], w["judge"], w["total"]
    );

    let bless_log = if o.bless {
        Some(bless(
            o,
            &mut file,
            &ms_path,
            &m,
            &set,
            &report,
            &mut bl_file,
            &bl_path,
            &conditions_of,
        )?)
    } else {
        None
    };
    Ok((report, bless_log))
}

fn judge_prompt(
    o: &GateOptions,
    m: &Milestone,
    p: &Prompt,
    runs: Vec<RunRecord>,
    policy: &Policy,
    oracle_probe: &std::result::Result<Value, String>,
    oracle_ran: bool,
) -> PromptResult {
    let root = &o.root;
    let eng = open(root, &runs[0]);
    let unc = open(root, &runs[1]);
    let con = open(root, &runs[2]);
    let ora: std::result::Result<Trace, String> = if oracle_ran {
        open(root, &runs[3])
    } else {
        Err(oracle_probe.as_ref().err().cloned().unwrap_or_default())
    };
    let oracle_failed_to_run = oracle_ran && ora.is_err();
    // Expectations hold for the milestone's own --generate: another N changes the digest, the
    // decision count and the tokens, so those comparisons are NOT CHECKED, not failed.
    let generate = o.generate.unwrap_or(m.generate);
    let expect: std::result::Result<&Expectation, String> = if generate != m.generate {
        Err(format!(
            "expectations are recorded for --generate {}, this run generates {generate}",
            m.generate
        ))
    } else {
        m.expect.get(&p.id).ok_or_else(|| {
            format!(
                "no expectation recorded for prompt {:?}: run with --bless",
                p.id
            )
        })
    };
    let expect = expect.as_ref().copied().map_err(String::as_str);
    let mut digests = BTreeMap::new();
    for (name, t) in [
        ("engine", &eng),
        ("engine_uncached", &unc),
        ("contract", &con),
        ("oracle", &ora),
    ] {
        if let Ok(t) = t {
            digests.insert(name.to_string(), t.digest().hex());
        }
    }
    let mut checks = Vec::new();

    // stable: the engine reproduces its recorded digest.
    checks.push(match (&eng, expect) {
        (Err(e), _) => CheckResult::new(Check::Stable, Status::Fail, e.clone()),
        (Ok(_), Err(why)) => CheckResult::not_checked(Check::Stable, why),
        (Ok(t), Ok(e)) if t.digest().hex() == e.engine_digest => CheckResult::new(
            Check::Stable,
            Status::Pass,
            format!("engine digest {} as recorded", t.digest().short()),
        ),
        (Ok(t), Ok(e)) => {
            let mut c = CheckResult::new(
                Check::Stable,
                Status::Fail,
                format!(
                    "engine digest {} but recorded {}",
                    t.digest().short(),
                    &e.engine_digest[..16.min(e.engine_digest.len())]
                ),
            );
            c.findings.push(finding(
                FindingKind::DigestChanged,
                "engine",
                1,
                c.detail.clone(),
            ));
            c
        }
    });

    // matches: engine ≡ contract, bit for bit, with the recorded counts.
    checks.push(match (&eng, &con) {
        (Ok(e), Ok(c)) => check_matches(m, p, e, c, expect),
        (Err(e), _) | (_, Err(e)) => CheckResult::new(Check::Matches, Status::Fail, e.clone()),
    });

    // generation: cached, uncached and contract tokens identical.
    let generated = Generated {
        engine_cached: eng.as_ref().ok().map(decode_tokens),
        engine_uncached: unc.as_ref().ok().map(decode_tokens),
        contract: con.as_ref().ok().map(decode_tokens),
        oracle: ora.as_ref().ok().map(decode_tokens),
    };
    checks.push(
        match (
            &generated.engine_cached,
            &generated.engine_uncached,
            &generated.contract,
        ) {
            (Some(a), _, _) if a.is_empty() => {
                CheckResult::not_checked(Check::Generation, "no tokens generated (--generate 0)")
            }
            (Some(a), Some(b), Some(c)) => {
                let mut found: Vec<Finding> = [
                    tokens_finding("engine-uncached", a, b),
                    tokens_finding("contract", a, c),
                ]
                .into_iter()
                .flatten()
                .collect();
                let mut detail = format!(
                    "{} tokens: engine cached = uncached = contract: {a:?}",
                    a.len()
                );
                if let Some(e) = expect.ok().filter(|e| &e.generated != a) {
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
            _ => {
                let why: Vec<String> = [&eng, &unc, &con]
                    .iter()
                    .filter_map(|t| t.as_ref().err().cloned())
                    .collect();
                CheckResult::new(Check::Generation, Status::Fail, why.join("; "))
            }
        },
    );

    // agrees + generation_oracle: engine ≈ oracle under the policy, decisions exact.
    let mut oracle_summary = None;
    match (&eng, &ora) {
        (Ok(e), Ok(r)) => {
            let (c, s) = check_agrees(m, p, e, r, policy, expect);
            checks.push(c);
            oracle_summary = Some(s);
            let (a, b) = (decode_tokens(e), decode_tokens(r));
            let found: Vec<Finding> = tokens_finding("oracle", &a, &b).into_iter().collect();
            checks.push(if a.is_empty() {
                CheckResult::not_checked(
                    Check::GenerationOracle,
                    "no tokens generated (--generate 0)",
                )
            } else {
                judge(
                    m,
                    &p.id,
                    CheckResult::new(
                        Check::GenerationOracle,
                        Status::Pass,
                        format!(
                            "{} greedy tokens equal to the oracle's (its own KV cache)",
                            a.len()
                        ),
                    ),
                    found,
                )
            });
        }
        (Err(e), _) => {
            checks.push(CheckResult::new(Check::Agrees, Status::Fail, e.clone()));
            checks.push(CheckResult::new(
                Check::GenerationOracle,
                Status::Fail,
                e.clone(),
            ));
        }
        (Ok(_), Err(why)) if oracle_failed_to_run => {
            checks.push(CheckResult::new(Check::Agrees, Status::Fail, why.clone()));
            checks.push(CheckResult::new(
                Check::GenerationOracle,
                Status::Fail,
                why.clone(),
            ));
        }
        (Ok(_), Err(why)) => {
            checks.push(CheckResult::not_checked(Check::Agrees, why.clone()));
            checks.push(CheckResult::not_checked(
                Check::GenerationOracle,
                why.clone(),
            ));
        }
    }

    let counts = match &eng {
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
    }
}

fn observed_of(r: &PromptResult) -> BTreeMap<String, f64> {
    let mut obs = BTreeMap::new();
    for run in &r.runs {
        let key = match (run.producer.as_str(), run.out.ends_with("uncached.trace")) {
            ("engine", true) => "engine_uncached".to_string(),
            (p, _) => p.to_string(),
        };
        obs.insert(
            format!("{key}_seconds"),
            (run.seconds * 1000.0).round() / 1000.0,
        );
        if let Some(kib) = run.peak_rss_kib {
            obs.insert(format!("{key}_peak_rss_kib"), kib as f64);
        }
    }
    obs
}

fn check_baselines(
    m: &Milestone,
    baselines: &[Baseline],
    results: &[PromptResult],
    conditions_of: &dyn Fn(&PromptResult) -> Conditions,
    assert_observed: Option<f64>,
    set: &PromptSet,
    selected: &[Prompt],
) -> (Vec<CheckResult>, Vec<String>) {
    let mut out = Vec::new();
    let mut not_selected = Vec::new();
    for b in baselines.iter().filter(|b| b.milestone == m.id) {
        let name = Check::Baseline(b.id.clone());
        // A prompt of the set left out by --only: its baselines are not this run's business.
        let want_prompt = b.requires.get("prompt").and_then(Value::as_str);
        if want_prompt.is_some_and(|p| {
            !selected.iter().any(|s| s.id == p) && set.prompts.iter().any(|s| s.id == p)
        }) {
            not_selected.push(b.id.clone());
            continue;
        }
        let mut applied = None;
        let mut reasons = Vec::new();
        for r in results {
            match b.unmet(&conditions_of(r)) {
                None => {
                    applied = Some(r);
                    break;
                }
                Some(why) => reasons.push(why),
            }
        }
        let Some(r) = applied else {
            let why = match want_prompt {
                Some(p) if !selected.iter().any(|s| s.id == p) => {
                    format!("prompt {p:?} is not in {}", set.path.display())
                }
                _ => reasons
                    .into_iter()
                    .find(|r| !r.starts_with("requires prompt="))
                    .unwrap_or_else(|| "no run matched".into()),
            };
            out.push(CheckResult::not_checked(name, why));
            continue;
        };
        if r.counts.is_null() {
            out.push(CheckResult::new(
                name,
                Status::Fail,
                "engine trace missing: counts unavailable",
            ));
            continue;
        }
        let mut c = CheckResult::new(name, Status::Pass, String::new());
        for (key, want) in &b.counts {
            let have = r.counts.get(key).cloned().unwrap_or(Value::Null);
            if &have != want {
                c.findings.push(finding(
                    FindingKind::CountChanged,
                    key.clone(),
                    1,
                    format!("{key}: baseline {want}, now {have}"),
                ));
            }
        }
        let obs = observed_of(r);
        let mut notes = Vec::new();
        for (key, old) in &b.observed {
            if let Some(new) = obs.get(key) {
                let delta = if *old != 0.0 { (new - old) / old } else { 0.0 };
                c.observed.push(Observed {
                    key: key.clone(),
                    baseline: *old,
                    now: *new,
                    delta,
                });
                notes.push(format!("{key} {new} ({:+.0}%)", delta * 100.0));
                if let Some(tol) = assert_observed {
                    if delta.abs() > tol {
                        c.findings.push(finding(
                            FindingKind::ObservedOutOfTolerance,
                            key.clone(),
                            1,
                            format!(
                                "{key}: baseline {old}, now {new} ({:+.0}% > ±{:.0}%)",
                                delta * 100.0,
                                tol * 100.0
                            ),
                        ));
                    }
                }
            }
        }
        let changed = c
            .findings
            .iter()
            .filter(|f| f.kind == FindingKind::CountChanged)
            .count();
        c.detail = format!(
            "{} of {} counts exact; observed: {}",
            b.counts.len() - changed,
            b.counts.len(),
            if notes.is_empty() {
                "none recorded".into()
            } else {
                notes.join(", ")
            }
        );
        let unrecorded: Vec<&str> = r
            .counts
            .as_object()
            .into_iter()
            .flat_map(|o| o.keys())
            .filter(|k| !b.counts.contains_key(*k))
            .map(String::as_str)
            .collect();
        if !unrecorded.is_empty() {
            c.detail.push_str(&format!(
                "; NOT CHECKED (not in this baseline; --bless records them): {}",
                unrecorded.join(", ")
            ));
        }
        if !c.findings.is_empty() {
            c.status = Status::Fail;
        }
        out.push(c);
    }
    if !out.iter().any(|c| c.status != Status::NotChecked) {
        out.push(CheckResult::new(Check::Baselines, Status::Fail, format!("no baseline of milestone {} applied to this run: zero checked baselines is a failure (record one with --bless)", m.id)));
    }
    (out, not_selected)
}

#[allow(clippy::too_many_arguments)]
fn bless(
    o: &GateOptions,
    file: &mut MilestoneFile,
    ms_path: &Path,
    m: &Milestone,
    set: &PromptSet,
    report: &MilestoneReport,
    bl_file: &mut BaselineFile,
    bl_path: &Path,
    conditions_of: &dyn Fn(&PromptResult) -> Conditions,
) -> Result<String> {
    let mut log = Vec::new();
    let entry = file
        .get_mut(&m.id)
        .ok_or_else(|| gerr!("milestone {} vanished", m.id))?;
    if entry.prompts.sha256 != set.sha256 {
        log.push(format!(
            "{}: prompts sha256 {} -> {}",
            m.id, entry.prompts.sha256, set.sha256
        ));
        entry.prompts.sha256 = set.sha256.clone();
    }
    // Expectations belong to the milestone's own --generate; another N gets only its baselines.
    let own_generate = report.generate == m.generate;
    if !own_generate {
        log.push(format!("{}: expectations left as recorded for --generate {} (this run: --generate {}); baselines recorded", m.id, m.generate, report.generate));
    }
    for r in &report.prompts {
        let Some(digest) = r.digests.get("engine") else {
            log.push(format!(
                "{}/{}: engine failed; expectation left as it was",
                m.id, r.id
            ));
            continue;
        };
        if own_generate {
            let differing = r
                .checks
                .iter()
                .find(|c| c.check == Check::Matches)
                .map(|c| {
                    c.findings
                        .iter()
                        .chain(&c.excused)
                        .filter(|f| f.kind == FindingKind::TensorDiffers)
                        .map(|f| f.about.count)
                        .sum()
                })
                .unwrap_or(0);
            let oracle_differing = r
                .checks
                .iter()
                .find(|c| c.check == Check::Agrees && c.status != Status::NotChecked)
                .map(|c| {
                    c.findings
                        .iter()
                        .chain(&c.excused)
                        .filter(|f| f.kind == FindingKind::DecisionDiffers)
                        .count()
                });
            let new = Expectation {
                engine_digest: digest.clone(),
                tensors: r.counts["tensors"].as_u64().unwrap_or(0) as usize,
                decisions: r.counts["decisions"].as_u64().unwrap_or(0) as usize,
                differing_elements: differing,
                generated: r.generated.engine_cached.clone().unwrap_or_default(),
                oracle_decisions_differing: oracle_differing.unwrap_or_else(|| {
                    entry
                        .expect
                        .get(&r.id)
                        .map(|e| e.oracle_decisions_differing)
                        .unwrap_or(0)
                }),
            };
            match entry.expect.get(&r.id) {
                Some(old) if *old == new => {}
                Some(old) => log.push(format!(
                    "{}/{}: expectation {} -> {}",
                    m.id,
                    r.id,
                    serde_json::to_string(old).unwrap_or_default(),
                    serde_json::to_string(&new).unwrap_or_default()
                )),
                None => log.push(format!(
                    "{}/{}: new expectation {}",
                    m.id,
                    r.id,
                    serde_json::to_string(&new).unwrap_or_default()
                )),
            }
            entry.expect.insert(r.id.clone(), new);
        }

        let conditions = conditions_of(r);
        let id = format!("{}.{}.t{}.g{}", m.id, r.id, o.threads, report.generate);
        let counts: BTreeMap<String, Value> = r
            .counts
            .as_object()
            .map(|o| o.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
            .unwrap_or_default();
        let baseline = Baseline {
            id: id.clone(),
            milestone: m.id.clone(),
            requires: conditions,
            counts,
            observed: observed_of(r),
        };
        match bl_file.baselines.iter_mut().find(|b| b.id == id) {
            Some(old) => {
                if old.counts != baseline.counts || old.requires != baseline.requires {
                    log.push(format!(
                        "baseline {id}: counts {} -> {}",
                        serde_json::to_string(&old.counts).unwrap_or_default(),
                        serde_json::to_string(&baseline.counts).unwrap_or_default()
                    ));
                }
                *old = baseline;
            }
            None => {
                log.push(format!("baseline {id}: new"));
                bl_file.baselines.push(baseline);
            }
        }
    }
    crate::write_json_atomic(ms_path, file)?;
    crate::write_json_atomic(bl_path, bl_file)?;
    if log.is_empty() {
        log.push("nothing changed".into());
    }
    Ok(log.join("\n"))
}
