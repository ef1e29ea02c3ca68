//! A decode-step capsule (docs/bisect.md, "Capsules"): the layer `gate bisect --generate N`
//! found wrong in isolation at decode step s (position P = n+s−1), replayed as the decode
//! isolation ran it — the candidate's `layer --decode-from P` (docs/producers.md) on the
//! reference's `layer.LL.hidden_in` rows at positions 0..=P (`input.trace`: the prompt's rows,
//! then steps 1..=s; from the rows below P the candidate rebuilds the layer's KV cache or
//! recurrent state), its one output row compared with the reference's step row at every point a
//! `--decode-from` trace holds (`reference.trace`). Both are written by the decode isolation's
//! own writer (../decode/isolate.rs `step_rows`), so the replay reads what the bisection read.
//!
//! Not minimised: the step needs its whole prefix (a shorter one is another step).

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::{json, Value};
use tracegate_diff::Policy;
use tracegate_trace::{names, Trace};

use super::*;
use crate::bisect::decode::isolate::step_rows;

/// The layer's input rows 0..=P, what the candidate's `layer --decode-from P` reads.
const INPUT: &str = "input.trace";

/// Why a decode capsule keeps every row (`rows.not_minimised`).
const WHOLE_PREFIX: &str = "a decode step needs its whole prefix: layer --decode-from P rebuilds the layer's KV cache (or recurrent state) from the hidden_in rows at positions 0..P-1, and a shorter prefix is another step at another position, not the one the bisection found wrong";

/// The decode step a capsule holds: s and its position P.
pub(super) struct Step {
    pub step: usize,
    pub position: i64,
}

/// The layer wrong in isolation at the bisection's first diverging decode step, its stage, and
/// the step; None when the decode bisection names no such layer.
pub(super) fn wrong_step(rep: &BisectReport) -> Option<(usize, Stage, Step)> {
    let d = rep.decode.as_ref()?;
    Some((
        d.first_wrong_layer?,
        d.stage.clone()?,
        Step {
            step: d.first_diverging_step?,
            position: d.position?,
        },
    ))
}

/// " at decode step S (position P)" for a decode capsule's manifest, "" for a prefill one.
pub(super) fn at(m: &Manifest) -> String {
    match (m.decode["step"].as_u64(), m.decode["position"].as_i64()) {
        (Some(s), Some(p)) => format!(" at decode step {s} (position {p})"),
        _ => String::new(),
    }
}

/// A decode capsule's `--decode-from P` and the file of the layer's input rows; None for a
/// prefill capsule.
pub(super) fn input(m: &Manifest) -> Option<(i64, &'static str)> {
    m.decode["position"].as_i64().map(|p| (p, INPUT))
}

/// The manifest's decode claims re-derived from the traces it pins: reference.trace and
/// input.trace say the same step and position (their provenance `capsule.decode`), the input
/// rows are at positions 0..=P and the compared rows at P with `decode_from` = P. A prefill
/// manifest must find no decode step in reference.trace.
pub(super) fn rederive(
    dir: &Path,
    m: &Manifest,
    reference: &Trace,
) -> std::result::Result<(), String> {
    let own = &reference.provenance()["capsule"]["decode"];
    let claim = json!({"step": m.decode["step"], "position": m.decode["position"]});
    if m.decode.is_null() {
        return match own.is_null() {
            true => Ok(()),
            false => Err(format!(
                "records no decode step, reference.trace holds decode step {} (position {})",
                own["step"], own["position"]
            )),
        };
    }
    if *own != claim {
        return Err(format!(
            "records decode step {} (position {}), reference.trace holds {own}",
            claim["step"], claim["position"]
        ));
    }
    if m.decode["input"] != json!(INPUT) || !m.files.contains_key(INPUT) {
        return Err(format!(
            "records the decode input {}, not a sha256-pinned {INPUT}",
            m.decode["input"]
        ));
    }
    let p = m.decode["position"].as_i64().unwrap_or(-1);
    let rows = Trace::open(dir.join(INPUT)).map_err(|e| format!("names {INPUT}: {e}"))?;
    if rows.provenance()["capsule"]["decode"] != claim {
        return Err(format!(
            "records decode step {} (position {p}), {INPUT} holds {}",
            claim["step"],
            rows.provenance()["capsule"]["decode"]
        ));
    }
    let input = names::layer(m.layer, "hidden_in");
    let want: Vec<i64> = (0..=p).collect();
    let got = rows
        .tensor_info(&input)
        .and_then(|i| i.attributes.positions.clone());
    if got.as_ref() != Some(&want) {
        return Err(format!(
            "records position {p}, {INPUT}'s {input} is not at positions 0..={p} ({})",
            got.map_or("none".into(), |g| format!("{} rows", g.len()))
        ));
    }
    for info in reference.tensors() {
        let from = info.attributes.extra.get("decode_from");
        if info.attributes.positions.as_deref() != Some(&[p][..]) || from != Some(&p.to_string()) {
            return Err(format!(
                "records position {p}, reference.trace's {} is at positions {:?} with decode_from {from:?}",
                info.name, info.attributes.positions
            ));
        }
    }
    Ok(())
}

/// The phrase of test_capsule.c's header that says what the port's layer verb ran on (a prefill
/// capsule's), and a decode capsule's instead.
const C_RUN_ON: &str = "(run on the capsule's reference.trace,\n * input layer.@LL@.hidden_in,";

