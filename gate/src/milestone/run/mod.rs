//! Running a milestone: every model's every selected prompt through the engine, the contract
//! and the oracle, then the checks — stable, matches, generation, agrees, generation_oracle —
//! and the baselines.
//!
//! `run_milestone` (this file) drives the phases: `Settled::settle` (plan.rs: everything checked
//! before a producer runs, one `Plan` per model), `Producers` (the three producers by name),
//! `produce` (every run, each role in order on a thread of its own, and the oracle probe), then
//! `judge_plan` per model: prompt.rs judges each prompt (checks.rs, agrees.rs), recorded.rs the
//! baselines and `--bless`, and `Plan::report` tallies the verdict. A port milestone runs in
//! port.rs instead. report.rs holds the report types; crate::milestone::render renders them.
//!
//! From the bottom up; no file imports one above it: report.rs; plan.rs, traces.rs,
//! findings.rs (what the phases share) and ranks.rs (a sharded port's rank traces merged);
//! checks.rs and agrees.rs; prompt.rs and recorded.rs; candidate.rs (a port's candidate tried
//! once); port.rs; this file, which calls them all and re-exports what the gate's other parts name.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tracegate_producers::{default_contract_cmd, default_oracle_cmd, python, Producer, Verb};

use crate::milestone::baselines::BaselineFile;
use crate::prompts::Prompt;
use crate::{gerr, Result};

mod agrees;
mod candidate;
mod checks;
mod findings;
mod plan;
mod port;
mod prompt;
mod ranks;
mod recorded;
mod report;
mod sharded;
mod traces;

pub use plan::{dir_name, GateOptions, AUTO_POLICY};
use plan::{Plan, Settled};
pub(crate) use port::tokenize_text;
pub(crate) use ranks::run_trace;

pub use report::*;

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
        .map_err(|e| gerr!("--oracle-cmd: {e}"))?
        .sharded_by(tracegate_producers::ORACLE_SHARDS_FLAG);
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
            _ => unreachable!(
                "a port milestone runs in run/port.rs, a sharded one in run/sharded.rs"
            ),
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
///
/// A sampling family (block diffusion, docs/diffusion-gemma.md) draws from the milestone's seed:
/// the engine and the contract draw the same numbers, torch's generator others, so the oracle
/// runs forced by the engine's trace of the same prompt (`--force-decisions`: its canvases,
/// draws and stops) and waits for it; such a family has no uncached path, and that role does
/// not run.
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
    let trace_of =
        |plan: &Plan, p: &Prompt, role: Role| format!("{}/{}/{}", plan.work_rel, p.id, role.file());
    // The engine's finished jobs, in order, for an oracle forced by its traces.
    let (engine_done, engine_finished) = std::sync::mpsc::channel::<usize>();
    let engine_finished = std::sync::Mutex::new(engine_finished);
    let (records, oracle_probe, setup) = std::thread::scope(|s| {
        let role_runs = |role: Role, done: Option<std::sync::mpsc::Sender<usize>>| {
            let (jobs, stop) = (&jobs, &stop);
            let mut finished = (role == Role::Oracle).then_some((0usize, &engine_finished));
            s.spawn(move || {
                let mut out = Vec::new();
                for (k, (plan, p)) in jobs.iter().enumerate() {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        break;
                    }
                    let sampling = plan.samples();
                    if sampling && role == Role::EngineUncached {
                        out.push(None);
                        continue;
                    }
                    if let (true, Some((seen, rx))) = (sampling, finished.as_mut()) {
                        // The engine runs every job in order: wait until it has run this one
                        // (or stopped: then the forcing trace is missing and the run says so).
                        let rx = rx.lock().unwrap_or_else(|p| p.into_inner());
                        while *seen <= k {
                            match rx.recv() {
                                Ok(_) => *seen += 1,
                                Err(_) => break,
                            }
                        }
                    }
                    let verb = Verb::Trace {
                        model: plan.model.clone(),
                        tokens: p.tokens.clone(),
                        out: trace_of(plan, p, role),
                        internals: plan.internals,
                        generate: plan.generate,
                        cache: role != Role::EngineUncached,
                        force: (sampling && role == Role::Oracle)
                            .then(|| trace_of(plan, p, Role::Engine)),
                        seed: sampling.then_some(plan.seed),
                        shards: None,
                    };
                    let rec = producers.of(role).run(&o.root, &verb, o.timeout);
                    if rec.timed_out {
                        stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    out.push(Some(rec));
                    if let Some(tx) = &done {
                        let _ = tx.send(k);
                    }
                }
                out
            })
        };
        // The contract worker's start-up overlaps the oracle's, which answers the probe.
        producers.contract.prestart(&o.root);
        let engine = role_runs(Role::Engine, Some(engine_done));
        let engine_uncached = role_runs(Role::EngineUncached, None);
        let contract = role_runs(Role::Contract, None);
        let oracle_probe = probe_oracle(
            &o.root,
            o.timeout,
            o.oracle_cmd.is_none().then_some(&producers.oracle),
            probe_dir,
        );
        let setup = started.elapsed().as_secs_f64();
        let oracle =
            (o.oracle_cmd.is_some() || oracle_probe.is_ok()).then(|| role_runs(Role::Oracle, None));
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
            .find_map(|(role, recs)| {
                recs.get(k)
                    .and_then(Option::as_ref)
                    .filter(|r| r.timed_out)
                    .map(|r| (*role, r))
            })
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
            // A role that does not run for this family leaves no record.
            PromptRuns(
                runs.into_iter()
                    .filter_map(|(role, r)| r.map(|r| (role, r)))
                    .collect(),
            )
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
    if settled.plans.iter().any(|p| !p.mm.shards.is_empty()) {
        return sharded::run(o, settled);
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
        Some(recorded::bless_all(
            o,
            settled.plans.iter().zip(&reports),
            &settled.ms_path,
            &mut settled.file,
            &bl_path,
            &mut bl_file,
        )?)
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
