//! The matvec path of `matmul` for 1..=MV_ROWS rows (cached decode, lightly routed experts):
//! each weight is read once, widened (and, row-major, transposed) in registers and consumed at
//! once (no L1 block), x broadcast per k, `span` outputs per kernel call, each weight stream
//! prefetched ahead. Threads split the outputs. Every output is still the definition's chain:
//! +0.0, k ascending, one rounded multiply then one rounded add per step (`step`), never FMA,
//! never split-K.

use rayon::prelude::*;

use super::step::{split_at, step, PLANT_SPLIT};
use super::{avx2, avx512, store_outputs, Kernel, SyncPtr};
use crate::matmul::layout::{Layout, Mat, PANEL};

/// Rows up to which `matmul` takes this path (more rows reuse a widened block enough for the
/// tile path to win).
pub(super) const MV_ROWS: usize = 4;

/// `y = x·Wᵀ (+ b)` for `rows ≤ MV_ROWS`, bit-equal to `matmul_ref` (tested).
pub(super) fn matvec<const P: u8>(
    kernel: Kernel,
    x: &[f32],
    rows: usize,
    w: Mat,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    assert!(
        (1..=MV_ROWS).contains(&rows),
        "matvec takes 1..={MV_ROWS} rows"
    );
    match rows {
        1 => run::<1, P>(kernel, x, w, bias),
        2 => run::<2, P>(kernel, x, w, bias),
        3 => run::<3, P>(kernel, x, w, bias),
        _ => run::<4, P>(kernel, x, w, bias),
    }
}

/// Outputs per kernel call on a row-major matrix (one vector of accumulators per row of x).
pub(super) fn lanes(kernel: Kernel) -> usize {
    match kernel {
        Kernel::Avx512 => 16,
        Kernel::Avx2 | Kernel::Portable => 8,
    }
}

/// Outputs per kernel call on `w`: on panels, two panels (two streams, two chains per row of x)
/// on avx512 and one panel (its halves two chains) on avx2; the portable family reads panels
/// element by element, `lanes` at a time.
pub(super) fn span(kernel: Kernel, w: Mat) -> usize {
    match (w.layout, kernel) {
        (Layout::Panels, Kernel::Avx512) => 2 * PANEL,
        (Layout::Panels, Kernel::Avx2) => PANEL,
        _ => lanes(kernel),
    }
}

fn run<const R: usize, const P: u8>(
    kernel: Kernel,
    x: &[f32],
    w: Mat,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let n = w.rows;
    let span = span(kernel, w);
    let panels = w.layout == Layout::Panels && kernel != Kernel::Portable;
    // About four chunks per thread (whole spans: panel boundaries), so uneven cores even out.
    let per = n
        .div_ceil(rayon::current_num_threads() * 4)
        .div_ceil(span)
        .max(1)
        * span;
    let mut y = vec![0.0f32; R * n];
    let yp = SyncPtr(y.as_mut_ptr());
    (0..n.div_ceil(per)).into_par_iter().for_each(|c| {
        let (c0, c1) = (c * per, n.min((c + 1) * per));
        // out[r * stride + j]: one call's outputs for every row.
        let mut out = [0.0f32; MV_ROWS * 2 * PANEL];
        let mut o0 = c0;
        while o0 < c1 {
            let (valid, stride) = if panels {
                // Panels are padded to whole panels: every call reads whole ones.
                let valid = span.min(c1 - o0);
                match kernel {
                    // SAFETY (all three): the CPU supports the family (`matmul_with` asserted
                    // it); o0 is a panel boundary (chunks are whole spans) and the panels
                    // o0/PANEL.. hold `valid` outputs; x holds R rows of k.
                    Kernel::Avx512 if valid > PANEL => unsafe {
                        avx512::matvec_panels_avx512::<R, P, 2>(x, w, o0, &mut out)
                    },
                    Kernel::Avx512 => unsafe {
                        avx512::matvec_panels_avx512::<R, P, 1>(x, w, o0, &mut out)
                    },
                    _ => unsafe { avx2::matvec_panels_avx2::<R, P>(x, w, o0, &mut out) },
                }
                (valid, valid.next_multiple_of(PANEL))
            } else {
                let full = o0 + span <= c1;
                let valid = if full { span } else { 8.min(c1 - o0) };
                match kernel {
                    // SAFETY: the CPU supports the family (`matmul_with` asserted it); outputs
                    // o0..o0+span are rows of w (full); x holds R rows of k.
                    Kernel::Avx512 if full => unsafe {
                        avx512::matvec_avx512::<R, P>(x, w, o0, &mut out)
                    },
                    // SAFETY: as above.
                    Kernel::Avx2 if full => unsafe {
                        avx2::matvec_avx2::<R, P>(x, w, o0, &mut out)
                    },
                    _ => matvec_portable::<R, P>(x, w, o0, valid, &mut out[..R * 8]),
                }
                (valid, if full { span } else { 8 })
            };
            for r in 0..R {
                // SAFETY: in bounds (r < R, o0 + valid ≤ n); chunk c is the only writer of
                // outputs c0..c1, and y outlives the parallel loop.
                unsafe {
                    store_outputs(
                        yp.get().add(r * n + o0),
                        &out[r * stride..r * stride + valid],
                        bias,
                        o0,
                    )
                };
            }
            o0 += valid;
        }
    });
    y
}

/// Scalar: `valid ≤ 8` outputs from `o0`, `out[r*8 + j]`; 8 rows' k-blocks widened to the stack.
fn matvec_portable<const R: usize, const P: u8>(
    x: &[f32],
    w: Mat,
    o0: usize,
    valid: usize,
    out: &mut [f32],
) {
    const B: usize = 64;
    let k = w.cols;
    let ks = if P == PLANT_SPLIT { split_at(k) } else { 0 };
    let mut acc = [[0.0f32; 8]; R];
    let mut saved = [[0.0f32; 8]; R];
    let mut blk = [[0.0f32; B]; 8];
    let mut k0 = 0;
    while k0 < k {
        let kb = B.min(k - k0);
        for (j, row) in blk.iter_mut().enumerate().take(valid) {
            w.widen_row(o0 + j, k0, &mut row[..kb]);
        }
        for kk in 0..kb {
            if ks > 0 && k0 + kk == ks {
                saved = acc;
                acc = [[0.0; 8]; R];
            }
            for r in 0..R {
                let xv = x[r * k + k0 + kk];
                for j in 0..valid {
                    acc[r][j] = step::<P>(acc[r][j], xv, blk[j][kk]);
                }
            }
        }
        k0 += kb;
    }
    if ks > 0 {
        for r in 0..R {
            for j in 0..8 {
                acc[r][j] += saved[r][j];
            }
        }
    }
    for r in 0..R {
        out[r * 8..r * 8 + valid].copy_from_slice(&acc[r][..valid]);
    }
}
