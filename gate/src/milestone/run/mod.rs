//! Running a milestone: every model's every selected prompt through the engine, the contract
//! and the oracle, then the checks — stable, matches, generation, agrees, generation_oracle —
//! and the baselines.
//!
//! `run_milestone` (this file) drives the phases: `Settled::settle` (everything checked before
//! a producer runs, one `Plan` per model), `Producers` (the three producers by name), `produce`
//! (every run, each role in order on a thread of its own, and the oracle probe), then
//! `judge_plan` per model: prompt.rs judges each prompt (checks.rs, agrees.rs), recorded.rs the
//! baselines and `--bless`, and `tally` the verdict. report.rs holds the report types;
//! crate::milestone::render renders them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_diff::Policy;
use tracegate_producers::{default_contract_cmd, default_oracle_cmd, python, Producer, Verb};

use crate::milestone::baselines::{BaselineFile, Conditions};
use crate::milestone::milestones::{Milestone, MilestoneFile, MilestoneModel};
use crate::prompts::{self, Prompt, PromptSet};
use crate::{gerr, Result};

mod agrees;
mod checks;
mod findings;
mod port;
mod prompt;
mod recorded;
mod report;
mod traces;

pub(crate) use port::tokenize_text;
pub use port::AUTO_POLICY;

pub use report::*;

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
    /// `gate init`: the milestones and baselines not yet written (they are, with the golden
    /// traces, only when the first run has recorded them); None: read from the root.
    pub milestones: Option<MilestoneFile>,
    pub baselines: Option<BaselineFile>,
}

/// Whether the oracle's interpreter can import torch and transformers; Err carries the reason.
/// The default oracle's worker answers it (`versions`), so torch is imported once per gate run;
/// `dir`: where it writes its answer. Asked once per gate process and interpreter (`gate check`
/// runs every milestone): an answer is remembered, a failure asked again.
fn probe_oracle(
    root: &Path,
    timeout: std::time::Duration,
    oracle: Option<&Producer>,
    dir: &Path,
) -> Result<Value> {
    static ANSWERED: std::sync::Mutex<BTreeMap<String, Value>> =
        std::sync::Mutex::new(BTreeMap::new());
    let py = python(root, "TRACEGATE_ORACLE_PYTHON");
    let key = format!("{py}\0{}", oracle.is_some());
    let answered = || ANSWERED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(v) = answered().get(&key) {
        return Ok(v.clone());
    }
    let v = ask_versions(root, timeout, oracle, dir, &py)?;
    answered().insert(key, v.clone());
    Ok(v)
}

fn ask_versions(
    root: &Path,
    timeout: std::time::Duration,
    oracle: Option<&Producer>,
    dir: &Path,
    py: &str,
) -> Result<Value> {
    let unavailable = |err: tracegate_producers::Error| {
        let err = err.to_string();
        let last = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.starts_with('['))
            .unwrap_or("import failed")
            .to_string();
        gerr!(Unavailable: "torch/transformers unavailable to {py}: {last}")
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
            std::fs::read_to_string(&answer)
                .map_err(|e| gerr!(Unavailable: "{}: {e}", answer.display()))
        })?,
        None => {
            let code = "import json, torch, transformers, numpy; print(json.dumps({'torch': torch.__version__, 'transformers': transformers.__version__, 'numpy': numpy.__version__}))";
            tracegate_producers::run_helper(root, &[py.into(), "-c".into(), code.into()], timeout)
                .map_err(unavailable)?
        }
    };
    serde_json::from_str(&out).map_err(|e| gerr!(Unavailable: "version probe printed no JSON: {e}"))
}

fn stack_versions(oracle: &Result<Value>) -> Value {
    json!({
        "tracegate": env!("CARGO_PKG_VERSION"),
        "oracle_stack": match oracle { Ok(v) => v.clone(), Err(e) => json!({"unavailable": e.to_string()}) },
    })
}

