//! Diffusion Gemma (docs/diffusion-gemma.md) on fixtures/tiny-diffusion-gemma: the DG16 names in
//! DG16 order with their attributes and decision shapes (expected lists built from config facts
//! and the stop decisions read back), the step semantics recomputed here from the trace's own
//! tensors, forcing (DG17), the refusals, and --threads independence. The SplitMix64 vectors of
//! DG15.5 are unit tests in engine/src/splitmix.rs.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_engine::{run_layer, run_trace_with, DiffusionOptions, LayerOptions, TraceOptions};
use tracegate_trace::{names, Trace, TraceWriter};

use crate::common::layer_opts;

// 10 tokens: past the sliding window (W = 5), so the windows and the decoder's W−1 prefix bite.
const PROMPT: [i64; 10] = [2, 17, 45, 300, 8, 99, 100, 7, 250, 31];

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-diffusion-gemma")
}

/// The config facts the expected lists are built from (read from the fixture's JSON here).
struct Facts {
    layers: usize,
    sliding: Vec<bool>,
    window: usize,
    canvas: usize,
    vocab: usize,
    heads: usize,
    top_k: usize,
    experts: usize,
    steps: usize,
}

fn facts() -> Facts {
    let cfg: Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    let gen: Value =
        serde_json::from_slice(&std::fs::read(fixture().join("generation_config.json")).unwrap())
            .unwrap();
    let t = &cfg["text_config"];
    let n = t["num_hidden_layers"].as_u64().unwrap() as usize;
    let mut sliding: Vec<bool> = t["layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k == "sliding_attention")
        .collect();
    sliding[n - 1] = false;
    let u = |v: &Value| v.as_u64().unwrap() as usize;
    Facts {
        layers: n,
        sliding,
        window: u(&t["sliding_window"]),
        canvas: u(&cfg["canvas_length"]),
        vocab: u(&t["vocab_size"]),
        heads: u(&t["num_attention_heads"]),
        top_k: u(&t["top_k_experts"]),
        experts: u(&t["num_experts"]),
        steps: u(&gen["max_denoising_steps"]),
    }
}

fn opts(out: PathBuf, internals: bool, threads: usize, force: Option<&Path>) -> TraceOptions {
    TraceOptions {
        model_dir: fixture(),
        tokens: PROMPT.to_vec(),
        out,
        internals,
        generate: 14,
        cache: true,
        threads,
        command_line: vec![],
        force_decisions: force.map(Path::to_path_buf),
        prompt_text: None,
        shards: None,
    }
}

fn seed3() -> DiffusionOptions {
    DiffusionOptions {
        seed: Some(3),
        ..Default::default()
    }
}

fn run(dir: &Path, name: &str, internals: bool, threads: usize, force: Option<&Path>) -> Trace {
    let out = dir.join(name);
    run_trace_with(&opts(out.clone(), internals, threads, force), &seed3()).unwrap();
    Trace::open(out).unwrap()
}

fn values(t: &Trace, name: &str) -> Vec<i64> {
    t.decision_values(
        t.decision_info(name)
            .unwrap_or_else(|| panic!("no decision {name}")),
    )
}

fn margins(t: &Trace, name: &str) -> Option<Vec<f32>> {
    t.decision_margins(t.decision_info(name).unwrap())
}

fn f32s(t: &Trace, name: &str) -> Vec<f32> {
    t.f32_vec(name)
        .unwrap_or_else(|e| panic!("tensor {name}: {e}"))
}

fn i64s(t: &Trace, name: &str) -> Vec<i64> {
    let i = t.tensor_info(name).unwrap();
    t.data(i)
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
        .collect()
}

/// Steps run per block, read back from the stop decisions: a block ends at the first stop = 1
/// or after N steps.
fn steps_per_block(t: &Trace, f: &Facts, blocks: usize) -> Vec<usize> {
    (0..blocks)
        .map(|b| {
            let mut s = 0;
            loop {
                let stop = values(t, &names::denoise(b, s, "stop"));
                s += 1;
                if stop[2] == 1 || s == f.steps {
                    return s;
                }
            }
        })
        .collect()
}

const DEFAULT_LAYER: [&str; 6] = [
    "hidden_in",
    "attn_out",
    "dense_mlp.branch",
    "moe.branch",
    "mlp_out",
    "hidden_out",
];

/// Expected (name, path, mask, positions) of every tensor, in DG16 order; `experts(prefix, l)`
/// gives the experts with routed rows (internals only).
fn expected_tensors(
    t: &Trace,
    f: &Facts,
    internals: bool,
) -> Vec<(String, &'static str, String, Vec<i64>)> {
    let n = PROMPT.len();
    let blocks = 14usize.div_ceil(f.canvas);
    let steps = steps_per_block(t, f, blocks);
    let mut out = vec![];
    let layer_points = |prefix: &dyn Fn(&str) -> String, l: usize| -> Vec<String> {
        if !internals {
            return DEFAULT_LAYER
                .iter()
                .map(|p| prefix(&names::layer(l, p)))
                .collect();
        }
        let topk = values(t, &prefix(&names::layer(l, "router.topk")));
        let mut v: Vec<String> = [
            "hidden_in",
            "q",
            "k",
            "v",
            "attn_probs",
            "attn_out",
            "attn_residual",
            "dense_mlp.out",
            "dense_mlp.branch",
            "router.logits",
        ]
        .iter()
        .map(|p| prefix(&names::layer(l, p)))
        .collect();
        for e in 0..f.experts {
            if topk.contains(&(e as i64)) {
                v.push(prefix(&names::expert(l, e, "out")));
            }
        }
        for p in ["moe.out", "moe.branch", "mlp_out", "hidden_out"] {
            v.push(prefix(&names::layer(l, p)));
        }
        v
    };
    let enc_mask = |l: Option<usize>| match l {
        Some(l) if f.sliding[l] => format!("sliding:{}", f.window),
        _ => "causal".to_string(),
    };
    let dec_mask = |l: Option<usize>| match l {
        Some(l) if f.sliding[l] => format!("bidirectional,sliding:{}", f.window),
        _ => "bidirectional".to_string(),
    };
    // The prompt.
    let ppos: Vec<i64> = (0..n as i64).collect();
    let bare = |s: &str| s.to_string();
    out.push((
        "embed.out".to_string(),
        "encode",
        enc_mask(None),
        ppos.clone(),
    ));
    for l in 0..f.layers {
        for name in layer_points(&bare, l) {
            out.push((name, "encode", enc_mask(Some(l)), ppos.clone()));
        }
    }
    for (b, &ns) in steps.iter().enumerate() {
        let l0 = n + b * f.canvas;
        let pos: Vec<i64> = (l0 as i64..(l0 + f.canvas) as i64).collect();
        for s in 0..ns {
            let pre = |r: &str| names::denoise(b, s, r);
            out.push((pre("canvas"), "denoise", dec_mask(None), pos.clone()));
            out.push((pre("embed.out"), "denoise", dec_mask(None), pos.clone()));
            out.push((pre("sc.soft"), "denoise", dec_mask(None), pos.clone()));
            if internals {
                out.push((pre("sc.mlp_out"), "denoise", dec_mask(None), pos.clone()));
            }
            out.push((pre("sc.out"), "denoise", dec_mask(None), pos.clone()));
            for l in 0..f.layers {
                for name in layer_points(&pre, l) {
                    out.push((name, "denoise", dec_mask(Some(l)), pos.clone()));
                }
            }
            let mut tail = vec!["final_norm.out"];
            if internals {
                tail.push("logits.uncapped");
            }
            tail.extend(["logits", "logits.tempered", "entropy"]);
            for p in tail {
                out.push((pre(p), "denoise", dec_mask(None), pos.clone()));
            }
        }
        if b + 1 < blocks {
            let pre = |r: &str| names::encode(b, r);
            out.push((pre("embed.out"), "encode", enc_mask(None), pos.clone()));
            for l in 0..f.layers {
                for name in layer_points(&pre, l) {
                    out.push((name, "encode", enc_mask(Some(l)), pos.clone()));
                }
            }
        }
    }
    out
}

fn expected_decisions(t: &Trace, f: &Facts) -> Vec<(String, Vec<u64>)> {
    let (n, c, k) = (PROMPT.len() as u64, f.canvas as u64, f.top_k as u64);
    let blocks = 14usize.div_ceil(f.canvas);
    let steps = steps_per_block(t, f, blocks);
    let mut out = vec![];
    for l in 0..f.layers {
        out.push((names::layer(l, "router.topk"), vec![n, k]));
    }
    for (b, &ns) in steps.iter().enumerate() {
        out.push((names::denoise_block(b, "init_canvas"), vec![c]));
        for s in 0..ns {
            for l in 0..f.layers {
                out.push((
                    names::denoise(b, s, &names::layer(l, "router.topk")),
                    vec![c, k],
                ));
            }
            for p in ["argmax", "sampled", "accept", "renoise"] {
                out.push((names::denoise(b, s, p), vec![c]));
            }
            out.push((names::denoise(b, s, "stop"), vec![3]));
        }
        out.push((names::denoise_block(b, "commit"), vec![c]));
        if b + 1 < blocks {
            for l in 0..f.layers {
                out.push((
                    names::encode(b, &names::layer(l, "router.topk")),
                    vec![c, k],
                ));
            }
        }
    }
    out
}

fn check_structure(t: &Trace, f: &Facts, internals: bool) {
    let want = expected_tensors(t, f, internals);
    let got: Vec<&str> = t.tensors().iter().map(|i| i.name.as_str()).collect();
    let want_names: Vec<&str> = want.iter().map(|w| w.0.as_str()).collect();
    assert_eq!(
        got, want_names,
        "tensor names and order (internals {internals})"
    );
    for (info, (name, path, mask, pos)) in t.tensors().iter().zip(&want) {
        let a = &info.attributes;
        assert_eq!(a.path.as_deref(), Some(*path), "{name} path");
        assert_eq!(a.mask.as_deref(), Some(mask.as_str()), "{name} mask");
        let shape = &info.shape;
        // Positions: one per row of the token axis (expert outputs: the routed rows only).
        let p = a.positions.as_ref().unwrap();
        if name.contains(".expert.") {
            assert!(p.iter().all(|x| pos.contains(x)), "{name} positions");
        } else {
            assert_eq!(p, pos, "{name} positions");
        }
        let want_dtype = if name.ends_with(".canvas") {
            "i64"
        } else {
            "f32"
        };
        assert_eq!(info.dtype.to_string(), want_dtype, "{name} dtype");
        if name.ends_with("attn_probs") {
            // Keys: the cached rows the layer reads, then the call's own.
            let l: usize = name.split("layer.").nth(1).unwrap()[..2].parse().unwrap();
            let own = pos.len();
            let cached = pos[0] as usize;
            let keys = if name.starts_with("denoise.") && f.sliding[l] {
                cached.min(f.window - 1) + own
            } else {
                cached + own
            };
            assert_eq!(shape, &[f.heads as u64, own as u64, keys as u64], "{name}");
        }
        if !name.contains("layer.")
            && (name.ends_with(".logits") || name.ends_with("logits.tempered"))
        {
            assert_eq!(shape, &[f.canvas as u64, f.vocab as u64], "{name}");
        }
    }
    let want = expected_decisions(t, f);
    let got: Vec<(String, Vec<u64>)> = t
        .decisions()
        .iter()
        .map(|d| (d.name.clone(), d.shape.clone()))
        .collect();
    assert_eq!(got, want, "decision names, order and shapes");
    for d in t.decisions() {
        let no_margins = d.name.ends_with("init_canvas") || d.name.ends_with("renoise");
        assert_eq!(
            t.decision_margins(d).is_none(),
            no_margins,
            "{} margins",
            d.name
        );
    }
}

#[test]
fn names_order_attributes_provenance_threads() {
    let tmp = tempfile::tempdir().unwrap();
    let f = facts();
    let t = run(tmp.path(), "a.trace", false, 1, None);
    check_structure(&t, &f, false);
    let p = t.provenance();
    assert_eq!(p["rng"], "splitmix64-dg15");
    assert_eq!(p["seed"], 3);
    assert_eq!(p["blocks"], 2);
    let g = &p["generation"];
    for (k, v) in [
        ("max_new_tokens", json!(14)),
        ("canvas_length", json!(f.canvas)),
        ("max_denoising_steps", json!(f.steps)),
        ("entropy_bound", json!(0.3)),
        ("t_max", json!(0.8)),
        ("t_min", json!(0.4)),
        ("stability_threshold", json!(1)),
        ("confidence_threshold", json!(0.05)),
        ("eos_token_id", Value::Null),
        ("pad_token_id", Value::Null),
    ] {
        assert_eq!(g[k], v, "generation.{k}");
    }
    // No EOS: the output is the two commits, whole.
    let mut commits = values(&t, "denoise.0000.commit");
    commits.extend(values(&t, "denoise.0001.commit"));
    assert_eq!(p["output_tokens"], json!(commits));

    let ti = run(tmp.path(), "i.trace", true, 1, None);
    check_structure(&ti, &f, true);
    // Internals add points only: every default tensor keeps its bits.
    for i in t.tensors() {
        assert_eq!(
            t.data(i),
            ti.data(ti.tensor_info(&i.name).unwrap()),
            "{}",
            i.name
        );
    }
    let t2 = run(tmp.path(), "b.trace", false, 2, None);
    assert_eq!(t.digest(), t2.digest(), "--threads 1 and 2");
}

/// DG12.1's T_s for step s of N, in f32 as the spec writes it.
fn temperature(s: usize, n: usize, t_min: f64, t_max: f64) -> f32 {
    (t_min as f32) + ((t_max - t_min) as f32) * (((n - s) as f32) / (n as f32))
}

#[test]
fn step_semantics_from_the_trace() {
    // The checkpoint's knobs, and a hot schedule whose last steps sample away from the argmax
    // (so `commit = argmax, not sampled` is checked where the two differ).
    let mut saw_commit_not_sampled = false;
    for (t_min, t_max) in [(0.4, 0.8), (2.0, 3.0)] {
        saw_commit_not_sampled |= step_semantics(t_min, t_max);
    }
    assert!(saw_commit_not_sampled);
}

/// Checks one run's steps from its tensors and decisions; says whether some commit differs
/// from its step's sampled canvas.
fn step_semantics(t_min: f64, t_max: f64) -> bool {
    let tmp = tempfile::tempdir().unwrap();
    let f = facts();
    let out = tmp.path().join("a.trace");
    let d = DiffusionOptions {
        seed: Some(3),
        t_min: Some(t_min),
        t_max: Some(t_max),
        ..Default::default()
    };
    run_trace_with(&opts(out.clone(), false, 2, None), &d).unwrap();
    let t = Trace::open(&out).unwrap();
    let (c, v) = (f.canvas, f.vocab);
    let beta = 0.3f32;
    let steps = steps_per_block(&t, &f, 2);
    let mut saw_reject = false;
    let mut commit_not_sampled = false;
    for (b, &ns) in steps.iter().enumerate() {
        let mut prev_argmax: Vec<Vec<i64>> = vec![];
        for s in 0..ns {
            let name = |p: &str| names::denoise(b, s, p);
            if s == 0 {
                assert!(
                    f32s(&t, &name("sc.soft")).iter().all(|x| x.to_bits() == 0),
                    "sc.soft is +0.0 at step 0"
                );
                assert_eq!(
                    i64s(&t, &name("canvas")),
                    values(&t, &names::denoise_block(b, "init_canvas"))
                );
            } else {
                assert!(f32s(&t, &name("sc.soft")).iter().any(|&x| x != 0.0));
            }
            // tempered = logits ⊘ T_s
            let logits = f32s(&t, &name("logits"));
            let tempered = f32s(&t, &name("logits.tempered"));
            let temp = temperature(s, f.steps, t_min, t_max);
            for (i, (&a, &b)) in logits.iter().zip(&tempered).enumerate() {
                assert_eq!(
                    (a / temp).to_bits(),
                    b.to_bits(),
                    "{} [{i}]",
                    name("logits.tempered")
                );
            }
            // argmax of the tempered rows, ties to the lowest index.
            let argmax = values(&t, &name("argmax"));
            for r in 0..c {
                let row = &tempered[r * v..(r + 1) * v];
                let best = (0..v).fold(0, |bi, i| if row[i] > row[bi] { i } else { bi });
                assert_eq!(argmax[r], best as i64, "{} row {r}", name("argmax"));
            }
            // accept from the entropies: rank ascending, x_j = S_j ⊖ H ≤ β.
            let h = f32s(&t, &name("entropy"));
            let mut order: Vec<usize> = (0..c).collect();
            order.sort_by(|&a, &b| h[a].partial_cmp(&h[b]).unwrap());
            let mut sum = 0.0f32;
            let mut want_accept = vec![0i64; c];
            for &r in &order {
                sum += h[r];
                want_accept[r] = i64::from(sum - h[r] <= beta);
            }
            let accept = values(&t, &name("accept"));
            assert_eq!(accept, want_accept, "{}", name("accept"));
            saw_reject |= accept.contains(&0);
            // renoise: −1 exactly where accepted; the next canvas.
            let sampled = values(&t, &name("sampled"));
            let renoise = values(&t, &name("renoise"));
            let next: Vec<i64> = (0..c)
                .map(|r| {
                    assert_eq!(
                        renoise[r] == -1,
                        accept[r] == 1,
                        "{} row {r}",
                        name("renoise")
                    );
                    if accept[r] == 1 {
                        sampled[r]
                    } else {
                        renoise[r]
                    }
                })
                .collect();
            if s + 1 < ns {
                assert_eq!(i64s(&t, &names::denoise(b, s + 1, "canvas")), next);
            }
            // stop: row 2 = row 0 AND row 1; stable = the previous step's argmax repeated (S = 1).
            let stop = values(&t, &name("stop"));
            assert_eq!(stop[2], stop[0] & stop[1], "{}", name("stop"));
            let stable = prev_argmax.last() == Some(&argmax);
            assert_eq!(stop[0], i64::from(stable), "{} stable", name("stop"));
            let mu = h.iter().fold(0.0f32, |a, &x| a + x) / c as f32;
            assert_eq!(
                stop[1],
                i64::from(mu < 0.05f32),
                "{} confident",
                name("stop")
            );
            prev_argmax.push(argmax);
        }
        // commit = the last step's argmax, with its margins.
        let last = |p: &str| names::denoise(b, ns - 1, p);
        let commit = names::denoise_block(b, "commit");
        assert_eq!(values(&t, &commit), values(&t, &last("argmax")));
        assert_eq!(margins(&t, &commit), margins(&t, &last("argmax")));
        commit_not_sampled |= values(&t, &commit) != values(&t, &last("sampled"));
    }
    assert!(saw_reject, "the run exercises renoising");
    commit_not_sampled
}

/// A copy of `t` with `edit` applied to its decisions (values only; margins kept) and
/// decisions named in `drop` left out.
fn altered(t: &Trace, out: &Path, drop: &str, edit: impl Fn(&str, &mut Vec<i64>)) -> PathBuf {
    let mut w = TraceWriter::create(out, t.provenance().clone()).unwrap();
    for i in t.tensors() {
        w.tensor(&i.name, i.dtype, &i.shape, t.data(i), &i.attributes)
            .unwrap();
    }
    for d in t.decisions().iter().filter(|d| d.name != drop) {
        let mut v = t.decision_values(d);
        edit(&d.name, &mut v);
        w.decision(&d.name, &d.shape, &v, t.decision_margins(d).as_deref())
            .unwrap();
    }
    w.finish().unwrap();
    out.to_path_buf()
}

fn refusal(o: TraceOptions, d: &DiffusionOptions) -> String {
    let out = o.out.clone();
    let e = run_trace_with(&o, d).expect_err("refused").to_string();
    assert!(!out.exists(), "a refused run writes nothing: {e}");
    assert_eq!(e.lines().count(), 1, "{e}");
    e
}

#[test]
fn forcing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let f = facts();
    let own = run(dir, "own.trace", true, 2, None);
    let own_path = dir.join("own.trace");
    // Forced by its own trace: the same bits and decisions; nothing overridden.
    let forced = run(dir, "forced.trace", true, 2, Some(&own_path));
    assert_eq!(
        own.tensors().iter().map(|i| &i.name).collect::<Vec<_>>(),
        forced.tensors().iter().map(|i| &i.name).collect::<Vec<_>>()
    );
    for i in own.tensors() {
        assert_eq!(
            own.data(i),
            forced.data(forced.tensor_info(&i.name).unwrap()),
            "{}",
            i.name
        );
    }
    for d in own.decisions() {
        assert_eq!(
            values(&own, &d.name),
            values(&forced, &d.name),
            "{}",
            d.name
        );
        assert_eq!(
            margins(&own, &d.name),
            margins(&forced, &d.name),
            "{}",
            d.name
        );
    }
    let fp = &forced.provenance()["forced_decisions"];
    assert_eq!(fp["rows_overridden"], 0);
    assert_eq!(fp["overridden"], serde_json::json!({}));
    assert_eq!(fp["overridden_rows"], serde_json::json!({}));
    assert_eq!(fp["trace_digest"], own.digest().hex());
    let listed: Vec<&str> = fp["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(
        listed.contains(&"denoise.0000.init_canvas")
            && listed.contains(&"denoise.0000.0001.sampled")
    );
    assert!(
        !listed.iter().any(|n| n.ends_with("commit")),
        "commit is not read"
    );

    // One sampled token changed where accepted: the next canvas carries it.
    let (b, mut s, mut r) = (0usize, 0usize, None);
    let ns = steps_per_block(&own, &f, 2)[0];
    while r.is_none() && s + 1 < ns {
        r = values(&own, &names::denoise(b, s, "accept"))
            .iter()
            .position(|&a| a == 1);
        if r.is_none() {
            s += 1;
        }
    }
    let r = r.expect("an accepted row before the last step");
    let target = names::denoise(b, s, "sampled");
    let old = values(&own, &target)[r];
    let new = (old + 1) % f.vocab as i64;
    let edited = altered(&own, &dir.join("edited.trace"), "", |n, v| {
        if n == target {
            v[r] = new
        }
    });
    let e = run(dir, "e.trace", true, 2, Some(&edited));
    let next = names::denoise(b, s + 1, "canvas");
    assert_eq!(i64s(&own, &next)[r], old);
    assert_eq!(
        i64s(&e, &next)[r],
        new,
        "{next} row {r} follows the forced sampled token"
    );
    assert_eq!(values(&e, &target)[r], new);
    assert_ne!(
        own.data(
            own.tensor_info(&names::denoise(b, s + 1, "embed.out"))
                .unwrap()
        ),
        e.data(
            e.tensor_info(&names::denoise(b, s + 1, "embed.out"))
                .unwrap()
        )
    );

    // A draw has no choice of the engine's own to override: none listed.
    let fp = &e.provenance()["forced_decisions"];
    assert!(fp["overridden_rows"].get(&target).is_none(), "{fp}");

    // Row 0 of the first step's argmax forced to another token: that row is listed as
    // overridden (docs/producers.md, "Recorded."), with the engine's own margin for it, < 0.
    let am = names::denoise(0, 0, "argmax");
    let tok = values(&own, &am)[0];
    let edited = altered(&own, &dir.join("argmax.trace"), "", |n, v| {
        if n == am {
            v[0] = (tok + 1) % f.vocab as i64
        }
    });
    let a = run(dir, "a.trace", true, 2, Some(&edited));
    let fp = &a.provenance()["forced_decisions"];
    assert_eq!(fp["overridden_rows"][&am], serde_json::json!([0]), "{fp}");
    assert_eq!(fp["overridden"][&am], 1, "{fp}");
    assert!(margins(&a, &am).unwrap()[0] < 0.0);

    // A decision the run needs, missing: refused naming it.
    let missing = names::denoise(0, 1, "accept");
    let m = altered(&own, &dir.join("missing.trace"), &missing, |_, _| {});
    let err = refusal(opts(dir.join("x.trace"), true, 2, Some(&m)), &seed3());
    assert!(err.contains(&missing) && err.contains("missing"), "{err}");
    // A commit REF's forced argmax does not give: refused.
    let bad = altered(&own, &dir.join("commit.trace"), "", |n, v| {
        if n == "denoise.0000.commit" {
            v[0] = (v[0] + 1) % 509
        }
    });
    let err = refusal(opts(dir.join("x.trace"), true, 2, Some(&bad)), &seed3());
    assert!(err.contains("denoise.0000.commit"), "{err}");
}

