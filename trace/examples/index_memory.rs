//! Measurement (not a test): peak memory of opening a trace with a large index.
//!
//!     cargo run --release -p tracegate-trace --example index_memory -- write N FILE
//!     /usr/bin/time -v target/release/examples/index_memory open FILE
//!
//! `write` records N empty f32 tensors (the index is all there is); `open` opens and verifies
//! the file and prints the index size beside the process's peak RSS (VmHWM).

use serde_json::json;
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

fn peak_rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    match (args.get(1).map(String::as_str), args.get(2), args.get(3)) {
        (Some("write"), Some(n), Some(file)) => {
            let n: usize = n.parse().expect("N is a count");
            let mut w =
                TraceWriter::create(file, json!({"producer": "index_memory"})).expect("create");
            let attrs = Attributes::default();
            for i in 0..n {
                w.tensor(
                    &format!("layer.{:02}.tensor.{i:09}", i % 64),
                    DType::F32,
                    &[0],
                    &[],
                    &attrs,
                )
                .expect("tensor");
            }
            w.finish().expect("finish");
        }
        (Some("open"), Some(file), _) => {
            let t = Trace::open(file).expect("open");
            t.verify().expect("verify");
            let len = std::fs::metadata(file).map(|m| m.len()).unwrap_or(0);
            let rss = peak_rss_kib() * 1024;
            println!(
                "{} tensors, file {len} bytes; peak RSS {rss} bytes = {:.2} x the file",
                t.tensors().len(),
                rss as f64 / len as f64
            );
        }
        _ => eprintln!("usage: index_memory write N FILE | index_memory open FILE"),
    }
}
