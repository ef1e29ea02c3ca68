"""Run transformers' own model classes and record what they computed.

Everything numeric here is done by transformers/torch; this module only
  * loads the checkpoint strictly (a missing, unexpected or mismatched tensor is an error),
  * pins the run (threads, seed, deterministic algorithms, no autocast, no TF32),
  * observes the shared capture points with hooks that are always removed afterwards,
  * records each router's decision as the experts its own `torch.topk` chose (at an exact tie
    that may be another index than the lowest), and turns the model's output logits into
    decisions with the shared tie rule (descending value, lowest index first), each with its
    margin.

A capture is built in memory (`Capture`) and written with `write_trace`, so tests can inspect
numbers without the trace binding and the binding stays the only writer of the format.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import platform
import random
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tracegate import names

from . import gguf_source
from .checkpoint import LoadProgress, preflight
from .errors import CheckpointError, OracleError  # noqa: F401 (re-exported)
from .families import FAMILIES, resolve
from .force import Forcing, RouterForcing, forced_answer, intercept_topk, shadow_forward
from .linear_attn import LinearTap, active_paths, torch_paths
from .linear_attn import provenance as linear_provenance

TORCH_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}


@dataclass
class RunConfig:
    device: str = "cpu"
    dtype: str = "f32"  # f32 | bf16 | f16
    threads: int = 1
    seed: int = 0
    capture: str = "default"  # default | internals
    cache: str = "on"  # generation with the model's KV cache (on) or full recompute (off)
    generate: int = 0
    # --device-map auto: transformers/accelerate place the modules over the visible GPUs (and, when
    # --max-memory leaves too little GPU memory, keep some in CPU memory: accelerate's offload).
    device_map: str | None = None
    max_memory: dict | None = None  # accelerate's max_memory: {GPU index or "cpu": size}
    # --distributed tp=N|ep=N (distributed.Spec): this process is one rank of transformers' own
    # tensor / expert parallel run (from_pretrained(distributed_config=...)).
    distributed: object | None = None


@dataclass
class Record:
    name: str
    array: np.ndarray  # bf16 as uint16 bit patterns, with dtype="bf16"
    dtype: str | None
    attrs: dict


@dataclass
class Decision:
    name: str
    values: np.ndarray  # int64
    margins: np.ndarray | None  # float32, one per row


@dataclass
class Capture:
    tensors: list[Record] = field(default_factory=list)
    decisions: list[Decision] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self.tensors]

    def __getitem__(self, name: str) -> Record:
        for r in self.tensors:
            if r.name == name:
                return r
        raise KeyError(name)

    def decision(self, name: str) -> Decision:
        for d in self.decisions:
            if d.name == name:
                return d
        raise KeyError(name)


# ---------------------------------------------------------------------------------------------
# run set-up and loading


def check_device_map(rc: RunConfig) -> None:
    """--device-map / --max-memory combinations that mean nothing, refused before torch is imported."""
    if rc.max_memory is not None and rc.device_map is None:
        raise OracleError("--max-memory: only with --device-map auto")
    if rc.device_map is not None and rc.device_map != "auto":
        raise OracleError(f"--device-map {rc.device_map!r}: expected auto")
    if rc.device_map is not None and rc.device != "cuda":
        # On CPU there is nothing to spread: transformers would load it as plain --device cpu does.
        raise OracleError(
            f"--device-map auto: needs --device cuda (it spreads the model over the visible GPUs), "
            f"not --device {rc.device}"
        )


def setup_torch(rc: RunConfig) -> dict:
    """Pin the run; returns the determinism record for provenance."""
    check_device_map(rc)
    if rc.device == "cuda":
        # cuBLAS is only deterministic with a fixed workspace, and it must be set before init.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch

    if rc.device == "cuda":
        if not torch.cuda.is_available():
            raise OracleError(
                "--device cuda: CUDA is not available in this torch build / machine"
                + (" (--device-map auto needs visible GPUs)" if rc.device_map else "")
            )
        bad = [k for k in rc.max_memory or {} if k != "cpu" and not k < torch.cuda.device_count()]
        if bad:
            raise OracleError(
                f"--max-memory: GPU {bad[0]} is not visible ({torch.cuda.device_count()} visible: "
                f"0..{torch.cuda.device_count() - 1})"
            )
        # TF32 would silently round fp32 matmul inputs to 10 mantissa bits.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    elif rc.device != "cpu":
        raise OracleError(f"--device {rc.device!r}: expected cpu or cuda")
    if rc.dtype not in TORCH_DTYPES:
        raise OracleError(f"--dtype {rc.dtype!r}: expected one of {', '.join(TORCH_DTYPES)}")
    if rc.threads < 1:
        raise OracleError(f"--threads {rc.threads}: must be >= 1")
    torch.set_float32_matmul_precision("highest")
    torch.set_num_threads(rc.threads)
    with contextlib.suppress(RuntimeError):  # can only be set once per process
        torch.set_num_interop_threads(1)
    torch.manual_seed(rc.seed)
    random.seed(rc.seed)
    np.random.seed(rc.seed % 2**32)
    det = {"use_deterministic_algorithms": True, "warn_only": False, "refusals": []}
    try:
        torch.use_deterministic_algorithms(True)
    except Exception as e:  # record, do not hide: the trace says it was not deterministic
        det["use_deterministic_algorithms"] = False
        det["refusals"].append(f"use_deterministic_algorithms(True): {e}")
    det["cudnn_deterministic"] = bool(torch.backends.cudnn.deterministic)
    det["cudnn_benchmark"] = bool(torch.backends.cudnn.benchmark)
    det["float32_matmul_precision"] = torch.get_float32_matmul_precision()
    det["autocast"] = False
    if rc.device == "cuda":
        det["CUBLAS_WORKSPACE_CONFIG"] = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    return det


def _deterministic(fn, det: dict):
    """Run fn under strict determinism; if an op refuses, record it and re-run with warn_only."""
    import torch

    try:
        return fn()
    except RuntimeError as e:
        if "deterministic" not in str(e):
            raise
        det["refusals"].append(str(e).splitlines()[0])
    torch.use_deterministic_algorithms(True, warn_only=True)
    det["warn_only"] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    det["refusals"] += sorted(
        {str(w.message).splitlines()[0] for w in caught if "deterministic" in str(w.message)}
    )
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def _transformers_log():
    """Hold transformers' log records during a load: its load report is a multi-line table, and a
    refusal must be one line. A load that is accepted replays them (`_replay`)."""
    import logging

    root = logging.getLogger("transformers")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    saved = root.handlers[:], root.propagate
    root.handlers, root.propagate = [Keep(logging.WARNING)], False
    try:
        yield records
    finally:
        root.handlers, root.propagate = saved


def _replay(records) -> None:
    import logging

    for r in records:
        logging.getLogger("transformers").handle(r)


def _report_rows(records) -> list[str]:
    """`key: details` of the MISMATCH / CONVERSION rows of transformers' load report."""
    rows = []
    for r in records:
        for line in re.sub(r"\x1b\[[0-9;]*m", "", r.getMessage()).splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 3 and cells[1] in ("MISMATCH", "CONVERSION"):
                rows.append(f"{cells[0]}: {' '.join(' '.join(cells[2:]).split())}")
    return rows


