//! Engine timings for scripts/bench_engine.sh (an observation, not a test):
//!
//!     cargo run --release -p tracegate-engine --example bench -- MODEL_DIR THREADS PREFILL DECODE
//!
//! Prints one JSON line: prefill seconds (best of 3, no capture), per-token cached decode seconds
//! (mean over DECODE greedy steps after the prompt), peak RSS (VmHWM, includes the mapped
//! checkpoint pages touched) and the model's f32 weight size.

use std::time::Instant;

use tracegate_engine::capture::Capture;
use tracegate_engine::qwen3::Model;
use tracegate_engine::weights::Store;
use tracegate_engine::{generate, load_config};

fn vm_hwm_kb() -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() != 5 {
        eprintln!("usage: bench MODEL_DIR THREADS PREFILL_TOKENS DECODE_STEPS");
        std::process::exit(2);
    }
    let dir = std::path::PathBuf::from(&a[1]);
    let threads: usize = a[2].parse().expect("threads");
    let n: usize = a[3].parse().expect("prefill tokens");
    let steps: usize = a[4].parse().expect("decode steps");
    let (cfg, _) = load_config(&dir).expect("config");
    let store = Store::open(&dir).expect("store");
    let model = Model::load(cfg, &store).expect("model");
    let v = model.cfg.vocab_size as i64;
    // The same prompt the torch side uses.
    let prompt: Vec<i64> = (0..n as i64).map(|i| (i * 7919 + 13) % v).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    pool.install(|| {
        let mut best = f64::INFINITY;
        for _ in 0..3 {
            let t0 = Instant::now();
            let mut kv = model.new_cache();
            model.forward(&prompt, 0, &mut kv, &mut Capture::off()).expect("forward");
            best = best.min(t0.elapsed().as_secs_f64());
        }
        let mut kv = model.new_cache();
        let logits = model.forward(&prompt, 0, &mut kv, &mut Capture::off()).expect("forward");
        let t0 = Instant::now();
        // Step 0 reuses the prompt's logits; steps 1..=DECODE each run one cached row.
        let out = generate(&model, &prompt, &logits, steps + 1, Some(&mut kv), false).expect("generate");
        let decode = t0.elapsed().as_secs_f64() / steps as f64;
        let tokens: Vec<i64> = out.iter().map(|s| s.token).collect();
        let c = &model.cfg;
        let mut params = c.vocab_size * c.hidden_size * if c.tie_word_embeddings { 1 } else { 2 } + c.hidden_size;
        let (h, d) = (c.hidden_size, c.head_dim);
        let attn = h * c.num_attention_heads * d * 2 + h * c.num_key_value_heads * d * 2 + 2 * d + 2 * h;
        params += c.num_hidden_layers * (attn + 3 * h * c.intermediate_size.unwrap_or(0));
        println!(
            "{{\"prefill_s\": {best:.5}, \"decode_s_per_token\": {decode:.5}, \"peak_rss_bytes\": {}, \"f32_weight_bytes\": {}, \"tokens\": {tokens:?}}}",
            vm_hwm_kb() * 1024,
            params * 4
        );
    });
}
