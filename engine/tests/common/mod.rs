//! Temporary random checkpoints for tests: a safetensors writer and tiny Qwen3 / Qwen3-MoE
//! configs with non-default values (biases, head_dim ≠ hidden/heads, GQA, mlp_only_layers, ...).
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use serde_json::{json, Value};
use tracegate_engine::LayerOptions;

pub struct T {
    pub name: String,
    pub dtype: &'static str,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// Minimal safetensors writer (8-byte-aligned header, tensors in the given order).
pub fn write_safetensors(path: &Path, tensors: &[T]) {
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    for t in tensors {
        header.insert(
            t.name.clone(),
            json!({"dtype": t.dtype, "shape": t.shape, "data_offsets": [off, off + t.bytes.len()]}),
        );
        off += t.bytes.len();
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    std::fs::write(path, out).unwrap();
}

pub struct Rng(u64);
impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E3779B97F4A7C15) | 1)
    }
    /// Uniform in [-scale, scale).
    pub fn f(&mut self, scale: f32) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
    }
}

pub fn tensor(
    rng: &mut Rng,
    name: &str,
    dtype: &'static str,
    shape: &[usize],
    scale: f32,
    offset: f32,
) -> T {
    let n: usize = shape.iter().product();
    let vals: Vec<f32> = (0..n).map(|_| offset + rng.f(scale)).collect();
    let bytes = match dtype {
        "F32" => vals.iter().flat_map(|x| x.to_le_bytes()).collect(),
        "BF16" => vals
            .iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect(),
        "F16" => vals
            .iter()
            .flat_map(|x| half::f16::from_f32(*x).to_bits().to_le_bytes())
            .collect(),
        _ => unreachable!(),
    };
    T {
        name: name.to_string(),
        dtype,
        shape: shape.to_vec(),
        bytes,
    }
}

pub fn dense_config() -> Value {
    json!({
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 61, "hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 10, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": true, "attention_bias": true, "use_sliding_window": false,
        "max_position_embeddings": 128, "torch_dtype": "float32"
    })
}

pub fn moe_config() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 53, "hidden_size": 16, "intermediate_size": 36, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 6, "hidden_act": "silu",
        "rms_norm_eps": 1e-5, "rope_theta": 1000000.0, "rope_scaling": null,
        "tie_word_embeddings": false, "attention_bias": false,
        "num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 12,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [1]
    })
}

/// All tensors a config needs, random (norm weights near 1), in `dtype`.
pub fn model_tensors(cfg: &Value, dtype: &'static str, seed: u64) -> Vec<T> {
    let g = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let (v, h, nl) = (g("vocab_size"), g("hidden_size"), g("num_hidden_layers"));
    let (nq, nkv, d) = (
        g("num_attention_heads"),
        g("num_key_value_heads"),
        g("head_dim"),
    );
    let bias = cfg["attention_bias"].as_bool().unwrap_or(false);
    let moe = cfg["model_type"] == "qwen3_moe";
    let mlp_only: Vec<u64> = cfg["mlp_only_layers"]
        .as_array()
        .map(|a| a.iter().map(|x| x.as_u64().unwrap()).collect())
        .unwrap_or_default();
    let mut r = Rng::new(seed);
    let mut ts = vec![tensor(
        &mut r,
        "model.embed_tokens.weight",
        dtype,
        &[v, h],
        1.0,
        0.0,
    )];
    for l in 0..nl {
        let p = format!("model.layers.{l}");
        ts.push(tensor(
            &mut r,
            &format!("{p}.input_layernorm.weight"),
            dtype,
            &[h],
            0.2,
            1.0,
        ));
        ts.push(tensor(
            &mut r,
            &format!("{p}.post_attention_layernorm.weight"),
            dtype,
            &[h],
            0.2,
            1.0,
        ));
        for (n, o, i) in [
            ("q_proj", nq * d, h),
            ("k_proj", nkv * d, h),
            ("v_proj", nkv * d, h),
            ("o_proj", h, nq * d),
        ] {
            ts.push(tensor(
                &mut r,
                &format!("{p}.self_attn.{n}.weight"),
                dtype,
                &[o, i],
                0.4,
                0.0,
            ));
            if bias {
                ts.push(tensor(
                    &mut r,
                    &format!("{p}.self_attn.{n}.bias"),
                    dtype,
                    &[o],
                    0.1,
                    0.0,
                ));
            }
        }
        ts.push(tensor(
            &mut r,
            &format!("{p}.self_attn.q_norm.weight"),
            dtype,
            &[d],
            0.2,
            1.0,
        ));
        ts.push(tensor(
            &mut r,
            &format!("{p}.self_attn.k_norm.weight"),
            dtype,
            &[d],
            0.2,
            1.0,
        ));
        let sparse = moe && !mlp_only.contains(&(l as u64));
        let mut mlp = |prefix: &str, inter: usize, ts: &mut Vec<T>| {
            ts.push(tensor(
                &mut r,
                &format!("{prefix}.gate_proj.weight"),
                dtype,
                &[inter, h],
                0.4,
                0.0,
            ));
            ts.push(tensor(
                &mut r,
                &format!("{prefix}.up_proj.weight"),
                dtype,
                &[inter, h],
                0.4,
                0.0,
            ));
            ts.push(tensor(
                &mut r,
                &format!("{prefix}.down_proj.weight"),
                dtype,
                &[h, inter],
                0.4,
                0.0,
            ));
        };
        if sparse {
            let (ne, mi) = (g("num_experts"), g("moe_intermediate_size"));
            let mut router = Rng::new(seed + 1000 + l as u64);
            ts.push(tensor(
                &mut router,
                &format!("{p}.mlp.gate.weight"),
                dtype,
                &[ne, h],
                1.0,
                0.0,
            ));
            for e in 0..ne {
                mlp(&format!("{p}.mlp.experts.{e}"), mi, &mut ts);
            }
        } else {
            mlp(&format!("{p}.mlp"), g("intermediate_size"), &mut ts);
        }
    }
    ts.push(tensor(&mut r, "model.norm.weight", dtype, &[h], 0.2, 1.0));
    if !cfg["tie_word_embeddings"].as_bool().unwrap_or(false) {
        ts.push(tensor(&mut r, "lm_head.weight", dtype, &[v, h], 0.5, 0.0));
    }
    ts
}

/// Write config.json + model.safetensors into `dir`.
pub fn write_model(dir: &Path, cfg: &Value, tensors: &[T]) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_vec_pretty(cfg).unwrap(),
    )
    .unwrap();
    write_safetensors(&dir.join("model.safetensors"), tensors);
}

pub fn make_model(dir: &Path, cfg: &Value, dtype: &'static str, seed: u64) {
    write_model(dir, cfg, &model_tensors(cfg, dtype, seed));
}

/// The `layer` verb of `layer` of the model at `model` on tensor `input_name` of `input`,
/// written to `out`: every capture point, one thread, nothing forced.
pub fn layer_opts(
    model: &Path,
    layer: usize,
    input: &Path,
    input_name: &str,
    out: PathBuf,
) -> LayerOptions {
    LayerOptions {
        model_dir: model.to_path_buf(),
        layer,
        input: input.to_path_buf(),
        input_name: input_name.to_string(),
        out,
        internals: true,
        threads: 1,
        command_line: vec![],
        force_decisions: None,
        decode_from: None,
    }
}
