//! What a milestone run is about, settled before any producer runs (`GateOptions`, one `Plan`
//! per model, `Settled`), and the report a plan ends with (`Plan::report`, `tally`).
//!
//! Below the phases that read a plan (prompt.rs, recorded.rs, port.rs) and run_milestone
//! (mod.rs), which all share it: it imports none of them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_diff::Policy;

use super::report::{
    CheckResult, GateVerdict, MilestoneReport, PromptResult, Status, REPORT_SCHEMA,
};
use crate::milestone::baselines::{BaselineFile, Conditions};
use crate::milestone::milestones::{Milestone, MilestoneFile, MilestoneModel};
use crate::prompts::{self, Prompt, PromptSet};
use crate::{gerr, Result};

/// The policy a new port milestone records until its first run has chosen one: the bundled
/// policy for the coarser of the candidate's and the golden traces' precision
/// (bisect::judge::precision).
pub const AUTO_POLICY: &str = "auto";

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

/// What a milestone run is about, settled before any producer runs: every refusal comes here.
/// One plan per model of the milestone that runs.
pub(super) struct Plan {
    pub(super) m: Milestone,
    /// The model of `m` this plan runs.
    pub(super) mm: MilestoneModel,
    pub(super) prompt_path: PathBuf,
    pub(super) set: PromptSet,
    pub(super) selected: Vec<Prompt>,
    /// The milestone model's own name, or the canonical path of `--model`.
    pub(super) model: String,
    pub(super) generate: usize,
    /// The seed of a sampling family's runs (the milestone's, 0 when it records none).
    pub(super) seed: u64,
    /// The milestone's `capture` is `internals`.
    pub(super) internals: bool,
    pub(super) threads: usize,
    pub(super) policy: Policy,
    /// `<work>/<milestone>/<model directory name>`, relative to the root (or absolute).
    pub(super) work_rel: String,
    /// A sharded milestone's split this plan judges (run/sharded.rs); None: one process.
    pub(super) shards: Option<tracegate_producers::Shards>,
}

/// The milestone file and one plan per model that runs: every model of the milestone, or the
/// one of `--model`'s family.
pub(super) struct Settled {
    pub(super) ms_path: PathBuf,
    pub(super) file: MilestoneFile,
    /// `<work>/<milestone>`, locked for the run.
    pub(super) work_rel: String,
    pub(super) plans: Vec<Plan>,
}

impl Settled {
    pub(super) fn settle(o: &GateOptions) -> Result<Settled> {
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
        // `--only`, else the milestone's own part of the set (m2's), else all of it.
        let selected = set.select(o.only.as_deref().or(m.prompts.only.as_deref()))?;
        // A declared divergence excuses a finding of one prompt: one of a prompt the set does
        // not hold excuses nothing, and says the milestone is not what its author thinks.
        for (i, mm) in m.models.iter().enumerate() {
            for (j, d) in mm.declared_divergences.iter().enumerate() {
                if !set.prompts.iter().any(|p| p.id == d.prompt) {
                    let ids: Vec<&str> = set.prompts.iter().map(|p| p.id.as_str()).collect();
                    return Err(gerr!(
                        "{}: milestone {}: models[{i}].declared_divergences[{j}] is for prompt {:?}, which {} does not hold (its prompts: {})",
                        ms_path.display(),
                        m.id,
                        d.prompt,
                        prompt_path.display(),
                        ids.join(", ")
                    ));
                }
            }
        }
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
        let internals = match m.capture.as_deref() {
            None | Some("default") => false,
            Some("internals") => true,
            Some(other) => {
                return Err(gerr!(
                    "{}: milestone {}: capture {other:?} is neither \"default\" nor \"internals\"",
                    ms_path.display(),
                    m.id
                ))
            }
        };
        let mut plans = Vec::new();
        for (mm, model) in runs {
            for p in &selected {
                prompts::check_fits(&o.root, &model, Some(&p.id), p.tokens.len(), generate)?;
            }
            // The milestone's own checkpoint is of the family it records (`--model` was matched
            // to a family by model_of): the family decides how the run goes (a sampling family
            // is forced, has no uncached path) and which `--model` may stand in for it.
            if model == mm.model {
                check_family(o, &ms_path, &m, &mm)?;
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
                seed: m.seed.unwrap_or(0),
                internals,
                threads: o.threads,
                policy: policy.clone(),
                shards: None,
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
    /// Whether the model samples (block diffusion): its runs take the seed, and an oracle is
    /// forced by the engine's draws (docs/diffusion-gemma.md DG17).
    pub(super) fn samples(&self) -> bool {
        crate::prompts::samples(&self.mm.family)
    }

    /// The conditions a baseline requires, as this run meets them for prompt `r`.
    pub(super) fn conditions(&self, r: &PromptResult) -> Conditions {
        let mut c = Conditions::new();
        c.insert("prompt".into(), json!(r.id));
        c.insert("threads".into(), json!(self.threads));
        c.insert("generate".into(), json!(self.generate));
        c.insert("model".into(), json!(self.model));
        if let Some(s) = self.shards {
            c.insert("shards".into(), json!(s.to_string()));
        }
        c
    }
}

/// A milestone model's recorded `family` against its checkpoint's (`model_type`, read as
/// `gate init` read it: [`prompts::family`]).
fn check_family(o: &GateOptions, ms_path: &Path, m: &Milestone, mm: &MilestoneModel) -> Result<()> {
    let i = m
        .models
        .iter()
        .position(|x| x.model == mm.model)
        .unwrap_or(0);
    let (config, from) = prompts::model_config(&o.root.join(&mm.model))
        .map_err(|e| gerr!("milestone {}: model {}: {e}", m.id, mm.model))?;
    let family = prompts::family(&config);
    if family != mm.family {
        return Err(gerr!(
            "{}: milestone {}: models[{i}].family is {:?}, but {} is of family {family:?} (its model_type): correct the record",
            ms_path.display(),
            m.id,
            mm.family,
            crate::paths::shown(&from)
        ));
    }
    Ok(())
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

impl Plan {
    /// The progress line of a judged prompt: its checks and their statuses.
    pub(super) fn judged(&self, r: &PromptResult) {
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
    pub(super) fn report(
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
            shards: self.shards.map(|s| s.to_string()),
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
