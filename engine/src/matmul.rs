//! The fast matmul of docs/numerics.md §2 (and the kernel families, which `ops`'s attention
//! dispatches on too): same arithmetic as the definition in `ops` (`matmul_ref`), each output
//! from +0.0 with k ascending and one rounded multiply then one rounded add per step (no FMA, no
//! split-K); only the grouping across outputs and rows changes. Runtime-detected SIMD kernels
//! beside a portable one; every path is tested bit-for-bit against the definition.
//!
//! Here: the kernel families and their dispatch, the tile loop and the data movement they share.
//! The kernels: `portable`, `avx2` and `avx512` (one file each), and `matvec` (1..=MV_ROWS rows:
//! decode; its SIMD kernels live in `avx2` and `avx512`, the step they share in `step`).

mod avx2;
mod avx512;
pub mod layout;
mod matvec;
mod portable;
mod step;
#[cfg(test)]
pub(crate) mod tests;

use rayon::prelude::*;

use crate::aligned::Lines;
use layout::{Layout, Mat};

use avx2::tile_avx2_packed;
#[cfg(target_arch = "x86_64")]
use avx2::{widen_panels_avx2, widen_transposed_avx2};
use avx512::tile_avx512_packed;
#[cfg(target_arch = "x86_64")]
use avx512::{widen_panels_avx512, widen_transposed_avx512};
use portable::{tile_portable, widen_panels, widen_transposed_scalar};

/// Rows of x up to which `matmul` takes the matvec path (decode): where a `Weight`'s panels pay.
pub const MATVEC_ROWS: usize = matvec::MV_ROWS;

/// Whether this process's kernel family has panel kernels (AVX2, AVX-512). The portable family
/// reads panels element by element, slower than the file's rows: there a `Weight` stays
/// row-major (other targets than x86-64, and `TRACEGATE_ENGINE_PORTABLE`).
pub fn panels_pay() -> bool {
    Kernel::detect() != Kernel::Portable
}

/// Outputs per tile: one 512-bit vector of accumulators per row.
const NR: usize = 16;
/// k per widened block: `KB × NR` f32 (16 KiB) stays in L1 while every row block streams it.
const KB: usize = 256;
/// Rows per micro-kernel call (independent accumulators per (row, output)).
const MR: usize = 8;
/// Rows per packed panel, and per micro-kernel call on the avx512 path (one zmm accumulator per
/// row). 12, not 16: the 16-row call ran about 10 % below 12 on the AVX-512 Xeon (docs/
/// benchmarks.md, "Softmax and SiLU without libm's exp per element"); on AVX2 a panel is two
/// 6-row calls instead of 6 + 6 + 4.
const MRP: usize = 12;
/// Rows per micro-kernel call on the avx2 path (two ymm accumulators per row: 12 of 16 registers).
const MRA: usize = 6;

/// The kernel family a matmul runs. Every family computes the same bits (tested); they differ in
/// vector width only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// Scalar code for baseline x86-64 (and other targets).
    Portable,
    /// 256-bit vectors: avx2 (plus f16c to widen f16 weights). Never FMA.
    Avx2,
    /// 512-bit vectors: avx512f. Never FMA.
    Avx512,
}

impl Kernel {
    /// The widest family this CPU supports; `TRACEGATE_ENGINE_PORTABLE` (any value) forces the
    /// portable one, so tests can check that every path gives the same digest.
    pub fn detect() -> Kernel {
        static DETECTED: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            if std::env::var_os("TRACEGATE_ENGINE_PORTABLE").is_some() {
                Kernel::Portable
            } else if Kernel::Avx512.supported() {
                Kernel::Avx512
            } else if Kernel::Avx2.supported() {
                Kernel::Avx2
            } else {
                Kernel::Portable
            }
        })
    }

    /// Whether this CPU can run the family (the environment variable aside).
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Kernel::Portable => true,
                Kernel::Avx2 => {
                    std::arch::is_x86_feature_detected!("avx2")
                        && std::arch::is_x86_feature_detected!("f16c")
                }
                Kernel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Kernel::Portable
        }
    }

    /// Every family this CPU can run, portable first (the tests compare them all).
    pub fn all_supported() -> Vec<Kernel> {
        [Kernel::Portable, Kernel::Avx2, Kernel::Avx512]
            .into_iter()
            .filter(|k| k.supported())
            .collect()
    }
}

