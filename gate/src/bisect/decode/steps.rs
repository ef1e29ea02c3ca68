//! The decode bisection's driver: the first diverging step, then the cache self-check and the
//! isolation at that step (cache.rs, isolate.rs), then the verdict.

use tracegate_diff::{compare, FindingKind, RowStatus};
use tracegate_producers::RunRecord;
use tracegate_trace::names::{self, Name};

use super::cache::cache_check;
use super::isolate::isolate_step;
use super::{decode_view, step_of, CacheStatus, Context, DecodeReport, DecodeStatus};
use crate::bisect::options::BisectOptions;
use crate::bisect::prefill::{
    self as b, BisectVerdict, CmpStatus, How, Isolated, Said, TensorCmp, WholeRunState,
};

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
    let opts = decode_view(c);
    let rep = compare(c.reference, c.candidate, &opts);
    let tensors = b::rows(&rep);
    let decisions = b::decisions(&rep);
    // A side that captured no decode tensors (a producer older than the decode capture) leaves
    // the steps' numbers unchecked, whatever its decisions say; its decode tokens (the
    // `decode.SSSS.argmax` decisions) are still compared, and the first step whose token
    // differs is named.
    let no_numbers = [("reference", c.reference), ("candidate", c.candidate)]
        .into_iter()
        .find(|(_, t)| t.tensor_info(&names::decode(0, "logits")).is_none())
        .map(|(side, _)| format!("the {side}'s trace has no {} (its trace verb does not capture decode steps, docs/producers.md)", names::decode(0, "logits")));
    let has_tokens =
        |t: &tracegate_trace::Trace| t.decisions().iter().any(|x| step_of(&x.name).is_some());
    if let Some(why) = &no_numbers {
        if !has_tokens(c.reference) || !has_tokens(c.candidate) {
            d.status = DecodeStatus::NotCompared;
            d.reason = Some(format!(
                "{why}; and no decode tokens (decode.SSSS.argmax) on both sides to compare"
            ));
            return (
                d,
                (
                    BisectVerdict::NotChecked,
                    format!(
                        "decode steps NOT CHECKED: {why}, nor decode tokens on both sides; the prefill: {}",
                        prefill.1
                    ),
                ),
            );
        }
        d.reason = Some(format!(
            "the steps' numbers ({why}); only their tokens are compared"
        ));
    }
    // Per step, in computation order: its tensors in the reference's order, then its decision;
    // what the differ states as a finding (a tensor or decision on one side only) counts too.
    // Without decode numbers only the decisions are compared.
    let structure: Vec<(&str, FindingKind)> = rep
        .findings
        .iter()
        .filter(|f| match f.kind {
            FindingKind::MissingTensor | FindingKind::ExtraTensor => no_numbers.is_none(),
            FindingKind::MissingDecision | FindingKind::ExtraDecision => true,
            _ => false,
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
            .filter(|_| no_numbers.is_none())
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
        // The comparison holds the prefill too: only the compared steps' rows say how they agree.
        let seen = |name: &str| step_of(name).is_some_and(|x| x < d.steps_compared);
        let identical = tensors
            .iter()
            .filter(|t| seen(&t.tensor))
            .all(|t| t.status == CmpStatus::Row(RowStatus::Identical))
            && decisions
                .iter()
                .filter(|x| seen(&x.name))
                .all(|x| x.differing_rows == 0);
        let how = if identical {
            "identical"
        } else {
            "within policy"
        };
        // Steps after an excused flip were not compared: NOT CHECKED, never a pass.
        let left = o.generate - d.steps_compared;
        let rest = match left {
            1 => format!("step {}", d.steps_compared),
            _ => format!("steps {}-{}", d.steps_compared, o.generate - 1),
        };
        let tail = match &stop_after {
            Some((at, dec)) if left > 0 => {
                let why = format!("{dec} is a near-tie the policy excuses, so the runs feed other tokens after step {at}: {rest} NOT CHECKED");
                d.reason = Some(match d.reason.take() {
                    Some(r) => format!("{r}; {why}"),
                    None => why.clone(),
                });
                format!("; {why}")
            }
            Some((at, dec)) => {
                format!("; {dec} is a near-tie the policy excuses (step {at}, the last)")
            }
            None => String::new(),
        };
        if let Some(why) = &no_numbers {
            let summary = format!(
                "decode steps NOT CHECKED: {why}; their tokens agree at {steps} ({} of {} steps compared){tail}; the prefill: {}",
                d.steps_compared, o.generate, prefill.1
            );
            return (d, (BisectVerdict::NotChecked, summary));
        }
        if stop_after.is_some() && left > 0 {
            // The headline says NOT CHECKED first: the prefill's "nothing wrong" comes after.
            let summary = format!(
                "decode {rest} NOT CHECKED: decode {steps} {how} ({} of {} steps compared){tail}; the prefill: {}",
                d.steps_compared, o.generate, prefill.1
            );
            return (d, (BisectVerdict::NotChecked, summary));
        }
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
    if let Some(why) = &no_numbers {
        let before = match s {
            0 => "the prefill matches".to_string(),
            1 => "the prefill matches and step 0 takes the same token".to_string(),
            _ => format!(
                "the prefill matches and steps 0-{} take the same tokens",
                s - 1
            ),
        };
        let (verdict, what) = match how {
            How::Differs => (
                BisectVerdict::DecisionsDiffer,
                "the candidate takes another token",
            ),
            How::Finding(_) => (
                BisectVerdict::StructureDiffers,
                "a decode token on one side only",
            ),
        };
        let how_said = match how {
            How::Differs => String::new(),
            How::Finding(k) => format!(" ({})", k.as_str().replace('_', " ")),
        };
        let summary = format!(
            "decode step {s} (position {p}) first diverges at {name}{how_said}: {what}; the steps' numbers NOT CHECKED (neither the cache self-check nor the isolation runs): {why}; {before}"
        );
        return (d, (verdict, summary));
    }

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
