//! Benchmark (prints ratios; not a test): write, verify and read a trace of large f32 tensors,
//! beside a plain write of the same bytes and a raw xxh3 pass over them.
//!
//!     cargo run --release -p tracegate-trace --example bench_trace -- [GiB] [DIR]
//!
//! Both writes end with fsync, so the ratio compares like with like. Each figure is the median
//! of 3 runs; verify and read run with the file in the page cache.

use std::io::Write;
use std::time::Instant;

use serde_json::json;
use tracegate_trace::{Attributes, Trace, TraceWriter};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gib: f64 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(1.0);
    let dir = args
        .get(2)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("target/bench"));
    std::fs::create_dir_all(&dir).expect("create bench dir");
    let tensors = 16usize;
    let per = ((gib * (1u64 << 30) as f64) as usize / tensors / 4).max(1);
    let data: Vec<f32> = (0..per).map(|i| (i as f32).sin()).collect();
    // SAFETY: f32 -> bytes view of an owned Vec.
    let bytes: &[u8] =
        unsafe { std::slice::from_raw_parts(data.as_ptr() as *const u8, data.len() * 4) };
    let total = (bytes.len() * tensors) as f64;
    println!(
        "payload: {tensors} tensors x {:.1} MiB = {:.2} GiB in {}",
        bytes.len() as f64 / 1048576.0,
        total / 1073741824.0,
        dir.display()
    );

    let plain_path = dir.join("plain.bin");
    let trace_path = dir.join("bench.trace");
    let (mut plain, mut write, mut verify, mut hash, mut read) =
        (vec![], vec![], vec![], vec![], vec![]);
    let mut hash_par = vec![];
    for _ in 0..3 {
        let t = Instant::now();
        let mut f = std::fs::File::create(&plain_path).unwrap();
        for _ in 0..tensors {
            f.write_all(bytes).unwrap();
        }
        f.sync_all().unwrap();
        plain.push(t.elapsed().as_secs_f64());
        std::fs::remove_file(&plain_path).unwrap();
        // Start the trace write from the same state: no old 1 GiB file to unlink mid-run.
        std::fs::remove_file(&trace_path).ok();

        let t = Instant::now();
        let mut w = TraceWriter::create(&trace_path, json!({"producer": "bench"})).unwrap();
        let attrs = Attributes::default().with_path("prefill");
        for i in 0..tensors {
            w.tensor(
                &format!("t{i:02}"),
                tracegate_trace::DType::F32,
                &[per as u64],
                bytes,
                &attrs,
            )
            .unwrap();
        }
        w.finish().unwrap();
        write.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        for _ in 0..tensors {
            std::hint::black_box(xxhash_rust::xxh3::xxh3_128(bytes));
        }
        hash.push(t.elapsed().as_secs_f64());

        // The same pass spread over the pool verify uses: the fair baseline for a parallel verify.
        let t = Instant::now();
        {
            use rayon::prelude::*;
            (0..tensors).into_par_iter().for_each(|_| {
                std::hint::black_box(xxhash_rust::xxh3::xxh3_128(bytes));
            });
        }
        hash_par.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let tr = Trace::open(&trace_path).unwrap();
        tr.verify().unwrap();
        verify.push(t.elapsed().as_secs_f64());

        let t = Instant::now();
        let mut acc = 0f32;
        for i in 0..tensors {
            let s = tr.f32_slice(&format!("t{i:02}")).unwrap();
            acc += s[s.len() - 1] + s[s.len() / 2];
        }
        std::hint::black_box(acc);
        read.push(t.elapsed().as_secs_f64());
    }
    let (plain, write, verify, hash, read) = (
        median(plain),
        median(write),
        median(verify),
        median(hash),
        median(read),
    );
    let hash_par = median(hash_par);
    let gbs = |s: f64| total / s / 1e9;
    println!(
        "plain write + fsync : {plain:.3} s ({:.2} GB/s)",
        gbs(plain)
    );
    println!(
        "trace write + fsync : {write:.3} s ({:.2} GB/s)",
        gbs(write)
    );
    println!(
        "raw xxh3-128 (1 thread): {hash:.3} s ({:.2} GB/s)",
        gbs(hash)
    );
    println!(
        "raw xxh3-128 ({} threads): {hash_par:.3} s ({:.2} GB/s)",
        rayon::current_num_threads(),
        gbs(hash_par)
    );
    println!(
        "open + verify       : {verify:.3} s ({:.2} GB/s, {} threads)",
        gbs(verify),
        rayon::current_num_threads()
    );
    println!(
        "open zero-copy reads: {:.6} s (mapped views; no copy)",
        read
    );
    println!(
        "RATIO write / plain write = {:.2} (target <= 1.3)",
        write / plain
    );
    println!(
        "RATIO verify / raw hash   = {:.2} (target <= 1.2)",
        verify / hash
    );
    println!(
        "RATIO verify / raw hash on {} threads = {:.2}",
        rayon::current_num_threads(),
        verify / hash_par
    );
    std::fs::remove_file(&trace_path).ok();
}
