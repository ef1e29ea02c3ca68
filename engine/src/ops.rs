//! Ordered fp32 kernels, each the written definition of docs/numerics.md (section numbers in the
//! comments). Rust never contracts `a * b + c` into an FMA, so every `+`/`*` below is one rounded
//! IEEE operation. Four operations have a fast path, each tested bit for bit against its
//! definition: `matmul` (tiled, AVX2/AVX-512, in `crate::matmul`, re-exported here) against
//! `matmul_ref`; `attention` (threaded over heads, query rows in blocks, keys and values
//! vectorised per kernel family) against `attention_ref`; and in `fast_exp`, the softmax's
//! exponentials (`exp_shifted`) and the gated MLP's SiLU product (`silu_mul`) against
//! `exp_to_f32` and `silu` (a polynomial `exp` kept only where it provably rounds as libm's does).
//! Names follow docs/numerics.md §14, the same as the contract's ops.py.
//!
//! Here: §2–§4, §9 and the softmax of §8.6/§10.2 (dot, ordered sum, the matmul definition, exp,
//! softmax, sigmoid, SiLU), the operations the others are written in. By section group, each
//! re-exported here: `norm` (§6, §15, §18.3), `attention` (§7–§8), `gated_deltanet` (§18) and
//! `decisions` (§10.3, §12).

mod attention;
mod decisions;
mod fast_exp;
mod gated_deltanet;
mod norm;
#[cfg(test)]
mod tests;

use crate::matmul::layout::Mat;
pub use crate::matmul::matmul;
pub use attention::{
    attention, attention_masked, attention_ref, inv_freq, inv_freq_scaled, Heads, KeyRows, Rope,
    RopeScaling,
};
pub use decisions::{argmax_margin, margin_of, topk};
pub use fast_exp::{exp_shifted, silu_mul};
pub use gated_deltanet::{causal_conv1d, delta_rule_step, gdn_decay, softplus};
pub use norm::{gated_rmsnorm, l2norm, rmsnorm, rmsnorm_plain, rmsnorm_rows, rmsnorm_zero_centred};

/// §2: `acc = +0.0; acc = acc ⊕ (x[k] ⊗ w[k])` for k ascending.
#[inline]
pub fn dot(x: &[f32], w: &[f32]) -> f32 {
    dot_from(0.0, x, w)
}

/// §2's loop continued from `acc` (§23.3: a rank goes on with the accumulator handed to it).
#[inline]
pub fn dot_from(mut acc: f32, x: &[f32], w: &[f32]) -> f32 {
    for k in 0..x.len() {
        acc += x[k] * w[k];
    }
    acc
}

/// §3: ordered sum from +0.0.
pub fn ordered_sum(v: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for &x in v {
        acc += x;
    }
    acc
}

/// §2, the plain definition: `y[r,o] = dot(x[r,:], W[o,:]) (⊕ b[o])`. The reference for tests.
pub fn matmul_ref(x: &[f32], rows: usize, w: Mat, bias: Option<&[f32]>) -> Vec<f32> {
    matmul_ref_by(x, rows, w, bias, dot)
}

/// `matmul_ref` with `dot` replaced (tests plant other orders with it to show they are caught).
pub fn matmul_ref_by(
    x: &[f32],
    rows: usize,
    w: Mat,
    bias: Option<&[f32]>,
    dot: impl Fn(&[f32], &[f32]) -> f32,
) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let mut wr = vec![0.0f32; k];
    let mut y = vec![0.0f32; rows * n];
    for o in 0..n {
        w.widen_row(o, 0, &mut wr);
        for r in 0..rows {
            let mut v = dot(&x[r * k..(r + 1) * k], &wr);
            if let Some(b) = bias {
                v += b[o];
            }
            y[r * n + o] = v;
        }
    }
    y
}

/// §4 `f32(E(binary64(x)))`: libm's binary64 exp, rounded to f32 once.
pub fn exp_to_f32(x: f32) -> f32 {
    (x as f64).exp() as f32
}

/// §8.6 / §10.2 softmax over the entries with `visible[c]`; masked entries get +0.0.
/// `m` is the max of the visible scores; `e = f32(exp_f64(s ⊖ m))`; ordered sum; divide.
pub fn softmax(s: &[f32], visible: impl Fn(usize) -> bool, out: &mut [f32]) {
    let mut m = f32::NEG_INFINITY;
    for (c, &v) in s.iter().enumerate() {
        if visible(c) && v > m {
            m = v;
        }
    }
    let mut z = 0.0f32;
    for (c, &v) in s.iter().enumerate() {
        if visible(c) {
            let e = exp_to_f32(v - m);
            out[c] = e;
            z += e;
        } else {
            out[c] = 0.0;
        }
    }
    for (c, o) in out.iter_mut().enumerate() {
        if visible(c) {
            *o /= z;
        }
    }
}

/// §9 sigmoid with the stated branch, binary64 throughout, rounded once. NaN takes `g < 0`.
pub fn sigmoid(g: f32) -> f32 {
    let g64 = g as f64;
    if g >= 0.0 {
        (1.0 / (1.0 + (-g64).exp())) as f32
    } else {
        let e = g64.exp();
        (e / (1.0 + e)) as f32
    }
}

/// §9 `silu(g) = g ⊗ sigmoid(g)`.
pub fn silu(g: f32) -> f32 {
    g * sigmoid(g)
}

/// diffusion-gemma.md DG1: `f32(tanh(binary64(x)))`, libm's binary64 tanh rounded once.
pub fn tanh_to_f32(x: f32) -> f32 {
    (x as f64).tanh() as f32
}

/// numerics.md §22.5 a logit softcap `f32(tanh(binary64(x ⊘ c))) ⊗ c` (diffusion-gemma.md DG11's
/// arithmetic).
pub fn softcap(x: f32, c: f32) -> f32 {
    tanh_to_f32(x / c) * c
}

/// diffusion-gemma.md DG7 `gelu_pytorch_tanh` in torch's order:
/// `(0.5 ⊗ x) ⊗ (1 ⊕ tanh(β ⊗ (x ⊕ κ ⊗ x³)))`, β = f32(√2·(2/√π)·0.5), κ = f32(0.044715).
pub fn gelu_tanh(x: f32) -> f32 {
    let beta = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
    let kappa = 0.044715f32;
    let x3 = (x * x) * x;
    let inner = beta * (x + kappa * x3);
    (0.5f32 * x) * (1.0f32 + tanh_to_f32(inner))
}
