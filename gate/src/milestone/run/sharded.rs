//! A sharded milestone (`gate m2`, docs/gate.md "m2"): each model runs its prompts in one process
//! (the engine and the oracle) and split by each of its `shards` (`tp=2`, `ep=2`; the engine, the
//! contract and the oracle, one trace per rank), and per split and prompt:
//! - `stable`: the unsharded engine reproduces its recorded digest;
//! - `merged_engine`: the engine's rank traces, merged (tracegate_trace::merge), ≡ the unsharded
//!   engine bit for bit; `merged_contract`: the contract's merged ≡ the engine's merged;
//! - `merged_oracle`: the oracle's merged within the milestone's policy of the unsharded oracle,
//!   every decision and greedy token equal (no near-tie excused: the claim is every argmax);
//! - `rank_shards`: each producer's rank traces hold what the split says (a run that computed
//!   everything on every rank would merge to the same digest).
//!
//! One report per model and split (`shards`), so baselines and `--bless` are the one-process
//! milestones' (recorded.rs), keyed by the split. A producer whose sharded mode is missing (it
//! refuses the flag) leaves its checks NOT CHECKED, never passed.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_producers::{RunRecord, Shards, Verb};
use tracegate_trace::{names, ShardKind, Trace};

use super::agrees::compare_agrees;
use super::checks::{check_stable, compare_matches};
use super::findings::tokens_finding;
use super::plan::{GateOptions, Plan, Settled};
use super::prompt::expectation;
use super::recorded;
use super::report::{
    finding, CheckResult, Finding, Generated, MilestoneReport, PromptResult, PromptRuns, Role,
    ShardedRun, Status,
};
use super::traces::{counts, decode_tokens, open, Opened};
use super::{probe_oracle, stack_versions, Producers};
use crate::milestone::baselines::BaselineFile;
use crate::milestone::check::{Check, FindingKind};
use crate::prompts::Prompt;
use crate::{gerr, Result};

/// The sharded roles, each with the unsharded role whose producer runs it.
const SHARDED: [(Role, Role); 3] = [
    (Role::EngineSharded, Role::Engine),
    (Role::ContractSharded, Role::Contract),
    (Role::OracleSharded, Role::Oracle),
];

/// One job: a model's prompt, and the splits it runs under.
struct Job<'a> {
    plan: &'a Plan,
    p: &'a Prompt,
    splits: Vec<Shards>,
}

impl Job<'_> {
    fn dir(&self) -> String {
        format!("{}/{}", self.plan.work_rel, self.p.id)
    }

    /// `out`: the trace judged (a sharded run's merged trace; its ranks beside it).
    fn verb(&self, role: Role, split: Option<Shards>) -> Verb {
        let out = match split {
            Some(s) => format!("{}/{}{}/{}", self.dir(), s.mode, s.world, role.file()),
            None => format!("{}/{}", self.dir(), role.file()),
        };
        Verb::Trace {
            model: self.plan.model.clone(),
            tokens: self.p.tokens.clone(),
            out,
            internals: self.plan.internals,
            generate: self.plan.generate,
            cache: true,
            force: None,
            seed: None,
            shards: split,
        }
    }
}

/// A job's runs: the unsharded ones by role, the sharded ones by split and role, each with
/// its rank traces' merge (ranks.rs, the one a sharded port's runs go through).
#[derive(Default)]
struct JobRuns {
    one: Vec<(Role, RunRecord)>,
    split: BTreeMap<String, Vec<(Role, RunRecord, Option<ShardedRun>)>>,
}