#[test]
fn refusals() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let out = || dir.join("x.trace");
    let knob = |d: DiffusionOptions, what: &str| {
        let e = refusal(opts(out(), false, 1, None), &d);
        assert!(e.contains(what), "{what}: {e}");
    };
    knob(
        DiffusionOptions {
            denoising_steps: Some(0),
            ..Default::default()
        },
        "max_denoising_steps",
    );
    knob(
        DiffusionOptions {
            t_max: Some(0.3),
            ..Default::default()
        },
        "t_max",
    );
    knob(
        DiffusionOptions {
            t_min: Some(-0.1),
            ..Default::default()
        },
        "t_min",
    );
    knob(
        DiffusionOptions {
            entropy_bound: Some(0.0),
            ..Default::default()
        },
        "entropy_bound",
    );
    knob(
        DiffusionOptions {
            confidence_threshold: Some(-1.0),
            ..Default::default()
        },
        "confidence_threshold",
    );
    knob(
        DiffusionOptions {
            eos: Some(vec![509]),
            ..Default::default()
        },
        "509",
    );
    // --cache off.
    let e = refusal(
        TraceOptions {
            cache: false,
            ..opts(out(), false, 1, None)
        },
        &DiffusionOptions::default(),
    );
    assert!(e.contains("--cache off"), "{e}");
    // The new flags on another family.
    let qwen = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/tiny-qwen3");
    let e = refusal(
        TraceOptions {
            model_dir: qwen,
            tokens: vec![1, 2, 3],
            generate: 0,
            ..opts(out(), false, 1, None)
        },
        &DiffusionOptions {
            seed: Some(1),
            t_max: Some(0.9),
            ..Default::default()
        },
    );
    assert!(
        e.contains("--seed, --t-max") && e.contains("diffusion_gemma"),
        "{e}"
    );
    // A bidirectional encoder (use_bidirectional_attention "all").
    let copy = dir.join("all");
    std::fs::create_dir(&copy).unwrap();
    for file in ["model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture().join(file), copy.join(file)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_slice(&std::fs::read(fixture().join("config.json")).unwrap()).unwrap();
    cfg["text_config"]["use_bidirectional_attention"] = json!("all");
    std::fs::write(copy.join("config.json"), cfg.to_string()).unwrap();
    let e = refusal(
        TraceOptions {
            model_dir: copy.clone(),
            ..opts(out(), false, 1, None)
        },
        &DiffusionOptions::default(),
    );
    assert!(e.contains("use_bidirectional_attention"), "{e}");
    // The same copy with "vision" runs (a causal encoder on token ids): the refusal is the field's.
    cfg["text_config"]["use_bidirectional_attention"] = json!("vision");
    std::fs::write(copy.join("config.json"), cfg.to_string()).unwrap();
    run_trace_with(
        &TraceOptions {
            model_dir: copy,
            ..opts(out(), false, 1, None)
        },
        &DiffusionOptions::default(),
    )
    .unwrap();

    // The CLI: exit 2, one line; `layer` refuses in one line; `info` works.
    let engine = env!("CARGO_BIN_EXE_engine");
    let o = std::process::Command::new(engine)
        .args(["trace", "--model"])
        .arg(fixture())
        .args([
            "--tokens",
            "2,17",
            "--generate",
            "7",
            "--entropy-bound",
            "-1",
            "--out",
        ])
        .arg(dir.join("cli.trace"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("entropy_bound"), "{err}");
    let o = std::process::Command::new(engine)
        .args(["layer", "--model"])
        .arg(fixture())
        .args(["--layer", "0", "--input"])
        .arg(dir.join("none.trace"))
        .args(["--input-name", "embed.out", "--out"])
        .arg(dir.join("layer.trace"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8(o.stderr).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.contains("embed.out: not layer 0's input of a pass"),
        "{err}"
    );
    let o = std::process::Command::new(engine)
        .args(["info", "--model"])
        .arg(fixture())
        .output()
        .unwrap();
    assert!(o.status.success());
    let info = String::from_utf8(o.stdout).unwrap();
    assert!(
        info.contains("family diffusion_gemma") && info.contains("weights_digest"),
        "{info}"
    );
}

#[test]
fn generation_length_and_eos() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let f = facts();
    // --generate 0: the prompt's encoder pass only.
    let out = dir.join("g0.trace");
    run_trace_with(
        &TraceOptions {
            generate: 0,
            ..opts(out.clone(), false, 1, None)
        },
        &seed3(),
    )
    .unwrap();
    let t = Trace::open(&out).unwrap();
    assert_eq!(t.provenance()["blocks"], 0);
    assert!(t.tensors().iter().all(|i| !i.name.starts_with("denoise.")));
    // --generate 8 = two whole canvases of 7 (never truncated).
    let out = dir.join("g8.trace");
    run_trace_with(
        &TraceOptions {
            generate: 8,
            ..opts(out.clone(), false, 1, None)
        },
        &seed3(),
    )
    .unwrap();
    let t8 = Trace::open(&out).unwrap();
    assert_eq!(
        t8.provenance()["output_tokens"].as_array().unwrap().len(),
        2 * f.canvas
    );
    // EOS = block 0's first committed token that recurs later in the commit: generation ends
    // after block 0, the tokens after the first EOS become the pad, and no commit pass runs.
    let commit = values(&t8, "denoise.0000.commit");
    let eos = commit[0];
    let out = dir.join("eos.trace");
    run_trace_with(
        &opts(out.clone(), false, 1, None),
        &DiffusionOptions {
            seed: Some(3),
            eos: Some(vec![eos]),
            pad: Some(0),
            ..Default::default()
        },
    )
    .unwrap();
    let te = Trace::open(&out).unwrap();
    assert_eq!(te.provenance()["blocks"], 1);
    let mut want = vec![eos];
    want.extend(std::iter::repeat_n(0, f.canvas - 1));
    assert_eq!(te.provenance()["output_tokens"], json!(want));
    assert_eq!(
        values(&te, "denoise.0000.commit"),
        commit,
        "commit before padding"
    );
    assert!(te.tensor_info("encode.0000.embed.out").is_none());
}

#[test]
fn two_blocks_are_fast() {
    let tmp = tempfile::tempdir().unwrap();
    let start = std::time::Instant::now();
    run(tmp.path(), "a.trace", false, 2, None);
    // An observation, not an assertion (docs: no timing asserts).
    eprintln!("diffusion_gemma 2-block trace: {:?}", start.elapsed());
}

#[test]
fn stop_is_stable_and_confident() {
    // A confidence threshold above ln V makes every step confident: with S = 1 step 0 is never
    // stable, so the block must go on (stop = AND, docs/diffusion-gemma.md DG13.5) and end at
    // the first step whose argmax repeats the previous step's.
    let tmp = tempfile::tempdir().unwrap();
    let f = facts();
    let out = tmp.path().join("a.trace");
    run_trace_with(
        &opts(out.clone(), false, 1, None),
        &DiffusionOptions {
            seed: Some(3),
            confidence_threshold: Some(10.0),
            ..Default::default()
        },
    )
    .unwrap();
    let t = Trace::open(&out).unwrap();
    for b in 0..2 {
        assert_eq!(values(&t, &names::denoise(b, 0, "stop")), [0, 1, 0]);
        let mut s = 1;
        loop {
            let stop = values(&t, &names::denoise(b, s, "stop"));
            let same = values(&t, &names::denoise(b, s, "argmax"))
                == values(&t, &names::denoise(b, s - 1, "argmax"));
            assert_eq!(
                stop,
                [i64::from(same), 1, i64::from(same)],
                "block {b} step {s}"
            );
            if same || s + 1 == f.steps {
                assert!(t.decision_info(&names::denoise(b, s + 1, "stop")).is_none());
                break;
            }
            s += 1;
        }
    }
    // Margins: stability in whole steps, confidence in nats, the deciding one third.
    let m = margins(&t, &names::denoise(0, 0, "stop")).unwrap();
    assert_eq!(m[0], 1.0);
    assert!(m[1] > 0.0 && m[2] == m[0]);
}

/// A copy of `t` with element 0 of tensor `name` nudged by one f32 ULP.
fn nudged(t: &Trace, out: &Path, name: &str) -> PathBuf {
    let mut w = TraceWriter::create(out, t.provenance().clone()).unwrap();
    for i in t.tensors() {
        let mut data = t.data(i).to_vec();
        if i.name == name {
            let x = f32::from_le_bytes(data[..4].try_into().unwrap());
            data[..4].copy_from_slice(&f32::from_bits(x.to_bits() + 1).to_le_bytes());
        }
        w.tensor(&i.name, i.dtype, &i.shape, &data, &i.attributes)
            .unwrap();
    }
    for d in t.decisions() {
        w.decision(
            &d.name,
            &d.shape,
            &t.decision_values(d),
            t.decision_margins(d).as_deref(),
        )
        .unwrap();
    }
    w.finish().unwrap();
    out.to_path_buf()
}

/// The layer verb on the engine's own `--capture internals` trace repeats, bit for bit, every
/// tensor (bytes, shape, path, mask, positions) and the router decision the whole run wrote for
/// that layer and pass — the prompt pass, a commit pass, and a denoise step of block 1 (whose
/// cache holds the prompt and block 0's commit pass: 17 rows, past the window of 5), each on a
/// sliding (0) and a full (1) layer — and nothing else; forced by the same trace too.
#[test]
fn layer_verb_repeats_the_whole_run() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let whole = run(dir, "i.trace", true, 1, None);
    let input = dir.join("i.trace");
    let last = steps_per_block(&whole, &facts(), 2)[1] - 1;
    let passes: [&dyn Fn(&str) -> String; 4] = [
        &|r| r.to_string(),
        &|r| names::encode(0, r),
        &|r| names::denoise(1, 0, r),
        &|r| names::denoise(1, last, r),
    ];
    let mut checked = 0;
    for (i, pass) in passes.iter().enumerate() {
        for l in [0, 1] {
            let prefix = pass(&names::layer_prefix(l));
            let name = pass(&names::layer(l, "hidden_in"));
            for (j, force) in [None, Some(input.as_path())].into_iter().enumerate() {
                let out = dir.join(format!("l{i}.{l}.{j}.trace"));
                run_layer(&LayerOptions {
                    force_decisions: force.map(Path::to_path_buf),
                    ..layer_opts(&fixture(), l, &input, &name, out.clone())
                })
                .unwrap_or_else(|e| panic!("{name}: {e}"));
                let lt = Trace::open(&out).unwrap();
                let want: Vec<&str> = whole
                    .tensors()
                    .iter()
                    .map(|t| t.name.as_str())
                    .filter(|n| n.starts_with(&prefix))
                    .collect();
                let got: Vec<&str> = lt.tensors().iter().map(|t| t.name.as_str()).collect();
                assert_eq!(got, want, "{name}");
                for t in lt.tensors() {
                    let w = whole.tensor_info(&t.name).unwrap();
                    assert!(lt.data(t) == whole.data(w), "{name}: {} differs", t.name);
                    assert_eq!(t.shape, w.shape, "{}", t.name);
                    let mut a = t.attributes.clone();
                    a.extra = Default::default();
                    assert_eq!(a, w.attributes, "{}", t.name);
                    checked += 1;
                }
                let topk = format!("{prefix}router.topk");
                let ds: Vec<&str> = lt.decisions().iter().map(|d| d.name.as_str()).collect();
                assert_eq!(ds, [topk.as_str()], "{name}");
                assert_eq!(values(&lt, &topk), values(&whole, &topk), "{topk}");
                assert_eq!(margins(&lt, &topk), margins(&whole, &topk), "{topk}");
                let p = lt.provenance();
                assert_eq!(p["verb"], "layer");
                assert_eq!(p["layer"], l);
                assert_eq!(p["input"]["name"], name.as_str());
                assert_eq!(p["forced_decisions"].is_object(), force.is_some());
            }
        }
    }
    assert!(checked > 100, "{checked}");
}

