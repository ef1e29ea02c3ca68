//! trace-diff throughput on two 1 GiB traces in the page cache (docs/benchmarks.md, "trace-diff").
//!
//!     cargo run --release -p tracegate-diff --example bench_diff [-- SIZE_MIB]
//!
//! Prints ratios, asserts nothing: timings on a shared machine are observations.
//! Cases: (1) identical pair (two files), full verify + compare, against xxh3-128 of both whole files;
//! (2) the first of 8 tensors differs in every element (by 1–97 ULP), --all, with verify: its
//! element comparison is the time beyond case 1's; (2b) the same with distances spread up to
//! 10^6 ULP, where the median needs one more pass over that tensor; (3) every element of every
//! tensor differs, --all --no-verify: the element-comparison rate alone (only the first
//! tensor's scan counts distances for a median); (4) a bf16 candidate of the same tensors (each
//! value rounded to bf16, then 0–2 bf16 ULP off) against the f32 reference, --all --no-verify:
//! the mixed-precision rate (docs/diff.md, "Mixed precision").

use std::path::Path;
use std::time::{Duration, Instant};

use tracegate_diff::{compare_files, Options, Verdict};
use tracegate_trace::{Attributes, DType, TraceWriter};

const TENSORS: usize = 8;

/// Varied magnitudes and signs: element `i` of tensor `t`.
fn value(t: usize, i: usize) -> f32 {
    ((i.wrapping_mul(2654435761) >> 7) % 20001) as f32 / 1000.0 - 10.0 + t as f32
}

/// Writes the 8 tensors, `mib` MiB of them as f32, in `dtype` (f32, or bf16 rounded to
/// nearest even), each value's bits then moved by `perturb(t, i)`.
fn write_as(path: &Path, dtype: DType, mib: usize, perturb: impl Fn(usize, usize) -> u32) {
    let per = mib * (1 << 20) / 4 / TENSORS;
    let mut w = TraceWriter::create(path, serde_json::json!({"producer": "bench"})).unwrap();
    let mut bytes = vec![0u8; per * dtype.size()];
    for t in 0..TENSORS {
        for (i, b) in bytes.chunks_exact_mut(dtype.size()).enumerate() {
            let x = value(t, i);
            match dtype {
                DType::F32 => {
                    b.copy_from_slice(&(x.to_bits().wrapping_add(perturb(t, i))).to_le_bytes())
                }
                _ => b.copy_from_slice(
                    &(half::bf16::from_f32(x)
                        .to_bits()
                        .wrapping_add(perturb(t, i) as u16))
                    .to_le_bytes(),
                ),
            }
        }
        w.tensor(
            &format!("layer.{t:02}.hidden_out"),
            dtype,
            &[per as u64 / 1024, 1024],
            &bytes,
            &Attributes::default(),
        )
        .unwrap();
    }
    w.decision("logits.argmax", &[4], &[1, 2, 3, 4], Some(&[0.5; 4]))
        .unwrap();
    w.finish().unwrap();
}

fn write(path: &Path, mib: usize, perturb: impl Fn(usize, usize) -> u32) {
    write_as(path, DType::F32, mib, perturb)
}

