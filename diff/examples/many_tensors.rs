//! Writes a trace of N empty tensors (default 1,000,000: an index of ~127 MB), to measure what
//! `trace-diff` and `--show` cost per index entry (docs/diff.md, "Memory").
//!
//!     cargo run --release -p tracegate-diff --example many_tensors -- OUT.trace [N]

use serde_json::json;
use tracegate_trace::{Attributes, DType, TraceWriter};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args.next().ok_or("usage: many_tensors OUT.trace [N]")?;
    let n: u64 = args
        .next()
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    let attrs = Attributes::default()
        .with_path("prefill")
        .with_mask("causal");
    let mut w = TraceWriter::create(&out, json!({"producer": "many_tensors", "count": n}))?;
    for i in 0..n {
        w.tensor(
            &format!("probe.{i:07}.out"),
            DType::F32,
            &[0, 4],
            &[],
            &attrs,
        )?;
    }
    w.finish()?;
    Ok(())
}
