"""The Qwen3.5 kernels (docs/numerics.md §§15–18) against hand-worked values of their written
definitions and, on random inputs, against a scalar transcription of the text (one np.float32
scalar operation per ⊗/⊕/⊘; transcendentals through `math`, as §4 says). Comparisons are on
bits. Each check has a negative control: the tempting wrong arithmetic gives other bits."""

import math

import numpy as np
import pytest
from test_ops import same_bits
from tracegate_contract import ops

f32 = np.float32


def scalar_inv(x, eps):
    ss = f32(0.0)
    for v in x:
        ss = f32(ss + f32(v * v))
    return f32(f32(1.0) / f32(np.sqrt(f32(f32(ss / f32(len(x))) + eps))))


def scalar_sigmoid(g):
    g = float(g)
    return f32(1 / (1 + math.exp(-g))) if g >= 0 else f32(math.exp(g) / (1 + math.exp(g)))


# ---- §15.1 zero-centred RMSNorm ----------------------------------------------------------------


def test_zero_centred_rmsnorm_hand_case_and_plain_norm_differs():
    x = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)  # ss 4, mean 1, inv 1 (eps 0)
    w = np.array([0.0, 0.5, -1.0, 1.0], np.float32)
    assert same_bits(ops.rmsnorm_zero_centred(x, w, f32(0.0)), [[1.0, -1.5, 0.0, -2.0]])
    # negative control: §6's plain weight would give w ⊗ x
    assert not same_bits(ops.rmsnorm(x, w, f32(0.0)), [[1.0, -1.5, 0.0, -2.0]])


def test_zero_centred_rmsnorm_random_rows_match_transcription():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 13)).astype(np.float32)
    w = (rng.standard_normal(13) * 0.1).astype(np.float32)
    eps = f32(1e-6)
    got = ops.rmsnorm_zero_centred(x, w, eps)
    for r in range(4):
        inv = scalar_inv(x[r], eps)
        want = [f32(f32(x[r, i] * inv) * f32(f32(1.0) + w[i])) for i in range(13)]
        assert same_bits(got[r], want)
    # negative control: folding 1 + w into the weight after the product, x ⊗ (inv ⊗ (1 ⊕ w)),
    # rounds differently somewhere in these rows
    inv = np.array([scalar_inv(x[r], eps) for r in range(4)], np.float32)[:, None]
    assert not same_bits(got, x * (inv * (f32(1.0) + w)))


# ---- §15.2 gated RMSNorm -----------------------------------------------------------------------


def test_gated_rmsnorm_hand_case():
    x = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    w = np.full(4, 2.0, np.float32)
    z = np.array([0.0, 1.0, -1.0, 2.0], np.float32)
    silu = [f32(f32(v) * scalar_sigmoid(v)) for v in z]
    want = [f32(f32(2.0 * xi) * s) for xi, s in zip(x, silu, strict=True)]  # (w ⊗ x) ⊗ silu(z)
    got = ops.gated_rmsnorm(x, w, z, f32(0.0))
    assert same_bits(got, want) and got[0] == 0.0
    # negative control: a plain sigmoid gate (not SiLU) gives other values
    assert not same_bits(
        got, [f32(f32(2.0 * xi) * scalar_sigmoid(v)) for xi, v in zip(x, z, strict=True)]
    )


# ---- §16 partial RoPE --------------------------------------------------------------------------


def test_partial_rope_inv_freq_uses_the_rotary_dim():
    # d = 6, rotary_dim = 4: inv_freq[1] = 1 / 100^(2/4) = 0.1 (not 100^(-2/6))
    r = ops.Rope(100.0, 6, 4)
    assert same_bits(r.inv_freq, [1.0, f32(0.1)])
    assert not same_bits(ops.Rope(100.0, 6).inv_freq[:2], [1.0, f32(0.1)])  # negative control


def test_partial_rope_rotates_the_first_dims_and_copies_the_rest():
    rope = ops.Rope(10000.0, 6, 2)  # h_r = 1: dims 0 and 1 rotate, 2..5 pass
    x = np.array([[[1.0, 2.0, 3.0, 4.0, 5.0, -0.0]]], np.float32)
    cos, sin = rope.tables([1])
    c, s = f32(math.cos(1.0)), f32(math.sin(1.0))  # angle = 1 ⊗ inv_freq[0] = 1
    got = ops.Rope.apply(x, cos, sin)
    want = [f32(f32(1 * c) - f32(2 * s)), f32(f32(2 * c) + f32(1 * s)), 3, 4, 5, -0.0]
    assert same_bits(got[0, 0], want)  # -0.0 copied as is
    # negative control: full RoPE pairs dim 0 with dim 3
    full = ops.Rope(10000.0, 6)
    assert not same_bits(ops.Rope.apply(x, *full.tables([1]))[0, 0], want)


