//! Engine timings for scripts/bench_engine.sh (an observation, not a test):
//!
//!     cargo run --release -p tracegate-engine --example bench -- MODEL_DIR THREADS PREFILLS DECODE
//!
//! `PREFILLS` is a comma-separated list of prompt lengths (e.g. `64,512`). Prints one JSON line:
//! prefill seconds per length (one timed forward each, after an untimed warm-up forward that
//! touches every weight page), per-token cached decode seconds (mean over DECODE greedy steps
//! after the first prompt), the weight bytes one decoded token reads and the GB/s that makes,
//! peak RSS (VmHWM, includes the weights' panels and the mapped pages touched, read before the
//! bandwidth probe below allocates), the model's f32 weight size, the load time (checkpoint open
//! and model load, and packing every matrix's panels, which the engine otherwise does on a
//! matrix's first decode use) and the bytes on transparent huge pages, and the machine's memory bandwidth on the same threads: a
//! read-only pass and a copy over buffers larger than the caches.

use std::time::Instant;

use rayon::prelude::*;
use tracegate_engine::capture::Capture;
use tracegate_engine::config::{Config, LayerKind};
use tracegate_engine::matmul::Kernel;
use tracegate_engine::model::Model;
use tracegate_engine::weights::Store;
use tracegate_engine::{generate, load_config};

fn vm_hwm_kb() -> u64 {
    proc_kb("/proc/self/status", "VmHWM:")
}

