//! `--explain` inside a layer (docs/diff.md, "Explaining a difference"): the engine's trace of
//! tiny-qwen3 (and tiny-qwen3-moe) under `--capture internals` is the reference; each candidate
//! is a copy with one layer point recomputed here from the reference's captured inputs — the
//! normed input by the engine's §6 RMSNorm, then the projection under a planted order (the
//! engine's `matmul_ref_by` with another `dot`) or with a planted defect. The order must be
//! named; a defect must be refused.

use std::path::{Path, PathBuf};

use tracegate_engine::ops::{dot, matmul_ref_by, rmsnorm_rows};
use tracegate_trace::Trace;

use crate::common::{p, run};
use crate::explain::{blocked16, candidate_line, copy_with, fixture, fma, split_k, TOKENS};

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
/// `matrix` (rows scaled by `scale`, plus its bias when `bias`) under `dot`.
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
    dot: fn(&[f32], &[f32]) -> f32,
) -> Vec<f32> {
    let t = Trace::open(reference).unwrap();
    let l = |point: &str| format!("layer.{LAYER:02}.{point}");
    let mut x = t.f32_vec(&l(inputs[0])).unwrap();
    for extra in &inputs[1..] {
        let y = t.f32_vec(&l(extra)).unwrap();
        x = x.iter().zip(&y).map(|(a, b)| a + b).collect();
    }
    let store = tracegate_engine::open_store(&fixture(model)).unwrap();
    let h = x.len() / TOKENS.len();
    let pre = format!("model.layers.{LAYER}");
    let nw = store
        .take(&format!("{pre}.{norm}.weight"), &[h])
        .unwrap()
        .to_vec();
    let xn = rmsnorm_rows(&x, &nw, eps, false);
    let n = store.shape(&format!("{pre}.{matrix}.weight")).unwrap()[0] as usize;
    let w = store
        .take(&format!("{pre}.{matrix}.weight"), &[n, h])
        .unwrap();
    let b = bias.then(|| {
        store
            .take(&format!("{pre}.{matrix}.bias"), &[n])
            .unwrap()
            .to_vec()
    });
    let scaled = move |a: &[f32], c: &[f32]| {
        let c: Vec<f32> = c.iter().map(|v| v * scale).collect();
        dot(a, &c)
    };
    matmul_ref_by(&xn, TOKENS.len(), w, b.as_deref(), scaled)
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
fn v_by(reference: &Path, eps: f32, scale: f32, dot: fn(&[f32], &[f32]) -> f32) -> Vec<f32> {
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
        assert!(out.contains("32400 orders tried"), "{out}");
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
