//! `gate bisect`: find the first layer whose *body* is wrong, not just the first layer whose
//! output differs (docs/bisect.md; report schema docs/bisect-report.schema.json).
//!
//! The parts, from the bottom up; none imports one above it:
//! - judge.rs: how it judges (by bits or a policy), the rounding-level reading, the outliers;
//! - options.rs: what a bisection is asked (its options, reference and producers) and work.rs
//!   the work directory and the producers' runs on fresh outputs, which every phase shares;
//! - prefill/: the prefill's phases (whole runs, layers in isolation, self-consistency,
//!   calibration, the verdict) and the report's types;
//! - decode/: `--generate N`, the decode steps after the prefill, built on prefill's pieces;
//! - diffusion/: `--generate N` on a block-diffusion model, the passes after the prompt;
//! - this file: the bisection itself (`run`: the prefill, then the decode steps) and its report;
//! - render.rs the text output and html/ the page (`--html`), both of the whole report;
//! - capsule/: `--capsule DIR`, the first wrong layer as a repro capsule, and its replay;
//! - sharded.rs: `--ranks N`, a sharded candidate's merged run, refusals and ranks.

use serde::Serialize;
use tracegate_diff::{Options, Verdict};
use tracegate_producers::RunRecord;

use crate::Result;

pub mod capsule;
pub mod decode;
pub mod diffusion;
pub mod html;
pub mod judge;
pub mod options;
pub mod prefill;
pub mod render;
pub mod sharded;
mod work;

use judge::{By, Judge, Outliers, RoundingLevel};
pub use options::{is_ordered, producer, BisectOptions, Reference, StoredReference};
use prefill::*;

/// The report's format (docs/bisect.md, docs/bisect-report.schema.json).
pub const SCHEMA: &str = "tracegate-bisect/6";

/// Whether the model at `model` (relative to `root`) samples: block diffusion, whose passes after
/// the prompt ../diffusion/ bisects.
pub fn samples(root: &std::path::Path, model: &str) -> Result<bool> {
    let (config, _) = crate::prompts::model_config(&root.join(model))
        .map_err(|e| crate::gerr!("--model: {e}"))?;
    Ok(crate::prompts::samples(crate::prompts::family(&config)))
}

/// Each layer's kind, the outlier check's peer groups: the config's `layer_types` (Qwen3.5's
/// linear and full attention, diffusion Gemma's sliding and full, whose last layer is always
/// full and whose default is 5:1, docs/diffusion-gemma.md); "" for every layer of a family
/// without them, or when the config cannot be read (the producers refuse it then).
fn layer_kinds(o: &BisectOptions, n: usize) -> Vec<String> {
    let Ok((config, _)) = crate::prompts::model_config(&o.root.join(&o.model)) else {
        return vec![String::new(); n];
    };
    let listed = crate::prompts::text_fields(&config)
        .get("layer_types")
        .and_then(serde_json::Value::as_array)
        .filter(|l| l.len() == n);
    let mut kinds: Vec<String> = match listed {
        Some(l) => l
            .iter()
            .map(|k| k.as_str().unwrap_or_default().to_string())
            .collect(),
        None if o.sampling => (0..n)
            .map(|l| {
                if (l + 1) % 6 == 0 {
                    "full_attention"
                } else {
                    "sliding_attention"
                }
                .into()
            })
            .collect(),
        None => vec![String::new(); n],
    };
    if o.sampling {
        if let Some(last) = kinds.last_mut() {
            *last = "full_attention".into();
        }
    }
    kinds
}

