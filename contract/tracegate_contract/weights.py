"""safetensors checkpoints, memory-mapped, with every tensor accounted for.

The header is parsed here (8-byte little-endian length, JSON, then the data region) and each
tensor is a numpy view into one `np.memmap` of its file, so nothing is read until used.
Hostile or broken headers are refused before anything is mapped. A model takes its tensors by
name through `Checkpoint.take`; a tensor it asks for and cannot find is refused by name, and
`Checkpoint.finish` refuses any tensor nobody took (docs/traps.md, trap 14: a declared weight must
reach the computation).
"""

from __future__ import annotations

import os
import stat
import struct

import numpy as np
from tracegate.jsonfile import file_kind

from . import gguf, jsonfile
from .errors import ContractError
from .ops import F32

# safetensors dtype -> (numpy storage dtype, bytes per element). Only the float types a
# checkpoint of these families carries; anything else is refused by name.
_DTYPES = {"F32": (np.dtype("<f4"), 4), "BF16": (np.dtype("<u2"), 2), "F16": (np.dtype("<f2"), 2)}
_MAX_HEADER = 100 * 1024 * 1024


def widen(dtype: str, stored: np.ndarray) -> np.ndarray:
    """§1: stored values (`dtype` as safetensors names it) -> f32, exactly: bf16 bit patterns
    (uint16) are the top half of an f32, f16 by numpy's exact cast, f32 as is."""
    if dtype == "BF16":
        return (stored.astype(np.uint32) << np.uint32(16)).view(F32)
    if dtype == "F16":
        return stored.astype(F32)
    return stored.astype(F32, copy=False)


def regular_file(path: str, shown: str) -> None:
    """Refuse a path that is not a regular file before opening it: opening a FIFO for reading
    blocks until a writer comes, which may be never (as the engine refuses it)."""
    if os.path.exists(path) and not os.path.isfile(path):
        raise ContractError(f"{shown}: not a regular file")


