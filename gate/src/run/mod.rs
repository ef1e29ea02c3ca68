//! Running a milestone: every selected prompt through the engine, the contract and the oracle,
//! then the checks — stable, matches, generation, agrees, generation_oracle — and the baselines.

//!
//! `run_milestone` (this file) drives the phases: `Plan::settle` (everything checked before a
//! producer runs), `Producers` (the three producers by name and the oracle probe), `run_prompt`
//! (one prompt's runs), then prompt.rs judges each prompt (checks.rs, agrees.rs), recorded.rs
//! the baselines and `--bless`, and `tally` the verdict. report.rs holds the report types;
//! crate::report renders them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_diff::Policy;

use crate::baselines::{BaselineFile, Conditions};
use crate::milestones::{Milestone, MilestoneFile, MilestoneModel};
use crate::producer::{Producer, Verb};
use crate::prompts::{self, Prompt, PromptSet};
use crate::{gerr, Result};

mod agrees;
mod checks;
mod prompt;
mod recorded;
mod report;

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
) -> Result<Value> {
    let py = python(root, "TRACEGATE_ORACLE_PYTHON");
    let unavailable = |err: crate::Error| {
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
            crate::producer::run_helper(root, &[py.clone(), "-c".into(), code.into()], timeout)
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
        let file = MilestoneFile::load(&ms_path)?;
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
        let runs: Vec<(MilestoneModel, String)> = match &o.model {
            Some(dir) => vec![model_of(o, &m, dir)?],
            None => m
                .models
                .iter()
                .map(|mm| (mm.clone(), mm.model.clone()))
                .collect(),
        };
        let generate = o.generate.unwrap_or(m.generate);
        let policy = Policy::resolve(&m.policy, &o.root).map_err(|e| gerr!("{}: {e}", m.policy))?;
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
    /// The oracle's versions, or why it cannot run (no torch or transformers).
    oracle_probe: Result<Value>,
    /// A user's oracle always runs; the default one when its probe answered.
    oracle_runs: bool,
}

impl Producers {
    /// `dir`: where the oracle's probe writes its answer.
    fn start(o: &GateOptions, dir: &Path) -> Result<Producers> {
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
            dir,
        );
        let oracle_runs = o.oracle_cmd.is_some() || oracle_probe.is_ok();
        Ok(Producers {
            engine,
            contract,
            oracle,
            oracle_probe,
            oracle_runs,
        })
    }

    fn of(&self, role: Role) -> &Producer {
        match role {
            Role::Engine | Role::EngineUncached => &self.engine,
            Role::Contract => &self.contract,
            Role::Oracle => &self.oracle,
        }
    }
}

/// Runs every model of the milestone (or `--model`'s) on every selected prompt: one report per
/// model, in milestones.json's order, and with `--bless` the log of what was recorded.
pub fn run_milestone(o: &GateOptions) -> Result<(Vec<MilestoneReport>, Option<String>)> {
    let started = std::time::Instant::now();
    let mut settled = Settled::settle(o)?;
    let _lock = crate::WorkLock::acquire(&o.root.join(&settled.work_rel))?;
    let producers = Producers::start(o, &o.root.join(&settled.work_rel))?;
    let setup = started.elapsed().as_secs_f64();
    let bl_path = o.root.join("baselines.json");
    let mut bl_file = BaselineFile::load(&bl_path)?;
    let mut reports = Vec::new();
    for plan in &settled.plans {
        reports.push(run_plan(o, plan, &producers, &bl_file, setup)?);
    }
    let sum = |k: &str| reports.iter().map(|r| r.wall_s[k]).sum::<f64>();
    eprintln!(
        "[gate {}] wall (observed): setup {setup:.1} s, producers {:.1} s, judge {:.1} s, total {:.1} s ({} model(s))",
        o.milestone,
        sum("producers"),
        sum("judge"),
        started.elapsed().as_secs_f64(),
        reports.len()
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
        crate::write_json_atomic(&settled.ms_path, &settled.file)?;
        crate::write_json_atomic(&bl_path, &bl_file)?;
        if log.is_empty() {
            log.push("nothing changed".into());
        }
        Some(log.join("\n"))
    } else {
        None
    };
    Ok((reports, bless_log))
}

