//! A port milestone (docs/gate.md, "Gate your own engine"): the user's engine — the candidate,
//! answering the producer protocol — judged on every prompt against golden reference traces
//! recorded once (`gate init`, `--bless`), with no torch needed once they exist.
//!
//! Per prompt: `stable` (for a candidate that declares itself deterministic; otherwise its digest
//! is an observation), `agrees` (candidate ≈ golden under the policy, every decision exact but
//! for near-ties — the same judge as the self-check's `agrees`), `generation` (its cached decode
//! = its uncached one, by that judge: every tensor within the policy, every token equal but for
//! near-ties), and
//! `generation_reference` (its tokens = the golden trace's). A failing `agrees` is localised in
//! the same run: `gate bisect` against the stored golden trace names the first wrong layer and
//! stage (`--ranks N` for a sharded port, which also names the rank).
//!
//! Soundness: a golden trace is verified and held to the digest milestones.json records before
//! the candidate runs — an edited, truncated or swapped file is refused, never judged — and is
//! changed only by `--bless`, which re-runs the reference and prints what changed.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tracegate_diff::Policy;
use tracegate_producers::{Producer, RunRecord, Verb};
use tracegate_trace::Trace;

use super::agrees::compare_agrees;
use super::candidate::try_candidate;
use super::checks::check_stable;
use super::findings::{incomparable, judge, not_comparable, tokens_finding};
use super::plan::{dir_name, GateOptions, Plan, Settled, AUTO_POLICY};
use super::recorded;
use super::report::{
    finding, CheckResult, Generated, MilestoneReport, PromptResult, PromptRuns, Role, ShardedRun,
    Status,
};
use super::traces::{counts, decode_tokens, open, Opened};
use crate::bisect;
use crate::milestone::baselines::BaselineFile;
use crate::milestone::check::{Check, FindingKind};
use crate::milestone::milestones::{Golden, Milestone, Port, PortExpectation, Tokenized};
use crate::prompts::{Prompt, PromptSet};
use crate::{gerr, journal, Result};

/// The oracle of tracegate's installation (or `--oracle-cmd`) as producer `name`, with `args`
/// after its own.
fn oracle_producer(o: &GateOptions, name: &str, args: &str) -> Result<Producer> {
    let base = o
        .oracle_cmd
        .clone()
        .unwrap_or_else(|| tracegate_producers::default_oracle_cmd(&o.root));
    Ok(Producer::command(name, &format!("{base} {args}"))?)
}

/// The reference producer of a port: the oracle of tracegate's installation in the recorded
/// dtype and device, or the user's command.
fn reference_producer(o: &GateOptions, port: &Port) -> Result<Producer> {
    let r = &port.reference;
    match (r.producer.as_str(), &r.cmd) {
        ("oracle", _) => oracle_producer(
            o,
            "reference",
            &format!("--dtype {} --device {}", r.dtype, r.device),
        ),
        ("cmd", Some(cmd)) => Ok(Producer::command("reference", cmd)?),
        (other, _) => Err(gerr!(
            "milestones.json: port reference producer {other:?} is neither \"oracle\" nor \"cmd\" (with its cmd)"
        )),
    }
}

/// The noise run of a port (docs/gate.md, "The noise run"): tracegate's own run of the reference
/// in the claimed precision, never the candidate's. An f32 claim: the engine where it computes the
/// family (ordered f32, which differs from transformers' f32 only in summation order), else the
/// oracle on another thread count; a bf16 or f16 claim: the oracle in that dtype. Err: why there
/// is none (said in the report; near-ties then read the policy's `near_tie.noise_abs`).
fn noise_producer(
    o: &GateOptions,
    plan: &Plan,
    port: &Port,
) -> std::result::Result<(Producer, String), String> {
    let r = &port.reference;
    if r.producer != "oracle" {
        return Err(format!(
            "the reference is a command of yours ({}): tracegate cannot run it in another precision",
            r.producer
        ));
    }
    // A claim per pattern is measured by its coarsest part's run.
    let claim = Policy::claimed_precision(&plan.m.policy).unwrap_or(r.dtype.as_str());
    let oracle = |args: &str| oracle_producer(o, "noise", args).map_err(|e| e.to_string());
    // The f32 run: the engine where it computes the family, else the oracle in f32 (on
    // another thread count when the reference is that same f32 oracle).
    let f32_run = || match tracegate_engine::load_config(&o.root.join(&plan.model)) {
        Ok(_) => Ok((
            Producer::Engine { threads: o.threads },
            "the engine (ordered f32)".to_string(),
        )),
        Err(_) if r.dtype == "f32" => Ok((
            oracle(&format!("--dtype f32 --device {} --threads 2", r.device))?,
            "the oracle in f32 on 2 threads".to_string(),
        )),
        Err(_) => Ok((
            oracle(&format!("--dtype f32 --device {}", r.device))?,
            "the oracle in f32".to_string(),
        )),
    };
    match (claim, r.dtype.as_str()) {
        ("f32", _) => f32_run(),
        // A reduced-precision claim against an f32 reference: the reference in that precision.
        ("bf16" | "f16", "f32") => Ok((
            oracle(&format!("--dtype {claim} --device {}", r.device))?,
            format!("the oracle in {claim}"),
        )),
        // A quantized port (llama.cpp's CPU path): transformers in f32 on the GGUF's weights with
        // its matmul inputs rounded as ggml rounds them (tracegate_oracle.quantized_activations).
        ("q8", "f32")
            if matches!(
                tracegate_trace::gguf_file(&o.root.join(&plan.model)),
                Ok(Some(_))
            ) =>
        {
            let py = tracegate_producers::python(&o.root, "TRACEGATE_ORACLE_PYTHON");
            Ok((
                Producer::command(
                    "noise",
                    &format!("'{py}' -m tracegate_oracle.quantized_activations {{verb}} {{args}}"),
                )
                .map_err(|e| e.to_string())?,
                "the oracle with 8-bit activations (quantized_activations)".into(),
            ))
        }
        ("q8", _) => Err(
            "a q8 claim's noise run (8-bit activations simulated on the GGUF's weights) needs a GGUF model and an f32 reference".into(),
        ),
        // The reference is itself the claimed precision's run: its difference from f32 is the
        // noise.
        (c, d) if c == d => f32_run(),
        (c, d) => Err(format!(
            "no noise run for the claimed precision {c} against a {d} reference yet"
        )),
    }
}

/// The text prompts of `set` tokenized by `model`'s own tokenizer, through the oracle's Python
/// (`python -m tracegate.text --prompts`, docs/producers.md "Text prompts").
pub(crate) fn tokenize_text(
    root: &Path,
    model: &str,
    set: &PromptSet,
    timeout: std::time::Duration,
) -> Result<Tokenized> {
    let py = tracegate_producers::python(root, "TRACEGATE_ORACLE_PYTHON");
    let argv = [
        py.clone(),
        "-m".into(),
        "tracegate.text".into(),
        "--model".into(),
        model.to_string(),
        "--prompts".into(),
        set.path.display().to_string(),
    ];
    let out = tracegate_producers::run_helper(root, &argv, timeout).map_err(|e| {
        gerr!(
            "tokenizing the text prompts of {} with {model}'s tokenizer ({py}): {e}",
            set.path.display()
        )
    })?;
    let t: Tokenized = serde_json::from_str(out.trim())
        .map_err(|e| gerr!("python -m tracegate.text printed no tokenization: {e}"))?;
    if let Some(p) = set
        .prompts
        .iter()
        .find(|p| p.text.is_some() && !t.prompts.contains_key(&p.id))
    {
        return Err(gerr!(
            "python -m tracegate.text gave no ids for text prompt {:?}",
            p.id
        ));
    }
    Ok(t)
}

