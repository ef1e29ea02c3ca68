//! `trace-diff --explain` (docs/diff.md, "Explaining a difference"): the engine's trace of
//! tiny-qwen3 is the reference; each candidate is a copy of it with one tensor recomputed here,
//! from the same inputs, under a planted order (the engine's `matmul_ref_by` with another
//! `dot`, as its own matmul tests plant them) or a planted defect. The order must be named; a
//! defect must be refused; a point that cannot be recomputed says NOT EXPLAINED and why.

use std::path::{Path, PathBuf};

use tracegate_engine::ops::{dot, matmul_ref_by, rmsnorm};
use tracegate_trace::Trace;

use tracegate_diff::explain::Outcome;

pub(crate) use crate::common::plant::{blocked16, copy_with, fma, split_k};
use crate::common::{p, run};

pub(crate) fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../fixtures")
        .join(name)
}

pub(crate) const TOKENS: [i64; 5] = [3, 17, 5, 42, 8];
const HIDDEN: usize = 52;
const VOCAB: usize = 499;

/// The engine's trace of tiny-qwen3 on TOKENS, in `dir`.
fn reference(dir: &Path) -> PathBuf {
    reference_with(dir, 0)
}

/// The same with `generate` decode steps and internals when there are any (the steps'
/// `final_norm.out` is an internal point).
fn reference_with(dir: &Path, generate: usize) -> PathBuf {
    let out = dir.join("reference.trace");
    tracegate_engine::run_trace(&tracegate_engine::TraceOptions {
        model_dir: fixture("tiny-qwen3"),
        tokens: TOKENS.to_vec(),
        out: out.clone(),
        internals: generate > 0,
        generate,
        cache: true,
        threads: 1,
        command_line: vec!["explain test".into()],
        force_decisions: None,
        prompt_text: None,
        shards: None,
    })
    .expect("engine trace of tiny-qwen3");
    out
}

/// `final_norm.out` of the reference and the model's head (tied: the embedding).
fn head_inputs(reference: &Path) -> (Vec<f32>, tracegate_engine::weights::Store) {
    let x = Trace::open(reference)
        .unwrap()
        .f32_vec("final_norm.out")
        .unwrap();
    let store = tracegate_engine::open_store(&fixture("tiny-qwen3")).unwrap();
    (x, store)
}

/// The logits recomputed with `dot` (the head's weights scaled by `scale`).
fn logits_by(reference: &Path, scale: f32, dot: impl Fn(&[f32], &[f32]) -> f32) -> Vec<f32> {
    let (x, store) = head_inputs(reference);
    let w = store
        .take("model.embed_tokens.weight", &[VOCAB, HIDDEN])
        .unwrap();
    let scaled = |a: &[f32], b: &[f32]| {
        let b: Vec<f32> = b.iter().map(|v| v * scale).collect();
        dot(a, &b)
    };
    matmul_ref_by(&x, TOKENS.len(), w, None, scaled)
}

struct Case {
    _dir: tempfile::TempDir,
    reference: PathBuf,
    candidate: PathBuf,
}

fn case(name: &str, make: impl FnOnce(&Path) -> Option<Vec<f32>>) -> Case {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference(dir.path());
    let values = make(&reference);
    let candidate = copy_with(
        &reference,
        &dir.path().join("candidate.trace"),
        name,
        values.as_deref(),
    );
    Case {
        _dir: dir,
        reference,
        candidate,
    }
}

fn explain(c: &Case, model: Option<&str>) -> String {
    let tiny = fixture(model.unwrap_or("tiny-qwen3"));
    let mut args = vec!["--explain", p(&c.reference), p(&c.candidate)];
    if model.is_some() {
        args.extend(["--model", p(&tiny)]);
    }
    let r = run(&args);
    assert_eq!(r.code, 1, "a difference: exit 1\n{}{}", r.stdout, r.stderr);
    r.stdout
}

/// The orders that reproduce the candidate's `tensor`, by the library (all of them; the text
/// names a few).
fn reproduced_by(c: &Case, tensor: &str) -> Vec<String> {
    let e = tracegate_diff::explain::explain(
        &Trace::open(&c.reference).unwrap(),
        &Trace::open(&c.candidate).unwrap(),
        tensor,
        Some(&fixture("tiny-qwen3")),
    );
    match e.outcome {
        Outcome::Checked(k) => k.candidate.reproduced_by,
        Outcome::NotExplained(why) => panic!("not explained: {why}"),
    }
}

/// The line of `out` about the candidate.
pub(crate) fn candidate_line(out: &str) -> &str {
    out.lines()
        .find(|l| l.trim_start().starts_with("candidate: "))
        .unwrap_or_else(|| panic!("no candidate line in\n{out}"))
}

