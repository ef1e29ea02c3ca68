//! The decode bisection's driver: the first diverging step, then the cache self-check and the
//! isolation at that step (cache.rs, isolate.rs), then the verdict.

use tracegate_diff::{compare, FindingKind, Verdict};
use tracegate_trace::names::{self, Name};

use super::cache::cache_check;
use super::isolate::isolate_step;
use super::{decode_only, step_of, CacheStatus, Context, DecodeReport, DecodeStatus};
use crate::bisect::{
    self as b, BisectOptions, BisectVerdict, How, Isolated, Said, TensorCmp, WholeRunState,
};
use crate::producer::RunRecord;

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
