//! `gate bisect --generate N`: the decode path (docs/bisect.md, "Decode"). The whole runs were
//! made with `--generate N --cache on --capture internals`; once their prefill agrees, the
//! decode steps (`decode.SSSS.*` tensors and decisions, docs/producers.md) are compared in order
//! to name the first diverging step s. Then the candidate's own `--cache off` run is compared
//! with its cached run: a difference at or before s means its cached decode path disagrees with
//! the full recompute. Last, each layer is isolated at step s: the candidate's
//! `layer --decode-from P` (P = n+s−1) runs on the reference's rows of that layer's input at
//! positions 0..P, and its one decode row is compared with the reference's step-s tensors.

use serde::Serialize;
use serde_json::json;
use tracegate_diff::{compare, string_enum, Filter, FindingKind, Options, Policy, Verdict};
use tracegate_trace::names::{self, Name};
use tracegate_trace::{Attributes, Trace, TraceWriter};

use crate::bisect::{
    self as b, BisectOptions, BisectVerdict, DecisionCmp, How, Isolated, LayerRow, LayerStatus,
    Said, Stage, TensorCmp, WholeRunState,
};
use crate::producer::{RunRecord, Verb};
use crate::{gerr, Result};

/// The exit code of `cached_decode_differs` (docs/bisect.md, "Exit codes").
pub const CACHED_DECODE_EXIT: i32 = 6;

/// The capture points of a decode step's layer, in computation order.
const BODY: [&str; 4] = ["hidden_in", "attn_out", "mlp_out", "hidden_out"];

string_enum! {
    /// The candidate's cached decode against its own full recompute.
    pub enum CacheStatus {
        /// No difference at or before the diverging step.
        Agrees = "agrees",
        Disagrees = "disagrees",
        NotChecked = "not_checked",
    }
}