def _check_shapes_on_meta(d: Path, cfg, inv, auto) -> None:
    """Build transformers' own class on the meta device (shapes, no storage; the layer and expert
    counts are already bounded by the checkpoint) and compare every parameter the checkpoint
    names alike. A size from config.json that disagrees is refused here, before anything is
    allocated; names transformers converts on load (fused experts) are left to its loader."""
    import torch

    try:
        with torch.device("meta"):
            skel = auto.from_config(
                cfg, attn_implementation="eager", experts_implementation="eager"
            )
    except Exception as e:  # any failure here comes from config.json's values
        raise OracleError(
            f"{d / 'config.json'}: transformers cannot build {cfg.architectures or cfg.model_type} "
            f"from it: {type(e).__name__}: {_one_line(e)}"
        ) from None
    archs = getattr(cfg, "architectures", None)
    if archs and type(skel).__name__ not in archs:
        raise OracleError(
            f"{d / 'config.json'}: architectures = {archs}, but model_type {cfg.model_type!r} "
            f"makes transformers build {type(skel).__name__}"
        )
    for name, t in skel.state_dict().items():
        e = inv.get(name)
        if e is not None and tuple(t.shape) != e.shape:
            raise CheckpointError(
                f"{d / e.file}: tensor {name} has shape {list(e.shape)}, but config.json gives "
                f"{type(skel).__name__} {list(t.shape)}"
            )


def load_model(model_dir: str | os.PathLike, rc: RunConfig):
    """Load with transformers' own classes; refuse anything but a clean one-to-one load."""
    import torch
    import transformers
    from transformers import AutoConfig

    d = Path(model_dir)
    found = gguf_source.locate(d)
    if found is not None:
        return _load_gguf(found, rc)
    inv = preflight(d)
    from . import diffusion_gemma

    if diffusion_gemma.is_diffusion(d):  # not a causal LM: its own loader (no family table entry)
        return diffusion_gemma.load_model(d, rc, inv)
    progress = LoadProgress(d, inv)
    transformers.utils.logging.disable_progress_bar()
    with _transformers_log() as log:
        try:
            cfg = AutoConfig.from_pretrained(d)
        except Exception as e:
            raise OracleError(
                f"--model {d}: config.json not understood by transformers: {_one_line(e)}"
            ) from None
        # The class config.json's architectures names (ForConditionalGeneration for a multimodal
        # layout, run on text only); a family outside the table is refused by resolve() below.
        spec = FAMILIES.get(getattr(cfg, "model_type", None))
        auto = getattr(transformers, spec.auto if spec else "AutoModelForCausalLM")
        _check_shapes_on_meta(d, cfg, inv, auto)
    progress.config(cfg)
    placement = _placement(rc)
    if rc.distributed is not None:
        from . import distributed

        placement = {"distributed_config": distributed.config(rc.distributed)}
    progress.weights(rc.dtype)
    try:
        with _transformers_log() as load_log:
            model, info = auto.from_pretrained(
                d,
                dtype=getattr(torch, TORCH_DTYPES[rc.dtype]),
                attn_implementation="eager",
                # transformers 5 defaults MoE experts to grouped_mm; eager is the plain per-expert loop.
                experts_implementation="eager",
                # Never torch.load: the weights digest covers the safetensors files only.
                use_safetensors=True,
                output_loading_info=True,
                **placement,
            )
    except (OSError, ValueError, RuntimeError) as e:
        if rc.distributed is not None and "_plan`" in str(e):
            # transformers' refusal of a model it has no tensor / expert parallel plan for
            raise OracleError(
                f"--distributed {rc.distributed}: transformers cannot shard "
                f"{(cfg.architectures or [cfg.model_type])[0]} ({cfg.model_type}): {_one_line(e)}"
            ) from None
        rows = _report_rows(load_log)
        detail = (
            "; ".join(rows[:3]) + (f" (+{len(rows) - 3} more)" if len(rows) > 3 else "")
            if rows
            else _one_line(e)
        )
        raise CheckpointError(f"--model {d}: transformers could not load it: {detail}") from None
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        # Random init of a missing tensor, or a silently dropped extra one, would make a trace of
        # a model nobody has: refuse instead (docs/traps.md, trap 14).
        detail = "; ".join(
            f"{k}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in problems.items()
        )
        raise CheckpointError(
            f"--model {d}: checkpoint does not match {type(model).__name__}: {detail}"
        )
    # the family table: refused here unless every capture point is found
    lay = resolve(model, f"--model {d}")
    # Present, not computed with: listed in provenance as {prefix: count} (as engine and
    # contract do), never dropped silently (transformers ignores `mtp.*` on load unreported).
    counts = {p: sum(n.startswith(p) for n in inv) for p in lay.spec.unused_prefixes}
    model.tracegate_unused_tensors = {p: n for p, n in counts.items() if n}
    _check_tied_head(model, d)
    _replay(log + load_log)
    progress.placement(model, rc.device)
    # A dispatched model stays where accelerate put it (transformers refuses .to() on an offloaded one).
    return (model if rc.device_map else model.to(rc.device)).eval()


def _load_gguf(path: Path, rc: RunConfig):
    """A GGUF checkpoint (gguf_source): transformers' class on the file's dequantized tensors,
    then the family table's check that every capture point is found."""
    import torch
    import transformers

    if rc.device_map is not None:
        raise OracleError(f"--model {path}: --device-map is not supported for a GGUF checkpoint")
    transformers.utils.logging.disable_progress_bar()
    src = gguf_source.read(path)
    spec = FAMILIES.get(src.config.get("model_type"))
    auto = getattr(transformers, spec.auto if spec else "AutoModelForCausalLM")
    with _transformers_log() as log:
        model = gguf_source.load(src, auto, getattr(torch, TORCH_DTYPES[rc.dtype]), rc.device)
    resolve(model, f"--model {path}")
    model.tracegate_unused_tensors = {}
    _replay(log)
    return model


