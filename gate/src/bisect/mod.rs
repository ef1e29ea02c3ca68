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
//! `run` (this file) drives the phases; report.rs holds the report types, isolate.rs layer
//! isolation and self-consistency, calibrate.rs `--calibrate`, verdict.rs the verdict and
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
use crate::producer::{Producer, RunRecord, Verb};
use crate::{gerr, Result};

mod calibrate;
mod isolate;
mod render;
mod report;
mod verdict;

pub use calibrate::*;
pub(crate) use isolate::*;
pub use render::*;
pub use report::*;
pub(crate) use verdict::*;

/// The report's format (docs/bisect.md, docs/bisect-report.schema.json).
pub const SCHEMA: &str = "tracegate-bisect/3";

#[derive(Clone, Debug)]
pub struct BisectOptions {
    pub root: PathBuf,
    pub model: String,
    pub tokens: Vec<i64>,
    pub prompt: Option<String>,
    pub reference: Producer,
    pub candidate: Producer,
    /// Judge by this policy (`--policy`); None: see `exact`.
    pub policy: Option<String>,
    /// `--exact`: judge by bits. Neither: by bits for two ordered producers, else by the bundled
    /// policy for the candidate's precision (bisect_judge.rs).
    pub exact: bool,
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
}

/// `engine|contract|oracle|cmd` plus an optional template into a producer; usage errors as values.
pub fn producer(
    root: &Path,
    kind: &str,
    template: Option<&str>,
    side: &str,
    threads: usize,
) -> Result<Producer> {
    let cmd = |name: &str, default: String| Producer::command(name, template.unwrap_or(&default));
    match (kind, template) {
        ("engine", None) => Ok(Producer::Engine { threads }),
        ("engine", Some(_)) => Err(gerr!("--{side}-cmd: the engine is built into the gate and takes no command; use --{side} cmd to run a command")),
        ("contract", _) => cmd("contract", crate::run::default_contract_cmd(root)),
        ("oracle", _) => cmd("oracle", crate::run::default_oracle_cmd(root)),
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
                && matches!(Producer::command("contract", &crate::run::default_contract_cmd(root)), Ok(Producer::Command { words: w, .. }) if w == *words)
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
    Trace::open(root.join(rel)).map_err(|e| gerr!("{rel}: {e}"))
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

pub fn run(o: &BisectOptions) -> Result<BisectReport> {
    crate::prompts::check_fits(
        &o.root,
        &o.model,
        o.prompt.as_deref(),
        o.tokens.len(),
        o.generate,
    )?;
    let _lock = crate::WorkLock::acquire(&o.root.join(&o.work))?;
    let _progress = crate::progress::start("bisect", 1);
    let ref_rel = format!("{}/reference.trace", o.work);
    let cand_rel = format!("{}/candidate.trace", o.work);
    let trace = |p: &Producer, out: &str, force: Option<String>| {
        p.run(
            &o.root,
            &Verb::Trace {
                model: o.model.clone(),
                tokens: o.tokens.clone(),
                out: out.into(),
                internals: o.internals,
                generate: o.generate,
                cache: true,
                force,
            },
            o.timeout,
        )
    };
    // Both whole runs at once: one is usually a subprocess.
    let (rr, cr) = std::thread::scope(|s| {
        let h = s.spawn(|| trace(&o.candidate, &cand_rel, None));
        (
            trace(&o.reference, &ref_rel, None),
            h.join().expect("candidate thread"),
        )
    });
    let mut runs = vec![rr.clone(), cr.clone()];
    crate::progress::step("whole runs of the reference and the candidate");
    for (side, rec) in [("reference", &rr), ("candidate", &cr)] {
        if !rec.ok {
            return Err(gerr!(
                "{side} ({}) trace failed: {}\n    $ {}",
                rec.producer,
                rec.why(),
                rec.invocation
            ));
        }
    }
    let reference = open(&o.root, &ref_rel)?;
    let candidate = open(&o.root, &cand_rel)?;

    // By bits for two ordered producers, else by the policy for the candidate's precision,
    // unless --exact or --policy says otherwise. An oracle's provenance is never ordered.
    let ask = match (o.exact, &o.policy) {
        (true, Some(p)) => {
            return Err(gerr!(
                "--exact judges by bits and --policy {p} by a policy: give one"
            ))
        }
        (true, None) => Ask::Exact,
        (false, Some(p)) => Ask::Policy(p.clone()),
        (false, None) => Ask::Default,
    };
    let ordered = (
        is_ordered(&o.root, &o.reference) && !is_oracle(&reference),
        is_ordered(&o.root, &o.candidate) && !is_oracle(&candidate),
    );
    let (judge, policy) = judge::choose(
        &ask,
        (&o.reference.name(), &o.candidate.name()),
        ordered,
        &candidate,
        &o.root,
    )?;

    // The decode steps are bisected after the prefill, step by step (bisect_decode.rs).
    let opts = Options {
        all: true,
        policy: policy.clone(),
        filter: crate::bisect_decode::prefill_filter(o.generate),
        ..Options::default()
    };
    let mut whole = compare_whole(&reference, &candidate, &opts)?;
    // A decision differs no later than the first differing tensor (by layer), so it may be what
    // makes the numbers differ: compare them past the flips, on the candidate forced to take the
    // reference's decisions (docs/producers.md). A flip after the numbers already diverged is
    // their consequence and changes nothing upstream. A candidate that cannot be forced is said so.
    let first_tensor = rows(&whole)
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| location(&t.tensor))
        .min();
    let first_flip = whole
        .decisions
        .results
        .iter()
        .filter(|d| d.differing_rows > 0)
        .map(|d| location(&d.name))
        .min();
    let decisions_forced = if first_flip.is_some_and(|f| first_tensor.is_none_or(|t| f <= t)) {
        let unforced = whole
            .decisions
            .results
            .iter()
            .filter(|d| d.differing_rows > 0)
            .map(|d| {
                let mut labels = std::collections::BTreeMap::new();
                for f in &d.flips {
                    *labels.entry(f.label).or_insert(0) += 1;
                }
                UnforcedDecision {
                    name: d.name.clone(),
                    rows: d.rows,
                    differing_rows: d.differing_rows,
                    labels,
                }
            })
            .collect();
        let forced_rel = format!("{}/candidate.forced.trace", o.work);
        let rec = trace(&o.candidate, &forced_rel, Some(ref_rel.clone()));
        runs.push(rec.clone());
        crate::progress::step("candidate traced with the reference's decisions forced");
        refuse_timeout(&runs, o)?;
        let mut f = DecisionsForced {
            status: Forcing::NotForced,
            reason: None,
            from: ref_rel.clone(),
            from_digest: reference.digest().hex(),
            candidate_trace: None,
            unforced,
            rows_overridden: None,
            overridden: None,
        };
        match forced_run(o, &reference, &rec, &forced_rel, &opts) {
            Ok((rep, t)) => {
                let prov = &t.provenance()["forced_decisions"];
                f.rows_overridden = prov["rows_overridden"].as_u64();
                f.overridden = Some(prov["overridden"].clone());
                f.status = Forcing::Forced;
                f.candidate_trace = Some(forced_rel);
                whole = rep;
            }
            Err(why) => f.reason = Some(why),
        }
        Some(f)
    } else {
        None
    };
    let forced = decisions_forced
        .as_ref()
        .is_some_and(|f| f.status == Forcing::Forced);
    let whole_rows = rows(&whole);
    let whole_decisions = decisions(&whole);
    let n = reference
        .tensors()
        .iter()
        .filter_map(|t| {
            let n = Name::parse(&t.name);
            (n.decode_step.is_none() && n.point == "hidden_out").then_some(n.layer?)
        })
        .map(|l| l + 1)
        .max()
        .unwrap_or(0);

    // The first diverging place, in computation order (tensors in reference order, then decisions by location).
    let mut diverging: Vec<(i64, String, How)> = whole_rows
        .iter()
        .filter(|t| t.status.is_bad())
        .map(|t| (location(&t.tensor), t.tensor.clone(), How::Differs))
        .collect();
    diverging.extend(
        whole_decisions
            .iter()
            .filter(|d| d.judged_rows() > 0)
            .map(|d| (location(&d.name), d.name.clone(), How::Differs)),
    );
    // What the differ states as a finding rather than as values (a tensor or decision on one
    // side only, another order): divergence too, so the headline never calls runs matching while
    // the body lists their differences.
    let structure: Vec<&tracegate_diff::Finding> = whole
        .findings
        .iter()
        .filter(|f| is_structure(f.kind))
        .collect();
    // A decision whose values agree but whose margins do not diverges in value, not structure.
    // Forced decisions agree by construction, and their margins say where the candidate would
    // have decided otherwise: that is `decisions_forced`, not a place to bisect numbers from.
    let margins = whole
        .findings
        .iter()
        .filter(|f| f.kind == FindingKind::MarginDiffers && !forced);
    for f in structure.iter().copied().chain(margins) {
        if let Some(t) = f
            .tensor()
            .filter(|t| !diverging.iter().any(|(_, name, _)| name == t))
        {
            diverging.push((location(t), t.to_string(), How::Finding(f.kind)));
        }
    }
    let first = diverging.iter().min_by_key(|(loc, _, _)| *loc).cloned();
    let first_layer = first
        .as_ref()
        .and_then(|(loc, _, _)| (0..n as i64).contains(loc).then_some(*loc as usize));
    let whole_run = WholeRun {
        verdict: whole.verdict,
        first_diverging: first.as_ref().map(|(_, n, _)| n.clone()),
        first_diverging_how: first.as_ref().map(|(_, _, how)| *how),
        first_diverging_layer: first_layer,
        first_violation: whole.first_violation(),
        first_bit_difference: whole.first_divergence.as_ref().map(|d| FirstBitDifference {
            tensor: d.tensor.clone(),
            coords: d.coords.clone(),
            reference_value: d.reference_value.clone(),
            candidate_value: d.candidate_value.clone(),
            ulp: d.ulp,
            differing_elements: d.differing_elements,
            total_elements: d.total_elements,
        }),
        differing_decisions: whole_decisions
            .iter()
            .filter(|d| d.differing_rows > 0)
            .cloned()
            .collect(),
        findings: whole
            .findings
            .iter()
            .filter(|f| {
                !matches!(
                    f.kind,
                    FindingKind::ValuesDiffer
                        | FindingKind::OutsidePolicy
                        | FindingKind::DecisionDiffers
                )
            })
            .map(describe)
            .collect(),
    };
    let structure = summarise(&structure);

    // Isolation: layers up to and including the first diverging one, or all of them.
    let isolate_upto = if o.all_layers {
        n
    } else {
        first_layer.map_or(0, |l| l + 1)
    };
    let mut layers: Vec<LayerRow> = (0..n)
        .map(|l| {
            let pfx = names::layer_prefix(l);
            let differs = diverging.iter().any(|(_, name, _)| name.starts_with(&pfx));
            let h = whole_rows
                .iter()
                .find(|t| t.tensor == names::layer(l, "hidden_out"));
            layer_row(l, differs, h)
        })
        .collect();
    let mut failed: Option<(usize, String)> = None;
    crate::progress::plan(isolate_upto as u64);
    for (l, row) in layers.iter_mut().enumerate().take(isolate_upto) {
        if let Some((at, _)) = &failed {
            row.isolation = Isolated::NotChecked;
            row.reason = Some(format!(
                "not attempted: the candidate's layer verb failed on layer {at:02}"
            ));
            continue;
        }
        let src = Source {
            trace: &reference,
            rel: &ref_rel,
            whose: "the reference's",
            out_stem: "candidate.layer",
            slice_stem: "reference.layer",
        };
        match isolate(o, &src, l, &policy, forced, &mut runs) {
            Ok(iso) => fill_isolated(row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.reason = Some(why.clone());
                failed = Some((l, why));
            }
        }
        crate::progress::step(format_args!("layer {l:02} in isolation: {}", row.isolation));
    }
    refuse_timeout(&runs, o)?;
    // Before a layer body is blamed: does the candidate's layer verb agree with its own whole run?
    let own_rel = decisions_forced
        .as_ref()
        .and_then(|f| f.candidate_trace.clone())
        .unwrap_or_else(|| cand_rel.clone());
    let own = open(&o.root, &own_rel)?;
    let self_consistency = self_check(o, &own, &own_rel, &mut layers, &policy, forced, &mut runs);
    refuse_timeout(&runs, o)?;
    for row in &mut layers {
        row.status = if row.self_check == SelfCheck::Inconsistent {
            LayerStatus::Inconsistent
        } else {
            layer_status(row.isolation, row.whole_run)
        };
    }
    let first_wrong = layers
        .iter()
        .find(|r| r.status == LayerStatus::Wrong)
        .map(|r| r.layer);
    let stage =
        first_wrong.map(|l| stage(l, &layers[l], is_moe(&reference, l), "differs in isolation"));

    // Calibration: from the first wrong layer, else the first diverging one, else layer 0. Judged
    // by bits, a layer about to be blamed in a pair that is not two ordered producers gets it
    // without --calibrate, for that one layer: is its difference rounding?
    let auto = judge.by == By::Bits && !(ordered.0 && ordered.1) && !o.calibrate;
    let calibration = match first_wrong {
        Some(l) if auto => Some(calibrate(o, &reference, l, l + 1, &mut runs)),
        _ => (o.calibrate && n > 0).then(|| {
            calibrate(
                o,
                &reference,
                first_wrong.or(first_layer).unwrap_or(0),
                n,
                &mut runs,
            )
        }),
    };
    if let Some(cal) = &calibration {
        for c in &cal.rows {
            let row = &mut layers[c.layer];
            row.calibration_rel_l2 = c.rel_l2;
            let over = |x: Option<f64>| match (x, c.rel_l2) {
                (Some(a), Some(b)) if b > 0.0 => Some(a / b),
                _ => None,
            };
            row.whole_vs_calibration = over(row.whole_rel_l2);
            if c.layer == cal.from_layer {
                row.isolated_vs_calibration = over(row.isolated_rel_l2);
            }
        }
    }

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

    // Outliers within the policy: the matching isolated layers' errors against their peers'.
    let errors: Vec<judge::LayerErrors> = layers
        .iter()
        .filter(|r| r.isolation == Isolated::Match && r.status != LayerStatus::Inconsistent)
        .map(|r| {
            let rel = |t: &str| {
                r.isolated
                    .iter()
                    .find(|x| x.tensor == names::layer(r.layer, t))
                    .and_then(|x| x.rel_l2)
            };
            (
                r.layer,
                rel("attn_out"),
                if is_moe(&reference, r.layer) {
                    None
                } else {
                    rel("mlp_out")
                },
            )
        })
        .collect();
    let (outliers, per) = judge::outliers(&errors);
    for (l, ratio, flagged) in per {
        (layers[l].peer_ratio, layers[l].suspicious) = (ratio, flagged);
    }

    // Amplification: geometric-mean growth of the whole-run error over consecutive differing layers.
    let errs: Vec<f64> = layers
        .iter()
        .filter_map(|r| r.whole_rel_l2)
        .filter(|&e| e > 0.0)
        .collect();
    let amplification = (errs.len() >= 2)
        .then(|| (errs[errs.len() - 1] / errs[0]).powf(1.0 / (errs.len() - 1) as f64));

    let (verdict, summary) = match &self_consistency.inconsistent {
        // The first layer whose verbs disagree comes before any layer blamed: nothing is blamed.
        Some(i) if first_wrong.is_none_or(|w| i.layer < w) => {
            inconsistent_verdict(i, &layers, &whole_run)
        }
        _ => verdict(
            &layers,
            first_wrong,
            &stage,
            &first,
            n,
            &whole_run,
            &structure,
            amplification,
            &failed,
        ),
    };
    let (verdict, mut summary) = match &decisions_forced {
        Some(f) => with_forcing(f, (verdict, summary)),
        None => (verdict, summary),
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
    let (decode, (verdict, summary)) = if o.generate > 0 {
        let ctx = crate::bisect_decode::Context {
            reference: &reference,
            candidate: &candidate,
            policy: &policy,
            layers: n,
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
        candidate: o.candidate.name(),
        judge,
        capture: if o.internals {
            Capture::Internals
        } else {
            Capture::Default
        },
        layers_total: n,
        decisions_forced,
        whole_run,
        timeout_s: o.timeout.as_secs(),
        first_wrong_layer: first_wrong,
        stage,
        layers,
        amplification_per_layer: amplification,
        calibration,
        decode,
        rounding_level,
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
