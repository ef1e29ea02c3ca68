"""Hostile GGUF files for the three readers (engine, contract, oracle): a small valid file (the
tiny Qwen3 fixture written by ggml's own GGUFWriter), a walker that finds where each field of
it lies, hand-made hostile files (issue 51's), and seeded random mutants of the valid file — bit
flips, byte edits in the header, truncations, count, offset, type, dim and length edits, extra
metadata spliced in. test_gguf_fuzz.py runs them all through the three readers."""

from __future__ import annotations

import json
import random
import struct
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"
V = gguf.GGUFValueType

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B"}
_SCALAR.update({10: "<Q", 11: "<q", 12: "<d"})


def _hf_to_gguf(hf: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf in top:
        return top[hf]
    block = {
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
    p = hf.split(".")
    return f"blk.{p[2]}.{block['.'.join(p[3:])]}"


def base_gguf(path: Path, layers: int = 2, extra_kv=(), head=False) -> Path:
    """fixtures/tiny-qwen3's first `layers` layers as a qwen3 GGUF: F32 weights (F16 for the
    q/k/v projections, so two types are in play), the metadata convert_hf_to_gguf.py writes
    (integers UINT32, floats FLOAT32), `extra_kv` appended ((key, value, type[, sub type]));
    `head`: an untied `output.weight` (the embedding's copy) as the last tensor."""
    from tracegate_contract.weights import SafetensorsFile

    cfg = json.loads((DENSE / "config.json").read_text())
    sf = SafetensorsFile(str(DENSE / "model.safetensors"))
    w = gguf.GGUFWriter(str(path), "qwen3")
    a = "qwen3"
    for key, value in (
        ("block_count", layers),
        ("context_length", cfg["max_position_embeddings"]),
        ("embedding_length", cfg["hidden_size"]),
        ("feed_forward_length", cfg["intermediate_size"]),
        ("attention.head_count", cfg["num_attention_heads"]),
        ("attention.head_count_kv", cfg["num_key_value_heads"]),
        ("vocab_size", cfg["vocab_size"]),
        ("attention.key_length", cfg["head_dim"]),
        ("attention.value_length", cfg["head_dim"]),
    ):
        w.add_key_value(f"{a}.{key}", value, V.UINT32)
    w.add_key_value(f"{a}.rope.freq_base", 10000.0, V.FLOAT32)
    w.add_key_value(f"{a}.attention.layer_norm_rms_epsilon", cfg["rms_norm_eps"], V.FLOAT32)
    for key, value, vtype, *sub in extra_kv:
        w.add_key_value(key, value, vtype, sub[0] if sub else None)
    names = [
        n
        for n in sorted(sf.entries)
        if not n.startswith("model.layers.") or int(n.split(".")[2]) < layers
    ]
    for n in names:
        t = np.ascontiguousarray(sf.as_f32(n))
        if any(f"self_attn.{x}_proj.weight" in n for x in "qkv"):
            t = t.astype(np.float16)
        w.add_tensor(_hf_to_gguf(n), t)
    if head:
        w.add_tensor("output.weight", np.ascontiguousarray(sf.as_f32("model.embed_tokens.weight")))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the layout of a valid file ----------------------------------------------------------------


@dataclass
class Kv:
    key: str
    at: int  # the key's length field
    type_at: int
    value_at: int
    end: int
    type: int


@dataclass
class Info:
    name: str
    at: int
    n_dims_at: int
    dims_at: list
    type_at: int
    offset_at: int
    type: int
    offset: int


@dataclass
class Layout:
    """Where each field of a valid GGUF lies (absolute offsets); `header_end` is where the
    tensor infos end, `data_start` the aligned start of the data section."""

    kvs: list = field(default_factory=list)
    infos: list = field(default_factory=list)
    header_end: int = 0
    data_start: int = 0


def _skip_value(b: bytes, pos: int, t: int) -> int:
    if t in _SCALAR:
        return pos + struct.calcsize(_SCALAR[t])
    if t == 8:
        (n,) = struct.unpack_from("<Q", b, pos)
        return pos + 8 + n
    assert t == 9, t
    item, n = struct.unpack_from("<IQ", b, pos)
    pos += 12
    for _ in range(n):
        pos = _skip_value(b, pos, item)
    return pos


def layout(b: bytes) -> Layout:
    """The fields of the valid GGUF `b` (the walker trusts it: give it only files GGUFWriter
    wrote)."""
    lay = Layout()
    n_tensors, n_kv = struct.unpack_from("<QQ", b, 8)
    pos = 24
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", b, pos)
        key = b[pos + 8 : pos + 8 + n].decode()
        t_at = pos + 8 + n
        (t,) = struct.unpack_from("<I", b, t_at)
        end = _skip_value(b, t_at + 4, t)
        lay.kvs.append(Kv(key, pos, t_at, t_at + 4, end, t))
        pos = end
    for _ in range(n_tensors):
        (n,) = struct.unpack_from("<Q", b, pos)
        name = b[pos + 8 : pos + 8 + n].decode()
        nd_at = pos + 8 + n
        (nd,) = struct.unpack_from("<I", b, nd_at)
        dims_at = [nd_at + 4 + 8 * i for i in range(nd)]
        type_at = nd_at + 4 + 8 * nd
        t, off = struct.unpack_from("<IQ", b, type_at)
        lay.infos.append(Info(name, pos, nd_at, dims_at, type_at, type_at + 4, t, off))
        pos = type_at + 12
    lay.header_end = pos
    lay.data_start = -(-pos // 32) * 32
    return lay


# ---- encoding pieces ---------------------------------------------------------------------------


def gstr(s: bytes | str) -> bytes:
    s = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(s)) + s


def kv_bytes(key: bytes | str, t: int, value: bytes) -> bytes:
    """One metadata entry: the key, the type, the value's bytes as given."""
    return gstr(key) + struct.pack("<I", t) + value


def nested_array(depth: int) -> bytes:
    """An ARRAY value holding arrays `depth` levels deep in all (the innermost holds one UINT8)."""
    v = struct.pack("<IQ", 0, 1) + b"\x07"
    for _ in range(depth - 1):
        v = struct.pack("<IQ", 9, 1) + v
    return v


def with_kvs(b: bytes, extra: bytes, n: int = 1, at: int | None = None) -> bytes:
    """`b` with `n` metadata entries (`extra`'s bytes) spliced in at `at` (default: after the
    last entry), the count raised, the data section moved to the next 32-byte boundary."""
    lay = layout(b)
    at = lay.kvs[-1].end if at is None else at
    head = bytearray(b[: lay.header_end])
    struct.pack_into("<Q", head, 16, len(lay.kvs) + n)
    head[at:at] = extra
    pad = -len(head) % 32
    return bytes(head) + b"\0" * pad + b[lay.data_start :]


def set_u32(b: bytes, at: int, v: int) -> bytes:
    out = bytearray(b)
    struct.pack_into("<I", out, at, v & 0xFFFFFFFF)
    return bytes(out)


def set_u64(b: bytes, at: int, v: int) -> bytes:
    out = bytearray(b)
    struct.pack_into("<Q", out, at, v & 0xFFFFFFFFFFFFFFFF)
    return bytes(out)


def set_value(b: bytes, key: str, t: int, value: bytes) -> bytes:
    """`b` with metadata `key`'s type and value replaced (the data section re-aligned)."""
    lay = layout(b)
    kv = next(k for k in lay.kvs if k.key == key)
    head = bytearray(b[: lay.header_end])
    head[kv.type_at : kv.end] = struct.pack("<I", t) + value
    pad = -len(head) % 32
    return bytes(head) + b"\0" * pad + b[lay.data_start :]


def rename_key(b: bytes, key: str, new: bytes) -> bytes:
    lay = layout(b)
    kv = next(k for k in lay.kvs if k.key == key)
    head = bytearray(b[: lay.header_end])
    head[kv.at : kv.type_at] = gstr(new)
    pad = -len(head) % 32
    return bytes(head) + b"\0" * pad + b[lay.data_start :]


# ---- the hand-made hostile files of issue 51 -----------------------------------------------------


def hostile(b: bytes, tied: bytes) -> dict[str, tuple[bytes, bool]]:
    """{case: (file bytes, legal)} from the valid file `b` (and `tied`, the same with an untied
    head as its last tensor): `legal` files are computed by the engine (§21.1 allows them)."""
    lay = layout(b)
    i1, i2 = lay.infos[1], lay.infos[2]
    tl = layout(tied)
    out: dict[str, tuple[bytes, bool]] = {}
    out["offset of another tensor"] = (set_u64(b, i2.offset_at, i1.offset), False)
    out["offset 1 byte off"] = (set_u64(b, i2.offset_at, i2.offset + 1), False)
    gap = bytearray(b)
    for t in lay.infos[2:]:
        struct.pack_into("<Q", gap, t.offset_at, t.offset + 32)
    first = lay.data_start + i2.offset
    out["32-byte gap"] = (bytes(gap[:first]) + b"\0" * 32 + bytes(gap[first:]), False)
    out["one tensor too few"] = (set_u64(tied, 8, len(tl.infos) - 1), False)
    f32 = next(t for t in lay.infos if t.type == 0)
    out["type Q2_K"] = (set_u32(b, f32.type_at, 10), False)  # a type no reader dequantizes
    out["empty file"] = (b"", False)
    out["header only"] = (b[:24], False)
    out["truncated in the metadata"] = (b[: lay.kvs[3].value_at + 2], False)
    out["truncated in the tensor infos"] = (b[: lay.infos[4].offset_at + 3], False)
    out["truncated in the data"] = (b[: len(b) - 100], False)
    k0 = lay.kvs[1]
    out["repeated key"] = (with_kvs(b, b[k0.at : k0.end]), False)
    out["version 1"] = (set_u32(b, 4, 1), False)
    out["lying string length"] = (set_u64(b, k0.at, 1 << 40), False)
    out["non-UTF-8 name"] = (rename_key(b, k0.key, b"qwen3.\xff\xfe"), False)
    out["head_count 0"] = (
        set_value(b, "qwen3.attention.head_count", 4, struct.pack("<I", 0)),
        False,
    )
    out["block_count 2^31"] = (
        set_value(b, "qwen3.block_count", 4, struct.pack("<I", 1 << 31)),
        False,
    )
    out["rope_theta 1e-60"] = (
        set_value(b, "qwen3.rope.freq_base", 12, struct.pack("<d", 1e-60)),
        False,
    )
    # 2^-149: its largest frequency at this head size, 1/θ^(10/12) ≈ 2^124, is a finite f32.
    out["subnormal freq_base"] = (
        set_value(b, "qwen3.rope.freq_base", 6, struct.pack("<I", 1)),
        True,
    )
    for depth in (8, 9, 16):
        out[f"arrays nested {depth} deep"] = (
            with_kvs(b, kv_bytes("t.nested", 9, nested_array(depth))),
            depth <= 8,
        )
    out["array of arrays"] = (
        with_kvs(
            b,
            kv_bytes("t.aa", 9, struct.pack("<IQ", 9, 2) + nested_array(1) + nested_array(1)),
        ),
        True,
    )
    out["rms epsilon an integer"] = (
        set_value(b, "qwen3.attention.layer_norm_rms_epsilon", 4, struct.pack("<I", 0)),
        True,
    )
    # Computed to NaN logits, which every reader refuses naming the row (capture-points.md).
    out["rms epsilon -1"] = (
        set_value(b, "qwen3.attention.layer_norm_rms_epsilon", 6, struct.pack("<f", -1.0)),
        False,
    )
    out["key with a newline"] = (
        with_kvs(b, kv_bytes("t.x\nengine trace: forged", 4, struct.pack("<I", 1)) * 2, n=2),
        False,
    )
    out["key with ESC"] = (
        with_kvs(b, kv_bytes("t.\x1b[2Jx", 4, struct.pack("<I", 1)) * 2, n=2),
        False,
    )
    return out


def many_empty_strings(b: bytes, n: int = 500_000) -> bytes:
    """`b` with a metadata array of `n` empty strings (8 bytes each)."""
    return with_kvs(b, kv_bytes("t.empty", 9, struct.pack("<IQ", 8, n) + b"\0" * 8 * n))


# ---- seeded random mutants -------------------------------------------------------------------------


def mutants(b: bytes, seed: int, count: int) -> list[tuple[str, bytes]]:
    """`count` mutants of the valid file `b`, each (what was done, bytes), from `seed`."""
    rng = random.Random(seed)
    lay = layout(b)
    kvs, infos = lay.kvs, lay.infos

    def bitflip():
        at = rng.randrange(lay.header_end)
        bit = rng.randrange(8)
        out = bytearray(b)
        out[at] ^= 1 << bit
        return f"flip bit {bit} of header byte {at}", bytes(out)

    def data_bitflip():
        at = rng.randrange(lay.data_start, len(b))
        out = bytearray(b)
        out[at] ^= 1 << rng.randrange(8)
        return f"flip a bit of data byte {at}", bytes(out)

    def byte_edit():
        at = rng.randrange(lay.header_end)
        v = rng.choice([0, 1, 0x7F, 0x80, 0xFF, rng.randrange(256)])
        out = bytearray(b)
        out[at] = v
        return f"header byte {at} = {v:#x}", bytes(out)

    def truncate():
        n = rng.choice([rng.randrange(lay.header_end), rng.randrange(len(b))])
        return f"truncated to {n} bytes", b[:n]

    def append():
        n = rng.choice([1, 31, 32, 64, 4096])
        return f"{n} bytes appended", b + bytes(rng.randrange(256) for _ in range(n))

    def count_edit():
        at, which = rng.choice([(8, "tensor count"), (16, "metadata count")])
        (v,) = struct.unpack_from("<Q", b, at)
        new = rng.choice([v - 1, v + 1, 0, 1 << 31, (1 << 64) - 1])
        return f"{which} {v} -> {new}", set_u64(b, at, new)

    def offset_edit():
        i = rng.randrange(len(infos))
        t = infos[i]
        new = rng.choice(
            [
                t.offset + 1,
                t.offset - 1,
                t.offset + 32,
                t.offset - 32,
                infos[rng.randrange(len(infos))].offset,
                0,
                len(b),
                (1 << 64) - 1,
            ]
        )
        return f"tensor {t.name} offset {t.offset} -> {new}", set_u64(b, t.offset_at, new)

    def type_edit():
        t = rng.choice(infos)
        new = rng.choice([0, 1, 2, 3, 6, 7, 8, 12, 14, 24, 28, 30, 31, 41, 42, 1 << 31])
        return f"tensor {t.name} type {t.type} -> {new}", set_u32(b, t.type_at, new)

    def dim_edit():
        t = rng.choice(infos)
        j = rng.randrange(len(t.dims_at))
        (d,) = struct.unpack_from("<Q", b, t.dims_at[j])
        new = rng.choice([d + 1, d - 1, d * 2, 0, 1, 1 << 62, (1 << 64) - 1])
        return f"tensor {t.name} dim {j} {d} -> {new}", set_u64(b, t.dims_at[j], new)

    def n_dims_edit():
        t = rng.choice(infos)
        new = rng.choice([0, 1, 3, 4, 5, 1 << 31])
        return f"tensor {t.name} n_dims -> {new}", set_u32(b, t.n_dims_at, new)

    def length_edit():
        if rng.random() < 0.5:
            k = rng.choice(kvs)
            at, what = k.at, f"key {k.key}"
        else:
            t = rng.choice(infos)
            at, what = t.at, f"tensor name {t.name}"
        (n,) = struct.unpack_from("<Q", b, at)
        new = rng.choice([n + 1, n - 1, 0, 64, 1 << 40, (1 << 64) - 1])
        return f"length of {what} {n} -> {new}", set_u64(b, at, new)

    def value_type_edit():
        k = rng.choice(kvs)
        new = rng.choice(list(range(14)) + [1 << 31])
        return f"metadata {k.key} type {k.type} -> {new}", set_u32(b, k.type_at, new)

    def value_edit():
        k = rng.choice([k for k in kvs if k.type in (4, 6)])
        if k.type == 4:
            v = rng.choice([0, 1, 2, 3, 7, 8, 1 << 16, 1 << 31, (1 << 32) - 1])
            new = struct.pack("<I", v)
        else:
            v = rng.choice([0.0, -1.0, 1e-45, 1e-30, 1.0, 1e30, float("inf"), float("nan")])
            new = struct.pack("<f", v)
        out = bytearray(b)
        out[k.value_at : k.end] = new
        return f"metadata {k.key} = {v}", bytes(out)

    def splice():
        kind = rng.randrange(5)
        if kind == 0:
            k = rng.choice(kvs)
            return f"metadata {k.key} repeated", with_kvs(b, b[k.at : k.end])
        if kind == 1:
            depth = rng.randrange(1, 18)
            return f"arrays nested {depth} deep", with_kvs(
                b, kv_bytes("t.nested", 9, nested_array(depth))
            )
        if kind == 2:
            item = rng.choice(list(range(13)))
            n = rng.choice([0, 1, 3])
            body = b""
            for _ in range(n):
                body += (
                    gstr("ab")
                    if item == 8
                    else nested_array(1)
                    if item == 9
                    else struct.pack(_SCALAR[item], 1)
                )
            return f"array of {n} items of type {item}", with_kvs(
                b, kv_bytes("t.arr", 9, struct.pack("<IQ", item, n) + body)
            )
        if kind == 3:
            t = rng.choice([4, 5, 6, 10, 11, 12])
            key = rng.choice(
                [
                    "qwen3.attention.layer_norm_rms_epsilon",
                    "qwen3.rope.freq_base",
                    "qwen3.context_length",
                ]
            )
            v = rng.choice([0, 1, 7])
            raw = struct.pack(_SCALAR[t], float(v) if t in (6, 12) else v)
            return f"metadata {key} as type {t} = {v}", set_value(b, key, t, raw)
        name = rng.choice([b"t.\n", b"t.\x1b[1m", b"t.\xff", b"", b"general.alignment"])
        return f"a key {name!r}", with_kvs(b, kv_bytes(name, 4, struct.pack("<I", 64)))

    kinds = [
        (bitflip, 6),
        (data_bitflip, 1),
        (byte_edit, 4),
        (truncate, 2),
        (append, 1),
        (count_edit, 2),
        (offset_edit, 3),
        (type_edit, 2),
        (dim_edit, 2),
        (n_dims_edit, 1),
        (length_edit, 2),
        (value_type_edit, 2),
        (value_edit, 3),
        (splice, 3),
    ]
    fns = [f for f, w in kinds for _ in range(w)]
    return [rng.choice(fns)() for _ in range(count)]
