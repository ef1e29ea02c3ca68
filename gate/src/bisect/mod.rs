//! `gate bisect`: find the first layer whose *body* is wrong, not just the first layer whose
//! output differs. Both producers write whole traces; then the candidate's `layer` verb runs
//! each layer alone on the **reference's** input to that layer, so a layer that matches in
//! isolation but differs in the whole run has inherited its difference from upstream. Within the
//! first wrong layer the capture points name the first wrong sub-stage. `--calibrate` chains the
//! reference's own layer verb over a 1-ULP perturbation of its input, to say how large the
//! candidate's difference is next to rounding noise. Before a layer body is blamed, the
//! candidate's layer verb is checked against its own whole run (`inconsistent_producer`). How it
//! judges, the rounding-level reading and the outlier flag: bisect_judge.rs. Report schema:
//! docs/bisect.md, docs/bisect-report.schema.json.
//!
//! `run` (this file) drives the phases: whole.rs the whole runs (run, judge, force decisions,
//! locate), layers.rs the per-layer phases, isolate.rs layer isolation and self-consistency,
//! calibrate.rs `--calibrate`, verdict.rs the verdict; report.rs holds the report types and
//! render.rs the text output.

use std::path::{Path, PathBuf};

use serde::Serialize;
use serde_json::json;
use tracegate_diff::{
    compare, string_enum, FindingKind, Label, Options, Policy, Report, RowStatus, Verdict,
};
use tracegate_trace::names::{self, Name};
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

use crate::bisect_judge::{self as judge, Ask, By, Judge, Outliers, RoundingLevel};
use crate::{gerr, Result};
use tracegate_producers::{Producer, RunRecord, Verb};

mod calibrate;
mod isolate;
mod layers;
mod render;
mod report;
mod stored;
mod verdict;
mod whole;
mod work;

pub use calibrate::*;
pub(crate) use isolate::*;
pub use render::*;
pub use report::*;
pub use stored::*;
pub(crate) use verdict::*;
pub(crate) use work::run_fresh;
pub use work::MARKER as WORK_MARKER;

/// The report's format (docs/bisect.md, docs/bisect-report.schema.json).
pub const SCHEMA: &str = "tracegate-bisect/4";

#[derive(Clone, Debug)]
pub struct BisectOptions {
    pub root: PathBuf,
    pub model: String,
    pub tokens: Vec<i64>,
    pub prompt: Option<String>,
    /// A producer run now, or a trace recorded before (`--reference trace:PATH`, stored.rs).
    pub reference: Reference,
    pub candidate: Producer,
    /// Judge by this policy (`--policy`); None: see `exact`.
    pub policy: Option<String>,
    /// `--exact`: judge by bits. Neither: by bits for two ordered producers, else by the bundled
    /// policy for the candidate's precision (bisect_judge.rs).
    pub exact: bool,
    /// `--precision`: the candidate's precision, over its declaration and its dtype.
    pub precision: Option<&'static str>,
    pub all_layers: bool,
    pub internals: bool,
    pub calibrate: bool,
    pub seed: u64,
    /// `--generate N`: decode steps in the whole runs, bisected after the prefill (bisect_decode.rs).
    pub generate: usize,
    /// Where the traces go, relative to root; kept for inspection.
    pub work: String,
    /// Each producer run is killed after this long, and the bisection refused.
    pub timeout: std::time::Duration,
    pub gate_invocation: Vec<String>,
    /// `--allow-stack-mismatch`: two oracle stacks that differ (not only in dtype) are compared,
    /// each difference a `stack_mismatch_allowed` finding, as `trace-diff` does.
    pub allow_stack_mismatch: bool,
}

