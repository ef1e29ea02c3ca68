//! The portable kernel: scalar tiles (any target), and the scalar widening every family falls
//! back to for partial tiles and k tails.

use super::{KB, MR, NR};
use crate::matmul::layout::{Mat, PANEL};

/// A block `W[o0..o0+NR, k0..k0+kb]` of a `Layout::Panels` matrix (o0 a panel boundary, k0 and
/// kb even) into `wt[k*NR + j]`: the panel is already transposed in pairs, so each word widens
/// to lane j of two consecutive k (padding rows are zero words: zero lanes). Every family takes
/// this path for panels (the SIMD families through their own copy of this loop).
pub(super) fn widen_panels(w: Mat, o0: usize, k0: usize, kb: usize, wt: &mut [f32]) {
    const { assert!(NR == PANEL) };
    assert!(k0.is_multiple_of(2) && kb.is_multiple_of(2));
    let panel = w.panels_from(o0, 1);
    for q in 0..kb / 2 {
        let src = &panel[(k0 / 2 + q) * PANEL * 4..][..PANEL * 4];
        let (even, odd) = wt[2 * q * NR..(2 * q + 2) * NR].split_at_mut(NR);
        for (j, word) in src.chunks_exact(4).enumerate() {
            let word = u32::from_le_bytes([word[0], word[1], word[2], word[3]]);
            even[j] = f32::from_bits(word << 16);
            odd[j] = f32::from_bits(word & 0xFFFF_0000);
        }
    }
}

pub(super) fn widen_transposed_scalar(
    w: Mat,
    o0: usize,
    valid: usize,
    k0: usize,
    kb: usize,
    wt: &mut [f32],
) {
    let mut row = [0.0f32; KB];
    for j in 0..NR {
        if j < valid {
            w.widen_row(o0 + j, k0, &mut row[..kb]);
            for kk in 0..kb {
                wt[kk * NR + j] = row[kk];
            }
        } else {
            for kk in 0..kb {
                wt[kk * NR + j] = 0.0;
            }
        }
    }
}

/// One k-block of a tile for all rows, in blocks of MR rows then single rows.
#[inline(always)]
fn tile_generic(
    x: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    let mut r = 0;
    while r + MR <= rows {
        micro::<MR>(x, k, r, k0, kb, wt, acc);
        r += MR;
    }
    while r < rows {
        micro::<1>(x, k, r, k0, kb, wt, acc);
        r += 1;
    }
}

/// `M` rows × NR outputs: `acc[m][j] = acc[m][j] ⊕ (x[r+m, k0+kk] ⊗ wt[kk][j])`, kk ascending;
/// in the first k-block (k0 = 0) from +0.0, not from `acc`.
#[inline(always)]
fn micro<const M: usize>(
    x: &[f32],
    k: usize,
    r0: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    let mut a = [[0.0f32; NR]; M];
    if k0 > 0 {
        for m in 0..M {
            a[m].copy_from_slice(&acc[(r0 + m) * NR..(r0 + m + 1) * NR]);
        }
    }
    let xs: [&[f32]; M] = std::array::from_fn(|m| &x[(r0 + m) * k + k0..(r0 + m) * k + k0 + kb]);
    for kk in 0..kb {
        let wv: &[f32; NR] = wt[kk * NR..(kk + 1) * NR].try_into().expect("NR lanes");
        for m in 0..M {
            let xv = xs[m][kk];
            for j in 0..NR {
                a[m][j] += xv * wv[j];
            }
        }
    }
    for m in 0..M {
        acc[(r0 + m) * NR..(r0 + m + 1) * NR].copy_from_slice(&a[m]);
    }
}

pub(super) fn tile_portable(
    x: &[f32],
    k: usize,
    rows: usize,
    k0: usize,
    kb: usize,
    wt: &[f32; KB * NR],
    acc: &mut [f32],
) {
    tile_generic(x, k, rows, k0, kb, wt, acc)
}
