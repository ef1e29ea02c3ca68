//! trace-diff throughput on two 1 GiB traces in the page cache (docs/benchmarks.md, "trace-diff").
//!
//!     cargo run --release -p tracegate-diff --example bench_diff [-- SIZE_MIB]
//!
//! Prints ratios, asserts nothing: timings on a shared machine are observations.
//! Cases: (1) identical pair (two files), full verify + compare, against xxh3-128 of both whole files;
//! (2) the first of 8 tensors differs in every element, --all, with verify; (3) every
//! element of every tensor differs, --all --no-verify: the element-comparison rate alone.

use std::path::Path;
use std::time::{Duration, Instant};

use tracegate_diff::{compare_files, Options, Verdict};
use tracegate_trace::{Attributes, DType, TraceWriter};

const TENSORS: usize = 8;

fn write(path: &Path, mib: usize, perturb: impl Fn(usize, usize) -> u32) {
    let per = mib * (1 << 20) / 4 / TENSORS;
    let mut w = TraceWriter::create(path, serde_json::json!({"producer": "bench"})).unwrap();
    let mut bytes = vec![0u8; per * 4];
    for t in 0..TENSORS {
        for (i, b) in bytes.chunks_exact_mut(4).enumerate() {
            // Varied magnitudes and signs, then a per-element bit perturbation.
            let x = ((i.wrapping_mul(2654435761) >> 7) % 20001) as f32 / 1000.0 - 10.0 + t as f32;
            b.copy_from_slice(&(x.to_bits().wrapping_add(perturb(t, i))).to_le_bytes());
        }
        w.tensor(&format!("layer.{t:02}.hidden_out"), DType::F32, &[per as u64 / 1024, 1024], &bytes, &Attributes::default()).unwrap();
    }
    w.decision("logits.argmax", &[4], &[1, 2, 3, 4], Some(&[0.5; 4])).unwrap();
    w.finish().unwrap();
}

fn best<T>(runs: usize, mut f: impl FnMut() -> T) -> (Duration, T) {
    let mut best = Duration::MAX;
    let mut out = None;
    for _ in 0..runs {
        let t = Instant::now();
        let v = f();
        best = best.min(t.elapsed());
        out = Some(v);
    }
    (best, out.unwrap())
}

fn hash_file(p: &Path) -> u128 {
    let f = std::fs::File::open(p).unwrap();
    // SAFETY: the file is not modified while mapped (the benchmark owns it).
    let m = unsafe { memmap2::Mmap::map(&f).unwrap() };
    xxhash_rust::xxh3::xxh3_128(&m)
}

fn main() {
    let mib: usize = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(1024);
    let dir = tempfile::tempdir().unwrap();
    let (r, r2) = (dir.path().join("ref.trace"), dir.path().join("same.trace"));
    let (c1, c2) = (dir.path().join("first.trace"), dir.path().join("all.trace"));
    eprintln!("writing 4 traces of {mib} MiB in {} ...", dir.path().display());
    write(&r, mib, |_, _| 0);
    write(&r2, mib, |_, _| 0);
    write(&c1, mib, |t, i| if t == 0 { 1 + (i % 97) as u32 } else { 0 });
    write(&c2, mib, |_, i| 1 + (i % 97) as u32);
    let elements_per_tensor = (mib * (1 << 20) / 4 / TENSORS) as f64;
    let threads = rayon::current_num_threads();
    println!("trace-diff bench: 2 traces of {mib} MiB each, {TENSORS} f32 tensors, {threads} rayon threads");

    // Page cache warm-up, then the baseline: xxh3-128 over both whole files.
    for p in [&r, &r2, &c1, &c2] {
        hash_file(p);
    }
    let (hash_seq, _) = best(3, || (hash_file(&r), hash_file(&r2)));
    let (hash_par, _) = best(3, || rayon::join(|| hash_file(&r), || hash_file(&r2)));

    let opts = Options::default();
    let (ident, rep) = best(3, || compare_files(&r, &r2, &opts));
    assert_eq!(rep.verdict, Verdict::Identical);
    println!(
        "identical pair (verify + compare): {:.3} s; xxh3 both files: {:.3} s sequential, {:.3} s two threads → ratio {:.2}× (vs sequential), {:.2}× (vs two threads); target ≤ 1.5×",
        ident.as_secs_f64(),
        hash_seq.as_secs_f64(),
        hash_par.as_secs_f64(),
        ident.as_secs_f64() / hash_seq.as_secs_f64(),
        ident.as_secs_f64() / hash_par.as_secs_f64()
    );

    let all = Options { all: true, ..Options::default() };
    let (first, rep) = best(3, || compare_files(&r, &c1, &all));
    assert_eq!(rep.first_divergence.as_ref().unwrap().differing_elements as f64, elements_per_tensor);
    let scan_only = first.as_secs_f64() - ident.as_secs_f64();
    println!(
        "first tensor differs everywhere, --all: {:.3} s end to end ({:.0} M elements element-wise); beyond the identical-pair time: {:.3} s → {:.2} G elements/s",
        first.as_secs_f64(),
        elements_per_tensor / 1e6,
        scan_only,
        elements_per_tensor / scan_only / 1e9
    );

    let raw = Options { all: true, verify: false, ..Options::default() };
    let (every, rep) = best(3, || compare_files(&r, &c2, &raw));
    let n = elements_per_tensor * TENSORS as f64;
    assert_eq!(rep.per_tensor.iter().filter_map(|t| t.differing_elements).sum::<u64>() as f64, n);
    println!(
        "every element differs, --all --no-verify: {:.3} s for {:.0} M elements → {:.2} G elements/s (target ≥ 1)",
        every.as_secs_f64(),
        n / 1e6,
        n / every.as_secs_f64() / 1e9
    );
    // Mapped file pages are shared page cache; anonymous memory is what the differ allocated.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| status.lines().find(|l| l.starts_with(k)).map(|l| l[k.len()..].trim().to_string()).unwrap_or_default();
    println!(
        "memory: RssAnon {} (heap, after all cases), RssFile {} (mapped trace pages, shared with the page cache)",
        field("RssAnon:"),
        field("RssFile:")
    );
}
