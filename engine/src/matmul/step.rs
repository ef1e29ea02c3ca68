//! What one step of an output's chain is, shared by the matvec path (`matvec.rs`) and its SIMD
//! kernels (`avx2.rs`, `avx512.rs`): the exact step `acc ⊕ (x ⊗ w)` and the planted faults only
//! the tests instantiate, and how far ahead the kernels prefetch their weight streams.

/// What a step does: `EXACT` in every build; the others are planted faults that only the
/// tests instantiate (the kernels take it as a const parameter, so the release build holds the
/// exact code alone), to show that the bit-equality check catches them in this path.
pub(super) const EXACT: u8 = 0;
/// Planted fault: a fused multiply–add per step (one rounding).
#[cfg_attr(not(test), allow(dead_code))]
pub(super) const PLANT_FMA: u8 = 1;
/// Planted fault: split-K, k from `split_at` on accumulated from +0.0 apart, then added.
pub(super) const PLANT_SPLIT: u8 = 2;

/// Where a planted split-K restarts its accumulators: half of k rounded down to a multiple of
/// 16 (a step boundary of every family; 0 = no split, k too short).
#[inline(always)]
pub(super) fn split_at(k: usize) -> usize {
    k / 2 / 16 * 16
}

/// One scalar step `acc ⊕ (x ⊗ w)`, or the planted fused step.
#[inline(always)]
pub(super) fn step<const P: u8>(acc: f32, x: f32, w: f32) -> f32 {
    if P == PLANT_FMA {
        x.mul_add(w, acc)
    } else {
        acc + x * w
    }
}

/// How far ahead (bytes) the SIMD kernels prefetch each weight row: one group of outputs per
/// call with 512 B ahead was the fastest variant measured on the 16-core Xeon at 1, 2 and 16
/// threads (docs/benchmarks.md, "Decode matvec path").
pub(super) const PREFETCH: usize = 512;

/// How far ahead (bytes) the panel kernels prefetch each panel's stream: 2 KiB was among the
/// fastest distances measured on the 16-core Xeon at 1 and 2 threads, 512 B clearly slower
/// (docs/benchmarks.md, "Decode from row panels").
pub(super) const PANEL_PREFETCH: usize = 2048;
