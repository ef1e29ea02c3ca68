"""GGUF checkpoints: the container parsed, the tensors dequantized to f32, the names and the
config mapped onto the Hugging Face ones the contract reads.

Written from the format (ggml's docs/gguf.md and gguf.cpp's checks) and the block layouts; ggml's
own Python package `gguf` is the reference the tests compare against, never imported here.

* The container (v2 and v3, little-endian): magic, version, tensor and metadata counts, the
  metadata of every value type (arrays of arrays included), the tensor infos, `general.alignment`
  (32 when absent), and the data region. Every length, count and offset is checked against the
  file before it is used; a file that would make ggml refuse it (a repeated key or tensor name, a
  name of 64 bytes or more, more than 4 dims, a row that is not whole blocks, tensors not laid out
  one after another at the alignment, in the order of their infos) is refused too.
* Dequantization (`dequantize`) of F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and
  Q6_K, bit for bit what gguf/quants.py computes: the same operations in the same order, each an f32 numpy ufunc
  (one rounding each, never fused, never through f64). Every other ggml type is refused by name.
  (In these formats every product is exact in f32 — an f16 scale of 11 significant bits times
  integers of at most 13 more — so Q8_0, Q4_0 and Q6_K round nowhere, and Q4_1 and Q4_K only in
  their final sum or difference: a fused or reordered evaluation would give the same bits. Q5_0,
  Q5_1 and Q5_K are Q4_0, Q4_1 and Q4_K with a fifth bit per quant.)
* The Hugging Face view (`GgufWeights`, `load_gguf`) of the GGUF architectures `llama`, `qwen3`
  and `gemma3`: GGUF names to HF names (an unknown name is refused), GGUF dims (innermost first)
  reversed into the row-major HF shape, llama's q/k rows un-permuted as transformers does,
  gemma3's norm weights (stored plus one by llama.cpp) minus one as transformers does, and the
  config.json dict transformers' GGUF loader builds from the metadata (`config_dict`).

Every refusal is a ContractError naming the file, the key or tensor, and the numbers.
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np

from .errors import ContractError

F32 = np.float32
_F16 = np.dtype("<f2")

MAGIC = b"GGUF"
# v1 had 32-bit counts and lengths; v3 differs from v2 only by allowing big-endian files.
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_NAME = 64  # GGML_MAX_NAME: a tensor name is shorter than this
MAX_NESTING = 8  # arrays of arrays: ggml reads none; deeper than this is refused (as the engine)
_I64 = 1 << 63

# Metadata value types (gguf.md): scalar code -> (struct format, size).
_SCALARS = {
    0: ("<B", 1),  # UINT8
    1: ("<b", 1),  # INT8
    2: ("<H", 2),  # UINT16
    3: ("<h", 2),  # INT16
    4: ("<I", 4),  # UINT32
    5: ("<i", 4),  # INT32
    6: ("<f", 4),  # FLOAT32
    7: ("<B", 1),  # BOOL
    10: ("<Q", 8),  # UINT64
    11: ("<q", 8),  # INT64
    12: ("<d", 8),  # FLOAT64
}
STRING, ARRAY, BOOL = 8, 9, 7
VALUE_TYPES = {
    0: "UINT8",
    1: "INT8",
    2: "UINT16",
    3: "INT16",
    4: "UINT32",
    5: "INT32",
    6: "FLOAT32",
    7: "BOOL",
    8: "STRING",
    9: "ARRAY",
    10: "UINT64",
    11: "INT64",
    12: "FLOAT64",
}
_INTEGERS = {0, 1, 2, 3, 4, 5, 10, 11}
_FLOATS = {6, 12}
# The fewest bytes one value of a type can take: bounds a count before anything is read.
_MIN_SIZE = {**{t: s for t, (_, s) in _SCALARS.items()}, STRING: 8, ARRAY: 12}

# ggml tensor types: code -> (name, elements per block, bytes per block), as ggml.c's type traits.
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}
TYPE_CODES = {name: code for code, (name, _, _) in GGML_TYPES.items()}


def shown(name: str) -> str:
    """A key or tensor name as a refusal quotes it: escaped (`\\n`, `\\x1b`, ...) where it holds
    a control or other unprintable character, so one refusal stays one line and cannot move the
    cursor or colour the terminal; an ordinary name is itself."""
    return name if name.isprintable() else repr(name)[1:-1]


class TensorInfo:
    """One tensor info: `dims` as stored (ne0 first, innermost), its type, its data's absolute
    byte range in the file."""

    __slots__ = ("name", "dims", "type", "start", "nbytes")

    def __init__(self, name: str, dims: tuple[int, ...], type_: int, start: int, nbytes: int):
        self.name, self.dims, self.type, self.start, self.nbytes = name, dims, type_, start, nbytes

    @property
    def type_name(self) -> str:
        return GGML_TYPES[self.type][0]

    @property
    def shape(self) -> tuple[int, ...]:
        """The row-major (numpy, HF) shape: the dims reversed."""
        return tuple(reversed(self.dims))

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n


class _Reader:
    """Reads the header front to back; every read is bounded by the file's size."""

    def __init__(self, path: str, buf, size: int):
        self.path, self.buf, self.size, self.pos = path, buf, size, 0

    def fail(self, what: str):
        raise ContractError(f"{self.path}: {what}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            self.fail(
                f"truncated: {what} at offset {self.pos} needs {n} bytes, "
                f"the file has {self.size - self.pos} left ({self.size} bytes in all)"
            )

    def scalar(self, code: int, what: str):
        fmt, n = _SCALARS[code]
        self.need(n, what)
        (v,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return v

    def u32(self, what: str) -> int:
        return self.scalar(4, what)

    def u64(self, what: str) -> int:
        return self.scalar(10, what)

    def string(self, what: str) -> str:
        at = self.pos
        n = self.u64(f"length of {what}")
        self.need(n, f"{what} ({n} bytes)")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            self.fail(f"{what} at offset {at} is not UTF-8: {e}")

    def value(self, code: int, key: str, depth: int = 0):
        """One metadata value of type `code` (the key names it in any refusal)."""
        if code == STRING:
            return self.string(f"the string value of {key}")
        if code == BOOL:
            v = self.scalar(BOOL, f"the value of {key}")
            if v > 1:
                self.fail(f"metadata {key}: BOOL value {v} is neither 0 nor 1")
            return bool(v)
        if code in _SCALARS:
            return self.scalar(code, f"the value of {key}")
        if code != ARRAY:
            self.fail(f"metadata {key}: unknown value type {code} (GGUF has 0..12)")
        if depth >= MAX_NESTING:
            self.fail(f"metadata {key}: arrays nested deeper than {MAX_NESTING} levels")
        item = self.u32(f"the item type of array {key}")
        if item not in VALUE_TYPES:
            self.fail(f"metadata {key}: array of unknown value type {item} (GGUF has 0..12)")
        n = self.u64(f"the length of array {key}")
        left = self.size - self.pos
        if n > left // _MIN_SIZE[item]:
            self.fail(
                f"metadata {key}: array of {n} {VALUE_TYPES[item]} values cannot fit in the "
                f"{left} bytes left in the file ({self.size} bytes in all; at least "
                f"{_MIN_SIZE[item]} bytes each)"
            )
        if item in _SCALARS:
            fmt, size = _SCALARS[item]
            a = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=n, offset=self.pos)
            self.pos += n * size
            if item == BOOL:
                if n and int(a.max()) > 1:
                    self.fail(f"metadata {key}: BOOL array holds a value that is neither 0 nor 1")
                return [bool(x) for x in a.tolist()]
            return a.tolist()
        if item == STRING:
            return self._strings(n, key)
        return [self.value(item, f"{key}[{i}]", depth + 1) for i in range(n)]

    def _strings(self, n: int, key: str) -> list:
        """`n` strings, in one loop (a metadata array of a million empty strings costs the
        strings, not a method call and a message each); any fault is reported by `string`."""
        buf, size, pos, out = self.buf, self.size, self.pos, []
        for i in range(n):
            if size - pos >= 8:
                (ln,) = struct.unpack_from("<Q", buf, pos)
                if ln <= size - pos - 8:
                    try:
                        out.append(bytes(buf[pos + 8 : pos + 8 + ln]).decode("utf-8"))
                        pos += 8 + ln
                        continue
                    except UnicodeDecodeError:
                        pass
            self.pos = pos
            self.string(f"the string value of {key}[{i}]")  # raises, naming what is wrong
        self.pos = pos
        return out


