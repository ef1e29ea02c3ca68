//! `gate bisect --generate N` on a block-diffusion model (docs/bisect.md, "Block diffusion").
//! The prompt's encoder pass is bisected as any prefill (../prefill/); once it agrees, the
//! passes after it — per block its denoise steps, its commit, its commit pass — are compared in
//! run order (`tracegate_diff::passes`) to name the first diverging pass, and each layer of that
//! pass is isolated: the candidate's `layer` verb runs on the reference's `P.layer.LL.hidden_in`
//! with the keys of the reference's earlier encoder passes (the verb reads them from the same
//! trace, docs/producers.md), and its outputs are compared with the reference's `P.layer.LL.*`.
//!
//! Two producers with different generators (the engine's splitmix64 stream, torch's) differ at
//! the first draw by construction, not by a defect: the candidate is then traced again taking
//! the reference's draws and decisions (`--force-decisions`), and what it would itself have
//! decided otherwise is read from that trace's provenance.
//!
//! The parts: this file the driver and the verdict, report.rs the report, isolate.rs the layers
//! isolated at the pass, render.rs the text output.

use tracegate_diff::passes::{self, Sampler};
use tracegate_diff::{compare, FindingKind, Options, Policy, Report};
use tracegate_producers::RunRecord;
use tracegate_trace::names::{self, Block as Registered, Diffusion, Name};
use tracegate_trace::Trace;

use super::decode::DecodeStatus;
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::overrides;
use crate::bisect::prefill::whole::trace_forced;
use crate::bisect::prefill::{
    self as b, BisectVerdict, DecisionsForced, Forcing, How, Isolated, Said,
};

mod isolate;
mod render;
mod report;

pub use render::render;
pub use report::*;

/// What the prefill bisection hands over.
pub struct Context<'a> {
    pub reference: &'a Trace,
    pub ref_rel: &'a str,
    /// The candidate's whole run (forced, when the prefill forced it).
    pub candidate: &'a Trace,
    pub cand_rel: &'a str,
    pub policy: &'a Option<Policy>,
    /// Decoder layers.
    pub layers: usize,
    pub allow_stack_mismatch: bool,
    /// The candidate's trace took the reference's decisions (the prefill forced it).
    pub forced: bool,
}

/// One diverging tensor or decision of the passes after the prompt, with its run-order key.
struct Diverging {
    key: (passes::Key, usize, usize),
    name: String,
    how: How,
}

/// Where a name stands inside its pass: 0 before the layers (canvas, embedding,
/// self-conditioning, layer 0's input), 1+L in layer L, past every layer for the head and the
/// sampler.
fn within_pass(name: &str) -> usize {
    let n = Name::parse(name);
    match n.layer {
        // Layer 0's input is the pass's, made before any layer.
        Some(0) if n.point == "hidden_in" => 0,
        Some(l) => l.saturating_add(1),
        None => match names::point(name).map(|p| p.block) {
            Some(Registered::Embedding | Registered::SelfConditioning | Registered::Input) => 0,
            _ => usize::MAX,
        },
    }
}

/// The pass a name belongs to, as its prefix (`denoise.BBBB.SSSS.`, `encode.BBBB.`,
/// `denoise.BBBB.` for a block's own decisions); None for a prompt-pass name.
fn pass_of(name: &str) -> Option<String> {
    let d = Name::parse(name).diffusion?;
    Some(match d {
        Diffusion::Encode { block } => names::encode(block, ""),
        Diffusion::Denoise { block, step } => names::denoise(block, step, ""),
        Diffusion::Block { block } => names::denoise_block(block, ""),
    })
}

/// The passes after the prompt in `t`, in run order: every denoise step and commit pass that
/// holds a tensor.
fn passes_in(t: &Trace) -> Vec<String> {
    let mut all: Vec<(passes::Key, String)> = t
        .tensors()
        .iter()
        .filter_map(|x| pass_of(&x.name).map(|p| (passes::key(&x.name), p)))
        .collect();
    all.sort();
    all.dedup_by(|a, b| a.1 == b.1);
    all.into_iter().map(|(_, p)| p).collect()
}