/// The kB figure of the line starting with `key` in a /proc file (0 if absent).
fn proc_kb(path: &str, key: &str) -> u64 {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// Parameters stored, and parameters one decoded token multiplies with (the head in full; of
/// the embedding one row; of a sparse layer the router, `num_experts_per_tok` experts and the
/// shared expert). Qwen3.5: a full-attention layer's q_proj carries the output gate (twice the
/// rows), a linear-attention layer holds the Gated DeltaNet's tensors (§18) instead.
fn param_counts(c: &Config) -> (usize, usize) {
    let (h, d, v) = (c.hidden_size, c.head_dim, c.vocab_size);
    let q35 = c.model_type.is_qwen3_5();
    let bias = if c.attention_bias {
        (c.num_attention_heads + 2 * c.num_key_value_heads) * d + h
    } else {
        0
    };
    let q_rows = c.num_attention_heads * d * (1 + q35 as usize);
    let attn =
        h * (q_rows + c.num_attention_heads * d + 2 * c.num_key_value_heads * d) + bias + 2 * d;
    let linear = c.linear.map_or(0, |s| {
        let (cd, vd, nv) = (s.conv_dim(), s.value_dim(), s.num_value_heads);
        h * (cd + vd + 2 * nv) + cd * s.conv_kernel + 2 * nv + s.value_head_dim + vd * h
    });
    let shared = match c.shared_expert_intermediate_size {
        0 => 0,
        si => 3 * h * si + h,
    };
    let (mut stored, mut read) = (v * h + h, h + h);
    if !c.tie_word_embeddings {
        stored += v * h;
    }
    read += v * h;
    for l in 0..c.num_hidden_layers {
        let mixer = match c.layer_kind(l) {
            LayerKind::Full => attn,
            LayerKind::Linear => linear,
        } + 2 * h;
        stored += mixer;
        read += mixer;
        match c.is_sparse(l) {
            true => {
                let expert = 3 * h * c.moe_intermediate_size;
                stored += c.num_experts * h + c.num_experts * expert + shared;
                read += c.num_experts * h + c.num_experts_per_tok * expert + shared;
            }
            _ => {
                let mlp = 3 * h * c.intermediate_size.unwrap_or(0);
                stored += mlp;
                read += mlp;
            }
        }
    }
    (stored, read)
}

/// Memory bandwidth over `bytes`-sized buffers on the current pool, best of 3, GB/s counting the
/// bytes of the source once: (read-only pass, copy).
fn bandwidth(bytes: usize) -> (f64, f64) {
    let n = bytes / 8;
    let src: Vec<u64> = (0..n as u64).collect();
    let mut dst = vec![0u64; n];
    let chunk = n.div_ceil(rayon::current_num_threads() * 4).max(1 << 16);
    let (mut read, mut copy) = (f64::INFINITY, f64::INFINITY);
    let mut sink = 0u64;
    for _ in 0..3 {
        let t0 = Instant::now();
        sink ^= src
            .par_chunks(chunk)
            .map(|c| {
                // Eight independent lanes, so the loop is bound by loads, not by one xor chain.
                let mut a = [0u64; 8];
                for w in c.chunks_exact(8) {
                    for i in 0..8 {
                        a[i] ^= w[i];
                    }
                }
                a.iter().fold(0, |x, y| x ^ y)
            })
            .reduce(|| 0, |x, y| x ^ y);
        read = read.min(t0.elapsed().as_secs_f64());
        let t0 = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        copy = copy.min(t0.elapsed().as_secs_f64());
    }
    std::hint::black_box((sink, &dst));
    let gb = (n * 8) as f64 / 1e9;
    (gb / read, gb / copy)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: bench MODEL_DIR THREADS PREFILL_TOKENS[,PREFILL_TOKENS...] DECODE_STEPS");
        std::process::exit(2);
    }
    let dir = std::path::PathBuf::from(&a[1]);
    let threads: usize = a[2].parse().expect("threads");
    let lens: Vec<usize> = a[3]
        .split(',')
        .map(|s| s.parse().expect("prefill tokens"))
        .collect();
    let steps: usize = a[4].parse().expect("decode steps");
    tracegate_engine::keep_freed_memory();
    let (cfg, _) = load_config(&dir).expect("config");
    let t0 = Instant::now();
    let store = Store::open(&dir).expect("store");
    let model = Model::load(cfg, &store).expect("model");
    // Steady decode: every matrix's panels made now, not on its first decode step.
    model.pack_panels();
    let load = t0.elapsed().as_secs_f64();
    let c = &model.cfg;
    let wdtype = store
        .take(
            &format!("{}embed_tokens.weight", c.layout.prefix()),
            &[c.vocab_size, c.hidden_size],
        )
        .expect("embedding")
        .dtype;
    let v = c.vocab_size as i64;
    // The same prompts the torch side uses.
    let prompt = |n: usize| -> Vec<i64> { (0..n as i64).map(|i| (i * 7919 + 13) % v).collect() };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    pool.install(|| {
        let forward = |p: &[i64]| {
            let mut kv = model.new_cache();
            let logits = model
                .forward(p, 0, &mut kv, &mut Capture::off())
                .expect("forward");
            (kv, logits)
        };
        forward(&prompt(lens[0]));
        let mut prefill = vec![];
        for &n in &lens {
            let p = prompt(n);
            let t0 = Instant::now();
            forward(&p);
            prefill.push(format!("\"{n}\": {:.6}", t0.elapsed().as_secs_f64()));
        }
        let p = prompt(lens[0]);
        let (mut kv, logits) = forward(&p);
        let t0 = Instant::now();
        // Step 0 reuses the prompt's logits; steps 1..=DECODE each run one cached row.
        let out = generate(&model, &p, &logits, steps + 1, Some(&mut kv), false).expect("generate");
        let decode = t0.elapsed().as_secs_f64() / steps as f64;
        let tokens: Vec<i64> = out.iter().map(|s| s.token).collect();
        let rss = vm_hwm_kb() * 1024;
        let huge = proc_kb("/proc/self/smaps_rollup", "AnonHugePages:") * 1024;
        let (stored, read) = param_counts(c);
        let read_bytes = read * wdtype.size();
        // 1 GiB each: far beyond any last-level cache of the machines this runs on.
        let (read_gbps, copy_gbps) = bandwidth(1 << 30);
        println!(
            "{{\"threads\": {threads}, \"kernel\": \"{:?}\", \"prefill_s\": {{{}}}, \
             \"decode_s_per_token\": {decode:.6}, \"decode_weight_bytes_per_token\": {read_bytes}, \
             \"decode_gbps\": {:.3}, \"read_gbps\": {read_gbps:.3}, \"copy_gbps\": {copy_gbps:.3}, \
             \"peak_rss_bytes\": {rss}, \"f32_weight_bytes\": {}, \
             \"load_s\": {load:.6}, \"anon_huge_bytes\": {huge}, \"tokens\": {tokens:?}}}",
            Kernel::detect(),
            prefill.join(", "),
            read_bytes as f64 / decode / 1e9,
            stored * 4
        );
    });
}
