"""Reference values for the engine's GGUF reader (engine/src/gguf/tests.rs runs this).

Writes three small GGUF files with ggml's own writer (gguf.GGUFWriter): a `llama`, a `qwen3` and a
`gemma3` model whose tensors cover every supported type, from random raw blocks (finite random
f16 scales) and from gguf.quants.quantize. Then records, from the reference implementations only:

- every GGUF tensor dequantized by gguf.quants.dequantize (flat, row-major);
- the Hugging Face checkpoint transformers' GGUF loader makes of each file
  (load_gguf_checkpoint: its config dict, and its tensors by name: mapping, llama's q/k
  un-permutation and gemma3's norms minus one included), and the config transformers' config
  class makes of that dict (AutoConfig.for_model(...).to_dict(): `resolved`);
- numpy's widening of all 65536 f16 bit patterns.

Usage: python reference.py OUT_DIR. Writes OUT_DIR/{llama,qwen3,gemma3}.gguf, expected.json and
expected.bin (the f32 values, little-endian; expected.json gives each one's offset and count).
"""

import json
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize, quantize

OUT = Path(sys.argv[1])
rng = np.random.default_rng(20240611)

# Byte offsets of the f16 scales in each quantized block.
SCALE_OFFSETS = {
    T.Q8_0: [0],
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}


def u16_bits(shape):
    return rng.integers(0, 1 << 16, size=shape, dtype=np.uint32).astype(np.uint16)


def finite_f16_bits(n):
    """Random f16 bit patterns, any sign, normal or subnormal, never infinity or NaN."""
    bits = u16_bits(n)
    exponent_all_ones = (bits & 0x7C00) == 0x7C00
    return np.where(exponent_all_ones, bits & 0xBFFF, bits).astype(np.uint16)