/// An engine or contract side on a family they do not compute is refused before anything runs
/// (else the other side's run, the oracle's minutes on a real model, comes first).
fn refuse_family_of_no_ordered_producer(o: &BisectOptions) -> Result<()> {
    let mut ordered = vec![&o.candidate];
    if let Reference::Run(p) = &o.reference {
        ordered.push(p);
    }
    if !ordered.into_iter().any(|p| is_ordered(&o.root, p)) {
        return Ok(());
    }
    let (config, _) = crate::prompts::model_config(&o.root.join(&o.model))
        .map_err(|e| crate::gerr!("--model: {e}"))?;
    let family = crate::prompts::family(&config);
    if family.is_empty() || tracegate_engine::config::BIT_EXACT_FAMILIES.contains(&family) {
        return Ok(()); // a config without model_type: the producer's own refusal says it
    }
    Err(crate::gerr!(
        "--model {}: model_type {family:?} {}",
        o.model,
        tracegate_engine::config::unsupported_family(family)
    ))
}

/// The bisection, phase by phase: the whole runs (prefill/whole.rs: run, judge, force decisions,
/// locate), the layers (prefill/layers.rs: isolate, self-check, statuses, calibrate, outliers), the
/// verdict (prefill/verdict.rs) and the decode steps (decode/). Every producer run is recorded
/// in `runs`; one that timed out refuses the bisection.
pub fn run(o: &BisectOptions) -> Result<BisectReport> {
    crate::prompts::check_fits(
        &o.root,
        &o.model,
        o.prompt.as_deref(),
        o.tokens.len(),
        o.generate,
    )?;
    if let Reference::Stored(s) = &o.reference {
        s.fits(o)?;
    }
    refuse_family_of_no_ordered_producer(o)?;
    // Never judge an earlier run's traces: only an empty directory or one bisect made is used,
    // and it is emptied of bisect's own traces under the lock (work.rs).
    let work_dir = o.root.join(&o.work);
    work::check(&work_dir)?;
    let _lock = crate::WorkLock::acquire(&work_dir)?;
    work::prepare(&work_dir)?;
    let _progress = crate::progress::start("bisect", 1);
    let mut runs = Vec::new();
    let whole = match whole::whole_runs(o, &mut runs)? {
        whole::Wholes::Both(w) => w,
        whole::Wholes::RanksRefused(s, reference) => {
            return sharded::refused_report(o, s, &reference, runs)
        }
    };
    let (judge, policy, ordered) = whole::choose_judge(o, (&whole.reference, &whole.candidate))?;
    // The decode steps are bisected after the prefill, step by step (decode/).
    let opts = Options {
        all: true,
        policy: policy.clone(),
        filter: decode::prefill_filter(o.generate, o.sampling),
        allow_stack_mismatch: o.allow_stack_mismatch,
        noise: o.noise.clone().filter(|_| policy.is_some()),
        ..Options::default()
    };
    let compared = compare_whole(&whole.reference, &whole.candidate, &opts)?;
    let (compared, decisions_forced) =
        whole::force_decisions(o, &whole, compared, &opts, &mut runs)?;
    let forced = decisions_forced
        .as_ref()
        .is_some_and(|f| f.status == Forcing::Forced);
    let located = whole::locate(&whole.reference, &compared, forced);
    let n = located.n;

    let (mut layers, failed) =
        layers::isolate_layers(o, &whole, &located, &policy, forced, &mut runs);
    refuse_timeout(&runs, o)?;
    // Before a layer body is blamed: does the candidate's layer verb agree with its own whole run?
    let own_rel = decisions_forced
        .as_ref()
        .and_then(|f| f.candidate_trace.clone())
        .unwrap_or_else(|| whole.cand_rel.clone());
    let own = open(&o.root, &own_rel)?;
    // And a layer that would "inherit" what its agreeing input cannot have passed on.
    let unexplained = layers::unexplained(&layers, &located);
    let self_consistency = self_check(
        o,
        &own,
        &own_rel,
        &mut layers,
        &policy,
        forced,
        unexplained.as_ref().map(|u| u.layer),
        &mut runs,
    );
    refuse_timeout(&runs, o)?;
    let first_wrong = layers::settle_statuses(&mut layers);
    let reference = &whole.reference;
    let stage =
        first_wrong.map(|l| stage(l, &layers[l], is_moe(reference, l), "differs in isolation"));
    let auto = judge.by == By::Bits && !(ordered.0 && ordered.1) && !o.calibrate;
    let calibration = layers::calibration(
        o,
        reference,
        &mut layers,
        &located,
        first_wrong,
        auto,
        &mut runs,
    );
    refuse_timeout(&runs, o)?;
    let rounding_level = match (first_wrong, judge.by) {
        (Some(l), By::Bits) => RoundingLevel::new(
            l,
            layers[l].isolated_rel_l2,
            layers[l].calibration_rel_l2,
            &judge,
            o.exact,
        ),
        _ => None,
    };
    let whole_within = matches!(
        located.whole_run.verdict,
        Verdict::Identical | Verdict::WithinPolicy
    );
    let rounding_response = match judge.by {
        By::Policy => layers::rounding_response(
            o,
            reference,
            &layers,
            first_wrong,
            whole_within,
            judge.precision,
            &mut runs,
        ),
        By::Bits => None,
    };
    refuse_timeout(&runs, o)?;
    let outliers = layers::outliers(reference, &layer_kinds(o, layers.len()), &mut layers);
    let amplification = layers::amplification(&layers);

    let said = match &self_consistency.inconsistent {
        // The first layer whose verbs disagree comes before any layer blamed: nothing is blamed.
        Some(i) if first_wrong.is_none_or(|w| i.layer < w) => {
            inconsistent_verdict(i, &layers, &located.whole_run, unexplained.as_ref())
        }
        _ => verdict(
            &layers,
            &located,
            first_wrong,
            &stage,
            amplification,
            &failed,
        ),
    };
    let (verdict, mut summary) = match &decisions_forced {
        Some(f) => with_forcing(f, said),
        None => said,
    };
    if let Some(r) = &rounding_level {
        summary.push_str(&format!("; {}", r.words()));
    }
    if first_wrong.is_some() && !self_consistency.not_checked.is_empty() {
        summary.push_str(&format!(
            "; the candidate's layer verb NOT CHECKED against its own whole run: {}",
            self_consistency.not_checked.join("; ")
        ));
    }
    if !outliers.suspicious.is_empty() {
        summary.push_str(&format!("; {}", suspicious_words(&layers, &outliers)));
    }
    if let Some(words) = rounding_response
        .as_ref()
        .and_then(|rr| response_words(rr, verdict, first_wrong))
    {
        summary.push_str(&format!("; {words}"));
    }
    let mut diffusion = None;
    let (decode, (verdict, summary)) = if o.generate > 0 && o.sampling {
        let forced_rel = decisions_forced
            .as_ref()
            .filter(|f| f.status == Forcing::Forced)
            .and_then(|f| f.candidate_trace.clone());
        let forced_trace = match &forced_rel {
            Some(rel) => Some(open(&o.root, rel)?),
            None => None,
        };
        let ctx = diffusion::Context {
            reference,
            ref_rel: &whole.ref_rel,
            candidate: forced_trace.as_ref().unwrap_or(&whole.candidate),
            cand_rel: forced_rel.as_deref().unwrap_or(&whole.cand_rel),
            policy: &policy,
            layers: n,
            allow_stack_mismatch: o.allow_stack_mismatch,
            forced,
        };
        let (d, v) = diffusion::run(o, &ctx, &mut runs, (verdict, summary));
        refuse_timeout(&runs, o)?;
        diffusion = Some(d);
        (None, v)
    } else if o.generate > 0 {
        let ctx = decode::Context {
            reference,
            candidate: &whole.candidate,
            policy: &policy,
            layers: n,
            allow_stack_mismatch: o.allow_stack_mismatch,
        };
        let (d, v) = decode::run(o, &ctx, &mut runs, (verdict, summary));
        refuse_timeout(&runs, o)?;
        (Some(d), v)
    } else {
        (None, (verdict, summary))
    };
    let mut report = BisectReport {
        schema: SCHEMA,
        summary,
        verdict,
        exit_code: verdict.exit_code(),
        model: o.model.clone(),
        prompt: o.prompt.clone(),
        tokens: o.tokens.clone(),
        reference: o.reference.name(),
        reference_trace: reference_trace(o),
        candidate: o.candidate.name(),
        judge,
        capture: capture(o),
        layers_total: n,
        decisions_forced,
        whole_run: located.whole_run,
        timeout_s: o.timeout.as_secs(),
        first_wrong_layer: first_wrong,
        stage,
        layers,
        amplification_per_layer: amplification,
        calibration,
        decode,
        diffusion,
        rounding_level,
        rounding_response,
        self_consistency,
        outliers,
        work_dir: o.work.clone(),
        runs,
        gate_invocation: o.gate_invocation.clone(),
        policy,
        sharded: None,
    };
    if let Some(run) = whole.sharded.clone() {
        report.sharded = Some(sharded::merged(o, run, &whole, &mut report));
    }
    Ok(report)
}