/// Every diverging tensor and decision after the prompt, in run order (tensors by the
/// reference's capture order inside their place; a decision after its layer's tensors).
fn diverging(reference: &Trace, rep: &Report, forced: bool) -> Vec<Diverging> {
    let index = |name: &str| {
        reference
            .tensors()
            .iter()
            .position(|t| t.name == name)
            .unwrap_or(usize::MAX)
    };
    let at = |name: &str, how: How| Diverging {
        key: (passes::key(name), within_pass(name), index(name)),
        name: name.to_string(),
        how,
    };
    let mut out: Vec<Diverging> = b::rows(rep)
        .iter()
        .filter(|t| t.status.is_bad() && pass_of(&t.tensor).is_some())
        .map(|t| at(&t.tensor, How::Differs))
        .collect();
    out.extend(
        b::decisions(rep)
            .iter()
            .filter(|d| d.judged_rows() > 0 && pass_of(&d.name).is_some())
            .map(|d| at(&d.name, How::Differs)),
    );
    // A tensor or decision on one side only, or (unforced) a decision whose margins differ;
    // past a sampling divergence not judged, as the differ leaves its values (an expert that
    // the other canvas routes no row to is missing there by consequence).
    let draw = rep
        .decisions
        .sampling_divergence
        .as_ref()
        .map(|sd| sd.decision.as_str());
    for f in &rep.findings {
        let counts = match f.kind {
            FindingKind::MissingTensor
            | FindingKind::ExtraTensor
            | FindingKind::MissingDecision
            | FindingKind::ExtraDecision => true,
            FindingKind::MarginDiffers => !forced,
            _ => false,
        };
        let judged = |t: &str| draw.is_none_or(|d| !passes::after_draw(d, t));
        if let Some(t) = f
            .tensor()
            .filter(|t| counts && pass_of(t).is_some() && judged(t))
        {
            if !out.iter().any(|d| d.name == t) {
                out.push(at(t, How::Finding(f.kind)));
            }
        }
    }
    out.sort_by(|a, b| a.key.cmp(&b.key).then_with(|| a.name.cmp(&b.name)));
    out
}

fn options(c: &Context) -> Options {
    Options {
        all: true,
        policy: c.policy.clone(),
        allow_stack_mismatch: c.allow_stack_mismatch,
        ..Options::default()
    }
}

/// The candidate traced again taking the reference's draws and decisions, and that comparison.
fn force(
    o: &BisectOptions,
    c: &Context,
    unforced: &Report,
    runs: &mut Vec<RunRecord>,
) -> (DecisionsForced, Option<(Report, Trace, String)>) {
    let rel = format!("{}/candidate.diffusion.forced.trace", o.work);
    let (f, got) = trace_forced(
        o,
        (c.reference, c.ref_rel),
        unforced,
        rel.clone(),
        &options(c),
        runs,
    );
    crate::progress::step("candidate traced with the reference's draws and decisions forced");
    (f, got.map(|(rep, t)| (rep, t, rel)))
}

/// The rows a forced candidate would have decided otherwise, as "NAME: N" items: (failing,
/// said). A rule of the sampler (accept, stop, commit) overridden fails: its margins are
/// distances to thresholds computed from numbers the comparison judges, so only the rule itself
/// can decide otherwise. An argmax or router overridden is said, not failed, when its own
/// numbers explain each row it overrode (`decisions_forced.overrides_unexplained` lists those
/// they do not, overrides.rs): an exact tie the reference's scores make too, broken otherwise,
/// or its own scores' choice (another choice, or a top-k in another order) within the
/// honest-noise bound of the reference's choice in the reference's scores (a near-tie, docs/diff.md "The near-tie rule"); else it fails.
/// A draw overridden is the other generator's, taken as given.
fn overridden(f: &DecisionsForced) -> (Vec<String>, Vec<String>) {
    let (mut failing, mut said) = (Vec::new(), Vec::new());
    for (name, n) in own_overrides(f) {
        let item = format!("{name}: {n}");
        let unexplained = f.overrides_unexplained.iter().find(|u| u.decision == name);
        match (overrides::from_numbers(name), unexplained) {
            (true, None) => {
                let mut how = Vec::new();
                if let Some(t) = f.overrides_ties.get(name) {
                    how.push(format!("{t} an exact tie"));
                }
                if let Some(t) = f.overrides_near_ties.get(name) {
                    how.push(format!("{t} a near-tie"));
                }
                said.push(match how.is_empty() {
                    true => item,
                    false => format!("{item} ({})", how.join(", ")),
                })
            }
            (true, Some(u)) => failing.push(format!(
                "{item} (not explained by its own numbers: {})",
                overrides::why_words(u)
            )),
            (false, _) => failing.push(item),
        }
    }
    (failing, said)
}

