//! `--explain` inside a layer (docs/diff.md, "Explaining a difference"): the engine's trace of
//! tiny-qwen3 (and tiny-qwen3-moe) under `--capture internals` is the reference; each candidate
//! is a copy with one layer point recomputed here from the reference's captured inputs — the
//! normed input by the engine's §6 RMSNorm, then the projection under a planted order (the
//! engine's `matmul_ref_by` with another `dot`) or with a planted defect. The order must be
//! named; a defect must be refused.

use std::path::{Path, PathBuf};

use tracegate_engine::ops::dot;
use tracegate_trace::Trace;

use crate::common::plant::{blocked16, fma, split_k, summed, Dot, Projection};
use crate::common::{p, run};
use crate::explain::{candidate_line, copy_with, fixture, TOKENS};

const LAYER: usize = 1;

/// The engine's trace of `model` on TOKENS with internals, in `dir`.
fn reference(dir: &Path, model: &str) -> PathBuf {
    let out = dir.join("reference.trace");
    tracegate_engine::run_trace(&tracegate_engine::TraceOptions {
        model_dir: fixture(model),
        tokens: TOKENS.to_vec(),
        out: out.clone(),
        internals: true,
        generate: 0,
        cache: true,
        threads: 1,
        command_line: vec!["explain_layer test".into()],
        force_decisions: None,
        prompt_text: None,
        shards: None,
    })
    .expect("engine trace with internals");
    out
}

/// Layer LAYER's `point` recomputed: `norm` (eps `eps`) of `inputs` added elementwise, then
/// `matrix` (rows scaled by `scale`, plus its bias when `bias`) under `dot` (common/plant.rs).
#[allow(clippy::too_many_arguments)]
fn projection(
    reference: &Path,
    model: &str,
    inputs: &[&str],
    norm: &str,
    eps: f32,
    matrix: &str,
    bias: bool,
    scale: f32,
    dot: Dot,
) -> Vec<f32> {
    let names: Vec<String> = inputs
        .iter()
        .map(|i| format!("layer.{LAYER:02}.{i}"))
        .collect();
    let x = summed(reference, &names);
    let store = tracegate_engine::open_store(&fixture(model)).unwrap();
    // Qwen3.5's weights sit under model.language_model., its norms are zero-centred (§15.1).
    let qwen3_5 = model == "tiny-qwen3_5";
    let layer = match qwen3_5 {
        true => format!("model.language_model.layers.{LAYER}"),
        false => format!("model.layers.{LAYER}"),
    };
    Projection {
        layer: &layer,
        norm,
        eps,
        zero_centred: model.starts_with("tiny-qwen3_5"),
        matrix,
        bias,
        scale,
    }
    .of(&x, &store, dot)
}

struct Case {
    _dir: tempfile::TempDir,
    reference: PathBuf,
    candidate: PathBuf,
    model: &'static str,
}

fn case(model: &'static str, point: &str, make: impl FnOnce(&Path) -> Vec<f32>) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference(dir.path(), model);
    let values = make(&reference);
    let candidate = copy_with(
        &reference,
        &dir.path().join("candidate.trace"),
        &format!("layer.{LAYER:02}.{point}"),
        Some(&values),
    );
    Case {
        _dir: dir,
        reference,
        candidate,
        model,
    }
}

fn explain(c: &Case, only: &str) -> String {
    let m = fixture(c.model);
    let r = run(&[
        "--explain",
        "--only",
        only,
        p(&c.reference),
        p(&c.candidate),
        "--model",
        p(&m),
    ]);
    assert_eq!(r.code, 1, "a difference: exit 1\n{}{}", r.stdout, r.stderr);
    r.stdout
}

/// v = v_proj(input_layernorm(hidden_in)) + bias, tiny-qwen3 (attention_bias: true).
fn v_by(reference: &Path, eps: f32, scale: f32, dot: Dot) -> Vec<f32> {
    let inputs = ["hidden_in"];
    let m = "self_attn.v_proj";
    projection(
        reference,
        "tiny-qwen3",
        &inputs,
        "input_layernorm",
        eps,
        m,
        true,
        scale,
        dot,
    )
}

const SIX: &str = "input_layernorm: sum of squares sequential (§2)";

