//! The Qwen3.5 families end to end on temporary random checkpoints (docs/numerics.md §§13,
//! 15–20): config fields honoured or refused by name, the two layouts giving one trace, unused
//! tensors listed, cached ≡ uncached decode for 8 steps, thread-count invariance, the `layer`
//! verb on both layer kinds (with `--decode-from`), fused ≡ per-expert experts.

use crate::common;

use std::path::{Path, PathBuf};

use common::*;
use serde_json::{json, Value};
use tracegate_engine::config::{Config, LayerKind};
use tracegate_engine::{run_layer, run_trace, LayerOptions, TraceOptions};
use tracegate_trace::Trace;

/// Dense, text layout: GQA, partial RoPE (12 × 0.5 = 6 rotary dims), `linear_num_value_heads` a
/// multiple (2) of the key heads, a layer pattern other than the default.
fn dense_config() -> Value {
    json!({
        "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
        "vocab_size": 67, "hidden_size": 20, "intermediate_size": 28, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false, "attention_bias": false,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 6, "linear_value_head_dim": 5,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                            "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 1],
                            "mrope_interleaved": true},
        "max_position_embeddings": 256
    })
}

/// MoE, text layout, bf16: every layer sparse with a shared expert; the default layer pattern
/// (`full_attention_interval` 3: layers 0, 1 linear, 2 full).
fn moe_config() -> Value {
    json!({
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": 59, "hidden_size": 16, "num_hidden_layers": 3,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "full_attention_interval": 3,
        "linear_conv_kernel_dim": 3, "linear_key_head_dim": 4, "linear_value_head_dim": 6,
        "linear_num_key_heads": 1, "linear_num_value_heads": 3,
        "num_experts": 5, "num_experts_per_tok": 2, "moe_intermediate_size": 10,
        "shared_expert_intermediate_size": 12,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}
    })
}

