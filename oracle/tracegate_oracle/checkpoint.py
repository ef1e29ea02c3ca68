"""What the oracle refuses before transformers builds anything: the model directory, the
safetensors headers and config.json, each refusal one line naming the file and the field.

The engine (engine/src/model/, engine/src/weights.rs) and the contract refuse these inputs;
transformers does not (it hangs building 2^40 layers, divides by zero heads, or computes a NaN
trace from a NaN epsilon), so the oracle checks them first. Pure Python (json, struct): no torch,
so the CLI refuses before the seconds that importing torch takes. Nothing here is model
arithmetic; the model stays transformers' own class.
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tracegate.jsonfile import JsonInputError, read_bytes

from .errors import CheckpointError, OracleError

# Largest safetensors header accepted (real ones are kilobytes), as the engine and contract.
MAX_HEADER_BYTES = 100 << 20

# Bytes per element of every safetensors dtype, so entries of any dtype are bounds-checked.
DTYPE_SIZE = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# Weight files transformers would load instead of (or beside) safetensors, with torch.load or
# another framework. The weights digest covers *.safetensors only, so any of them makes "which
# weights ran" unanswerable: refused.
OTHER_WEIGHTS = re.compile(
    r"^(pytorch_model.*\.bin(\.index\.json)?|tf_model.*\.h5(\.index\.json)?"
    r"|flax_model.*\.msgpack(\.index\.json)?|model\.ckpt.*|.*\.(pt|pth))$"
)

# Config fields that size the model: when present (not null) each must be an integer >= 1
# (engine: req_usize / opt_usize). num_experts may be 0 (every layer dense) and is checked apart.
SIZE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "moe_intermediate_size",
    "decoder_sparse_step",
)

# Weights the oracle loads: floats. transformers would convert an integer or bool tensor into a
# float parameter by value, and F8 needs a quantisation config this oracle does not run.
WEIGHT_DTYPES = ("F64", "F32", "F16", "BF16")

# decoder layers; `model.language_model.layers.N` in a multimodal checkpoint (Qwen3.5),
# `model.decoder.layers.N` in diffusion_gemma (its encoder's layers are tied to them)
LAYER_NAME = re.compile(r"^model\.(?:language_model\.|decoder\.)?layers\.(\d+)\.")
EXPERT_NAME = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Entry:
    file: str
    dtype: str
    shape: tuple[int, ...]


def _unique_object(pairs):
    """json object_pairs_hook: a repeated key is refused (json keeps the last one silently)."""
    seen = {}
    for k, v in pairs:
        if k in seen:
            raise _Duplicate(k)
        seen[k] = v
    return seen


class _Duplicate(ValueError):
    pass


def _load_json(text: str, where: str, what: str):
    try:
        return json.loads(text, object_pairs_hook=_unique_object)
    except _Duplicate as e:
        raise CheckpointError(f"{where}: duplicate {what} {e.args[0]!r}") from None
    except RecursionError:
        raise CheckpointError(f"{where}: JSON nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, and bad UTF-8 surrogates
        raise CheckpointError(f"{where}: not valid JSON: {e}") from None


def _is_int(v) -> bool:
    return type(v) is int  # bool is an int subclass; true is not a size


# ------------------------------------------------------------------------------------ files


def safetensors_files(d: Path, wm: dict[str, str] | None) -> list[Path]:
    """The checkpoint's files, by the engine's rule: exactly the shards the index's weight map
    `wm` names, else (no index) exactly model.safetensors; any other weights file is refused."""
    try:
        names = sorted(p.name for p in d.iterdir())
    except OSError as e:
        raise CheckpointError(f"{d}: cannot list the model directory: {e.strerror}") from None
    other = [n for n in names if OTHER_WEIGHTS.match(n)]
    if other:
        raise CheckpointError(
            f"{d / other[0]}: weights the oracle does not load (safetensors only); "
            "remove it so the weights digest covers every weight in the directory"
        )
    expected = sorted(set(wm.values())) if wm is not None else ["model.safetensors"]
    present = [n for n in names if n.endswith(".safetensors")]
    for n in present:
        if n not in expected:
            raise CheckpointError(
                f"{d / n}: a safetensors file the checkpoint does not name (expected {expected})"
            )
    for n in expected:
        if n not in present:
            raise CheckpointError(f"{d / n}: missing safetensors file")
    return [d / n for n in expected]


def read_json_file(path: Path, absent: str | None = None):
    """The parsed JSON of one regular file of at most MAX_JSON_LEN bytes, no object repeating a
    key, as the engine reads it (trace/src/json.rs; the read is tracegate.jsonfile's): a JSON
    input of the oracle's tools (a policy, a prompt set) or of a checkpoint. `absent` is the
    message when it is missing (default `PATH: missing`)."""
    if absent is None:
        absent = f"{path}: missing"
    try:
        data = read_bytes(path, str(path))
    except FileNotFoundError:
        raise CheckpointError(absent) from None
    except JsonInputError as e:
        raise CheckpointError(str(e)) from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: unreadable: {e}") from None
    return _load_json(text, str(path), "key")


def _index(path: Path) -> dict[str, str]:
    v = read_json_file(path, f"{path}: not a regular file")
    wm = v.get("weight_map") if isinstance(v, dict) else None
    if not isinstance(wm, dict):
        raise CheckpointError(f"{path}: no weight_map object")
    for k, f in wm.items():
        if not isinstance(f, str) or "/" in f or "\\" in f or not f.endswith(".safetensors"):
            raise CheckpointError(
                f"{path}: weight_map[{k}] = {f!r} is not a safetensors file in the directory"
            )
    return wm


def read_header(path: Path) -> dict[str, Entry]:
    """One file's tensors, refused unless the header is a JSON object of unique names whose
    dtype, shape and data_offsets tile the data region exactly (no overlap, gap or trailing byte)."""
    if not path.is_file():  # a FIFO would block the open
        raise CheckpointError(f"{path}: not a regular file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"{path}: {size} bytes, too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(
                    f"{path}: header length {n} exceeds the file ({size} bytes) "
                    f"or the {MAX_HEADER_BYTES}-byte limit"
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(f"{path}: header is not UTF-8: {e}") from None
    header = _load_json(text, f"{path}: header", "tensor name")
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (
        isinstance(meta, dict) and all(isinstance(x, str) for x in meta.values())
    ):
        raise CheckpointError(f"{path}: __metadata__ must be an object of strings")
    data_len = size - 8 - n
    out, spans = {}, []
    for name, info in header.items():
        where = f"{path}: tensor {name}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in DTYPE_SIZE:
            raise CheckpointError(f"{where}: unknown dtype {dt!r}")
        if dt not in WEIGHT_DTYPES:
            raise CheckpointError(
                f"{where}: dtype {dt} is not a float weight ({', '.join(WEIGHT_DTYPES)})"
            )
        if not (isinstance(shape, list) and all(_is_int(s) and s >= 0 for s in shape)):
            raise CheckpointError(
                f"{where}: shape {shape!r} is not a list of non-negative integers"
            )
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
            raise CheckpointError(f"{where}: data_offsets {offs!r} is not [begin, end]")
        b, e = offs
        if not 0 <= b <= e <= data_len:
            raise CheckpointError(
                f"{where}: data_offsets [{b}, {e}] outside the {data_len}-byte data region"
            )
        need = DTYPE_SIZE[dt] * math.prod(shape)  # Python ints: no overflow
        if e - b != need:
            raise CheckpointError(
                f"{where}: shape {shape} of {dt} needs {need} bytes, data_offsets give {e - b}"
            )
        out[name] = Entry(path.name, dt, tuple(shape))
        spans.append((b, e, name))
    pos = 0
    for b, e, name in sorted(spans):
        if b != pos:
            why = "overlaps the previous tensor" if b < pos else f"leaves {b - pos} bytes before it"
            raise CheckpointError(f"{path}: tensor {name}: data range [{b}, {e}] {why}")
        pos = e
    if pos != data_len:
        raise CheckpointError(
            f"{path}: {data_len - pos} trailing bytes of the data region belong to no tensor"
        )
    return out


def inventory(d: Path) -> dict[str, Entry]:
    """Every tensor of the checkpoint by name, each in exactly one file (and where the index says)."""
    index = d / "model.safetensors.index.json"
    wm = _index(index) if index.exists() else None
    out: dict[str, Entry] = {}
    for f in safetensors_files(d, wm):
        for name, entry in read_header(f).items():
            if name in out:
                raise CheckpointError(f"{d}: tensor {name} in both {out[name].file} and {f.name}")
            if wm is not None and wm.get(name) != f.name:
                raise CheckpointError(
                    f"{f}: tensor {name}: the index names {wm.get(name)!r} for it"
                )
            out[name] = entry
    for name, f in (wm or {}).items():
        if name not in out:
            raise CheckpointError(f"{index}: tensor {name} listed for {f} but not in that file")
    return out


# ----------------------------------------------------------------------------------- config


def read_config(d: Path) -> dict:
    path = d / "config.json"
    raw = read_json_file(path, f"--model {d}: no config.json (or not a regular file)")
    if not isinstance(raw, dict):
        raise OracleError(f"{path}: not a JSON object")
    return raw


def _walk(v, at: str = ""):
    """(dotted path, value) of every scalar in a JSON value."""
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _walk(x, f"{at}.{k}" if at else str(k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _walk(x, f"{at}[{i}]")
    else:
        yield at, v


def check_config(raw: dict, inv: dict[str, Entry], path: Path, family=None) -> None:
    """Refuse, naming the field, what the engine refuses and transformers would turn into a hang,
    an exception or a NaN trace; then `family(raw, path)`, the family's own refusals, when given
    (loading.preflight passes diffusion_config.check_config); then every size the checkpoint can
    bound is checked against it."""

    def refuse(msg: str):
        raise OracleError(f"{path}: {msg}")

    for at, v in _walk(raw):
        # json accepts NaN/Infinity; the engine's JSON parser refuses them anywhere.
        if isinstance(v, float) and not math.isfinite(v):
            refuse(f"{at} = {v} is not a finite number")
        if at.split(".")[-1] == "rope_theta" and v is not None:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                refuse(
                    f"{at} = {v!r} is not positive (every RoPE frequency would be NaN or infinite)"
                )
    if family is not None:
        family(raw, path)
    # diffusion_gemma names its top-k field its own way.
    diffusion = raw.get("model_type") == "diffusion_gemma"
    # A multimodal config holds the language model's fields under text_config.
    raw = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    eps = raw.get("rms_norm_eps")
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float))):
        refuse(f"rms_norm_eps = {eps!r} is not a number")
    for key in SIZE_FIELDS:
        v = raw.get(key)
        if v is not None and not (_is_int(v) and v >= 1):
            refuse(f"{key} = {v!r} is not a positive integer")
    # The engine and contract hold positions in [0, 2^24) (f32 represents each exactly).
    v = raw.get("max_position_embeddings")
    if v is not None and v > 1 << 24:
        refuse(f"max_position_embeddings = {v} exceeds the position limit 2^24 = {1 << 24}")
    v = raw.get("vocab_size")
    if v is not None and v < 2:
        refuse(f"vocab_size = {v} (argmax margins need at least 2)")
    heads, kv = raw.get("num_attention_heads"), raw.get("num_key_value_heads")
    if heads is not None and kv is not None and heads % kv:
        refuse(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    hd = raw.get("head_dim")
    if hd is not None and hd % 2:
        refuse(f"head_dim = {hd} is odd (RoPE rotates pairs)")
    for key in ("num_experts", "num_local_experts"):
        ne = raw.get(key)
        if ne is None:
            continue
        if not (_is_int(ne) and ne >= 0):
            refuse(f"{key} = {ne!r} is not a non-negative integer")
        kname = "top_k_experts" if diffusion else "num_experts_per_tok"
        k = raw.get(kname)
        if ne > 0 and not (_is_int(k) and 1 <= k < ne):
            refuse(f"{kname} = {k!r} not supported with {key} = {ne} (need 1 <= k < {key})")

    # Sizes against the checkpoint, before any module exists: transformers builds every layer and
    # expert the config declares before it looks at a weight.
    n = raw.get("num_hidden_layers")
    have = sorted({int(m.group(1)) for name in inv if (m := LAYER_NAME.match(name))})
    if n is not None and (
        len(have) != n or have != list(range(len(have)))
    ):  # never range(n): n may be 2^62
        got = (
            f"layers {have[0]}..{have[-1]} ({len(have)} distinct)"
            if have
            else "no model.layers.N tensors"
        )
        refuse(f"num_hidden_layers = {n} but the checkpoint holds {got}")
    experts = {int(m.group(1)) for name in inv if (m := EXPERT_NAME.search(name))}
    fused = [
        e.shape[0]
        for name, e in inv.items()
        if ".experts." in name and not EXPERT_NAME.search(name) and e.shape
    ]
    held = max(experts) + 1 if experts else max(fused, default=0)
    for key in ("num_experts", "num_local_experts"):
        ne = raw.get(key)
        if ne is not None and ne > held:
            refuse(f"{key} = {ne} but the checkpoint holds {held} experts")


# ---------------------------------------------------------------------------------- progress

# From this many bytes of weights a load takes seconds (read, convert, place), so the oracle says
# each phase on stderr as it starts: a log shows where a large model's minutes go. Smaller models
# say nothing, so a refused load of one stays the one line a refusal is.
LOAD_PROGRESS_BYTES = 256 << 20


def weight_bytes(inv: dict[str, Entry]) -> int:
    """The bytes the checkpoint's tensors occupy on disk."""
    return sum(DTYPE_SIZE[e.dtype] * math.prod(e.shape) for e in inv.values())


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} bytes"