fn c_run_on_decode(layer: usize, p: i64) -> String {
    format!("(run as `layer --decode-from {p}` on the capsule's {INPUT},\n * input layer.{layer:02}.hidden_in at positions 0..={p},")
}

/// Writes the decode capsule of `layer` at step `at` into `dir`, which already holds nothing.
#[allow(clippy::too_many_arguments)]
pub(super) fn build(
    o: &BisectOptions,
    rep: &BisectReport,
    dir: &Path,
    at: &Step,
    layer: usize,
    stage: &Stage,
    policy: &Option<Policy>,
    lw: &weights::LayerWeights,
) -> Result<std::result::Result<Written, String>> {
    let Prepared {
        _lock,
        trials,
        replay_model: _,
        replay_digest,
    } = prepare(o, dir, lw)?;
    let d = rep
        .decode
        .as_ref()
        .ok_or_else(|| gerr!("a decode capsule without the bisection's decode report"))?;
    let reference = open(&o.root, &format!("{}/reference.trace", o.work))?;
    let source_digest = reference
        .provenance()
        .get("weights_digest")
        .cloned()
        .unwrap_or(Value::Null);
    let (s, p) = (at.step, at.position);
    let rows = p as usize + 1;
    let mut prov = reference.provenance().clone();
    if let Some(x) = prov.as_object_mut() {
        x.insert("weights_digest".into(), json!(replay_digest));
        x.insert(
            "capsule".into(),
            json!({"layer": layer, "rows": rows, "of": rows, "source_weights_digest": source_digest,
                   "decode": {"step": s, "position": p}}),
        );
    }
    step_rows(
        &reference,
        s,
        p,
        layer..layer + 1,
        &prov,
        &dir.join(INPUT),
        &dir.join("reference.trace"),
    )?;
    if let Some(p) = policy {
        let text = serde_json::to_vec_pretty(p).map_err(|e| gerr!("policy: {e}"))?;
        write_file(&dir.join("policy.json"), &text)?;
    }
    write_file(&dir.join("test_capsule.py"), PYTEST.as_bytes())?;
    let isolated = &d.layers[layer];
    let judged: Vec<&str> = isolated
        .isolated
        .iter()
        .map(|t| t.tensor.as_str())
        .collect();
    let c = c_test(
        layer,
        &open(&o.root, &dir.join("reference.trace").display().to_string())?,
        policy,
        &judged,
        &[],
    );
    let prefill_words = C_RUN_ON.replace("@LL@", &format!("{layer:02}"));
    if !c.contains(&prefill_words) {
        return Err(gerr!(
            "test_capsule.c's template no longer says {prefill_words:?}: its decode wording is not placed"
        ));
    }
    write_file(
        &dir.join(C_TEST),
        c.replace(&prefill_words, &c_run_on_decode(layer, p))
            .as_bytes(),
    )?;
    let judged = Judged::of(o, rep, policy, stage, isolated);
    let mut not_included: Vec<String> = not_included(o)
        .into_iter()
        .filter(|l| l != NO_DECODE_STEP && l != HEADS_NAMED)
        .collect();
    not_included.push("heads and experts: a decode capsule keeps every head and expert of the layer and names none (units is null)".into());
    not_included.push("the decode step's internal capture points and decisions: a layer --decode-from trace holds hidden_in, attn_out, mlp_out and hidden_out only (docs/producers.md); reference.trace's router decision, for an MoE layer, is the prompt's and only names the block".into());
    not_included.push("the bisection's cache self-check (the candidate's --cache off run against its cached run): the capsule replays the layer's cached decode path only".into());
    let manifest = Manifest {
        schema: SCHEMA.into(),
        layer,
        decode: json!({
            "step": s, "position": p, "prompt_rows": rep.tokens.len(), "input": INPUT,
            "verb": format!("layer --decode-from {p}"),
        }),
        capture: if o.internals { "internals" } else { "default" }.into(),
        judge: judged.judge,
        stage: json!(stage),
        broke: judged.broke,
        rule: judged.rule,
        bisection: judged.bisection,
        rows: json!({
            "bisection": rows, "kept": rows, "tokens_kept": rep.tokens, "removed": "none",
            "minimised": false, "not_minimised": WHOLE_PREFIX, "trials": [],
            "one_fewer_passes": null, "still_fails": null,
        }),
        weights: {
            let mut w = lw.replay.clone();
            w.insert("source_weights_digest".into(), source_digest.clone());
            w.insert("replay_weights_digest".into(), json!(replay_digest));
            Value::Object(w)
        },
        expected: Value::Null,
        not_included,
        allow_stack_mismatch: o.allow_stack_mismatch,
        files: BTreeMap::new(),
        units: Value::Null,
    };
    kept_if_failing(
        o,
        dir,
        manifest,
        &stage.tensor,
        &trials,
        "the layer does not fail at the step when replayed from its own weights on the reference's rows alone, or the candidate does not repeat itself; not captured",
    )
}

#[cfg(test)]
mod tests {
    /// The decode wording replaces a phrase of the C template: a template that drops it must
    /// fail here, not write a decode capsule's C test that says it ran on reference.trace.
    #[test]
    fn the_c_templates_prefill_phrase_is_there_to_replace() {
        assert!(super::super::C_TEMPLATE.contains(super::C_RUN_ON));
    }
}
