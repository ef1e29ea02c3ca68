"""A tiny llama GGUF written with ggml's own GGUFWriter, each weight in a chosen type, q/k rows
permuted as llama.cpp's converter does: the model the GGUF tests run (test_gguf_producers.py,
test_quantized_activations.py). F32, F16, BF16, Q8_0, Q4_0 and Q4_1 weights are quantized by
gguf.quants (ggml's reference); Q4_K and Q6_K are random blocks with finite scales (gguf-py has
no K-quant quantizer)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
V = gguf.GGUFValueType
H, HEADS, KV, D, FF, VOCAB = 256, 4, 2, 64, 512, 300


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


def tiny_llama(path: Path, layers: int, types: list, output, name: str | None = None) -> Path:
    """The model at `path`: `layers` layers whose seven matrices take `types` (rotated by one per
    layer, so each type sits on another matrix in the next), an lm head of type `output`."""
    rng = np.random.default_rng(37)
    w = gguf.GGUFWriter(str(path), "llama")
    if name:
        w.add_name(name)
    for key, value in (
        ("block_count", layers),
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

    def norm(n):
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name, array, raw=None):
        w.add_tensor(name, array, raw_dtype=raw)

    add("token_embd.weight", *tensor(rng, Q.Q8_0, VOCAB, H))
    for layer in range(layers):
        p = f"blk.{layer}."
        t = types[layer:] + types[:layer]
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
    add("output.weight", *tensor(rng, output, VOCAB, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_gemma3(path: Path, layers: int = 7, window: int = 4) -> Path:
    """A Gemma 3 as llama.cpp's converter writes one: every norm stored as w + 1 (f32), the
    embedding tied, head size in key_length/value_length, a sliding window (`window`, shorter
    than the tests' prompts, so the sliding layers differ from the global one, layer 5 of 7).
    Matrices in Q5_0 and Q5_1 (quantized by gguf.quants), Q8_0, Q4_0 and Q4_K/Q6_K blocks."""
    rng = np.random.default_rng(41)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_name("tiny gemma3")
    for key, value in (
        ("block_count", layers),
        ("context_length", 256),
        ("embedding_length", H),
        ("feed_forward_length", FF),
        ("attention.head_count", HEADS),
        ("attention.head_count_kv", 1),
        ("attention.key_length", D),
        ("attention.value_length", D),
        ("attention.sliding_window", window),
    ):
        w.add_key_value(f"gemma3.{key}", value, V.UINT32)
    w.add_key_value("gemma3.rope.freq_base", 1000000.0, V.FLOAT32)
    w.add_key_value("gemma3.attention.layer_norm_rms_epsilon", 1e-6, V.FLOAT32)
    w.add_token_list([f"t{i}" for i in range(VOCAB)])

    def norm(n):  # the stored w + 1, with w around 0 as a trained Gemma's
        return (1 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name, array, raw=None):
        w.add_tensor(name, array, raw_dtype=raw)

    types = [Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_0, Q.Q4_0, Q.Q6_K]
    add("token_embd.weight", *tensor(rng, Q.Q5_0, VOCAB, H))
    for layer in range(layers):
        p = f"blk.{layer}."
        t = types[layer % 7 :] + types[: layer % 7]
        w.add_tensor(p + "attn_norm.weight", norm(H))
        add(p + "attn_q.weight", *tensor(rng, t[0], HEADS * D, H))
        w.add_tensor(p + "attn_q_norm.weight", norm(D))
        add(p + "attn_k.weight", *tensor(rng, t[1], D, H))
        w.add_tensor(p + "attn_k_norm.weight", norm(D))
        add(p + "attn_v.weight", *tensor(rng, t[2], D, H))
        add(p + "attn_output.weight", *tensor(rng, t[3], H, HEADS * D))
        w.add_tensor(p + "post_attention_norm.weight", norm(H))
        w.add_tensor(p + "ffn_norm.weight", norm(H))
        add(p + "ffn_gate.weight", *tensor(rng, t[4], FF, H))
        add(p + "ffn_up.weight", *tensor(rng, t[5], FF, H))
        add(p + "ffn_down.weight", *tensor(rng, t[6], H, FF))
        w.add_tensor(p + "post_ffw_norm.weight", norm(H))
    w.add_tensor("output_norm.weight", norm(H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