#[test]
fn planted_orders_of_v_are_named() {
    for (dot, name) in [
        (split_k as fn(&[f32], &[f32]) -> f32, "split-K 2"),
        (fma, "sequential (§2) with FMA"),
        (blocked16, "blocked-K 16"),
    ] {
        let c = case("tiny-qwen3", "v", |r| v_by(r, 1e-6, 1.0, dot));
        let out = explain(&c, "layer.01.v");
        assert!(
            out.contains("explain layer.01.v: layer.01.v = input_layernorm(layer.01.hidden_in) · Wᵀ + bias, W = model.layers.1.self_attn.v_proj.weight [24, 52]"),
            "{out}"
        );
        assert!(
            candidate_line(&out).starts_with(&format!("  candidate: REPRODUCED by {name} | {SIX}")),
            "{name}:\n{out}"
        );
        // The positive control that runs every time: the engine is §6 then §2.
        assert!(
            out.contains(&format!(
                "  reference: REPRODUCED by sequential (§2) | {SIX}"
            )),
            "{out}"
        );
        assert!(
            out.contains("inputs: layer.01.hidden_in of each side, bit-identical"),
            "{out}"
        );
        assert!(out.contains("51984 orders tried"), "{out}");
    }
}

/// The ULPs the closest order leaves, from the candidate's NOT REPRODUCED line.
fn refused_by(out: &str) -> u64 {
    let line = candidate_line(out);
    assert!(line.contains("NOT REPRODUCED — no order tried"), "{out}");
    line.split(", ")
        .find_map(|s| s.strip_suffix(" ULP away"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no distance in {line}"))
}

#[test]
fn a_scaled_v_proj_and_a_wrong_input_norm_eps_are_refused() {
    let c = case("tiny-qwen3", "v", |r| v_by(r, 1e-6, 1.01, dot));
    let away = refused_by(&explain(&c, "layer.01.v"));
    assert!(away > 1000, "1 % of a weight: {away} ULP");
    // 1e-5 for the config's 1e-6 (llama's default): no norm order gives its normed rows.
    let c = case("tiny-qwen3", "v", |r| v_by(r, 1e-5, 1.0, dot));
    refused_by(&explain(&c, "layer.01.v"));
}

#[test]
fn router_logits_are_explained_from_hidden_in_and_attn_out() {
    // tiny-qwen3-moe's layer 1 is sparse (mlp_only_layers: [2]); the router has no bias.
    let c = case("tiny-qwen3-moe", "router.logits", |r| {
        projection(
            r,
            "tiny-qwen3-moe",
            &["hidden_in", "attn_out"],
            "post_attention_layernorm",
            1e-5, // the config's rms_norm_eps
            "mlp.gate",
            false,
            1.0,
            fma,
        )
    });
    let out = explain(&c, "layer.01.router.logits");
    assert!(
        out.contains("post_attention_layernorm(layer.01.hidden_in ⊕ layer.01.attn_out) · Wᵀ"),
        "{out}"
    );
    assert!(
        candidate_line(&out).starts_with(
            "  candidate: REPRODUCED by sequential (§2) with FMA | post_attention_layernorm: sum of squares sequential (§2)"
        ),
        "{out}"
    );
    assert!(
        out.contains("  reference: REPRODUCED by sequential (§2) | post_attention_layernorm: sum of squares sequential (§2)"),
        "{out}"
    );
}

#[test]
fn layer_points_that_cannot_be_recomputed_say_why() {
    let c = case("tiny-qwen3", "q", |r| {
        let mut v = Trace::open(r).unwrap().f32_vec("layer.01.q").unwrap();
        v[0] *= 1.5;
        v
    });
    let out = explain(&c, "layer.01.q");
    assert!(
        out.contains("explain layer.01.q: NOT EXPLAINED — no recomputable definition: layer.LL.q is its projection after the per-head q_norm/k_norm and RoPE"),
        "{out}"
    );
    // The candidate without the norm's input: said, never recomputed from the reference's.
    let c = case("tiny-qwen3", "v", |r| v_by(r, 1e-6, 1.0, split_k));
    let dir = tempfile::tempdir().unwrap();
    let cand = copy_with(
        &c.candidate,
        &dir.path().join("no_hidden_in.trace"),
        "layer.01.hidden_in",
        None,
    );
    let m = fixture("tiny-qwen3");
    let r = run(&[
        "--explain",
        "--only",
        "layer.01.v",
        p(&c.reference),
        p(&cand),
        "--model",
        p(&m),
    ]);
    assert!(
        r.stdout.contains("explain layer.01.v: NOT EXPLAINED — the candidate trace holds no layer.01.hidden_in (the input of layer.01.v)"),
        "{}{}",
        r.stdout,
        r.stderr
    );
}

/// tiny-qwen3_5's layer-1 `attn_gate` (full attention; no bias; zero-centred norms, eps 1e-6):
/// each head's gate half of `q_proj(input_layernorm(hidden_in))` (§17.1), q_proj's row being
/// [query | gate] per head, 4 heads of 24.
fn attn_gate_by(reference: &Path, scale: f32, dot: Dot) -> Vec<f32> {
    let q = projection(
        reference,
        "tiny-qwen3_5",
        &["hidden_in"],
        "input_layernorm",
        1e-6,
        "self_attn.q_proj",
        false,
        scale,
        dot,
    );
    let (heads, d) = (4, 24);
    q.chunks(heads * 2 * d)
        .flat_map(|row| row.chunks(2 * d).flat_map(|h| h[d..].to_vec()))
        .collect()
}

#[test]
fn a_planted_order_of_attn_gate_is_named_and_a_scaled_q_proj_refused() {
    let c = case("tiny-qwen3_5", "attn_gate", |r| {
        attn_gate_by(r, 1.0, split_k)
    });
    let out = explain(&c, "layer.01.attn_gate");
    assert!(
        out.contains("explain layer.01.attn_gate: layer.01.attn_gate = input_layernorm(layer.01.hidden_in) · Wᵀ, W = model.language_model.layers.1.self_attn.q_proj.weight [192, 40], each head's gate half"),
        "{out}"
    );
    assert!(
        candidate_line(&out).starts_with(&format!("  candidate: REPRODUCED by split-K 2 | {SIX}")),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "  reference: REPRODUCED by sequential (§2) | {SIX}"
        )),
        "{out}"
    );
    let c = case("tiny-qwen3_5", "attn_gate", |r| attn_gate_by(r, 1.01, dot));
    let away = refused_by(&explain(&c, "layer.01.attn_gate"));
    assert!(away > 1000, "1 % of a weight: {away} ULP");
}