/// §2, fast: `y = x·Wᵀ (+ b)`, `x` is `[rows, K]`, result `[rows, N]`. Tiles of NR outputs are
/// spread over the rayon pool; within a tile every (row, output) has its own accumulator that
/// starts at +0.0 and adds `x[r,k] ⊗ w[o,k]` for k ascending, across k-blocks, exactly as `dot`
/// does. Only the grouping across outputs and rows changes, so bits equal `matmul_ref`.
pub fn matmul(x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    matmul_with(Kernel::detect(), x, rows, w, bias)
}

/// `matmul` on a given kernel family (tests run every family the CPU has). Panics if the CPU
/// cannot run it.
pub fn matmul_with(
    kernel: Kernel,
    x: &[f32],
    rows: usize,
    w: Mat,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    assert!(
        kernel.supported(),
        "{kernel:?} kernels need CPU features this CPU lacks"
    );
    let (n, k) = (w.rows, w.cols);
    assert_eq!(x.len(), rows * k, "x is [rows, K]");
    if (1..=matvec::MV_ROWS).contains(&rows) {
        return matvec::matvec::<{ step::EXACT }>(kernel, x, rows, w, bias);
    }
    let tiles = n.div_ceil(NR);
    // Not zeroed: the tiles write every element (below) before `set_len`.
    let mut y: Vec<f32> = Vec::with_capacity(rows * n);
    // The SIMD paths read x from k-major panels of MRP rows (pure data movement).
    let xp = match kernel {
        Kernel::Portable => Vec::new(),
        Kernel::Avx2 | Kernel::Avx512 => pack_rows(x, rows, k),
    };
    let yp = SyncPtr(y.as_mut_ptr());
    // Each task keeps its tile's [rows][NR] accumulators and the widened weight block in scratch
    // of its own, cache-line aligned (not zeroed per tile: the first k-block's kernels start from
    // +0.0 and write every accumulator before any is read; with no k-block they stay the zeros
    // they were made with), and writes the finished tile straight into its columns of y.
    // (1..=MV_ROWS rows, cached decode, took the matvec path above: no L1 block there.) Never a
    // whole f32 copy of the weights.
    (0..tiles).into_par_iter().for_each_init(
        || (Lines::zeros(rows * NR), Lines::zeros(KB * NR)),
        |(tile_acc, block), t| {
            let wt: &mut [f32; KB * NR] = (&mut block[..]).try_into().expect("KB × NR floats");
            let o0 = t * NR;
            let valid = NR.min(n - o0);
            let mut k0 = 0;
            while k0 < k {
                let kb = KB.min(k - k0);
                widen_transposed(kernel, w, o0, valid, k0, kb, wt);
                match kernel {
                    // SAFETY: the CPU supports avx512f (asserted above); `xp` is `x` packed.
                    Kernel::Avx512 => unsafe {
                        tile_avx512_packed(&xp, k, rows, k0, kb, wt, tile_acc)
                    },
                    // SAFETY: the CPU supports avx2 (asserted above); `xp` is `x` packed.
                    Kernel::Avx2 => unsafe { tile_avx2_packed(&xp, k, rows, k0, kb, wt, tile_acc) },
                    Kernel::Portable => tile_portable(x, k, rows, k0, kb, wt, tile_acc),
                }
                k0 += kb;
            }
            for r in 0..rows {
                // SAFETY: in bounds of y's capacity (r < rows, o0 + valid ≤ n); tile t is the
                // only writer of columns o0..o0+valid, and y outlives the parallel loop.
                unsafe {
                    store_outputs(
                        yp.get().add(r * n + o0),
                        &tile_acc[r * NR..r * NR + valid],
                        bias,
                        o0,
                    )
                };
            }
        },
    );
    // SAFETY: the tiles cover columns 0..n (t * NR, `valid` each) and each wrote every row.
    unsafe { y.set_len(rows * n) };
    y
}