class LoadProgress:
    """One stderr line per loading phase (config, weights with their size, device placement),
    `[oracle] loading DIR: PHASE: DETAIL`, for a checkpoint of at least LOAD_PROGRESS_BYTES.
    Lines, never a bar: transformers' own bars stay off (loading.py disables them), so a
    CI log gets no carriage-return spam. stdout and the trace are unchanged."""

    def __init__(self, d: Path, inv: dict[str, Entry]):
        self.d, self.inv = d, inv
        self.bytes = weight_bytes(inv)
        self.on = self.bytes >= LOAD_PROGRESS_BYTES

    def _say(self, phase: str, detail: str) -> None:
        if self.on:
            print(f"[oracle] loading {self.d}: {phase}: {detail}", file=sys.stderr, flush=True)

    def config(self, cfg) -> None:
        layers = getattr(cfg, "num_hidden_layers", None)
        self._say("config", f"{cfg.model_type}, {layers} layers, shapes checked on the meta device")

    def weights(self, dtype: str) -> None:
        files = len({e.file for e in self.inv.values()})
        self._say(
            "weights",
            f"{_size(self.bytes)} in {files} safetensors file{'s' if files != 1 else ''} "
            f"({len(self.inv)} tensors), loading as {dtype}",
        )

    def placement(self, model, device: str) -> None:
        """Where transformers/accelerate put the modules (a device map), else `device`."""
        dm = getattr(model, "hf_device_map", None)
        if dm:
            where = ", ".join(
                f"{d} ({n} modules)" for d, n in Counter(map(str, dm.values())).items()
            )
            self._say("placement", f"device map: {where}")
        else:
            self._say("placement", f"every module on {device}")
