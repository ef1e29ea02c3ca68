//! The numerics.md operations against hand cases and their definitions.

use super::attention::{self, PLANT_FMA, PLANT_NONE, PLANT_SPLIT, PLANT_SUM_ORDER};
use super::*;
use crate::matmul::tests::{first_mismatch, note_unchecked_kernels, vals};
use crate::matmul::Kernel;

/// An attention case: `(nq, nkv, d, key count, query rows)`, keys at positions `k_pos` (the
/// query rows at the last `t` of them unless `q_pos` is given).
struct AttnCase {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    k_pos: Vec<i64>,
    q_pos: Vec<i64>,
    hs: Heads,
}

fn attn_case(nq: usize, nkv: usize, d: usize, s_len: usize, t: usize, seed: u64) -> AttnCase {
    let k_pos: Vec<i64> = (0..s_len as i64).collect();
    AttnCase {
        q: vals(t * nq * d, seed),
        k: vals(s_len * nkv * d, seed + 1),
        v: vals(s_len * nkv * d, seed + 2),
        q_pos: k_pos[s_len - t..].to_vec(),
        k_pos,
        hs: Heads { nq, nkv, d },
    }
}

impl AttnCase {
    fn run<const PLANT: u8>(&self, kernel: Kernel, want_probs: bool) -> (Vec<f32>, Vec<f32>) {
        let keys = KeyRows {
            k: &self.k,
            v: &self.v,
            pos: &self.k_pos,
        };
        let job = attention::Job {
            q: &self.q,
            q_pos: &self.q_pos,
            keys: &keys,
            hs: self.hs,
            scale: 0.375,
        };
        attention::attention_with::<PLANT>(kernel, &job, want_probs)
    }