/// What a milestone run is about, settled before any producer runs: every refusal comes here.
/// One plan per model of the milestone that runs.
struct Plan {
    m: Milestone,
    /// The model of `m` this plan runs.
    mm: MilestoneModel,
    prompt_path: PathBuf,
    set: PromptSet,
    selected: Vec<Prompt>,
    /// The milestone model's own name, or the canonical path of `--model`.
    model: String,
    generate: usize,
    threads: usize,
    policy: Policy,
    /// `<work>/<milestone>/<model directory name>`, relative to the root (or absolute).
    work_rel: String,
}

/// The milestone file and one plan per model that runs: every model of the milestone, or the
/// one of `--model`'s family.
struct Settled {
    ms_path: PathBuf,
    file: MilestoneFile,
    /// `<work>/<milestone>`, locked for the run.
    work_rel: String,
    plans: Vec<Plan>,
}

impl Settled {
    fn settle(o: &GateOptions) -> Result<Settled> {
        let ms_path = o.root.join("milestones.json");
        let file = match &o.milestones {
            Some(f) => f.clone(),
            None => MilestoneFile::load(&ms_path)?,
        };
        let m = file.get(&o.milestone)?.clone();
        let prompt_path = prompts::resolve(&o.root, o.prompts.as_deref().unwrap_or(&m.prompts.set));
        let set: PromptSet = prompts::load(&prompt_path)?;
        if m.port.is_none() {
            set.token_ids_only(&format!("milestone {}", m.id))?;
        }
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
        if let (Some(_), Some(dir)) = (&m.port, &o.model) {
            return Err(gerr!(
                "--model {}: milestone {}'s golden traces are of {}; `gate init` a milestone for another model",
                dir.display(),
                m.id,
                m.models.first().map_or("its model", |mm| mm.model.as_str())
            ));
        }
        let runs: Vec<(MilestoneModel, String)> = match &o.model {
            Some(dir) => vec![model_of(o, &m, dir)?],
            None => m
                .models
                .iter()
                .map(|mm| (mm.clone(), mm.model.clone()))
                .collect(),
        };
        let generate = o.generate.unwrap_or(m.generate);
        // A new port milestone's policy is chosen by its first run (run/port.rs).
        let policy_arg = if m.port.is_some() && m.policy == AUTO_POLICY {
            "f32"
        } else {
            &m.policy
        };
        let policy =
            Policy::resolve(policy_arg, &o.root).map_err(|e| gerr!("{}: {e}", m.policy))?;
        let work_rel = format!("{}/{}", o.work.trim_end_matches('/'), m.id);
        let mut plans = Vec::new();
        for (mm, model) in runs {
            for p in &selected {
                prompts::check_fits(&o.root, &model, Some(&p.id), p.tokens.len(), generate)?;
            }
            plans.push(Plan {
                work_rel: format!("{work_rel}/{}", dir_name(&model)),
                m: m.clone(),
                mm,
                prompt_path: prompt_path.clone(),
                set: set.clone(),
                selected: selected.clone(),
                model,
                generate,
                threads: o.threads,
                policy: policy.clone(),
            });
        }
        Ok(Settled {
            ms_path,
            file,
            work_rel,
            plans,
        })
    }
}

/// A model's directory name: its traces' directory under the milestone's, and its part of a
/// baseline id (milestones.json keeps these distinct within a milestone).
pub fn dir_name(model: &str) -> String {
    Path::new(model)
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| model.to_string())
}

impl Plan {
    /// The conditions a baseline requires, as this run meets them for prompt `r`.
    fn conditions(&self, r: &PromptResult) -> Conditions {
        let mut c = Conditions::new();
        c.insert("prompt".into(), json!(r.id));
        c.insert("threads".into(), json!(self.threads));
        c.insert("generate".into(), json!(self.generate));
        c.insert("model".into(), json!(self.model));
        c
    }
}