/// The ids of the text prompts among `plan.selected`, filled in: tokenized anew when blessing
/// (returned, to be recorded), else the recorded ids, held to the tokenizer digest recorded with
/// them — a changed tokenizer is refused as a changed prompt is.
fn resolve_text(o: &GateOptions, plan: &mut Plan, port: &Port) -> Result<Option<Tokenized>> {
    if plan.set.prompts.iter().all(|p| p.text.is_none()) {
        return Ok(None);
    }
    let m = &plan.m.id;
    let tokenized = if o.bless {
        tokenize_text(&o.root, &plan.model, &plan.set, o.timeout)?
    } else {
        let recorded = port.tokenized.clone().ok_or_else(|| {
            gerr!("{}: text prompts, and milestone {m} records no ids for them: tokenize them with `gate run {m} --bless`", plan.set.path.display())
        })?;
        let now = crate::milestone::tokenizer::tokenizer_digest(&o.root.join(&plan.model))?;
        if now != recorded.tokenizer_digest {
            return Err(gerr!(
                "{}: the tokenizer changed (digest {now}, recorded {}): its text prompts' ids may have too — changing the tokenizer changes the gate; rerun with --bless to accept it",
                plan.model,
                recorded.tokenizer_digest
            ));
        }
        recorded
    };
    for p in plan.selected.iter_mut().filter(|p| p.text.is_some()) {
        let ids = tokenized.prompts.get(&p.id).ok_or_else(|| {
            gerr!(
                "milestone {m}: no ids recorded for text prompt {:?}: run with --bless",
                p.id
            )
        })?;
        p.tokens = ids.tokens.clone();
        crate::prompts::check_fits(
            &o.root,
            &plan.model,
            Some(&p.id),
            p.tokens.len(),
            plan.generate,
        )?;
    }
    Ok(Some(tokenized))
}

/// A golden trace as recorded, or why it may not be judged against (a refusal: exit 2): one that
/// is not the file milestones.json records, or was recorded for another prompt, decode length
/// or capture than the milestone now states.
fn verified_golden(
    o: &GateOptions,
    m: &Milestone,
    port: &Port,
    p: &Prompt,
    g: Option<&Golden>,
) -> Result<Trace> {
    let g = g.ok_or_else(|| {
        gerr!(
            "prompt {:?} has no golden trace in milestone {}: record it with `gate run {} --bless`",
            p.id,
            m.id,
            m.id
        )
    })?;
    let t = verified_recorded(o, m, &port.capture, p, g, "golden trace")?;
    // The tokens milestones.json records beside the trace are the trace's own.
    let tokens = decode_tokens(&t);
    if tokens != g.generated {
        return Err(
            gerr!(File: "milestones.json: milestone {}: port.golden.{}.generated {:?} is not golden trace {}'s greedy tokens {tokens:?}; it changes only through `gate run {} --bless` (restore it from version control)", m.id, p.id, g.generated, g.trace, m.id),
        );
    }
    // The golden trace is the reference's: its producer, dtype and device are the milestone's.
    let prov = t.provenance();
    let r = &port.reference;
    if r.producer == "oracle" {
        let producer = prov["producer"].as_str().unwrap_or("not recorded");
        let dtype = prov["dtype"]
            .as_str()
            .map(|d| tracegate_diff::policy::dtype_precision(d).unwrap_or(d));
        if producer != "oracle" || dtype != Some(r.dtype.as_str()) {
            return Err(
                gerr!(File: "golden trace {}: written by {producer:?} in {}, but milestone {}'s reference is the oracle in {}: a golden trace is the reference's own run (re-record it with `gate run {} --bless`)", g.trace, dtype.unwrap_or("an unrecorded dtype"), m.id, r.dtype, m.id),
            );
        }
    }
    Ok(t)
}

/// A port's noise trace as recorded ([`verified_recorded`]), from one of tracegate's reference
/// producers.
fn verified_noise(
    o: &GateOptions,
    m: &Milestone,
    port: &Port,
    p: &Prompt,
    g: &Golden,
) -> Result<Trace> {
    let t = verified_recorded(o, m, &port.capture, p, g, "noise trace")?;
    // `--bless` records no tokens for a noise trace; any it records are the trace's own.
    if !g.generated.is_empty() && g.generated != decode_tokens(&t) {
        return Err(
            gerr!(File: "milestones.json: milestone {}: port.noise.{}.generated {:?} is not noise trace {}'s greedy tokens {:?}; it changes only through `gate run {} --bless` (restore it from version control)", m.id, p.id, g.generated, g.trace, decode_tokens(&t), m.id),
        );
    }
    let producer = t.provenance()["producer"]
        .as_str()
        .unwrap_or("not recorded");
    if !tracegate_diff::NOISE_PRODUCERS.contains(&producer) {
        return Err(
            gerr!(File: "noise trace {}: written by {producer:?}, not one of tracegate's reference producers ({}): honest noise is tracegate's own run (re-record it with `gate run {} --bless`)", g.trace, tracegate_diff::NOISE_PRODUCERS.join(", "), m.id),
        );
    }
    Ok(t)
}

/// A recorded trace (golden or noise) as milestones.json records it, or why it may not be used (a
/// refusal: exit 2): one that is not the file recorded (content digest), whose provenance is not
/// the one pinned, or was recorded for another prompt, decode length or capture than the
/// milestone now states.
fn verified_recorded(
    o: &GateOptions,
    m: &Milestone,
    capture: &str,
    p: &Prompt,
    g: &Golden,
    what: &str,
) -> Result<Trace> {
    let (m, want) = (&m.id, m.generate);
    let refuse = |why: String| gerr!(File: "{what} {}: {why}; a {what} changes only through `gate run {m} --bless` (restore it from version control)", g.trace);
    let t = Trace::open(o.root.join(&g.trace)).map_err(|e| refuse(e.to_string()))?;
    t.verify().map_err(|e| refuse(e.to_string()))?;
    if t.digest().hex() != g.digest {
        return Err(refuse(format!(
            "content digest {} differs from milestones.json's record {}",
            t.digest().hex(),
            g.digest
        )));
    }
    // Provenance is outside the content digest: pinned on its own.
    let pin = crate::milestone::milestones::provenance_pin(t.provenance());
    if g.provenance.is_empty() {
        return Err(
            gerr!(File: "{what} {}: milestones.json does not pin its provenance (producer, dtype, device, versions), recorded by an older gate; re-record it with `gate run {m} --bless`", g.trace),
        );
    }
    if pin != g.provenance {
        return Err(refuse(format!(
            "its provenance (producer {}, dtype {}, device, versions) is not the one milestones.json pins (sha256 {} vs {})",
            t.provenance()["producer"],
            t.provenance()["dtype"],
            &pin[..16],
            &g.provenance[..16.min(g.provenance.len())]
        )));
    }
    let tokens: Option<Vec<i64>> = t.provenance()["prompt_tokens"]
        .as_array()
        .and_then(|a| a.iter().map(Value::as_i64).collect());
    if tokens.as_deref() != Some(&p.tokens[..]) {
        return Err(refuse(format!(
            "recorded for prompt tokens {tokens:?}, prompt {:?} is now {:?}",
            p.id, p.tokens
        )));
    }
    let prov = t.provenance();
    let generate = prov["generate"].as_u64().unwrap_or(0);
    if generate != want as u64 {
        return Err(refuse(format!(
            "recorded with --generate {generate}, milestone {m} states {want}"
        )));
    }
    let recorded = prov["capture"].as_str().unwrap_or("default");
    if recorded != capture {
        return Err(refuse(format!(
            "recorded with --capture {recorded}, milestone {m} states {capture}"
        )));
    }
    Ok(t)
}