class GgufFile:
    """A parsed GGUF file: `version`, `metadata` {key: value} (Python ints, floats, bools,
    strings, nested lists), `value_types` {key: type code, or (ARRAY, item code)}, `alignment`,
    `data_start`, `tensors` {name: TensorInfo} in file order. The tensor data is one read-only
    memory map of the file: nothing is read until a tensor is asked for."""

    def __init__(self, path: str):
        self.path = path = os.fspath(path)
        if os.path.exists(path) and not os.path.isfile(path):
            raise ContractError(f"{path}: not a regular file")
        try:
            size = os.path.getsize(path)
        except OSError as e:
            raise ContractError(f"{path}: cannot read: {e.strerror}") from None
        if size < 24:
            raise ContractError(
                f"{path}: too short to be a GGUF file ({size} bytes; the header alone is 24)"
            )
        try:
            self._map = np.memmap(path, dtype=np.uint8, mode="r")
        except (OSError, ValueError) as e:
            raise ContractError(f"{path}: cannot map: {e}") from None
        r = _Reader(path, memoryview(self._map), size)
        self.size = size
        magic = bytes(self._map[:4])
        if magic != MAGIC:
            r.fail(f"not a GGUF file: magic {magic!r}, expected {MAGIC!r}")
        r.pos = 4
        version = r.u32("version")
        if version & 0xFFFF == 0 and version != 0:
            r.fail(f"version field {version:#010x}: a big-endian GGUF file, which is not supported")
        if version not in VERSIONS:
            r.fail(f"GGUF version {version} is not supported (2 and 3 are)")
        self.version = version
        n_tensors = r.u64("tensor count")
        n_kv = r.u64("metadata count")
        left = size - r.pos
        if n_kv > left // 13:  # a key's length, its type and a value of at least one byte
            r.fail(
                f"metadata count {n_kv} cannot fit in the {left} bytes after the header "
                f"({size} bytes in all)"
            )
        if n_tensors > left // 24:  # a name's length, n_dims, a type and an offset
            r.fail(
                f"tensor count {n_tensors} cannot fit in the {left} bytes after the header "
                f"({size} bytes in all)"
            )

        self.metadata: dict = {}
        self.value_types: dict = {}
        self.spans: dict[str, tuple[int, int]] = {}  # key -> its entry's byte range in the file
        for i in range(n_kv):
            start = r.pos
            key = r.string(f"metadata key #{i}")
            ks = shown(key)
            if key in self.metadata:
                r.fail(f"metadata key {ks} appears twice")
            code = r.u32(f"the value type of {ks}")
            if code not in VALUE_TYPES:
                r.fail(f"metadata {ks}: unknown value type {code} (GGUF has 0..12)")
            at = r.pos
            self.metadata[key] = r.value(code, ks)
            self.spans[key] = (start, r.pos)
            if code == ARRAY:
                self.value_types[key] = (ARRAY, struct.unpack_from("<I", self._map, at)[0])
            else:
                self.value_types[key] = code

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self.metadata:
            a = self.metadata["general.alignment"]
            t = self.value_types["general.alignment"]
            if t != 4:
                r.fail(f"metadata general.alignment: type {_type_name(t)}, must be UINT32")
            if a == 0 or a & (a - 1):
                r.fail(f"metadata general.alignment: {a} is not a power of two")
            self.alignment = a

        infos = []
        names = set()
        for i in range(n_tensors):
            raw_name = r.string(f"the name of tensor #{i}")
            name = shown(raw_name)  # as messages quote it
            n = len(raw_name.encode("utf-8"))
            if n >= MAX_NAME:
                r.fail(f"tensor {name}: a name of {n} bytes (ggml allows {MAX_NAME - 1})")
            if raw_name in names:
                r.fail(f"tensor {name} appears twice")
            names.add(raw_name)
            n_dims = r.u32(f"the dim count of tensor {name}")
            if n_dims > MAX_DIMS:
                r.fail(f"tensor {name}: {n_dims} dims (ggml allows at most {MAX_DIMS})")
            dims = tuple(r.u64(f"dim {j} of tensor {name}") for j in range(n_dims))
            for j, d in enumerate(dims):
                if d >= _I64:
                    r.fail(f"tensor {name}: dim {j} is {d}, beyond ggml's int64 sizes")
            code = r.u32(f"the type of tensor {name}")
            if code not in GGML_TYPES:
                r.fail(f"tensor {name}: unknown ggml type {code}")
            offset = r.u64(f"the data offset of tensor {name}")
            infos.append((raw_name, name, dims, code, offset))

        self.data_start = _pad(r.pos, self.alignment)
        self.tensors: dict[str, TensorInfo] = {}
        expected = 0  # ggml lays the tensors out in info order, each padded to the alignment
        for raw_name, name, dims, code, offset in infos:
            tname, block, bsize = GGML_TYPES[code]
            n = 1
            for d in dims:
                n *= d
            if n >= _I64:
                r.fail(f"tensor {name}: {' x '.join(map(str, dims))} = {n} elements, beyond int64")
            row = dims[0] if dims else 1  # ggml's ne0, 1 for a tensor of no dims
            if row % block:
                r.fail(
                    f"tensor {name}: a row of {row} elements is not whole {tname} blocks of {block}"
                )
            nbytes = n // block * bsize
            if offset != expected:
                r.fail(
                    f"tensor {name}: data offset {offset}, expected {expected} (the tensors are "
                    f"laid out in order, each padded to the alignment {self.alignment})"
                )
            start = self.data_start + offset
            if start + nbytes > size:
                r.fail(
                    f"tensor {name}: its {nbytes} bytes of {tname} data at offset {start} end at "
                    f"{start + nbytes}, past the end of the file ({size} bytes)"
                )
            expected = _pad(offset + nbytes, self.alignment)
            self.tensors[raw_name] = TensorInfo(raw_name, dims, code, start, nbytes)
        # The file ends at the last tensor's padded end at the latest (that padding may be
        # absent): bytes after it belong to no tensor (numerics.md §21.1, as the engine).
        end = self.data_start + expected
        if size > end:
            r.fail(
                f"{size - end} bytes after the data section (which ends at {end}) belong to no tensor"
            )

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes (a read-only view into the map)."""
        t = self.tensors[name]
        return self._map[t.start : t.start + t.nbytes]

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor in f32, in its row-major shape (the dims reversed)."""
        t = self.tensors[name]
        try:
            flat = dequantize(self.raw(name), t.type, t.n_elements)
        except ContractError as e:
            raise ContractError(f"{self.path}: tensor {shown(name)}: {e}") from None
        return flat.reshape(t.shape)