string_enum! {
    /// Whether the decode steps were compared.
    pub enum DecodeStatus {
        Compared = "compared",
        /// The prefill verdict wins (`reason`).
        NotCompared = "not_compared",
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct CacheCheck {
    pub status: CacheStatus,
    /// The candidate's `--cache off` trace.
    pub trace: Option<String>,
    /// The first difference between the candidate's cached and uncached decode steps.
    pub first_step: Option<usize>,
    pub first_tensor: Option<String>,
    pub detail: Option<String>,
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    /// `--generate N`: decode steps in each whole run.
    pub generate: usize,
    pub status: DecodeStatus,
    pub reason: Option<String>,
    /// Steps compared, 0.. in order: up to and including the first diverging one.
    pub steps_compared: usize,
    pub first_diverging_step: Option<usize>,
    /// Its absolute position, n+s−1.
    pub position: Option<i64>,
    /// The first tensor or decision of that step that differs (or is outside the policy, or on
    /// one side only), and how.
    pub first_diverging: Option<String>,
    pub first_diverging_how: Option<How>,
    /// The step's differing tensors and decision.
    pub step_tensors: Vec<TensorCmp>,
    pub step_decisions: Vec<DecisionCmp>,
    /// Null when no step diverged (nothing to check).
    pub cache_check: Option<CacheCheck>,
    /// Layers isolated at the diverging step (`layer --decode-from P`), as the prefill's table:
    /// `whole_*` from `decode.SSSS.layer.LL.hidden_out`, `isolated_*` the candidate's decode row.
    pub layers: Vec<LayerRow>,
    pub first_wrong_layer: Option<usize>,
    pub stage: Option<Stage>,
    /// Why the isolation at that step did not run or did not finish.
    pub isolation_not_checked: Option<String>,
}

impl DecodeReport {
    fn new(generate: usize) -> DecodeReport {
        DecodeReport {
            generate,
            status: DecodeStatus::Compared,
            reason: None,
            steps_compared: 0,
            first_diverging_step: None,
            position: None,
            first_diverging: None,
            first_diverging_how: None,
            step_tensors: vec![],
            step_decisions: vec![],
            cache_check: None,
            layers: vec![],
            first_wrong_layer: None,
            stage: None,
            isolation_not_checked: None,
        }
    }
}

/// What the prefill bisection hands over.
pub struct Context<'a> {
    pub reference: &'a Trace,
    pub candidate: &'a Trace,
    pub policy: &'a Option<Policy>,
    /// Decoder layers.
    pub layers: usize,
}

/// The whole runs' comparison leaves the decode steps to this module.
pub fn prefill_filter(generate: usize) -> Filter {
    Filter {
        only: vec![],
        skip: if generate > 0 {
            vec!["decode.**".into()]
        } else {
            vec![]
        },
    }
}

/// Options comparing only the decode steps, judged by `policy` (the whole runs' judge).
fn decode_only(policy: &Option<Policy>) -> Options {
    Options {
        all: true,
        policy: policy.clone(),
        filter: Filter {
            only: vec!["decode.**".into()],
            skip: vec![],
        },
        ..Options::default()
    }
}

/// The step of a `decode.SSSS.…` name (every digit: a step past 9999 has more than four).
fn step_of(name: &str) -> Option<usize> {
    Name::parse(name).decode_step
}

/// The decode bisection, after the prefill's verdict: returns the decode report and the verdict
/// (the prefill's when it is not `nothing_wrong`: a prefill verdict wins).
pub fn run(
    o: &BisectOptions,
    c: &Context,
    runs: &mut Vec<RunRecord>,
    prefill: Said,
) -> (DecodeReport, Said) {
    let mut d = DecodeReport::new(o.generate);
    if prefill.0 != BisectVerdict::NothingWrong {
        d.status = DecodeStatus::NotCompared;
        d.reason = Some(format!(
            "the prefill verdict ({}) wins; decode steps are compared only when the prefill agrees",
            prefill.0
        ));
        return (d, prefill);
    }
    let n = o.tokens.len() as i64;
    let opts = decode_only(c.policy);
    let rep = compare(c.reference, c.candidate, &opts);
    let tensors = b::rows(&rep);
    let decisions = b::decisions(&rep);
    // A side that captured no decode tensors (a producer older than the decode capture) leaves
    // the steps' numbers unchecked, whatever its decisions say.
    for (side, t) in [("reference", c.reference), ("candidate", c.candidate)] {
        if t.tensor_info(&names::decode(0, "logits")).is_none() {
            let why = format!("the {side}'s trace has no {} (its trace verb does not capture decode steps, docs/producers.md)", names::decode(0, "logits"));
            d.status = DecodeStatus::NotCompared;
            d.reason = Some(why.clone());
            return (
                d,
                (
                    BisectVerdict::NotChecked,
                    format!(
                        "decode steps NOT CHECKED: {why}; the prefill: {}",
                        prefill.1
                    ),
                ),
            );
        }
    }
    // Per step, in computation order: its tensors in the reference's order, then its decision;
    // what the differ states as a finding (a tensor or decision on one side only) counts too.
    let structure: Vec<(&str, FindingKind)> = rep
        .findings
        .iter()
        .filter(|f| {
            matches!(
                f.kind,
                FindingKind::MissingTensor
                    | FindingKind::ExtraTensor
                    | FindingKind::MissingDecision
                    | FindingKind::ExtraDecision
            )
        })
        .filter_map(|f| f.tensor().map(|t| (t, f.kind)))
        .collect();
    let mut first: Option<(usize, String, How)> = None;
    let mut step_all: Vec<TensorCmp> = Vec::new();
    let mut stop_after: Option<(usize, String)> = None;
    for s in 0..o.generate {
        d.steps_compared = s + 1;
        let mine = |name: &str| step_of(name) == Some(s);
        let bad_tensor = tensors
            .iter()
            .find(|t| mine(&t.tensor) && t.status.is_bad())
            .map(|t| (t.tensor.clone(), How::Differs));
        let bad_structure = structure
            .iter()
            .find(|(t, _)| mine(t))
            .map(|(t, k)| (t.to_string(), How::Finding(*k)));
        let dec = decisions.iter().find(|x| mine(&x.name));
        let bad_decision = dec
            .filter(|x| x.judged_rows() > 0)
            .map(|x| (x.name.clone(), How::Differs));
        if let Some((name, how)) = bad_tensor.or(bad_structure).or(bad_decision) {
            step_all = tensors
                .iter()
                .filter(|t| mine(&t.tensor))
                .cloned()
                .collect();
            d.step_tensors = step_all
                .iter()
                .filter(|t| t.status.is_bad())
                .cloned()
                .collect();
            d.step_decisions = decisions
                .iter()
                .filter(|x| mine(&x.name) && x.differing_rows > 0)
                .cloned()
                .collect();
            first = Some((s, name, how));
            break;
        }
        // A flip a policy excuses (a near-tie) feeds the runs different tokens: later steps are
        // not comparable.
        if let Some(x) = dec.filter(|x| x.differing_rows > 0) {
            stop_after = Some((s, x.name.clone()));
            break;
        }
    }
    crate::progress::step(format_args!(
        "decode: {} of {} steps compared",
        d.steps_compared, o.generate
    ));
    let Some((s, name, how)) = first else {
        let steps = if d.steps_compared == 1 {
            "step 0".to_string()
        } else {
            format!("steps 0-{}", d.steps_compared - 1)
        };
        let how = if rep.verdict == Verdict::WithinPolicy {
            "within policy"
        } else {
            "identical"
        };
        let tail = match &stop_after {
            Some((at, dec)) => format!("; {dec} is a near-tie the policy excuses, so the steps after {at} (other tokens) are not compared"),
            None => String::new(),
        };
        let summary = format!(
            "{}; decode {steps} {how} ({} of {} steps compared){tail}",
            prefill.1, d.steps_compared, o.generate
        );
        return (d, (BisectVerdict::NothingWrong, summary));
    };
    let p = n + s as i64 - 1;
    d.first_diverging_step = Some(s);
    d.position = Some(p);
    d.first_diverging = Some(name.clone());
    d.first_diverging_how = Some(how);

    let cache = cache_check(o, c, s, runs);
    let cache_says = match (cache.status, &cache.first_tensor, cache.first_step) {
        (CacheStatus::Disagrees, Some(t), Some(at)) => Some(format!(
            "the cached decode path disagrees with the full recompute from step {at}: first {t}{} (the candidate's --cache on vs --cache off)",
            cache.detail.as_ref().map(|x| format!(" ({x})")).unwrap_or_default()
        )),
        _ => None,
    };
    let cache_note = match cache.status {
        CacheStatus::Agrees => {
            "the candidate's cached decode agrees with its full recompute through this step"
                .to_string()
        }
        CacheStatus::NotChecked => format!(
            "cache self-check NOT CHECKED: {}",
            cache.reason.as_deref().unwrap_or("")
        ),
        CacheStatus::Disagrees => String::new(),
    };
    d.cache_check = Some(cache);

    let how_said = match how {
        How::Differs => String::new(),
        How::Finding(k) => format!(" ({})", k.as_str().replace('_', " ")),
    };
    let head = format!("decode step {s} (position {p}) first diverges at {name}{how_said}");
    let before = match s {
        0 => "the prefill matches".to_string(),
        1 => "the prefill and step 0 match".to_string(),
        _ => format!("the prefill and steps 0-{} match", s - 1),
    };
    // Step 0 runs no forward: its logits are the prompt's last row, which the prefill compared.
    if s == 0 {
        let v = cache_says.map(|c| (BisectVerdict::CachedDecodeDiffers, c)).unwrap_or((BisectVerdict::OutsideLayers, format!("{head}: step 0 is the prompt's last logits row, which matched in the prefill; the producer records another")));
        return (d, (v.0, format!("{}; {before}", v.1)));
    }
    isolate_step(o, c, s, p, &step_all, &mut d, runs);
    let iso = iso_words(&d, s);
    let (verdict, what) = match (&cache_says, d.first_wrong_layer, &d.isolation_not_checked) {
        (Some(cs), _, _) => (BisectVerdict::CachedDecodeDiffers, format!("{cs}; {iso}")),
        (None, Some(_), _) => (BisectVerdict::WrongLayer, format!("{head}; {iso}; {cache_note}")),
        (None, None, Some(_)) => (BisectVerdict::NotChecked, format!("{head}; {iso}; {cache_note}")),
        (None, None, None) if how != How::Differs => (BisectVerdict::StructureDiffers, format!("{head}; {iso}")),
        (None, None, None) if Name::parse(&name).point == "argmax" => {
            (BisectVerdict::DecisionsDiffer, format!("{head}: the step's numbers agree but the candidate decides otherwise; {iso}; {cache_note}"))
        }
        (None, None, None) if Name::parse(&name).layer.is_none() && d.layers.iter().all(|r| r.whole_run == WholeRunState::Match) => {
            (BisectVerdict::OutsideLayers, format!("{head}, after the last layer (the head, which the layer verb does not isolate); {iso}; {cache_note}"))
        }
        (None, None, None) => (BisectVerdict::Accumulates, format!("{head}; no layer's decode body is wrong in isolation; {iso}; {cache_note}")),
    };
    (
        d,
        (
            verdict,
            format!("{}; {before}", what.trim_end_matches("; ")),
        ),
    )
}

/// The isolation's outcome at step `s`, in words.
fn iso_words(d: &DecodeReport, s: usize) -> String {
    if let (Some(l), Some(st)) = (d.first_wrong_layer, &d.stage) {
        return format!(
            "in isolation at step {s} layer {l:02}'s decode body is wrong: {} [{}]",
            st.detail,
            st.block.words()
        );
    }
    if let Some(why) = &d.isolation_not_checked {
        return format!("isolation at step {s} NOT CHECKED: {why}");
    }
    let matched: Vec<usize> = d
        .layers
        .iter()
        .filter(|r| r.isolation == Isolated::Match)
        .map(|r| r.layer)
        .collect();
    if matched.is_empty() {
        format!("no layer isolated at step {s}")
    } else {
        format!(
            "at step {s} {}",
            b::say(&matched, "matches in isolation", "match in isolation")
        )
    }
}

/// The candidate's `--cache off` run against its own cached run, decode steps only, judged as
/// the whole runs are.
fn cache_check(o: &BisectOptions, c: &Context, s: usize, runs: &mut Vec<RunRecord>) -> CacheCheck {
    let rel = format!("{}/candidate.uncached.trace", o.work);
    let mut check = CacheCheck {
        status: CacheStatus::NotChecked,
        trace: None,
        first_step: None,
        first_tensor: None,
        detail: None,
        reason: None,
    };
    let verb = Verb::Trace {
        model: o.model.clone(),
        tokens: o.tokens.clone(),
        out: rel.clone(),
        internals: o.internals,
        generate: o.generate,
        cache: false,
        force: None,
    };
    let rec = o.candidate.run(&o.root, &verb, o.timeout);
    runs.push(rec.clone());
    crate::progress::step("decode: candidate traced with --cache off");
    if !rec.ok {
        check.reason = Some(format!(
            "the candidate's trace verb failed with --cache off: {}",
            rec.why()
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" | ")
        ));
        return check;
    }
    let uncached = match b::open(&o.root, &rel) {
        Ok(t) => t,
        Err(e) => {
            check.reason = Some(e.to_string());
            return check;
        }
    };
    check.trace = Some(rel);
    // The full recompute is the reference side: the cached path is what is being checked.
    let opts = decode_only(c.policy);
    let rep = compare(&uncached, c.candidate, &opts);
    let tensors = b::rows(&rep);
    let bad_t = tensors
        .iter()
        .filter(|t| t.status.is_bad())
        .filter_map(|t| step_of(&t.tensor).map(|s| (s, t)))
        .min_by_key(|(s, _)| *s);
    let bad_d = b::decisions(&rep)
        .into_iter()
        .filter(|x| x.judged_rows() > 0)
        .filter_map(|x| step_of(&x.name).map(|s| (s, x.name)))
        .min_by_key(|(s, _)| *s);
    let first = match (bad_t, bad_d) {
        (Some((st, t)), Some((sd, _))) if st <= sd => Some((st, t.tensor.clone(), Some(t))),
        (_, Some((sd, name))) => Some((sd, name, None)),
        (Some((st, t)), None) => Some((st, t.tensor.clone(), Some(t))),
        (None, None) => None,
    };
    match first {
        Some((at, name, t)) if at <= s => {
            check.status = CacheStatus::Disagrees;
            check.first_step = Some(at);
            check.first_tensor = Some(name);
            check.detail = t.map(|t| {
                format!(
                    "{}/{} elements, max {} ULP, rel L2 {}",
                    b::thousands(t.differing_elements.unwrap_or(0)),
                    b::thousands(t.total_elements),
                    b::ulps(t.max_ulp),
                    b::sci(t.rel_l2)
                )
            });
        }
        other => {
            check.status = CacheStatus::Agrees;
            // A later difference is a consequence of the step already diverging, not the cause.
            if let Some((at, name, _)) = other {
                check.first_step = Some(at);
                check.first_tensor = Some(name);
            }
        }
    }
    check
}