def _placement(rc: RunConfig) -> dict:
    """from_pretrained's device_map / max_memory for --device-map auto (sizes read by accelerate)."""
    if rc.device_map is None:
        return {}
    try:
        from accelerate.utils import convert_file_size_to_int
    except ImportError:
        raise OracleError(
            "--device-map auto: needs the `accelerate` package (requirements.txt)"
        ) from None
    if rc.max_memory is None:
        return {"device_map": rc.device_map}
    sizes = {}
    for k, v in rc.max_memory.items():
        try:
            sizes[k] = convert_file_size_to_int(int(v) if v.isdigit() else v)
        except ValueError:
            raise OracleError(
                f"--max-memory {k}={v}: not a size accelerate reads (bytes, or e.g. 70GiB, 500MB)"
            ) from None
    return {"device_map": rc.device_map, "max_memory": sizes}


def _device_map_provenance(model, rc: RunConfig) -> dict:
    """Where transformers/accelerate put each module, and where each computes (accelerate's hook
    moves a cpu-placed module's weights to its execution device for every forward)."""
    import torch

    placed = getattr(model, "hf_device_map", None)
    if placed is not None:
        modules, source = dict(placed), "model.hf_device_map"
    else:
        # A map of one device: transformers loads there and dispatches nothing (no hf_device_map).
        devs = sorted(
            {
                (p.device.index if p.device.type == "cuda" else p.device.type)
                for p in model.parameters()
            },
            key=str,
        )
        modules, source = (
            {"": devs[0] if len(devs) == 1 else [str(d) for d in devs]},
            "parameter devices (one device: no dispatch)",
        )
    computed_on = {}
    for name in modules:
        hook = getattr(model.get_submodule(name), "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):  # accelerate's SequentialHook holds several
            d = getattr(h, "execution_device", None)
            if d is not None:
                computed_on[name] = f"cuda:{d}" if isinstance(d, int) else str(d)
    devices = {}
    for d in sorted({v for v in modules.values() if not isinstance(v, list)}, key=str):
        if isinstance(d, int):
            devices[f"cuda:{d}"] = torch.cuda.get_device_name(d)
        else:
            devices[str(d)] = (platform.processor() or platform.machine()) if d == "cpu" else str(d)
    return {
        "requested": rc.device_map,
        "max_memory": rc.max_memory and {str(k): v for k, v in rc.max_memory.items()},
        "modules": modules,
        "reported_by": source,
        "computed_on": computed_on,
        "devices": devices,
        "visible_gpus": torch.cuda.device_count(),
    }


def execution_device(module, rc: RunConfig):
    """Where `module` computes, so its inputs are sent there: accelerate's hook's execution device
    under --device-map auto, else the device of its weights, else --device. Sending token ids to
    plain `cuda` (GPU 0) fails when accelerate puts the whole model on GPU 1: a map of one device
    dispatches nothing, so no hook moves them."""
    import torch

    d = getattr(getattr(module, "_hf_hook", None), "execution_device", None)
    if d is not None:
        return torch.device("cuda", d) if isinstance(d, int) else torch.device(d)
    p = next(module.parameters(), None)
    return p.device if p is not None and p.device.type != "meta" else torch.device(rc.device)


def _check_tied_head(model, d: Path) -> None:
    """A checkpoint with tie_word_embeddings=true and its own, different lm_head.weight is not
    reported by transformers as unexpected: 5.23 silently un-ties and uses it (warning only), so
    the model no longer is what config.json declares. Refuse; an equal redundant copy (some real
    checkpoints ship one) is fine."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, emb = model.lm_head.weight, model.get_input_embeddings().weight
    if head is emb or (head.shape == emb.shape and bool((head == emb).all())):
        return
    raise CheckpointError(
        f"--model {d}: config says tie_word_embeddings=true but the checkpoint's lm_head.weight differs from "
        "model.embed_tokens.weight (transformers would silently use the untied head)"
    )


def _weights_digest(model_dir: Path) -> str | None:
    """tracegate.weights_digest (which refuses a weights file that is not a regular file, a FIFO
    or /dev/zero, before opening it), its refusal a CheckpointError: one line, exit 2."""
    try:
        import tracegate

        digest = tracegate.weights_digest
    except (ImportError, AttributeError):
        digest = None
    if digest is not None:
        try:
            return digest(str(model_dir))
        except tracegate.TraceError as e:
            raise CheckpointError(f"--model: {e}") from None
    try:  # same definition as the binding: xxh3-128 over the files' bytes, sorted by name
        import xxhash
    except ImportError:
        return None
    h = xxhash.xxh3_128()
    for f in sorted(Path(model_dir).glob("*.safetensors"), key=lambda p: p.name):
        if not f.is_file():  # looked at first: opening a FIFO blocks, /dev/zero never ends
            raise CheckpointError(f"{f}: not a regular file: a weights file must be one")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def _version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _build_id() -> str:
    """Digest of this package's sources: a trace from edited oracle code is distinguishable."""
    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return "oracle-src-" + h.hexdigest()[:16]


def versions_record() -> dict:
    """The stack's versions, as every oracle trace records them."""
    import torch
    import transformers

    try:
        import tracegate

        tg_version = getattr(tracegate, "__version__", "unknown")
    except ImportError:
        tg_version = None
    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "tracegate": tg_version,
        "safetensors": _version_of("safetensors"),
    }


def device_record(rc: RunConfig) -> dict:
    """The device the run computed on, with what decides its arithmetic (TF32, MKLDNN)."""
    import torch

    dev = {"type": rc.device}
    if rc.device == "cuda":
        dev.update(
            name=torch.cuda.get_device_name(),
            capability=".".join(map(str, torch.cuda.get_device_capability())),
            cuda=torch.version.cuda,
            cudnn=torch.backends.cudnn.version(),
            tf32_matmul=torch.backends.cuda.matmul.allow_tf32,
            tf32_cudnn=torch.backends.cudnn.allow_tf32,
        )
    else:
        dev.update(
            name=platform.processor() or platform.machine(),
            mkldnn=torch.backends.mkldnn.is_available(),
        )
    return dev


def provenance(model, model_dir, rc: RunConfig, det: dict, tokens, verb: str) -> dict:
    dev = device_record(rc)
    cfg = model.config
    lay = resolve(model)
    is_moe = bool(lay.moe_layers)
    return {
        "producer": "oracle",
        "verb": verb,
        "versions": versions_record(),
        "device": dev,
        **({"device_map": _device_map_provenance(model, rc)} if rc.device_map is not None else {}),
        "dtype": rc.dtype,
        "threads": rc.threads,
        "seed": rc.seed,
        "deterministic": det,
        "attn_implementation": cfg._attn_implementation,
        "experts_implementation": cfg._experts_implementation if is_moe else None,
        "model_class": type(model).__name__,
        **(
            {"unused_tensors": model.tracegate_unused_tensors}
            if getattr(model, "tracegate_unused_tensors", None)
            else {}
        ),
        **({"linear_attention": linear_provenance(lay)} if lay.linear_layers else {}),
        # What this family computes differently (masks per layer, softcaps, embedding scale, tied head).
        "family": lay.provenance(),
        "model": str(model_dir),
        "model_abspath": str(Path(model_dir).resolve()),
        # The digest of the weights this model was loaded from, where the loader recorded it
        # (cli._load keys its served models on it); else the directory's, now.
        "weights_digest": getattr(model, "tracegate_weights_digest", None)
        or _weights_digest(Path(model_dir)),
        "prompt_tokens": [int(t) for t in tokens] if tokens is not None else None,
        "capture": rc.capture,
        "cache": rc.cache,
        "generate": rc.generate,
        "command": command_record(),
        "build_id": _build_id(),
    }