#[test]
fn planted_orders_of_the_head_are_named() {
    for (dot, name) in [
        (split_k as fn(&[f32], &[f32]) -> f32, "split-K 2"),
        (fma, "sequential (§2) with FMA"),
        (blocked16, "blocked-K 16"),
    ] {
        let c = case("logits", |r| Some(logits_by(r, 1.0, dot)));
        let out = explain(&c, Some("tiny-qwen3"));
        assert!(
            candidate_line(&out).starts_with(&format!("  candidate: REPRODUCED by {name}")),
            "{name}:\n{out}"
        );
        // The positive control that runs every time: the ordered reference is §2's order.
        assert!(
            out.contains("  reference: REPRODUCED by sequential (§2)"),
            "{out}"
        );
        // Four differing elements in each of the five rows.
        assert!(out.contains("checked: 20 differing and"), "{out}");
        assert!(out.contains(" in 5 rows "), "{out}");
        assert!(
            out.contains("inputs: final_norm.out of each side, bit-identical"),
            "{out}"
        );
    }
}

#[test]
fn a_decode_step_is_explained_from_its_own_input() {
    let dir = tempfile::tempdir().unwrap();
    let reference = reference_with(dir.path(), 2);
    let t = Trace::open(&reference).unwrap();
    let x = t.f32_vec("decode.0001.final_norm.out").unwrap();
    let store = tracegate_engine::open_store(&fixture("tiny-qwen3")).unwrap();
    let w = store
        .take("model.embed_tokens.weight", &[VOCAB, HIDDEN])
        .unwrap();
    let v = matmul_ref_by(&x, 1, w, None, fma);
    let candidate = copy_with(
        &reference,
        &dir.path().join("candidate.trace"),
        "decode.0001.logits",
        Some(&v),
    );
    let model = fixture("tiny-qwen3");
    let r = run(&[
        "--explain",
        p(&reference),
        p(&candidate),
        "--model",
        p(&model),
    ]);
    assert!(
        r.stdout.contains(
            "explain decode.0001.logits: decode.0001.logits = decode.0001.final_norm.out · Wᵀ"
        ),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert!(
        candidate_line(&r.stdout)
            .starts_with("  candidate: REPRODUCED by sequential (§2) with FMA"),
        "{}",
        r.stdout
    );
}

#[test]
fn a_scaled_head_weight_is_refused() {
    let c = case("logits", |r| Some(logits_by(r, 1.01, dot)));
    let out = explain(&c, Some("tiny-qwen3"));
    let line = candidate_line(&out);
    assert!(line.contains("NOT REPRODUCED — no order tried"), "{out}");
    // 1 % of a logit is far beyond any order's few ULPs.
    let away: u64 = line
        .split(", ")
        .find_map(|s| s.strip_suffix(" ULP away"))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no distance in {line}"));
    assert!(away > 1000, "{line}");
}

/// Adversary: split-K 2 everywhere but one checked element moved one ULP further. Every
/// checked element must hold the order's bits; the one ULP left is a defect and is said so.
#[test]
fn one_ulp_off_in_one_element_is_not_reproduced() {
    let c = case("logits", |r| {
        let want = logits_by(r, 1.0, dot);
        let mut v = logits_by(r, 1.0, split_k);
        // Row 2's second element where split-K differs from §2 (a checked one).
        let i = (2 * VOCAB..3 * VOCAB)
            .filter(|&i| v[i].to_bits() != want[i].to_bits())
            .nth(1)
            .unwrap();
        v[i] = f32::from_bits(v[i].to_bits() + 1);
        Some(v)
    });
    let out = explain(&c, Some("tiny-qwen3"));
    let line = candidate_line(&out);
    assert!(
        line.contains("NOT REPRODUCED") && line.contains("closest: split-K 2, 1 ULP away"),
        "{out}"
    );
}

/// §6 RMSNorm of the last hidden_out written out here: `rsqrt` rounded once instead of
/// `1 ⊘ sqrt`, and the sum of squares in 8 lanes folded in halves.
fn norm_by(reference: &Path, eps: f32, rsqrt_once: bool, lanes: bool) -> Vec<f32> {
    let t = Trace::open(reference).unwrap();
    let x = t.f32_vec("layer.04.hidden_out").unwrap();
    let store = tracegate_engine::open_store(&fixture("tiny-qwen3")).unwrap();
    let w = store.take("model.norm.weight", &[HIDDEN]).unwrap().to_vec();
    let mut out = vec![0.0f32; x.len()];
    for (xr, or) in x.chunks(HIDDEN).zip(out.chunks_mut(HIDDEN)) {
        if !rsqrt_once && !lanes {
            rmsnorm(xr, &w, eps, or);
            continue;
        }
        let ss = if lanes {
            let mut l = [0.0f32; 8];
            for (i, v) in xr.iter().enumerate() {
                l[i % 8] += v * v;
            }
            for n in [4, 2, 1] {
                for i in 0..n {
                    l[i] += l[i + n];
                }
            }
            l[0]
        } else {
            xr.iter().fold(0.0f32, |a, v| a + v * v)
        };
        let t = ss / HIDDEN as f32 + eps;
        let inv = if rsqrt_once {
            (1.0 / (t as f64).sqrt()) as f32
        } else {
            1.0 / t.sqrt()
        };
        for i in 0..HIDDEN {
            or[i] = w[i] * (xr[i] * inv);
        }
    }
    out
}

#[test]
fn planted_norm_orders_are_named() {
    for (rsqrt, lanes, name) in [
        (
            true,
            false,
            "sum of squares sequential (§2), rsqrt rounded once",
        ),
        (false, true, "sum of squares 8 lanes"),
    ] {
        let c = case("final_norm.out", |r| Some(norm_by(r, 1e-6, rsqrt, lanes)));
        let out = explain(&c, Some("tiny-qwen3"));
        assert!(
            candidate_line(&out).starts_with("  candidate: REPRODUCED by "),
            "{name}:\n{out}"
        );
        assert!(
            out.contains("final_norm.out = RMSNorm(layer.04.hidden_out"),
            "{out}"
        );
        // A norm's row shares one reciprocal: other orders may round it the same way on these
        // rows, and are listed beside it; §6's own is never among them (the sides differ).
        let by = reproduced_by(&c, "final_norm.out");
        assert!(by.iter().any(|o| o == name), "{name} not in {by:?}");
        assert!(
            !by.iter().any(|o| o == "sum of squares sequential (§2)"),
            "{by:?}"
        );
    }
}

#[test]
fn a_norm_with_the_wrong_eps_is_refused() {
    // The config says 1e-6; 1e-5 is llama's default, a classic porting slip.
    let c = case("final_norm.out", |r| Some(norm_by(r, 1e-5, false, false)));
    let out = explain(&c, Some("tiny-qwen3"));
    assert!(
        candidate_line(&out).contains("NOT REPRODUCED — no order tried"),
        "{out}"
    );
}

#[test]
fn what_cannot_be_explained_says_why() {
    // A point without a recomputable definition: attn_out's input (p·v) is not captured.
    let c = case("layer.01.attn_out", |r| {
        let mut v = Trace::open(r)
            .unwrap()
            .f32_vec("layer.01.attn_out")
            .unwrap();
        v[3] *= 1.5;
        Some(v)
    });
    let out = explain(&c, Some("tiny-qwen3"));
    assert!(
        out.contains("explain layer.01.attn_out: NOT EXPLAINED — no recomputable definition"),
        "{out}"
    );

    let c = case("logits", |r| Some(logits_by(r, 1.0, split_k)));
    // No --model: the head's weights are not in a trace.
    let out = explain(&c, None);
    assert!(
        out.contains("explain logits: NOT EXPLAINED — no --model DIR"),
        "{out}"
    );
    // Another model's weights: refused by their digest, never recomputed.
    let out = explain(&c, Some("tiny-llama"));
    assert!(
        out.contains("explain logits: NOT EXPLAINED — --model") && out.contains("weights digest"),
        "{out}"
    );

    // The input missing from the candidate (it compares logits only).
    let dir = tempfile::tempdir().unwrap();
    let reference = reference(dir.path());
    let split = logits_by(&reference, 1.0, split_k);
    let mid = copy_with(
        &reference,
        &dir.path().join("mid.trace"),
        "logits",
        Some(&split),
    );
    let candidate = copy_with(&mid, &dir.path().join("cand.trace"), "final_norm.out", None);
    let model = fixture("tiny-qwen3");
    let r = run(&[
        "--explain",
        "--only",
        "logits",
        p(&reference),
        p(&candidate),
        "--model",
        p(&model),
    ]);
    assert!(
        r.stdout.contains(
            "explain logits: NOT EXPLAINED — the candidate trace holds no final_norm.out"
        ),
        "{}{}",
        r.stdout,
        r.stderr
    );

    // Nothing differs: said, never a silent nothing; exit 0 as the comparison's.
    let r = run(&[
        "--explain",
        p(&reference),
        p(&reference),
        "--model",
        p(&model),
    ]);
    assert_eq!(r.code, 0);
    assert!(
        r.stdout
            .contains("NOT EXPLAINED — no tensor differs by bits"),
        "{}",
        r.stdout
    );

    // --model without --explain, --explain with --json: usage errors.
    assert_eq!(
        run(&[p(&reference), p(&reference), "--model", p(&model)]).code,
        2
    );
    assert_eq!(
        run(&["--explain", "--json", p(&reference), p(&reference)]).code,
        2
    );
}