/// Writes the isolation inputs of step `s` from the reference: `decode.SSSS.input.trace`, per
/// layer `layer.LL.hidden_in` at positions 0..=P (the prefill's rows, then steps 1..=s), and
/// `decode.SSSS.reference.trace`, per layer the step's `layer.LL.*` row as the candidate's
/// `layer --decode-from P` writes it (one row at P, attribute `decode_from`).
fn write_step_inputs(
    o: &BisectOptions,
    c: &Context,
    s: usize,
    p: i64,
    input_rel: &str,
    view_rel: &str,
) -> Result<()> {
    let r = c.reference;
    let mut prov = r.provenance().clone();
    if let Some(x) = prov.as_object_mut() {
        x.insert(
            "bisect_decode_step".into(),
            json!({ "step": s, "position": p, "from": r.path().display().to_string() }),
        );
    }
    let create = |rel: &str| {
        TraceWriter::create(o.root.join(rel), prov.clone()).map_err(|e| gerr!(File: "{rel}: {e}"))
    };
    let (mut input, mut view) = (create(input_rel)?, create(view_rel)?);
    for l in 0..c.layers {
        let pre = names::layer(l, "hidden_in");
        let mut x = r
            .f32_slice(&pre)
            .map_err(|e| gerr!(File: "the reference's {pre}: {e}"))?
            .to_vec();
        let info = r
            .tensor_info(&pre)
            .ok_or_else(|| gerr!(Producer: "the reference has no {pre}"))?;
        let h = *info.shape.last().unwrap_or(&0);
        for t in 1..=s {
            let name = names::decode(t, &pre);
            x.extend_from_slice(
                r.f32_slice(&name)
                    .map_err(|e| gerr!(File: "the reference's {name}: {e}"))?,
            );
        }
        let attrs = Attributes {
            positions: Some((0..=p).collect()),
            ..info.attributes.clone()
        };
        input
            .tensor_f32(&pre, &[p as u64 + 1, h], &x, &attrs)
            .map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
        for point in BODY {
            let name = names::decode(s, &names::layer(l, point));
            let info = r
                .tensor_info(&name)
                .ok_or_else(|| gerr!(Producer: "the reference has no {name}"))?;
            let mut attrs = info.attributes.clone();
            attrs.extra.insert("decode_from".into(), p.to_string());
            let data = r
                .f32_slice(&name)
                .map_err(|e| gerr!(File: "the reference's {name}: {e}"))?;
            view.tensor_f32(&names::layer(l, point), &info.shape, data, &attrs)
                .map_err(|e| gerr!(File: "{view_rel}: {e}"))?;
        }
    }
    input
        .finish()
        .map_err(|e| gerr!(File: "{input_rel}: {e}"))?;
    view.finish().map_err(|e| gerr!(File: "{view_rel}: {e}"))?;
    Ok(())
}

