//! What the differ's own structures cost per tensor, apart from the reader's: opens both
//! traces, then reports resident memory before and after `compare` (Linux /proc/self/status).
//!
//!     cargo run --release -p tracegate-diff --example differ_memory -- REF CAND

use tracegate_diff::{compare, Options};
use tracegate_trace::Trace;

fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches(" kB").parse().ok())
        .unwrap_or(0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [r, c] = &args[..] else {
        return Err("usage: differ_memory REF CAND".into());
    };
    let (r, c) = (Trace::open(r)?, Trace::open(c)?);
    let before = rss_kib();
    let rep = compare(&r, &c, &Options::default());
    let after = rss_kib();
    let n = rep.tensors.reference_count.max(1) as u64;
    eprintln!(
        "size_of TensorRow {} bytes",
        std::mem::size_of::<tracegate_diff::TensorRow>()
    );
    println!(
        "{:?}: {} tensors; resident after open {} KiB, after compare {} KiB: the report holds {} bytes per tensor",
        rep.verdict,
        n,
        before,
        after,
        (after.saturating_sub(before)) * 1024 / n
    );
    Ok(())
}