/// `--model DIR` validated as the engine would (unsupported fields are refused here, not mid-run):
/// the milestone's model of the same family, and the name DIR runs under.
fn model_of(o: &GateOptions, m: &Milestone, dir: &Path) -> Result<(MilestoneModel, String)> {
    let shown = crate::paths::shown(dir);
    let (_, raw) = tracegate_engine::load_config(dir).map_err(|e| gerr!("--model {shown}: {e}"))?;
    let family = prompts::family(&raw);
    let Some(mm) = m.models.iter().find(|mm| mm.family == family) else {
        let families: Vec<&str> = m.models.iter().map(|mm| mm.family.as_str()).collect();
        return Err(gerr!(
            "--model {shown}: model_type {family:?} is not a family of milestone {} ({})",
            m.id,
            families.join(", ")
        ));
    };
    let canon = std::fs::canonicalize(dir).map_err(|e| gerr!("--model {shown}: {e}"))?;
    // The milestone's own checkpoint, however spelled, keeps the milestone's name, so its
    // recorded baselines still apply.
    let name = if std::fs::canonicalize(o.root.join(&mm.model)).is_ok_and(|own| own == canon) {
        mm.model.clone()
    } else {
        canon.display().to_string()
    };
    Ok((mm.clone(), name))
}

/// The producers of a milestone run, by name, and whether the oracle can run at all.
struct Producers {
    engine: Producer,
    contract: Producer,
    oracle: Producer,
}

impl Producers {
    fn new(o: &GateOptions) -> Result<Producers> {
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
        Ok(Producers {
            engine,
            contract,
            oracle,
        })
    }

    fn of(&self, role: Role) -> &Producer {
        match role {
            Role::Engine | Role::EngineUncached => &self.engine,
            Role::Contract => &self.contract,
            Role::Oracle => &self.oracle,
            Role::Candidate | Role::CandidateUncached => {
                unreachable!("a port milestone runs its candidate in run/port.rs")
            }
        }
    }
}

/// Every run of a milestone, and what the oracle's probe said.
struct Produced {
    /// Per plan, per selected prompt, in order.
    runs: Vec<Vec<PromptRuns>>,
    /// The oracle's versions, or why it cannot run (no torch or transformers).
    oracle_probe: Result<Value>,
    /// Seconds until the oracle's probe answered (its worker started).
    setup: f64,
}

