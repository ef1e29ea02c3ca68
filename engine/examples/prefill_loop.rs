//! Repeated prefill forwards in one process (an observation, not a test): what a run of many
//! forwards pays beyond the first, e.g. for the allocator (`tracegate_engine::keep_freed_memory`).
//!
//!     cargo run --release -p tracegate-engine --example prefill_loop -- MODEL_DIR THREADS TOKENS REPS [--default-malloc] [--panels]
//!
//! Prints each forward's wall time in ms, one per line; `--default-malloc` leaves glibc's
//! defaults (freed blocks handed back to the kernel) instead of keeping freed memory, as the
//! engine CLI and the bench do; `--panels` packs every matrix first, as the bench does (a run
//! that decodes reads its prefill from the panels too), instead of reading the file's rows.

use std::time::Instant;

use tracegate_engine::capture::Capture;
use tracegate_engine::load_config;
use tracegate_engine::model::Model;
use tracegate_engine::weights::Store;

fn main() {
    let a: Vec<String> = std::env::args().collect();
    if a.len() < 5 {
        eprintln!(
            "usage: prefill_loop MODEL_DIR THREADS TOKENS REPS [--default-malloc] [--panels]"
        );
        std::process::exit(2);
    }
    if let Some(x) = a[5..]
        .iter()
        .find(|x| !["--default-malloc", "--panels"].contains(&x.as_str()))
    {
        eprintln!("prefill_loop: unknown option {x} (--default-malloc, --panels)");
        std::process::exit(2);
    }
    let flag = |f: &str| a[5..].iter().any(|x| x == f);
    if !flag("--default-malloc") {
        tracegate_engine::keep_freed_memory();
    }
    let dir = std::path::PathBuf::from(&a[1]);
    let threads: usize = a[2].parse().expect("threads");
    let tokens: usize = a[3].parse().expect("tokens");
    let reps: usize = a[4].parse().expect("reps");
    let (cfg, _) = load_config(&dir).expect("config");
    let store = Store::open(&dir).expect("store");
    let model = Model::load(cfg, &store).expect("model");
    if flag("--panels") {
        model.pack_panels();
    }
    let v = model.cfg.vocab_size as i64;
    // The bench's prompt.
    let prompt: Vec<i64> = (0..tokens as i64).map(|i| (i * 7919 + 13) % v).collect();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    pool.install(|| {
        for _ in 0..reps {
            let t0 = Instant::now();
            let mut kv = model.new_cache();
            model
                .forward(&prompt, 0, &mut kv, &mut Capture::off())
                .expect("forward");
            println!("{:.1}", t0.elapsed().as_secs_f64() * 1e3);
        }
    });
}