def command_record() -> list[str]:
    """The command line, as it can be re-run: under -m, sys.argv[0] is __main__.py's path."""
    return (
        [sys.executable, "-m", "tracegate_oracle", *sys.argv[1:]]
        if sys.argv and sys.argv[0].endswith("__main__.py")
        else list(sys.argv)
    )


# ---------------------------------------------------------------------------------------------
# decisions (tie rule: descending value, lowest index first)


def ranked(x: np.ndarray) -> np.ndarray:
    """Indices of each row by descending value, ties to the lowest index (stable sort)."""
    return np.argsort(-x, axis=-1, kind="stable")


def _no_nan(name: str, x: np.ndarray) -> None:
    """A NaN logit or probability is an error naming the row, never a decision
    (docs/capture-points.md), as in the engine and the contract."""
    bad = np.nonzero(np.isnan(x).any(axis=-1))[0]
    if bad.size:
        raise OracleError(f"{name}: NaN in row {int(bad[0])}")


def argmax_decision(name: str, logits: np.ndarray) -> Decision:
    x = np.asarray(logits, dtype=np.float32).reshape(-1, logits.shape[-1])
    _no_nan(name, x)
    order = ranked(x)
    rows = np.arange(x.shape[0])
    margins = (x[rows, order[:, 0]] - x[rows, order[:, 1]]).astype(np.float32)
    return Decision(name, order[:, 0].astype(np.int64), margins)


def topk_decision(name: str, probs: np.ndarray, k: int) -> Decision:
    p = np.asarray(probs, dtype=np.float32)
    _no_nan(name, p)
    order = ranked(p)
    rows = np.arange(p.shape[0])
    margins = (p[rows, order[:, k - 1]] - p[rows, order[:, k]]).astype(np.float32)
    return Decision(name, order[:, :k].astype(np.int64), margins)


def margin_of(row: np.ndarray, chosen) -> np.float32:
    """The model's margin for a given choice (docs/producers.md, forced decisions): the value of
    the chosen index last in the tie rule's order ⊖ that of the unchosen index first in it. For
    the model's own choice it is the margin above; negative where it ranks an unchosen higher."""
    order = [int(i) for i in ranked(np.asarray(row, dtype=np.float32)[None])[0]]
    chosen = [int(c) for c in chosen]
    weakest = max(chosen, key=order.index)
    strongest = next(i for i in order if i not in chosen)
    return np.float32(row[weakest] - row[strongest])


def force_decision(
    d: Decision, scores: np.ndarray, forced: np.ndarray | None, rows: list[int]
) -> tuple[Decision, list[int]]:
    """Decision `d` (the model's own, from `scores`) with row r replaced by forced row rows[r]
    where the forcing trace holds it; margins the model's own for the forced choice. Returns the
    decision written and the rows (ascending) the model would have decided otherwise."""
    if forced is None:
        return d, []
    values, margins, overridden = d.values.copy(), d.margins.copy(), []
    x = np.asarray(scores, dtype=np.float32).reshape(len(values), -1)
    for r, i in enumerate(rows):
        if i < len(forced):
            f = forced[i].reshape(-1)
            if not np.array_equal(f, values[r].reshape(-1)):
                overridden.append(r)
            margins[r] = margin_of(x[r], f)
            values[r] = forced[i]
    return Decision(d.name, values, margins), overridden


# ---------------------------------------------------------------------------------------------
# hooks


