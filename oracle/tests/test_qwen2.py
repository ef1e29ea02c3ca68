"""Qwen2 in the bit-exact reference (docs/numerics.md §8, §13 "Qwen2"): the engine and the contract
compute tiny-qwen2 bit for bit alike and within the oracle policy of transformers' own
Qwen2ForCausalLM; and the oracle comparison catches the qwen2 defect a port makes most easily —
the q/k/v bias that llama and Qwen3 configs switch off and qwen2 always has, forgotten — at the
point where it enters.

tiny-qwen2 itself is gated by milestone m0 (frozen prompts, decode included); here a prompt
longer than its (disabled) sliding window of 8, under internals capture, and the planted bias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
from binaries import judge, planted_contract, producer_trace, release_binary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
QWEN2 = ROOT / "fixtures" / "tiny-qwen2"
# 12 tokens, more than the fixture's sliding_window (8), which use_sliding_window = false turns off.
TOKENS = "1,17,300,5,42,7,99,250,3,11,480,64"
_, why_engine = release_binary("engine")
_, why_diff = release_binary("trace-diff")
needs_binaries = pytest.mark.skipif(
    bool(why_engine or why_diff), reason=f"{why_engine or why_diff}"
)


def trace(who: str, out: Path, capture="internals", cache="on", env=None) -> Path:
    return producer_trace(who, QWEN2, TOKENS, out, capture=capture, cache=cache, env=env)


@pytest.fixture(scope="module")
def oracle_traces(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("oracle")
    return {c: trace("oracle", d / f"o-{c}.trace", c) for c in ("internals", "default")}


def test_the_fixture_is_what_transformers_loads_as_qwen2():
    """transformers' own class claims every tensor of tiny-qwen2 and misses none: q/k/v biases,
    no o_proj bias, no q/k norm, tied head; and the config is the real checkpoints' (no
    attention_bias field, legacy top-level rope_theta, sliding window present but off)."""
    from transformers import Qwen2ForCausalLM

    cfg = json.loads((QWEN2 / "config.json").read_text())
    assert "attention_bias" not in cfg and "head_dim" not in cfg and "rope_parameters" not in cfg
    assert cfg["use_sliding_window"] is False and cfg["sliding_window"] < len(TOKENS.split(","))
    model, info = Qwen2ForCausalLM.from_pretrained(str(QWEN2), output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None
    assert attn.v_proj.bias is not None and attn.o_proj.bias is None
    assert attn.sliding_window is None and not hasattr(attn, "q_norm")
    assert model.config.rope_parameters == {"rope_type": "default", "rope_theta": 1000000.0}


@needs_binaries
@pytest.mark.parametrize("capture", ["internals", "default"])
def test_engine_is_the_contract_and_agrees_with_the_oracle(tmp_path, oracle_traces, capture):
    e = trace("engine", tmp_path / "e.trace", capture, "on")
    c = trace("contract", tmp_path / "c.trace", capture, "off")
    same, report = judge(e, c, policy=None)
    assert same == 0 and report["first_bit_difference"] is None, report["first_bit_difference"]
    code, report = judge(oracle_traces[capture], e)
    assert code == 0, report["first_violation"]
    assert report["decisions"]["compared"] > 0 and report["tensors"]["compared_elementwise"]


# The planted defect: a contract whose attention matmul adds no q/k/v bias (what a port computes
# that follows llama's or Qwen3's `attention_bias`, absent in qwen2's config, to "no bias"; the
# tensors are still loaded, so nothing is refused). First seen where the bias enters: layer 0's q
# under internals capture, layer 0's attn_out under the default capture (which has no q).
BIAS_SITE = "qkv = ops.matmul(xn, A.wqkv_t, A.bqkv)"
NO_BIAS = "qkv = ops.matmul(xn, A.wqkv_t, None)"


@needs_binaries
@pytest.mark.parametrize(
    "capture,first", [("internals", "layer.00.q"), ("default", "layer.00.attn_out")]
)
def test_a_forgotten_qkv_bias_is_caught_where_it_enters(tmp_path, oracle_traces, capture, first):
    oracle = oracle_traces[capture]
    # Negative control: the same comparison passes the unplanted contract.
    clean = trace("contract", tmp_path / "clean.trace", capture)
    code, report = judge(oracle, clean)
    assert code == 0, f"the clean contract must pass first: {report['first_violation']}"
    env = planted_contract(tmp_path, "mixers.py", BIAS_SITE, NO_BIAS)
    bad = trace("contract", tmp_path / "bad.trace", capture, env=env)
    code, report = judge(oracle, bad)
    assert code == 1, "the oracle comparison passed a contract without the q/k/v bias"
    assert report["first_violation"]["tensor"] == first, report["first_violation"]