/// Every tensor the text config needs, under `prefix` (`model.` or `model.language_model.`),
/// random: zero-centred norm weights near 0, the gated norm's near 1, `A_log` and `dt_bias` in
/// transformers' ranges. Per-expert experts unless `fused`.
fn tensors(cfg: &Value, prefix: &str, dtype: &'static str, fused: bool) -> Vec<T> {
    let c = Config::from_json(cfg).unwrap();
    let (v, h, d) = (c.vocab_size, c.hidden_size, c.head_dim);
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    let mut r = Rng::new(5);
    let mut ts = vec![];
    let mut t = |ts: &mut Vec<T>, name: String, shape: &[usize], scale: f32, offset: f32| {
        ts.push(tensor(&mut r, &name, dtype, shape, scale, offset))
    };
    t(
        &mut ts,
        format!("{prefix}embed_tokens.weight"),
        &[v, h],
        1.0,
        0.0,
    );
    for l in 0..c.num_hidden_layers {
        let p = format!("{prefix}layers.{l}");
        t(
            &mut ts,
            format!("{p}.input_layernorm.weight"),
            &[h],
            0.2,
            0.0,
        );
        t(
            &mut ts,
            format!("{p}.post_attention_layernorm.weight"),
            &[h],
            0.2,
            0.0,
        );
        match c.layer_kind(l) {
            LayerKind::Full => {
                let a = format!("{p}.self_attn");
                t(
                    &mut ts,
                    format!("{a}.q_proj.weight"),
                    &[2 * nq * d, h],
                    0.4,
                    0.0,
                );
                t(
                    &mut ts,
                    format!("{a}.k_proj.weight"),
                    &[nkv * d, h],
                    0.4,
                    0.0,
                );
                t(
                    &mut ts,
                    format!("{a}.v_proj.weight"),
                    &[nkv * d, h],
                    0.4,
                    0.0,
                );
                t(
                    &mut ts,
                    format!("{a}.o_proj.weight"),
                    &[h, nq * d],
                    0.4,
                    0.0,
                );
                t(&mut ts, format!("{a}.q_norm.weight"), &[d], 0.2, 0.0);
                t(&mut ts, format!("{a}.k_norm.weight"), &[d], 0.2, 0.0);
            }
            LayerKind::Linear => {
                let s = c.linear.unwrap();
                let (nv, a) = (s.num_value_heads, format!("{p}.linear_attn"));
                t(
                    &mut ts,
                    format!("{a}.in_proj_qkv.weight"),
                    &[s.conv_dim(), h],
                    0.4,
                    0.0,
                );
                t(
                    &mut ts,
                    format!("{a}.in_proj_z.weight"),
                    &[s.value_dim(), h],
                    0.4,
                    0.0,
                );
                t(&mut ts, format!("{a}.in_proj_b.weight"), &[nv, h], 0.4, 0.0);
                t(&mut ts, format!("{a}.in_proj_a.weight"), &[nv, h], 0.4, 0.0);
                let conv = [s.conv_dim(), 1, s.conv_kernel];
                t(&mut ts, format!("{a}.conv1d.weight"), &conv, 0.5, 0.0);
                t(&mut ts, format!("{a}.dt_bias"), &[nv], 0.5, 1.0);
                t(&mut ts, format!("{a}.A_log"), &[nv], 1.2, 1.3);
                t(
                    &mut ts,
                    format!("{a}.norm.weight"),
                    &[s.value_head_dim],
                    0.2,
                    1.0,
                );
                t(
                    &mut ts,
                    format!("{a}.out_proj.weight"),
                    &[h, s.value_dim()],
                    0.4,
                    0.0,
                );
            }
        }
        let mlp = |ts: &mut Vec<T>, r: &mut Rng, p: &str, i: usize| {
            for (n, shape) in [("gate", [i, h]), ("up", [i, h]), ("down", [h, i])] {
                ts.push(tensor(
                    r,
                    &format!("{p}.{n}_proj.weight"),
                    dtype,
                    &shape,
                    0.4,
                    0.0,
                ));
            }
        };
        if c.is_sparse(l) {
            let (ne, mi, si) = (
                c.num_experts,
                c.moe_intermediate_size,
                c.shared_expert_intermediate_size,
            );
            t(&mut ts, format!("{p}.mlp.gate.weight"), &[ne, h], 1.0, 0.0);
            let mut er = Rng::new(50 + l as u64);
            let experts: Vec<Vec<T>> = (0..ne)
                .map(|e| {
                    let mut one = vec![];
                    mlp(&mut one, &mut er, &format!("{p}.mlp.experts.{e}"), mi);
                    one
                })
                .collect();
            if fused {
                // The same values as the per-expert tensors: [E, 2I, H] gate then up rows, [E, H, I].
                let cat = |name: &str, parts: &[usize], shape: Vec<usize>| T {
                    name: name.to_string(),
                    dtype,
                    shape,
                    bytes: experts
                        .iter()
                        .flat_map(|ex| parts.iter().flat_map(|&i| ex[i].bytes.clone()))
                        .collect(),
                };
                ts.push(cat(
                    &format!("{p}.mlp.experts.gate_up_proj"),
                    &[0, 1],
                    vec![ne, 2 * mi, h],
                ));
                ts.push(cat(
                    &format!("{p}.mlp.experts.down_proj"),
                    &[2],
                    vec![ne, h, mi],
                ));
            } else {
                ts.extend(experts.into_iter().flatten());
            }
            let mut sr = Rng::new(90 + l as u64);
            mlp(&mut ts, &mut sr, &format!("{p}.mlp.shared_expert"), si);
            ts.push(tensor(
                &mut sr,
                &format!("{p}.mlp.shared_expert_gate.weight"),
                dtype,
                &[1, h],
                0.5,
                0.0,
            ));
        } else {
            let mut dr = Rng::new(70 + l as u64);
            mlp(
                &mut ts,
                &mut dr,
                &format!("{p}.mlp"),
                c.intermediate_size.unwrap(),
            );
        }
    }
    t(&mut ts, format!("{prefix}norm.weight"), &[h], 0.2, 0.0);
    if !c.tie_word_embeddings {
        t(&mut ts, "lm_head.weight".into(), &[v, h], 0.5, 0.0);
    }
    ts
}

