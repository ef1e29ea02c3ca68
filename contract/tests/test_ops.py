"""Each ordered kernel against its written definition (docs/numerics.md), on small cases that
can be checked by hand and on random cases checked against a scalar transcription of the text
(one np.float32 scalar operation per ⊗/⊕/⊘). Comparisons are on bits, never tolerances."""

import math
from decimal import Decimal

import numpy as np
import pytest
from tracegate_contract import ops
from tracegate_contract.errors import ContractError
from tracegate_contract.weights import widen

f32 = np.float32


def bits(a):
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def same_bits(a, b):
    a, b = np.asarray(a, dtype=np.float32), np.asarray(b, dtype=np.float32)
    return a.shape == b.shape and np.array_equal(bits(a), bits(b))


# ---- §1 bf16 widening ------------------------------------------------------------------------


def test_bf16_widening_is_exact_including_signed_zero_subnormal_inf_nan():
    raw = np.array(
        [0x3F80, 0xBF80, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x7FC1, 0x4049], dtype=np.uint16
    )
    w = widen("BF16", raw)
    assert w.dtype == np.float32
    assert list(bits(w)) == [int(r) << 16 for r in raw]  # bit-for-bit: NaN payload kept
    assert w[0] == 1.0 and w[1] == -1.0
    assert w[2] == 0 and np.signbit(w[2])
    assert w[6] == 2.0**-133  # smallest bf16 subnormal survives
    assert w[8] == f32(3.140625)


# ---- §2 ordered matmul -----------------------------------------------------------------------


def matmul_by_definition(x, W, b=None):
    rows, K = x.shape
    out = np.zeros((rows, W.shape[0]), dtype=np.float32)
    for r in range(rows):
        for o in range(W.shape[0]):
            acc = f32(0.0)
            for k in range(K):
                acc = f32(acc + f32(x[r, k] * W[o, k]))
            if b is not None:
                acc = f32(acc + b[o])
            out[r, o] = acc
    return out


@pytest.mark.parametrize(
    "rows,K,O,bias",
    [(1, 1, 1, False), (1, 7, 3, True), (3, 1, 5, True), (4, 13, 9, False), (5, 33, 17, True)],
)
def test_matmul_matches_definition_on_tail_shapes(rows, K, O, bias):
    rng = np.random.default_rng(rows * 100 + K)
    x = rng.standard_normal((rows, K)).astype(np.float32) * f32(10)
    W = rng.standard_normal((O, K)).astype(np.float32)
    b = rng.standard_normal(O).astype(np.float32) if bias else None
    got = ops.matmul(x, ops.transpose_weight(W), b)
    assert same_bits(got, matmul_by_definition(x, W, b))


def test_matmul_accumulates_left_to_right_not_pairwise():
    # 2^24 + 1 + 1: left to right each +1 is lost (ties to even); any other grouping gives 2^24+2.
    x = np.array([[2.0**24, 1.0, 1.0]], dtype=np.float32)
    W = np.ones((1, 3), dtype=np.float32)
    assert ops.matmul(x, ops.transpose_weight(W))[0, 0] == f32(2.0**24)
    # the bias is added once, after the loop
    assert ops.matmul(x, ops.transpose_weight(W), np.array([2.0], np.float32))[0, 0] == f32(
        2.0**24 + 2
    )


def test_ordered_sum_is_left_to_right():
    v = np.array([1e8, 1.0, -1e8, 1.0], dtype=np.float32)
    assert ops.ordered_sum(v) == f32(1.0)  # (1e8 ⊕ 1) = 1e8, ⊕ −1e8 = 0, ⊕ 1 = 1
    assert not np.signbit(ops.ordered_sum(np.array([-0.0, -0.0], np.float32)))  # starts at +0.0


# ---- §6 RMSNorm --------------------------------------------------------------------------------


def rmsnorm_by_definition(x, w, eps):
    n = len(x)
    ss = f32(0.0)
    for i in range(n):
        ss = f32(ss + f32(x[i] * x[i]))
    mean = f32(ss / f32(n))
    t = f32(mean + eps)
    s = f32(np.sqrt(t))
    inv = f32(f32(1.0) / s)
    return np.array([f32(w[i] * f32(x[i] * inv)) for i in range(n)], dtype=np.float32)


def test_rmsnorm_hand_case():
    x = np.array([[1.0, -1.0, 1.0, -1.0]], dtype=np.float32)
    y = ops.rmsnorm(x, np.array([1.0, 2.0, 0.5, 1.0], np.float32), f32(0.0))
    assert same_bits(y, [[1.0, -2.0, 0.5, -1.0]])
    # 3,4: ss = 25, mean = 12.5, sqrt = 3.5355339..., inv rounded, then x ⊗ inv
    y = ops.rmsnorm(np.array([[3.0, 4.0]], np.float32), np.ones(2, np.float32), f32(0.0))
    inv = f32(1.0) / np.sqrt(f32(12.5))
    assert same_bits(y, [[f32(3.0) * inv, f32(4.0) * inv]])