/// The forced candidate's overridden decisions (provenance `forced_decisions.overridden`), draws
/// aside: those are the other generator's by construction.
pub(crate) fn own_overrides(f: &DecisionsForced) -> Vec<(&str, &serde_json::Value)> {
    f.overridden
        .as_ref()
        .and_then(|v| v.as_object())
        .into_iter()
        .flatten()
        .filter(|(name, _)| !overrides::is_draw(name))
        .map(|(name, n)| (name.as_str(), n))
        .collect()
}

/// The bisection of the passes after the prompt, after the prefill's verdict: returns its report
/// and the verdict (the prefill's when it is not `nothing_wrong`).
pub fn run(
    o: &BisectOptions,
    c: &Context,
    runs: &mut Vec<RunRecord>,
    prefill: Said,
) -> (DiffusionReport, Said) {
    let all = passes_in(c.reference);
    let mut d = DiffusionReport::new(o, all.len());
    if prefill.0 != BisectVerdict::NothingWrong {
        d.status = DecodeStatus::NotCompared;
        d.reason = Some(format!(
            "the prompt pass's verdict ({}) wins; the passes after it are compared only when it agrees",
            prefill.0
        ));
        return (d, prefill);
    }
    let unforced = compare(c.reference, c.candidate, &options(c));
    let mut refused = None;
    let forced_run = match &unforced.decisions.sampling_divergence {
        // Another generator: forcing is the only way to compare past its first draw.
        Some(sd) => {
            let (f, got) = force(o, c, &unforced, runs);
            d.forced = Some(f);
            if got.is_none() {
                refused = Some(format!(
                    "the draws differ from {} at block {}{} (rng {:?} vs {:?}) and the candidate could not be forced: what follows is not judged",
                    sd.decision,
                    sd.block,
                    sd.step.map_or(String::new(), |s| format!(" step {s}")),
                    sd.reference_rng,
                    sd.candidate_rng
                ));
            }
            got
        }
        None => None,
    };
    d.reason = refused;
    let (rep, cand, cand_rel): (&Report, &Trace, &str) = match &forced_run {
        Some((r, t, rel)) => (r, t, rel),
        None => (&unforced, c.candidate, c.cand_rel),
    };
    let forced = c.forced || forced_run.is_some();
    if let (Some(f), Some(_)) = (&d.forced, &forced_run) {
        d.forced_unexplained = f
            .overrides_unexplained
            .iter()
            .map(|u| u.decision.clone())
            .collect();
    }
    let div = diverging(c.reference, rep, forced);
    let Some(first) = div.first() else {
        let said = nothing_differs(&mut d, &all, prefill);
        return (d, said);
    };
    let pass = pass_of(&first.name).unwrap_or_default();
    // The passes up to the one that diverges (a block's commit: every step of the block).
    let upto = passes::key(&first.name);
    d.passes_compared = all
        .iter()
        .filter(|p| passes::key(&format!("{p}x")) <= upto)
        .count();
    d.first_diverging_pass = Some(pass.clone());
    d.place = passes::in_words(&pass);
    d.first_diverging = Some(first.name.clone());
    d.first_diverging_how = Some(first.how);
    let in_pass = |n: &str| pass_of(n).as_deref() == Some(pass.as_str());
    d.pass_tensors = b::rows(rep)
        .into_iter()
        .filter(|t| t.status.is_bad() && in_pass(&t.tensor))
        .collect();
    d.pass_decisions = b::decisions(rep)
        .into_iter()
        .filter(|x| x.judged_rows() > 0 && in_pass(&x.name))
        .collect();
    let place = d.place.clone().unwrap_or_default();
    let said = match (first.how, within_pass(&first.name)) {
        (How::Finding(k), _) => (
            BisectVerdict::StructureDiffers,
            format!("at {place}: {} is {}", first.name, How::Finding(k).words()),
        ),
        (How::Differs, w) if w > 0 && w <= c.layers => {
            let rows: Vec<_> = b::rows(rep)
                .into_iter()
                .filter(|t| in_pass(&t.tensor))
                .collect();
            let x = isolate::Pass {
                prefix: &pass,
                first_layer: w - 1,
                forced,
                candidate: cand,
                cand_rel,
                rows: &rows,
            };
            isolate::isolate_pass(o, c, &x, &mut d, runs);
            verdict(&d, &place)
        }
        (How::Differs, 0) => (
            BisectVerdict::OutsideLayers,
            format!(
                "at {place}: {} differs before any layer (the pass's input: {}), with every pass before it matching",
                first.name,
                stage_words(&first.name)
            ),
        ),
        (How::Differs, _) => match passes::place(&first.name).and_then(|p| p.sampler) {
            Some(s) => (
                BisectVerdict::DecisionsDiffer,
                format!(
                    "at {place}: the candidate's {} decision differs ({}) on numbers that agree{}",
                    sampler_words(s),
                    d.pass_decisions
                        .iter()
                        .find(|x| x.name == first.name)
                        .map_or(String::new(), |x| format!(
                            "{} of {} rows",
                            x.judged_rows(),
                            x.rows
                        )),
                    if forced {
                        ""
                    } else {
                        ", every tensor of the pass and every pass before it matching"
                    }
                ),
            ),
            None => (
                BisectVerdict::OutsideLayers,
                format!(
                    "at {place}: only the head differs ({} first), every layer of the pass matching",
                    first.name
                ),
            ),
        },
    };
    let said = with_observations(&d, said);
    (d, said)
}