/// Runs every model's every prompt. Each role (engine cached, engine uncached, contract,
/// oracle) takes its requests in plan and prompt order from a thread of its own, so the roles
/// overlap one another and the oracle worker's start-up: the engine and the contract run while
/// torch imports. The oracle's requests start once its probe answered (a user's oracle always
/// runs). A run that timed out stops every role before its next request and refuses the whole
/// gate run: a hang says nothing about the model.
fn produce(
    o: &GateOptions,
    plans: &[Plan],
    producers: &Producers,
    probe_dir: &Path,
) -> Result<Produced> {
    let started = std::time::Instant::now();
    let jobs: Vec<(&Plan, &Prompt)> = plans
        .iter()
        .flat_map(|plan| plan.selected.iter().map(move |p| (plan, p)))
        .collect();
    for (plan, p) in &jobs {
        let dir = o.root.join(&plan.work_rel).join(&p.id);
        // Never compare a stale trace: a producer that fails must leave nothing to read.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| gerr!(File: "{}: {e}", dir.display()))?;
    }
    crate::progress::doing("running the producers");
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (records, oracle_probe, setup) = std::thread::scope(|s| {
        let role_runs = |role: Role| {
            let (jobs, stop) = (&jobs, &stop);
            s.spawn(move || {
                let mut out = Vec::new();
                for (plan, p) in jobs {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let verb = Verb::Trace {
                        model: plan.model.clone(),
                        tokens: p.tokens.clone(),
                        out: format!("{}/{}/{}", plan.work_rel, p.id, role.file()),
                        internals: false,
                        generate: plan.generate,
                        cache: role != Role::EngineUncached,
                        force: None,
                    };
                    let rec = producers.of(role).run(&o.root, &verb, o.timeout);
                    if rec.timed_out {
                        stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    out.push(rec);
                }
                out
            })
        };
        // The contract worker's start-up overlaps the oracle's, which answers the probe.
        producers.contract.prestart(&o.root);
        let engine = role_runs(Role::Engine);
        let engine_uncached = role_runs(Role::EngineUncached);
        let contract = role_runs(Role::Contract);
        let oracle_probe = probe_oracle(
            &o.root,
            o.timeout,
            o.oracle_cmd.is_none().then_some(&producers.oracle),
            probe_dir,
        );
        let setup = started.elapsed().as_secs_f64();
        let oracle =
            (o.oracle_cmd.is_some() || oracle_probe.is_ok()).then(|| role_runs(Role::Oracle));
        let done = "a producer thread panicked";
        let records = (
            engine.join().expect(done),
            engine_uncached.join().expect(done),
            contract.join().expect(done),
            oracle.map(|h| h.join().expect(done)),
        );
        (records, oracle_probe, setup)
    });
    let (engine, engine_uncached, contract, oracle) = records;
    let mut by_role = vec![
        (Role::Engine, &engine),
        (Role::EngineUncached, &engine_uncached),
        (Role::Contract, &contract),
    ];
    by_role.extend(oracle.as_ref().map(|r| (Role::Oracle, r)));
    // The first run that timed out, in prompt then role order; without one, every role ran
    // every job.
    let first = (0..jobs.len()).find_map(|k| {
        by_role
            .iter()
            .find_map(|(role, recs)| recs.get(k).filter(|r| r.timed_out).map(|r| (*role, r)))
            .map(|(role, rec)| (jobs[k], role, rec))
    });
    if let Some(((plan, p), role, rec)) = first {
        return Err(gerr!(
            Producer: "{} {}: {} {} timed out after {} s (--timeout) and was killed: $ {}",
            dir_name(&plan.model),
            p.id,
            role.label(),
            rec.verb,
            o.timeout.as_secs(),
            rec.invocation
        ));
    }
    let mut oracle = oracle.map(Vec::into_iter);
    let mut all = engine.into_iter().zip(engine_uncached).zip(contract).map(
        |((engine, engine_uncached), contract)| {
            let mut runs = vec![
                (Role::Engine, engine),
                (Role::EngineUncached, engine_uncached),
                (Role::Contract, contract),
            ];
            runs.extend(
                oracle
                    .as_mut()
                    .and_then(Iterator::next)
                    .map(|r| (Role::Oracle, r)),
            );
            PromptRuns(runs)
        },
    );
    let runs = plans
        .iter()
        .map(|plan| all.by_ref().take(plan.selected.len()).collect())
        .collect();
    Ok(Produced {
        runs,
        oracle_probe,
        setup,
    })
}

/// Runs every model of the milestone (or `--model`'s) on every selected prompt: one report per
/// model, in milestones.json's order, and with `--bless` the log of what was recorded.
pub fn run_milestone(o: &GateOptions) -> Result<(Vec<MilestoneReport>, Option<String>)> {
    let started = std::time::Instant::now();
    let mut settled = Settled::settle(o)?;
    if settled.plans.first().is_some_and(|p| p.m.port.is_some()) {
        return port::run(o, settled);
    }
    let _lock = crate::WorkLock::acquire(&o.root.join(&settled.work_rel))?;
    let producers = Producers::new(o)?;
    let jobs: u64 = settled.plans.iter().map(|p| p.selected.len() as u64).sum();
    let progress = crate::progress::start(format!("gate {}", o.milestone), jobs);
    let produced = produce(
        o,
        &settled.plans,
        &producers,
        &o.root.join(&settled.work_rel),
    )?;
    let mut wall_s: BTreeMap<&'static str, f64> = BTreeMap::new();
    wall_s.insert("setup", produced.setup);
    wall_s.insert(
        "producers",
        started.elapsed().as_secs_f64() - produced.setup,
    );
    let judging = std::time::Instant::now();
    let bl_path = o.root.join("baselines.json");
    let mut bl_file = BaselineFile::load(&bl_path)?;
    let mut reports: Vec<MilestoneReport> = settled
        .plans
        .iter()
        .zip(produced.runs)
        .map(|(plan, runs)| judge_plan(o, plan, runs, &produced.oracle_probe, &bl_file))
        .collect();
    drop(progress);
    wall_s.insert("judge", judging.elapsed().as_secs_f64());
    wall_s.insert("total", started.elapsed().as_secs_f64());
    for r in &mut reports {
        r.wall_s = wall_s.clone();
    }
    eprintln!(
        "[gate {}] wall (observed): setup {:.1} s, producers {:.1} s, judge {:.1} s, total {:.1} s ({} model(s), {jobs} prompt runs)",
        o.milestone, wall_s["setup"], wall_s["producers"], wall_s["judge"], wall_s["total"], reports.len()
    );
    let bless_log = if o.bless {
        let mut log = Vec::new();
        for (plan, report) in settled.plans.iter().zip(&reports) {
            log.extend(recorded::bless(
                plan,
                report,
                &mut settled.file,
                &mut bl_file,
            )?);
        }
        // Both or neither: a milestones.json blessed without its baselines would disagree.
        let ms = crate::json_bytes(&settled.ms_path, &settled.file)?;
        let bl = crate::json_bytes(&bl_path, &bl_file)?;
        crate::write_files(&[(&settled.ms_path, &ms), (&bl_path, &bl)])?;
        if log.is_empty() {
            log.push("nothing changed".into());
        }
        Some(log.join("\n"))
    } else {
        None
    };
    Ok((reports, bless_log))
}

/// One model's runs judged, prompt by prompt, and its baselines checked.
fn judge_plan(
    o: &GateOptions,
    plan: &Plan,
    runs: Vec<PromptRuns>,
    oracle_probe: &Result<Value>,
    bl_file: &BaselineFile,
) -> MilestoneReport {
    let mut results = Vec::new();
    for (p, runs) in plan.selected.iter().zip(runs) {
        let result =
            prompt::judge_prompt(o, &plan.m, &plan.mm, p, runs, &plan.policy, oracle_probe);
        plan.judged(&result);
        results.push(result);
    }
    let baselines =
        recorded::check_baselines(plan, &bl_file.baselines, &results, o.assert_observed);
    plan.report(o, stack_versions(oracle_probe), results, baselines)
}

impl Plan {
    /// The progress line of a judged prompt: its checks and their statuses.
    fn judged(&self, r: &PromptResult) {
        let checks: Vec<String> = r
            .checks
            .iter()
            .map(|c| format!("{} {}", c.check, c.status))
            .collect();
        crate::progress::step(format!(
            "{} {}: {}",
            dir_name(&self.model),
            r.id,
            checks.join(", ")
        ));
    }

    /// This model's report: its prompts' results and its baselines (checked, and those of
    /// prompts `--only` left out), tallied.
    fn report(
        &self,
        o: &GateOptions,
        stack: Value,
        results: Vec<PromptResult>,
        (baselines, baselines_not_selected): (Vec<CheckResult>, Vec<String>),
    ) -> MilestoneReport {
        let mut report = MilestoneReport {
            schema: REPORT_SCHEMA,
            milestone: self.m.id.clone(),
            claim: self.m.claim.clone(),
            model: self.model.clone(),
            family: self.mm.family.clone(),
            prompt_file: self.prompt_path.display().to_string(),
            prompt_sha256: self.set.sha256.clone(),
            generate: self.generate,
            threads: o.threads,
            timeout_s: o.timeout.as_secs(),
            policy: self.m.policy.clone(),
            gate_invocation: o.gate_invocation.clone(),
            stack,
            prompts: results,
            baselines,
            baselines_not_selected,
            totals: BTreeMap::new(),
            wall_s: BTreeMap::new(),
            verdict: GateVerdict::Fail,
        };
        (report.totals, report.verdict) = tally(&report);
        report
    }
}

/// Every check's status counted, and the verdict: FAIL when anything failed or nothing passed,
/// INCOMPLETE when something was NOT CHECKED, else PASS.
fn tally(report: &MilestoneReport) -> (BTreeMap<Status, usize>, GateVerdict) {
    let mut totals: BTreeMap<Status, usize> = BTreeMap::new();
    for c in report.all_checks() {
        *totals.entry(c.status).or_default() += 1;
    }
    let n = |s: Status| totals.get(&s).copied().unwrap_or(0);
    let verdict = if n(Status::Fail) > 0 || n(Status::Pass) == 0 {
        GateVerdict::Fail
    } else if n(Status::NotChecked) > 0 {
        GateVerdict::Incomplete
    } else {
        GateVerdict::Pass
    };
    (totals, verdict)
}
