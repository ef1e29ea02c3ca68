"""An independent writer of the .trace format, written from docs/trace-format.md alone.

It shares no code with the Rust crate: if both produce the same bytes for the conformance
vectors, the spec is what they both follow. Run as a script to (re)generate the vectors:

    .venv/bin/python binding/tests/spec_writer.py fixtures/format
"""

from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

import xxhash

SIZES = {
    "f64": 8,
    "f32": 4,
    "f16": 2,
    "bf16": 2,
    "i64": 8,
    "i32": 4,
    "i16": 2,
    "i8": 1,
    "u8": 1,
    "bool": 1,
}


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _str(s: str) -> bytes:
    b = s.encode("utf-8")
    return _u64(len(b)) + b


def _attr_value(value) -> bytes:
    if isinstance(value, str):
        return b"\x01" + _str(value)
    if isinstance(value, int):
        return b"\x02" + struct.pack("<q", value)
    return b"\x03" + _u64(len(value)) + b"".join(struct.pack("<q", v) for v in value)


def content_digest(tensors: list[dict], decisions: list[dict]) -> str:
    """tensors: name, dtype, shape, attributes, data(bytes); decisions: name, shape, values, margins."""
    out = bytearray(_str("tracegate-content-v1") + _u64(len(tensors)))
    for t in tensors:
        out += _str(t["name"]) + _str(t["dtype"]) + _u64(len(t["shape"]))
        out += b"".join(_u64(d) for d in t["shape"])
        attrs = sorted(t["attributes"].items(), key=lambda kv: kv[0].encode())
        out += _u64(len(attrs))
        for key, value in attrs:
            out += _str(key) + _attr_value(value)
        out += xxhash.xxh3_128_digest(t["data"])
    out += _u64(len(decisions))
    for d in decisions:
        out += _str(d["name"]) + _u64(len(d["shape"])) + b"".join(_u64(x) for x in d["shape"])
        out += _u64(len(d["values"])) + b"".join(struct.pack("<q", v) for v in d["values"])
        if d["margins"] is None:
            out += b"\x00"
        else:
            out += b"\x01" + _u64(len(d["margins"])) + b"".join(d["margins"])
    return hashlib.sha256(bytes(out)).hexdigest()