def raw_blocks(qtype, rows, cols):
    """Random raw blocks of `qtype` for a [rows, cols] tensor, scales finite f16."""
    block, size = GGML_QUANT_SIZES[qtype]
    n_blocks = rows * cols // block
    data = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint16).astype(np.uint8)
    for at in SCALE_OFFSETS[qtype]:
        data[:, at : at + 2] = finite_f16_bits(n_blocks).view(np.uint8).reshape(n_blocks, 2)
    return data.reshape(rows, cols // block * size)


def tensor(qtype, rows, cols=None, source="raw"):
    """(data, raw_dtype) for GGUFWriter.add_tensor; shape [rows] when cols is None. F32, F16 and
    BF16 "raw" data are random bit patterns, NaNs and infinities included."""
    shape = (rows,) if cols is None else (rows, cols)
    if qtype == T.F32:
        if source == "values":
            return rng.standard_normal(shape).astype(np.float32), None
        bits = rng.integers(0, 1 << 32, size=shape, dtype=np.uint64).astype(np.uint32)
        return bits.view(np.float32), None
    if qtype == T.F16:
        return u16_bits(shape).view(np.float16), None
    if qtype == T.BF16:
        return u16_bits(shape).view(np.uint8).reshape(*shape[:-1], shape[-1] * 2), T.BF16
    if source == "quantize":
        values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        return quantize(values, qtype), qtype
    return raw_blocks(qtype, rows, cols), qtype


def write(path, arch, metadata, tensors):
    w = GGUFWriter(str(path), arch)
    for method, value in metadata:
        getattr(w, method)(value)
    for name, (data, raw_dtype) in tensors.items():
        w.add_tensor(name, data, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


H, V, FF = 256, 64, 512
tokens = [f"t{i}" for i in range(V)]
llama = {
    "token_embd.weight": tensor(T.Q4_K, V, H),
    "blk.0.attn_norm.weight": tensor(T.F32, H, source="values"),
    "blk.0.attn_q.weight": tensor(T.Q6_K, H, H),
    "blk.0.attn_k.weight": tensor(T.Q8_0, 128, H),
    "blk.0.attn_v.weight": tensor(T.Q4_0, 128, H),
    "blk.0.attn_output.weight": tensor(T.Q4_1, H, H),
    "blk.0.ffn_norm.weight": tensor(T.F16, H),
    "blk.0.ffn_gate.weight": tensor(T.BF16, FF, H),
    "blk.0.ffn_up.weight": tensor(T.F16, FF, H),
    "blk.0.ffn_down.weight": tensor(T.Q4_K, H, FF),
    "blk.1.attn_norm.weight": tensor(T.F32, H),
    "blk.1.attn_q.weight": tensor(T.F32, H, H),
    "blk.1.attn_k.weight": tensor(T.BF16, 128, H),
    "blk.1.attn_v.weight": tensor(T.Q8_0, 128, H, source="quantize"),
    "blk.1.attn_output.weight": tensor(T.Q4_0, H, H, source="quantize"),
    "blk.1.ffn_norm.weight": tensor(T.BF16, H),
    "blk.1.ffn_gate.weight": tensor(T.Q4_1, FF, H, source="quantize"),
    "blk.1.ffn_up.weight": tensor(T.Q6_K, FF, H),
    "blk.1.ffn_down.weight": tensor(T.Q8_0, H, FF),
    "output_norm.weight": tensor(T.F32, H, source="values"),
    "output.weight": tensor(T.Q6_K, V, H),
}
write(
    OUT / "llama.gguf",
    "llama",
    [
        ("add_name", "tiny-llama"),
        ("add_context_length", 4096),
        ("add_embedding_length", H),
        ("add_block_count", 2),
        ("add_feed_forward_length", FF),
        ("add_rope_dimension_count", 64),
        ("add_head_count", 4),
        ("add_head_count_kv", 2),
        ("add_layer_norm_rms_eps", 1e-5),
        ("add_rope_freq_base", 500000.0),
        ("add_token_list", tokens),
    ],
    llama,
)
qwen3 = {
    "token_embd.weight": tensor(T.Q8_0, V, H),
    "blk.0.attn_norm.weight": tensor(T.F32, H, source="values"),
    "blk.0.attn_q.weight": tensor(T.Q4_K, H, H),
    "blk.0.attn_q_norm.weight": tensor(T.F32, 128, source="values"),
    "blk.0.attn_k.weight": tensor(T.Q6_K, 128, H),
    "blk.0.attn_k_norm.weight": tensor(T.BF16, 128),
    "blk.0.attn_v.weight": tensor(T.Q4_1, 128, H),
    "blk.0.attn_output.weight": tensor(T.Q4_0, H, H),
    "blk.0.ffn_norm.weight": tensor(T.F16, H),
    "blk.0.ffn_gate.weight": tensor(T.F16, FF, H),
    "blk.0.ffn_up.weight": tensor(T.BF16, FF, H),
    "blk.0.ffn_down.weight": tensor(T.Q6_K, H, FF),
    "output_norm.weight": tensor(T.F32, H, source="values"),
}
write(
    OUT / "qwen3.gguf",
    "qwen3",
    [
        ("add_vocab_size", V),
        ("add_context_length", 40960),
        ("add_embedding_length", H),
        ("add_block_count", 1),
        ("add_feed_forward_length", FF),
        ("add_head_count", 2),
        ("add_head_count_kv", 1),
        ("add_key_length", 128),
        ("add_layer_norm_rms_eps", 1e-6),
        ("add_rope_freq_base", 1000000.0),
        ("add_token_list", tokens),
    ],
    qwen3,
)

# Gemma 3: its four norms a layer (stored plus one by llama.cpp's converter: values near 1, and
# some far from it, where `w - 1` rounds), the five-bit types, 7 layers (one global: the 6th).
HD = 128


def norm(n):
    w = (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)
    w[:4] = [1e-9, -3.5, 1.0 + 2.0**-23, 70000.0]  # 1e-9 - 1 rounds to -1; 70000 - 1 exact
    return w, None


gemma3 = {"token_embd.weight": tensor(T.Q5_0, V, H)}
gemma_types = [T.Q5_0, T.Q5_1, T.Q5_K, T.Q8_0, T.Q4_K, T.Q6_K, T.Q4_0]
for layer in range(7):

    def ty(k, layer=layer):
        return gemma_types[(layer + k) % len(gemma_types)]

    gemma3.update(
        {
            f"blk.{layer}.attn_norm.weight": norm(H),
            f"blk.{layer}.attn_q.weight": tensor(ty(0), 2 * HD, H),
            f"blk.{layer}.attn_q_norm.weight": norm(HD),
            f"blk.{layer}.attn_k.weight": tensor(ty(1), HD, H),
            f"blk.{layer}.attn_k_norm.weight": norm(HD),
            f"blk.{layer}.attn_v.weight": tensor(ty(2), HD, H),
            f"blk.{layer}.attn_output.weight": tensor(ty(3), H, 2 * HD),
            f"blk.{layer}.post_attention_norm.weight": norm(H),
            f"blk.{layer}.ffn_norm.weight": norm(H),
            f"blk.{layer}.ffn_gate.weight": tensor(ty(4), FF, H),
            f"blk.{layer}.ffn_up.weight": tensor(ty(5), FF, H),
            f"blk.{layer}.ffn_down.weight": tensor(ty(6), H, FF),
            f"blk.{layer}.post_ffw_norm.weight": norm(H),
        }
    )
gemma3["blk.0.ffn_up.weight"] = tensor(T.Q5_0, FF, H, source="quantize")
gemma3["blk.1.ffn_up.weight"] = tensor(T.Q5_1, FF, H, source="quantize")
gemma3["output_norm.weight"] = norm(H)
write(
    OUT / "gemma3.gguf",
    "gemma3",
    [
        ("add_name", "tiny-gemma3"),
        ("add_context_length", 32768),
        ("add_embedding_length", H),
        ("add_block_count", 7),
        ("add_feed_forward_length", FF),
        ("add_head_count", 2),
        ("add_layer_norm_rms_eps", 1e-6),
        ("add_key_length", HD),
        ("add_value_length", HD),
        ("add_rope_freq_base", 1000000.0),
        ("add_sliding_window", 512),
        ("add_head_count_kv", 1),
        ("add_token_list", tokens),
    ],
    gemma3,
)

# From here on only the references read the files.
import torch  # noqa: E402
from gguf import GGUFReader  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint  # noqa: E402

blob = bytearray()


def put(values):
    values = np.ascontiguousarray(values, dtype=np.float32)
    entry = {"offset": len(blob), "count": int(values.size)}
    blob.extend(values.tobytes())
    return entry


every_f16 = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
expected = {"f16_all": put(every_f16.astype(np.float32))}
files = []
for name in ["llama.gguf", "qwen3.gguf", "gemma3.gguf"]:
    path = OUT / name
    reader = GGUFReader(str(path))
    dequantized = []
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type)
        dequantized.append({"name": t.name, "type": t.tensor_type.name, **put(values)})
    config = load_gguf_checkpoint(str(path))["config"]
    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config)
    loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)
    hf = []
    for hf_name, values in loaded["tensors"].items():
        hf.append({"name": hf_name, "shape": list(values.shape), **put(values.numpy())})
    resolved = json.loads(hf_config.to_json_string(use_diff=False))
    files.append(
        {
            "path": name,
            "config": config,
            "resolved": resolved,
            "dequantized": dequantized,
            "hf": hf,
        }
    )
expected["files"] = files
(OUT / "expected.bin").write_bytes(bytes(blob))
(OUT / "expected.json").write_text(json.dumps(expected, indent=1))
