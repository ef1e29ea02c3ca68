"""The three producers on one GGUF file (docs/numerics.md §21): a llama whose tensors use every
supported type — F32, F16, BF16, Q8_0, Q4_0, Q4_1 (quantized by ggml's own gguf.quants), Q4_K and
Q6_K (random blocks with finite scales: gguf-py has no K-quant quantizer) — written with ggml's
GGUFWriter, its q/k rows permuted as llama.cpp's converter does. The engine's trace is the
contract's bit for bit; the oracle (transformers' LlamaForCausalLM on transformers' own
dequantization) agrees under the f32 policy; and a contract planted to skip the q/k
un-permutation — the classic GGUF llama bug — is caught at layer.00.q against the oracle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
pytest.importorskip("torch")
from binaries import diff_report, planted_contract, release_binary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
H, HEADS, KV, D, FF, VOCAB, LAYERS = 256, 4, 2, 64, 512, 300, 2
TOKENS = "1,17,250,5,42,7,99,3"
ENGINE, why_engine = release_binary("engine")
DIFF, why_diff = release_binary("trace-diff")
needs_binaries = pytest.mark.skipif(
    bool(why_engine or why_diff), reason=str(why_engine or why_diff)
)


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: the rows llama.cpp stores for q and k."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def k_blocks(rng, qtype, rows: int, cols: int) -> np.ndarray:
    """Random K-quant blocks with small positive f16 scales (values of order 0.1)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    b = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for at, scale in {Q.Q4_K: [(0, 2e-3), (2, 2e-3)], Q.Q6_K: [(208, 1e-4)]}[qtype]:
        f = (scale * (0.5 + rng.random(n))).astype(np.float16)
        b[:, at : at + 2] = f.view(np.uint8).reshape(n, 2)
    return b.reshape(rows, cols // block * size)


def tensor(rng, qtype, rows: int, cols: int, permute_heads: int = 0):
    """(array, raw dtype) of a [rows, cols] weight stored as `qtype`."""
    if qtype in (Q.Q4_K, Q.Q6_K):
        return k_blocks(rng, qtype, rows, cols), qtype
    w = (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)
    if permute_heads:
        w = llama_cpp_permute(w, permute_heads)
    if qtype == Q.F32:
        return w, None
    if qtype == Q.F16:
        return w.astype(np.float16), None
    if qtype == Q.BF16:
        return (w.view(np.uint32) >> 16).astype(np.uint16), Q.BF16
    return gguf.quants.quantize(w, qtype), qtype


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    rng = np.random.default_rng(37)
    path = tmp_path_factory.mktemp("gguf-llama") / "tiny-llama-mixed.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny mixed")
    for key, value in (
        ("block_count", LAYERS),
        ("context_length", 256),
        ("embedding_length", H),
        ("feed_forward_length", FF),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", KV),
        ("rope.dimension_count", D),
        ("vocab_size", VOCAB),
    ):
        w.add_key_value(f"llama.{key}", value, V.UINT32)
    w.add_key_value("llama.rope.freq_base", 10000.0, V.FLOAT32)
    w.add_key_value("llama.attention.layer_norm_rms_epsilon", 1e-5, V.FLOAT32)
    norm = lambda n: (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)  # noqa: E731

    def add(name, array, raw=None):
        w.add_tensor(name, array, raw_dtype=raw)

    add("token_embd.weight", *tensor(rng, Q.Q8_0, VOCAB, H))
    types = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K, Q.F16, Q.BF16, Q.Q4_K]
    for layer in range(LAYERS):
        p = f"blk.{layer}."
        t = types[layer:] + types[:layer]  # each type on another matrix in the next layer
        w.add_tensor(p + "attn_norm.weight", norm(H))
        add(p + "attn_q.weight", *tensor(rng, t[0], HEADS * D, H, HEADS))
        add(p + "attn_k.weight", *tensor(rng, t[1], KV * D, H, KV))
        add(p + "attn_v.weight", *tensor(rng, t[2], KV * D, H))
        add(p + "attn_output.weight", *tensor(rng, t[3], H, HEADS * D))
        w.add_tensor(p + "ffn_norm.weight", norm(H))
        add(p + "ffn_gate.weight", *tensor(rng, t[4], FF, H))
        add(p + "ffn_up.weight", *tensor(rng, t[5], FF, H))
        add(p + "ffn_down.weight", *tensor(rng, t[6], H, FF))
    w.add_tensor("output_norm.weight", norm(H))
    add("output.weight", *tensor(rng, Q.Q4_K, VOCAB, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def trace(who: str, model: Path, out: Path, env=None) -> Path:
    args = ["trace", "--model", str(model), "--tokens", TOKENS, "--generate", "3"]
    args += ["--capture", "internals", "--out", str(out)]
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
