//! The norms: §6 RMSNorm, Qwen3.5's §15.1 zero-centred and §15.2 gated variants, and §18.3's L2
//! normalisation.

use rayon::prelude::*;

use super::silu;

/// §6 RMSNorm of one vector.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for i in 0..x.len() {
        out[i] = w[i] * (x[i] * inv);
    }
}

/// §15.1 zero-centred RMSNorm of one vector (Qwen3.5): §6's `inv`, then
/// `(x[i] ⊗ inv) ⊗ (1 ⊕ w[i])`.
pub fn rmsnorm_zero_centred(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for i in 0..x.len() {
        out[i] = (x[i] * inv) * (1.0 + w[i]);
    }
}

/// §6's `1 ⊘ sqrt(mean(x²) ⊕ eps)`, the mean an ordered sum of squares divided by n.
fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let mut ss = 0.0f32;
    for &v in x {
        ss += v * v;
    }
    let mean = ss / x.len() as f32;
    1.0f32 / (mean + eps).sqrt()
}

/// §15.2 gated RMSNorm (Qwen3.5's linear-attention output norm): §6 with the plain weight,
/// then times `silu(z[i])`.
pub fn gated_rmsnorm(x: &[f32], w: &[f32], z: &[f32], eps: f32, out: &mut [f32]) {
    rmsnorm(x, w, eps, out);
    for i in 0..x.len() {
        out[i] *= silu(z[i]);
    }
}

/// §18.3 L2 normalisation of one vector with transformers' fixed `1e-6`:
/// `x[i] ⊗ (1 ⊘ sqrt(Σ x² ⊕ 1e-6))`, the sum ordered.
pub fn l2norm(x: &[f32], out: &mut [f32]) {
    let mut ss = 0.0f32;
    for &v in x {
        ss += v * v;
    }
    let inv = 1.0f32 / (ss + 1e-6f32).sqrt();
    for i in 0..x.len() {
        out[i] = x[i] * inv;
    }
}

/// §6 RMSNorm (or, `zero_centred`, §15.1's) of every `n`-wide row of `x`.
pub fn rmsnorm_rows(x: &[f32], w: &[f32], eps: f32, zero_centred: bool) -> Vec<f32> {
    let n = w.len();
    let mut out = vec![0.0f32; x.len()];
    // Rows are independent; each row's arithmetic is the same whichever thread runs it.
    out.par_chunks_exact_mut(n)
        .zip(x.par_chunks_exact(n))
        .for_each(|(or, xr)| match zero_centred {
            false => rmsnorm(xr, w, eps, or),
            true => rmsnorm_zero_centred(xr, w, eps, or),
        });
    out
}

/// diffusion-gemma.md DG3 `rmsnorm_plain` (a weightless norm): §6's `inv`, then `x[i] ⊗ inv`.
pub fn rmsnorm_plain(x: &[f32], eps: f32, out: &mut [f32]) {
    let inv = rms_inv(x, eps);
    for i in 0..x.len() {
        out[i] = x[i] * inv;
    }
}