/// No pass after the prompt diverges: nothing wrong, unless the candidate could not be forced
/// past another generator's draws (NOT CHECKED) or, forced, would itself have decided otherwise
/// in a rule of the sampler.
fn nothing_differs(d: &mut DiffusionReport, all: &[String], prefill: Said) -> Said {
    d.passes_compared = all.len();
    if let Some(why) = &d.reason {
        return (
            BisectVerdict::NotChecked,
            format!(
                "the passes after the prompt NOT CHECKED: {why}; the prompt: {}",
                prefill.1
            ),
        );
    }
    let blocks = all
        .iter()
        .filter_map(|p| passes::place(p).map(|x| x.block))
        .max()
        .map_or(0, |b| b + 1);
    let steps = all.iter().filter(|p| p.starts_with("denoise.")).count();
    // The prefill compared the prompt's encoder pass alone: its "whole runs" are that pass's.
    let prompt = prefill
        .1
        .replacen("the whole runs are", "the prompt's encoder passes are", 1);
    let said = (
        BisectVerdict::NothingWrong,
        format!(
            "{prompt}; the {} passes after the prompt agree ({blocks} blocks: {steps} denoise steps and {} commit passes, every tensor and decision)",
            all.len(),
            all.len() - steps
        ),
    );
    with_observations(d, said)
}

/// Forcing said: a candidate that would have decided otherwise on numbers that agree decides
/// otherwise (`decisions_differ`, [`overridden`]); what is excused is said.
fn with_observations(d: &DiffusionReport, (verdict, mut summary): Said) -> Said {
    let Some(f) = d.forced.as_ref().filter(|f| f.status == Forcing::Forced) else {
        return (verdict, summary);
    };
    let (failing, said) = overridden(f);
    summary.push_str(&format!(
        "; the candidate was traced taking the reference's draws and decisions (another generator; it would have taken {} of its own decisions otherwise, draws aside)",
        failing.len() + said.len()
    ));
    if !said.is_empty() {
        summary.push_str(&format!(
            "; argmax or router rows it would have decided otherwise where the scores tie exactly, or where its own scores make a choice within the honest-noise bound of the reference's in the reference's scores (said, not failed): {}",
            said.join(", ")
        ));
    }
    // An override record that cannot be read or judged: what the candidate would itself have
    // decided is unknown, never none.
    let (verdict, summary) = match &f.overrides_not_checked {
        Some(why) => {
            let words = format!("the candidate's own decisions NOT CHECKED: {why}");
            match verdict {
                BisectVerdict::NothingWrong => {
                    (BisectVerdict::NotChecked, format!("{words}; {summary}"))
                }
                v => (v, format!("{summary}; {words}")),
            }
        }
        None => (verdict, summary),
    };
    if failing.is_empty() {
        return (verdict, summary);
    }
    const SHOWN: usize = 3;
    let more = match failing.len() {
        n if n > SHOWN => format!(" … ({n} decisions)"),
        _ => String::new(),
    };
    let words = format!(
        "the candidate's own decisions differ on the reference's numbers: {}{more}",
        failing[..failing.len().min(SHOWN)].join(", ")
    );
    match verdict {
        BisectVerdict::NothingWrong | BisectVerdict::NotChecked => (
            BisectVerdict::DecisionsDiffer,
            format!(
                "{words}; {}",
                summary.strip_prefix("nothing wrong: ").unwrap_or(&summary)
            ),
        ),
        _ => (verdict, format!("{summary}; {words}")),
    }
}