/// `engine|contract|oracle|cmd` plus an optional template into a producer; usage errors as values.
pub fn producer(
    root: &Path,
    kind: &str,
    template: Option<&str>,
    side: &str,
    threads: usize,
) -> Result<Producer> {
    let cmd =
        |name: &str, default: String| Ok(Producer::command(name, template.unwrap_or(&default))?);
    match (kind, template) {
        ("engine", None) => Ok(Producer::Engine { threads }),
        ("engine", Some(_)) => Err(gerr!("--{side}-cmd: the engine is built into the gate and takes no command; use --{side} cmd to run a command")),
        ("contract", _) => cmd("contract", tracegate_producers::default_contract_cmd(root)),
        ("oracle", _) => cmd("oracle", tracegate_producers::default_oracle_cmd(root)),
        ("cmd", Some(_)) => cmd(&format!("{side}-cmd"), String::new()),
        ("cmd", None) => Err(gerr!("--{side} cmd needs --{side}-cmd 'TEMPLATE' (e.g. 'my-engine {{verb}} {{args}}')")),
        (other, _) => Err(gerr!("--{side} {other:?}: expected engine, contract, oracle or cmd")),
    }
}

/// Whether a producer is one of the built-in ordered ones (docs/numerics.md): the engine, or the
/// contract run by its own command. A replaced command is the user's producer.
pub fn is_ordered(root: &Path, p: &Producer) -> bool {
    match p {
        Producer::Engine { .. } => true,
        Producer::Command { name, words, .. } => {
            name == "contract"
                && matches!(Producer::command("contract", &tracegate_producers::default_contract_cmd(root)), Ok(Producer::Command { words: w, .. }) if w == *words)
        }
    }
}

// ------------------------------------------------------------------------------------------
// Helpers

pub(crate) fn is_oracle(t: &Trace) -> bool {
    tracegate_diff::comparable::is_oracle(t.provenance())
}

/// Where a capture point sits: -1 embed, NN a layer, i64::MAX the head (final norm, logits, decode).
pub(crate) fn location(name: &str) -> i64 {
    if name.starts_with("embed.") {
        return -1;
    }
    let n = Name::parse(name);
    match (n.decode_step, n.layer) {
        (None, Some(l)) => l as i64,
        _ => i64::MAX,
    }
}

pub(crate) fn rows(rep: &Report) -> Vec<TensorCmp> {
    rep.per_tensor
        .iter()
        .map(|r| TensorCmp {
            tensor: r.tensor.clone(),
            status: CmpStatus::Row(r.status),
            differing_elements: r.differing_elements,
            total_elements: r.total_elements,
            max_ulp: r.max_ulp,
            rel_l2: r.rel_l2.map(|x| x.0),
            cosine: r.cosine.map(|x| x.0),
            scale_error: r.scale_error.map(|x| x.0),
            violations: r.violations.to_vec(),
        })
        // A common tensor of another dtype or shape gets no value row; it differs all the same.
        .chain(
            rep.findings
                .iter()
                .filter(|f| {
                    matches!(
                        f.kind,
                        FindingKind::DtypeMismatch | FindingKind::ShapeMismatch
                    )
                })
                .map(|f| TensorCmp {
                    tensor: f.tensor().unwrap_or_default().to_string(),
                    status: CmpStatus::Structure(f.kind),
                    differing_elements: None,
                    total_elements: 0,
                    max_ulp: None,
                    rel_l2: None,
                    cosine: None,
                    scale_error: None,
                    violations: Vec::new(),
                }),
        )
        .collect()
}

pub(crate) fn decisions(rep: &Report) -> Vec<DecisionCmp> {
    rep.decisions
        .results
        .iter()
        .map(|d| DecisionCmp {
            name: d.name.clone(),
            rows: d.rows,
            differing_rows: d.differing_rows,
            excused_rows: d.flips.iter().filter(|f| f.excused()).count() as u64,
        })
        .collect()
}

pub(crate) fn open(root: &Path, rel: &str) -> Result<Trace> {
    Trace::open(root.join(rel)).map_err(|e| gerr!(File: "{rel}: {e}"))
}

pub use tracegate_diff::thousands;

pub(crate) fn sci(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(0.0) => "0".into(),
        Some(v) => format!("{v:.2e}"),
    }
}

pub(crate) fn ulps(x: Option<u64>) -> String {
    x.map(thousands).unwrap_or_else(|| "-".into())
}

pub(crate) fn ratio(x: Option<f64>) -> String {
    match x {
        None => "-".into(),
        Some(v) if v >= 10.0 => format!("{}×", thousands(v.round() as u64)),
        Some(v) => format!("{v:.2}×"),
    }
}