def _pad(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def _type_name(t) -> str:
    if isinstance(t, tuple):
        return f"ARRAY of {VALUE_TYPES[t[1]]}"
    return VALUE_TYPES[t]


# --------------------------------------------------------------------------------------------
# Dequantization: each function takes the blocks as a [n_blocks, bytes per block] uint8 array
# and returns [n_blocks, elements per block] f32, by gguf/quants.py's operations in its order.


def _half(b: np.ndarray) -> np.ndarray:
    """Two bytes per block (a little-endian f16) widened exactly to f32: [n, 1]."""
    return np.ascontiguousarray(b).view(_F16).astype(F32)


def _q8_0(b):
    # 2 bytes d (f16), 32 int8 quants: x = q * d.
    d = _half(b[:, 0:2])
    q = np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(F32)
    return q * d


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, k] bytes -> [n, 2k]: all the low nibbles, then all the high ones (uint8)."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _q4_0(b):
    # 2 bytes d (f16), 16 bytes: element j is byte j's low nibble, element j+16 its high one,
    # each minus 8: x = d * (q - 8).
    d = _half(b[:, 0:2])
    q = _nibbles(b[:, 2:18]).astype(np.int8) - np.int8(8)
    return d * q.astype(F32)


def _q4_1(b):
    # 2 bytes d, 2 bytes m (f16), 16 bytes of nibbles as Q4_0, unsigned: x = d * q + m (two
    # roundings: a product, then a sum).
    d = _half(b[:, 0:2])
    m = _half(b[:, 2:4])
    q = _nibbles(b[:, 4:20]).astype(F32)
    return (d * q) + m