def open_weights(path: str, shown: str):
    """The weights file `path` opened for reading (a binary file object), refused in one line
    unless it is a regular file once symlinks are followed: looked at before the open (a FIFO
    would block it, /dev/zero never ends), opened non-blocking, and looked at again through the
    handle, which is what is then read and mapped (never the path a second time)."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            raise ContractError(f"{shown}: not a regular file ({file_kind(st.st_mode)})")
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as e:
        raise ContractError(f"{shown}: cannot read: {e.strerror}") from None
    f = os.fdopen(fd, "rb")
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        f.close()
        raise ContractError(f"{shown}: not a regular file ({file_kind(st.st_mode)})")
    return f


def stamp(st: os.stat_result) -> tuple[int, ...]:
    """Which file, and what a write to it changes: device, inode, size and mtime (not ctime,
    which a chmod moves too; a writer that puts size and mtime back, `cp -p` onto the same file,
    is not seen)."""
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _stamp_path(path: str) -> tuple[int, ...] | None:
    try:
        return stamp(os.stat(path))
    except OSError:
        return None


# The weights files of each model directory as its last Checkpoint loaded them: real path of
# the directory -> [(file path, stamp)]. `weights_digest` holds the recorded digest to them.
_LOADED: dict[str, list[tuple[str, tuple[int, ...]]]] = {}


def weights_digest(model_dir: str) -> str:
    """The weights digest provenance records (tracegate.weights_digest), refused in one line if
    a weights file the run's Checkpoint loaded is no longer the file at its path, or was written
    since: the path would be hashed, not the bytes the contract computed with (a checkpoint
    renamed over mid-run). Checked after the digest, so the digest read the loaded files."""
    import tracegate

    digest = tracegate.weights_digest(model_dir)
    for path, then in _LOADED.get(os.path.realpath(model_dir), ()):
        try:
            now = stamp(os.stat(path))
        except OSError as e:
            now = e.strerror
        if now != then:
            what = (
                f"another file now (inode {then[1]} -> {now[1]})"
                if isinstance(now, tuple) and now[:2] != then[:2]
                else f"written since (size, mtime {then[2:]} -> {now[2:]})"
                if isinstance(now, tuple)
                else f"gone ({now})"
            )
            raise ContractError(
                f"{path}: the weights file changed after the contract loaded it: {what}; "
                "its digest would not be that of the weights computed with, rerun"
            )
    return digest


class SafetensorsFile:
    def __init__(self, path: str):
        self.path = path
        name = os.path.basename(path)
        with open_weights(path, name) as f:
            self.stamp = stamp(os.fstat(f.fileno()))
            self._read(f, name)

    def _read(self, f, name: str) -> None:
        try:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise ContractError(f"{name}: too short to be a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or n > size - 8:
                raise ContractError(f"{name}: header length {n} exceeds the file ({size} bytes)")
            raw = f.read(n)
        except OSError as e:
            raise ContractError(f"{name}: cannot read: {e.strerror}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ContractError(f"{name}: header is not UTF-8: {e}") from None
        header, repeated = jsonfile.loads(text, f"{name}: header")
        if not isinstance(header, dict):
            raise ContractError(f"{name}: header is not a JSON object")
        if repeated is not None:  # json keeps the last silently; which one is meant is unknowable
            raise ContractError(f"{name}: duplicate tensor name {repeated!r} in the header")
        meta = header.pop("__metadata__", None)
        if meta is not None and not (
            isinstance(meta, dict) and all(isinstance(x, str) for x in meta.values())
        ):
            raise ContractError(f"{name}: __metadata__ must be an object of strings")
        data_len = size - 8 - n
        self._data_start = 8 + n
        self.entries: dict[str, tuple[np.dtype, tuple[int, ...], int, int, str]] = {}
        spans = []
        for tname, info in header.items():
            if not isinstance(info, dict):
                raise ContractError(f"{name}: tensor {tname}: entry is not an object")
            dt = info.get("dtype")
            if dt not in _DTYPES:
                raise ContractError(
                    f"{name}: tensor {tname}: unsupported dtype {dt!r} (F32, BF16, F16)"
                )
            shape = info.get("shape")
            offs = info.get("data_offsets")
            if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
                raise ContractError(f"{name}: tensor {tname}: bad shape {shape!r}")
            if not (
                isinstance(offs, list) and len(offs) == 2 and all(type(o) is int for o in offs)
            ):
                raise ContractError(f"{name}: tensor {tname}: bad data_offsets {offs!r}")
            b, e = offs
            np_dtype, itemsize = _DTYPES[dt]
            want = itemsize
            for s in shape:  # Python ints: no overflow whatever the header claims
                want *= s
            if not (0 <= b <= e <= data_len) or e - b != want:
                raise ContractError(
                    f"{name}: tensor {tname}: data_offsets {offs} do not hold {dt}{shape} "
                    f"within a {data_len}-byte data region"
                )
            spans.append((b, e, tname))
            self.entries[tname] = (np_dtype, tuple(shape), b, e, dt)
        # The data region must be tiled exactly, as the format requires: no overlap, no gap, and
        # no trailing bytes that no tensor covers.
        spans.sort()
        at, prev = 0, None
        for b, e, tname in spans:
            if b < at:
                raise ContractError(f"{name}: tensors {prev} and {tname} overlap")
            if b > at:
                raise ContractError(
                    f"{name}: tensor {tname}: a gap of {b - at} bytes before its data"
                )
            at, prev = e, tname
        if at != data_len:
            raise ContractError(
                f"{name}: {data_len - at} trailing bytes of the data region belong to no tensor"
            )
        # Mapped from the handle read above: the bytes whose header was checked.
        self._map = np.memmap(f, dtype=np.uint8, mode="r") if size > 0 else None

    def stored(self, tname: str) -> np.ndarray:
        """The tensor as stored (a view into the map, no copy)."""
        np_dtype, shape, b, e, _ = self.entries[tname]
        if b == e:
            return np.zeros(shape, dtype=np_dtype)
        buf = self._map[self._data_start + b : self._data_start + e]
        return buf.view(np_dtype).reshape(shape)

    def as_f32(self, tname: str) -> np.ndarray:
        """Widened to f32 exactly (§1)."""
        return widen(self.entries[tname][4], self.stored(tname))


class Checkpoint:
    """All tensors of a model directory: `model.safetensors`, or the shards named by
    `model.safetensors.index.json`; or of a GGUF file (gguf.locate: a `.gguf` path, or a
    directory holding one and no safetensors), under their HF names, dequantized to f32."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._claimed: set[str] = set()
        key = os.path.realpath(model_dir)
        _LOADED.pop(key, None)
        found = gguf.locate(model_dir)
        if found is not None:
            # The GGUF reader maps the path itself: the file it mapped is the one stamped before
            # and after, or the load is refused.
            before = _stamp_path(found)
            g = gguf.GgufWeights(found)
            if _stamp_path(found) != before:
                raise ContractError(f"{found}: the weights file changed while it was loading")
            self._where = dict.fromkeys(g.entries, g)
            _LOADED[key] = [(found, before)]
            return
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self._where: dict[str, SafetensorsFile] = {}
        if os.path.exists(index):
            where = "model.safetensors.index.json"
            try:
                text = jsonfile.read_bytes(index, where)
            except FileNotFoundError:
                raise ContractError(f"{where}: vanished while being read") from None
            idx = jsonfile.loads_unique(text, where)
            weight_map = idx.get("weight_map") if isinstance(idx, dict) else None
            if not isinstance(weight_map, dict):
                raise ContractError("model.safetensors.index.json: no weight_map object")
            files = {}
            for fname in sorted(set(weight_map.values())):
                if (
                    not isinstance(fname, str)
                    or os.path.basename(fname) != fname
                    or not fname.endswith(".safetensors")
                ):
                    raise ContractError(f"model.safetensors.index.json: bad shard name {fname!r}")
                p = os.path.join(model_dir, fname)
                if not os.path.exists(p):
                    raise ContractError(f"model.safetensors.index.json: shard {fname} is missing")
                files[fname] = SafetensorsFile(p)
            for tname, fname in weight_map.items():
                if tname not in files[fname].entries:
                    raise ContractError(
                        f"missing tensor {tname} (index names {fname}, which lacks it)"
                    )
            for fname, sf in files.items():
                for tname in sf.entries:
                    if weight_map.get(tname) != fname:
                        raise ContractError(
                            f"tensor {tname} in {fname} is not listed there by the index"
                        )
                    self._where[tname] = sf
        elif os.path.exists(single):
            files = {"model.safetensors": SafetensorsFile(single)}
            for tname in files["model.safetensors"].entries:
                self._where[tname] = files["model.safetensors"]
        else:
            raise ContractError(
                f"{model_dir}: no model.safetensors or model.safetensors.index.json"
            )
        # As the engine: a safetensors file the checkpoint does not name is refused, not ignored.
        stray = sorted(
            f for f in os.listdir(model_dir) if f.endswith(".safetensors") and f not in files
        )
        if stray:
            raise ContractError(f"{stray[0]}: a safetensors file the checkpoint does not name")
        _LOADED[key] = [(sf.path, sf.stamp) for sf in files.values()]

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The stored shape, without claiming the tensor (to check a config before loading)."""
        sf = self._where.get(name)
        return None if sf is None else sf.entries[name][1]

    def layer_count(self, prefix: str = "model.") -> int:
        """One past the highest N of the `{prefix}layers.N.*` tensors (0: none)."""
        head = prefix.split(".")[:-1] + ["layers"]
        at = len(head)
        ns = [
            p[at]
            for p in (n.split(".") for n in self._where)
            if len(p) > at and p[:at] == head and p[at].isascii() and p[at].isdigit()
        ]
        return max(map(int, ns)) + 1 if ns else 0

    def has(self, name: str) -> bool:
        return name in self._where

    def _claim(self, name: str, shape: tuple[int, ...]):
        """Mark a tensor as used by the model after checking it exists with this shape."""
        sf = self._where.get(name)
        if sf is None:
            raise ContractError(f"missing tensor {name} (expected shape {list(shape)})")
        got = sf.entries[name][1]
        if tuple(got) != tuple(shape):
            raise ContractError(f"tensor {name} has shape {list(got)}, expected {list(shape)}")
        self._claimed.add(name)
        return sf

    def take(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """Claim a tensor, check its shape, return it widened to f32."""
        return self._claim(name, shape).as_f32(name)

    def take_stored(self, name: str, shape: tuple[int, ...]) -> tuple[np.ndarray, str]:
        """Claim a tensor without widening it (the embedding table is widened row by row)."""
        sf = self._claim(name, shape)
        return sf.stored(name), sf.entries[name][4]

    def finish(self, unused_prefixes: tuple[str, ...] = ()) -> dict[str, int]:
        """Refuse the checkpoint if any tensor was not claimed by the model, apart from those
        under `unused_prefixes` (present and unused, §20): returned as {prefix: count} for the
        prefixes that hold any."""
        left = sorted(set(self._where) - self._claimed)
        unused: dict[str, int] = {}
        for prefix in unused_prefixes:
            under = [n for n in left if n.startswith(prefix)]
            if under:
                unused[prefix] = len(under)
                left = [n for n in left if not n.startswith(prefix)]
        if left:
            more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
            raise ContractError(
                f"unclaimed tensor {left[0]}{more}: no module of this model uses it"
            )
        return unused