/// Finished accumulators `src` of outputs `o0..` to `dst` (raw: y is not initialised before),
/// the bias (if any) added once, after the whole accumulation. A whole tile is one fixed-size
/// copy: a call to memmove per 64 bytes took ~3 % of a 512-token prefill.
///
/// # Safety
/// `dst..dst + src.len()` is valid for writes and written by no one else meanwhile.
unsafe fn store_outputs(dst: *mut f32, src: &[f32], bias: Option<&[f32]>, o0: usize) {
    match bias {
        Some(b) => {
            for (j, (&s, &bb)) in src.iter().zip(&b[o0..o0 + src.len()]).enumerate() {
                dst.add(j).write(s + bb);
            }
        }
        // (As a typed array: a length-NR `copy_nonoverlapping` here became memmove again.)
        None if src.len() == NR => dst
            .cast::<[f32; NR]>()
            .write_unaligned(src.as_ptr().cast::<[f32; NR]>().read_unaligned()),
        None => std::ptr::copy_nonoverlapping(src.as_ptr(), dst, src.len()),
    }
}

/// The output pointer shared by the tile tasks (each writes disjoint columns).
struct SyncPtr(*mut f32);
// SAFETY: only used for disjoint writes inside `matmul` while the Vec it points into is alive.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}
impl SyncPtr {
    fn get(&self) -> *mut f32 {
        self.0
    }
}

/// `x [rows, K]` as panels: rows `b*MRP..b*MRP+MRP` stored k-major (`[K][MRP]`) at `b*MRP*K`,
/// then the `rows % MRP` tail rows k-major (`[K][rem]`). Pure data movement.
fn pack_rows(x: &[f32], rows: usize, k: usize) -> Vec<f32> {
    let mut xp = vec![0.0f32; rows * k];
    let mut r0 = 0;
    while r0 < rows {
        let m = MRP.min(rows - r0);
        let dst = &mut xp[r0 * k..(r0 + m) * k];
        for i in 0..m {
            let src = &x[(r0 + i) * k..(r0 + i + 1) * k];
            for (kk, &v) in src.iter().enumerate() {
                dst[kk * m + i] = v;
            }
        }
        r0 += m;
    }
    xp
}

/// Widen `W[o0..o0+valid, k0..k0+kb]` into `wt[k*NR + j]` (lanes past `valid` are zero and their
/// results discarded). Pure data movement: every path stores the same exact values. (Tiles
/// start on panel boundaries: NR = PANEL.)
fn widen_transposed(
    kernel: Kernel,
    w: Mat,
    o0: usize,
    valid: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32; KB * NR],
) {
    if w.layout == Layout::Panels {
        match kernel {
            // SAFETY (both): the family's CPU features were checked by the caller; the block is
            // whole panel words of `w` (the kernels assert it).
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => unsafe { widen_panels_avx512(w, o0, k0, kb, wt) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { widen_panels_avx2(w, o0, k0, kb, wt) },
            _ => widen_panels(w, o0, k0, kb, &mut wt[..]),
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if valid == NR {
        // SAFETY: the family's CPU features were checked by the caller (`matmul_with` asserts
        // `supported`); the block's rows/columns are in bounds of `w` (valid == NR).
        let done = match kernel {
            Kernel::Avx512 if kb >= 16 => unsafe { widen_transposed_avx512(w, o0, k0, kb, wt) },
            Kernel::Avx2 if kb >= 8 => unsafe { widen_transposed_avx2(w, o0, k0, kb, wt) },
            _ => 0,
        };
        if done < kb {
            widen_transposed_scalar(w, o0, valid, k0 + done, kb - done, &mut wt[done * NR..]);
        }
        return;
    }
    let _ = kernel;
    widen_transposed_scalar(w, o0, valid, k0, kb, &mut wt[..]);
}