def to_numpy(t) -> tuple[np.ndarray, str | None]:
    """A torch tensor as stored: f32/f16/f64 natively, bf16 as its uint16 bit patterns."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy(), "bf16"
    return t.numpy().copy(), None


def _expert_tap_class():
    import torch
    from torch.overrides import TorchFunctionMode

    linear = torch.nn.functional.linear

    def slice_index(w, p):
        """Which p[e] the tensor w is (a view of the stacked expert parameter), or None."""
        if w.dim() != p.dim() - 1 or tuple(w.shape) != tuple(p.shape[1:]):
            return None
        if w.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            return None
        return (w.storage_offset() - p.storage_offset()) // p.stride(0)

    class ExpertTap(TorchFunctionMode):
        """Observes transformers' eager experts loop: for each expert, the rows it received
        (from its `torch.where`) and the output of its down projection, before the routing
        weight is applied. It computes nothing itself."""

        def __init__(self, experts):
            super().__init__()
            self.experts = experts
            self.token_idx = None
            self.outs: dict[int, tuple] = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is torch.where and len(args) == 1 and not kwargs:
                self.token_idx = out[1]
            elif func is linear:
                # Looked up at each call: accelerate's offload hook (--device-map auto, a module kept
                # in CPU memory) puts the parameter in place only once the experts' forward runs.
                e = slice_index(
                    args[1] if len(args) > 1 else kwargs["weight"], self.experts.down_proj
                )
                if e is not None:
                    self.outs[int(e)] = (self.token_idx, out)
            return out

    return ExpertTap


class Tap:
    """Hooks at the capture points of `layers` (and, for a whole run, embed/final norm/logits).

    Records in execution order, which is the shared capture order. All hooks and patches are
    removed on exit, also when the forward raised.

    `decode=True` taps one decode step (docs/producers.md, decode steps): only the last row of
    each point (the step's row, whether the forward ran one row on the cache or recomputed the
    whole sequence), names under `decode.SSSS.` for `step` S, no embedding, no internals and
    no router decisions; `final_norm.out` only with layers; the logits always (when `whole`).
    """

    def __init__(
        self,
        model,
        *,
        path: str,
        positions: list[int],
        layers,
        internals: bool,
        whole: bool,
        forcing=None,
        decode: bool = False,
        step: int | None = None,
        sharding=None,
    ):
        self.model, self.path, self.positions = model, path, list(positions)
        # --distributed: each record says what part of the logical tensor this rank holds.
        self.sharding = sharding
        self.lay = resolve(model)
        self.layers, self.internals, self.whole = list(layers), internals and not decode, whole
        self.decode, self.step = decode, step
        self.records: list[Record] = []
        self.decisions: list[Decision] = []
        self.notes: list[str] = []
        self._handles = []
        self._undo = []
        self._gates: dict = {}  # layer -> its attn_gate, until _patch_attention records it
        # --force-decisions: (name, the rows overridden) per forced decision; tensors recorded
        # after the first carry `forced = <the forcing trace's digest>`.
        self.forcing = forcing
        self.forced: list[tuple[str, list[int]]] = []

    # -- recording
    def add(self, name: str, t, positions=None, layer_idx=None):
        if names.point(name) is None:
            # A hook for a point the registry does not know: every other tool would guess its
            # layout and policy, so it is refused here, where it was added.
            raise OracleError(
                f"capture point {name!r} is not in the capture-point registry "
                "(tracegate_trace::names::POINTS, trace/src/names.rs): register it there first"
            )
        arr, dt = to_numpy(t[-1:] if self.decode else t)
        attrs = {
            "path": self.path,
            "mask": self.lay.mask(layer_idx),
            "positions": list(positions or self.positions),
        }
        # A decode step of `trace` comes after its forced logits.argmax (the first forced decision).
        if self.forced or (self.decode and self.forcing is not None and self.whole):
            attrs["forced"] = self.forcing.digest
        if self.sharding is not None:
            attrs["shard"] = self.sharding.kind(name, layer_idx)
        if self.step is not None:
            name = names.decode(self.step, name)
        self.records.append(Record(name, arr, dt, attrs))

    def decide(self, d: Decision, scores: np.ndarray, rows: list[int]) -> None:
        """Record decision `d`, forced when a forcing trace is given."""
        if self.forcing is None:
            self.decisions.append(d)
            return
        d, overridden = force_decision(d, scores, self.forcing.values(d.name), rows)
        self.decisions.append(d)
        self.forced.append((d.name, overridden))

    # -- hook installation
    def __enter__(self):
        import torch

        lay = self.lay
        try:
            if self.whole and not self.decode:
                self._hook(lay.embed, lambda mod, a, out: self.add("embed.out", out[0]))
            for L in self.layers:
                self._hook_layer(L, lay.layers[L])
            if self.whole and (self.layers or not self.decode):
                self._hook(lay.final_norm, lambda mod, a, out: self.add("final_norm.out", out[0]))
            if self.whole:
                # The model's output logits, not the head's: a final softcap (Gemma) comes after it.
                self._hook(self.model, self._on_logits)
            if self.internals:
                self._patch_attention()
        except BaseException:
            self.close()
            raise
        self._grad = torch.no_grad()
        self._grad.__enter__()
        return self

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self.close()
        return False

    def close(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _hook(self, module, fn, pre=False):
        h = (
            module.register_forward_pre_hook(fn, with_kwargs=True)
            if pre
            else module.register_forward_hook(fn)
        )
        self._handles.append(h)

    def _hook_layer(self, L: int, layer):
        def hidden_in(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.add(names.layer(L, "hidden_in"), x[0], layer_idx=L)

        self._hook(layer, hidden_in, pre=True)
        lay = self.lay
        if self.internals and L in lay.linear_layers:
            self._tap_linear(L, lay.attn(L))
        if self.internals and lay.spec.attn_gate and L not in lay.linear_layers:
            self._tap_attn_gate(L, lay.attn(L))

        def attn_out(mod, a, out):  # self-attention returns (output, weights); linear, the output
            self.add(
                names.layer(L, "attn_out"),
                (out[0] if isinstance(out, tuple) else out)[0],
                layer_idx=L,
            )

        self._hook(lay.attn(L), attn_out)
        mlp = lay.mlp(L)
        if L in lay.moe_layers and not self.decode:
            self._tap_router(L, lay.router(L))
            if self.internals:
                self._tap_experts(L, lay.experts(L))
                if lay.shared_expert(L):
                    self._tap_shared_expert(L, *lay.shared_expert(L))
        self._hook(
            mlp, lambda mod, a, out: self.add(names.layer(L, "mlp_out"), out[0], layer_idx=L)
        )

        def hidden_out(mod, args, out):
            self.add(
                names.layer(L, "hidden_out"),
                (out[0] if isinstance(out, tuple) else out)[0],
                layer_idx=L,
            )

        self._hook(layer, hidden_out)

    def _tap_linear(self, L: int, module):
        """Layer L's Gated DeltaNet internals (linear_attn.LinearTap), recorded before attn_out."""
        paths = active_paths()
        if paths is None:
            raise RuntimeError("linear-attention internals need the torch paths (TorchPaths)")
        taps: list[LinearTap] = []

        def pre(mod, args, kwargs):
            taps.append(LinearTap(mod))
            paths.observer = taps[-1]

        def post(mod, args, out):
            paths.observer = None
            for name, t in taps.pop().records():
                # the state is after the call's last row: that row's position
                pos = self.positions[-1:] if name == "linear.state" else None
                self.add(names.layer(L, name), t, pos, L)

        self._hook(module, pre, pre=True)
        self._hook(module.norm, lambda mod, a, out: taps[-1].norm_out(out))
        self._hook(module, post)
        self._undo.append(lambda: setattr(paths, "observer", None))

    def _tap_attn_gate(self, L: int, attn):
        """The gate half of q_proj's output, per head `[rows, heads, head_dim]` before the
        sigmoid (Qwen3.5: q_proj's output is, per head, head_dim query then head_dim gate
        values); recorded after v by _patch_attention."""
        hd = attn.head_dim

        def hook(mod, a, out):
            self._gates[L] = out[0].view(out.shape[1], -1, 2 * hd)[..., hd:]

        self._hook(attn.q_proj, hook)

    def _tap_shared_expert(self, L: int, shared, shared_gate):
        """`shared_expert.gate` [rows, 1] (the gate logit, before the sigmoid), then
        `shared_expert.out` [rows, hidden] (the shared MLP, before its gate). transformers runs
        the shared MLP first and its gate after the routed experts; the output is held until the
        gate is recorded, so the trace order is router, experts, gate, output."""
        held = []
        self._hook(shared, lambda mod, a, out: held.append(out))

        def gate(mod, a, out):
            self.add(names.layer(L, "shared_expert.gate"), out, layer_idx=L)
            self.add(names.layer(L, "shared_expert.out"), held.pop(), layer_idx=L)

        self._hook(shared_gate, gate)

    def _tap_router(self, L: int, router):
        """Layer L's router, through its one `torch.topk` call (force.intercept_topk): the
        decision is the experts that call chose, and under --force-decisions it is answered with
        the forced experts at the rows the forcing trace holds (force.forced_answer), as
        RouterForcing does where no decision is recorded."""
        answer = None
        if self.forcing is not None:
            forced = self.forcing.values(names.layer(L, "router.topk"))
            if forced is not None:
                answer = forced_answer(self.lay.family, L, router, forced, lambda: self.positions)
        self._undo.append(
            intercept_topk(
                router,
                refuse=lambda calls: (
                    f"{self.lay.family} layer {L}: its router ({type(router).__name__}) called "
                    f"torch.topk {calls} times, not once: the oracle records and forces its "
                    "routing at that call (transformers changed?)"
                ),
                answer=answer,
                after=lambda result, own, used: self._on_router(L, result[0], own),
            )
        )

    def _on_router(self, L: int, logits, own):
        """`router.logits` (internals) and `router.topk`: `own`, the experts the router's own
        `torch.topk` returned, in its rank order, so the recorded routing is the one the experts
        computed with. Margins: the model's own for that choice (margin_of) over the fp32
        softmax of its logits — at an exact tie torch may have taken another index than the
        lowest, margin 0. Under forcing, decide() writes the forced rows and counts those that
        differ from `own`."""
        import torch

        if self.internals:
            self.add(names.layer(L, "router.logits"), logits, layer_idx=L)
        # The model's own probabilities: fp32 softmax of its router logits, as its router does.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).cpu().numpy()
        chosen = own.cpu().numpy().astype(np.int64)
        margins = np.array([margin_of(probs[r], c) for r, c in enumerate(chosen)], np.float32)
        name = names.layer(L, "router.topk")
        self.decide(Decision(name, chosen, margins), probs, self.positions)

    def _tap_experts(self, L: int, experts):
        ExpertTap = _expert_tap_class()
        orig = experts.forward  # the bound, dispatching forward (eager selected at load)

        def forward(*args, **kwargs):
            tap = ExpertTap(experts)
            with tap:
                out = orig(*args, **kwargs)
            self._on_experts(L, tap)
            return out

        self._undo.append(shadow_forward(experts, forward))

    def _on_experts(self, L: int, tap):
        # Expert parallel: the tap sees the rank's own experts, numbered from 0; a rank none of
        # whose experts received a row computes nothing.
        held = self.sharding.experts(L)[1] if self.sharding else None
        if not tap.outs and held is None:
            raise RuntimeError(
                f"layer {L}: the experts tap saw no expert computation (transformers internals changed?)"
            )
        expected = {}
        topk = self.decisions[-1].values if self.decisions else None
        if topk is not None:
            for e in np.unique(topk):
                expected[int(e)] = np.nonzero((topk == e).any(-1))[0].tolist()
        if held is not None:
            # ...but one the router sent rows to must have computed: no silent hole in the shard.
            unseen = [e for e in held if e in expected and e - held.start not in tap.outs]
            if unseen:
                raise RuntimeError(
                    f"layer {L}: the router sent rows to expert {unseen[0]}, held on this rank, "
                    "and the experts tap saw no computation for it (transformers internals changed?)"
                )
        for local in sorted(tap.outs):
            tok, out = tap.outs[local]
            e = local + (held.start if held is not None else 0)
            tok = tok.cpu().numpy()
            order = np.argsort(tok, kind="stable")  # ascending token order
            rows = tok[order]
            if expected.get(e) != rows.tolist():
                self.notes.append(
                    f"layer {L} expert {e}: model routed rows {rows.tolist()}, router.topk records {expected.get(e)}"
                )
            self.add(
                names.expert(L, e, "out"),
                out[order],
                positions=[self.positions[i] for i in rows],
                layer_idx=L,
            )

    def _patch_attention(self):
        """Wrap the modeling module's eager attention function (looked up at call time) to see
        q and k after norm and RoPE, v, and the attention probabilities."""
        mods = {sys.modules[type(self.lay.attn(L)).__module__] for L in self.layers}
        for mod in mods:
            orig = getattr(mod, "eager_attention_forward", None)
            if orig is None:
                raise RuntimeError(
                    f"{mod.__name__} has no eager_attention_forward: cannot capture internals"
                )
            tapped = set(self.layers)

            def wrapped(
                module, query, key, value, attention_mask, *a, _orig=orig, _tapped=tapped, **kw
            ):
                out, weights = _orig(module, query, key, value, attention_mask, *a, **kw)
                L = getattr(module, "layer_idx", None)
                if L in _tapped:
                    self.add(names.layer(L, "q"), query[0].transpose(0, 1), layer_idx=L)
                    self.add(names.layer(L, "k"), key[0].transpose(0, 1), layer_idx=L)
                    self.add(names.layer(L, "v"), value[0].transpose(0, 1), layer_idx=L)
                    if L in self._gates:
                        self.add(names.layer(L, "attn_gate"), self._gates.pop(L), layer_idx=L)
                    self.add(names.layer(L, "attn_probs"), weights[0], layer_idx=L)
                return out, weights

            mod.eager_attention_forward = wrapped
            self._undo.append(
                lambda mod=mod, orig=orig: setattr(mod, "eager_attention_forward", orig)
            )

    def _on_logits(self, mod, args, out):
        logits = out.logits[0]
        self.add("logits", logits)
        if not self.decode:  # a decode step's decision is taken by _generate
            self._logits = logits.float().cpu().numpy()

    def finish(self) -> None:
        if self.whole:
            self.decide(
                argmax_decision("logits.argmax", self._logits),
                self._logits,
                list(range(len(self._logits))),
            )


