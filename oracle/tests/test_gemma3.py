"""Gemma 3 text in the bit-exact reference (docs/numerics.md §22): the engine and the contract
compute tiny-gemma3 bit for bit alike and within the oracle policy of transformers' own
Gemma3ForCausalLM; and the oracle comparison catches the Gemma 3 defects a port makes most
easily, each at the point where it enters, with the unplanted contract passing the same
comparison first (the negative control).

tiny-gemma3 itself is gated by milestone m0 (frozen prompts, decode included); here one prompt
longer than its sliding window (6), under internals capture, and the planted defects."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

for module in ("torch", "transformers"):
    pytest.importorskip(module)
from binaries import judge, needs_built, planted_contract, producer_trace  # noqa: E402

GEMMA3 = Path(__file__).resolve().parents[2] / "fixtures" / "tiny-gemma3"
# 13 tokens, over twice the fixture's sliding_window (6): the window bites in layers 0, 1, 3.
TOKENS = "2,105,17,488,5,42,42,7,310,99,3,250,64"
needs_binaries = needs_built("engine", "trace-diff")


def trace(who: str, out: Path, cache="on", env=None) -> Path:
    """`who`'s trace of TOKENS under internals capture, 4 tokens generated."""
    return producer_trace(who, GEMMA3, TOKENS, out, cache=cache, env=env)


@pytest.fixture(scope="module")
def oracle_trace(tmp_path_factory) -> Path:
    return trace("oracle", tmp_path_factory.mktemp("oracle") / "o.trace")


def test_the_fixture_is_what_transformers_loads_as_gemma3():
    """transformers' own class claims every tensor of tiny-gemma3 and misses none, and reads its
    config as the producers do: sliding and full layers, the window shorter than the prompt,
    two rope bases, query_pre_attn_scalar unlike head_dim, a tied head."""
    from transformers import Gemma3ForCausalLM

    cfg = json.loads((GEMMA3 / "config.json").read_text())
    assert cfg["sliding_window"] < len(TOKENS.split(","))
    assert cfg["query_pre_attn_scalar"] != cfg["head_dim"]
    model, info = Gemma3ForCausalLM.from_pretrained(str(GEMMA3), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    assert model.config.layer_types == cfg["layer_types"]
    assert model.config.rope_parameters == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.layers[0].self_attn.sliding_window == cfg["sliding_window"]
    assert model.model.layers[2].self_attn.sliding_window is None


@needs_binaries
@pytest.mark.parametrize("cache", ["on", "off"])
def test_engine_is_the_contract_and_agrees_with_the_oracle(tmp_path, oracle_trace, cache):
    e = trace("engine", tmp_path / "e.trace", cache=cache)
    c = trace("contract", tmp_path / "c.trace", cache="off" if cache == "on" else "on")
    same, report = judge(e, c, policy=None)
    assert same == 0 and report["first_bit_difference"] is None, report["first_bit_difference"]
    code, report = judge(oracle_trace, e)
    assert code == 0, report["first_violation"]
    assert report["decisions"]["compared"] > 0 and report["tensors"]["compared_elementwise"]


# The planted defects, each in the computation (the tensors are still loaded, so nothing is
# refused): (file, the line as written, the line planted, the first tensor the oracle comparison
# must name).
PLANTS = {
    # The sliding layers rotated by the full layers' base (one rope table for every layer):
    # position 0 is unrotated either way, the rows after it are not.
    "one-rope-theta": (
        "model.py",
        "ops.Rope(cfg.local_rope_theta, cfg.head_dim) if cfg.gemma3 else None",
        "ops.Rope(cfg.rope_theta, cfg.head_dim) if cfg.gemma3 else None",
        "layer.00.q",
    ),
    # Gemma3RMSNorm's (1 + w) read as llama's plain w: the norms nearly zero their input. The
    # first captured norm output is q's (q_norm).
    "norm-without-one-plus-w": (
        "config.py",
        "return self.hybrid or self.gemma3",
        "return self.hybrid",
        "layer.00.q",
    ),
    # No window: every layer causal over every earlier key. Rows past the window see more keys.
    "no-sliding-window": (
        "mixers.py",
        "w = model.cfg.window(i)",
        "w = None",
        "layer.00.attn_probs",
    ),
    # Scores scaled by head_dim^-0.5 instead of query_pre_attn_scalar^-0.5.
    "scale-by-head-dim": (
        "config.py",
        "if self.gemma3:\n            return np.float32(math.pow(self.query_pre_attn_scalar, -0.5))",
        "if False:\n            pass",
        "layer.00.attn_probs",
    ),
}


@needs_binaries
@pytest.mark.parametrize("plant", list(PLANTS))
def test_a_planted_gemma3_defect_is_caught_where_it_enters(tmp_path, oracle_trace, plant):
    file, old, new, first = PLANTS[plant]
    # Negative control: the same comparison passes the unplanted contract.
    clean = trace("contract", tmp_path / "clean.trace")
    code, report = judge(oracle_trace, clean)
    assert code == 0, f"the clean contract must pass first: {report['first_violation']}"
    env = planted_contract(tmp_path, file, old, new)
    bad = trace("contract", tmp_path / "bad.trace", env=env)
    code, report = judge(oracle_trace, bad)
    assert code == 1, f"the oracle comparison passed a contract with {plant}"
    assert report["first_violation"]["tensor"] == first, report["first_violation"]