def test_rmsnorm_random_rows_match_definition():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 11)).astype(np.float32)
    w = rng.standard_normal(11).astype(np.float32)
    eps = ops.f32_of_config_number(Decimal("1e-6"))
    got = ops.rmsnorm(x, w, eps)
    for idx in np.ndindex(3, 2):
        assert same_bits(got[idx], rmsnorm_by_definition(x[idx], w, eps))


def test_eps_goes_through_binary64_like_transformers():
    # 1 + 2^-24 + 2^-70 lies just above the midpoint between two f32s; parsed to binary64 it
    # becomes the midpoint and ties-to-even takes it down to 1.0. §6 prescribes that path,
    # because it is what JSON readers and transformers (a Python float, then an f32 scalar) do.
    d = Decimal(1) + Decimal(2) ** -24 + Decimal(2) ** -70
    assert ops.f32_of_config_number(d) == f32(1.0)
    assert ops.f32_of_config_number(Decimal("1e-6")) == f32(1e-6)
    assert ops.f32_of_config_number(Decimal("1e-5")) == f32(1e-5)
    with pytest.raises(TypeError):
        ops.f32_of_config_number(True)


# ---- §8.6 softmax --------------------------------------------------------------------------------


def softmax_by_definition(s, visible):
    m = max(s[c] for c in range(len(s)) if visible[c])
    e = [f32(math.exp(float(f32(s[c] - m)))) if visible[c] else None for c in range(len(s))]
    z = f32(0.0)
    for c in range(len(s)):
        if visible[c]:
            z = f32(z + e[c])
    return np.array(
        [f32(e[c] / z) if visible[c] else f32(0.0) for c in range(len(s))], dtype=np.float32
    )


def test_softmax_with_masked_entries_hand_case():
    s = np.array([[2.0, 2.0, 100.0]], dtype=np.float32)
    vis = np.array([[True, True, False]])
    p = ops.softmax(s, vis)
    assert same_bits(p, [[0.5, 0.5, 0.0]])  # masked → +0.0, and its 100 never reaches the max
    assert not np.signbit(p[0, 2])


def test_softmax_random_matches_definition():
    rng = np.random.default_rng(2)
    s = (rng.standard_normal((6, 9)) * 5).astype(np.float32)
    vis = rng.random((6, 9)) < 0.7
    vis[:, 0] = True
    p = ops.softmax(s, vis)
    for r in range(6):
        assert same_bits(p[r], softmax_by_definition(s[r], vis[r]))
    p = ops.softmax(s)
    for r in range(6):
        assert same_bits(p[r], softmax_by_definition(s[r], [True] * 9))


def test_exp_uses_libm_binary64_rounded_once():
    v = np.array(
        [-0.0, -1e-8, -0.5, -3.75, -20.0, -87.3, -104.0, -200.0, -np.inf], dtype=np.float32
    )
    want = np.array([f32(math.exp(float(x))) for x in v], dtype=np.float32)
    assert same_bits(ops.exp_to_f32(v), want)


# ---- §7 RoPE -----------------------------------------------------------------------------------------


def test_rope_table_matches_formula():
    base, d = 1000000.0, 16
    t = ops.Rope(base, d)
    for i in range(d // 2):
        assert t.inv_freq[i] == f32(1.0 / math.pow(base, (2 * i) / d))
    for p in (0, 1, 2, 63, 64, 1000, 4095):
        cos, sin = t.row(p)
        for i in range(d // 2):
            angle = f32(f32(p) * t.inv_freq[i])
            assert cos[i] == f32(math.cos(float(angle))) and sin[i] == f32(math.sin(float(angle)))
    cos, sin = t.row(0)
    assert np.all(cos == 1.0) and np.all(sin == 0.0)
    assert t.inv_freq[0] == 1.0  # pow(base, 0) = 1


def test_rope_apply_matches_definition_and_is_identity_at_zero():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 2, 8)).astype(np.float32)
    t = ops.Rope(10000.0, 8)
    cos, sin = t.tables([0, 5, 17])
    y = ops.Rope.apply(x, cos, sin)
    assert same_bits(y[0], x[0])
    for r in range(3):
        for h in range(2):
            for i in range(4):
                assert y[r, h, i] == f32(
                    f32(x[r, h, i] * cos[r, i]) - f32(x[r, h, i + 4] * sin[r, i])
                )
                assert y[r, h, i + 4] == f32(
                    f32(x[r, h, i + 4] * cos[r, i]) + f32(x[r, h, i] * sin[r, i])
                )