/// Runs a port milestone: see the module doc. `--bless` (and `gate init`) re-record the golden
/// traces, the expectations and the baselines, and return the log of what changed.
pub(super) fn run(
    o: &GateOptions,
    mut settled: Settled,
) -> Result<(Vec<MilestoneReport>, Option<String>)> {
    let started = std::time::Instant::now();
    let mut plan = settled
        .plans
        .pop()
        .ok_or_else(|| gerr!("a port milestone lists one model"))?;
    let m = plan.m.clone();
    let port = m
        .port
        .clone()
        .ok_or_else(|| gerr!("milestone {} is not a port milestone", m.id))?;
    if o.contract_cmd.is_some() {
        return Err(gerr!(
            "--contract-cmd: a port milestone runs no contract (its reference is {})",
            port.reference.producer
        ));
    }
    if plan.generate != m.generate && !o.bless {
        return Err(gerr!(
            "--generate {}: milestone {}'s golden traces hold {} greedy tokens; re-record them with --bless to change it",
            plan.generate,
            m.id,
            m.generate
        ));
    }
    let internals = match port.capture.as_str() {
        "default" => false,
        "internals" => true,
        other => {
            return Err(gerr!(
                "milestones.json: milestone {}: capture {other:?} is neither \"default\" nor \"internals\"",
                m.id
            ))
        }
    };
    let candidate = Producer::command("candidate", &port.candidate.cmd)
        .map_err(|e| gerr!("milestones.json: milestone {}: {e}", m.id))?;
    let reference = reference_producer(o, &port)?;
    let tokenized = resolve_text(o, &mut plan, &port)?;
    // Before anything runs: a golden trace that is not the one recorded is refused.
    let mut goldens: Vec<Option<Trace>> = Vec::new();
    for p in &plan.selected {
        goldens.push(if o.bless {
            None
        } else {
            Some(verified_golden(o, &m, &port, p, port.golden.get(&p.id))?)
        });
    }
    // The weights the golden traces were recorded on, before anything runs: another checkpoint
    // in the model's place would fail every comparison; it is named once instead.
    // A weights file the digest refuses (a FIFO, a device: it looks before it opens) is refused
    // here, before anything runs, instead of being waited on outside any --timeout.
    if let Some(g) = goldens.iter().flatten().next() {
        let now =
            tracegate_trace::weights_digest(&o.root.join(&plan.model)).map_err(|e| gerr!("{e}"))?;
        if let Some(then) = g.provenance()["weights_digest"]
            .as_str()
            .filter(|t| *t != now)
        {
            return Err(gerr!(
                "{}: its weights changed since milestone {}'s golden traces were recorded (weights digest {now}, golden {then}); re-record them with `gate run {} --bless`",
                plan.model,
                m.id,
                m.id
            ));
        }
    }
    let _lock = crate::WorkLock::acquire(&o.root.join(&settled.work_rel))?;
    for p in &plan.selected {
        let dir = o.root.join(&plan.work_rel).join(&p.id);
        // Never judge a stale trace: a candidate that fails must leave nothing to read.
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).map_err(|e| gerr!(File: "{}: {e}", dir.display()))?;
    }
    if o.bless {
        // `gate init`, `--bless`: the candidate once before the reference runs on every prompt.
        try_candidate(
            &o.root,
            &candidate,
            &plan.model,
            &plan.selected,
            internals,
            &plan.work_rel,
            o.timeout,
            port.candidate.ranks,
        )?;
    }
    let progress = crate::progress::start(format!("gate {}", m.id), plan.selected.len() as u64);
    // The noise traces: recorded ones verified before anything runs; re-run when blessing.
    let noise = noise_producer(o, &plan, &port);
    let mut noises: Vec<Option<std::sync::Arc<Trace>>> = Vec::new();
    for p in &plan.selected {
        noises.push(match (o.bless, port.noise.get(&p.id)) {
            (false, Some(g)) => Some(std::sync::Arc::new(verified_noise(o, &m, &port, p, g)?)),
            _ => None,
        });
    }
    let roles: Vec<Role> = [Role::Candidate]
        .into_iter()
        .chain(port.candidate.cache_off.then_some(Role::CandidateUncached))
        .chain(o.bless.then_some(Role::Oracle))
        .chain((o.bless && noise.is_ok()).then_some(Role::Noise))
        .collect();
    let noise_run = noise.as_ref().ok().map(|n| &n.0);
    let runs = produce(
        o,
        &plan,
        &roles,
        &candidate,
        &reference,
        noise_run,
        internals,
        port.candidate.ranks,
    )?;
    let producers_s = started.elapsed().as_secs_f64();
    let judging = std::time::Instant::now();
    // Blessing: the reference's new traces are the golden ones; a reference that failed
    // leaves nothing to bless.
    if o.bless {
        for ((p, (runs, _)), golden) in plan.selected.iter().zip(&runs).zip(goldens.iter_mut()) {
            let rec = runs
                .get(Role::Oracle)
                .ok_or_else(|| gerr!("the reference did not run"))?;
            let t = open(&o.root, rec).map_err(|e| {
                gerr!(Producer: "prompt {:?}: the reference failed, nothing is blessed: {e}\n    $ {}", p.id, rec.invocation)
            })?;
            *golden = Some(t);
        }
        for ((p, (runs, _)), slot) in plan.selected.iter().zip(&runs).zip(noises.iter_mut()) {
            let Some(rec) = runs.get(Role::Noise) else {
                continue;
            };
            let t = open(&o.root, rec).map_err(|e| {
                gerr!(Producer: "prompt {:?}: the noise run ({}) failed, nothing is blessed: {e}\n    $ {}", p.id, noise.as_ref().map(|n| n.1.as_str()).unwrap_or(""), rec.invocation)
            })?;
            *slot = Some(std::sync::Arc::new(t));
        }
    }
    let goldens: Vec<Trace> = goldens.into_iter().flatten().collect();
    if plan.m.policy == AUTO_POLICY {
        // A milestone recorded before precision was claimed at init: the golden traces'
        // precision (the user's --dtype at init), never the candidate's, which may declare
        // or store a coarser one to be judged more loosely.
        let golden: Vec<&str> = goldens
            .iter()
            .map(|t| {
                tracegate_diff::policy::computes_in(
                    t.provenance(),
                    t.tensors().iter().map(|i| (i.name.as_str(), i.dtype)),
                )
                // One that says nothing: the finest, the strictest judge.
                .map(|p| p.unwrap_or("f32"))
                .map_err(|e| gerr!(Producer: "{}: {e}", t.path().display()))
            })
            .collect::<Result<_>>()?;
        let precision = tracegate_diff::policy::coarsest(golden).unwrap_or("f32");
        plan.m.policy = precision.to_string();
        plan.policy = Policy::resolve(precision, &o.root).map_err(|e| gerr!("{precision}: {e}"))?;
    }
    let mut results = Vec::new();
    let noise_said = match &noise {
        Ok((_, what)) => format!("noise run: {what}"),
        Err(why) => {
            format!("no noise run: {why}; near-ties are bounded by the policy's near_tie.noise_abs")
        }
    };
    for (((p, (runs, sharded)), golden), noise_trace) in
        plan.selected.iter().zip(runs).zip(&goldens).zip(&noises)
    {
        let mut r = judge_prompt(
            o,
            &plan,
            &port,
            p,
            (runs, sharded),
            golden,
            noise_trace.as_ref(),
        );
        r.observations.push(match noise_trace {
            // Read only when it is not the candidate's own content (judge_prompt says so then).
            Some(n) if r.digests.contains_key("noise") => format!(
                "{noise_said}; the near-ties' honest noise read from {} ({})",
                n.path().display(),
                n.provenance()["producer"].as_str().unwrap_or("?")
            ),
            Some(_) => noise_said.clone(),
            None if noise.is_ok() && !o.bless => format!(
                "no noise trace recorded for prompt {:?} (an older gate init, or one whose noise run was the candidate's own content, which is never recorded): near-ties are bounded by the policy's near_tie.noise_abs; `gate run {} --bless` records one unless the candidate computes exactly as the noise run",
                p.id, m.id
            ),
            None => noise_said.clone(),
        });
        plan.judged(&r);
        if r.checks
            .iter()
            .any(|c| c.check == Check::Agrees && c.status == Status::Fail)
            && r.runs.get(Role::Candidate).is_some_and(|rec| rec.ok)
        {
            let sharded = r.sharded.get(Role::Candidate.key());
            let (mut l, bisected) = localise(
                o,
                &plan,
                &port,
                p,
                &candidate,
                internals,
                noise_trace.as_ref(),
                sharded.map(|s| s.world),
            );
            if let Some(s) = sharded {
                with_rank(o, &r, s, bisected, &mut l);
            }
            r.localised = Some(l);
        }
        results.push(r);
    }
    drop(progress);
    let bl_path = o.root.join("baselines.json");
    let mut bl_file = match &o.baselines {
        Some(b) => b.clone(),
        None => BaselineFile::load(&bl_path)?,
    };
    // `gate init` records the first baselines: there are none yet to hold this run to, and
    // none it records is checked against itself.
    let baselines = if o.baselines.is_some() {
        (Vec::new(), Vec::new())
    } else {
        recorded::check_baselines(&plan, &bl_file.baselines, &results, o.assert_observed)
    };
    let stack = json!({
        "tracegate": env!("CARGO_PKG_VERSION"),
        "reference": goldens.first().map(|g| json!({
            "producer": g.provenance()["producer"],
            "versions": g.provenance()["versions"],
            "dtype": g.provenance()["dtype"],
            "device": g.provenance()["device"],
        })),
    });
    let mut report = plan.report(o, stack, results, baselines);
    report.wall_s.insert("setup", 0.0);
    report.wall_s.insert("producers", producers_s);
    report
        .wall_s
        .insert("judge", judging.elapsed().as_secs_f64());
    report
        .wall_s
        .insert("total", started.elapsed().as_secs_f64());
    let log = if o.bless {
        Some(bless(
            o,
            &plan,
            &report,
            tokenized,
            &mut settled,
            &mut bl_file,
        )?)
    } else {
        None
    };
    Ok((vec![report], log))
}