/// The refusals, each one line naming what is wrong and writing nothing; and the negative
/// control: one input row nudged by one ULP changes the layer's output.
#[test]
fn layer_verb_refusals_and_a_planted_change() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let whole = run(dir, "i.trace", true, 1, None);
    run(dir, "d.trace", false, 1, None);
    let (input, default) = (dir.join("i.trace"), dir.join("d.trace"));
    let out = dir.join("l.trace");
    let refuse = |o: LayerOptions| -> String {
        let e = run_layer(&o).expect_err("refused").to_string();
        assert!(!out.exists(), "a refused run writes nothing: {e}");
        assert_eq!(e.lines().count(), 1, "{e}");
        e
    };
    // A default capture has no k/v: the first one needed is named.
    let name = names::denoise(1, 0, &names::layer(0, "hidden_in"));
    let e = refuse(layer_opts(&fixture(), 0, &default, &name, out.clone()));
    assert!(
        e.contains("no tensor layer.00.k ") && e.contains("--capture internals"),
        "{e}"
    );
    // The prompt pass needs no cache: a default capture is enough.
    run_layer(&layer_opts(
        &fixture(),
        0,
        &default,
        "layer.00.hidden_in",
        dir.join("p.trace"),
    ))
    .unwrap();
    for (l, bad) in [
        (1, name.clone()),
        (0, names::denoise(1, 0, &names::layer(0, "attn_out"))),
        (0, names::denoise_block(1, &names::layer(0, "hidden_in"))),
        (0, names::decode(1, &names::layer(0, "hidden_in"))),
        (0, "layer.0.hidden_in".to_string()),
    ] {
        let e = refuse(layer_opts(&fixture(), l, &input, &bad, out.clone()));
        assert!(
            e.contains(&format!("--input-name {bad}: not layer {l}'s input")),
            "{e}"
        );
    }
    let e = refuse(layer_opts(&fixture(), 4, &input, &name, out.clone()));
    assert!(e.contains("--layer 4 out of range"), "{e}");
    let e = refuse(LayerOptions {
        decode_from: Some(0),
        ..layer_opts(&fixture(), 0, &input, &name, out.clone())
    });
    assert!(e.starts_with("--decode-from"), "{e}");

    // Negative control: row 0 of the input one ULP up changes the output (every canvas row sees
    // row 0 in a denoise step).
    let planted = nudged(&whole, &dir.join("n.trace"), &name);
    run_layer(&layer_opts(&fixture(), 0, &planted, &name, out.clone())).unwrap();
    let lt = Trace::open(&out).unwrap();
    let ho = names::denoise(1, 0, &names::layer(0, "hidden_out"));
    assert_ne!(f32s(&lt, &ho), f32s(&whole, &ho));
}