# ---------------------------------------------------------------------------------------------
# verbs


def _check_tokens(model, tokens, extra: int = 0):
    V = model.config.get_text_config().vocab_size
    if not tokens:
        raise OracleError("--tokens: empty prompt")
    bad = [t for t in tokens if not 0 <= t < V]
    if bad:
        raise OracleError(f"--tokens: ids {bad[:5]} outside the vocabulary [0, {V})")
    P = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if P is not None and len(tokens) + extra > P:
        raise OracleError(
            f"--tokens/--generate: {len(tokens) + extra} positions exceed max_position_embeddings {P}"
        )


def _generate(
    model, tokens, n: int, rc: RunConfig, forcing=None, sharding=None
) -> tuple[list[Record], list[Decision], list[tuple[str, list[int]]]]:
    """Greedy decode with the model's own KV cache (the DynamicCache its forward creates, sliding
    layers included), or by recomputing the whole sequence. Step 0 decides from the prompt's last
    logits row; step s >= 1 first runs token s-1 at position n+s-1 (cached: that one row on the
    cache; uncached: the whole sequence, its last row kept). Each step's forward is tapped
    (`Tap(decode=True)`): `decode.SSSS.logits` always, and for s >= 1 under --capture internals
    the layers' points and `final_norm.out`. Under --force-decisions step s feeds the forcing
    trace's decode.SSSS.argmax, and the prompt's rows are routed as forced in every forward (as
    in the captured prefill). Returns the tensors, the decisions and the forced record (name,
    the rows overridden)."""
    import torch

    records, out, forced = [], [], []
    seq = list(tokens)
    cache = rc.cache == "on"
    layers = range(len(resolve(model).layers)) if rc.capture == "internals" else []
    routing = (
        RouterForcing(resolve(model), forcing) if forcing is not None else contextlib.nullcontext()
    )
    past = None
    dev = execution_device(model.get_input_embeddings(), rc)

    with torch.no_grad(), routing, torch.autocast(device_type=rc.device, enabled=False):
        for s in range(n):
            p = len(seq) - 1
            ids, positions, kw = seq, range(len(seq)), {"use_cache": cache}
            if cache and s > 0:
                ids, positions, kw = seq[-1:], [p], {"use_cache": True, "past_key_values": past}
            if forcing is not None:
                routing.positions = list(positions)
            with Tap(
                model,
                path="decode",
                positions=[p],
                layers=layers if s > 0 else [],
                internals=False,
                whole=True,
                forcing=forcing,
                decode=True,
                step=s,
                sharding=sharding,
            ) as tap:
                r = model(torch.tensor([ids], device=dev), **kw)
            records += tap.records
            past = r.past_key_values
            row = r.logits[0, -1].float().cpu().numpy()[None]
            d = argmax_decision(names.decode(s, "argmax"), row)
            if forcing is not None:
                d, over = force_decision(d, row, forcing.values(d.name), [0])
                forced.append((d.name, over))
            out.append(d)
            seq.append(int(d.values[0]))
    return records, out, forced


