"""The GGUF weight source (tracegate_contract/gguf.py) against ggml's own Python package `gguf`
(the writer makes every file here, its reader and quants.py are the reference) and against
transformers' GGUF loader: the container parsed as GGUFReader parses it, every supported type
dequantized bit for bit as gguf.quants.dequantize, malformed files refused by what is wrong,
llama's q/k rows un-permuted as transformers does, and the tiny Qwen3 fixture round-tripped
through a GGUF file into the same tensors, the same config and the same forward pass."""

from __future__ import annotations

import json
import os
import struct

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V
from tracegate_contract import Capture, ContractError, run
from tracegate_contract import gguf as contract_gguf
from tracegate_contract.config import gguf_config
from tracegate_contract.weights import Checkpoint, SafetensorsFile

from conftest import FIXTURES, write_safetensors

QK_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")
# The byte offsets of each quantized type's f16 scales.
SCALES = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
}


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def write_gguf(path, arch, kv=(), tensors=(), alignment=None) -> str:
    """kv: (key, value, GGUFValueType[, sub_type]); tensors: (name, array, raw_dtype or None) —
    a raw dtype with a uint8 array: its bytes are blocks, the shape follows from them."""
    w = gguf.GGUFWriter(str(path), arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, value, vtype, *sub in kv:
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    for name, array, raw in tensors:
        w.add_tensor(name, array, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def random_blocks(rng, qtype: str, n_blocks: int) -> np.ndarray:
    """Random block bytes with every f16 scale finite (random sign and size, subnormals too)."""
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    b = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        f = (rng.standard_normal(n_blocks) * rng.choice([1e-6, 1e-2, 1.0, 100.0], n_blocks)).astype(
            np.float16
        )
        f[rng.random(n_blocks) < 0.05] = 0.0
        b[:, at : at + 2] = f.view(np.uint8).reshape(n_blocks, 2)
    return b


def tensor_of(rng, qtype: str, rows: int, cols: int):
    """(array, raw_dtype) for the writer: random floats, bit patterns or blocks of `qtype`."""
    if qtype == "F32":
        return rng.standard_normal((rows, cols)).astype(np.float32), None
    if qtype == "F16":  # every bit pattern, infinities and NaNs included
        return rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16).view(np.float16), None
    if qtype == "BF16":
        return rng.integers(0, 1 << 16, (rows, cols), dtype=np.uint16), Q.BF16
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    b = random_blocks(rng, qtype, rows * cols // block)
    return b.reshape(rows, cols // block * size), Q[qtype]


# --------------------------------------------------------------------------------------------
# Dequantization, bit for bit


@pytest.mark.parametrize("qtype", QK_TYPES)
def test_dequantization_matches_ggml_bit_for_bit(tmp_path, qtype):
    """Odd block counts (3, 5, 7 and 13 blocks per row) of random blocks, and for the legacy
    quants also gguf.quants.quantize's blocks of random floats: the same bits as
    gguf.quants.dequantize of the same bytes, read through both packages' parsers."""
    rng = np.random.default_rng(sum(map(ord, qtype)))
    block = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
    tensors = []
    for i, (rows, k) in enumerate(((3, 3), (1, 5), (2, 7), (5, 13))):
        a, raw = tensor_of(rng, qtype, rows, k * block)
        tensors.append((f"t{i}", a, raw))
    if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        x = (rng.standard_normal((7, 9 * 32)) * 3).astype(np.float32)
        x[0, :32] = 0.0  # an all-zero block: d = 0
        tensors.append(("quantized", gguf.quants.quantize(x, Q[qtype]), Q[qtype]))
    path = write_gguf(tmp_path / "q.gguf", "qwen3", tensors=tensors)
    ref = {t.name: t for t in gguf.GGUFReader(path).tensors}
    mine = contract_gguf.GgufFile(path)
    for name, t in ref.items():
        want = gguf.quants.dequantize(t.data, t.tensor_type)
        info = mine.tensors[name]
        assert info.type_name == qtype
        got = mine.dequantize(name)
        assert got.dtype == np.float32 and got.shape == want.shape == info.shape
        assert np.array_equal(bits(got), bits(want)), f"{qtype} {name}: bits differ"
        # the module-level function on the bare bytes, by type name
        flat = contract_gguf.dequantize(mine.raw(name), qtype, info.n_elements)
        assert np.array_equal(bits(flat), bits(want).reshape(-1))


def test_f32_tensors_are_views_of_the_file_mapping(tmp_path):
    a = np.arange(64, dtype=np.float32).reshape(2, 32)
    path = write_gguf(tmp_path / "v.gguf", "qwen3", tensors=[("x", a, None)])
    got = contract_gguf.GgufFile(path).dequantize("x")
    assert np.array_equal(got, a) and not got.flags.owndata and not got.flags.writeable
    base = got
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def _f16(x: float) -> list[int]:
    return list(np.array([x], np.float16).view(np.uint8))


def _q5_bits(q: list[int]) -> list[int]:
    """32 five-bit quants as Q5_0/Q5_1 store them: the u32 of fifth bits, then 16 bytes whose
    low nibbles are quants 0..15 and high nibbles 16..31."""
    qh = sum(((v >> 4) & 1) << i for i, v in enumerate(q))
    return list(struct.pack("<I", qh)) + [(q[j] & 15) | ((q[j + 16] & 15) << 4) for j in range(16)]


def test_five_bit_blocks_by_hand_and_as_ggml():
    """Q5_0, Q5_1 and Q5_K blocks built here, each value worked out by hand, and the same bytes
    through gguf.quants.dequantize: equal bits, negative-zero and extreme scales included."""
    q = [(7 * i + 3) % 32 for i in range(32)]  # every fifth bit used, both halves
    # Q5_0, d = 0.5: y = 0.5 * (q - 16)
    y = contract_gguf.dequantize(np.array(_f16(0.5) + _q5_bits(q), np.uint8), "Q5_0", 32)
    assert y.tolist() == [0.5 * (v - 16) for v in q]
    # d = -0.0: q - 16 < 0 gives +0.0, q - 16 >= 0 gives -0.0 (the sign of the product).
    y = contract_gguf.dequantize(np.array(_f16(-0.0) + _q5_bits(q), np.uint8), "Q5_0", 32)
    assert [np.signbit(v) for v in y] == [v >= 16 for v in q] and not y.any()
    # d = 65504 (f16's largest): 65504 * -16 and 65504 * 15, exact.
    y = contract_gguf.dequantize(np.array(_f16(65504.0) + _q5_bits(q), np.uint8), "Q5_0", 32)
    assert y.tolist() == [65504.0 * (v - 16) for v in q]
    # Q5_1, d = 1024, m = 2^-11: 1024 q + 2^-11 is exact below 8192 and rounds to even above
    # (the ulp of 8192..16384 is 2^-10: a tie, the even 1024 q).
    y = contract_gguf.dequantize(
        np.array(_f16(1024.0) + _f16(2.0**-11) + _q5_bits(q), np.uint8), "Q5_1", 32
    )
    assert y.tolist() == [1024.0 * v + (2.0**-11 if v < 8 else 0.0) for v in q]
    # m = -0.0 with d * q = +0.0: +0.0 + -0.0 is +0.0.
    y = contract_gguf.dequantize(
        np.array(_f16(1.0) + _f16(-0.0) + _q5_bits([0] * 32), np.uint8), "Q5_1", 32
    )
    assert not np.signbit(y).any() and not y.any()
    # Q5_K: scales as Q4_K (sc = 1..8, mn = 0..7, all < 16: bytes 0..8 direct, 8..12 zero
    # nibbles above), d = 1, dmin = 0.25; qh byte l = l (bit j of l is sub-block j's fifth
    # bit); nibble byte k: low k mod 16, high 15 - k mod 16.
    sc, mn = list(range(1, 9)), list(range(8))
    scales = sc[:4] + mn[:4] + [sc[4 + j] | (mn[4 + j] << 4) for j in range(4)]
    qh = list(range(32))
    qs = [(k % 16) | ((15 - k % 16) << 4) for k in range(128)]
    block = np.array(_f16(1.0) + _f16(0.25) + scales + qh + qs, np.uint8)
    y = contract_gguf.dequantize(block, "Q5_K", 256)
    want = []
    for j in range(8):
        for l in range(32):
            low = l % 16 if j % 2 == 0 else 15 - l % 16
            want.append(sc[j] * (low | ((l >> j) & 1) << 4) - 0.25 * mn[j])
    assert y.tolist() == want
    # Against ggml, these blocks and their negative-zero / largest-scale variants.
    for qtype, blk in (
        ("Q5_0", _f16(-0.0) + _q5_bits(q)),
        ("Q5_0", _f16(-65504.0) + _q5_bits(q)),
        ("Q5_1", _f16(-0.0) + _f16(-0.0) + _q5_bits(q)),
        ("Q5_1", _f16(65504.0) + _f16(-65504.0) + _q5_bits(q)),
        ("Q5_1", _f16(6e-8) + _f16(1.0) + _q5_bits(q)),  # a subnormal d
        ("Q5_K", list(block)),
        ("Q5_K", _f16(-0.0) + _f16(65504.0) + list(block[4:])),
        ("Q5_K", _f16(65504.0) + _f16(-0.0) + list(block[4:])),
    ):
        raw = np.array(blk, np.uint8)
        n = gguf.GGML_QUANT_SIZES[Q[qtype]][0]
        got = contract_gguf.dequantize(raw, qtype, n)
        want = gguf.quants.dequantize(raw, Q[qtype]).reshape(-1)
        assert np.array_equal(bits(got), bits(want)), qtype


def test_unsupported_types_are_refused_by_name(tmp_path):
    rng = np.random.default_rng(5)
    b = rng.integers(0, 256, (2, 84), dtype=np.uint8)  # two Q2_K blocks
    path = write_gguf(
        tmp_path / "m.gguf",
        "qwen3",
        tensors=[("blk.0.ffn_up.weight", b, Q.Q2_K)],
    )
    g = contract_gguf.GgufFile(path)  # a valid file: parsed, its tensor sized
    assert g.tensors["blk.0.ffn_up.weight"].type_name == "Q2_K"
    with pytest.raises(
        ContractError, match=r"tensor blk\.0\.ffn_up\.weight: type Q2_K is not supported"
    ):
        g.dequantize("blk.0.ffn_up.weight")
    with pytest.raises(ContractError, match=r"m\.gguf: tensor blk\.0\.ffn_up\.weight: type Q2_K"):
        contract_gguf.GgufWeights(path)
    with pytest.raises(ContractError, match=r"type I32 is not supported"):
        contract_gguf.dequantize(np.zeros(8, np.uint8), 26, 2)


# --------------------------------------------------------------------------------------------
# The container


def test_metadata_of_every_value_type_as_ggufreader_reads_it(tmp_path):
    kv = [
        ("t.u8", 250, V.UINT8),
        ("t.i8", -7, V.INT8),
        ("t.u16", 65000, V.UINT16),
        ("t.i16", -30000, V.INT16),
        ("t.u32", 4_000_000_000, V.UINT32),
        ("t.i32", -2_000_000_000, V.INT32),
        ("t.f32", 0.1, V.FLOAT32),
        ("t.bool", True, V.BOOL),
        ("t.str", "héllo ∑", V.STRING),
        ("t.u64", (1 << 64) - 1, V.UINT64),
        ("t.i64", -(1 << 63), V.INT64),
        ("t.f64", 0.1, V.FLOAT64),
        ("t.arr_u64", [1, 1 << 40], V.ARRAY, V.UINT64),
        ("t.arr_f32", [0.5, -1.25, 3.0], V.ARRAY),
        ("t.arr_str", ["a", "", "ü"], V.ARRAY),
        ("t.arr_bool", [True, False], V.ARRAY),
        ("t.nested", [[1, 2], [3], [4, 5, 6]], V.ARRAY),
        ("t.nested2", [[["x"], ["y", "z"]], [["w"]]], V.ARRAY),
    ]
    tensors = [("a", np.ones((3, 5), np.float32), None), ("b", np.ones(7, np.float16), None)]
    path = write_gguf(tmp_path / "kv.gguf", "qwen3", kv, tensors, alignment=64)
    mine = contract_gguf.GgufFile(path)
    ref = gguf.GGUFReader(path)
    assert list(mine.metadata) == [k for k in ref.fields if not k.startswith("GGUF.")]
    assert mine.version == 3 and mine.alignment == ref.alignment == 64
    assert mine.data_start == ref.data_offset
    want = {k: v for k, v, *_ in kv}
    want["t.f32"] = float(np.float32(0.1))
    want["t.arr_f32"] = [0.5, -1.25, 3.0]
    for key, value in want.items():
        assert mine.metadata[key] == value, key
        assert type(mine.metadata[key]) is type(value), key
    for key in want:
        if not key.startswith("t.nested"):  # GGUFReader flattens nested arrays
            assert mine.metadata[key] == ref.fields[key].contents(), key
    assert mine.value_types["t.u8"] == 0 and mine.value_types["t.arr_u64"] == (9, 10)
    assert mine.value_types["t.nested"] == (9, 9)
    assert mine.metadata["general.architecture"] == "qwen3"
    for t in ref.tensors:
        info = mine.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist())) and info.start == t.data_offset
        assert info.type == t.tensor_type and info.nbytes == t.n_bytes


def test_version_2_and_a_file_without_tensors(tmp_path):
    path = write_gguf(tmp_path / "e.gguf", "qwen3", [("t.x", 1, V.UINT32)])
    data = bytearray(open(path, "rb").read())
    data[4:8] = struct.pack("<I", 2)
    open(path, "wb").write(data)
    g = contract_gguf.GgufFile(path)
    assert g.version == 2 and g.tensors == {} and g.metadata["t.x"] == 1


# Refusals: a small valid file, then one thing broken in it.

BASE_KV = [("t.name", "tiny", V.STRING), ("t.list", [1, 2, 3], V.ARRAY), ("t.aa", 1, V.UINT32)]


@pytest.fixture
def base(tmp_path):
    rng = np.random.default_rng(0)
    q = gguf.quants.quantize(rng.standard_normal((2, 64)).astype(np.float32), Q.Q8_0)
    tensors = [("norm", np.ones(4, np.float32), None), ("mat", q, Q.Q8_0)]
    path = write_gguf(tmp_path / "base.gguf", "qwen3", BASE_KV + [("t.ab", 2, V.UINT32)], tensors)
    return path, bytearray(open(path, "rb").read())


def _after_name(data: bytes, name: str) -> int:
    """The offset just after the (length-prefixed) name of a metadata key or a tensor: a key's
    value type, a tensor info's dim count."""
    enc = name.encode()
    at = data.find(struct.pack("<Q", len(enc)) + enc)
    assert at > 0
    return at + 8 + len(enc)


def refused(path, data, *patterns):
    open(path, "wb").write(bytes(data))
    with pytest.raises(ContractError) as e:
        contract_gguf.GgufFile(path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(path), msg
    for p in patterns:
        assert p in msg, f"{p!r} not in {msg!r}"
    return msg


def test_bad_magic(base):
    path, data = base
    data[0:4] = b"GGML"
    refused(path, data, "not a GGUF file", "b'GGML'")


@pytest.mark.parametrize(
    "version,why", [(1, "GGUF version 1"), (4, "GGUF version 4"), (0x03000000, "big-endian")]
)
def test_bad_version(base, version, why):
    path, data = base
    data[4:8] = struct.pack("<I", version)
    refused(path, data, why)


def test_too_short(base):
    path, data = base
    refused(path, data[:20], "too short to be a GGUF file (20 bytes")


def test_truncated_anywhere_in_the_header(base):
    """Cut at every byte of the header: each cut is refused, as truncated or as data past the
    end of the file, naming the offset and the sizes."""
    path, data = base
    g = contract_gguf.GgufFile(path)
    for cut in range(24, g.data_start + 1):
        msg = refused(path, data[:cut])
        assert (("truncated" in msg or "cannot fit" in msg) and f"({cut} bytes in all" in msg) or (
            "past the end of the file" in msg and f"({cut} bytes)" in msg
        ), msg
    refused(path, data[: _after_name(data, "t.name") + 10], "truncated", "t.name")


def test_tensor_past_the_end_of_the_file(base):
    path, data = base
    g = contract_gguf.GgufFile(path)
    end = g.tensors["mat"].start + g.tensors["mat"].nbytes
    refused(path, data[: end - 1], "tensor mat", "136 bytes of Q8_0", f"({end - 1} bytes)")
    # a padded end is not needed: the data itself within the file is
    open(path, "wb").write(bytes(data[:end]))
    assert contract_gguf.GgufFile(path).dequantize("mat").shape == (2, 64)


def test_unknown_tensor_type(base):
    path, data = base
    at = _after_name(data, "mat") + 4 + 2 * 8
    assert struct.unpack_from("<I", data, at)[0] == 8
    data[at : at + 4] = struct.pack("<I", 99)
    refused(path, data, "tensor mat: unknown ggml type 99")


def test_unknown_value_type(base):
    path, data = base
    at = _after_name(data, "t.aa")
    data[at : at + 4] = struct.pack("<I", 13)
    refused(path, data, "metadata t.aa: unknown value type 13")


@pytest.mark.parametrize(
    "which,at,what", [("tensor", 8, "tensor count"), ("kv", 16, "metadata count")]
)
def test_absurd_counts(base, which, at, what):
    path, data = base
    data[at : at + 8] = struct.pack("<Q", 1 << 60)
    refused(path, data, f"{what} {1 << 60} cannot fit in the")


def test_absurd_array_length(base):
    path, data = base
    at = _after_name(data, "t.list") + 4 + 4  # the value type, the item type, then the length
    data[at : at + 8] = struct.pack("<Q", 1 << 61)
    refused(path, data, f"metadata t.list: array of {1 << 61} INT32 values cannot fit")


def test_absurd_string_length(base):
    path, data = base
    at = _after_name(data, "t.name") + 4
    data[at : at + 8] = struct.pack("<Q", (1 << 64) - 1)
    refused(path, data, "truncated", f"the string value of t.name ({(1 << 64) - 1} bytes)")


def test_repeated_key(base):
    path, data = base
    at = data.find(b"t.ab")
    data[at : at + 4] = b"t.aa"
    refused(path, data, "metadata key t.aa appears twice")


def test_bad_offsets_and_rows(base):
    path, data = base
    at = _after_name(data, "mat") + 4 + 2 * 8 + 4
    (offset,) = struct.unpack_from("<Q", data, at)
    assert offset == 32
    bad = bytearray(data)
    bad[at : at + 8] = struct.pack("<Q", 64)
    refused(path, bad, "tensor mat: data offset 64, expected 32")
    bad = bytearray(data)
    at = _after_name(data, "mat") + 4
    bad[at : at + 8] = struct.pack("<Q", 48)
    refused(path, bad, "tensor mat: a row of 48 elements is not whole Q8_0 blocks of 32")
    bad = bytearray(data)
    bad[at - 4 : at] = struct.pack("<I", 5)
    refused(path, bad, "tensor mat: 5 dims (ggml allows at most 4)")


def test_alignment_must_be_a_uint32_power_of_two(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", "qwen3", [("general.alignment", 48, V.UINT32)])
    with pytest.raises(ContractError, match="general.alignment: 48 is not a power of two"):
        contract_gguf.GgufFile(p)
    p = write_gguf(tmp_path / "b.gguf", "qwen3", [("general.alignment", 32, V.UINT64)])
    with pytest.raises(ContractError, match="general.alignment: type UINT64, must be UINT32"):
        contract_gguf.GgufFile(p)


def test_repeated_tensor_name(tmp_path):
    p = write_gguf(
        tmp_path / "d.gguf",
        "qwen3",
        tensors=[("ab", np.ones(4, np.float32), None), ("ac", np.ones(4, np.float32), None)],
    )
    data = bytearray(open(p, "rb").read())
    at = _after_name(data, "ac") - 2
    data[at : at + 2] = b"ab"
    open(p, "wb").write(bytes(data))
    with pytest.raises(ContractError, match="tensor ab appears twice"):
        contract_gguf.GgufFile(p)


# --------------------------------------------------------------------------------------------
# llama's q/k rows


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (k passes n_head_kv as n_head)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def test_unpermute_is_transformers_llama_tensor_processor():
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

    # transformers un-permutes for the llama architecture only (qwen3's converter permutes nothing)
    assert TENSOR_PROCESSORS["llama"] is LlamaTensorProcessor and "qwen3" not in TENSOR_PROCESSORS
    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    rng = np.random.default_rng(3)
    for name, heads, shape in (
        ("blk.0.attn_q.weight", 4, (4 * 6, 10)),
        ("blk.0.attn_k.weight", 2, (2 * 6, 10)),
        ("blk.1.attn_q.bias", 4, (4 * 6,)),
        ("blk.1.attn_k.bias", 2, (2 * 6,)),
    ):
        w = rng.standard_normal(shape).astype(np.float32)
        want = proc.process(w, name).weights
        got = contract_gguf.unpermute_qk(w, heads)
        assert np.array_equal(bits(got), bits(want)), name
        assert np.array_equal(contract_gguf.unpermute_qk(llama_cpp_permute(w, heads), heads), w)
    with pytest.raises(ContractError, match="10 rows are not 4 heads of an even size"):
        contract_gguf.unpermute_qk(np.zeros((10, 3), np.float32), 4)


# --------------------------------------------------------------------------------------------
# Round trip: the tiny Qwen3 fixture through a GGUF file

HF_TO_GGUF_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
HF_TO_GGUF_BLOCK = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    **{
        f"self_attn.{h}_proj.{s}": f"attn_{g}.{s}"
        for h, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
        for s in ("weight", "bias")
    },
}


def gguf_name(hf: str) -> str:
    if hf in HF_TO_GGUF_TOP:
        return HF_TO_GGUF_TOP[hf]
    p = hf.split(".")
    assert p[:2] == ["model", "layers"], hf
    return f"blk.{p[2]}.{HF_TO_GGUF_BLOCK['.'.join(p[3:])]}"


def arch_kv(arch: str, cfg: dict) -> list:
    """The metadata convert_hf_to_gguf.py writes for these fields (integers as UINT32, floats as
    FLOAT32)."""
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    kv = [
        (f"{arch}.block_count", cfg["num_hidden_layers"], V.UINT32),
        (f"{arch}.context_length", cfg["max_position_embeddings"], V.UINT32),
        (f"{arch}.embedding_length", cfg["hidden_size"], V.UINT32),
        (f"{arch}.feed_forward_length", cfg["intermediate_size"], V.UINT32),
        (f"{arch}.attention.head_count", cfg["num_attention_heads"], V.UINT32),
        (f"{arch}.attention.head_count_kv", cfg["num_key_value_heads"], V.UINT32),
        (f"{arch}.rope.freq_base", theta, V.FLOAT32),
        (f"{arch}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], V.FLOAT32),
        (f"{arch}.vocab_size", cfg["vocab_size"], V.UINT32),
        (f"{arch}.attention.key_length", cfg["head_dim"], V.UINT32),
        (f"{arch}.attention.value_length", cfg["head_dim"], V.UINT32),
    ]
    if arch == "llama":
        kv.append((f"{arch}.rope.dimension_count", cfg["head_dim"], V.UINT32))
    return kv


@pytest.fixture(scope="module")
def fixture_gguf(tmp_path_factory):
    """fixtures/tiny-qwen3 written as a qwen3 GGUF at F32: (its dir, the file, config.json,
    the safetensors)."""
    src = FIXTURES["dense"]
    cfg = json.load(open(os.path.join(src, "config.json")))
    sf = SafetensorsFile(os.path.join(src, "model.safetensors"))
    d = tmp_path_factory.mktemp("gguf-qwen3")
    tensors = [(gguf_name(n), np.ascontiguousarray(sf.as_f32(n)), None) for n in sorted(sf.entries)]
    path = write_gguf(d / "tiny-qwen3-f32.gguf", "qwen3", arch_kv("qwen3", cfg), tensors)
    return str(d), path, cfg, sf


def test_fixture_round_trip_bit_for_bit(fixture_gguf):
    d, path, cfg, sf = fixture_gguf
    for where in (path, d):  # the file, or the directory holding it
        config, tensors = contract_gguf.load_gguf(where)
        assert sorted(tensors) == sorted(sf.entries)
        for name, a in tensors.items():
            want = sf.as_f32(name)
            assert a.dtype == np.float32 and a.shape == want.shape, name
            assert np.array_equal(bits(a), bits(want)), name
    # The fields GGUF carries, as config.json has them; attention_bias from the bias tensors.
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "model_type",
        "architectures",
    ):
        assert config[field] == cfg[field], field
    assert config["rope_theta"] == cfg["rope_parameters"]["rope_theta"]
    assert np.float32(config["rms_norm_eps"]) == np.float32(cfg["rms_norm_eps"])
    # through the contract's own config parser: the same Config as config.json gives
    from tracegate_contract.config import load_config

    assert gguf_config(path) == load_config(FIXTURES["dense"])


def test_fixture_gguf_runs_as_the_safetensors_do(fixture_gguf):
    """The model opened from the GGUF file (run._model: the file or its directory) computes every
    captured tensor bit for bit as the model opened from the fixture's directory."""
    d, path, _, _ = fixture_gguf
    toks = [1, 5, 7, 9, 300]

    def capture(where):
        cap = Capture(True)
        run._model(where).run(toks, cap)
        return {n: a for n, a, _ in cap.tensors}

    want = capture(FIXTURES["dense"])
    for where in (path, d):
        got = capture(where)
        assert list(got) == list(want)
        for name in want:
            assert np.array_equal(bits(got[name]), bits(want[name])), name


def test_model_paths_are_refused_in_one_line(tmp_path, fixture_gguf):
    _, path, _, _ = fixture_gguf
    both = tmp_path / "both"
    both.mkdir()
    os.symlink(path, both / "m.gguf")
    open(both / "model.safetensors", "wb").close()
    for call in (run._model, Checkpoint, contract_gguf.load_gguf):
        with pytest.raises(
            ContractError,
            match=r"holds both a GGUF file \(m\.gguf\) and safetensors \(model\.safetensors\)",
        ) as e:
            call(str(both))
        assert "\n" not in str(e.value)
    two = tmp_path / "two"
    two.mkdir()
    os.symlink(path, two / "a.gguf")
    os.symlink(path, two / "b.gguf")
    with pytest.raises(ContractError, match=r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); pass one"):
        run._model(str(two))
    with pytest.raises(ContractError, match="is not a directory or a .gguf file"):
        run._model(str(tmp_path / "nowhere"))


def test_unknown_tensor_names_and_architectures(tmp_path):
    one = np.ones(4, np.float32)
    p = write_gguf(tmp_path / "u.gguf", "qwen3", tensors=[("blk.0.attn_qkv.weight", one, None)])
    with pytest.raises(
        ContractError,
        match=r"u\.gguf: tensor blk\.0\.attn_qkv\.weight: not a tensor of the GGUF "
        r"architecture qwen3",
    ):
        contract_gguf.GgufWeights(p)
    p = write_gguf(tmp_path / "l.gguf", "llama", tensors=[("blk.0.attn_q_norm.weight", one, None)])
    with pytest.raises(
        ContractError, match=r"attn_q_norm\.weight: not a tensor of the GGUF architecture llama"
    ):
        contract_gguf.GgufWeights(p)
    p = write_gguf(tmp_path / "r.gguf", "llama", tensors=[("rope_freqs.weight", one, None)])
    with pytest.raises(ContractError, match="rope_freqs.weight: .*llama3 rope frequency factors"):
        contract_gguf.GgufWeights(p)
    p = write_gguf(tmp_path / "z.gguf", "qwen3", tensors=[("blk.01.attn_norm.weight", one, None)])
    with pytest.raises(ContractError, match=r"blk\.01\.attn_norm\.weight: not a tensor"):
        contract_gguf.GgufWeights(p)
    p = write_gguf(tmp_path / "a.gguf", "qwen3moe")
    with pytest.raises(ContractError, match="GGUF architecture 'qwen3moe' is not supported"):
        contract_gguf.GgufWeights(p)


def test_config_refusals_name_the_gguf_key(tmp_path, fixture_gguf):
    _, _, cfg, _ = fixture_gguf
    kv = [x for x in arch_kv("qwen3", cfg) if x[0] != "qwen3.attention.key_length"]
    kv = [x for x in kv if x[0] != "qwen3.attention.value_length"]
    p = write_gguf(
        tmp_path / "h.gguf", "qwen3", kv + [("qwen3.attention.key_length", 11, V.UINT32)]
    )
    with pytest.raises(
        ContractError,
        match=r"h\.gguf: the GGUF metadata as config.json: "
        r"head_dim \(from qwen3\.attention\.key_length\): must be even",
    ):
        gguf_config(p)
    p = write_gguf(
        tmp_path / "d.gguf",
        "qwen3",
        kv
        + [
            ("qwen3.attention.key_length", 12, V.UINT32),
            ("qwen3.attention.value_length", 16, V.UINT32),
        ],
    )
    with pytest.raises(
        ContractError,
        match="head sizes disagree: "
        "qwen3.attention.key_length = 12, qwen3.attention.value_length = 16",
    ):
        gguf_config(p)
    p = write_gguf(tmp_path / "t.gguf", "qwen3", [("qwen3.block_count", 2.0, V.FLOAT32)])
    with pytest.raises(
        ContractError, match="metadata qwen3.block_count: type FLOAT32, must be an integer"
    ):
        gguf_config(p)
    p = write_gguf(tmp_path / "s.gguf", "llama", [("llama.rope.scaling.type", "linear", V.STRING)])
    with pytest.raises(ContractError, match="llama.rope.scaling.type = 'linear'"):
        gguf_config(p)


def test_llama_round_trip_through_llama_cpp_permutation(tmp_path):
    """A llama file as convert_hf_to_gguf.py writes one (q and k permuted, no q/k norms): back to
    the HF tensors exactly, the config transformers' mapping gives (head_dim from
    rope.dimension_count), and the same forward pass as the HF directory of those tensors."""
    cfg = dict(
        num_hidden_layers=2,
        max_position_embeddings=64,
        hidden_size=24,
        intermediate_size=40,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        vocab_size=50,
        head_dim=6,
    )
    rng = np.random.default_rng(11)
    H, I, d, nh, nkv = 24, 40, 6, 4, 2
    hf = {"model.embed_tokens.weight": (50, H), "model.norm.weight": (H,)}
    for i in range(2):
        p = f"model.layers.{i}"
        hf |= {
            f"{p}.input_layernorm.weight": (H,),
            f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (nh * d, H),
            f"{p}.self_attn.k_proj.weight": (nkv * d, H),
            f"{p}.self_attn.v_proj.weight": (nkv * d, H),
            f"{p}.self_attn.o_proj.weight": (H, nh * d),
            f"{p}.mlp.gate_proj.weight": (I, H),
            f"{p}.mlp.up_proj.weight": (I, H),
            f"{p}.mlp.down_proj.weight": (H, I),
        }
    hf = {n: rng.standard_normal(s).astype(np.float32) for n, s in hf.items()}
    tensors = []
    for n, a in hf.items():
        if "q_proj" in n:
            a = llama_cpp_permute(a, nh)
        elif "k_proj" in n:
            a = llama_cpp_permute(a, nkv)
        tensors.append((gguf_name(n), a, None))
    p = write_gguf(tmp_path / "llama.gguf", "llama", arch_kv("llama", cfg), tensors)
    config, got = contract_gguf.load_gguf(p)
    assert sorted(got) == sorted(hf)
    for n, a in hf.items():
        assert np.array_equal(bits(got[n]), bits(a)), n
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["head_dim"] == 6 and config["tie_word_embeddings"] is True
    assert "attention_bias" not in config and config["rope_theta"] == 500000.0

    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    write_safetensors(str(hf_dir / "model.safetensors"), {n: ("F32", a) for n, a in hf.items()})
    with open(hf_dir / "config.json", "w") as f:
        json.dump({**cfg, "model_type": "llama", "tie_word_embeddings": True}, f)

    def capture(where):
        cap = Capture(True)
        run._model(where).run([3, 1, 4, 1, 5], cap)
        return {n: a for n, a, _ in cap.tensors}

    want, got = capture(str(hf_dir)), capture(p)
    assert list(got) == list(want)
    for name in want:
        assert np.array_equal(bits(got[name]), bits(want[name])), name


# --------------------------------------------------------------------------------------------
# transformers' own GGUF loader


def _hf_load(d, name):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    m = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    return {k: v.detach().numpy() for k, v in m.state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_gguf_loader_agrees_bit_for_bit_for_every_type(tmp_path, arch):
    """Measured: for a file whose config transformers can rebuild (head_dim 128, Qwen3Config's
    default; no biases), AutoModelForCausalLM.from_pretrained(gguf_file=...) holds exactly our
    tensors, for each of the 11 types, llama's q/k un-permuted alike. So an oracle may load
    llama/qwen3 GGUF files through transformers as far as the tensors go (transformers
    dequantizes with gguf.quants, whose arithmetic ours repeats) — but see the next test for
    the config, which it does not rebuild from every file."""
    H, I, d, nh, nkv, V_ = 256, 256, 128, 2, 1, 32
    cfg = dict(
        num_hidden_layers=2,
        max_position_embeddings=128,
        hidden_size=H,
        intermediate_size=I,
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        vocab_size=V_,
        head_dim=d,
    )
    types = {
        "token_embd.weight": ("Q8_0", V_, H),
        "blk.0.attn_q.weight": ("Q4_K", nh * d, H),
        "blk.0.attn_k.weight": ("Q4_0", nkv * d, H),
        "blk.0.attn_v.weight": ("Q4_1", nkv * d, H),
        "blk.0.attn_output.weight": ("Q6_K", H, nh * d),
        "blk.0.ffn_gate.weight": ("F16", I, H),
        "blk.0.ffn_up.weight": ("BF16", I, H),
        "blk.0.ffn_down.weight": ("Q6_K", H, I),
        "blk.1.attn_q.weight": ("Q5_0", nh * d, H),
        "blk.1.attn_k.weight": ("Q5_1", nkv * d, H),
        "blk.1.attn_v.weight": ("Q5_K", nkv * d, H),
        "blk.1.attn_output.weight": ("Q5_0", H, nh * d),
        "blk.1.ffn_gate.weight": ("Q5_1", I, H),
        "blk.1.ffn_up.weight": ("Q5_K", I, H),
        "blk.1.ffn_down.weight": ("Q8_0", H, I),
        "output.weight": ("F32", V_, H),
    }
    rng = np.random.default_rng(7)
    tensors = []
    for name, (qtype, rows, cols) in types.items():
        a, raw = tensor_of(rng, qtype, rows, cols)
        if qtype == "F16":  # finite values: a NaN never equals itself
            a = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float16)
        if qtype == "BF16":
            a = (rng.standard_normal((rows, cols)).astype(np.float32).view(np.uint32) >> 16).astype(
                np.uint16
            )
        tensors.append((name, a, raw))
    norms = ["attn_norm", "ffn_norm"] + (["attn_q_norm", "attn_k_norm"] if arch == "qwen3" else [])
    for n in norms:
        size = d if "q_norm" in n or "k_norm" in n else H
        for layer in (0, 1):
            a = rng.standard_normal(size).astype(np.float32)
            tensors.append((f"blk.{layer}.{n}.weight", a, None))
    tensors.append(("output_norm.weight", rng.standard_normal(H).astype(np.float32), None))
    path = write_gguf(tmp_path / f"{arch}.gguf", arch, arch_kv(arch, cfg), tensors)
    config, ours = contract_gguf.load_gguf(path)
    assert config["head_dim"] == d and config["tie_word_embeddings"] is False
    theirs = _hf_load(str(tmp_path), f"{arch}.gguf")
    assert sorted(theirs) == sorted(ours)
    agree = {}
    for gname, (qtype, _, _) in types.items():
        hf = contract_gguf.hf_name(arch, gname)
        agree.setdefault(qtype, []).append(np.array_equal(bits(theirs[hf]), bits(ours[hf])))
    assert {t: all(v) for t, v in agree.items()} == dict.fromkeys(QK_TYPES, True)
    for hf in ours:
        assert np.array_equal(bits(theirs[hf]), bits(ours[hf])), hf


def test_transformers_gguf_loader_cannot_rebuild_the_fixture(fixture_gguf):
    """Measured on the fixture's GGUF file: transformers' loader refuses it. Its config mapping
    reads no head_dim for qwen3 (Qwen3Config's 128 stays, the file's q_proj has 4 heads × 12
    rows) and no attention_bias (the file's bias tensors would be dropped); ours reads both
    (attention.key_length, the attn_*.bias tensors). So an oracle cannot take transformers' GGUF
    loader as it is for a qwen3 file whose head size is not 128, or that has biases."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    d, path, _, _ = fixture_gguf
    theirs = load_gguf_checkpoint(path, return_tensors=False)["config"]
    ours, _ = contract_gguf.config_dict(contract_gguf.GgufFile(path))
    assert "head_dim" not in theirs and "attention_bias" not in theirs
    assert ours["head_dim"] == 12 and ours["attention_bias"] is True
    assert {k: v for k, v in ours.items() if k in theirs} == {
        k: v for k, v in theirs.items() if k in ours
    }
    with pytest.raises(RuntimeError, match="ignore_mismatched_sizes"):
        _hf_load(d, os.path.basename(path))


# --------------------------------------------------------------------------------------------
# The engine refuses what the contract refuses (two implementations of numerics.md §21)


def _hostile(tmp_path, fixture_gguf):
    """(case, model path, what the contract's refusal names): one thing wrong in each."""
    _, path, cfg, _ = fixture_gguf
    good = bytearray(open(path, "rb").read())
    kv = arch_kv("qwen3", cfg)
    one = np.ones(4, np.float32)
    cases = []

    def file(name, data):
        p = tmp_path / name
        p.write_bytes(bytes(data))
        return str(p)

    bad = bytearray(good)
    bad[0:4] = b"GGUG"
    cases.append(("magic", file("magic.gguf", bad), "magic"))
    cases.append(("truncated", file("trunc.gguf", good[: len(good) - 100]), "past the end"))
    cases.append(("trailing bytes", file("trail.gguf", good + b"\0" * 64), "belong to no tensor"))
    sizes = [x for x in kv if not x[0].endswith(("key_length", "value_length"))]
    disagree = sizes + [
        ("qwen3.attention.key_length", cfg["head_dim"], V.UINT32),
        ("qwen3.attention.value_length", cfg["head_dim"] + 2, V.UINT32),
    ]
    cases.append(
        ("head sizes", write_gguf(tmp_path / "hd.gguf", "qwen3", disagree), "head sizes disagree")
    )
    scaling = kv + [("qwen3.rope.scaling.type", "linear", V.STRING)]
    cases.append(("rope scaling", write_gguf(tmp_path / "rs.gguf", "qwen3", scaling), "scaling"))
    experts = kv + [("qwen3.expert_count", 8, V.UINT32)]
    cases.append(("experts", write_gguf(tmp_path / "ex.gguf", "qwen3", experts), "expert"))
    unknown = [("blk.0.attn_qkv.weight", one, None)]
    cases.append(
        ("unknown tensor", write_gguf(tmp_path / "un.gguf", "qwen3", kv, unknown), "attn_qkv")
    )
    rope_freqs = [("rope_freqs.weight", one, None)]
    cases.append(
        (
            "rope_freqs",
            write_gguf(tmp_path / "rf.gguf", "llama", arch_kv("llama", cfg), rope_freqs),
            "rope_freqs",
        )
    )
    cases.append(("architecture", write_gguf(tmp_path / "a.gguf", "qwen3moe"), "qwen3moe"))
    both = tmp_path / "both"
    both.mkdir()
    (both / "m.gguf").write_bytes(bytes(good))
    (both / "model.safetensors").write_bytes(b"")
    cases.append(("both kinds", str(both), "both"))
    return cases


# What the engine's refusal of each case names (its own words for the same thing).
ENGINE_NAMES = {
    "magic": "not a GGUF file",
    "truncated": "past the end of the file",
    "trailing bytes": "belong to no tensor",
    "head sizes": "head sizes disagree",
    "rope scaling": "rope.scaling.type",
    "experts": "expert_count",
    "unknown tensor": "blk.0.attn_qkv.weight",
    "rope_freqs": "rope_freqs.weight",
    "architecture": "qwen3moe",
    "both kinds": "both",
}


def test_the_engine_refuses_each_gguf_the_contract_refuses(tmp_path, capsys, fixture_gguf):
    from test_engine_identity import ENGINE
    from test_engine_refusals import contract_refusal, engine_refusal

    if not os.access(ENGINE, os.X_OK):
        pytest.skip(f"NOT CHECKED (the engine's side): {ENGINE} is not built")
    for case, model, named in _hostile(tmp_path, fixture_gguf):
        args = ["trace", "--model", model, "--tokens", "1,2,3"]
        c = contract_refusal(capsys, *args, "--out", tmp_path / "c.trace")
        assert named in c, f"{case}: contract: {c}"
        e = engine_refusal(*args, "--out", tmp_path / "e.trace")
        assert os.path.basename(model) in e and ENGINE_NAMES[case] in e, f"{case}: engine: {e}"


def _nested(depth: int) -> bytes:
    """An ARRAY value `depth` arrays deep (the innermost holds one UINT8)."""
    v = struct.pack("<IQ", 0, 1) + b"\x07"
    for _ in range(depth - 1):
        v = struct.pack("<IQ", 9, 1) + v
    return v


def _kv(key: bytes, vtype: int, value: bytes) -> bytes:
    return struct.pack("<Q", len(key)) + key + struct.pack("<I", vtype) + value


def _with_kv(key: bytes, vtype: int, value: bytes, copies: int = 1) -> bytes:
    """A qwen3 file of no tensors whose metadata ends with `copies` of one more entry (no
    tensors: the file may end where its metadata does)."""
    arch = _kv(b"general.architecture", 8, struct.pack("<Q", 5) + b"qwen3")
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1 + copies)
    return head + arch + _kv(key, vtype, value) * copies


def test_arrays_nest_at_most_8_deep_as_in_the_engine(tmp_path):
    """§21.1 and the engine (parse.rs MAX_NESTING) take arrays 8 deep and refuse 9; the
    contract took them 16 deep (issue 51: all 23 engine/contract disagreements of its fuzz)."""
    path = str(tmp_path / "n.gguf")
    for depth in (1, 8):
        open(path, "wb").write(_with_kv(b"t.deep", 9, _nested(depth)))
        g = contract_gguf.GgufFile(path)
        inner = g.metadata["t.deep"]
        for _ in range(depth - 1):
            inner = inner[0]
        assert inner == [7]
    for depth in (9, 16):
        refused(path, _with_kv(b"t.deep", 9, _nested(depth)), "nested deeper than 8")


def test_a_name_with_control_bytes_is_quoted_escaped(tmp_path):
    """A refusal quoting a key or tensor name is one line without control bytes: a name
    holding a newline could forge a second line, ESC sequences clear or colour the terminal."""
    path = str(tmp_path / "c.gguf")
    u32 = struct.pack("<I", 1)
    msg = refused(path, _with_kv(b"t.x\nerror: forged", 4, u32, 2), "appears twice")
    assert msg.isprintable() and "t.x\\nerror: forged" in msg, msg
    msg = refused(path, _with_kv(b"t.\x1b[2J\xe2\x80\xae", 4, u32, 2))
    assert msg.isprintable() and "t.\\x1b[2J\\u202e" in msg, msg
    # A tensor name: the second of two tensors of one name.
    name = "blk.0.\x1b[31mred"
    write_gguf(path, "qwen3", tensors=[(name, np.ones(4, np.float32), None)] * 1)
    g = contract_gguf.GgufFile(path)
    assert list(g.tensors) == [name]  # the file's own name, unescaped, as the key
    with pytest.raises(ContractError) as e:
        contract_gguf.hf_name("qwen3", name)
    assert str(e.value).isprintable() and "\\x1b[31mred" in str(e.value)
    assert contract_gguf.shown("blk.0.attn_q.weight") == "blk.0.attn_q.weight"


def test_a_metadata_array_of_many_strings_is_read_in_one_loop(tmp_path):
    """500,000 empty strings: read as the engine reads them, and a fault inside such an array
    still names the item."""
    path = str(tmp_path / "s.gguf")
    n = 500_000
    open(path, "wb").write(_with_kv(b"t.s", 9, struct.pack("<IQ", 8, n) + bytes(8 * n)))
    assert contract_gguf.GgufFile(path).metadata["t.s"] == [""] * n
    three = struct.pack("<IQ", 8, 3) + struct.pack("<Q", 1) + b"a" + struct.pack("<Q", 1) + b"\xff"
    refused(path, _with_kv(b"t.s", 9, three + bytes(8)), "t.s[1]", "not UTF-8")
    lying = struct.pack("<IQ", 8, 2) + struct.pack("<Q", 0) + struct.pack("<Q", 1 << 40)
    refused(path, _with_kv(b"t.s", 9, lying), "t.s[1]", "truncated")


# --------------------------------------------------------------------------------------------
# gemma3: names, norms stored plus one, the config transformers makes


def gemma3_gguf(tmp_path, layers=7, **kv_over) -> str:
    """A tiny gemma3 GGUF as llama.cpp's converter writes one (norms stored as w + 1, tied
    embedding, key_length/value_length, sliding_window), with the five-bit types among its
    matrices; some norms far from 1, where `stored - 1` rounds."""
    H, I, d, nh, nkv, V_ = 256, 512, 128, 2, 1, 48
    rng = np.random.default_rng(3)
    kv = {
        "gemma3.context_length": (32768, V.UINT32),
        "gemma3.embedding_length": (H, V.UINT32),
        "gemma3.block_count": (layers, V.UINT32),
        "gemma3.feed_forward_length": (I, V.UINT32),
        "gemma3.attention.head_count": (nh, V.UINT32),
        "gemma3.attention.layer_norm_rms_epsilon": (1e-6, V.FLOAT32),
        "gemma3.attention.key_length": (d, V.UINT32),
        "gemma3.attention.value_length": (d, V.UINT32),
        "gemma3.rope.freq_base": (1e6, V.FLOAT32),
        "gemma3.attention.sliding_window": (512, V.UINT32),
        "gemma3.attention.head_count_kv": (nkv, V.UINT32),
    }
    kv.update(kv_over)
    kvs = [(k, v, t) for k, (v, t) in kv.items() if v is not None]
    kvs.append(("tokenizer.ggml.tokens", [f"t{i}" for i in range(V_)], V.ARRAY, V.STRING))

    def norm(n):
        w = (1.0 + rng.standard_normal(n) * 0.1).astype(np.float32)
        w[:3] = [1e-9, -3.5, 1.0 + 2.0**-23]  # 1e-9 - 1 rounds to -1
        return w, None

    types = ["Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q4_K", "Q6_K", "Q4_0"]
    t = [("token_embd.weight", *tensor_of(rng, "Q5_0", V_, H))]
    for i in range(layers):

        def m(k, rows, cols, i=i):
            return tensor_of(rng, types[(i + k) % len(types)], rows, cols)

        t += [
            (f"blk.{i}.attn_norm.weight", *norm(H)),
            (f"blk.{i}.attn_q.weight", *m(0, nh * d, H)),
            (f"blk.{i}.attn_q_norm.weight", *norm(d)),
            (f"blk.{i}.attn_k.weight", *m(1, nkv * d, H)),
            (f"blk.{i}.attn_k_norm.weight", *norm(d)),
            (f"blk.{i}.attn_v.weight", *m(2, nkv * d, H)),
            (f"blk.{i}.attn_output.weight", *m(3, H, nh * d)),
            (f"blk.{i}.post_attention_norm.weight", *norm(H)),
            (f"blk.{i}.ffn_norm.weight", *norm(H)),
            (f"blk.{i}.ffn_gate.weight", *m(4, I, H)),
            (f"blk.{i}.ffn_up.weight", *m(5, I, H)),
            (f"blk.{i}.ffn_down.weight", *m(6, H, I)),
            (f"blk.{i}.post_ffw_norm.weight", *norm(H)),
        ]
    t.append(("output_norm.weight", *norm(H)))
    return write_gguf(tmp_path / "gemma3.gguf", "gemma3", kvs, t)


def _loader(path):
    """transformers' GGUF loader on `path`: (its config dict, the config its class makes of it,
    its tensors by HF name)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = load_gguf_checkpoint(path)["config"]
    hf = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    got = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)["tensors"]
    return cfg, hf, {k: v.numpy() for k, v in got.items()}


def test_gemma3_is_what_transformers_gguf_loader_makes(tmp_path):
    """A gemma3 file: every tensor, under its HF name, the bits transformers' loader gives (the
    norms minus one, in f32: 1e-9 stored gives -1, not the 1e-9 - 1 + 1 a port might keep), and
    our config dict the one transformers' config class makes of its loader's: the same resolved
    config (layer pattern, both rope thetas, head size, sliding window), transformers' own keys
    as it gives them but rope_theta (moved into rope_parameters, as the class saves it)."""
    from transformers import AutoConfig

    path = gemma3_gguf(tmp_path)
    theirs, resolved, tensors = _loader(path)
    ours, hf = contract_gguf.load_gguf(path)
    assert sorted(hf) == sorted(tensors)
    for name, v in tensors.items():
        assert np.array_equal(bits(hf[name]), bits(v)), name
    w = hf["model.layers.0.pre_feedforward_layernorm.weight"]
    assert w[0] == -1.0 and w[1] == -4.5
    assert {k: v for k, v in theirs.items() if k != "rope_theta"} == {
        k: ours[k] for k in theirs if k != "rope_theta"
    }
    assert ours["architectures"] == ["Gemma3ForCausalLM"] and ours["model_type"] == "gemma3_text"
    mine = AutoConfig.for_model(**{k: v for k, v in ours.items() if k != "architectures"})
    a, b = mine.to_dict(), resolved.to_dict()
    assert a == b, {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
    for k in ("layer_types", "rope_parameters", "query_pre_attn_scalar", "sliding_window"):
        assert ours[k] == b[k], k
    assert (
        ours["layer_types"][5] == "full_attention"
        and ours["layer_types"].count("full_attention") == 1
    )


@pytest.mark.parametrize(
    "key, value, field, want",
    [
        ("gemma3.attention.sliding_window", (1024, V.UINT32), "sliding_window", 1024),
        ("gemma3.rope.freq_base", (5e5, V.FLOAT32), "rope_parameters", 500000.0),
        ("gemma3.rope.freq_base", (None, None), "rope_parameters", 1e6),
        ("gemma3.block_count", (12, V.UINT32), "layer_types", 12),
    ],
)
def test_gemma3_config_keys_follow_the_file(tmp_path, key, value, field, want):
    """Each key the config is read from, changed (or absent: transformers' default): ours moves
    with transformers' resolved config (negative control of the test above: a key that were
    mistranslated, or fixed, would differ here)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gemma3_gguf(tmp_path, layers=12 if key.endswith("block_count") else 7, **{key: value})
    theirs = AutoConfig.for_model(**load_gguf_checkpoint(path)["config"]).to_dict()
    ours, _ = contract_gguf.config_dict(contract_gguf.GgufFile(path))
    assert ours[field] == theirs[field]
    got = {
        "sliding_window": lambda: ours["sliding_window"],
        "rope_parameters": lambda: ours["rope_parameters"]["full_attention"]["rope_theta"],
        "layer_types": lambda: len(ours["layer_types"]),
    }[field]()
    assert got == want