    fn reference(&self) -> (Vec<f32>, Vec<f32>) {
        let keys = KeyRows {
            k: &self.k,
            v: &self.v,
            pos: &self.k_pos,
        };
        attention_ref(&self.q, &self.q_pos, &keys, self.hs, 0.375)
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn attention_fast_equals_definition_bits() {
    note_unchecked_kernels("attention_fast_equals_definition_bits");
    // GQA groups of 1, 2 and 3; head dims odd, below and above every vector width (67 = 64 + 3);
    // key counts around the 8/16/64-wide blocks; query-row counts not a multiple of the 4-row
    // block; cached rows (keys before the query rows) and a causal prefill (each row sees a
    // different count). Qwen3.5's output gate multiplies o after this function (model/mixer/attention.rs), so
    // its path is this one.
    let mut cases = vec![];
    for (i, &(nq, nkv, d, s_len, t)) in [
        (2, 2, 4, 1, 1),
        (6, 2, 8, 17, 5),
        (3, 1, 6, 33, 33),
        (4, 2, 67, 70, 70),
        (2, 1, 64, 131, 7),
        (2, 2, 128, 19, 19),
        (3, 3, 24, 65, 1),
    ]
    .iter()
    .enumerate()
    {
        cases.push(attn_case(nq, nkv, d, s_len, t, 11 + 3 * i as u64));
    }
    // Key positions out of order (a key hidden from a row between visible ones), and a row that
    // sees no key at all.
    let mut holes = attn_case(2, 1, 16, 23, 6, 40);
    holes.k_pos.swap(3, 20);
    holes.k_pos.swap(8, 22);
    holes.q_pos[0] = -1;
    cases.push(holes);
    // Keys in order (each row's visible keys a prefix) and a row before every key.
    let mut early = attn_case(2, 1, 16, 23, 6, 41);
    early.q_pos[0] = -1;
    cases.push(early);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(3)
        .build()
        .unwrap();
    for (n, case) in cases.iter().enumerate() {
        let (want_o, want_p) = case.reference();
        for kernel in Kernel::all_supported() {
            let (got_o, got_p) = pool.install(|| case.run::<PLANT_NONE>(kernel, true));
            assert_eq!(bits(&want_o), bits(&got_o), "o: case {n} {kernel:?}");
            assert_eq!(bits(&want_p), bits(&got_p), "p: case {n} {kernel:?}");
            let (o2, p2) = case.run::<PLANT_NONE>(kernel, false);
            assert_eq!(
                bits(&o2),
                bits(&want_o),
                "o without probs: case {n} {kernel:?}"
            );
            assert!(p2.is_empty());
        }
    }
    // The public entry is the detected family's path.
    let c = &cases[3];
    let keys = KeyRows {
        k: &c.k,
        v: &c.v,
        pos: &c.k_pos,
    };
    let (o, _) = attention(&c.q, &c.q_pos, &keys, c.hs, 0.375, false);
    assert_eq!(bits(&o), bits(&c.reference().0));
}

/// Negative control for the test above: a planted split-K in the scores, a planted FMA in P·V
/// and the softmax's sums taken backwards, in every family's own widest blocks (d = 64: whole
/// vectors; 40 rows: whole 4-row blocks and keys every row of a block sees), are caught by the
/// same comparison.
#[test]
fn attention_check_catches_planted_split_and_fma() {
    note_unchecked_kernels("attention_check_catches_planted_split_and_fma");
    let case = attn_case(4, 2, 64, 40, 40, 7);
    let (want_o, want_p) = case.reference();
    for kernel in Kernel::all_supported() {
        let (o, p) = case.run::<PLANT_SPLIT>(kernel, true);
        assert_ne!(
            bits(&want_p),
            bits(&p),
            "split scores not caught: {kernel:?}"
        );
        assert_ne!(
            bits(&want_o),
            bits(&o),
            "split scores not caught: {kernel:?}"
        );
        let (o, p) = case.run::<PLANT_FMA>(kernel, true);
        assert_eq!(
            bits(&want_p),
            bits(&p),
            "the FMA plant is in P·V only: {kernel:?}"
        );
        assert_ne!(bits(&want_o), bits(&o), "fused P·V not caught: {kernel:?}");
        let (_, p) = case.run::<PLANT_SUM_ORDER>(kernel, true);
        assert_ne!(
            bits(&want_p),
            bits(&p),
            "softmax sums out of order not caught: {kernel:?}"
        );
    }
}

#[test]
fn dot_starts_from_positive_zero() {
    // -0 ⊗ 1 = -0, and +0 ⊕ -0 = +0: the accumulator's +0 start is visible.
    assert_eq!(dot(&[-0.0], &[1.0]).to_bits(), 0.0f32.to_bits());
    // Order matters: (1e8 + 1) - 1e8 = 0 in f32, left to right.
    assert_eq!(dot(&[1e8, 1.0, -1e8], &[1.0, 1.0, 1.0]), 0.0);
    assert_eq!(ordered_sum(&[1.0, 1e8, -1e8]), 0.0);
    assert_eq!(ordered_sum(&[1e8, -1e8, 1.0]), 1.0);
}

#[test]
fn rmsnorm_hand_case() {
    // x = [3, 4]: ss = 25, mean = 12.5, t = 12.5 + eps, inv = 1/sqrt(t).
    let eps = 1e-6f32;
    let mut out = [0.0f32; 2];
    rmsnorm(&[3.0, 4.0], &[1.0, 2.0], eps, &mut out);
    let inv = 1.0f32 / (12.5f32 + eps).sqrt();
    assert_eq!(out, [1.0 * (3.0 * inv), 2.0 * (4.0 * inv)]);
    // Zero vector: inv = 1/sqrt(eps), output zeros keep their sign.
    rmsnorm(&[0.0, -0.0], &[1.0, 1.0], eps, &mut out);
    assert_eq!(out[0].to_bits(), 0.0f32.to_bits());
    assert_eq!(out[1].to_bits(), (-0.0f32).to_bits());
}

#[test]
fn rmsnorm_zero_centred_and_gated_hand_cases() {
    // §15.1: x = [3, 4], w = [0, 1]: u = [1, 2], y = (x ⊗ inv) ⊗ u.
    let eps = 1e-6f32;
    let inv = 1.0f32 / (12.5f32 + eps).sqrt();
    let mut out = [0.0f32; 2];
    rmsnorm_zero_centred(&[3.0, 4.0], &[0.0, 1.0], eps, &mut out);
    assert_eq!(out, [3.0 * inv, (4.0 * inv) * 2.0]);
    // Control: the plain norm with the same stored weight is another function.
    let mut plain = [0.0f32; 2];
    rmsnorm(&[3.0, 4.0], &[0.0, 1.0], eps, &mut plain);
    assert_ne!(plain, out);
    // §15.2: plain weight, then times silu(z); silu(0) = 0 zeroes its element.
    gated_rmsnorm(&[3.0, 4.0], &[1.0, 2.0], &[0.0, 2.0], eps, &mut out);
    let sig2 = (1.0f64 / (1.0 + (-2.0f64).exp())) as f32;
    assert_eq!(out, [0.0, (2.0 * (4.0 * inv)) * (2.0 * sig2)]);
}

#[test]
fn l2norm_uses_the_fixed_epsilon() {
    // §18.3 on a small vector, where the epsilon shows: t = ss ⊕ f32(1e-6), ordered ss.
    let x = [3e-4f32, 4e-4];
    let mut out = [0.0f32; 2];
    l2norm(&x, &mut out);
    let ss = (0.0f32 + x[0] * x[0]) + x[1] * x[1];
    let inv = 1.0f32 / (ss + 1e-6f32).sqrt();
    assert_eq!(out, [x[0] * inv, x[1] * inv]);
    // Control: without the epsilon (or with rms_norm_eps 1e-5) the result is another one.
    for eps in [0.0f32, 1e-5] {
        let inv = 1.0f32 / (ss + eps).sqrt();
        assert_ne!(out, [x[0] * inv, x[1] * inv]);
    }
}

#[test]
fn softplus_threshold_and_decay() {
    // §18.4: above 20 the input itself; at 20 and below libm's log1p(exp(u)) in binary64.
    assert_eq!(softplus(21.0), 21.0);
    assert_eq!(softplus(20.0), (20.0f64.exp().ln_1p()) as f32);
    // Control: the threshold keeps a large input finite where log1p(exp(u)) overflows.
    assert_eq!(softplus(1000.0), 1000.0);
    assert!((1000.0f64.exp().ln_1p() as f32).is_infinite());
    assert_eq!(softplus(0.0), std::f64::consts::LN_2 as f32);
    assert_eq!(softplus(f32::NEG_INFINITY), 0.0);
    assert!(softplus(f32::NAN).is_nan());
    // g = (−f32(E(A_log))) ⊗ softplus(a ⊕ dt_bias); alpha = f32(E(g)).
    let (g, alpha) = gdn_decay(0.5, 0.25, 0.0);
    let sp = (0.75f64.exp().ln_1p()) as f32;
    assert_eq!(g, -sp);
    assert_eq!(alpha, ((g as f64).exp()) as f32);
    let (g2, _) = gdn_decay(0.5, 0.25, std::f32::consts::LN_2);
    assert_eq!(g2, -(((std::f32::consts::LN_2 as f64).exp()) as f32) * sp);
    assert!(g2 < g && g < 0.0);
}

#[test]
fn causal_conv1d_reads_the_state_then_the_row() {
    // §18.2, K = 3, two channels (taps [1, 2, 3] and [0.5, 0, -1]), rows 1, 10, 100 and 2, 4, 8.
    let w = [1.0f32, 2.0, 3.0, 0.5, 0.0, -1.0];
    let mut state = [0.0f32; 4]; // [conv_dim 2, K-1 2], zeros before position 0
    let mut out = [0.0f32; 2];
    let rows = [[1.0f32, 2.0], [10.0, 4.0], [100.0, 8.0]];
    // acc, row t, channel 0: Σ win[j] ⊗ w[j] with win = (state, row).
    let want0 = [3.0f32, 2.0 + 30.0, 1.0 + 20.0 + 300.0];
    let want1 = [-2.0f32, -4.0, 1.0 + 0.0 - 8.0];
    for (t, row) in rows.iter().enumerate() {
        causal_conv1d(row, &w, 3, &mut state, &mut out);
        assert_eq!(out, [silu(want0[t]), silu(want1[t])], "row {t}");
    }
    assert_eq!(state, [10.0, 100.0, 4.0, 8.0]);
    // K = 1: no state, the row times its one tap.
    causal_conv1d(&[2.0], &[3.0], 1, &mut [], &mut out[..1]);
    assert_eq!(out[0], silu(6.0));
}

#[test]
fn delta_rule_step_hand_case() {
    // §18.5, dk = dv = 2, S = [[1, 2], [3, 4]] (i rows, j columns): every value exact.
    let mut s = [1.0f32, 2.0, 3.0, 4.0];
    let (mut mem, mut out) = ([9.0f32; 2], [9.0f32; 2]);
    delta_rule_step(
        &mut s,
        &[1.0, 1.0],
        &[1.0, 0.0],
        &[2.0, 3.0],
        0.5,
        0.5,
        &mut mem,
        &mut out,
    );
    // decay: [[.5, 1], [1.5, 2]]; mem = [.5, 1]; d = [(2 − .5)·.5, (3 − 1)·.5] = [.75, 1];
    // write row 0 (k = [1, 0]): [[1.25, 2], [1.5, 2]]; out = S₀ + S₁ = [2.75, 4].
    assert_eq!(s, [1.25, 2.0, 1.5, 2.0]);
    assert_eq!(out, [2.75, 4.0]);
    // Control: the output reads the state after the write (before it, out would be [2, 3]).
    assert_ne!(out, [2.0, 3.0]);
}

#[test]
fn softmax_with_masked_and_neg_inf() {
    let s = [1.0f32, f32::NEG_INFINITY, 3.0, 100.0];
    let mut p = [9.0f32; 4];
    softmax(&s, |c| c < 3, &mut p);
    // m = 3; e = [exp(-2), exp(-inf)=0, 1]; masked entry 3 → +0.
    let e0 = ((-2.0f64).exp()) as f32;
    let z = (e0 + 0.0) + 1.0;
    assert_eq!(p, [e0 / z, 0.0, 1.0 / z, 0.0]);
    assert_eq!(p[3].to_bits(), 0);
}

#[test]
fn rope_table_entries_match_f64_formula() {
    let (base, d) = (10000.0f64, 12usize);
    let inv = inv_freq(base, d);
    for i in 0..d / 2 {
        let want = (1.0 / base.powf(2.0 * i as f64 / 12.0)) as f32;
        assert_eq!(inv[i].to_bits(), want.to_bits());
    }
    assert_eq!(inv[0], 1.0);
    let rope = Rope::new(base, d, &[0, 5, 1000]);
    for (row, p) in [0i64, 5, 1000].iter().enumerate() {
        for i in 0..6 {
            let angle = (*p as f32) * inv[i];
            assert_eq!(
                rope.cos[row * 6 + i].to_bits(),
                ((angle as f64).cos() as f32).to_bits()
            );
            assert_eq!(
                rope.sin[row * 6 + i].to_bits(),
                ((angle as f64).sin() as f32).to_bits()
            );
        }
    }
    // Position 0 is the identity.
    let mut x: Vec<f32> = (0..12).map(|i| i as f32 - 5.5).collect();
    let x0 = x.clone();
    rope.apply(0, &mut x);
    assert_eq!(x, x0);
    // Hand case: d = 2, angle = π/2-ish: out = (a·c − b·s, b·c + a·s).
    let r = Rope {
        half: 1,
        cos: vec![0.5],
        sin: vec![0.25],
    };
    let mut v = [2.0f32, 4.0];
    r.apply(0, &mut v);
    assert_eq!(v, [2.0 * 0.5 - 4.0 * 0.25, 4.0 * 0.5 + 2.0 * 0.25]);
}

#[test]
fn rope_odd_rotary_dim_rounds_up_as_transformers() {
    // §16: d_r = 3 (12 × 0.25). transformers: arange(0, 3, 2) → 2 frequencies, exponent over 3,
    // cos/sin 4 wide: dims 0..3 rotate (0 with 2, 1 with 3), 4.. are left alone.
    let base = 100.0f64;
    let f1 = (1.0 / base.powf(2.0 / 3.0)) as f32;
    assert_eq!(inv_freq(base, 3), [1.0, f1]);
    let rope = Rope::new(base, 3, &[2]);
    assert_eq!(rope.half, 2);
    let (a0, a1) = (2.0f32, 2.0f32 * f1);
    let (c0, s0) = ((a0 as f64).cos() as f32, (a0 as f64).sin() as f32);
    let (c1, s1) = ((a1 as f64).cos() as f32, (a1 as f64).sin() as f32);
    let mut x: Vec<f32> = (1..=12).map(|i| i as f32).collect();
    rope.apply(0, &mut x);
    let mut want = vec![
        1.0 * c0 - 3.0 * s0,
        2.0 * c1 - 4.0 * s1,
        3.0 * c0 + 1.0 * s0,
        4.0 * c1 + 2.0 * s1,
    ];
    want.extend((5..=12).map(|i| i as f32));
    assert_eq!(bits(&x), bits(&want));
    // Negative controls, the two tempting off-by-ones: the floor (one frequency: dims 0 and 1
    // rotate, dim 3 passes) and the rounded-up width in the denominator (100^(-2/4) = 0.1).
    let mut y: Vec<f32> = (1..=12).map(|i| i as f32).collect();
    Rope::new(base, 2, &[2]).apply(0, &mut y);
    assert_ne!(bits(&y), bits(&want));
    assert_ne!(inv_freq(base, 4), [1.0, f1]);
}

#[test]
fn silu_both_branches() {
    let g = 1.5f32;
    assert_eq!(sigmoid(g), (1.0 / (1.0 + (-1.5f64).exp())) as f32);
    let g = -1.5f32;
    let e = (-1.5f64).exp();
    assert_eq!(sigmoid(g), (e / (1.0 + e)) as f32);
    assert_eq!(sigmoid(0.0), 0.5);
    assert_eq!(sigmoid(-0.0), 0.5);
    assert_eq!(
        sigmoid(-200.0),
        ((-200.0f64).exp() / (1.0 + (-200.0f64).exp())) as f32
    );
    assert_eq!(silu(2.0), 2.0 * sigmoid(2.0));
    assert!(silu(f32::NAN).is_nan());
    assert!(silu(f32::NEG_INFINITY).is_nan()); // -inf ⊗ 0: IEEE NaN, left as is
}

#[test]
fn topk_ties_go_to_lowest_index() {
    let p = [0.1f32, 0.3, 0.3, 0.2, 0.3];
    let (c, next) = topk(&p, 2);
    assert_eq!(c, vec![1, 2]);
    assert_eq!(next, Some(4));
    let (c, next) = topk(&p, 5);
    assert_eq!(c, vec![1, 2, 4, 3, 0]);
    assert_eq!(next, None);
}

#[test]
fn argmax_margin_ties_and_values() {
    assert_eq!(argmax_margin(&[1.0, 3.0, 3.0, 2.0]), (1, 0.0));
    assert_eq!(argmax_margin(&[5.0, 3.0, -1.0]), (0, 2.0));
    assert_eq!(
        argmax_margin(&[-1.0, f32::NEG_INFINITY]),
        (0, f32::INFINITY)
    );
}

/// f32s from every `stride`-th bit pattern in `[lo, hi)`, then the cases at the edges of the
/// fast path's range and every special value.
fn sampled(lo: u32, hi: u32, stride: u32) -> Vec<f32> {
    let mut xs: Vec<f32> = (lo..hi)
        .step_by(stride as usize)
        .map(f32::from_bits)
        .collect();
    for x in [
        0.0f32,
        -0.0,
        -87.0,
        -87.00001,
        -86.99999,
        87.0,
        87.00001,
        -87.4,
        -88.73,
        -103.97,
        -104.0,
        -1e-45,
        1e-45,
        -1.17e-38,
        f32::MIN,
        f32::MAX,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        -f32::NAN,
    ] {
        xs.push(x);
    }
    xs
}

fn exp_definition(s: &[f32], m: f32) -> Vec<f32> {
    s.iter().map(|&v| exp_to_f32(v - m)).collect()
}

fn silu_definition(g: &[f32], u: &[f32]) -> Vec<f32> {
    g.iter().zip(u).map(|(&g, &u)| silu(g) * u).collect()
}

/// Every kernel family's softmax exponentials and SiLU products equal the definition's bits on
/// about 11 M softmax arguments (every 101st f32 in [-88, -0]) and 16 M SiLU inputs (every
/// 257th of all 2^32 patterns: NaNs, infinities, subnormals), with a shift `m` and odd lengths
/// (the scalar tail). About 2·2^10/2^29 of the lanes are near an f32 midpoint, so a few dozen
/// take the libm recomputation; the count is printed.
#[test]
fn fast_exp_and_silu_equal_definition_bits() {
    note_unchecked_kernels("fast_exp_and_silu_equal_definition_bits");
    let ts = sampled(0x8000_0000, 0xC2B0_0001, 101);
    let gs = sampled(0, u32::MAX, 257);
    let us = vals(gs.len(), 5);
    let shifted: Vec<f32> = vals(1003, 9).iter().map(|v| v * 40.0).collect();
    let m = shifted.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for kernel in Kernel::all_supported() {
        let mut got = ts.clone();
        fast_exp::exp_shifted_with::<{ fast_exp::DEGREE }>(kernel, &mut got, 0.0);
        assert_eq!(
            first_mismatch(&exp_definition(&ts, 0.0), &got),
            None,
            "exp {kernel:?}"
        );
        let mut got = shifted.clone();
        fast_exp::exp_shifted_with::<{ fast_exp::DEGREE }>(kernel, &mut got, m);
        let want = exp_definition(&shifted, m);
        assert_eq!(first_mismatch(&want, &got), None, "exp - m {kernel:?}");
        for n in [0, 1, 3, 5, 1003] {
            let (g, u) = (&gs[..n], &us[..n]);
            let mut got = vec![0.0f32; n];
            fast_exp::silu_mul_with::<{ fast_exp::DEGREE }>(kernel, g, u, &mut got);
            assert_eq!(
                first_mismatch(&silu_definition(g, u), &got),
                None,
                "silu {n}"
            );
        }
        let mut got = vec![0.0f32; gs.len()];
        fast_exp::silu_mul_with::<{ fast_exp::DEGREE }>(kernel, &gs, &us, &mut got);
        assert_eq!(
            first_mismatch(&silu_definition(&gs, &us), &got),
            None,
            "silu {kernel:?}"
        );
    }
    #[cfg(target_arch = "x86_64")]
    if Kernel::Avx2.supported() {
        let (e, s) = (
            fast_exp::recomputed_exp(&ts),
            fast_exp::recomputed_silu(&gs),
        );
        eprintln!(
            "fast_exp: lanes recomputed with libm: exp {e} of {}, SiLU {s} of {} (out of range or near an f32 midpoint)",
            ts.len(),
            gs.len()
        );
        assert!(
            e > 0 && s > 0,
            "the sample must reach the libm recomputation"
        );
    }
}

/// What the guard rests on: the polynomial's binary64 exp lies within GUARD/8 ulps of libm's on
/// the sampled arguments (the analysis in fast_exp.rs bounds it by 2^7; the largest seen is
/// printed).
#[cfg(target_arch = "x86_64")]
#[test]
fn fast_exp_polynomial_is_far_inside_the_guard() {
    if !Kernel::Avx2.supported() {
        eprintln!("NOT CHECKED: fast_exp_polynomial_is_far_inside_the_guard: no AVX2");
        return;
    }
    let xs: Vec<f64> = sampled(0x8000_0000, 0xC2AE_0000, 101)
        .into_iter()
        .filter(|x| (-87.0..=0.0).contains(x))
        .map(f64::from)
        .collect();
    let poly = fast_exp::exp_f64::<{ fast_exp::DEGREE }>(&xs);
    let worst = xs
        .iter()
        .zip(&poly)
        .map(|(x, p)| (x.exp().to_bits() as i64 - p.to_bits() as i64).abs())
        .max()
        .unwrap();
    eprintln!(
        "fast_exp: largest difference from libm's exp over {} arguments: {worst} ulps",
        xs.len()
    );
    assert!(worst <= fast_exp::GUARD / 8, "{worst} ulps");
}

/// Negative control: a degree-6 polynomial (relative error about 2^-23, beyond what the guard
/// covers) is caught by the comparison above, in exp and in SiLU.
#[test]
fn fast_exp_check_catches_a_short_polynomial() {
    let vector: Vec<Kernel> = Kernel::all_supported()
        .into_iter()
        .filter(|&k| k != Kernel::Portable)
        .collect();
    if vector.is_empty() {
        eprintln!("NOT CHECKED: fast_exp_check_catches_a_short_polynomial: no vector family here");
        return;
    }
    let ts = sampled(0x8000_0000, 0xC2B0_0001, 1009);
    let gs = sampled(0, u32::MAX, 2053);
    let us = vec![1.0f32; gs.len()];
    for kernel in vector {
        let mut got = ts.clone();
        fast_exp::exp_shifted_with::<6>(kernel, &mut got, 0.0);
        assert!(
            first_mismatch(&exp_definition(&ts, 0.0), &got).is_some(),
            "exp {kernel:?}"
        );
        let mut got = vec![0.0f32; gs.len()];
        fast_exp::silu_mul_with::<6>(kernel, &gs, &us, &mut got);
        assert!(
            first_mismatch(&silu_definition(&gs, &us), &got).is_some(),
            "silu {kernel:?}"
        );
    }
}

/// Every softmax argument in [-88, -0] and every f32 SiLU input, on both cores (about two
/// minutes on two): `cargo test --release -p tracegate-engine -- --ignored fast_exp_every`.
#[test]
#[ignore]
fn fast_exp_every_f32_input_equals_definition() {
    use rayon::prelude::*;
    let chunk = 1u64 << 22;
    // Per chunk of inputs, the first one whose bits differ (if any).
    let bad_exp: Vec<u32> = (0x8000_0000u64..=0xC2B0_0000)
        .step_by(chunk as usize)
        .par_bridge()
        .filter_map(|a| {
            let ts: Vec<f32> = (a..(a + chunk).min(0xC2B0_0001))
                .map(|b| f32::from_bits(b as u32))
                .collect();
            let mut got = ts.clone();
            fast_exp::exp_shifted(&mut got, 0.0);
            first_mismatch(&exp_definition(&ts, 0.0), &got).map(|i| ts[i].to_bits())
        })
        .collect();
    let bad_silu: Vec<u32> = (0u64..1 << 32)
        .step_by(chunk as usize)
        .par_bridge()
        .filter_map(|a| {
            let gs: Vec<f32> = (a..a + chunk).map(|b| f32::from_bits(b as u32)).collect();
            let us = vec![1.0f32; gs.len()];
            let mut got = vec![0.0f32; gs.len()];
            fast_exp::silu_mul(&gs, &us, &mut got);
            first_mismatch(&silu_definition(&gs, &us), &got).map(|i| gs[i].to_bits())
        })
        .collect();
    assert!(
        bad_exp.is_empty() && bad_silu.is_empty(),
        "inputs whose bits differ (the first of each chunk): exp {bad_exp:x?}, SiLU {bad_silu:x?}"
    );
}