def test_odd_rotary_dim_rounds_up_as_transformers():
    # §16: d_r = 12 × 0.25 = 3 is odd. transformers takes arange(0, 3, 2) → 2 frequencies with
    # the odd d_r in the exponent's denominator, and its cos/sin are 2·2 = 4 wide, so dims 0..3
    # rotate (0 with 2, 1 with 3) and 4..11 pass.
    rope = ops.Rope(100.0, 12, 3)
    f1 = f32(1.0 / math.pow(100.0, 2 / 3))
    assert same_bits(rope.inv_freq, [1.0, f1])
    x = np.arange(1, 13, dtype=np.float32).reshape(1, 1, 12)
    cos, sin = rope.tables([2])
    a0, a1 = f32(2.0), f32(f32(2.0) * f1)
    c0, s0 = f32(math.cos(float(a0))), f32(math.sin(float(a0)))
    c1, s1 = f32(math.cos(float(a1))), f32(math.sin(float(a1)))
    want = [
        f32(f32(1 * c0) - f32(3 * s0)),
        f32(f32(2 * c1) - f32(4 * s1)),
        f32(f32(3 * c0) + f32(1 * s0)),
        f32(f32(4 * c1) + f32(2 * s1)),
        *range(5, 13),
    ]
    assert same_bits(ops.Rope.apply(x, cos, sin)[0, 0], want)
    # negative controls, the two tempting off-by-ones: the floor (1 frequency, dims 0 and 1
    # rotate, dim 3 passes) and the rounded-up width in the denominator (100^(-2/4) = 0.1)
    floor = ops.Rope(100.0, 12, 2)
    assert not same_bits(ops.Rope.apply(x, *floor.tables([2]))[0, 0], want)
    assert not same_bits(ops.Rope(100.0, 12, 4).inv_freq, [1.0, f1])


# ---- §18.2 causal conv1d -----------------------------------------------------------------------


def test_causal_conv1d_hand_case_state_and_continuation():
    w = np.array([[1.0, 10.0, 100.0]], np.float32)  # tap 2 multiplies the current row
    mixed = np.array([[1.0], [2.0], [3.0]], np.float32)
    out, state = ops.causal_conv1d(mixed, w, np.zeros((1, 2), np.float32))
    acc = [100.0, 210.0, 321.0]  # 0·1 + 0·10 + 1·100, 0·1 + 1·10 + 2·100, 1 + 20 + 300
    assert same_bits(out[:, 0], [f32(a * float(scalar_sigmoid(a))) for a in acc])
    assert same_bits(state, [[2.0, 3.0]])  # the last K−1 pre-conv values, oldest first
    # row by row with the carried state: the same bits (§18.7)
    st, rows = np.zeros((1, 2), np.float32), []
    for t in range(3):
        o, st = ops.causal_conv1d(mixed[t : t + 1], w, st)
        rows.append(o[0])
    assert same_bits(np.array(rows), out) and same_bits(st, state)
    # negative control: taps reversed (tap 0 on the current row) give silu(1) for row 0
    out_rev, _ = ops.causal_conv1d(mixed, w[:, ::-1].copy(), np.zeros((1, 2), np.float32))
    assert not same_bits(out_rev, out)


def test_causal_conv1d_random_matches_transcription():
    rng = np.random.default_rng(5)
    T, C, K = 5, 3, 4
    mixed = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    st0 = rng.standard_normal((C, K - 1)).astype(np.float32)
    out, _ = ops.causal_conv1d(mixed, w, st0)
    for c in range(C):
        win = list(st0[c])
        for t in range(T):
            win.append(mixed[t, c])
            acc = f32(0.0)
            for j in range(K):
                acc = f32(acc + f32(win[-K + j] * w[c, j]))
            assert same_bits(out[t, c], f32(acc * scalar_sigmoid(acc)))


# ---- §18.3 L2 normalisation --------------------------------------------------------------------


def test_l2norm_hand_cases_and_edges():
    x = np.array([3.0, 4.0], np.float32)
    t = f32(f32(25.0) + f32(1e-6))  # the constant is f32(1e-6), whatever the config's eps
    inv = f32(f32(1.0) / f32(np.sqrt(t)))
    assert same_bits(ops.l2norm(x), [f32(3.0 * inv), f32(4.0 * inv)])
    assert same_bits(ops.l2norm(np.zeros(3, np.float32)), np.zeros(3))  # eps keeps 0 finite
    with np.errstate(over="ignore"):  # x ⊗ x overflows to inf, inv = 0
        assert same_bits(ops.l2norm(np.array([1e20, 1.0], np.float32)), [0.0, 0.0])
    # negative control: the mean-square form of RMSNorm (÷ n) is another value
    assert not same_bits(ops.l2norm(x), ops.rmsnorm(x, np.ones(2, np.float32), f32(1e-6)))


# ---- §18.4 softplus and the decay --------------------------------------------------------------