pub(super) fn run(
    o: &GateOptions,
    settled: Settled,
) -> Result<(Vec<MilestoneReport>, Option<String>)> {
    let started = std::time::Instant::now();
    let mut settled = settled;
    let _lock = crate::WorkLock::acquire(&o.root.join(&settled.work_rel))?;
    let producers = Producers::new(o)?;
    let mut jobs = Vec::new();
    for plan in &settled.plans {
        let splits = plan
            .mm
            .shards
            .iter()
            .map(|s| Shards::parse(s).map_err(|e| gerr!("{}: {e}", plan.mm.model)))
            .collect::<Result<Vec<_>>>()?;
        for p in &plan.selected {
            jobs.push(Job {
                plan,
                p,
                splits: splits.clone(),
            });
        }
    }
    for j in &jobs {
        // Never judge a stale trace: a producer that fails must leave nothing to read.
        let dir = o.root.join(j.dir());
        let _ = std::fs::remove_dir_all(&dir);
        for s in &j.splits {
            let d = dir.join(format!("{}{}", s.mode, s.world));
            std::fs::create_dir_all(&d).map_err(|e| gerr!(File: "{}: {e}", d.display()))?;
        }
    }
    let progress = crate::progress::start(format!("gate {}", o.milestone), jobs.len() as u64);
    crate::progress::doing("running the producers");
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Two lines of runs: the engine's and the contract's, and the oracle's (torch, torchrun),
    // which starts once its probe answered.
    let run_line = |roles: &[Role]| -> Vec<JobRuns> {
        let mut all = Vec::new();
        for j in &jobs {
            let mut runs = JobRuns::default();
            for &role in roles {
                let go = |split: Option<Shards>, unsharded: Role| {
                    if stop.load(std::sync::atomic::Ordering::SeqCst) {
                        return None;
                    }
                    let (rec, merged) = super::ranks::run_trace(
                        producers.of(unsharded),
                        &o.root,
                        &j.verb(role, split),
                        o.timeout,
                        split.map(|s| s.world as u64),
                    );
                    if rec.timed_out {
                        stop.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                    Some((rec, merged))
                };
                match SHARDED.iter().find(|(r, _)| *r == role) {
                    Some(&(_, unsharded)) => {
                        for s in &j.splits {
                            if let Some((rec, merged)) = go(Some(*s), unsharded) {
                                runs.split
                                    .entry(s.to_string())
                                    .or_default()
                                    .push((role, rec, merged));
                            }
                        }
                    }
                    None => runs.one.extend(go(None, role).map(|(rec, _)| (role, rec))),
                }
            }
            all.push(runs);
        }
        all
    };
    let probe_dir = o.root.join(&settled.work_rel);
    let (local, oracle, oracle_probe, setup) = std::thread::scope(|s| {
        producers.contract.prestart(&o.root);
        let local =
            s.spawn(|| run_line(&[Role::Engine, Role::EngineSharded, Role::ContractSharded]));
        let probe = probe_oracle(
            &o.root,
            o.timeout,
            o.oracle_cmd.is_none().then_some(&producers.oracle),
            &probe_dir,
        );
        let setup = started.elapsed().as_secs_f64();
        let oracle = (o.oracle_cmd.is_some() || probe.is_ok())
            .then(|| run_line(&[Role::Oracle, Role::OracleSharded]));
        let done = "a producer thread panicked";
        (local.join().expect(done), oracle, probe, setup)
    });
    let timed_out = local
        .iter()
        .chain(oracle.iter().flatten())
        .flat_map(|r| {
            r.one
                .iter()
                .map(|(role, rec)| (role, rec))
                .chain(r.split.values().flatten().map(|(role, rec, _)| (role, rec)))
        })
        .find(|(_, r)| r.timed_out);
    if let Some((role, rec)) = timed_out {
        return Err(gerr!(
            Producer: "{} {} timed out after {} s (--timeout) and was killed: $ {}",
            role.label(),
            rec.verb,
            o.timeout.as_secs(),
            rec.invocation
        ));
    }
    let produced = started.elapsed().as_secs_f64();
    let judging = std::time::Instant::now();
    let bl_path = o.root.join("baselines.json");
    let mut bl_file = BaselineFile::load(&bl_path)?;
    // One report per model and split, in milestones.json's order.
    let mut oracle = oracle.map(Vec::into_iter);
    let mut per_job: Vec<JobRuns> = local
        .into_iter()
        .map(|mut l| {
            if let Some(r) = oracle.as_mut().and_then(Iterator::next) {
                l.one.extend(r.one);
                for (k, v) in r.split {
                    l.split.entry(k).or_default().extend(v);
                }
            }
            l
        })
        .collect();
    let mut out: Vec<(Plan, MilestoneReport)> = Vec::new();
    let mut k = 0;
    for plan in &settled.plans {
        let n = plan.selected.len();
        let runs: Vec<JobRuns> = per_job.drain(..n).collect();
        let splits = &jobs[k].splits;
        k += n;
        for s in splits {
            let mut sp = plan_for(plan, *s);
            let results: Vec<PromptResult> = plan
                .selected
                .iter()
                .zip(&runs)
                .map(|(p, r)| judge(o, &sp, p, *s, r, &oracle_probe))
                .collect();
            for r in &results {
                sp.judged(r);
            }
            let baselines =
                recorded::check_baselines(&sp, &bl_file.baselines, &results, o.assert_observed);
            let report = sp.report(o, stack_versions(&oracle_probe), results, baselines);
            sp.work_rel = plan.work_rel.clone();
            out.push((sp, report));
        }
    }
    drop(progress);
    let mut wall_s: BTreeMap<&'static str, f64> = BTreeMap::new();
    wall_s.insert("setup", setup);
    wall_s.insert("producers", produced - setup);
    wall_s.insert("judge", judging.elapsed().as_secs_f64());
    wall_s.insert("total", started.elapsed().as_secs_f64());
    eprintln!(
        "[gate {}] wall (observed): setup {:.1} s, producers {:.1} s, judge {:.1} s, total {:.1} s ({} model split(s), {} prompt runs)",
        o.milestone, wall_s["setup"], wall_s["producers"], wall_s["judge"], wall_s["total"], out.len(), jobs.len()
    );
    for (_, r) in &mut out {
        r.wall_s = wall_s.clone();
    }
    let bless_log = if o.bless {
        Some(recorded::bless_all(
            o,
            out.iter().map(|(p, r)| (p, r)),
            &settled.ms_path,
            &mut settled.file,
            &bl_path,
            &mut bl_file,
        )?)
    } else {
        None
    };
    Ok((out.into_iter().map(|(_, r)| r).collect(), bless_log))
}

/// The model's plan for one split: its baselines and report are the split's.
fn plan_for(plan: &Plan, s: Shards) -> Plan {
    Plan {
        m: plan.m.clone(),
        mm: plan.mm.clone(),
        prompt_path: plan.prompt_path.clone(),
        set: plan.set.clone(),
        selected: plan.selected.clone(),
        model: plan.model.clone(),
        generate: plan.generate,
        seed: plan.seed,
        internals: plan.internals,
        threads: plan.threads,
        policy: plan.policy.clone(),
        work_rel: plan.work_rel.clone(),
        shards: Some(s),
    }
}

/// A sharded run's rank traces and their merge, opened; or why there is nothing to judge.
struct Ranked {
    ranks: Vec<PathBuf>,
    merged: Result<Trace>,
    run: Option<ShardedRun>,
}

/// A sharded run read back: its producer has no sharded mode (the flag refused as unknown:
/// Unavailable, so NOT CHECKED), it failed or its rank traces were refused (FAIL), or the merged
/// trace to judge.
fn sharded_run(
    root: &Path,
    ran: Option<&(Role, RunRecord, Option<ShardedRun>)>,
    s: Shards,
    flag: &str,
) -> Ranked {
    let Some((_, rec, run)) = ran else {
        return Ranked {
            ranks: vec![],
            merged: Err(gerr!(Producer: "did not run")),
            run: None,
        };
    };
    let ranks = run
        .iter()
        .flat_map(|r| &r.ranks)
        .map(|r| root.join(&r.file))
        .collect();
    let merged = if let (true, Some(_)) = (rec.ok, run) {
        open(root, rec)
    } else if run.is_none()
        && ["unrecognized arguments", "unexpected argument"]
            .iter()
            .any(|w| rec.stderr.contains(w))
        && rec.stderr.contains(flag)
    {
        Err(
            gerr!(Unavailable: "{} has no sharded mode ({flag} {s} refused as unknown): {}", rec.producer, rec.why()),
        )
    } else {
        Err(gerr!(Producer: "{} {} ({s}) failed: {}", rec.producer, rec.verb, rec.why()))
    };
    Ranked {
        ranks,
        merged,
        run: run.clone(),
    }
}

/// A check that could not compare: NOT CHECKED when a producer cannot run its sharded mode (or
/// the oracle at all), else FAIL.
fn cannot(check: Check, e: &crate::Error) -> CheckResult {
    match e {
        crate::Error::Unavailable(_) => CheckResult::not_checked(check, e.to_string()),
        _ => CheckResult::new(check, Status::Fail, e.to_string()),
    }
}

fn judge(
    o: &GateOptions,
    plan: &Plan,
    p: &Prompt,
    s: Shards,
    runs: &JobRuns,
    oracle_probe: &Result<Value>,
) -> PromptResult {
    let one = |role: Role| -> Opened {
        match runs.one.iter().find(|(r, _)| *r == role) {
            Some((_, rec)) => open(&o.root, rec),
            None if role == Role::Oracle => Err(crate::Error::Unavailable(
                oracle_probe
                    .as_ref()
                    .err()
                    .map(ToString::to_string)
                    .unwrap_or_else(|| "the oracle did not run".into()),
            )),
            None => Err(gerr!(Producer: "{} did not run", role.label())),
        }
    };
    let split_runs = runs.split.get(&s.to_string());
    let sharded = |role: Role| {
        let rec = split_runs.and_then(|v| v.iter().find(|(r, _, _)| *r == role));
        let flag = if role == Role::OracleSharded {
            tracegate_producers::ORACLE_SHARDS_FLAG
        } else {
            tracegate_producers::SHARDS_FLAG
        };
        match (rec, role) {
            // The oracle could not run at all (no torch): its sharded run is NOT CHECKED too.
            (None, Role::OracleSharded) if oracle_probe.is_err() => Ranked {
                ranks: vec![],
                merged: Err(crate::Error::Unavailable(
                    oracle_probe
                        .as_ref()
                        .err()
                        .map(ToString::to_string)
                        .unwrap_or_default(),
                )),
                run: None,
            },
            _ => sharded_run(&o.root, rec, s, flag),
        }
    };
    let (engine, oracle) = (one(Role::Engine), one(Role::Oracle));
    let [e_s, c_s, o_s] = [
        Role::EngineSharded,
        Role::ContractSharded,
        Role::OracleSharded,
    ]
    .map(sharded);
    let expect = expectation(&plan.m, &plan.mm, p, plan.generate);
    let expect = expect.as_ref().copied().map_err(String::as_str);
    let mm = &plan.mm;
    let with_merge = |mut c: CheckResult, who: &str, r: &Ranked| {
        if let Some(run) = &r.run {
            c.detail = format!("{}; {who} {}", c.detail, run.line());
        }
        c
    };
    // (a) the merged engine ≡ the unsharded engine.
    let merged_engine = match (&engine, &e_s.merged) {
        (Ok(one), Ok(m)) => with_merge(
            compare_matches(Check::MergedEngine, mm, p, one, m, expect),
            "engine",
            &e_s,
        ),
        (Err(e), _) => CheckResult::new(Check::MergedEngine, Status::Fail, e.to_string()),
        (_, Err(e)) => cannot(Check::MergedEngine, e),
    };
    // (b) the merged contract ≡ the merged engine.
    let merged_contract = match (&e_s.merged, &c_s.merged) {
        (Ok(e), Ok(c)) => with_merge(
            compare_matches(Check::MergedContract, mm, p, e, c, expect),
            "contract",
            &c_s,
        ),
        (_, Err(e)) => cannot(Check::MergedContract, e),
        (Err(e), _) => cannot(
            Check::MergedContract,
            &gerr!(Producer: "no merged engine trace to compare with: {e}"),
        ),
    };
    // (c) the merged oracle ≈ the unsharded oracle, every decision and token equal.
    let (merged_oracle, summary) = match (&oracle, &o_s.merged) {
        (Ok(one), Ok(m)) => {
            let (mut c, summary) =
                compare_agrees(Check::MergedOracle, mm, p, one, m, &plan.policy, None, None);
            for t in &summary.near_ties {
                c.findings.push(finding(
                    FindingKind::DecisionDiffers,
                    t.clone(),
                    1,
                    "a near-tie flipped by the split: the claim is every argmax equal, so it is not excused here",
                ));
            }
            let (a, b) = (decode_tokens(one), decode_tokens(m));
            c.findings
                .extend(tokens_finding("oracle", "oracle merged", &a, &b));
            if a.is_empty() {
                c.findings.push(finding(
                    FindingKind::TokensDiffer,
                    "generated",
                    0,
                    "no greedy tokens to compare: the milestone claims them",
                ));
            }
            c.detail = format!("{}; {} greedy tokens equal", c.detail, a.len());
            if !c.findings.is_empty() {
                c.status = Status::Fail;
            }
            (with_merge(c, "oracle", &o_s), Some(summary))
        }
        (Err(e), _) => (cannot(Check::MergedOracle, e), None),
        (_, Err(e)) => (cannot(Check::MergedOracle, e), None),
    };
    // (d) each rank trace holds what the split says.
    let rank_shards = rank_shards(
        s,
        plan.mm.family.contains("moe"),
        &[("engine", &e_s), ("contract", &c_s), ("oracle", &o_s)],
    );
    let checks = vec![
        check_stable("engine", &engine, expect.map(|e| e.engine_digest.as_str())),
        merged_engine,
        merged_contract,
        merged_oracle,
        rank_shards,
    ];
    let mut digests = BTreeMap::new();
    for (key, t) in [("engine", &engine), ("oracle", &oracle)] {
        if let Ok(t) = t {
            digests.insert(key.to_string(), t.digest().hex());
        }
    }
    let mut sharded = BTreeMap::new();
    for (role, r) in [
        (Role::EngineSharded, &e_s),
        (Role::ContractSharded, &c_s),
        (Role::OracleSharded, &o_s),
    ] {
        if let Ok(t) = &r.merged {
            digests.insert(format!("{}_merged", role.key()), t.digest().hex());
        }
        if let Some(run) = &r.run {
            sharded.insert(role.key().to_string(), run.clone());
        }
    }
    let counts = match &engine {
        Ok(t) => {
            let mut c = counts(t);
            c["ranks_merged"] = json!(e_s.run.as_ref().map_or(0, |r| r.ranks.len()));
            c
        }
        _ => Value::Null,
    };
    let tokens = |r: &Ranked| r.merged.as_ref().ok().map(decode_tokens);
    let mut all_runs: Vec<(Role, RunRecord)> = runs.one.clone();
    all_runs.extend(
        split_runs
            .into_iter()
            .flatten()
            .map(|(role, rec, _)| (*role, rec.clone())),
    );
    PromptResult {
        id: p.id.clone(),
        tokens: p.tokens.len(),
        runs: PromptRuns(all_runs),
        digests,
        checks,
        counts,
        generated: Generated {
            engine_cached: engine.as_ref().ok().map(decode_tokens),
            engine_uncached: tokens(&e_s),
            contract: tokens(&c_s),
            oracle: tokens(&o_s),
            ..Default::default()
        },
        oracle: summary,
        observations: Vec::new(),
        localised: None,
        sharded,
    }
}

/// (d): per producer, each rank trace names its rank of the split's world; every head point
/// (`q`, `k`, `v`, `attn_gate`: axis 1; `attn_probs`: axis 0) is a true slice of its heads on
/// every rank; under `ep` on a MoE model every expert's tensor is on one rank, held as
/// `experts`, no rank holding them all. A run that holds no head point (or, under ep, no expert
/// tensor) shows nothing and fails: the milestone captures internals for this.
fn rank_shards(s: Shards, moe: bool, producers: &[(&str, &Ranked)]) -> CheckResult {
    let mut found: Vec<Finding> = Vec::new();
    let mut said = Vec::new();
    let mut not_checked = Vec::new();
    for (who, r) in producers {
        match &r.merged {
            Err(e @ crate::Error::Unavailable(_)) => {
                not_checked.push(format!("{who}: NOT CHECKED ({e})"));
                continue;
            }
            Err(e) => match r.run.as_ref().and_then(super::ranks::refusal_finding) {
                // Refused rank traces are still read below: what each holds says why.
                Some(f) => found.push(f),
                None => {
                    found.push(finding(FindingKind::ShardLayout, *who, 1, e.to_string()));
                    continue;
                }
            },
            Ok(_) => {}
        }
        match layout(s, moe, &r.ranks) {
            Ok(line) => said.push(format!("{who}: {line}")),
            Err(problems) => found.extend(problems.into_iter().map(|(name, d)| {
                finding(FindingKind::ShardLayout, name, 1, format!("{who}: {d}"))
            })),
        }
    }
    let status = if !found.is_empty() {
        Status::Fail
    } else if !not_checked.is_empty() {
        Status::NotChecked
    } else {
        Status::Pass
    };
    let mut c = CheckResult::new(
        Check::RankShards,
        status,
        said.into_iter()
            .chain(not_checked)
            .collect::<Vec<_>>()
            .join("; "),
    );
    c.findings = found;
    c
}

/// One producer's rank traces against the split: a line of what was checked, or each problem
/// (tensor name, detail).
fn layout(
    s: Shards,
    moe: bool,
    ranks: &[PathBuf],
) -> std::result::Result<String, Vec<(String, String)>> {
    let mut problems: Vec<(String, String)> = Vec::new();
    let world = s.world as u64;
    let (mut heads, mut experts) = (0usize, 0usize);
    // Expert tensor name -> the ranks holding it; rank -> its held list.
    let mut expert_on: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut held: BTreeMap<u64, (Vec<u64>, u64)> = BTreeMap::new();
    if ranks.len() != s.world {
        problems.push((
            String::new(),
            format!("{} rank traces for {s}", ranks.len()),
        ));
    }
    for (rank, path) in ranks.iter().enumerate() {
        let rank = rank as u64;
        let t = match Trace::open(path) {
            Ok(t) => t,
            Err(e) => {
                problems.push((String::new(), format!("rank {rank}: {e}")));
                continue;
            }
        };
        let mut rank_heads = 0;
        for info in t.tensors() {
            let name = info.name.as_str();
            let shard = match info.attributes.shard() {
                Ok(sh) => sh,
                Err(e) => {
                    problems.push((name.into(), format!("rank {rank}: {e}")));
                    continue;
                }
            };
            if let Some(sh) = &shard {
                if (sh.rank, sh.world) != (rank, world) {
                    problems.push((
                        name.into(),
                        format!(
                            "rank {rank}'s trace says rank {}/{} ({s} has {world} ranks)",
                            sh.rank, sh.world
                        ),
                    ));
                    continue;
                }
                if let Err(e) = sh.check_for(name, &info.shape) {
                    problems.push((name.into(), format!("rank {rank}: {e}")));
                    continue;
                }
            }
            let n = names::Name::parse(name);
            let kind = shard.as_ref().map(|sh| &sh.kind);
            let head_axis = match n.point {
                "q" | "k" | "v" | "attn_gate" if n.layer.is_some() && n.expert.is_none() => Some(1),
                "attn_probs" if n.layer.is_some() => Some(0),
                _ => None,
            };
            if let Some(axis) = head_axis {
                match kind {
                    Some(ShardKind::Slice {
                        axis: a,
                        length,
                        size,
                        ..
                    }) if *a == axis && length < size => rank_heads += 1,
                    other => problems.push((
                        name.into(),
                        format!(
                            "rank {rank} holds {} where {s} computes a slice of the heads (axis {axis}) on each rank",
                            other.map_or("the whole tensor (no shard)".into(), |k| format!("{k:?}"))
                        ),
                    )),
                }
            }
            if n.expert.is_some() && s.mode == "ep" {
                match kind {
                    Some(ShardKind::Experts { held: h, of }) => {
                        experts += 1;
                        expert_on.entry(name.into()).or_default().push(rank);
                        held.insert(rank, (h.clone(), *of));
                    }
                    other => problems.push((
                        name.into(),
                        format!(
                            "rank {rank} holds {} where ep computes each expert on one rank",
                            other
                                .map_or("the whole tensor (no shard)".into(), |k| format!("{k:?}"))
                        ),
                    )),
                }
            }
        }
        if rank_heads == 0 {
            problems.push((
                String::new(),
                format!("rank {rank} holds no head-sliced tensor (q, k, v, attn_probs): nothing shows its heads are split (the milestone captures internals)"),
            ));
        }
        heads += rank_heads;
    }
    for (name, on) in &expert_on {
        if on.len() > 1 {
            problems.push((name.clone(), format!("an expert's tensor on ranks {on:?}")));
        }
    }
    for (rank, (h, of)) in &held {
        if h.len() as u64 >= *of {
            problems.push((String::new(), format!("rank {rank} holds all {of} experts")));
        }
    }
    if s.mode == "ep" && moe && experts == 0 {
        problems.push((
            String::new(),
            "no expert tensor on any rank: nothing shows the experts are split".into(),
        ));
    }
    if !problems.is_empty() {
        return Err(problems);
    }
    let held: Vec<String> = held
        .iter()
        .map(|(r, (h, of))| format!("rank {r} experts {h:?} of {of}"))
        .collect();
    Ok(format!(
        "{} ranks, {heads} head-sliced tensors (each a slice of its heads){}",
        ranks.len(),
        if held.is_empty() {
            String::new()
        } else {
            format!(
                ", {experts} expert tensors each on one rank ({})",
                held.join(", ")
            )
        }
    ))
}