def _q5_quants(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of high bits (a little-endian u32) and [n, 16] bytes of nibbles -> [n, 32]
    5-bit quants (uint8): element j is `_nibbles`' j topped with bit j of the u32 as its bit 4."""
    bits = np.ascontiguousarray(qh).view("<u4")  # [n, 1]
    high = ((bits >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    return _nibbles(qs) | (high << np.uint8(4))


def _q5_0(b):
    # 2 bytes d (f16), 4 bytes qh, 16 bytes of nibbles: 5-bit quants minus 16: x = d * (q - 16)
    # (exact: 11 significant bits times 5).
    d = _half(b[:, 0:2])
    q = _q5_quants(b[:, 2:6], b[:, 6:22]).astype(np.int8) - np.int8(16)
    return d * q.astype(F32)


def _q5_1(b):
    # 2 bytes d, 2 bytes m (f16), 4 bytes qh, 16 bytes of nibbles: unsigned 5-bit quants,
    # x = d * q + m (a product, then a sum: two roundings, the product's exact).
    d = _half(b[:, 0:2])
    m = _half(b[:, 2:4])
    q = _q5_quants(b[:, 4:8], b[:, 8:24]).astype(F32)
    return (d * q) + m


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> eight 6-bit scales and eight 6-bit mins (uint8). Sub-block j < 4: the low six
    bits of byte j (scale) and of byte j+4 (min). j >= 4: byte j+4's low nibble (scale) or high
    nibble (min), topped with the two high bits of byte j-4 (scale) or byte j (min)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    six = np.uint8(0x3F)
    sc = np.concatenate(
        [lo & six, (hi & np.uint8(0x0F)) | ((lo >> np.uint8(6)) << np.uint8(4))], -1
    )
    mn = np.concatenate(
        [mid & six, (hi >> np.uint8(4)) | ((mid >> np.uint8(6)) << np.uint8(4))], -1
    )
    return sc, mn


def _q4_k(b):
    # 2 bytes d, 2 bytes dmin (f16), 12 bytes of packed scales and mins, 128 bytes of nibbles.
    # 256 elements in 8 sub-blocks of 32: each 32 bytes hold two sub-blocks, the low nibbles the
    # first and the high nibbles the second. x = (d * sc) * q - (dmin * m).
    n = b.shape[0]
    d = _half(b[:, 0:2])
    dmin = _half(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    ds = (d * sc.astype(F32)).reshape(n, 8, 1)
    dm = (dmin * mn.astype(F32)).reshape(n, 8, 1)
    qs = b[:, 16:144].reshape(n, 4, 1, 32)
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)
    return (ds * q.astype(F32) - dm).reshape(n, 256)


def _q5_k(b):
    # As Q4_K (d, dmin, the same 12 bytes of scales and mins, 128 bytes of nibbles at 48), with
    # 32 bytes qh at 16 between: element l of sub-block j takes bit j of qh[l] as its bit 4.
    # x = (d * sc) * q - (dmin * m).
    n = b.shape[0]
    d = _half(b[:, 0:2])
    dmin = _half(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    ds = (d * sc.astype(F32)).reshape(n, 8, 1)
    dm = (dmin * mn.astype(F32)).reshape(n, 8, 1)
    qh = b[:, 16:48].reshape(n, 1, 32)
    high = (qh >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & np.uint8(1)
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)
    q = low | (high << np.uint8(4))
    return (ds * q.astype(F32) - dm).reshape(n, 256)


def _q6_k(b):
    # 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits), 16 int8 scales, 2 bytes d (f16).
    # Each half of 128 elements takes 64 bytes of ql and 32 of qh: its four runs of 32 are ql's
    # low nibbles (bytes 0-31, then 32-63), then its high nibbles (0-31, 32-63), topped with qh's
    # bits 0-1, 2-3, 4-5, 6-7. q - 32, scaled per 16 elements: x = (d * scale) * q.
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(F32)
    d = _half(b[:, 208:210])
    low = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=2).reshape(n, 2, 4, 32)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = (qh >> shifts) & np.uint8(0x03)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    ds = (d * scales).reshape(n, 16, 1)
    return (ds * q.reshape(n, 16, 16).astype(F32)).reshape(n, 256)


_BLOCKS = {
    "Q8_0": _q8_0,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def dequantize(raw: np.ndarray, ggml_type: int | str, n_elements: int) -> np.ndarray:
    """`n_elements` values of `ggml_type` (code or name) stored in `raw` (uint8), as flat f32.
    F32 is returned as a view of `raw`; the others are computed."""
    name = ggml_type if isinstance(ggml_type, str) else GGML_TYPES.get(ggml_type, (None,))[0]
    if name not in SUPPORTED:
        what = name if name is not None else f"ggml type {ggml_type}"
        raise ContractError(f"type {what} is not supported ({', '.join(SUPPORTED)})")
    _, block, bsize = GGML_TYPES[TYPE_CODES[name]]
    raw = np.asarray(raw).reshape(-1).view(np.uint8)
    if n_elements % block or raw.size != n_elements // block * bsize:
        raise ContractError(
            f"{raw.size} bytes do not hold {n_elements} {name} values "
            f"({n_elements // block * bsize} bytes in blocks of {block})"
        )
    if name == "F32":
        return raw.view("<f4").astype(F32, copy=False)
    if name == "F16":
        return raw.view(_F16).astype(F32)
    if name == "BF16":  # the top half of an f32
        return (raw.view("<u2").astype(np.uint32) << np.uint32(16)).view(F32)
    blocks = raw.reshape(-1, bsize)
    return _BLOCKS[name](blocks).reshape(-1)


# --------------------------------------------------------------------------------------------
# The Hugging Face view: names, shapes, llama's q/k rows, the config.

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# The model_type transformers gives a file of each architecture (a gemma3 file holds the text
# model only).
MODEL_TYPES = {"llama": "llama", "qwen3": "qwen3", "gemma3": "gemma3_text"}

_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{
        f"attn_{g}.{s}": f"self_attn.{h}_proj.{s}"
        for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
        for s in ("weight", "bias")
    },
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per architecture, the block tensors llama.cpp defines for it (and transformers maps).
_BLOCK_NAMES = {
    "qwen3": {
        **_BLOCK,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    # Gemma 3: a norm before and after attention and before and after the feed-forward;
    # llama.cpp's ffn_norm is the one before it.
    "gemma3": {
        **_BLOCK,
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
    "llama": {
        **_BLOCK,
        "ffn_gate.bias": "mlp.gate_proj.bias",
        "ffn_up.bias": "mlp.up_proj.bias",
        "ffn_down.bias": "mlp.down_proj.bias",
    },
}
_BLK = re.compile(r"blk\.(0|[1-9][0-9]*)\.(.+)")
_ATTN_BIAS = re.compile(r"blk\.\d+\.attn_(q|k|v|output)\.bias")
_MLP_BIAS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.bias")


def hf_name(arch: str, name: str) -> str:
    """The HF name of GGUF tensor `name` in a file of architecture `arch`; an unknown name is
    refused."""
    if arch not in _BLOCK_NAMES:
        raise ContractError(
            f"GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    if name in _TOP:
        return _TOP[name]
    m = _BLK.fullmatch(name)
    if m and m.group(2) in _BLOCK_NAMES[arch]:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[arch][m.group(2)]}"
    why = ""
    if name == "rope_freqs.weight":
        why = (
            " (llama3 rope frequency factors: the metadata does not say which rope_scaling they "
            "encode, and transformers' GGUF loader drops them)"
        )
    raise ContractError(f"tensor {shown(name)}: not a tensor of the GGUF architecture {arch}{why}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter stores each head's q (k) rows interleaved, the two halves of the
    head alternating (row 2i+j holds HF row j*d/2 + i); this puts them back, as transformers'
    LlamaTensorProcessor does (on a bias too: its rows are the weight's)."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise ContractError(f"{rows} rows are not {n_head} heads of an even size")
    half = rows // n_head // 2
    return np.ascontiguousarray(
        w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


# GGUF metadata key (under the architecture's prefix) -> the config.json field transformers'
# GGUF_CONFIG_MAPPING gives it, for the three architectures. `rope.dimension_count` is head_dim
# for llama only; transformers reads no head_dim for qwen3 (see config_dict); gemma3's come
# from _GEMMA3_KEYS too.
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_GEMMA3_KEYS = {
    "attention.key_length": "head_dim",
    "attention.sliding_window": "sliding_window",
}
_FLOAT_FIELDS = {"rope_theta", "rms_norm_eps"}
# Gemma3TextConfig's derivations where a GGUF file says nothing (llama.cpp computes with the same
# in code): every 6th layer global, the sliding layers' rope theta, the global one's default.
GEMMA3_PATTERN = 6
GEMMA3_THETA_LOCAL = 10_000.0
GEMMA3_THETA_GLOBAL = 1_000_000.0
_MAX_LAYERS = 1 << 20  # a layer_types list longer than this is not built (as the engine)


def stored_plus_one(arch: str, name: str) -> bool:
    """Whether GGUF tensor `name` holds llama.cpp's `w + 1` of a gemma3 norm weight: transformers'
    Gemma2TensorProcessor (the GGUF architecture gemma3's) subtracts 1 from every tensor whose
    name contains `norm.weight`, in f32 (numpy f32 minus a Python int)."""
    return arch == "gemma3" and "norm.weight" in name


def _gemma3_fields(cfg: dict, src: dict, where: str) -> None:
    """What Gemma3TextConfig derives and a GGUF file cannot state, as transformers saves it:
    rope_parameters (replacing rope_theta), layer_types, and its defaults for the scalar of the
    attention scores, the activation and the (absent) logit soft-capping."""
    full = cfg.pop("rope_theta", GEMMA3_THETA_GLOBAL)
    src["rope_parameters"] = src.pop("rope_theta", "Gemma3TextConfig's default")
    layers = cfg.get("num_hidden_layers", 26)  # Gemma3TextConfig's default
    if not 0 <= layers <= _MAX_LAYERS:
        raise ContractError(f"{where}: metadata gemma3.block_count = {layers} is not a layer count")
    cfg["rope_parameters"] = {
        "sliding_attention": {"rope_type": "default", "rope_theta": GEMMA3_THETA_LOCAL},
        "full_attention": {"rope_type": "default", "rope_theta": float(full)},
    }
    cfg["layer_types"] = [
        "full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention"
        for i in range(layers)
    ]
    src["layer_types"] = f"gemma3.block_count, every {GEMMA3_PATTERN}th layer global"
    cfg["query_pre_attn_scalar"] = 256
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["final_logit_softcapping"] = None
    cfg["attn_logit_softcapping"] = None


def config_dict(g: GgufFile) -> tuple[dict, dict]:
    """(the config.json dict, {field: the GGUF key it came from}) for a llama, qwen3 or gemma3
    file: the fields transformers' GGUF loader (load_gguf_checkpoint with GGUF_CONFIG_MAPPING)
    builds, and those the file states that it cannot:

    * head_dim: llama's from `rope.dimension_count` as transformers, gemma3's from
      `attention.key_length` as transformers; for qwen3 (where transformers leaves Qwen3Config's
      128) from `attention.key_length` when the file has it.
      Where the file has several of rope.dimension_count, key_length and value_length, they
      must agree (the contract rotates the whole head and gives v the head size of k).
    * attention_bias (mlp_bias for llama): true when the file holds such bias tensors
      (transformers would drop them).
    * the keys the contract cannot honour are refused: a rope scaling type, experts.
    * for gemma3, what Gemma3TextConfig derives (`_gemma3_fields`): rope_parameters in place of
      rope_theta, layer_types, and its defaults (numerics.md §21.5 step 5).
    """
    md, where = g.metadata, g.path
    arch = md.get("general.architecture")
    if g.value_types.get("general.architecture") != STRING:
        raise ContractError(f"{where}: metadata general.architecture: missing or not a string")
    if arch not in ARCHITECTURES:
        raise ContractError(
            f"{where}: GGUF architecture {arch!r} is not supported by the contract's GGUF source "
            f"({', '.join(ARCHITECTURES)})"
        )
    split = md.get("split.count")
    if split is not None and split != 1:
        raise ContractError(
            f"{where}: metadata split.count = {split}: split GGUF files are not supported"
        )
    model_type = MODEL_TYPES[arch]
    # transformers: `"mistral" in model_name` over the list read_field returns, i.e. a name that is
    # exactly "mistral" makes a llama file a mistral one.
    if arch == "llama" and md.get("general.name") == "mistral":
        model_type = "mistral"
    cfg: dict = {
        "model_type": model_type,
        "architectures": ["MistralForCausalLM" if model_type == "mistral" else ARCHITECTURES[arch]],
    }
    src: dict = {"model_type": "general.architecture"}

    def get(key: str, integer: bool):
        full = f"{arch}.{key}"
        if full not in md:
            return None
        t = g.value_types[full]
        ok = t in _INTEGERS if integer else (t in _FLOATS or t in _INTEGERS)
        if not ok:
            kind = "an integer" if integer else "a number"
            raise ContractError(f"{where}: metadata {full}: type {_type_name(t)}, must be {kind}")
        return md[full]

    keys = {**_CONFIG_KEYS, **(_GEMMA3_KEYS if arch == "gemma3" else {})}
    for key, fld in keys.items():
        v = get(key, fld not in _FLOAT_FIELDS)
        if v is not None:
            cfg[fld] = float(v) if fld in _FLOAT_FIELDS else v
            src[fld] = f"{arch}.{key}"
    if "vocab_size" not in cfg and g.value_types.get("tokenizer.ggml.tokens") == (ARRAY, STRING):
        cfg["vocab_size"] = len(md["tokenizer.ggml.tokens"])  # as transformers
        src["vocab_size"] = "tokenizer.ggml.tokens"

    dims = {
        k: get(k, True)
        for k in ("rope.dimension_count", "attention.key_length", "attention.value_length")
    }
    given = {k: v for k, v in dims.items() if v is not None}
    if len(set(given.values())) > 1:
        listed = ", ".join(f"{arch}.{k} = {v}" for k, v in given.items())
        raise ContractError(f"{where}: head sizes disagree: {listed}")
    first = "rope.dimension_count" if arch == "llama" else "attention.key_length"
    for k in (first, "attention.key_length", "attention.value_length", "rope.dimension_count"):
        if k in given and "head_dim" not in cfg:
            cfg["head_dim"], src["head_dim"] = given[k], f"{arch}.{k}"
            break

    st = md.get(f"{arch}.rope.scaling.type")
    if st is not None and st != "none":
        raise ContractError(
            f"{where}: metadata {arch}.rope.scaling.type = {st!r}: rope scaling from GGUF "
            "metadata is not supported (transformers' GGUF loader ignores it)"
        )
    experts = get("expert_count", True)
    if experts:
        raise ContractError(
            f"{where}: metadata {arch}.expert_count = {experts}: experts are not supported"
        )

    names = list(g.tensors)
    cfg["tie_word_embeddings"] = "output.weight" not in names
    src["tie_word_embeddings"] = "the absence of output.weight"
    if any(_ATTN_BIAS.fullmatch(n) for n in names):
        cfg["attention_bias"], src["attention_bias"] = True, "the attn_*.bias tensors"
    if arch == "llama" and any(_MLP_BIAS.fullmatch(n) for n in names):
        cfg["mlp_bias"], src["mlp_bias"] = True, "the ffn_*.bias tensors"
    if arch == "gemma3":
        _gemma3_fields(cfg, src, where)
    return cfg, src


class GgufWeights:
    """A GGUF file as the checkpoint of an HF model: `entries` {HF name: (f32 dtype, HF shape,
    GGUF name, GGUF type name, "F32")} (the first, second and last places as
    weights.SafetensorsFile's), `stored`/`as_f32` dequantize (llama's q/k un-permuted) on
    demand, `config`/`config_sources` as config_dict."""

    def __init__(self, path: str):
        self.path = path
        g = self.file = GgufFile(path)
        self.config, self.config_sources = config_dict(g)
        arch = self.arch = g.metadata["general.architecture"]
        self.entries: dict[str, tuple] = {}
        for name, t in g.tensors.items():
            if t.type_name not in SUPPORTED:
                raise ContractError(
                    f"{path}: tensor {shown(name)}: type {t.type_name} is not supported "
                    f"({', '.join(SUPPORTED)})"
                )
            try:
                hf = hf_name(arch, name)
            except ContractError as e:
                raise ContractError(f"{path}: {e}") from None
            self.entries[hf] = (np.dtype(F32), t.shape, name, t.type_name, "F32")
        self._heads = {}
        if arch == "llama":  # transformers' LlamaTensorProcessor, for the llama architecture only
            for fld in ("num_attention_heads", "num_key_value_heads"):
                if fld not in self.config:
                    raise ContractError(
                        f"{path}: metadata {arch}.{_key_of(fld)} is missing: the q/k rows of a "
                        "llama file cannot be un-permuted without it"
                    )
            self._heads = {
                "attn_q": self.config["num_attention_heads"],
                "attn_k": self.config["num_key_value_heads"],
            }

    def stored(self, hf: str) -> np.ndarray:
        name = self.entries[hf][2]
        w = self.file.dequantize(name)
        if stored_plus_one(self.arch, name):
            w = w - np.float32(1)  # one f32 subtraction, as transformers' `weights - 1`
        part = name.split(".")[-2] if name.startswith("blk.") else ""
        if part in self._heads:
            try:
                w = unpermute_qk(w, self._heads[part])
            except ContractError as e:
                raise ContractError(f"{self.path}: tensor {shown(name)}: {e}") from None
        return w

    as_f32 = stored


def _key_of(fld: str) -> str:
    return next(k for k, f in _CONFIG_KEYS.items() if f == fld)


def locate(path: str) -> str | None:
    """The GGUF file `--model` names: `path` itself when it is a `.gguf` file, the one `.gguf`
    file of a directory holding no `*.safetensors`, else None (not a GGUF checkpoint). A
    directory with both kinds, or several `.gguf` files, is refused."""
    path = os.fspath(path)
    if os.path.isfile(path):
        return path if path.endswith(".gguf") else None
    if not os.path.isdir(path):
        return None
    files = sorted(os.listdir(path))
    ggufs = [f for f in files if f.endswith(".gguf")]
    if not ggufs:
        return None
    st = [f for f in files if f.endswith(".safetensors")]
    if st:
        raise ContractError(
            f"{path}: holds both a GGUF file ({ggufs[0]}) and safetensors ({st[0]}); "
            "pass the .gguf file itself, or a directory with one kind"
        )
    if len(ggufs) > 1:
        raise ContractError(
            f"{path}: holds {len(ggufs)} .gguf files ({', '.join(ggufs)}); pass one of them"
        )
    return os.path.join(path, ggufs[0])


def load_gguf(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(the config.json dict, {HF name: f32 array}) of a llama, qwen3 or gemma3 GGUF file (or of
    the directory `locate` accepts)."""
    found = locate(path)
    if found is None:
        raise ContractError(f"{path}: not a .gguf file or a directory holding one")
    w = GgufWeights(found)
    return dict(w.config), {hf: w.as_f32(hf) for hf in w.entries}
