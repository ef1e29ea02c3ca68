//! What a milestone run is held to besides its checks, and how a run records it: the
//! baselines (counts exact, observations bounded by `--assert-observed`), and `--bless`.

use std::collections::BTreeMap;

use serde_json::Value;

use super::plan::{dir_name, Plan};
use super::report::{finding, CheckResult, MilestoneReport, Observed, PromptResult, Status};
use crate::milestone::baselines::{Baseline, BaselineFile};
use crate::milestone::check::{Check, FindingKind};
use crate::milestone::milestones::{Expectation, MilestoneFile};
use crate::{gerr, Result};

pub(super) fn observed_of(r: &PromptResult) -> BTreeMap<String, f64> {
    let mut obs = BTreeMap::new();
    for (role, run) in r.runs.by_role() {
        let key = role.key();
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

/// Each baseline of the milestone against the first prompt whose conditions it meets; and the
/// baselines of prompts `--only` left out.
pub(super) fn check_baselines(
    plan: &Plan,
    baselines: &[Baseline],
    results: &[PromptResult],
    assert_observed: Option<f64>,
) -> (Vec<CheckResult>, Vec<String>) {
    let Plan {
        m,
        mm,
        set,
        selected,
        ..
    } = plan;
    let mut out = Vec::new();
    let mut not_selected = Vec::new();
    // A baseline belongs to the model it requires: the one that ran, or the milestone's own
    // (then NOT CHECKED under `--model`, by its unmet condition), not a sibling model; and to
    // the split it requires (a sharded milestone's), not a sibling split.
    let split = plan.shards.map(|s| s.to_string());
    let ours = |b: &&Baseline| {
        b.milestone == m.id
            && b.requires
                .get("model")
                .and_then(Value::as_str)
                .is_none_or(|want| want == plan.model || want == mm.model)
            && b.requires.get("shards").and_then(Value::as_str) == split.as_deref()
    };
    for b in baselines.iter().filter(ours) {
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
            match b.unmet(&plan.conditions(r)) {
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
    // A milestone with no baseline at all has nothing to hold a run to: a failure. One whose
    // baselines were recorded under other conditions (`--generate 4` against g8 baselines) is
    // not wrong, only unchecked: NOT CHECKED (exit 4), each baseline saying which condition.
    if out.is_empty() && not_selected.is_empty() {
        out.push(CheckResult::new(Check::Baselines, Status::Fail, format!("no baseline of milestone {} for this model: zero checked baselines is a failure (record one with --bless)", m.id)));
    } else if !out.is_empty() && out.iter().all(|c| c.status == Status::NotChecked) {
        out.push(CheckResult::not_checked(Check::Baselines, format!("none of milestone {}'s {} baseline(s) applies to this run's conditions (each says which): the counts are NOT CHECKED; --bless records a baseline for them", m.id, out.len())));
    }
    (out, not_selected)
}

/// `--bless` of a whole run: each model's run recorded ([`bless`]), then milestones.json and
/// baselines.json written together; the log of what changed, or "nothing changed".
pub(super) fn bless_all<'a>(
    o: &super::GateOptions,
    runs: impl IntoIterator<Item = (&'a Plan, &'a MilestoneReport)>,
    ms_path: &std::path::Path,
    file: &mut MilestoneFile,
    bl_path: &std::path::Path,
    bl_file: &mut BaselineFile,
) -> Result<String> {
    let mut log = Vec::new();
    for (plan, report) in runs {
        log.extend(bless(plan, report, file, bl_file)?);
    }
    // Both or neither, at every instant (crate::journal): a milestones.json blessed without
    // its baselines would disagree.
    let ms = crate::json_bytes(ms_path, file)?;
    let bl = crate::json_bytes(bl_path, bl_file)?;
    crate::journal::commit(
        &o.root,
        &format!("gate run {} --bless", o.milestone),
        &[
            ("milestones.json", crate::journal::Content::Bytes(&ms)),
            ("baselines.json", crate::journal::Content::Bytes(&bl)),
        ],
    )?;
    log.dedup();
    if log.is_empty() {
        log.push("nothing changed".into());
    }
    Ok(log.join("\n"))
}

/// `--bless`: one model's run recorded in `file` (the prompts sha256, the model's expectations)
/// and `bl_file` (its baselines); the log of what changed. The caller writes both files.
pub(super) fn bless(
    plan: &Plan,
    report: &MilestoneReport,
    file: &mut MilestoneFile,
    bl_file: &mut BaselineFile,
) -> Result<Vec<String>> {
    let Plan { m, mm, set, .. } = plan;
    let mut log = Vec::new();
    let milestone = file
        .get_mut(&m.id)
        .ok_or_else(|| gerr!("milestone {} vanished", m.id))?;
    if milestone.prompts.sha256 != set.sha256 {
        log.push(format!(
            "{}: prompts sha256 {} -> {}",
            m.id, milestone.prompts.sha256, set.sha256
        ));
        let (shared, old) = (
            milestone.prompts.set.clone(),
            milestone.prompts.sha256.clone(),
        );
        milestone.prompts.sha256 = set.sha256.clone();
        // The file is one fact: every milestone that records the same set at the same old hash
        // moves with it, or the next milestone would refuse the file this one just accepted.
        // Their expectations are their own: a prompt that changed fails their checks until they
        // are blessed too, and the log says so.
        for other in file
            .milestones
            .iter_mut()
            .filter(|x| x.id != m.id && x.prompts.set == shared && x.prompts.sha256 == old)
        {
            log.push(format!(
                "{}: prompts sha256 {old} -> {} (shares {shared} with {}; its expectations are not re-recorded: bless it too if a prompt changed)",
                other.id, set.sha256, m.id
            ));
            other.prompts.sha256 = set.sha256.clone();
        }
    }
    let milestone = file
        .get_mut(&m.id)
        .ok_or_else(|| gerr!("milestone {} vanished", m.id))?;
    let entry = milestone
        .models
        .iter_mut()
        .find(|e| e.model == mm.model)
        .ok_or_else(|| gerr!("milestone {}: model {} vanished", m.id, mm.model))?;
    // Each line names the model: a milestone's models share its prompt ids.
    let tag = format!("{} {}", m.id, dir_name(&plan.model));
    // Expectations belong to the milestone's own --generate; another N gets only its baselines.
    let own_generate = report.generate == m.generate;
    if !own_generate {
        log.push(format!("{}: expectations left as recorded for --generate {} (this run: --generate {}); baselines recorded", tag, m.generate, report.generate));
    }
    for r in &report.prompts {
        let Some(digest) = r.digests.get("engine") else {
            log.push(format!(
                "{}/{}: engine failed; expectation left as it was",
                tag, r.id
            ));
            continue;
        };
        if own_generate {
            let new = expectation_of(r, digest, entry.expect.get(&r.id));
            match entry.expect.get(&r.id) {
                Some(old) if *old == new => {}
                Some(old) => log.push(format!(
                    "{}/{}: expectation {} -> {}",
                    tag,
                    r.id,
                    serde_json::to_string(old).unwrap_or_default(),
                    serde_json::to_string(&new).unwrap_or_default()
                )),
                None => log.push(format!(
                    "{}/{}: new expectation {}",
                    tag,
                    r.id,
                    serde_json::to_string(&new).unwrap_or_default()
                )),
            }
            entry.expect.insert(r.id.clone(), new);
        }

        record_baseline(plan, report, r, bl_file, &mut log);
    }
    Ok(log)
}

/// `--bless`: prompt `r`'s baseline for this run's conditions, recorded in `bl_file` (a change
/// of its counts or conditions logged).
pub(super) fn record_baseline(
    plan: &Plan,
    report: &MilestoneReport,
    r: &PromptResult,
    bl_file: &mut BaselineFile,
    log: &mut Vec<String>,
) {
    let Plan { m, threads, .. } = plan;
    // A sharded plan's baseline is of its split: `m2.tiny-qwen3-moe.short.tp2.t1.g8`.
    let split = plan
        .shards
        .map(|s| format!(".{}{}", s.mode, s.world))
        .unwrap_or_default();
    let id = format!(
        "{}.{}.{}{split}.t{}.g{}",
        m.id,
        dir_name(&plan.model),
        r.id,
        threads,
        report.generate
    );
    let counts: BTreeMap<String, Value> = r
        .counts
        .as_object()
        .map(|o| o.iter().map(|(k, v)| (k.clone(), v.clone())).collect())
        .unwrap_or_default();
    let baseline = Baseline {
        id: id.clone(),
        milestone: m.id.clone(),
        requires: plan.conditions(r),
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

/// The expectation this run would record for prompt `r` (engine trace digest `digest`); `old`:
/// the one recorded, whose oracle count stands when the oracle was NOT CHECKED.
fn expectation_of(r: &PromptResult, digest: &str, old: Option<&Expectation>) -> Expectation {
    let differing = r
        .found(Check::Matches, FindingKind::TensorDiffers)
        .map_or(0, |f| f.iter().map(|f| f.about.count).sum());
    let oracle_differing = r
        .found(Check::Agrees, FindingKind::DecisionDiffers)
        .map(|f| f.len());
    Expectation {
        engine_digest: digest.to_string(),
        tensors: r.counts["tensors"].as_u64().unwrap_or(0) as usize,
        decisions: r.counts["decisions"].as_u64().unwrap_or(0) as usize,
        differing_elements: differing,
        generated: r.generated.engine_cached.clone().unwrap_or_default(),
        oracle_decisions_differing: oracle_differing
            .unwrap_or_else(|| old.map_or(0, |e| e.oracle_decisions_differing)),
    }
}