def test_softplus_hand_cases_threshold_and_non_finite():
    u = np.array([0.0, 20.0, 21.0, 800.0, -100.0, -np.inf, np.inf, np.nan], np.float32)
    got = ops.softplus(u)
    assert got[0] == f32(math.log(2.0))
    assert got[1] == f32(math.log1p(math.exp(20.0)))  # 20 is not above the threshold
    assert got[2] == f32(21.0) and got[3] == f32(800.0)  # above it: the input itself
    assert got[4] == f32(math.log1p(math.exp(-100.0))) and got[4] > 0  # a subnormal, kept
    assert got[5] == 0.0 and got[6] == np.inf and np.isnan(got[7])
    # negative control: without the threshold, log1p(exp(800)) overflows binary64
    with pytest.raises(OverflowError):
        math.log1p(math.exp(800.0))


def test_gdn_decay_hand_cases():
    a = np.array([[0.5, 30.0, 0.0]], np.float32)
    dt_bias = np.array([-0.5, -5.0, 0.0], np.float32)
    a_log = np.array([0.0, 0.0, 1000.0], np.float32)  # A = 1, 1, +inf (exp overflows)
    g = ops.gdn_decay(a, dt_bias, a_log)
    ln2 = f32(math.log(2.0))
    assert same_bits(g, [[-ln2, -25.0, -np.inf]])  # u = 0; u = 25 > 20 passes; −inf ⊗ ln 2
    assert same_bits(ops.exp_to_f32(g), [[f32(math.exp(-float(ln2))), f32(math.exp(-25.0)), 0.0]])
    # negative control: decay = exp(A_log) ⊗ softplus, without the minus, is not ≤ 0
    assert (-g[0, :2] > 0).all()


# ---- §18.5 the delta rule ----------------------------------------------------------------------


def step(s, q, k, v, alpha, beta):
    one = lambda a: np.array([a], np.float32)  # noqa: E731
    return ops.delta_rule_step(
        s, one(q), one(k), one(v), np.array([alpha], np.float32), np.array([beta], np.float32)
    )


def test_delta_rule_hand_case_three_rows():
    s = np.zeros((1, 2, 1), np.float32)  # nv 1, dk 2, dv 1
    assert same_bits(step(s, [1, 0], [1, 0], [3], 0.5, 1.0), [[3.0]])  # S = [3, 0]
    assert same_bits(s[0, :, 0], [3.0, 0.0])
    # decay to 1.5, mem 1.5, d = (5 − 1.5)·0.5 = 1.75, S = [3.25, 0], out = 3.25·1 + 0·1
    assert same_bits(step(s, [1, 1], [1, 0], [5], 0.5, 0.5), [[3.25]])
    # key 1: mem 0, d = 2, S = [3.25, 2], out 5.25
    assert same_bits(step(s, [1, 1], [0, 1], [2], 1.0, 1.0), [[5.25]])
    # negative control: reading the output before the write (step 5 before 4) gives 0 on row 0
    s0 = np.zeros((1, 2, 1), np.float32)
    before_write = f32(0.0)
    for i in range(2):
        before_write = f32(before_write + f32(s0[0, i, 0] * [1, 0][i]))
    assert before_write != 3.0


def test_delta_rule_sums_over_the_key_dim_ascending():
    # S column [1, 1e8, −1e8], k = q = 1: ascending (1 ⊕ 1e8) ⊕ −1e8 = 0; descending gives 1.
    s = np.array([[[1.0], [1e8], [-1e8]]], np.float32)
    ones = [1.0, 1.0, 1.0]
    # beta 0: no write, so the output reads the decayed (α = 1) state alone
    assert same_bits(step(s, ones, ones, [0.0], 1.0, 0.0), [[0.0]])
    desc = f32(f32(f32(-1e8) + f32(1e8)) + f32(1.0))
    assert desc == 1.0  # negative control: the other order


def test_delta_rule_random_matches_transcription():
    rng = np.random.default_rng(7)
    nv, dk, dv = 2, 3, 4
    s = rng.standard_normal((nv, dk, dv)).astype(np.float32)
    ref = s.copy()
    q, k = (rng.standard_normal((nv, dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((nv, dv)).astype(np.float32)
    alpha, beta = np.array([0.9, 0.3], np.float32), np.array([0.6, 0.2], np.float32)
    core = ops.delta_rule_step(s, q, k, v, alpha, beta)
    for h in range(nv):
        S = [[f32(ref[h, i, j] * alpha[h]) for j in range(dv)] for i in range(dk)]
        for j in range(dv):
            mem = f32(0.0)
            for i in range(dk):
                mem = f32(mem + f32(S[i][j] * k[h, i]))
            d = f32(f32(v[h, j] - mem) * beta[h])
            for i in range(dk):
                S[i][j] = f32(S[i][j] + f32(k[h, i] * d))
        for j in range(dv):
            out = f32(0.0)
            for i in range(dk):
                out = f32(out + f32(S[i][j] * q[h, i]))
            assert same_bits(core[h, j], out)
        assert same_bits(s[h], np.array(S, np.float32))
