"""What a capture is made of and how it is written: the records (`Record`, `Decision`, `Capture`),
the decisions' tie rule (descending value, lowest index first) with each row's margin, the
provenance every oracle trace carries (versions, device, weights digest, build id, command line),
and the trace, through the tracegate binding (the only writer of the format): `Stream`, each
record written as it is made (the CLI's verbs), or `write_trace`, a capture built in memory
(so tests can inspect numbers without the trace binding)."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .errors import CheckpointError, OracleError
from .families import resolve
from .linear_attn import provenance as linear_provenance
from .torch_setup import RunConfig


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


def to_numpy(t) -> tuple[np.ndarray, str | None]:
    """A torch tensor as stored: f32/f16/f64 natively, bf16 as its uint16 bit patterns."""
    import torch

    t = t.detach().to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16).copy(), "bf16"
    return t.numpy().copy(), None


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


def weights_digest(model_dir: Path) -> str | None:
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


def build_id() -> str:
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


def device_map_provenance(model, rc: RunConfig) -> dict:
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


def model_weights_digest(model, model_dir) -> str | None:
    """The digest of the weights `model` was loaded from, where the loader recorded it (cli._load
    keys its served models on it); else the directory's, now."""
    return getattr(model, "tracegate_weights_digest", None) or weights_digest(Path(model_dir))


def run_provenance(
    model,
    model_dir,
    rc: RunConfig,
    det: dict,
    tokens,
    verb: str,
    *,
    experts_implementation,
    family: dict,
    linear: dict | None = None,
    extra: dict | None = None,
) -> dict:
    """What every oracle trace records of its run, in one order: `family`, what this family
    computes differently; `linear`, the linear-attention record where the model has such layers;
    `extra`, the verb's own keys (after `generate`)."""
    return {
        "producer": "oracle",
        "verb": verb,
        "versions": versions_record(),
        "device": device_record(rc),
        **({"device_map": device_map_provenance(model, rc)} if rc.device_map is not None else {}),
        "dtype": rc.dtype,
        "threads": rc.threads,
        "seed": rc.seed,
        "deterministic": det,
        "attn_implementation": model.config._attn_implementation,
        "experts_implementation": experts_implementation,
        "model_class": type(model).__name__,
        **(
            {"unused_tensors": model.tracegate_unused_tensors}
            if getattr(model, "tracegate_unused_tensors", None)
            else {}
        ),
        **({"linear_attention": linear} if linear is not None else {}),
        "family": family,
        "model": str(model_dir),
        "model_abspath": str(Path(model_dir).resolve()),
        "weights_digest": model_weights_digest(model, model_dir),
        "prompt_tokens": [int(t) for t in tokens] if tokens is not None else None,
        "capture": rc.capture,
        "cache": rc.cache,
        "generate": rc.generate,
        **(extra or {}),
        "command": command_record(),
        "build_id": build_id(),
    }


def provenance(model, model_dir, rc: RunConfig, det: dict, tokens, verb: str) -> dict:
    """A causal LM's run record (the family table's layout)."""
    lay = resolve(model)
    return run_provenance(
        model,
        model_dir,
        rc,
        det,
        tokens,
        verb,
        experts_implementation=model.config._experts_implementation if lay.moe_layers else None,
        # What this family computes differently (masks per layer, softcaps, embedding scale, tied head).
        family=lay.provenance(),
        linear=linear_provenance(lay) if lay.linear_layers else None,
    )


def command_record() -> list[str]:
    """The command line, as it can be re-run: under -m, sys.argv[0] is __main__.py's path."""
    return (
        [sys.executable, "-m", "tracegate_oracle", *sys.argv[1:]]
        if sys.argv and sys.argv[0].endswith("__main__.py")
        else list(sys.argv)
    )


class Stream:
    """The trace a run writes as it records (docs/trace-format.md, "Writing"): open it before
    the run and hand it to the capture (its taps `add` each record as it is made and keep
    none), then `finish` with the Capture. Nothing is at `out` until then; leaving the `with`
    block unfinished, by an error or not, leaves nothing there. An unwritable --out (a missing
    directory, a full disk) is an OracleError naming it, as the engine's."""

    def __init__(self, out: str | os.PathLike):
        try:
            import tracegate
        except ImportError:
            raise OracleError(
                "the `tracegate` Python module is not installed (run scripts/setup.sh)"
            ) from None
        self.tracegate, self.out, self.writer = tracegate, out, None
        self.begin()

    def _writing(self, fn):
        try:
            return fn()
        except (OSError, self.tracegate.TraceError) as e:
            raise OracleError(f"--out {self.out}: cannot write the trace: {e}") from None

    def begin(self) -> None:
        """A run starts from an empty trace: torch_setup.deterministic runs a capture again
        when an op refused determinism, and what the first run wrote is dropped."""
        if self.writer is not None:
            self.writer.abort()
        self.writer = self._writing(lambda: self.tracegate.TraceWriter(str(self.out)))

    def add(self, r: Record) -> None:
        a = r.attrs
        extra = {k: a[k] for k in ("forced", "decode_from", "shard") if k in a}
        self._writing(
            lambda: self.writer.tensor(
                r.name,
                r.array,
                dtype=r.dtype,
                path=a["path"],
                mask=a["mask"],
                positions=a["positions"],
                **extra,
            )
        )

    def finish(self, cap: Capture) -> str:
        """The tensors `cap` still holds (a capture kept whole), its decisions (kept to the end,
        so the file is byte for byte the one a capture written whole gives) and its provenance;
        returns the digest."""
        for r in cap.tensors:
            self.add(r)

        def close():
            for d in cap.decisions:
                self.writer.decision(d.name, d.values, margins=d.margins)
            self.writer.set_provenance(cap.provenance)
            return self.writer.finish()

        return self._writing(close)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> bool:
        if self.writer.digest is None:
            self.writer.abort()
        return False


def write_trace(cap: Capture, out: str | os.PathLike) -> str:
    """A capture built in memory, written through a `Stream`; returns the digest."""
    with Stream(out) as s:
        return s.finish(cap)