/// The multimodal layout of the same language model: `qwen3_5` / `qwen3_5_moe` with the text
/// fields under `text_config`, weights under `model.language_model.`, plus a (random) vision
/// tower and multi-token-prediction head.
fn multimodal(cfg: &Value, dtype: &'static str) -> (Value, Vec<T>) {
    let moe = cfg["model_type"] == "qwen3_5_moe_text";
    let (mt, arch) = if moe {
        ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
    } else {
        ("qwen3_5", "Qwen3_5ForConditionalGeneration")
    };
    let mut text = cfg.clone();
    let tie = text["tie_word_embeddings"].clone();
    text.as_object_mut().unwrap().remove("architectures");
    let outer = json!({
        "architectures": [arch], "model_type": mt, "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8}, "tie_word_embeddings": tie,
        "image_token_id": 60
    });
    let mut ts = tensors(cfg, "model.language_model.", dtype, false);
    let mut r = Rng::new(7);
    for name in [
        "model.visual.patch_embed.proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
        "mtp.fc.weight",
        "mtp.layers.0.mlp.up_proj.weight",
        "mtp.norm.weight",
    ] {
        ts.push(tensor(&mut r, name, dtype, &[4, 3], 1.0, 0.0));
    }
    (outer, ts)
}

struct Models {
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    dense: PathBuf,
    moe: PathBuf,
}

fn models() -> Models {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let (dense, moe) = (dir.join("dense"), dir.join("moe"));
    write_model(
        &dense,
        &dense_config(),
        &tensors(&dense_config(), "model.", "F32", false),
    );
    write_model(
        &moe,
        &moe_config(),
        &tensors(&moe_config(), "model.", "BF16", false),
    );
    Models {
        _tmp: tmp,
        dir,
        dense,
        moe,
    }
}

const PROMPT: [i64; 7] = [3, 17, 5, 0, 42, 17, 9];