/// "00-01", "03", or "00, 02" for a set of layers (sorted).
pub(crate) fn span(layers: &[usize]) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let mut j = i;
        while j + 1 < layers.len() && layers[j + 1] == layers[j] + 1 {
            j += 1;
        }
        parts.push(if i == j {
            format!("{:02}", layers[i])
        } else {
            format!("{:02}-{:02}", layers[i], layers[j])
        });
        i = j + 1;
    }
    parts.join(", ")
}

/// "layer 03 inherits" / "layers 03-04 inherit".
pub(crate) fn say(layers: &[usize], one: &str, many: &str) -> String {
    if layers.len() == 1 {
        format!("layer {} {one}", span(layers))
    } else {
        format!("layers {} {many}", span(layers))
    }
}

// ------------------------------------------------------------------------------------------
// The bisection

/// The bisection, phase by phase: the whole runs (whole.rs: run, judge, force decisions,
/// locate), the layers (layers.rs: isolate, self-check, statuses, calibrate, outliers), the
/// verdict (verdict.rs) and the decode steps (bisect_decode.rs). Every producer run is recorded
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
    // Never judge an earlier run's traces: only an empty directory or one bisect made is used,
    // and it is emptied of bisect's own traces under the lock (work.rs).
    let work_dir = o.root.join(&o.work);
    work::check(&work_dir)?;
    let _lock = crate::WorkLock::acquire(&work_dir)?;
    work::prepare(&work_dir)?;
    let _progress = crate::progress::start("bisect", 1);
    let mut runs = Vec::new();
    let whole = whole::whole_runs(o, &mut runs)?;
    let (judge, policy, ordered) = whole::choose_judge(o, &whole)?;
    // The decode steps are bisected after the prefill, step by step (bisect_decode.rs).
    let opts = Options {
        all: true,
        policy: policy.clone(),
        filter: crate::bisect_decode::prefill_filter(o.generate),
        allow_stack_mismatch: o.allow_stack_mismatch,
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
    let self_consistency = self_check(o, &own, &own_rel, &mut layers, &policy, forced, &mut runs);
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
    let outliers = layers::outliers(reference, &mut layers);
    let amplification = layers::amplification(&layers);

    let said = match &self_consistency.inconsistent {
        // The first layer whose verbs disagree comes before any layer blamed: nothing is blamed.
        Some(i) if first_wrong.is_none_or(|w| i.layer < w) => {
            inconsistent_verdict(i, &layers, &located.whole_run)
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
    let (decode, (verdict, summary)) = if o.generate > 0 {
        let ctx = crate::bisect_decode::Context {
            reference,
            candidate: &whole.candidate,
            policy: &policy,
            layers: n,
            allow_stack_mismatch: o.allow_stack_mismatch,
        };
        let (d, v) = crate::bisect_decode::run(o, &ctx, &mut runs, (verdict, summary));
        refuse_timeout(&runs, o)?;
        (Some(d), v)
    } else {
        (None, (verdict, summary))
    };
    Ok(BisectReport {
        schema: SCHEMA,
        summary,
        verdict,
        exit_code: verdict.exit_code(),
        model: o.model.clone(),
        prompt: o.prompt.clone(),
        tokens: o.tokens.clone(),
        reference: o.reference.name(),
        reference_trace: match &o.reference {
            Reference::Stored(s) => Some(ReferenceTrace {
                path: s.shown.clone(),
                digest: s.digest.clone(),
                producer: s.producer.clone(),
            }),
            Reference::Run(_) => None,
        },
        candidate: o.candidate.name(),
        judge,
        capture: if o.internals {
            Capture::Internals
        } else {
            Capture::Default
        },
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
        rounding_level,
        rounding_response,
        self_consistency,
        outliers,
        work_dir: o.work.clone(),
        runs,
        gate_invocation: o.gate_invocation.clone(),
    })
}

#[cfg(test)]
mod tests {
    /// Before `names`, `location` read two digits: `layer.100.*` sat at layer 10.
    #[test]
    fn location_reads_every_digit_of_the_layer() {
        assert_eq!(super::location("layer.100.mlp_out"), 100);
        assert_eq!(super::location("layer.07.q"), 7);
        assert_eq!(super::location("embed.out"), -1);
        assert_eq!(super::location("logits"), i64::MAX);
        assert_eq!(super::location("decode.0001.layer.03.q"), i64::MAX);
    }
}
