//! Qwen3.5's Gated DeltaNet (§18): the decay (§18.4), the causal conv1d (§18.2) and the delta
//! rule (§18.5).

use super::{exp_to_f32, silu};

/// §18.4 PyTorch's softplus (beta 1, threshold 20): `u` above 20, else
/// `f32(log1p(E(u)))` in binary64 with libm's exp and log1p. NaN takes the second branch.
pub fn softplus(u: f32) -> f32 {
    if u > 20.0 {
        u
    } else {
        (u as f64).exp().ln_1p() as f32
    }
}

/// §18.4 one value head's decay for one row: `g = (−f32(E(A_log))) ⊗ softplus(a ⊕ dt_bias)`
/// (≤ 0, captured as `linear.g`) and the factor `alpha = f32(E(g))` the state is scaled by.
pub fn gdn_decay(a: f32, dt_bias: f32, a_log: f32) -> (f32, f32) {
    let sp = softplus(a + dt_bias);
    let g = -exp_to_f32(a_log) * sp;
    (g, exp_to_f32(g))
}

/// §18.2 causal depthwise conv1d + SiLU of one row, updating the conv state. `state` holds
/// each channel's K−1 previous pre-conv values, oldest first (`[conv_dim, K−1]`, channel-major);
/// `w` is `conv1d.weight` as `[conv_dim, K]`; `mixed` the row's pre-conv values. Every channel:
/// `acc = Σ_j win[j] ⊗ w[c, j]` over the window (state, then this row) from +0.0 in j order, the
/// output `silu(acc)`; then the window, less its oldest value, becomes the state.
pub fn causal_conv1d(mixed: &[f32], w: &[f32], k: usize, state: &mut [f32], out: &mut [f32]) {
    let keep = k - 1;
    for c in 0..mixed.len() {
        let st = &mut state[c * keep..(c + 1) * keep];
        let wc = &w[c * k..(c + 1) * k];
        let mut acc = 0.0f32;
        for j in 0..keep {
            acc += st[j] * wc[j];
        }
        acc += mixed[c] * wc[keep];
        out[c] = silu(acc);
        if keep > 0 {
            st.copy_within(1.., 0);
            st[keep - 1] = mixed[c];
        }
    }
}

/// §18.5 the delta rule for one row and one value head, on its state `s` (`[dk, dv]`,
/// row-major): decay by `alpha`, read `mem = Sᵀk`, `d = (v ⊖ mem) ⊗ beta`, write `S ⊕= k dᵀ`,
/// then `out = Sᵀq` (the query already scaled); every sum over i ascending from +0.0.
#[allow(clippy::too_many_arguments)]
pub fn delta_rule_step(
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    alpha: f32,
    beta: f32,
    mem: &mut [f32],
    out: &mut [f32],
) {
    let (dk, dv) = (k.len(), v.len());
    for x in s.iter_mut() {
        *x *= alpha;
    }
    mem.fill(0.0);
    for i in 0..dk {
        for j in 0..dv {
            mem[j] += s[i * dv + j] * k[i];
        }
    }
    for j in 0..dv {
        mem[j] = (v[j] - mem[j]) * beta; // d[j], in mem's place
    }
    for i in 0..dk {
        for j in 0..dv {
            s[i * dv + j] += k[i] * mem[j];
        }
    }
    out.fill(0.0);
    for i in 0..dk {
        for j in 0..dv {
            out[j] += s[i * dv + j] * q[i];
        }
    }
}
