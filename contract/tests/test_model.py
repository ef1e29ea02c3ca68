"""Whole-model properties: capture order and names, cached == uncached generation bit for bit,
a layer run alone on its recorded input reproduces the whole run's layer bit for bit, and the
MoE capture conventions. Runs on a random checkpoint written here and on the committed
fixtures (when present)."""

import os

import numpy as np
import pytest
from tracegate_contract import Capture, ContractError, Model

from conftest import FIXTURES


def model_dirs(dense_dir, moe_dir):
    out = [dense_dir, moe_dir]
    out += [d for d in FIXTURES.values() if os.path.exists(os.path.join(d, "config.json"))]
    return out


@pytest.fixture
def dirs(dense_dir, moe_dir):
    return model_dirs(dense_dir, moe_dir)


def prompt(model, n, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.integers(0, model.cfg.vocab_size, n).tolist()
    if n >= 4:
        t[3] = t[1]  # a repeated token
    return t


def bitwise_equal(a, b):
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_capture_order_and_names(moe_dir):
    m = Model(moe_dir)
    cap = Capture(internals=True)
    m.run(prompt(m, 6), cap)
    names = [n for n, _, _ in cap.tensors]
    assert names[0] == "embed.out" and names[-2:] == ["final_norm.out", "logits"]
    l0 = [n for n in names if n.startswith("layer.00.")]
    experts = [n for n in l0 if ".expert." in n]
    assert l0 == [
        "layer.00.hidden_in",
        "layer.00.q",
        "layer.00.k",
        "layer.00.v",
        "layer.00.attn_probs",
        "layer.00.attn_out",
        "layer.00.router.logits",
        *experts,
        "layer.00.mlp_out",
        "layer.00.hidden_out",
    ]
    assert experts == sorted(experts) and experts
    assert not any(
        ".router" in n for n in names if n.startswith("layer.01.")
    )  # mlp_only_layers [1]
    assert [d for d, _, _ in cap.decisions] == [
        "layer.00.router.topk",
        "layer.02.router.topk",
        "logits.argmax",
    ]
    shapes = {n: a.shape for n, a, _ in cap.tensors}
    assert shapes["layer.00.q"] == (6, 4, 6) and shapes["layer.00.k"] == (6, 2, 6)
    assert shapes["layer.00.attn_probs"] == (4, 6, 6) and shapes["layer.00.router.logits"] == (6, 5)
    assert all(a.dtype == np.float32 for _, a, _ in cap.tensors)
    default = Capture()
    m.run(prompt(m, 6), default)
    want = ["embed.out"]
    for i in range(3):
        want += [f"layer.{i:02d}.{p}" for p in ("hidden_in", "attn_out", "mlp_out", "hidden_out")]
    assert [n for n, _, _ in default.tensors] == want + ["final_norm.out", "logits"]


def test_expert_rows_and_positions(moe_dir):
    m = Model(moe_dir)
    cap = Capture(internals=True)
    m.run(prompt(m, 9, seed=3), cap)
    topk = dict((n, v) for n, v, _ in cap.decisions)["layer.00.router.topk"]
    total = 0
    for name, a, pos in cap.tensors:
        if name.startswith("layer.00.expert."):
            e = int(name.split(".")[3])
            want = [r for r in range(9) if e in topk[r]]
            assert pos == want and a.shape == (len(want), m.cfg.hidden_size)
            total += len(want)
    assert total == 9 * m.cfg.num_experts_per_tok


def test_attention_probs_masked_entries_are_positive_zero(dense_dir):
    m = Model(dense_dir)
    cap = Capture(internals=True)
    m.run(prompt(m, 5), cap)
    p = dict((n, a) for n, a, _ in cap.tensors)["layer.00.attn_probs"]
    upper = np.triu(np.ones((5, 5), bool), 1)
    assert np.all(p[:, upper] == 0) and not np.signbit(p[:, upper]).any()


@pytest.mark.parametrize("n", [1, 5, 17])
def test_cached_equals_uncached_generation(dirs, n):
    for d in dirs:
        m = Model(d)
        toks = prompt(m, n, seed=n)
        a, b = Capture(), Capture()
        ga = m.run(toks, a, generate=6, cached=True)
        gb = m.run(toks, b, generate=6, cached=False)
        assert ga == gb, d
        assert_same_captures(a, b, d)


def assert_same_captures(a: Capture, b: Capture, where) -> None:
    """Names (hence lengths) first: zip alone stops at the shorter list and hides what is missing."""
    assert [n for n, _, _ in a.decisions] == [n for n, _, _ in b.decisions], where
    assert [n for n, _, _ in a.tensors] == [n for n, _, _ in b.tensors], where
    for (na, va, ma), (_, vb, mb) in zip(a.decisions, b.decisions, strict=False):
        assert np.array_equal(va, vb) and bitwise_equal(ma, mb), (where, na)
    for (na, xa, pa), (_, xb, pb) in zip(a.tensors, b.tensors, strict=False):
        assert pa == pb and bitwise_equal(xa, xb), (where, na)


def test_capture_comparison_sees_a_missing_tail():
    """The comparison above must fail when one run recorded less (it once zipped and passed)."""
    a, b = Capture(), Capture()
    for c in (a, b):
        c.tensor("x", np.zeros(2, np.float32), [0, 1])
    a.decision("d", np.array([1]), np.array([0.5], np.float32))
    with pytest.raises(AssertionError):
        assert_same_captures(a, b, "planted")
    b.decision("d", np.array([1]), np.array([0.5], np.float32))
    assert_same_captures(a, b, "equal")
    a.tensor("y", np.zeros(2, np.float32), [0, 1])
    with pytest.raises(AssertionError):
        assert_same_captures(a, b, "planted")


def test_cached_decode_row_equals_uncached_row(dense_dir):
    """Stronger than equal decisions: the cached step's logits row is the uncached row's bits."""
    from tracegate_contract.model import KVCache

    m = Model(dense_dir)
    toks = prompt(m, 7)
    full = m.forward(toks + [4, 9], range(9))
    cache = KVCache(m.cfg.num_hidden_layers)
    m.forward(toks, range(7), cache=cache)
    r7 = m.forward([4], [7], cache=cache)
    r8 = m.forward([9], [8], cache=cache)
    assert bitwise_equal(r7[0], full[7]) and bitwise_equal(r8[0], full[8])


def test_layer_alone_reproduces_whole_run(dirs):
    for d in dirs:
        m = Model(d)
        whole = Capture(internals=True)
        m.run(prompt(m, 11, seed=7), whole)
        got = dict((n, (a, p)) for n, a, p in whole.tensors)
        for i in range(m.cfg.num_hidden_layers):
            x, pos = got[f"layer.{i:02d}.hidden_in"]
            alone = Capture(internals=True)
            out = m.layer(i, x.copy(), pos, alone)
            assert bitwise_equal(out, got[f"layer.{i:02d}.hidden_out"][0])
            for name, a, p in alone.tensors:
                assert bitwise_equal(a, got[name][0]) and p == got[name][1], (d, name)
            want = [n for n, _, _ in whole.decisions if n.startswith(f"layer.{i:02d}.")]
            assert [n for n, _, _ in alone.decisions] == want


def test_layer_on_a_suffix_of_rows_sees_only_those_rows(dense_dir):
    """Positions come from the caller; causal by positions: rows 3..5 alone attend only among
    themselves, so row 3 (the first) must equal a one-row run at position 3."""
    m = Model(dense_dir)
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32)
    y = m.layer(1, x, [3, 4, 5])
    y1 = m.layer(1, x[:1], [3])
    assert bitwise_equal(y[0], y1[0])


def test_token_out_of_range(dense_dir):
    m = Model(dense_dir)
    with pytest.raises(ContractError, match=r"token id 37 is outside the vocabulary \[0, 37\)"):
        m.run([1, 37], Capture())