/// A prompt's runs and, for a sharded candidate, each of its runs' rank traces by role key.
type Produced = (PromptRuns, BTreeMap<String, ShardedRun>);

/// Every run of the port, each role (candidate cached, uncached, and the reference when
/// blessing) in prompt order on a thread of its own; a sharded candidate's (`ranks`) rank
/// traces merged (ranks.rs). A run that timed out refuses the whole gate run, as for the
/// self-checks.
#[allow(clippy::too_many_arguments)]
fn produce(
    o: &GateOptions,
    plan: &Plan,
    roles: &[Role],
    candidate: &Producer,
    reference: &Producer,
    noise: Option<&Producer>,
    internals: bool,
    ranks: Option<u64>,
) -> Result<Vec<Produced>> {
    let per_role: Vec<Vec<(RunRecord, Option<ShardedRun>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = roles
            .iter()
            .map(|&role| {
                s.spawn(move || {
                    let (producer, ranks) = match role {
                        Role::Oracle => (reference, None),
                        Role::Noise => (noise.unwrap_or(reference), None),
                        _ => (candidate, ranks),
                    };
                    let file = if role == Role::Oracle {
                        "reference.trace"
                    } else {
                        role.file()
                    };
                    let mut out = Vec::new();
                    for p in &plan.selected {
                        let verb = Verb::Trace {
                            model: plan.model.clone(),
                            tokens: p.tokens.clone(),
                            out: format!("{}/{}/{file}", plan.work_rel, p.id),
                            internals,
                            generate: plan.generate,
                            cache: role != Role::CandidateUncached,
                            force: None,
                            seed: None,
                            shards: None,
                        };
                        let (rec, sharded) =
                            super::ranks::run_trace(producer, &o.root, &verb, o.timeout, ranks);
                        let stop = rec.timed_out;
                        out.push((rec, sharded));
                        if stop {
                            break;
                        }
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    for (role, recs) in roles.iter().zip(&per_role) {
        if let Some((p, (rec, _))) = plan
            .selected
            .iter()
            .zip(recs)
            .find(|(_, (r, _))| r.timed_out)
        {
            return Err(gerr!(
                Producer: "{} {}: {} {} timed out after {} s (--timeout) and was killed: $ {}",
                dir_name(&plan.model),
                p.id,
                match role {
                    Role::Oracle => "reference",
                    Role::Noise => "noise run",
                    _ => role.label(),
                },
                rec.verb,
                o.timeout.as_secs(),
                rec.invocation
            ));
        }
    }
    let mut iters: Vec<_> = per_role.into_iter().map(Vec::into_iter).collect();
    Ok(plan
        .selected
        .iter()
        .map(|_| {
            let mut sharded = BTreeMap::new();
            let runs = roles
                .iter()
                .zip(iters.iter_mut())
                .filter_map(|(role, it)| {
                    let (rec, s) = it.next()?;
                    if let Some(s) = s {
                        sharded.insert(role.key().to_string(), s);
                    }
                    Some((*role, rec))
                })
                .collect();
            (PromptRuns(runs), sharded)
        })
        .collect())
}

/// One prompt's checks: stable, agrees, generation, generation_reference.
fn judge_prompt(
    o: &GateOptions,
    plan: &Plan,
    port: &Port,
    p: &Prompt,
    (runs, sharded): Produced,
    golden: &Trace,
    noise: Option<&std::sync::Arc<Trace>>,
) -> PromptResult {
    let opened = |role: Role| -> Option<Opened> { runs.get(role).map(|rec| open(&o.root, rec)) };
    let cand = opened(Role::Candidate)
        .unwrap_or_else(|| Err(gerr!(Producer: "the candidate did not run")));
    let uncached = opened(Role::CandidateUncached);
    let expect = port.expect.get(&p.id);
    let mut observations = Vec::new();
    let mut checks = Vec::new();
    // stable: a claim only for a candidate that makes it.
    match (&cand, expect) {
        (Ok(t), Some(e)) if !port.candidate.deterministic => observations.push(format!(
            "candidate digest {} ({} the recorded {}): an observation, not a check — the candidate does not declare itself deterministic (candidate.deterministic in milestones.json)",
            t.digest().short(),
            if t.digest().hex() == e.candidate_digest { "equal to" } else { "differs from" },
            &e.candidate_digest[..16.min(e.candidate_digest.len())]
        )),
        (_, _) if !port.candidate.deterministic => {}
        // `gate init` records the first digest: nothing yet to hold it to.
        (Ok(t), None) if o.baselines.is_some() => observations.push(format!(
            "candidate digest {}: recorded by gate init, `stable` checks it from the next run on",
            t.digest().short()
        )),
        (_, expect) => {
            let recorded = expect.map(|e| e.candidate_digest.as_str()).ok_or_else(|| {
                format!("no digest recorded for prompt {:?}: run with --bless", p.id)
            });
            let mut c = check_stable("candidate", &cand, recorded.as_deref().map_err(String::as_str));
            if c.status == Status::Fail && cand.is_ok() {
                c.detail
                    .push_str(" (the candidate declares itself deterministic)");
            }
            checks.push(c);
        }
    }
    // A candidate that reproduces the noise run bit for bit (a port that is tracegate's engine)
    // would size its own near-ties through it: the policy's noise_abs bounds them instead.
    let noise = match (noise, &cand) {
        (Some(n), Ok(t)) if n.digest() == t.digest() => {
            observations.push(format!(
                "the noise trace {} is the candidate's own content: not read (near-ties are bounded by the policy's near_tie.noise_abs)",
                n.path().display()
            ));
            None
        }
        (n, _) => n,
    };
    let (agrees, summary) = match &cand {
        Ok(t) => {
            let (c, s) = compare_agrees(
                Check::Agrees,
                &plan.mm,
                p,
                golden,
                t,
                &plan.policy,
                noise,
                expect.map(|e| e.decisions_differing),
            );
            (c, Some(s))
        }
        Err(e) => (
            CheckResult::new(Check::Agrees, Status::Fail, e.to_string()),
            None,
        ),
    };
    // The candidate's recorded counts and tokens hold a run, not the `--bless` that replaces them.
    let recorded = expect.filter(|_| !o.bless);
    let agrees = match (&cand, recorded) {
        (Ok(t), Some(e)) => held_to_counts(plan, p, agrees, e, t),
        _ => agrees,
    };
    let agrees = match &cand {
        Ok(t) => run_as_asked(plan, p, agrees, golden, t),
        Err(_) => agrees,
    };
    checks.push(agrees);
    checks.push(check_generation(plan, port, p, &cand, uncached.as_ref()));
    let golden_tokens = decode_tokens(golden);
    checks.push(match &cand {
        Err(e) => CheckResult::new(Check::GenerationReference, Status::Fail, e.to_string()),
        Ok(_) if golden_tokens.is_empty() => CheckResult::not_checked(
            Check::GenerationReference,
            "no tokens generated (--generate 0)",
        ),
        Ok(t) => match &incomparable("candidate", &[("golden", t, golden)])[..] {
            refused @ [_, ..] => not_comparable(Check::GenerationReference, refused.to_vec()),
            [] => {
                let tokens = decode_tokens(t);
                let mut found: Vec<_> =
                    tokens_finding("candidate", "golden", &tokens, &golden_tokens)
                        .into_iter()
                        .collect();
                let mut detail = match found.first() {
                    None => format!("{} greedy tokens equal to the golden trace's", tokens.len()),
                    Some(f) => format!(
                        "{} of {} greedy tokens differ from the golden trace's: {}",
                        f.about.count,
                        tokens.len().max(golden_tokens.len()),
                        f.detail
                    ),
                };
                // And the tokens recorded when it was blessed (`expect.P.generated`).
                if let Some(e) = recorded.filter(|e| e.generated != tokens) {
                    let changed = format!(
                        "expect.{}.generated: recorded {:?}, now {tokens:?}",
                        p.id, e.generated
                    );
                    detail.push_str(&format!("; {changed}"));
                    found.push(finding(
                        FindingKind::TokensChanged,
                        "candidate",
                        tokens.len() as u64,
                        changed,
                    ));
                }
                judge(
                    &plan.mm,
                    &p.id,
                    CheckResult::new(Check::GenerationReference, Status::Pass, detail),
                    found,
                )
            }
        },
    });
    with_rank_findings(&mut checks, &sharded);
    for (role, s) in &sharded {
        observations.push(format!("{role} {}", s.line()));
    }
    let mut digests = BTreeMap::new();
    digests.insert("reference".to_string(), golden.digest().hex());
    if let Some(n) = noise {
        digests.insert("noise".to_string(), n.digest().hex());
    }
    for (role, t) in [
        (Role::Candidate, Some(&cand)),
        (Role::CandidateUncached, uncached.as_ref()),
    ] {
        if let Some(Ok(t)) = t {
            digests.insert(role.key().to_string(), t.digest().hex());
        }
    }
    PromptResult {
        id: p.id.clone(),
        tokens: p.tokens.len(),
        digests,
        checks,
        counts: cand.as_ref().map(counts).unwrap_or(Value::Null),
        generated: Generated {
            candidate_cached: cand.as_ref().ok().map(decode_tokens),
            candidate_uncached: uncached
                .as_ref()
                .and_then(|u| u.as_ref().ok())
                .map(decode_tokens),
            reference: Some(golden_tokens),
            ..Generated::default()
        },
        oracle: summary,
        observations,
        localised: None,
        sharded,
        runs,
    }
}

/// A sharded candidate's refused rank traces as FAIL findings naming the rank: on `agrees` and
/// `generation_reference` for its cached run, on `generation` for either run — each check that
/// failed because that run has no merged trace to judge. A merged run's line leads `agrees`.
fn with_rank_findings(checks: &mut [CheckResult], sharded: &BTreeMap<String, ShardedRun>) {
    let of = |role: Role| sharded.get(role.key());
    for c in checks.iter_mut() {
        let runs: &[Role] = match c.check {
            Check::Agrees | Check::GenerationReference | Check::Stable => &[Role::Candidate],
            Check::Generation => &[Role::Candidate, Role::CandidateUncached],
            _ => &[],
        };
        for s in runs.iter().filter_map(|r| of(*r)) {
            if let Some(f) = super::ranks::refusal_finding(s) {
                c.status = Status::Fail;
                c.findings.push(f);
            }
        }
        if c.check == Check::Agrees {
            if let Some(s) = of(Role::Candidate).filter(|s| s.refused.is_none()) {
                c.detail = format!("candidate {}; {}", s.line(), c.detail);
            }
        }
    }
}

/// A failing `agrees` of a sharded candidate, localised by `gate bisect --ranks N` (`l`), keeps
/// the gate's own attribution in `l.sharded`: the first tensor of the merged trace outside the
/// policy and the rank whose shard holds its worst element ([`super::ranks::attribute`]), beside
/// the bisection's `at` (its first divergence, or the refused merge's tensor, with the rank) and
/// how its layers were isolated (`layer_verb`), from its report's `sharded` (`bisected`). When the bisection names no rank (it could not
/// run, or judged no divergence), the summary ends with the gate's attribution, so the line
/// still names layer, stage and rank.
fn with_rank(o: &GateOptions, r: &PromptResult, s: &ShardedRun, bisected: Value, l: &mut Value) {
    let (rank, holds, tensor) = match r.oracle.as_ref().and_then(|o| o.first_violation.as_ref()) {
        None => {
            let first = r
                .checks
                .iter()
                .find(|c| c.check == Check::Agrees)
                .and_then(|c| c.findings.first())
                .map_or("-".to_string(), |f| format!("{} {}", f.kind, f.about.name));
            (
                None,
                format!("no tensor of the merged trace is outside the policy (first finding: {first}), so no rank's shard is named"),
                None,
            )
        }
        Some(v) => {
            let coords = v.worst_element.as_ref().map(|e| e.coords.as_slice());
            let (rank, holds) = super::ranks::attribute(&o.root, s, &v.tensor, coords);
            (rank, holds, Some(v.tensor.clone()))
        }
    };
    if bisected["at"]["rank"].is_null() {
        let words = match &tensor {
            Some(t) => {
                let n = tracegate_trace::names::Name::parse(t);
                let layer = n
                    .layer
                    .map_or("outside any layer".to_string(), |l| format!("layer {l:02}"));
                format!(
                    "{layer}, stage {}: {t} is outside the policy; {holds}",
                    n.point
                )
            }
            None => holds.clone(),
        };
        let summary = l["summary"].as_str().unwrap_or("-").to_string();
        l["summary"] = Value::String(format!(
            "{summary}; by the {} rank traces the gate merged: {words}",
            s.world
        ));
    }
    l["sharded"] = json!({
        "world": s.world,
        "rank": rank,
        "holds": holds,
        "ranks": s.ranks,
        "at": bisected["at"],
        "layer_verb": bisected["layer_verb"].as_str().unwrap_or("not run: the bisection did not run"),
    });
}

/// `agrees` also holds the candidate's trace to the counts its expectation records, as
/// `matches` holds the engine's: `expect.P.tensors` and `expect.P.decisions`, each a
/// `count_changed` finding when it is not this run's.
fn held_to_counts(
    plan: &Plan,
    p: &Prompt,
    c: CheckResult,
    e: &PortExpectation,
    t: &Trace,
) -> CheckResult {
    let found: Vec<_> = [
        ("tensors", e.tensors, t.tensors().len()),
        ("decisions", e.decisions, t.decisions().len()),
    ]
    .into_iter()
    .filter(|(_, want, have)| want != have)
    .map(|(what, want, have)| {
        finding(
            FindingKind::CountChanged,
            what,
            have as u64,
            format!("expect.{}.{what}: recorded {want}, now {have}", p.id),
        )
    })
    .collect();
    failed_by(plan, p, c, found, Said::After)
}

/// Where `failed_by` puts its findings' words in the check's detail.
enum Said {
    Before,
    After,
}

/// `c` with the gate's own findings `found` judged (a declared divergence excuses one) and said
/// in its detail; FAIL when one stands, whatever `c` was.
fn failed_by(
    plan: &Plan,
    p: &Prompt,
    c: CheckResult,
    found: Vec<super::Finding>,
    said_at: Said,
) -> CheckResult {
    if found.is_empty() {
        return c;
    }
    let said = found
        .iter()
        .map(|f| f.detail.as_str())
        .collect::<Vec<_>>()
        .join("; ");
    let mut c = judge(&plan.mm, &p.id, c, found);
    c.detail = match said_at {
        Said::Before => format!("{said}; {}", c.detail),
        Said::After => format!("{}; {said}", c.detail),
    };
    if !c.findings.is_empty() {
        c.status = Status::Fail;
    }
    c
}

/// `agrees` fails when the candidate's trace is not the run the gate asked for, whatever its
/// values: a trace that does not record its prompt (`prompt_tokens`) or its `generate`, or
/// records another `generate`, cannot be shown to be that run (docs/producers.md, "Provenance a
/// producer must record"); one with another number of greedy tokens than the golden trace did
/// not run the decode asked for. (Another prompt is refused as incomparable before this.)
fn run_as_asked(plan: &Plan, p: &Prompt, c: CheckResult, golden: &Trace, t: &Trace) -> CheckResult {
    let prov = t.provenance();
    let mut found = Vec::new();
    if prov.get("prompt_tokens").is_none_or(Value::is_null) {
        found.push(finding(
            FindingKind::NotAsAsked,
            "prompt_tokens",
            1,
            "the candidate's trace records no provenance prompt_tokens: which prompt it ran cannot be verified; record the ids it was given (docs/producers.md, \"Provenance a producer must record\")",
        ));
    }
    let asked = plan.generate as u64;
    match prov.get("generate") {
        Some(v) if v.as_u64() == Some(asked) => {}
        said => found.push(finding(
            FindingKind::NotAsAsked,
            "generate",
            1,
            match said {
                None => format!("the candidate's trace records no provenance generate (asked: --generate {asked}); record the count it was given (docs/producers.md)"),
                Some(v) => format!("the candidate was asked for --generate {asked} and its provenance says generate {v}"),
            },
        )),
    }
    let (have, want) = (decode_tokens(t).len(), decode_tokens(golden).len());
    if have != want {
        found.push(finding(
            FindingKind::NotAsAsked,
            "greedy tokens",
            have as u64,
            format!(
                "the candidate generated {have} greedy token(s) where the golden trace holds {want} (asked: --generate {asked}): its decode loop stops early or runs on"
            ),
        ));
    }
    failed_by(plan, p, c, found, Said::Before)
}

/// generation: the candidate's cached decode against its own uncached recompute, judged as
/// `agrees` judges the golden trace (the uncached run the reference): every tensor (the decode
/// steps' logits among them) within the policy and present in both, and every decision — the
/// greedy tokens — equal but for near-ties, so a cache defect that leaves the tokens alone still
/// fails and a non-ordered port's honest near-tie between its two paths does not.
fn check_generation(
    plan: &Plan,
    port: &Port,
    p: &Prompt,
    cand: &Opened,
    uncached: Option<&Opened>,
) -> CheckResult {
    let c = Check::Generation;
    if plan.generate == 0 {
        return CheckResult::not_checked(c, "no tokens generated (--generate 0)");
    }
    let unc = match (cand, uncached) {
        (_, None) if !port.candidate.cache_off => {
            return CheckResult::not_checked(
                c,
                "the candidate does not answer `trace --cache off` (candidate.cache_off in milestones.json, found by gate init): its cached decode has nothing to be compared with",
            )
        }
        (Err(e), _) => return CheckResult::new(c, Status::Fail, e.to_string()),
        (_, None) => {
            return CheckResult::new(c, Status::Fail, "the candidate's uncached run did not run")
        }
        (_, Some(Err(e))) => return CheckResult::new(c, Status::Fail, format!("--cache off: {e}")),
        (Ok(_), Some(Ok(u))) => u,
    };
    let Ok(cached) = cand else {
        return CheckResult::new(c, Status::Fail, "the candidate's trace is unreadable");
    };
    // What is compared must be what was asked for: a port that ignores `--cache off` compares
    // its cached path with itself.
    if let Some(judged) = cache_as_asked(cached, unc) {
        return judged;
    }
    if let refused @ [_, ..] =
        &incomparable("candidate", &[("candidate-uncached", cached, unc)])[..]
    {
        return not_comparable(c, refused.to_vec());
    }
    // No noise trace here: it measures the reference model, not the candidate's uncached path.
    let (mut judged, _) = compare_agrees(c, &plan.mm, p, unc, cached, &plan.policy, None, None);
    let (a, b) = (decode_tokens(cached), decode_tokens(unc));
    let tokens = match a.iter().zip(&b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
    {
        0 => format!("{} greedy tokens equal", a.len()),
        n => format!("{n} of {} greedy tokens differ", a.len().max(b.len())),
    };
    judged.detail = format!("cached vs uncached: {tokens}; {}", judged.detail);
    judged
}

/// `generation` refused before anything is compared when either run's provenance `cache` is
/// not the one the gate asked for (docs/producers.md: a `trace --generate` run records `cache`,
/// `"on"` or `"off"`): FAIL when it says another (`"on"` in the uncached run: the port ignored
/// `--cache off`, and its cached path was compared with itself); NOT CHECKED when a run does not
/// record it, since what ran cannot then be verified. None: both say what was asked.
fn cache_as_asked(cached: &Trace, uncached: &Trace) -> Option<CheckResult> {
    let c = Check::Generation;
    let runs = [("cached", cached, "on"), ("uncached", uncached, "off")];
    let wrong: Vec<_> = runs
        .iter()
        .filter_map(|(run, t, want)| match t.provenance().get("cache") {
            Some(Value::String(s)) if s == want => None,
            Some(v) => Some(finding(
                FindingKind::NotAsAsked,
                format!("candidate-{run}"),
                1,
                format!(
                    "the candidate's {run} run was asked for `--cache {want}` and its provenance says cache {v}: {}",
                    if *want == "off" {
                        "the port ignored `--cache off`, so its cached decode was compared with itself; run the uncached path when asked (docs/producers.md)"
                    } else {
                        "record the cache it ran with (docs/producers.md)"
                    }
                ),
            )),
            None => None,
        })
        .collect();
    if !wrong.is_empty() {
        let said: Vec<&str> = wrong.iter().map(|f| f.detail.as_str()).collect();
        let mut r = CheckResult::new(
            c,
            Status::Fail,
            format!("not compared: {}", said.join("; ")),
        );
        r.findings = wrong;
        return Some(r);
    }
    let silent: Vec<&str> = runs
        .iter()
        .filter(|(_, t, _)| t.provenance().get("cache").is_none())
        .map(|(run, _, _)| *run)
        .collect();
    (!silent.is_empty()).then(|| {
        CheckResult::not_checked(
            c,
            format!(
                "the candidate's {} run records no provenance `cache`: whether it ran with or without its KV cache cannot be verified, so the cached decode is not compared; record `cache` (\"on\" / \"off\", as asked) in every `trace` run's provenance (docs/producers.md)",
                silent.join(" and ")
            ),
        )
    })
}

/// A failing `agrees` localised: `gate bisect` of the candidate against the stored golden
/// trace (its `hidden_in` per layer feeds the candidate's `layer` verb; its outputs judge).
/// Its report goes beside the prompt's traces; the summary names the first wrong layer and stage.
/// A sharded candidate (`ranks`) is bisected with `--ranks N` (docs/bisect.md, "Sharded
/// candidates"): its report's `sharded` (`at`, `layer_verb`; null unsharded or when the
/// bisection did not run) is returned beside the localisation, for [`with_rank`].
#[allow(clippy::too_many_arguments)]
fn localise(
    o: &GateOptions,
    plan: &Plan,
    port: &Port,
    p: &Prompt,
    candidate: &Producer,
    internals: bool,
    noise: Option<&std::sync::Arc<Trace>>,
    ranks: Option<u64>,
) -> (Value, Value) {
    let work = format!("{}/{}/bisect", plan.work_rel, p.id);
    // Blessing: the golden trace is still the reference's new one in the work directory.
    let golden = match (o.bless, port.golden.get(&p.id)) {
        (true, _) => format!("{}/{}/reference.trace", plan.work_rel, p.id),
        (false, Some(g)) => g.trace.clone(),
        (false, None) => {
            return (
                json!({"verdict": "refused", "summary": "no golden trace", "first_wrong_layer": null, "stage": null, "report": null,
                "capsule": bisect::capsule::not_written("no golden trace")}),
                Value::Null,
            )
        }
    };
    crate::progress::doing(format!(
        "{}: localising the failing agrees (gate bisect against {golden})",
        p.id
    ));
    let result = bisect::StoredReference::open(&o.root.join(&golden), &golden).and_then(|stored| {
        let opts = bisect::BisectOptions {
            root: o.root.clone(),
            model: plan.model.clone(),
            tokens: p.tokens.clone(),
            prompt: Some(p.id.clone()),
            reference: bisect::Reference::Stored(stored),
            candidate: candidate.clone(),
            policy: Some(plan.m.policy.clone()),
            exact: false,
            // The claim the milestone records: the rounding response's unit.
            precision: Policy::claimed_precision(&plan.m.policy).map(|_| plan.m.policy.clone()),
            all_layers: false,
            internals,
            calibrate: false,
            generate: plan.generate,
            seed: 1,
            sampling: plan.samples(),
            sampler_seed: plan.seed,
            work: work.clone(),
            timeout: o.timeout,
            gate_invocation: o.gate_invocation.clone(),
            allow_stack_mismatch: false,
            noise: noise.map(|n| tracegate_diff::NoiseReference(n.clone())),
            ranks,
        };
        bisect::run(&opts).map(|rep| (opts, rep))
    });
    match result {
        Ok((opts, rep)) => {
            let path = format!("{work}/report.json");
            let written = crate::write_json_atomic(&o.root.join(&path), &rep).is_ok();
            // The first wrong layer as a repro capsule beside the bisection's report.
            let capsule = format!("{}/{}/capsule", plan.work_rel, p.id);
            let l = json!({
                "verdict": rep.verdict,
                "summary": rep.summary,
                "first_wrong_layer": rep.first_wrong_layer,
                "stage": rep.stage.as_ref().map(|s| json!({"layer": s.layer, "block": s.block, "tensor": s.tensor, "detail": s.detail})),
                "report": written.then_some(path),
                "capsule": bisect::capsule::for_report(&opts, &rep, &capsule),
            });
            let sharded = rep.sharded.as_ref().map_or(
                Value::Null,
                |s| json!({"at": s.at, "layer_verb": s.layer_verb}),
            );
            (l, sharded)
        }
        Err(e) => (
            json!({"verdict": "refused", "summary": format!("the bisection could not run: {e}"), "first_wrong_layer": null, "stage": null, "report": null,
                "capsule": bisect::capsule::not_written("the bisection could not run")}),
            Value::Null,
        ),
    }
}

/// `--bless` (and `gate init`): the golden traces, the expectations, the policy chosen and the
/// baselines recorded; the log of what changed. Every file is written through one journal
/// (crate::journal): an interrupted bless leaves the project as it was or as it became.
fn bless(
    o: &GateOptions,
    plan: &Plan,
    report: &MilestoneReport,
    tokenized: Option<Tokenized>,
    settled: &mut Settled,
    bl_file: &mut BaselineFile,
) -> Result<String> {
    let mut log = Vec::new();
    let id = plan.m.id.clone();
    let milestone = settled
        .file
        .get_mut(&id)
        .ok_or_else(|| gerr!("milestone {id} vanished"))?;
    if milestone.prompts.sha256 != plan.set.sha256 {
        log.push(format!(
            "{id}: prompts sha256 {} -> {}",
            milestone.prompts.sha256, plan.set.sha256
        ));
        milestone.prompts.sha256 = plan.set.sha256.clone();
    }
    if milestone.policy != plan.m.policy {
        log.push(format!(
            "{id}: policy {} -> {}",
            milestone.policy, plan.m.policy
        ));
        milestone.policy = plan.m.policy.clone();
    }
    if milestone.generate != plan.generate {
        log.push(format!(
            "{id}: generate {} -> {}",
            milestone.generate, plan.generate
        ));
        milestone.generate = plan.generate;
    }
    let port = milestone
        .port
        .as_mut()
        .ok_or_else(|| gerr!("milestone {id} is not a port milestone"))?;
    if port.tokenized != tokenized {
        let digest = |t: &Option<Tokenized>| {
            t.as_ref()
                .map_or("none".to_string(), |t| t.tokenizer_digest[..16].to_string())
        };
        log.push(format!(
            "{id}: text prompts tokenized (tokenizer {} -> {}){}",
            digest(&port.tokenized),
            digest(&tokenized),
            tokenized
                .iter()
                .flat_map(|t| &t.prompts)
                .map(|(pid, t)| format!("; {pid} {:?}", t.tokens))
                .collect::<String>()
        ));
        port.tokenized = tokenized;
    }
    let mut moves = Vec::new();
    for r in &report.prompts {
        let Some(digest) = r.digests.get("reference") else {
            continue;
        };
        let trace = format!("golden/{}.trace", r.id);
        let from = o.root.join(&plan.work_rel).join(&r.id);
        let pin = |file: &str| -> Result<String> {
            let t = Trace::open(from.join(file))
                .map_err(|e| gerr!(File: "{}: {e}", from.join(file).display()))?;
            Ok(crate::milestone::milestones::provenance_pin(t.provenance()))
        };
        let new = Golden {
            trace: trace.clone(),
            digest: digest.clone(),
            generated: r.generated.reference.clone().unwrap_or_default(),
            provenance: pin("reference.trace")?,
        };
        match r.digests.get("noise") {
            Some(nd) => {
                let noise_trace = format!("golden/{}.noise.trace", r.id);
                let n = Golden {
                    trace: noise_trace.clone(),
                    digest: nd.clone(),
                    generated: Vec::new(),
                    provenance: pin("noise.trace")?,
                };
                if port.noise.get(&r.id) != Some(&n) {
                    log.push(format!(
                        "{id}/{}: noise trace {noise_trace} ({})",
                        r.id,
                        &nd[..16]
                    ));
                }
                port.noise.insert(r.id.clone(), n);
                moves.push((from.join("noise.trace"), noise_trace.clone()));
            }
            None => {
                if port.noise.remove(&r.id).is_some() {
                    log.push(format!("{id}/{}: noise trace dropped (no noise run)", r.id));
                }
            }
        }
        match port.golden.get(&r.id) {
            Some(old) if *old == new => log.push(format!(
                "{id}/{}: golden trace unchanged ({})",
                r.id,
                &digest[..16]
            )),
            Some(old) => log.push(format!(
                "{id}/{}: golden trace {} -> {}{}",
                r.id,
                &old.digest[..16.min(old.digest.len())],
                &digest[..16],
                if old.generated == new.generated {
                    String::new()
                } else {
                    format!("; golden tokens {:?} -> {:?}", old.generated, new.generated)
                }
            )),
            None => log.push(format!(
                "{id}/{}: new golden trace {trace} ({})",
                r.id,
                &digest[..16]
            )),
        }
        port.golden.insert(r.id.clone(), new);
        moves.push((from.join("reference.trace"), trace.clone()));
        let Some(cand) = r.digests.get("candidate") else {
            log.push(format!(
                "{id}/{}: the candidate failed; its expectation left as it was",
                r.id
            ));
            continue;
        };
        let differing = r
            .found(Check::Agrees, FindingKind::DecisionDiffers)
            .map_or(0, |f| f.len());
        let new = PortExpectation {
            candidate_digest: cand.clone(),
            tensors: r.counts["tensors"].as_u64().unwrap_or(0) as usize,
            decisions: r.counts["decisions"].as_u64().unwrap_or(0) as usize,
            generated: r.generated.candidate_cached.clone().unwrap_or_default(),
            decisions_differing: differing,
        };
        match port.expect.get(&r.id) {
            Some(old) if *old == new => {}
            Some(old) => log.push(format!(
                "{id}/{}: expectation {} -> {}",
                r.id,
                serde_json::to_string(old).unwrap_or_default(),
                serde_json::to_string(&new).unwrap_or_default()
            )),
            None => log.push(format!(
                "{id}/{}: new expectation {}",
                r.id,
                serde_json::to_string(&new).unwrap_or_default()
            )),
        }
        port.expect.insert(r.id.clone(), new);
        recorded::record_baseline(plan, report, r, bl_file, &mut log);
    }
    let ms = crate::json_bytes(&settled.ms_path, &settled.file)?;
    let bl_path = o.root.join("baselines.json");
    let bl = crate::json_bytes(&bl_path, bl_file)?;
    // `gate init` that read a prompt file from outside the project: the project's copy, the
    // very bytes the milestone records the sha256 of.
    let recorded_set = crate::prompts::resolve(&o.root, &plan.m.prompts.set);
    let prompt_copy = if o.milestones.is_some() && recorded_set != plan.prompt_path {
        let bytes = tracegate_trace::json::read_bytes(
            &plan.prompt_path,
            tracegate_trace::json::MAX_JSON_LEN,
        )
        .map_err(|e| gerr!(File: "{e}; nothing written"))?;
        let sha = {
            use sha2::Digest;
            hex::encode(sha2::Sha256::digest(&bytes))
        };
        if sha != plan.set.sha256 {
            return Err(
                gerr!(File: "{}: changed while gate init ran (sha256 {sha}, read as {}); nothing written", plan.prompt_path.display(), plan.set.sha256),
            );
        }
        Some(bytes)
    } else {
        None
    };
    // Everything or nothing, at every instant (crate::journal): milestones.json, baselines.json,
    // the golden and noise traces (and init's prompt copy) staged, then renamed into place.
    let mut files: Vec<(&str, journal::Content)> = vec![
        ("milestones.json", journal::Content::Bytes(&ms)),
        ("baselines.json", journal::Content::Bytes(&bl)),
    ];
    for (from, rel) in &moves {
        files.push((rel, journal::Content::Copy(from)));
    }
    if let Some(bytes) = &prompt_copy {
        files.push((&plan.m.prompts.set, journal::Content::Bytes(bytes)));
    }
    let command = if o.milestones.is_some() {
        "gate init".to_string()
    } else {
        format!("gate run {id} --bless")
    };
    journal::commit(&o.root, &command, &files)?;
    if log.is_empty() {
        log.push("nothing changed".into());
    }
    Ok(log.join("\n"))
}
