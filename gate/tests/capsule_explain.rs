//! `gate capsule explain` (docs/diff.md, "Explaining a difference"): a capsule with every row of
//! the defective contract's `mlp-add` (layer 02, captured with internals); candidate traces are
//! its reference.trace with `layer.02.v` recomputed here from the capsule's own `hidden_in` and
//! `layer.safetensors` under a planted order (diff/tests/common/plant.rs, shared by path). The
//! order must be named through the capsule's replay model; a ×1.01 v_proj refused; a point the
//! explainer cannot recompute said NOT EXPLAINED; a capsule whose layer.safetensors was changed
//! refused before anything is explained, also when its manifest was re-sealed over the change.

#[allow(dead_code)]
#[path = "../../diff/tests/common/plant.rs"]
mod plant;

use std::path::{Path, PathBuf};

use serde_json::Value;
use sha2::Digest as _;

use tracegate_engine::ops::dot;

use crate::common::{self, defective, repo};
use plant::{copy_with, split_k, summed, Dot, Projection};

const V: &str = "layer.02.v";

/// `gate bisect --capsule DIR --capsule-full` of the `mlp-add` defect on tiny-qwen3 (as
/// tests/capsule.rs writes it): the capsule's directory.
fn full_capsule(tmp: &Path) -> PathBuf {
    let cap = tmp.join("capsule");
    let cand = defective("mlp-add");
    let b = common::bisect(
        &tmp.join("work"),
        &tmp.join("report.json"),
        &[
            "--model",
            "fixtures/tiny-qwen3",
            "--prompt",
            "short",
            "--reference",
            "engine",
            "--capture",
            "internals",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            &cand,
            "--capsule",
            cap.to_str().unwrap(),
            "--capsule-full",
        ],
    );
    assert!(b.stdout.contains("capsule written to"), "{}", b.stdout);
    cap
}

/// `layer.02.v` of the capsule's rows: `v_proj(input_layernorm(hidden_in)) + bias` from the
/// capsule's own files (tiny-qwen3: eps 1e-6, attention_bias), v_proj's rows scaled by `scale`.
fn v_of(cap: &Path, scratch: &Path, scale: f32, dot: Dot) -> Vec<f32> {
    // The engine's loader reads a checkpoint directory: the layer file as its one file.
    std::fs::create_dir_all(scratch).unwrap();
    std::fs::copy(
        cap.join("layer.safetensors"),
        scratch.join("model.safetensors"),
    )
    .unwrap();
    let store = tracegate_engine::open_store(scratch).unwrap();
    let x = summed(&cap.join("reference.trace"), &["layer.02.hidden_in".into()]);
    Projection {
        layer: "model.layers.2",
        norm: "input_layernorm",
        eps: 1e-6,
        zero_centred: false,
        matrix: "self_attn.v_proj",
        bias: true,
        scale,
    }
    .of(&x, &store, dot)
}

/// `gate capsule explain CAP --candidate-trace CAND [extra]` from `tmp` (not the root): exit
/// code and stdout + stderr.
fn explain(tmp: &Path, cap: &Path, cand: &Path, extra: &[&str]) -> (i32, String) {
    let out = common::gate()
        .current_dir(tmp)
        .args(["--root", repo().to_str().unwrap(), "capsule", "explain"])
        .arg(cap)
        .arg("--candidate-trace")
        .arg(cand)
        .args(["--work", tmp.join("replay").to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code().unwrap_or(-1), text)
}

fn candidate_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.starts_with("  candidate: "))
        .unwrap_or_else(|| panic!("no candidate line in\n{out}"))
}

fn sha256_hex(p: &Path) -> String {
    hex::encode(sha2::Sha256::digest(std::fs::read(p).unwrap()))
}

/// A copy of the capsule with the last byte of layer.safetensors (a weight's, not the header's)
/// flipped; `reseal`: its manifest then records the changed file's sha256, and manifest.sha256
/// the manifest's, as an editor covering their tracks would.
fn tampered(tmp: &Path, cap: &Path, name: &str, reseal: bool) -> PathBuf {
    let to = tmp.join(name);
    common::copy_dir(cap, &to);
    let lf = to.join("layer.safetensors");
    let mut bytes = std::fs::read(&lf).unwrap();
    *bytes.last_mut().unwrap() ^= 0x40;
    std::fs::write(&lf, bytes).unwrap();
    if reseal {
        let mp = to.join("manifest.json");
        let mut m: Value = serde_json::from_slice(&std::fs::read(&mp).unwrap()).unwrap();
        m["files"]["layer.safetensors"] = Value::String(sha256_hex(&lf));
        std::fs::write(&mp, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
        let line = format!("{}  manifest.json\n", sha256_hex(&mp));
        std::fs::write(to.join("manifest.sha256"), line).unwrap();
    }
    to
}

const SIX: &str = "input_layernorm: sum of squares sequential (§2)";

#[test]
fn a_capsule_explains_a_planted_order_and_refuses_a_defect_and_a_changed_layer_file() {
    let tmp = tempfile::tempdir_in(repo().join("target")).unwrap();
    let t = tmp.path();
    let cap = full_capsule(t);
    let reference = cap.join("reference.trace");

    // Split-K 2: named, through the replay model (no model directory).
    let values = v_of(&cap, &t.join("w"), 1.0, split_k);
    let cand = copy_with(&reference, &t.join("split.trace"), V, Some(&values));
    let (code, out) = explain(t, &cap, &cand, &[]);
    assert_eq!(code, 1, "a difference: trace-diff's exit 1\n{out}");
    assert!(
        out.contains("explain layer.02.v: layer.02.v = input_layernorm(layer.02.hidden_in) · Wᵀ + bias, W = model.layers.2.self_attn.v_proj.weight [24, 52]"),
        "{out}"
    );
    assert!(
        out.contains("weights: digest equal to both traces'"),
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

    // v_proj × 1.01: no order reproduces it (--only picks the tensor, as trace-diff's).
    let values = v_of(&cap, &t.join("w"), 1.01, dot);
    let cand = copy_with(&reference, &t.join("scaled.trace"), V, Some(&values));
    let (code, out) = explain(t, &cap, &cand, &["--only", V]);
    assert_eq!(code, 1, "{out}");
    assert!(
        candidate_line(&out).contains("NOT REPRODUCED — no order tried"),
        "{out}"
    );

    // The explainer's own refusal passes through: q has no recomputable definition.
    let mut q = summed(&reference, &["layer.02.q".into()]);
    q[0] *= 1.5;
    let cand = copy_with(&reference, &t.join("q.trace"), "layer.02.q", Some(&q));
    let (code, out) = explain(t, &cap, &cand, &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("explain layer.02.q: NOT EXPLAINED — no recomputable definition"),
        "{out}"
    );

    // A changed layer file: refused (exit 2) before anything is explained, by its sha256, and
    // with the manifest re-sealed over it, by the replay model's weights digest.
    let cand = t.join("split.trace");
    for (name, reseal, why) in [
        ("changed", false, "layer.safetensors was changed"),
        ("resealed", true, "the replay model's weights digest is"),
    ] {
        let bad = tampered(t, &cap, name, reseal);
        let (code, out) = explain(t, &bad, &cand, &[]);
        assert_eq!(code, 2, "{name}: {out}");
        assert!(out.contains(why), "{name}: {out}");
        assert!(!out.contains("explain layer"), "{name}: {out}");
    }
}