def _routing(model, forcing, positions):
    """Forced routing for one forward at `positions`, or nothing."""
    if forcing is None:
        return contextlib.nullcontext()
    r = RouterForcing(resolve(model), forcing)
    r.positions = list(positions)
    return r


def _require_forced(
    model,
    forcing: Forcing,
    tokens: list[int] | None,
    generate: int,
    layer: int | None = None,
    positions: list[int] | None = None,
) -> None:
    """What this run needs from the forcing trace, checked before anything runs."""
    lay = resolve(model)
    cfg = lay.config
    if tokens is not None:
        forcing.check_prompt(tokens)
    for L in lay.moe_layers if layer is None else [L for L in lay.moe_layers if L == layer]:
        name = names.layer(L, "router.topk")
        router = lay.router(L)
        rows = forcing.require(
            name, None if tokens is None else len(tokens), router.top_k, router.num_experts
        )
        beyond = next((p for p in positions or [] if p >= rows), None)
        if beyond is not None:
            raise OracleError(
                f"--force-decisions {forcing.path}: decision {name} has {rows} rows, the input holds position {beyond}"
            )
    if tokens is not None:
        forcing.require("logits.argmax", len(tokens), None, cfg.vocab_size)
        for s in range(generate):
            forcing.require(names.decode(s, "argmax"), 1, None, cfg.vocab_size)


def _forced_provenance(
    prov: dict, forcing: Forcing | None, records: list[tuple[str, list[int]]]
) -> None:
    if forcing is not None:
        forcing.check_weights(prov.get("weights_digest"))
        prov["forced_decisions"] = forcing.provenance(records)


def capture_prompt(
    model,
    model_dir,
    tokens: list[int],
    rc: RunConfig,
    det: dict | None = None,
    forcing: Forcing | None = None,
    sharding=None,
) -> Capture:
    """The `trace` verb: the whole forward over `tokens` (path=prefill), then optional greedy decode;
    under --force-decisions with the forcing trace's decisions (force.py); with `sharding`
    (distributed.Sharding) as one rank of a sharded run, each tensor saying what part it holds."""
    import torch

    det = det if det is not None else {"use_deterministic_algorithms": None, "refusals": []}
    _check_tokens(model, tokens, rc.generate)
    if forcing is not None:
        _require_forced(model, forcing, tokens, rc.generate)
    n_layers = len(resolve(model).layers)

    def run():
        with Tap(
            model,
            path="prefill",
            positions=range(len(tokens)),
            layers=range(n_layers),
            internals=rc.capture == "internals",
            whole=True,
            forcing=forcing,
            sharding=sharding,
        ) as tap:
            # Forced routing: the Tap answers each router's topk itself (it records them all).
            with torch.autocast(device_type=rc.device, enabled=False):
                model(
                    torch.tensor(
                        [tokens], device=execution_device(model.get_input_embeddings(), rc)
                    ),
                    use_cache=False,
                )
            tap.finish()
        return tap, _generate(model, tokens, rc.generate, rc, forcing, sharding)

    with torch_paths(resolve(model)):  # Gated DeltaNet: transformers' torch references
        tap, (gen_tensors, gen, gen_forced) = _deterministic(run, det)
    prov = provenance(model, model_dir, rc, det, tokens, "trace")
    if sharding is not None:
        prov.update(sharding.provenance())
    _forced_provenance(prov, forcing, tap.forced + gen_forced)
    if tap.notes:
        prov["notes"] = tap.notes
    return Capture(tap.records + gen_tensors, tap.decisions + gen, prov)


def _layer_mask(model, L: int, x, position_ids, cache=None):
    """The model's own mask for a forward over these rows (causal in row order; with `cache`,
    sized by layer L's cache as the model's forward sizes it), of the kind its forward gives
    layer L (the family table's mask rule)."""
    from transformers import masking_utils as mu

    lay = resolve(model)
    if L in lay.linear_layers:  # the model's own (None without padding: nothing to mask)
        return mu.create_recurrent_attention_mask(
            config=lay.config, inputs_embeds=x, attention_mask=None, past_key_values=cache
        )
    fn = mu.create_causal_mask if lay.window(L) is None else mu.create_sliding_window_causal_mask
    return fn(
        config=lay.config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=cache,
        position_ids=position_ids,
        layer_idx=L if cache is not None else None,
    )


def _positions_text(positions: list[int]) -> str:
    p = list(positions)
    return str(p) if len(p) <= 8 else f"[{', '.join(map(str, p[:8]))}, ...] ({len(p)} rows)"


def check_decode_from(P: int, positions: list[int], name: str) -> None:
    """--decode-from needs rows at positions exactly 0..m-1, and 0 <= P < m."""
    bad = next((i for i, p in enumerate(positions) if p != i), None)
    if bad is not None:
        raise OracleError(
            f"--input-name {name}: --decode-from needs rows at positions 0..{len(positions) - 1} in order; "
            f"row {bad} is at position {positions[bad]}"
        )
    if not 0 <= P < len(positions):
        raise OracleError(
            f"--decode-from {P}: must be in 0..{len(positions) - 1} (--input-name {name} has "
            f"{len(positions)} rows)"
        )


