"""Llama in the bit-exact reference (docs/numerics.md §7.1, §13): the engine and the contract
compute tiny-llama's variants bit for bit alike and within the oracle policy of transformers' own
LlamaForCausalLM; and the oracle comparison catches the llama defects a port makes — its rope
scaling dropped or misplaced, its MLP bias forgotten — at the point where they enter.

tiny-llama itself (bf16, tied head, llama3 rope) is gated by milestone m0; here its variants:
tiny-llama-bias (attention and MLP biases, no num_key_value_heads, linear rope; made by
scripts/make_fixtures.py at test time) and single-field edits of tiny-llama."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from oracle_runner import run_oracle

pytest.importorskip("torch")
pytest.importorskip("transformers")
from binaries import (  # noqa: E402
    judge,
    planted_contract,
    producer_trace,
    release_binary,
)
from binaries import run_checked as run  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "fixtures" / "tiny-llama"
TOKENS = "1,17,300,5,42,7,99,250,3"
ENGINE, why_engine = release_binary("engine")
_, why_diff = release_binary("trace-diff")
needs_binaries = pytest.mark.skipif(
    bool(why_engine or why_diff), reason=f"{why_engine or why_diff}"
)


def trace(who: str, model: Path, out: Path, cache: str = "on") -> Path:
    return producer_trace(who, model, TOKENS, out, cache=cache)


@pytest.fixture(scope="module")
def llama_bias(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiny-llama-bias")
    run(sys.executable, ROOT / "scripts" / "make_fixtures.py", "tiny-llama-bias", "--out", out)
    return out


@pytest.fixture(scope="module")
def oracle_llama(tmp_path_factory) -> Path:
    return trace("oracle", LLAMA, tmp_path_factory.mktemp("oracle") / "o.trace")


def edited(tmp_path: Path, src: Path, edit) -> Path:
    d = tmp_path / f"{src.name}-edited"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


@needs_binaries
def test_bias_variant_engine_is_the_contract_and_agrees_with_the_oracle(tmp_path, llama_bias):
    cfg = json.loads((llama_bias / "config.json").read_text())
    assert cfg["attention_bias"] and cfg["mlp_bias"] and "num_key_value_heads" not in cfg
    assert cfg["rope_parameters"]["rope_type"] == "linear"
    e = trace("engine", llama_bias, tmp_path / "e.trace", "on")
    c = trace("contract", llama_bias, tmp_path / "c.trace", "off")
    o = trace("oracle", llama_bias, tmp_path / "o.trace")
    same, report = judge(e, c)
    assert same == 0 and report["first_bit_difference"] is None, report["first_bit_difference"]
    code, report = judge(o, e)
    assert code == 0, report["first_violation"]
    assert report["decisions"]["compared"] > 0 and report["tensors"]["compared_elementwise"]


@needs_binaries
@pytest.mark.parametrize(
    "planted,edit,first",
    [
        # A port that ignores rope_parameters' type (the default rope): every rotated q differs.
        (
            "llama3-scaling-dropped",
            lambda c: c.update(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
            "layer.00.q",
        ),
        # Only the blended band and the low frequencies move: a wrong original context length.
        (
            "llama3-original-context-doubled",
            lambda c: c["rope_parameters"].update(original_max_position_embeddings=512),
            "layer.00.q",
        ),
    ],
)
def test_a_rope_scaling_defect_is_caught_where_it_enters(
    tmp_path, oracle_llama, planted, edit, first
):
    e = trace("engine", edited(tmp_path, LLAMA, edit), tmp_path / "e.trace")
    code, report = judge(oracle_llama, e)
    assert code == 1, f"{planted}: the oracle comparison passed a planted defect"
    assert report["first_violation"]["tensor"] == first, report["first_violation"]


@needs_binaries
def test_a_forgotten_mlp_bias_is_caught_at_the_first_mlp_out(tmp_path, llama_bias):
    """A contract planted to load no MLP bias (what a port that skips `mlp_bias` computes),
    against the oracle on the same checkpoint."""
    site = "self.bgu, self.bd = bias if bias is not None else (None, None)"
    env = planted_contract(tmp_path, "feed_forward.py", site, "self.bgu, self.bd = (None, None)")
    out = tmp_path / "c.trace"
    producer_trace("contract", llama_bias, TOKENS, out, cache=None, generate=0, env=env)
    o = trace("oracle", llama_bias, tmp_path / "o.trace")
    code, report = judge(o, out)
    assert code == 1, "the oracle comparison passed a contract without MLP biases"
    assert report["first_violation"]["tensor"] == "layer.00.mlp_out", report["first_violation"]


@needs_binaries
def test_a_chat_text_prompt_through_the_fixtures_own_tokenizer(tmp_path):
    """tiny-llama carries a byte-level BPE tokenizer and a chat template, as real llama
    checkpoints do: the three producers take a chat text prompt, tokenized by it (the ids are
    its own apply_chat_template's), engine ≡ contract bit for bit, the oracle within f32."""
    import tracegate
    from transformers import AutoTokenizer

    question = "What is the capital of France?"
    want = AutoTokenizer.from_pretrained(str(LLAMA)).apply_chat_template(
        [{"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"]
    args = ["trace", "--model", LLAMA, "--text", question, "--chat", "--generate", 4]
    e, c, o = (tmp_path / f"{w}.trace" for w in ("e", "c", "o"))
    run(ENGINE, *args, "--out", e)
    run(sys.executable, "-m", "tracegate_contract", *args, "--out", c)
    r = run_oracle(*args, "--out", o)
    assert r.returncode == 0, r.stderr[-1500:]
    assert tracegate.Trace(str(e)).provenance["prompt_tokens"] == list(want)
    code, report = judge(e, c)
    assert code == 0 and report["first_bit_difference"] is None, report["first_bit_difference"]
    code, report = judge(o, e)
    assert code == 0, report["first_violation"]
