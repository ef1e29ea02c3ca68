"""The three producers on one GGUF file (docs/numerics.md §21): a llama whose tensors use every
supported type — F32, F16, BF16, Q8_0, Q4_0, Q4_1 (quantized by ggml's own gguf.quants), Q4_K and
Q6_K (random blocks with finite scales: gguf-py has no K-quant quantizer) — written with ggml's
GGUFWriter, its q/k rows permuted as llama.cpp's converter does. The engine's trace is the
contract's bit for bit; the oracle (transformers' LlamaForCausalLM on transformers' own
dequantization) agrees under the f32 policy; and a contract planted to skip the q/k
un-permutation — the classic GGUF llama bug — is caught at layer.00.q against the oracle. The same
for a tiny gemma3 (Q5_0, Q5_1, norms stored as w + 1, sliding and global layers), where the planted
contract keeps the stored w + 1."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from oracle_runner import run_oracle

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
from binaries import diff_report, planted_contract, release_binary  # noqa: E402
from gguf_models import Q, tiny_gemma3, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
LAYERS = 2
TOKENS = "1,17,250,5,42,7,99,3"
ENGINE, why_engine = release_binary("engine")
DIFF, why_diff = release_binary("trace-diff")
needs_binaries = pytest.mark.skipif(
    bool(why_engine or why_diff), reason=str(why_engine or why_diff)
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf-llama") / "tiny-llama-mixed.gguf"
    types = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K, Q.F16, Q.BF16, Q.Q4_K]
    return tiny_llama(path, LAYERS, types, Q.Q4_K, name="tiny mixed")


def trace(who: str, model: Path, out: Path, env=None) -> Path:
    args = ["trace", "--model", str(model), "--tokens", TOKENS, "--generate", "3"]
    args += ["--capture", "internals", "--out", str(out)]
    if who == "oracle":
        r = run_oracle(*args, timeout=600, env=env)
    else:
        cmd = (
            [str(ENGINE), *args]
            if who == "engine"
            else [sys.executable, "-m", f"tracegate_{who}", *args]
        )
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"{who}: exit {r.returncode}: {r.stderr[-1500:]}"
    return out


def judge(reference: Path, candidate: Path, policy: str | None = "f32") -> tuple[int, dict]:
    args = [str(DIFF), str(reference), str(candidate), "--json"]
    if policy:
        args += ["--policy", policy]
    r = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, diff_report(r.stdout)


@pytest.fixture(scope="module")
def oracle_trace(model, tmp_path_factory) -> Path:
    return trace("oracle", model, tmp_path_factory.mktemp("o") / "o.trace")


def test_every_type_is_in_the_file(model):
    seen = {t.tensor_type for t in gguf.GGUFReader(str(model)).tensors}
    assert seen == {Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}


@needs_binaries
def test_engine_is_the_contract_and_agrees_with_the_oracle(tmp_path, model, oracle_trace):
    e = trace("engine", model, tmp_path / "e.trace")
    c = trace("contract", model, tmp_path / "c.trace")
    code, report = judge(e, c, policy=None)
    assert code == 0 and report["verdict"] == "identical", report["first_bit_difference"]
    code, report = judge(oracle_trace, e)
    assert code == 0, report["first_violation"]
    # The same file, so the same weights digest on all three (trace-diff checked it).
    assert report["tensors"]["compared_elementwise"] and report["decisions"]["compared"] >= 4


@needs_binaries
def test_a_contract_that_keeps_llama_cpp_row_order_is_caught_at_layer_00_q(
    tmp_path, model, oracle_trace
):
    site = "def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:\n"
    env = planted_contract(tmp_path, "gguf.py", site, site + "    return w\n")
    bad = trace("contract", model, tmp_path / "bad.trace", env=env)
    code, report = judge(oracle_trace, bad)
    assert code == 1, "the oracle comparison passed q/k rows in llama.cpp's order"
    assert report["first_violation"]["tensor"] == "layer.00.q", report["first_violation"]


# --------------------------------------------------------------------------------------------
# gemma3: its four norms stored as w + 1 (numerics.md §21.3), Q5_0 and Q5_1, sliding layers


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    return tiny_gemma3(tmp_path_factory.mktemp("gguf-gemma3") / "tiny-gemma3.gguf")


@needs_binaries
def test_gemma3_engine_is_the_contract_and_agrees_with_the_oracle_and_a_kept_plus_one_is_not(
    tmp_path, gemma3
):
    """engine ≡ contract, both within the f32 policy of transformers' Gemma3ForCausalLM on its
    own loading of the file (7 layers, window 4 < the 8-token prompt, global layer 5). Negative
    control: a contract that keeps llama.cpp's stored w + 1 (skips transformers' minus one) is
    caught in layer 00."""
    types = {t.tensor_type for t in gguf.GGUFReader(str(gemma3)).tensors}
    assert {Q.Q5_0, Q.Q5_1} <= types
    o = tmp_path / "o.trace"
    args = ["trace", "--model", str(gemma3), "--tokens", TOKENS, "--generate", "3"]
    args += ["--capture", "internals", "--out", str(o)]
    r = run_oracle(*args)
    assert r.returncode == 0, r.stderr[-1500:]
    # The file has no gemma3.vocab_size: the oracle counts the tokenizer's tokens, as
    # transformers would, without transformers' warning that it could not.
    assert "vocab_size" not in r.stderr, r.stderr
    e = trace("engine", gemma3, tmp_path / "e.trace")
    c = trace("contract", gemma3, tmp_path / "c.trace")
    code, report = judge(e, c, policy=None)
    assert code == 0 and report["verdict"] == "identical", report["first_bit_difference"]
    code, report = judge(o, e)
    assert code == 0 and report["verdict"] == "within_policy", report["first_violation"]
    assert report["decisions"]["compared"] >= 4
    site = "def stored_plus_one(arch: str, name: str) -> bool:\n"
    env = planted_contract(tmp_path, "gguf.py", site, site + "    return False\n")
    bad = trace("contract", gemma3, tmp_path / "bad.trace", env=env)
    code, report = judge(o, bad)
    assert code == 1, "the oracle comparison passed norms stored as w + 1"
    assert report["first_violation"]["tensor"].startswith("layer.00."), report["first_violation"]