def _decode_layer(model, L: int, x, positions: list[int], P: int, forcing) -> list[Record]:
    """Layer L the way the model's cached generation runs it: rows < P in one prefill forward
    filling the layer's cache (the DynamicCache the model's forward creates from its config, so
    a sliding layer keeps its window), then each row >= P alone on that cache, tapped
    (`Tap(decode=True)`). Returns one record per point, the decode rows stacked in order."""
    import torch
    from transformers import DynamicCache

    lay = resolve(model)
    cache = DynamicCache(config=lay.config)

    def forward(rows: slice):
        xs, pos = x[:, rows], torch.tensor([positions[rows]], device=x.device)
        with _routing(model, forcing, positions[rows]):
            lay.layers[L](
                xs,
                attention_mask=_layer_mask(model, L, xs, pos, cache),
                position_ids=pos,
                position_embeddings=lay.rope(xs, pos, L),
                past_key_values=cache,
                use_cache=True,
            )

    if P > 0:
        forward(slice(0, P))
    rows: dict[str, list[Record]] = {}
    for p in range(P, len(positions)):
        with Tap(
            model,
            path="layer",
            positions=[p],
            layers=[L],
            internals=False,
            whole=False,
            forcing=forcing,
            decode=True,
        ) as tap:
            forward(slice(p, p + 1))
        for r in tap.records:
            rows.setdefault(r.name, []).append(r)
    return [
        Record(
            n,
            np.concatenate([r.array for r in rs]),
            rs[0].dtype,
            {**rs[0].attrs, "positions": positions[P:], "decode_from": str(P)},
        )
        for n, rs in rows.items()
    ]


def capture_layer(
    model,
    model_dir,
    L: int,
    hidden: np.ndarray,
    positions: list[int],
    rc: RunConfig,
    det: dict | None = None,
    input_dtype: str | None = None,
    source: dict | None = None,
    forcing: Forcing | None = None,
    decode_from: int | None = None,
) -> Capture:
    """The `layer` verb: the model's own decoder layer L on `hidden` [T, H] at `positions`; under
    --force-decisions its router takes the forcing trace's rows at those positions. With
    `decode_from` P (docs/producers.md, `layer --decode-from`): rows < P fill the layer's KV
    cache, each row >= P runs as a cached decode step, and only those rows are written."""
    import torch

    det = det if det is not None else {"use_deterministic_algorithms": None, "refusals": []}
    lay = resolve(model)
    layers = lay.layers
    if not 0 <= L < len(layers):
        raise OracleError(f"--layer {L}: the model has layers 0..{len(layers) - 1}")
    H = lay.config.hidden_size
    if hidden.ndim != 2 or hidden.shape[1] != H or hidden.shape[0] < 1:
        raise OracleError(
            f"--input-name: tensor shape {list(hidden.shape)} is not [rows, {H}] with rows ≥ 1"
        )
    if len(positions) != hidden.shape[0]:
        raise OracleError(f"--input-name: {len(positions)} positions for {hidden.shape[0]} rows")
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)) or (
        positions and positions[0] < 0
    ):
        raise OracleError("--input-name: positions must be non-negative and strictly increasing")
    name = (source or {}).get("input_name", "")
    if decode_from is not None:
        check_decode_from(decode_from, positions, name)
    elif L in lay.linear_layers and list(positions) != list(range(len(positions))):
        # Run alone, a linear-attention layer starts from zero conv and recurrent states, which
        # is position 0: its rows must be the whole prefix.
        raise OracleError(
            f"--input-name {name}: layer {L} is a linear-attention layer, which runs from a zero "
            f"state at position 0: its rows must be at positions 0..{len(positions) - 1} in "
            f"order, not {_positions_text(positions)}"
        )
    if forcing is not None:
        # Under --decode-from the rows the forcing trace holds are forced and later ones route
        # themselves, as generated rows do in `trace`; the cache's prefix must be covered.
        _require_forced(
            model,
            forcing,
            None,
            0,
            layer=L,
            positions=positions if decode_from is None else positions[:decode_from],
        )
    dt = next(model.parameters()).dtype
    if input_dtype == "bf16":
        x = torch.from_numpy(np.array(hidden, copy=True).view(np.int16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(np.array(hidden, copy=True))  # the trace view is read-only
    dev = execution_device(layers[L], rc)
    x = x.to(dev, dt)[None]
    pos = torch.tensor([positions], device=dev)

    def run():
        if decode_from is not None:
            with torch.no_grad(), torch.autocast(device_type=rc.device, enabled=False):
                return _decode_layer(model, L, x, list(positions), decode_from, forcing), None
        with Tap(
            model,
            path="layer",
            positions=positions,
            layers=[L],
            internals=rc.capture == "internals",
            whole=False,
            forcing=forcing,
        ) as tap:
            # Forced routing: the Tap answers layer L's router itself.
            with torch.autocast(device_type=rc.device, enabled=False):
                mask = _layer_mask(model, L, x, pos)
                pe = lay.rope(x, pos, L)
                layers[L](
                    x,
                    attention_mask=mask,
                    position_ids=pos,
                    position_embeddings=pe,
                    past_key_values=None,
                    use_cache=False,
                )
        return tap.records, tap

    with torch_paths(lay):  # Gated DeltaNet: transformers' torch references
        records, tap = _deterministic(run, det)
    prov = provenance(model, model_dir, rc, det, None, "layer")
    prov.update(layer=L, positions=list(positions), **(source or {}))
    if decode_from is not None:
        prov["decode_from"] = decode_from
    # Under --decode-from no decision is recorded (a decode row's routing is not one, as in `trace`).
    _forced_provenance(prov, forcing, tap.forced if tap else [])
    if tap and tap.notes:
        prov["notes"] = tap.notes
    return Capture(records, tap.decisions if tap else [], prov)


def write_trace(cap: Capture, out: str | os.PathLike) -> str:
    """Write through the tracegate binding (the only writer of the format); returns the digest."""
    try:
        import tracegate
    except ImportError:
        raise OracleError(
            "the `tracegate` Python module is not installed (run scripts/setup.sh)"
        ) from None
    try:
        return _write(tracegate, cap, out)
    except (OSError, tracegate.TraceError) as e:
        # An unwritable --out (a read-only directory, a full disk): one line, as the engine's.
        raise OracleError(f"--out {out}: cannot write the trace: {e}") from None


def _write(tracegate, cap: Capture, out) -> str:
    with tracegate.TraceWriter(str(out), cap.provenance) as w:
        for r in cap.tensors:
            a = r.attrs
            extra = {k: a[k] for k in ("forced", "decode_from", "shard") if k in a}
            w.tensor(
                r.name,
                r.array,
                dtype=r.dtype,
                path=a["path"],
                mask=a["mask"],
                positions=a["positions"],
                **extra,
            )
        for d in cap.decisions:
            w.decision(d.name, d.values, margins=d.margins)
        return w.finish()