/// `--reference trace:PATH`: the stored trace judged against (None: a producer ran).
fn reference_trace(o: &BisectOptions) -> Option<ReferenceTrace> {
    match &o.reference {
        Reference::Stored(s) => Some(ReferenceTrace {
            path: s.shown.clone(),
            digest: s.digest.clone(),
            producer: s.producer.clone(),
        }),
        Reference::Run(_) => None,
    }
}

fn capture(o: &BisectOptions) -> Capture {
    if o.internals {
        Capture::Internals
    } else {
        Capture::Default
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct BisectReport {
    pub schema: &'static str,
    pub summary: String,
    pub verdict: BisectVerdict,
    /// `verdict`'s exit status.
    pub exit_code: i32,
    pub model: String,
    pub prompt: Option<String>,
    pub tokens: Vec<i64>,
    pub reference: String,
    /// `--reference trace:PATH`: the stored trace judged against (null: a producer ran).
    pub reference_trace: Option<ReferenceTrace>,
    pub candidate: String,
    /// How it judged and why (the first line of the text verdict).
    pub judge: Judge,
    pub capture: Capture,
    pub layers_total: usize,
    /// Whether the candidate's decisions were forced from the reference's (null: they agreed).
    pub decisions_forced: Option<DecisionsForced>,
    pub whole_run: WholeRun,
    /// `--timeout`: seconds each producer run may take.
    pub timeout_s: u64,
    pub first_wrong_layer: Option<usize>,
    pub stage: Option<Stage>,
    pub layers: Vec<LayerRow>,
    /// Geometric mean growth of the whole-run hidden_out rel L2 per layer, over differing layers.
    pub amplification_per_layer: Option<f64>,
    pub calibration: Option<Calibration>,
    /// `--generate N`: the decode steps (decode/); null without it.
    pub decode: Option<decode::DecodeReport>,
    /// `--generate N` on a block-diffusion model: the passes after the prompt (diffusion/);
    /// null otherwise.
    pub diffusion: Option<diffusion::DiffusionReport>,
    /// Judged by bits with a calibrated blamed layer: whether its difference is rounding level.
    pub rounding_level: Option<RoundingLevel>,
    /// Judged by policy with layers isolated: null when judged by bits.
    pub rounding_response: Option<RoundingResponse>,
    pub self_consistency: SelfConsistency,
    pub outliers: Outliers,
    pub work_dir: String,
    pub runs: Vec<RunRecord>,
    pub gate_invocation: Vec<String>,
    /// The policy that judged (None: by bits); not in the report (`judge` names it), kept for
    /// a capsule's policy.json (capsule/).
    #[serde(skip)]
    pub policy: Option<tracegate_diff::Policy>,
    /// `--ranks N`: the candidate's rank traces merged (or refused), where the first divergence
    /// is and which rank holds it, and which layer verb isolated (sharded.rs); null without it.
    pub sharded: Option<sharded::Sharded>,
}
