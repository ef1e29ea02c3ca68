//! Qwen3.5's Gated DeltaNet (§18): the decay (§18.4), the causal conv1d (§18.2) and the delta
//! rule (§18.5).

use super::{exp_to_f32, silu};
use crate::matmul::Kernel;

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
///
/// Two passes over S instead of five steps: row i is decayed just before the read adds it
/// (steps 1–2), and is final once written, so the output adds it right after (steps 4–5). Every
/// element meets the same operations on the same operands, and each sum still takes i
/// ascending, so the bits are the steps'. The same body is compiled for AVX2 / AVX-512 (wider
/// vectors across j, never FMA: Rust does not contract a multiply and an add) and picked as the
/// matmul kernel is (`Kernel::detect`, so `TRACEGATE_ENGINE_PORTABLE` forces the baseline one).
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
    let row = DeltaRow {
        q,
        k,
        v,
        alpha,
        beta,
    };
    delta_rule_step_with(Kernel::detect(), s, &row, mem, out)
}

/// One row's operands of `delta_rule_step` for one value head.
pub(crate) struct DeltaRow<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub alpha: f32,
    pub beta: f32,
}

/// `delta_rule_step` compiled for `kernel`'s family (tests run each one the CPU supports);
/// a family this CPU lacks runs the baseline body.
pub(crate) fn delta_rule_step_with(
    kernel: Kernel,
    s: &mut [f32],
    row: &DeltaRow,
    mem: &mut [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if kernel.supported() {
        match kernel {
            // SAFETY: the CPU supports the family (checked just above).
            Kernel::Avx512 => unsafe { return delta_rule_step_avx512(s, row, mem, out) },
            // SAFETY: as above (the Avx2 family includes avx2).
            Kernel::Avx2 => unsafe { return delta_rule_step_avx2(s, row, mem, out) },
            Kernel::Portable => {}
        }
    }
    delta_rule_body(s, row, mem, out)
}

/// `delta_rule_body` compiled with a target feature: one function per SIMD family.
macro_rules! delta_rule_for {
    ($name:ident, $feature:literal) => {
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $feature)]
        unsafe fn $name(s: &mut [f32], row: &DeltaRow, mem: &mut [f32], out: &mut [f32]) {
            delta_rule_body(s, row, mem, out)
        }
    };
}
delta_rule_for!(delta_rule_step_avx512, "avx512f");
delta_rule_for!(delta_rule_step_avx2, "avx2");

#[inline(always)]
fn delta_rule_body(s: &mut [f32], row: &DeltaRow, mem: &mut [f32], out: &mut [f32]) {
    let (q, k, v, alpha, beta) = (row.q, row.k, row.v, row.alpha, row.beta);
    let dv = v.len();
    let mem = &mut mem[..dv];
    let out = &mut out[..dv];
    mem.fill(0.0);
    for (row, &ki) in s.chunks_exact_mut(dv).zip(k) {
        for (x, m) in row.iter_mut().zip(mem.iter_mut()) {
            *x *= alpha;
            *m += *x * ki;
        }
    }
    for (m, &vj) in mem.iter_mut().zip(v) {
        *m = (vj - *m) * beta; // d[j], in mem's place
    }
    out.fill(0.0);
    for ((row, &ki), &qi) in s.chunks_exact_mut(dv).zip(k).zip(q) {
        for ((x, &d), o) in row.iter_mut().zip(mem.iter()).zip(out.iter_mut()) {
            *x += ki * d;
            *o += *x * qi;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::matmul::tests::{note_unchecked_kernels, vals};

    /// §18.5's five steps as numerics.md writes them, on `s`; returns the output row. With
    /// `read_descending` step 2 sums i descending (the negative control's planted reorder).
    fn steps(s: &mut [f32], row: &DeltaRow, read_descending: bool) -> Vec<f32> {
        let (q, k, v, alpha, beta) = (row.q, row.k, row.v, row.alpha, row.beta);
        let (dk, dv) = (k.len(), v.len());
        for x in s.iter_mut() {
            *x *= alpha;
        }
        let mut mem = vec![0.0f32; dv];
        for j in 0..dv {
            for n in 0..dk {
                let i = if read_descending { dk - 1 - n } else { n };
                mem[j] += s[i * dv + j] * k[i];
            }
        }
        let d: Vec<f32> = (0..dv).map(|j| (v[j] - mem[j]) * beta).collect();
        for i in 0..dk {
            for j in 0..dv {
                s[i * dv + j] += k[i] * d[j];
            }
        }
        let mut out = vec![0.0f32; dv];
        for j in 0..dv {
            for i in 0..dk {
                out[j] += s[i * dv + j] * q[i];
            }
        }
        out
    }

    fn bits(x: &[f32]) -> Vec<u32> {
        x.iter().map(|v| v.to_bits()).collect()
    }

    /// Several rows on one state (the state carries), shapes with vector tails, every family
    /// this CPU has, against the written steps bit for bit; `mem` and `out` start as garbage.
    #[test]
    fn delta_rule_step_every_kernel_equals_the_steps_bits() {
        note_unchecked_kernels("delta_rule_step_every_kernel_equals_the_steps_bits");
        let mut planted_differs = false;
        for &(dk, dv) in &[(1, 1), (5, 19), (16, 33), (128, 128)] {
            for kernel in [Kernel::Portable, Kernel::Avx2, Kernel::Avx512] {
                if !kernel.supported() {
                    continue;
                }
                let mut want_s = vals(dk * dv, 1);
                let mut got_s = want_s.clone();
                let mut planted_s = want_s.clone();
                for r in 0..4u64 {
                    let (q, k, v) = (vals(dk, 10 + r), vals(dk, 20 + r), vals(dv, 30 + r));
                    let row = DeltaRow {
                        q: &q,
                        k: &k,
                        v: &v,
                        alpha: 0.9 - 0.15 * r as f32,
                        beta: 0.3 + 0.2 * r as f32,
                    };
                    let want = steps(&mut want_s, &row, false);
                    let (mut mem, mut out) = (vec![7.0f32; dv], vec![9.0f32; dv]);
                    delta_rule_step_with(kernel, &mut got_s, &row, &mut mem, &mut out);
                    assert_eq!(
                        bits(&out),
                        bits(&want),
                        "{kernel:?} dk {dk} dv {dv} row {r}"
                    );
                    assert_eq!(bits(&got_s), bits(&want_s), "{kernel:?} state, row {r}");
                    let planted = steps(&mut planted_s, &row, true);
                    planted_differs |= bits(&planted) != bits(&out);
                }
            }
        }
        // Negative control: a read summed in the other order is caught by this comparison.
        assert!(
            planted_differs,
            "a reordered read gave the same bits: the data cannot tell"
        );
    }
}