/// One model's run: its prompts through the producers, judged, and its baselines checked.
/// `setup`: the seconds the milestone spent starting its producers (shared by its models).
fn run_plan(
    o: &GateOptions,
    plan: &Plan,
    producers: &Producers,
    bl_file: &BaselineFile,
    setup: f64,
) -> Result<MilestoneReport> {
    let started = std::time::Instant::now();
    let progress = crate::progress::start(
        format!("gate {} {}", plan.m.id, dir_name(&plan.model)),
        plan.selected.len() as u64,
    );
    let mut results = Vec::new();
    let mut wall_s: BTreeMap<&'static str, f64> = BTreeMap::new();
    wall_s.insert("setup", setup);
    let (mut producing, mut judging) = (0.0, 0.0);
    for p in &plan.selected {
        let phase = std::time::Instant::now();
        let runs = run_prompt(o, plan, producers, p)?;
        producing += phase.elapsed().as_secs_f64();
        let phase = std::time::Instant::now();
        let result = prompt::judge_prompt(
            o,
            &plan.m,
            &plan.mm,
            p,
            runs,
            &plan.policy,
            &producers.oracle_probe,
        );
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

    let (baselines, baselines_not_selected) =
        recorded::check_baselines(plan, &bl_file.baselines, &results, o.assert_observed);

    let m = &plan.m;
    let mut report = MilestoneReport {
        schema: REPORT_SCHEMA,
        milestone: m.id.clone(),
        claim: m.claim.clone(),
        model: plan.model.clone(),
        family: plan.mm.family.clone(),
        prompt_file: plan.prompt_path.display().to_string(),
        prompt_sha256: plan.set.sha256.clone(),
        generate: plan.generate,
        threads: o.threads,
        timeout_s: o.timeout.as_secs(),
        policy: m.policy.clone(),
        gate_invocation: o.gate_invocation.clone(),
        stack: stack_versions(&producers.oracle_probe),
        prompts: results,
        baselines,
        baselines_not_selected,
        totals: BTreeMap::new(),
        wall_s,
        verdict: GateVerdict::Fail,
    };
    (report.totals, report.verdict) = tally(&report);
    report
        .wall_s
        .insert("total", started.elapsed().as_secs_f64());
    Ok(report)
}

/// One prompt's runs, overlapping (the Python producers are served by their own workers), each
/// writing into a fresh `<work>/<milestone>/<prompt>/`. A run that timed out refuses the whole
/// gate run: a hang says nothing about the model.
fn run_prompt(
    o: &GateOptions,
    plan: &Plan,
    producers: &Producers,
    p: &Prompt,
) -> Result<PromptRuns> {
    let dir_rel = format!("{}/{}", plan.work_rel, p.id);
    let dir = o.root.join(&dir_rel);
    // Never compare a stale trace: a producer that fails must leave nothing to read.
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| gerr!(File: "{}: {e}", dir.display()))?;
    crate::progress::doing(format!("{}: running the producers", p.id));
    let runs = std::thread::scope(|s| {
        let spawn = |role: Role| {
            let verb = Verb::Trace {
                model: plan.model.clone(),
                tokens: p.tokens.clone(),
                out: format!("{dir_rel}/{}", role.file()),
                internals: false,
                generate: plan.generate,
                cache: role != Role::EngineUncached,
                force: None,
            };
            let producer = producers.of(role);
            s.spawn(move || producer.run(&o.root, &verb, o.timeout))
        };
        let engine = spawn(Role::Engine);
        let engine_uncached = spawn(Role::EngineUncached);
        let contract = spawn(Role::Contract);
        let oracle = producers.oracle_runs.then(|| spawn(Role::Oracle));
        let done = "a producer run panicked";
        PromptRuns {
            engine: engine.join().expect(done),
            engine_uncached: engine_uncached.join().expect(done),
            contract: contract.join().expect(done),
            oracle: oracle.map(|h| h.join().expect(done)),
        }
    });
    if let Some((role, rec)) = runs.by_role().find(|(_, rec)| rec.timed_out) {
        return Err(gerr!(
            Producer: "{}: {} {} timed out after {} s (--timeout) and was killed: $ {}",
            p.id,
            role.label(),
            rec.verb,
            o.timeout.as_secs(),
            rec.invocation
        ));
    }
    Ok(runs)
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
