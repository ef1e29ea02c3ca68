//! The prefill ceiling under docs/numerics.md (an observation, not a test; scripts/
//! matmul_ceiling.sh runs it beside torch's sgemm on the same shapes):
//!
//!     cargo run --release -p tracegate-engine --example matmul_ceiling -- [ROWS=64] [SHAPES=bench]
//!
//! On one core: (a) the peak rate of independent vector multiply-then-add pairs (two rounded
//! instructions, what the engine may use) and of fused multiply-adds (what sgemm uses), per
//! vector width this CPU has; (b) the engine's matmul on a benchmark preset's prefill shapes
//! (`SHAPES`: `bench` or `0.6b`; `ROWS` × in × out, bf16 weights as the engine holds them:
//! panels) in GFLOP/s (2 flops per multiply-add).
//! Prints one JSON line.

use std::time::Instant;

use tracegate_engine::matmul::{matmul_with, Kernel};
use tracegate_engine::weights::{Mat, WDType, PANEL};

/// A preset's linear layers: (name, in, out, times per forward).
type Shapes = &'static [(&'static str, usize, usize, usize)];

/// `scripts/make_fixtures.py bench-qwen3` (8 layers).
const BENCH: Shapes = &[
    ("q_proj", 1024, 1024, 8),
    ("k_proj/v_proj", 1024, 512, 16),
    ("o_proj", 1024, 1024, 8),
    ("gate_proj/up_proj", 1024, 2816, 16),
    ("down_proj", 2816, 1024, 8),
    ("lm_head", 1024, 32000, 1),
];

/// `scripts/make_fixtures.py bench-qwen3-0.6b` (28 layers, head_dim 128, tied head).
const QWEN3_0_6B: Shapes = &[
    ("q_proj", 1024, 2048, 28),
    ("k_proj/v_proj", 1024, 1024, 56),
    ("o_proj", 2048, 1024, 28),
    ("gate_proj/up_proj", 1024, 3072, 56),
    ("down_proj", 3072, 1024, 28),
    ("lm_head", 1024, 151936, 1),
];

/// Independent chains per loop step in the peak loops below (twice as many fused ones): enough
/// to cover 2 ports × 4 cycles of latency, few enough that every chain stays in one of the 16
/// ymm registers (a spilled chain would measure the store forwarding instead).
const CHAINS: usize = 7;
/// Loop steps per peak measurement.
const STEPS: usize = 2_000_000;

fn best_of(n: usize, mut f: impl FnMut()) -> f64 {
    (0..n)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

/// Peak loops: CHAINS independent chains, each step one multiply then one add per chain (the
/// product is the next multiply's input, so nothing folds away), or one fused multiply-add.
/// Return a sum of the lanes so the work is live.
#[cfg(target_arch = "x86_64")]
mod peak {
    use super::CHAINS;
    use std::arch::x86_64::*;

    const C: f32 = 0.999_999_94; // 1 - 2^-24: not 1, so `m * C` is a real multiply

    /// The two loops for one vector width: (names, features, lanes, intrinsics).
    macro_rules! peak_loops {
        ($mul_add:ident, $fma:ident, $feat:literal, $fma_feat:literal, $lanes:literal,
         $set1:ident, $zero:ident, $mul:ident, $add:ident, $fmadd:ident, $store:ident) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $mul_add(steps: usize) -> f32 {
                let c = $set1(C);
                let (mut m, mut a) = ([$set1(1.0); CHAINS], [$zero(); CHAINS]);
                for _ in 0..steps {
                    for i in 0..CHAINS {
                        m[i] = $mul(m[i], c);
                        a[i] = $add(a[i], m[i]);
                    }
                }
                let mut lanes = [0.0f32; $lanes];
                a.iter().fold(0.0, |t, v| {
                    $store(lanes.as_mut_ptr(), *v);
                    t + lanes.iter().sum::<f32>()
                })
            }

            #[target_feature(enable = $fma_feat)]
            pub unsafe fn $fma(steps: usize) -> f32 {
                let (c, d) = ($set1(C), $set1(1.0));
                let mut a = [$zero(); 2 * CHAINS];
                for _ in 0..steps {
                    for ai in a.iter_mut() {
                        *ai = $fmadd(*ai, c, d);
                    }
                }
                let mut lanes = [0.0f32; $lanes];
                a.iter().fold(0.0, |t, v| {
                    $store(lanes.as_mut_ptr(), *v);
                    t + lanes.iter().sum::<f32>()
                })
            }
        };
    }

    #[rustfmt::skip]
    peak_loops!(mul_add_512, fma_512, "avx512f", "avx512f", 16, _mm512_set1_ps,
                _mm512_setzero_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_fmadd_ps, _mm512_storeu_ps);
    #[rustfmt::skip]
    peak_loops!(mul_add_256, fma_256, "avx2", "avx2,fma", 8, _mm256_set1_ps,
                _mm256_setzero_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_fmadd_ps, _mm256_storeu_ps);
}