/// The orders the library finds reproducing the candidate's `tensor` (all of them).
fn reproduced_by(c: &Case, tensor: &str) -> Vec<String> {
    let e = tracegate_diff::explain::explain(
        &Trace::open(&c.reference).unwrap(),
        &Trace::open(&c.candidate).unwrap(),
        tensor,
        Some(&fixture(c.model)),
    );
    match e.outcome {
        tracegate_diff::explain::Outcome::Checked(k) => k.candidate.reproduced_by,
        tracegate_diff::explain::Outcome::NotExplained(why) => panic!("not explained: {why}"),
    }
}

/// tiny-qwen3_5-moe's layer-1 `shared_expert.gate` (eps 1e-5, zero-centred, bf16 weights): one
/// output per row, so few elements to tell orders apart: the planted one must be among those
/// that reproduce it, §2's own must not.
fn shared_gate_by(reference: &Path, scale: f32, dot: Dot) -> Vec<f32> {
    projection(
        reference,
        "tiny-qwen3_5-moe",
        &["hidden_in", "attn_out"],
        "post_attention_layernorm",
        1e-5,
        "mlp.shared_expert_gate",
        false,
        scale,
        dot,
    )
}

#[test]
fn a_planted_order_of_shared_expert_gate_is_named_and_a_scaled_gate_refused() {
    const POST: &str = "post_attention_layernorm: sum of squares sequential (§2)";
    let c = case("tiny-qwen3_5-moe", "shared_expert.gate", |r| {
        shared_gate_by(r, 1.0, fma)
    });
    let out = explain(&c, "layer.01.shared_expert.gate");
    assert!(
        out.contains("layer.01.shared_expert.gate = post_attention_layernorm(layer.01.hidden_in ⊕ layer.01.attn_out) · Wᵀ, W = model.layers.1.mlp.shared_expert_gate.weight [1, 36]"),
        "{out}"
    );
    assert!(
        out.contains(&format!(
            "  reference: REPRODUCED by sequential (§2) | {POST}"
        )),
        "{out}"
    );
    let by = reproduced_by(&c, "layer.01.shared_expert.gate");
    assert!(
        by.iter()
            .any(|o| o.starts_with(&format!("sequential (§2) with FMA | {POST}"))),
        "{by:?}\n{out}"
    );
    assert!(
        !by.iter().any(|o| o.starts_with("sequential (§2) | ")),
        "the plant is indistinguishable from §2 here: {by:?}"
    );
    let c = case("tiny-qwen3_5-moe", "shared_expert.gate", |r| {
        shared_gate_by(r, 1.01, dot)
    });
    let away = refused_by(&explain(&c, "layer.01.shared_expert.gate"));
    assert!(away > 1000, "1 % of a weight: {away} ULP");
}
