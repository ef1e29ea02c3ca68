//! The reader's memory is bounded by its index: opening and verifying a trace of many empty
//! tensors (an index and nothing else) grows peak RSS by at most 3x the index size
//! (docs/trace-format.md, "Memory"). Measured in a fresh child process, whose high-water mark
//! (VmHWM) holds nothing else.

use serde_json::json;
use tracegate_trace::{Attributes, DType, Trace, TraceWriter};

fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib * 1024)
}

/// Child half: prints the growth of peak RSS across open + verify of TRACEGATE_MEMORY_CHILD.
#[test]
fn memory_child() {
    let Ok(path) = std::env::var("TRACEGATE_MEMORY_CHILD") else {
        return;
    };
    let before = peak_rss_bytes().expect("VmHWM");
    let t = Trace::open(&path).unwrap();
    t.verify().unwrap();
    let after = peak_rss_bytes().expect("VmHWM");
    println!("GROWTH {} TENSORS {}", after - before, t.tensors().len());
}

/// Opens and verifies, in a child process, a trace of `n` empty tensors each with `attrs`;
/// asserts peak RSS grows by at most 3x the index.
fn assert_open_costs_at_most_three_times_the_index(n: usize, attrs: &Attributes) {
    if peak_rss_bytes().is_none() {
        println!("NOT CHECKED: no /proc/self/status VmHWM on this system to measure peak RSS");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wide.trace");
    let mut w = TraceWriter::create(&path, json!({})).unwrap();
    for i in 0..n {
        w.tensor(
            &format!("layer.{:02}.tensor.{i:09}", i % 64),
            DType::F32,
            &[0],
            &[],
            attrs,
        )
        .unwrap();
    }
    w.finish().unwrap();
    let index_len = {
        let f = std::fs::read(&path).unwrap();
        u64::from_le_bytes(f[f.len() - 32..f.len() - 24].try_into().unwrap())
    };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "memory::memory_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("TRACEGATE_MEMORY_CHILD", &path)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("GROWTH ").map(|(_, r)| r))
        .unwrap_or_else(|| panic!("the child did not report its growth: {stdout}"));
    let (growth, tensors) = line.split_once(" TENSORS ").unwrap();
    let growth: u64 = growth.parse().unwrap();
    assert_eq!(tensors, n.to_string());
    assert!(
        growth <= 3 * index_len,
        "open + verify grew peak RSS by {growth} bytes for a {index_len}-byte index ({:.2}x, limit 3x)",
        growth as f64 / index_len as f64
    );
}

#[test]
fn opening_a_large_index_costs_at_most_three_times_its_size() {
    assert_open_costs_at_most_three_times_the_index(200_000, &Attributes::default());
}

#[test]
fn extra_attributes_keep_the_same_bound() {
    // One short extra attribute per tensor: a B-tree map per tensor cost ~540 bytes (6.1x).
    let mut attrs = Attributes::default();
    attrs.extra.insert("r".into(), "x".into());
    assert_open_costs_at_most_three_times_the_index(200_000, &attrs);
}