/// The verdict once the layers of the first diverging pass were isolated.
fn verdict(d: &DiffusionReport, place: &str) -> Said {
    if let (Some(l), Some(st)) = (d.first_wrong_layer, &d.stage) {
        let mut s = format!(
            "in isolation at {place} layer {l:02}'s body is wrong: {} — {}",
            st.block.words(),
            st.detail
        );
        let matching: Vec<usize> = d
            .layers
            .iter()
            .filter(|r| r.layer < l && r.isolation == Isolated::Match)
            .map(|r| r.layer)
            .collect();
        if !matching.is_empty() {
            s.push_str(&format!("; {}", b::say(&matching, "matches", "match")));
        }
        if let Some(i) = &d.inconsistent {
            return (
                BisectVerdict::InconsistentProducer,
                format!(
                    "at {place} the candidate's layer verb disagrees with its own whole run at layer {:02} ({}): no layer body is blamed",
                    i.layer, i.detail
                ),
            );
        }
        if let Some(why) = &d.self_check_not_checked {
            s.push_str(&format!(
                "; the candidate's layer verb NOT CHECKED against its own whole run: {why}"
            ));
        }
        return (BisectVerdict::WrongLayer, s);
    }
    if let Some(i) = &d.inconsistent {
        // No body is wrong in isolation, yet this layer's input agrees in the whole runs: its
        // whole run read other keys than the ones its trace records (isolate::unexplained).
        return (
            BisectVerdict::InconsistentProducer,
            format!(
                "at {place} the candidate's layer verb disagrees with its own whole run at layer {:02} ({}): the layer's input agrees in the whole runs and its body matches in isolation, so its whole run read other keys than the earlier encoder passes' k and v its trace records (a cache built from another hidden state?); no layer body is blamed",
                i.layer, i.detail
            ),
        );
    }
    if let Some(why) = &d.isolation_not_checked {
        return (
            BisectVerdict::NotChecked,
            format!("the first diverging pass is {place} ({}), and its layers could not be isolated: {why}", d.first_diverging.as_deref().unwrap_or("")),
        );
    }
    (
        BisectVerdict::Accumulates,
        format!(
            "at {place} no layer's body is wrong in isolation (layers {} isolated): the difference accumulates from inputs that differ below the judge's resolution",
            b::span(&d.layers.iter().map(|r| r.layer).collect::<Vec<_>>())
        ),
    )
}

fn stage_words(name: &str) -> &'static str {
    match names::point(name).map(|p| p.block) {
        Some(Registered::SelfConditioning) => "self-conditioning",
        Some(Registered::Embedding) => "the canvas or its embedding",
        _ => "the first layer's input",
    }
}

fn sampler_words(s: Sampler) -> &'static str {
    match s {
        Sampler::InitCanvas => "initial canvas",
        Sampler::Argmax => "argmax",
        Sampler::Sampled => "sampled",
        Sampler::Accept => "accept",
        Sampler::Renoise => "renoise",
        Sampler::Stop => "stop",
        Sampler::Commit => "commit",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_inside_a_pass() {
        assert_eq!(within_pass("denoise.0000.0001.sc.out"), 0);
        assert_eq!(within_pass("denoise.0000.0001.canvas"), 0);
        assert_eq!(within_pass("denoise.0000.0001.layer.00.hidden_in"), 0);
        assert_eq!(within_pass("denoise.0000.0001.layer.00.q"), 1);
        assert_eq!(within_pass("denoise.0000.0001.layer.01.hidden_in"), 2);
        assert_eq!(within_pass("denoise.0000.0001.layer.12.mlp_out"), 13);
        assert_eq!(within_pass("denoise.0000.0001.logits"), usize::MAX);
        assert_eq!(within_pass("denoise.0000.0001.stop"), usize::MAX);
        assert_eq!(
            pass_of("encode.0001.layer.00.k").as_deref(),
            Some("encode.0001.")
        );
        assert_eq!(
            pass_of("denoise.0001.0002.entropy").as_deref(),
            Some("denoise.0001.0002.")
        );
        assert_eq!(
            pass_of("denoise.0001.commit").as_deref(),
            Some("denoise.0001.")
        );
        assert_eq!(pass_of("layer.00.k"), None);
    }
}