/// Isolates layers at step `s` (up to the first diverging one, or all with `--all-layers`).
/// `step_all`: the whole runs' comparison of every tensor of step `s`.
fn isolate_step(
    o: &BisectOptions,
    c: &Context,
    s: usize,
    p: i64,
    step_all: &[TensorCmp],
    d: &mut DecodeReport,
    runs: &mut Vec<RunRecord>,
) {
    let input_rel = format!("{}/decode.{s:04}.input.trace", o.work);
    let view_rel = format!("{}/decode.{s:04}.reference.trace", o.work);
    if let Err(e) = write_step_inputs(o, c, s, p, &input_rel, &view_rel) {
        d.isolation_not_checked = Some(e.to_string());
        return;
    }
    let view = match b::open(&o.root, &view_rel) {
        Ok(t) => t,
        Err(e) => {
            d.isolation_not_checked = Some(e.to_string());
            return;
        }
    };
    let whole = |l: usize| {
        step_all
            .iter()
            .find(|t| t.tensor == names::decode(s, &names::layer(l, "hidden_out")))
            .cloned()
    };
    let differs = |l: usize| {
        d.step_tensors.iter().any(|t| {
            t.tensor
                .starts_with(&names::decode(s, &names::layer_prefix(l)))
        })
    };
    let first_layer = (0..c.layers).find(|&l| differs(l));
    let upto = if o.all_layers {
        c.layers
    } else {
        first_layer.map_or(0, |l| l + 1)
    };
    crate::progress::plan(upto as u64);
    for l in 0..upto {
        let h = whole(l);
        let mut row = b::layer_row(l, differs(l), h.as_ref());
        let run = b::LayerRun {
            verb: Verb::Layer {
                model: o.model.clone(),
                layer: l,
                input: input_rel.clone(),
                input_name: names::layer(l, "hidden_in"),
                out: format!("{}/decode.{s:04}.candidate.layer.{l:02}.trace", o.work),
                internals: o.internals,
                force: None,
                decode_from: Some(p),
            },
            layer: l,
            slice_rel: format!("{}/decode.{s:04}.reference.layer.{l:02}.trace", o.work),
            whose: "the reference's",
        };
        match b::isolate_with(o, &run, c.policy, runs, |cand, out| {
            b::write_slice(&view, cand, l, out)
        }) {
            Ok(iso) => b::fill_isolated(&mut row, iso),
            Err(why) => {
                row.isolation = Isolated::NotChecked;
                row.status = LayerStatus::NotChecked;
                let why = format!("{why} (--decode-from is part of the decode extension, docs/producers.md; a producer without it cannot be isolated at a decode step)");
                row.reason = Some(why.clone());
                d.isolation_not_checked = Some(format!("layer {l:02}: {why}"));
                crate::progress::step(format_args!("decode step {s}: layer {l:02} not checked"));
                d.layers.push(row);
                break;
            }
        }
        crate::progress::step(format_args!(
            "decode step {s}: layer {l:02} in isolation: {}",
            row.isolation
        ));
        d.layers.push(row);
    }
    for row in &mut d.layers {
        row.status = b::layer_status(row.isolation, row.whole_run);
    }
    d.first_wrong_layer = d
        .layers
        .iter()
        .find(|r| r.isolation == Isolated::Wrong)
        .map(|r| r.layer);
    d.stage = d.first_wrong_layer.map(|l| {
        b::stage(
            l,
            &d.layers[l],
            c.reference
                .decision_info(&names::layer(l, "router.topk"))
                .is_some(),
            "differs in isolation",
        )
    });
}