fn opts(model: &Path, out: PathBuf) -> TraceOptions {
    TraceOptions {
        model_dir: model.to_path_buf(),
        tokens: PROMPT.to_vec(),
        out,
        internals: true,
        generate: 0,
        cache: true,
        threads: 1,
        command_line: vec![],
        force_decisions: None,
        prompt_text: None,
        shards: None,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn refusal(cfg: &Value) -> String {
    match Config::from_json(cfg) {
        Ok(_) => panic!("accepted: {cfg}"),
        Err(e) => e.to_string(),
    }
}

fn with(cfg: &Value, key: &str, val: Value) -> Value {
    let mut c = cfg.clone();
    match val {
        Value::Null => c.as_object_mut().unwrap().remove(key),
        v => c.as_object_mut().unwrap().insert(key.to_string(), v),
    };
    c
}

#[test]
fn config_fields_are_honoured_or_refused_by_name() {
    let (d, m) = (dense_config(), moe_config());
    // The controls: both base configs load, with the fields read as written.
    let c = Config::from_json(&d).unwrap();
    assert_eq!((c.rotary_dim, c.head_dim), (6, 12));
    let kinds: Vec<LayerKind> = (0..4).map(|l| c.layer_kind(l)).collect();
    use LayerKind::{Full as F, Linear as L};
    assert_eq!(kinds, [L, F, L, L]);
    let c = Config::from_json(&m).unwrap();
    assert_eq!((c.rotary_dim, c.norm_topk_prob), (2, true)); // 8 × 0.25 by default
    assert_eq!(
        (0..3).map(|l| c.layer_kind(l)).collect::<Vec<_>>(),
        [L, L, F]
    );
    assert!((0..3).all(|l| c.is_sparse(l)));
    // Absent layer_types and interval: every 4th layer full, as transformers builds it.
    let c = Config::from_json(&with(
        &with(&m, "full_attention_interval", Value::Null),
        "num_hidden_layers",
        json!(8),
    ))
    .unwrap();
    assert_eq!(
        (0..8).filter(|&l| c.layer_kind(l) == F).collect::<Vec<_>>(),
        [3, 7]
    );
    // The MoE fields transformers hard-wires: accepted at those values (controls) ...
    for (k, ok) in [
        ("norm_topk_prob", json!(true)),
        ("decoder_sparse_step", json!(1)),
        ("mlp_only_layers", json!([])),
    ] {
        Config::from_json(&with(&m, k, ok)).unwrap();
    }
    // ... and partial_rotary_factor 1 (every dim rotates) at the top level, legacy style.
    let top = with(
        &with(&d, "rope_parameters", Value::Null),
        "partial_rotary_factor",
        json!(1.0),
    );
    assert_eq!(Config::from_json(&top).unwrap().rotary_dim, 12);
    // An odd rotary dim (12 × 0.25 = 3) is run as transformers runs it, rounded up (§16); so is
    // an odd head whose rotated dims fit in it (7 × 0.5 = 3.5 → 3: 4 of its 7 dims rotate).
    let odd = with(
        &d,
        "rope_parameters",
        json!({"partial_rotary_factor": 0.25}),
    );
    assert_eq!(Config::from_json(&odd).unwrap().rotary_dim, 3);
    let odd_head = with(&odd, "head_dim", json!(7));
    let odd_head = with(
        &odd_head,
        "rope_parameters",
        json!({"partial_rotary_factor": 0.5}),
    );
    assert_eq!(Config::from_json(&odd_head).unwrap().rotary_dim, 3);
    let rope = |extra: Value| {
        let mut r = d["rope_parameters"].clone();
        for (k, v) in extra.as_object().unwrap() {
            r[k] = v.clone();
        }
        with(&d, "rope_parameters", r)
    };
    let cases: Vec<(Value, &str)> = vec![
        (
            with(
                &d,
                "layer_types",
                json!([
                    "linear_attention",
                    "full_attention",
                    "sliding_attention",
                    "full_attention"
                ]),
            ),
            "layer_types",
        ),
        (
            with(
                &d,
                "layer_types",
                json!(["linear_attention", "full_attention"]),
            ),
            "layer_types",
        ),
        (
            rope(json!({"partial_rotary_factor": 0.0})),
            "partial_rotary_factor",
        ),
        (
            rope(json!({"partial_rotary_factor": 1.5})),
            "partial_rotary_factor",
        ),
        (
            rope(json!({"partial_rotary_factor": 0.05})),
            "partial_rotary_factor = 0.05 gives 0 rotary dims",
        ), // 12 × 0.05 = 0.6 → 0
        (
            with(&rope(json!({"partial_rotary_factor": 1.0})), "head_dim", json!(11)),
            "partial_rotary_factor = 1 gives the odd rotary dim 11, which rotates 12 dims, more than head_dim 11",
        ), // an odd head rotated whole: transformers refuses it too (§16)
        (
            rope(json!({"rope_type": "yarn"})),
            "rope_parameters.rope_type",
        ),
        (rope(json!({"factor": 2.0})), "rope_parameters.factor"),
        (rope(json!({"mrope_section": [1, 2]})), "mrope_section"),
        (rope(json!({"mrope_interleaved": 1})), "mrope_interleaved"),
        (
            with(&d, "linear_num_value_heads", json!(3)),
            "linear_num_value_heads",
        ),
        (
            with(&d, "linear_key_head_dim", Value::Null),
            "linear_key_head_dim",
        ),
        (
            with(&d, "linear_conv_kernel_dim", json!(0)),
            "linear_conv_kernel_dim",
        ),
        (
            with(&d, "intermediate_size", Value::Null),
            "intermediate_size",
        ),
        (with(&d, "hidden_act", json!("gelu")), "hidden_act"),
        (
            with(&d, "architectures", json!(["Qwen3_5MoeForCausalLM"])),
            "architectures",
        ),
        (with(&m, "norm_topk_prob", json!(false)), "norm_topk_prob"),
        (
            with(&m, "decoder_sparse_step", json!(2)),
            "decoder_sparse_step",
        ),
        (with(&m, "mlp_only_layers", json!([1])), "mlp_only_layers"),
        (with(&m, "num_experts", json!(1)), "num_experts"),
        (
            with(&m, "num_experts_per_tok", json!(5)),
            "num_experts_per_tok",
        ),
        (
            with(&m, "shared_expert_intermediate_size", Value::Null),
            "shared_expert_intermediate_size",
        ),
        (
            with(&m, "moe_intermediate_size", Value::Null),
            "moe_intermediate_size",
        ),
        (
            with(&m, "full_attention_interval", json!(0)),
            "full_attention_interval",
        ),
    ];
    for (cfg, field) in &cases {
        let e = refusal(cfg);
        assert!(e.contains(field), "{field}: {e}");
    }
    // Only the MoE family ignores intermediate_size (it has no dense MLP): not even its type.
    Config::from_json(&with(&m, "intermediate_size", json!("x"))).unwrap();
    // The multimodal layout: text_config read, tying from the top level; refusals by name.
    let (mm, _) = multimodal(&d, "F32");
    let c = Config::from_json(&mm).unwrap();
    assert_eq!(
        (c.hidden_size, c.rotary_dim, c.tie_word_embeddings),
        (20, 6, false)
    );
    let mut bad_tie = mm.clone();
    bad_tie["text_config"]["tie_word_embeddings"] = json!(true);
    let mut bad_type = mm.clone();
    bad_type["text_config"]["model_type"] = json!("qwen3_5_moe_text");
    for (cfg, field) in [
        (bad_tie, "text_config.tie_word_embeddings"),
        (bad_type, "text_config.model_type"),
        (with(&mm, "text_config", Value::Null), "text_config"),
        (
            with(&mm, "architectures", json!(["Qwen3_5ForCausalLM"])),
            "architectures",
        ),
    ] {
        let e = refusal(&cfg);
        assert!(e.contains(field), "{field}: {e}");
    }
}

#[test]
fn both_layouts_give_one_trace_and_list_the_unused_tensors() {
    let f = models();
    for (text, cfg, dtype) in [
        (&f.dense, dense_config(), "F32"),
        (&f.moe, moe_config(), "BF16"),
    ] {
        let mm_dir = f.dir.join("mm");
        let (mm, ts) = multimodal(&cfg, dtype);
        write_model(&mm_dir, &mm, &ts);
        let a = run_trace(&opts(text, f.dir.join("a.trace"))).unwrap();
        let b = run_trace(&opts(&mm_dir, f.dir.join("b.trace"))).unwrap();
        assert_eq!(a, b, "{}", cfg["model_type"]);
        let prov = |p: &str| Trace::open(f.dir.join(p)).unwrap().provenance().clone();
        assert!(prov("a.trace").get("unused_tensors").is_none());
        assert_eq!(
            prov("b.trace")["unused_tensors"],
            json!({"model.visual.": 2, "mtp.": 3})
        );
        assert_ne!(
            prov("a.trace")["weights_digest"],
            prov("b.trace")["weights_digest"]
        );
        let info = tracegate_engine::info(&mm_dir).unwrap();
        assert!(
            info.contains("5 unused (model.visual.* 2, mtp.* 3)"),
            "{info}"
        );
        // Negative control: a tensor under no known prefix is still refused, by name.
        let mut extra = ts;
        extra.push(tensor(
            &mut Rng::new(1),
            "vision.stray.weight",
            dtype,
            &[2],
            1.0,
            0.0,
        ));
        write_model(&mm_dir, &mm, &extra);
        let e = run_trace(&opts(&mm_dir, f.dir.join("c.trace")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("unclaimed tensor vision.stray.weight"), "{e}");
    }
}

#[test]
fn capture_points_in_order_with_their_shapes() {
    let f = models();
    run_trace(&opts(&f.moe, f.dir.join("t.trace"))).unwrap();
    let t = Trace::open(f.dir.join("t.trace")).unwrap();
    let names: Vec<String> = t
        .tensors()
        .iter()
        .map(|i| i.name.clone())
        .filter(|n| n.starts_with("layer.01.") || n.starts_with("layer.02."))
        .filter(|n| !n.contains(".expert."))
        .collect();
    let lin = [
        "hidden_in",
        "linear.conv_out",
        "linear.q",
        "linear.k",
        "linear.g",
        "linear.beta",
        "linear.core",
        "linear.norm_out",
        "linear.state",
        "attn_out",
    ];
    let full = [
        "hidden_in",
        "q",
        "k",
        "v",
        "attn_gate",
        "attn_probs",
        "attn_out",
    ];
    let moe = [
        "router.logits",
        "shared_expert.gate",
        "shared_expert.out",
        "mlp_out",
        "hidden_out",
    ];
    let mut want: Vec<String> = vec![];
    for (l, mixer) in [(1, &lin[..]), (2, &full[..])] {
        want.extend(
            mixer
                .iter()
                .chain(&moe)
                .map(|p| format!("layer.{l:02}.{p}")),
        );
    }
    assert_eq!(names, want);
    let shape = |n: &str| t.tensor_info(n).unwrap().shape.clone();
    // conv_dim = 2·1·4 + 3·6 = 26; nk 1 × dk 4; nv 3 × dv 6.
    assert_eq!(shape("layer.01.linear.conv_out"), [7, 26]);
    assert_eq!(shape("layer.01.linear.q"), [7, 1, 4]);
    assert_eq!(shape("layer.01.linear.g"), [7, 3]);
    assert_eq!(shape("layer.01.linear.core"), [7, 3, 6]);
    assert_eq!(shape("layer.01.linear.state"), [1, 3, 4, 6]);
    assert_eq!(
        t.tensor_info("layer.01.linear.state")
            .unwrap()
            .attributes
            .positions,
        Some(vec![6])
    );
    assert_eq!(shape("layer.02.attn_gate"), [7, 2, 8]);
    assert_eq!(shape("layer.02.shared_expert.gate"), [7, 1]);
    // g ≤ 0 and beta in (0, 1), as the definitions make them.
    assert!(t
        .f32_vec("layer.01.linear.g")
        .unwrap()
        .iter()
        .all(|&g| g <= 0.0));
    assert!(t
        .f32_vec("layer.01.linear.beta")
        .unwrap()
        .iter()
        .all(|&b| b > 0.0 && b < 1.0));
}

#[test]
fn cached_decode_equals_uncached_for_8_steps_and_threads_do_not_matter() {
    let f = models();
    for model in [&f.dense, &f.moe] {
        let mut o = opts(model, f.dir.join("on.trace"));
        o.generate = 8;
        let on = run_trace(&o).unwrap();
        o.cache = false;
        o.out = f.dir.join("off.trace");
        let off = run_trace(&o).unwrap();
        assert_eq!(on, off, "{}", model.display());
        let t = Trace::open(&o.out).unwrap();
        assert!(t.tensor_info("decode.0007.layer.00.attn_out").is_some());
        assert!(t.tensor_info("decode.0007.layer.01.attn_out").is_some());
        o.threads = 2;
        o.out = f.dir.join("t2.trace");
        assert_eq!(run_trace(&o).unwrap(), off);
        // Control: a decode row on a cache without the prompt's linear state is refused, never
        // computed from a zero state as if it were at position 0.
        let (cfg, _) = tracegate_engine::load_config(model).unwrap();
        let store = tracegate_engine::weights::Store::open(model).unwrap();
        let m = tracegate_engine::model::Model::load(cfg, &store).unwrap();
        let mut fresh = m.new_cache();
        let quiet = tracegate_engine::capture::Capture::off;
        let e = m
            .forward(&[5], 7, &mut fresh, &mut quiet())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is linear attention") && e.contains("row 0 is at position 7"),
            "{e}"
        );
        m.forward(&PROMPT, 0, &mut fresh, &mut quiet()).unwrap();
        m.forward(&[5], 7, &mut fresh, &mut quiet()).unwrap();
        // Control: the decode steps differ from each other (the state moves on).
        let (a, b) = (
            t.f32_vec("decode.0003.logits").unwrap(),
            t.f32_vec("decode.0004.logits").unwrap(),
        );
        assert_ne!(bits(&a), bits(&b));
    }
}

#[test]
fn layer_verb_on_both_layer_kinds() {
    let f = models();
    let whole = f.dir.join("whole.trace");
    let mut o = opts(&f.moe, whole.clone());
    o.generate = 3;
    run_trace(&o).unwrap();
    let wt = Trace::open(&whole).unwrap();
    for l in 0..3 {
        let out = f.dir.join("l.trace");
        run_layer(&LayerOptions {
            threads: 2,
            ..layer_opts(
                &f.moe,
                l,
                &whole,
                &format!("layer.{l:02}.hidden_in"),
                out.clone(),
            )
        })
        .unwrap();
        let lt = Trace::open(&out).unwrap();
        let prefix = format!("layer.{l:02}.");
        let want: Vec<&str> = wt
            .tensors()
            .iter()
            .map(|i| i.name.as_str())
            .filter(|n| n.starts_with(&prefix))
            .collect();
        let got: Vec<&str> = lt.tensors().iter().map(|i| i.name.as_str()).collect();
        assert_eq!(got, want);
        for n in got {
            assert_eq!(
                bits(&lt.f32_vec(n).unwrap()),
                bits(&wt.f32_vec(n).unwrap()),
                "{n}"
            );
        }
    }
    // --decode-from on a linear (0) and a full (2) layer: rows ≥ P one at a time equal the plain
    // verb's rows, the whole run's prompt rows, and the cached decode steps.
    let mut o = opts(&f.moe, f.dir.join("long.trace"));
    o.tokens = [&PROMPT[..], &[11, 23]].concat();
    run_trace(&o).unwrap();
    let long = Trace::open(&o.out).unwrap();
    for l in [0, 2] {
        let name = format!("layer.{l:02}.hidden_in");
        let mut lo = LayerOptions {
            threads: 2,
            ..layer_opts(&f.moe, l, &o.out, &name, f.dir.join("df.trace"))
        };
        lo.decode_from = Some(4);
        run_layer(&lo).unwrap();
        let df = Trace::open(&lo.out).unwrap();
        let out = format!("layer.{l:02}.hidden_out");
        let (got, all) = (df.f32_vec(&out).unwrap(), long.f32_vec(&out).unwrap());
        assert_eq!(bits(&got), bits(&all[4 * 16..]), "layer {l}");
        assert_eq!(
            df.tensor_info(&out).unwrap().attributes.positions,
            Some((4..9).collect())
        );
    }
    // A linear-attention layer starts from a zero state at position 0: other positions are refused,
    // naming them (control: the full-attention layer takes them).
    let sub = f.dir.join("sub.trace");
    {
        let x = long.f32_vec("layer.00.hidden_in").unwrap();
        let mut w = tracegate_trace::TraceWriter::create(&sub, json!({})).unwrap();
        let attrs = tracegate_trace::Attributes::default().with_positions(vec![2, 3, 4]);
        w.tensor_f32("x", &[3, 16], &x[2 * 16..5 * 16], &attrs)
            .unwrap();
        w.finish().unwrap();
    }
    let e = run_layer(&LayerOptions {
        threads: 2,
        ..layer_opts(&f.moe, 0, &sub, "x", f.dir.join("r.trace"))
    })
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("layer 0 is linear attention") && e.contains("row 0 is at position 2"),
        "{e}"
    );
    run_layer(&LayerOptions {
        threads: 2,
        ..layer_opts(&f.moe, 2, &sub, "x", f.dir.join("r.trace"))
    })
    .unwrap();
}

#[test]
fn fused_experts_equal_per_expert_experts() {
    let f = models();
    let fused = f.dir.join("fused");
    write_model(
        &fused,
        &moe_config(),
        &tensors(&moe_config(), "model.", "BF16", true),
    );
    let a = run_trace(&opts(&f.moe, f.dir.join("a.trace"))).unwrap();
    let b = run_trace(&opts(&fused, f.dir.join("b.trace"))).unwrap();
    assert_eq!(a, b);
}

/// Sizes the checkpoint does not bear out are refused naming the field before anything is
/// allocated: 2^40 or 2^62 never becomes an allocation, a loop or an overflowing product.
#[test]
fn absurd_sizes_are_refused_naming_the_field() {
    let f = models();
    let dir = f.dir.join("absurd");
    for (base, dtype) in [(dense_config(), "F32"), (moe_config(), "BF16")] {
        let ts = tensors(&base, "model.", dtype, false);
        let mut fields = vec![
            "linear_num_value_heads",
            "linear_num_key_heads",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_conv_kernel_dim",
            "num_hidden_layers",
            "head_dim",
            "num_attention_heads",
        ];
        if base["model_type"] == "qwen3_5_moe_text" {
            fields.extend(["shared_expert_intermediate_size", "moe_intermediate_size"]);
        }
        for field in fields {
            for big in [1u64 << 40, 1u64 << 62] {
                let mut cfg = base.clone();
                cfg[field] = json!(big);
                if field == "num_hidden_layers" {
                    cfg.as_object_mut().unwrap().remove("layer_types");
                }
                if field == "linear_num_key_heads" {
                    cfg["linear_num_value_heads"] = json!(big); // a multiple, so the sizes are read
                }
                write_model(&dir, &cfg, &ts);
                let e = run_trace(&opts(&dir, f.dir.join("x.trace")))
                    .unwrap_err()
                    .to_string();
                assert!(e.contains(field), "{field} = {big}: {e}");
            }
        }
        // Control: the unchanged config runs.
        write_model(&dir, &base, &ts);
        run_trace(&opts(&dir, f.dir.join("x.trace"))).unwrap();
    }
}