/// GFLOP/s (2 flops per multiply-add pair) of a peak loop: `vectors` instructions of `lanes`
/// lanes per step. (`black_box` on the step count and the result keeps the pure call inside the
/// timed region.)
fn peak_gflops(lanes: usize, vectors: usize, f: unsafe fn(usize) -> f32) -> f64 {
    use std::hint::black_box;
    // SAFETY: called only where the CPU has the loop's features (checked by the caller).
    let s = best_of(10, || {
        black_box(unsafe { f(black_box(STEPS)) });
    });
    2.0 * (lanes * vectors * STEPS) as f64 / s / 1e9
}

fn main() {
    // As the engine runs: freed outputs reused, not faulted in again per call.
    tracegate_engine::keep_freed_memory();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rows: usize = match args.first() {
        None => 64,
        Some(a) => a.parse().ok().filter(|&r| r > 0).unwrap_or_else(|| {
            eprintln!("matmul_ceiling: ROWS must be a positive integer, not {a:?}");
            std::process::exit(2)
        }),
    };
    let table = match args.get(1).map_or("bench", String::as_str) {
        "bench" => BENCH,
        "0.6b" => QWEN3_0_6B,
        other => {
            eprintln!("matmul_ceiling: SHAPES must be bench or 0.6b, not {other:?}");
            std::process::exit(2)
        }
    };
    if args.len() > 2 {
        eprintln!("usage: matmul_ceiling [ROWS=64] [SHAPES=bench|0.6b]");
        std::process::exit(2);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .expect("a one-thread pool");
    let kernel = Kernel::detect();
    let mut peaks = vec![];
    #[cfg(target_arch = "x86_64")]
    {
        if Kernel::Avx512.supported() {
            peaks.push(("avx512_mul_add", peak_gflops(16, CHAINS, peak::mul_add_512)));
            peaks.push(("avx512_fma", peak_gflops(16, 2 * CHAINS, peak::fma_512)));
        }
        if Kernel::Avx2.supported() && std::arch::is_x86_feature_detected!("fma") {
            peaks.push(("avx2_mul_add", peak_gflops(8, CHAINS, peak::mul_add_256)));
            peaks.push(("avx2_fma", peak_gflops(8, 2 * CHAINS, peak::fma_256)));
        }
    }
    // Deterministic values in a modest range (the rate does not depend on them; no subnormals).
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((seed >> 40) as f32 / (1u64 << 24) as f32) - 0.5
    };
    let mut shapes = vec![];
    for &(name, k, n, per_forward) in table {
        let x: Vec<f32> = (0..rows * k).map(|_| next()).collect();
        let bytes: Vec<u8> = (0..n * k)
            .flat_map(|_| ((next().to_bits() >> 16) as u16).to_le_bytes())
            .collect();
        // As the engine holds them once decode has used them: bf16 panels (`Weight`), on a
        // cache-line boundary as the engine's page-aligned ones are (malloc's 16-byte alignment
        // would let 64-byte loads straddle two lines).
        let len = n.div_ceil(PANEL) * PANEL * k * 2;
        let mut buf = vec![0u8; len + 64];
        let off = buf.as_ptr().align_offset(64);
        let w = Mat::rows(WDType::BF16, n, k, &bytes).pack_into(&mut buf[off..off + len]);
        let s = pool.install(|| {
            best_of(5, || {
                std::hint::black_box(matmul_with(kernel, &x, rows, w, None));
            })
        });
        let gflops = 2.0 * (rows * k * n) as f64 / s / 1e9;
        shapes.push(format!(
            "{{\"name\": \"{name}\", \"rows\": {rows}, \"in\": {k}, \"out\": {n}, \
             \"per_forward\": {per_forward}, \"seconds\": {s:.6}, \"gflops\": {gflops:.2}}}"
        ));
    }
    let peaks: Vec<String> = peaks
        .iter()
        .map(|(k, g)| format!("\"{k}\": {g:.2}"))
        .collect();
    println!(
        "{{\"kernel\": \"{kernel:?}\", \"peak_gflops\": {{{}}}, \"shapes\": [{}]}}",
        peaks.join(", "),
        shapes.join(", ")
    );
}