/// Best times of two measurements taken in turn, so that drift on a shared machine hits both.
fn best_of_pair<A, B>(
    runs: usize,
    mut f: impl FnMut() -> A,
    mut g: impl FnMut() -> B,
) -> (Duration, Duration, A, B) {
    let (mut tf, mut tg) = (Duration::MAX, Duration::MAX);
    let (mut a, mut b) = (None, None);
    for _ in 0..runs {
        let t = Instant::now();
        a = Some(f());
        tf = tf.min(t.elapsed());
        let t = Instant::now();
        b = Some(g());
        tg = tg.min(t.elapsed());
    }
    (tf, tg, a.unwrap(), b.unwrap())
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
    let mib: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(1024);
    let dir = tempfile::tempdir().unwrap();
    let (r, r2) = (dir.path().join("ref.trace"), dir.path().join("same.trace"));
    let (c1, c2) = (dir.path().join("first.trace"), dir.path().join("all.trace"));
    let wide = dir.path().join("first-wide.trace");
    let bf16 = dir.path().join("bf16.trace");
    eprintln!(
        "writing 5 traces of {mib} MiB and one of {} MiB in {} ...",
        mib / 2,
        dir.path().display()
    );
    write(&r, mib, |_, _| 0);
    write(&r2, mib, |_, _| 0);
    write(
        &c1,
        mib,
        |t, i| if t == 0 { 1 + (i % 97) as u32 } else { 0 },
    );
    write(&wide, mib, |t, i| {
        if t == 0 {
            1 + (i.wrapping_mul(7919) % 1_000_003) as u32
        } else {
            0
        }
    });
    write(&c2, mib, |_, i| 1 + (i % 97) as u32);
    write_as(&bf16, DType::BF16, mib, |_, i| (i % 3) as u32);
    let elements_per_tensor = (mib * (1 << 20) / 4 / TENSORS) as f64;
    let threads = rayon::current_num_threads();
    println!("trace-diff bench: 2 traces of {mib} MiB each, {TENSORS} f32 tensors, {threads} rayon threads");

    // Page cache warm-up, then the baseline: xxh3-128 over both whole files.
    for p in [&r, &r2, &c1, &wide, &c2, &bf16] {
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

    let all = Options {
        all: true,
        ..Options::default()
    };
    for (name, cand) in [("by 1-97 ULP", &c1), ("by up to 10^6 ULP", &wide)] {
        let (ident, first, _, rep) = best_of_pair(
            7,
            || compare_files(&r, &r2, &opts),
            || compare_files(&r, cand, &all),
        );
        let fd = rep.first_divergence.as_ref().unwrap();
        assert_eq!(fd.differing_elements as f64, elements_per_tensor);
        let scan_only = first.as_secs_f64() - ident.as_secs_f64();
        println!(
            "first tensor differs everywhere {name} (median {} ULP), --all: {:.3} s end to end ({:.0} M elements element-wise); beyond the identical pair's {:.3} s: {:.3} s → {:.2} G elements/s (target ≥ 1)",
            fd.median_ulp.map_or("-".to_string(), |m| m.to_string()),
            first.as_secs_f64(),
            elements_per_tensor / 1e6,
            ident.as_secs_f64(),
            scan_only,
            elements_per_tensor / scan_only / 1e9
        );
    }

    let raw = Options {
        all: true,
        verify: false,
        ..Options::default()
    };
    let (every, rep) = best(3, || compare_files(&r, &c2, &raw));
    let n = elements_per_tensor * TENSORS as f64;
    assert_eq!(
        rep.per_tensor
            .iter()
            .filter_map(|t| t.differing_elements)
            .sum::<u64>() as f64,
        n
    );
    println!(
        "every element differs, --all --no-verify: {:.3} s for {:.0} M elements → {:.2} G elements/s",
        every.as_secs_f64(),
        n / 1e6,
        n / every.as_secs_f64() / 1e9
    );

    // A bf16 port against the f32 reference: every pair mixed, most elements differ in value.
    // Best of 7, as case 2: each run is short, and on a shared machine most runs share a core.
    let (mixed, rep) = best(7, || compare_files(&r, &bf16, &raw));
    assert_eq!(rep.verdict, Verdict::Different);
    let t0 = &rep.per_tensor[0];
    assert_eq!(
        (t0.dtype, t0.candidate_dtype, t0.ulp_dtype),
        ("f32", DType::BF16, Some(DType::BF16))
    );
    assert_eq!(
        rep.per_tensor.iter().map(|t| t.total_elements).sum::<u64>() as f64,
        n
    );
    println!(
        "bf16 candidate vs f32 reference, --all --no-verify: {:.3} s for {:.0} M elements ({} differ in value, max {} bf16 ULP) → {:.2} G elements/s (target ≥ 1)",
        mixed.as_secs_f64(),
        n / 1e6,
        rep.differing_elements(),
        rep.per_tensor.iter().filter_map(|t| t.max_ulp).max().unwrap_or(0),
        n / mixed.as_secs_f64() / 1e9
    );
    // Mapped file pages are shared page cache; anonymous memory is what the differ allocated.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |k: &str| {
        status
            .lines()
            .find(|l| l.starts_with(k))
            .map(|l| l[k.len()..].trim().to_string())
            .unwrap_or_default()
    };
    println!(
        "memory: RssAnon {} (heap, after all cases), RssFile {} (mapped trace pages, shared with the page cache)",
        field("RssAnon:"),
        field("RssFile:")
    );
}