/// The decode part of the human output.
pub fn render(d: &DecodeReport) -> String {
    let mut o = String::new();
    if d.status != DecodeStatus::Compared {
        o.push_str(&format!(
            "\n  decode ({} steps): not compared: {}\n",
            d.generate,
            d.reason.as_deref().unwrap_or("")
        ));
        return o;
    }
    let first = match (d.first_diverging_step, &d.first_diverging) {
        (Some(s), Some(name)) => format!(
            "; first diverging step {s} (position {}) at {name}",
            d.position.unwrap_or(0)
        ),
        _ => "; no step diverges".into(),
    };
    o.push_str(&format!(
        "\n  decode ({} steps, cached): {} steps compared{first}\n",
        d.generate, d.steps_compared
    ));
    const SHOWN: usize = 6;
    if d.step_tensors.len() > SHOWN {
        o.push_str(&format!(
            "    ({} of the step's tensors differ; the first {SHOWN}:)\n",
            d.step_tensors.len()
        ));
    }
    for t in d.step_tensors.iter().take(SHOWN) {
        o.push_str(&format!(
            "    {:<36} {:<14} {:>9}/{:<9} max {} ULP, rel L2 {}\n",
            t.tensor,
            t.status,
            b::thousands(t.differing_elements.unwrap_or(0)),
            b::thousands(t.total_elements),
            b::ulps(t.max_ulp),
            b::sci(t.rel_l2)
        ));
    }
    for x in &d.step_decisions {
        o.push_str(&format!(
            "    decision {} differs in {}/{} rows\n",
            x.name, x.differing_rows, x.rows
        ));
    }
    if let Some(c) = &d.cache_check {
        let what = match c.status {
            CacheStatus::Disagrees => format!(
                "DISAGREES from step {} at {} ({})",
                c.first_step.unwrap_or(0),
                c.first_tensor.as_deref().unwrap_or(""),
                c.detail.as_deref().unwrap_or("")
            ),
            CacheStatus::Agrees => "agrees through the diverging step".to_string(),
            CacheStatus::NotChecked => {
                format!("NOT CHECKED: {}", c.reason.as_deref().unwrap_or(""))
            }
        };
        o.push_str(&format!(
            "  cache self-check (the candidate's --cache on vs --cache off): {what}\n"
        ));
    }
    if !d.layers.is_empty() {
        o.push_str(&format!(
            "  isolated at step {} (layer --decode-from {}):\n",
            d.first_diverging_step.unwrap_or(0),
            d.position.unwrap_or(0)
        ));
        o.push_str(&format!(
            "    {:<5} {:<11} {:<9} {:>12} {:>11} {:>12} {:>11}\n",
            "layer", "status", "step", "isol max ULP", "isol rel L2", "step max ULP", "step rel L2"
        ));
        for r in &d.layers {
            o.push_str(&format!(
                "    {:<5} {:<11} {:<9} {:>12} {:>11} {:>12} {:>11}\n",
                format!("{:02}", r.layer),
                r.status,
                r.whole_run,
                b::ulps(r.isolated_max_ulp),
                b::sci(r.isolated_rel_l2),
                b::ulps(r.whole_max_ulp),
                b::sci(r.whole_rel_l2)
            ));
        }
    }
    if let Some(st) = &d.stage {
        o.push_str(&format!(
            "  first wrong stage in layer {:02} at the decode step: {} — {}\n",
            st.layer,
            st.block.words(),
            st.detail
        ));
    }
    if let Some(why) = &d.isolation_not_checked {
        o.push_str(&format!("  decode isolation NOT CHECKED: {why}\n"));
    }
    o
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_step_is_every_digit_up_to_the_dot() {
        assert_eq!(super::step_of("decode.0003.logits"), Some(3));
        assert_eq!(
            super::step_of("decode.10000.layer.01.attn_out"),
            Some(10000)
        );
        assert_eq!(super::step_of("decode.x.logits"), None);
        assert_eq!(super::step_of("layer.01.attn_out"), None);
    }
}