# ---- §9 SiLU --------------------------------------------------------------------------------------------


def test_silu_both_branches_and_edges():
    g = np.array([0.0, -0.0, 2.0, -2.0, 30.0, -30.0, -1000.0, np.nan], dtype=np.float32)
    y = ops.silu(g)
    assert y[0] == 0.0 and not np.signbit(y[0])
    assert y[1] == 0.0 and np.signbit(y[1])  # -0 ⊗ 0.5
    assert y[2] == f32(2.0) * f32(1.0 / (1.0 + math.exp(-2.0)))  # g ≥ 0 branch
    e = math.exp(-2.0)
    assert y[3] == f32(-2.0) * f32(e / (1.0 + e))  # g < 0 branch
    e = math.exp(-30.0)
    assert y[5] == f32(-30.0) * f32(
        e / (1.0 + e)
    )  # the stable branch keeps a tiny, exact-ish value
    assert y[4] == f32(30.0) * f32(1.0 / (1.0 + math.exp(-30.0)))
    assert y[6] == 0.0 and np.signbit(y[6])  # exp underflows to 0: -1000 ⊗ 0 = -0
    assert np.isnan(y[7])


# ---- §10.3, §12 decisions ---------------------------------------------------------------------------


def test_topk_ties_go_to_lowest_index_and_margin():
    p = np.array(
        [[0.25, 0.25, 0.25, 0.25], [0.1, 0.4, 0.4, 0.1], [0.05, 0.15, 0.5, 0.3]], dtype=np.float32
    )
    chosen, margin = ops.topk(p, 2)
    assert chosen.tolist() == [[0, 1], [1, 2], [2, 3]]
    assert chosen.dtype == np.int64
    assert same_bits(margin, [0.0, f32(0.4) - f32(0.1), f32(0.3) - f32(0.15)])


def test_topk_treats_signed_zeros_as_equal():
    p = np.array([[0.0, -0.0, 0.0, 1.0]], dtype=np.float32)
    p[0, 0] = -0.0
    chosen, _ = ops.topk(p, 3)
    assert chosen.tolist() == [[3, 0, 1]]


def test_argmax_margin_ties_and_nan():
    lg = np.array(
        [[1.0, 3.0, 3.0, 2.0], [5.0, 1.0, 2.0, -7.0], [-1.0, -1.0, -2.0, -3.0]], dtype=np.float32
    )
    idx, margin = ops.argmax_margin(lg)
    assert idx.tolist() == [1, 0, 0]
    assert same_bits(margin, [0.0, 3.0, 0.0])
    with pytest.raises(ContractError, match="row 1"):
        ops.argmax_margin(np.array([[1.0, 2.0], [np.nan, 1.0]], dtype=np.float32))


# ---- §8 attention -----------------------------------------------------------------------------------------


def test_attention_matches_definition_with_gqa_and_positions():
    rng = np.random.default_rng(4)
    T, nh, nkv, d = 4, 4, 2, 3
    q = rng.standard_normal((T, nh, d)).astype(np.float32)
    k = rng.standard_normal((T, nkv, d)).astype(np.float32)
    v = rng.standard_normal((T, nkv, d)).astype(np.float32)
    pos = [3, 7, 8, 20]
    scale = f32(1.0 / math.sqrt(3.0))
    o, probs = ops.attention(q, k, v, pos, pos, scale)
    for hq in range(nh):
        hk = hq // 2
        for r in range(T):
            vis = [pos[c] <= pos[r] for c in range(T)]
            s = np.zeros(T, np.float32)
            for c in range(T):
                acc = f32(0.0)
                for j in range(d):
                    acc = f32(acc + f32(q[r, hq, j] * k[c, hk, j]))
                s[c] = f32(acc * scale)
            p = softmax_by_definition(s, vis)
            assert same_bits(probs[hq, r], p)
            for j in range(d):
                acc = f32(0.0)
                for c in range(T):
                    if vis[c]:
                        acc = f32(acc + f32(p[c] * v[c, hk, j]))
                assert o[r, hq, j] == acc or (acc == 0 and o[r, hq, j] == 0)
                assert bits(o[r, hq, j]) == bits(acc)


def test_attention_future_inf_value_does_not_leak():
    q = np.ones((2, 1, 2), np.float32)
    k = np.ones((2, 1, 2), np.float32)
    v = np.array([[[1.0, 2.0]], [[np.inf, np.inf]]], dtype=np.float32)
    o, _ = ops.attention(q, k, v, [0, 1], [0, 1], f32(1.0))
    assert o[0, 0].tolist() == [1.0, 2.0]  # row 0 cannot see row 1's inf (no 0·inf = NaN)