def write(path: Path, tensors: list[dict], decisions: list[dict], provenance: dict) -> str:
    """Margins are given as 4-byte little-endian f32 bit strings so -0.0 and NaN stay exact."""
    body = bytearray(b"TGTRACE\x00" + struct.pack("<HH", 1, 0) + bytes(52))

    def place(payload: bytes) -> int:
        body.extend(bytes(-len(body) % 64))
        offset = len(body)
        body.extend(payload)
        return offset

    index_tensors = []
    for t in tensors:
        n = 1
        for d in t["shape"]:
            n *= d
        assert len(t["data"]) == n * SIZES[t["dtype"]], t["name"]
        offset = place(t["data"])
        index_tensors.append(
            {
                "name": t["name"],
                "dtype": t["dtype"],
                "shape": t["shape"],
                "offset": offset,
                "nbytes": len(t["data"]),
                "xxh3": xxhash.xxh3_128_hexdigest(t["data"]),
                "attributes": dict(sorted(t["attributes"].items(), key=lambda kv: kv[0].encode())),
            }
        )
    index_decisions = []
    for d in decisions:
        values = b"".join(struct.pack("<q", v) for v in d["values"])
        margins = None if d["margins"] is None else b"".join(d["margins"])
        values_offset = place(values)
        margins_offset = None if margins is None else place(margins)
        index_decisions.append(
            {
                "name": d["name"],
                "shape": d["shape"],
                "values_offset": values_offset,
                "margins_offset": margins_offset,
                "xxh3": xxhash.xxh3_128_hexdigest(values + (margins or b"")),
            }
        )
    digest = content_digest(tensors, decisions)
    index = json.dumps(
        {
            "format": "tracegate.trace",
            "version": [1, 0],
            "digest": digest,
            "tensors": index_tensors,
            "decisions": index_decisions,
            "provenance": provenance,
        },
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode("utf-8")
    index_offset = place(index)
    body += _u64(index_offset) + _u64(len(index)) + xxhash.xxh3_128_digest(index) + b"TGTREND\x00"
    Path(path).write_bytes(bytes(body))
    return digest


def load_vectors(directory: Path) -> list[dict]:
    """vectors.json in the form the tests consume: payloads and margins as hex."""
    return json.loads((Path(directory) / "vectors.json").read_text())["vectors"]


def decode(vector: dict) -> tuple[list[dict], list[dict]]:
    tensors = [dict(t, data=bytes.fromhex(t["data_hex"])) for t in vector["tensors"]]
    decisions = [
        dict(
            d,
            margins=None
            if d["margins_hex"] is None
            else [bytes.fromhex(m) for m in d["margins_hex"]],
        )
        for d in vector["decisions"]
    ]
    return tensors, decisions


def _f32(x: float) -> str:
    return struct.pack("<f", x).hex()


# The inputs of the conformance vectors: edit here, then regenerate.
VECTOR_INPUTS = [
    {
        "file": "empty.trace",
        "provenance": {"producer": "conformance"},
        "tensors": [],
        "decisions": [],
    },
    {
        "file": "dtypes.trace",
        "provenance": {
            "producer": "conformance",
            "note": "one tensor per dtype; rank 0, rank 5, empty",
        },
        "tensors": [
            {
                "name": "f64",
                "dtype": "f64",
                "shape": [2],
                "attributes": {"path": "prefill"},
                "data_hex": struct.pack("<dd", 1.5, -0.0).hex(),
            },
            {
                "name": "f32",
                "dtype": "f32",
                "shape": [2, 2],
                "attributes": {"path": "prefill", "mask": "causal", "positions": [0, 1]},
                "data_hex": struct.pack("<ffff", 1.0, -2.5, 3.25, float("inf")).hex(),
            },
            {
                "name": "f16",
                "dtype": "f16",
                "shape": [3],
                "attributes": {"step": 2},
                "data_hex": "003c00c0ff7f",
            },
            {
                "name": "bf16",
                "dtype": "bf16",
                "shape": [1, 1, 1, 1, 2],
                "attributes": {"note": "rank five"},
                "data_hex": "803f80bf",
            },
            {
                "name": "i64",
                "dtype": "i64",
                "shape": [],
                "attributes": {},
                "data_hex": struct.pack("<q", -7).hex(),
            },
            {
                "name": "i32",
                "dtype": "i32",
                "shape": [2],
                "attributes": {},
                "data_hex": struct.pack("<ii", 1, -1).hex(),
            },
            {
                "name": "i16",
                "dtype": "i16",
                "shape": [1],
                "attributes": {},
                "data_hex": struct.pack("<h", -300).hex(),
            },
            {"name": "i8", "dtype": "i8", "shape": [2], "attributes": {}, "data_hex": "7f80"},
            {"name": "u8", "dtype": "u8", "shape": [0, 3], "attributes": {}, "data_hex": ""},
            {
                "name": "bool",
                "dtype": "bool",
                "shape": [3],
                "attributes": {"zeta": "last", "alpha": "first"},
                "data_hex": "010001",
            },
        ],
        "decisions": [],
    },
    {
        "file": "decisions.trace",
        "provenance": {
            "producer": "conformance",
            "versions": {"tracegate": "0.1.0"},
            "prompt_tokens": [3, 17, 5],
        },
        "tensors": [
            {
                "name": "logits",
                "dtype": "f32",
                "shape": [3, 2],
                "attributes": {"path": "prefill", "mask": "causal", "positions": [0, 1, 2]},
                "data_hex": struct.pack("<6f", 0.5, 0.25, -1.0, 2.0, 3.0, 3.0).hex(),
            },
        ],
        "decisions": [
            {
                "name": "logits.argmax",
                "shape": [3],
                "values": [0, 1, 0],
                "margins_hex": [_f32(0.25), _f32(3.0), _f32(0.0)],
            },
            {
                "name": "layer.00.router.topk",
                "shape": [3, 2],
                "values": [1, 4, 0, 2, 4, 1],
                "margins_hex": [_f32(0.125), _f32(-0.0), _f32(1e-7)],
            },
            {"name": "decode.0000.argmax", "shape": [1], "values": [42], "margins_hex": None},
            {"name": "scalar", "shape": [], "values": [-1], "margins_hex": None},
        ],
    },
]


def regenerate(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    vectors = []
    for v in VECTOR_INPUTS:
        tensors, decisions = decode(v)
        digest = write(directory / v["file"], tensors, decisions, v["provenance"])
        file_sha = hashlib.sha256((directory / v["file"]).read_bytes()).hexdigest()
        vectors.append(dict(v, digest=digest, file_sha256=file_sha))
    (directory / "vectors.json").write_text(
        json.dumps(
            {
                "about": "Conformance vectors for docs/trace-format.md, written by binding/tests/spec_writer.py",
                "vectors": vectors,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: spec_writer.py OUTPUT_DIR")
    regenerate(Path(sys.argv[1]))
