"""Read and write tracegate `.trace` files from Python.

    with tracegate.TraceWriter("run.trace", {"producer": "mine"}) as w:
        w.tensor("logits", logits, path="prefill", mask="causal", positions=[0, 1, 2])
        w.decision("logits.argmax", ids, margins=gaps)
    # on leaving the `with` block the trace is finished; an exception inside leaves no file

    t = tracegate.Trace("run.trace")
    t.verify()
    t["logits"]            # read-only numpy view into the mapped file (no copy, stays valid)

    report = tracegate.compare("engine.trace", "oracle.trace", policy="f32")
    report.verdict, report.first_violation, report.per_tensor    # the --json report's fields
    report.to_html("report.html")

bf16 has no numpy dtype: pass the raw bits as a uint16 array with ``dtype="bf16"`` (or an
``ml_dtypes.bfloat16`` array, or a torch ``bfloat16`` tensor as it is); bf16 tensors are read
back as uint16 arrays holding the bits.
The format is specified in docs/trace-format.md.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ._native import (
    FORMAT_VERSION,
    CompareError,
    NativeTrace,
    NativeWriter,
    TraceError,
    __version__,
    parse_shard,
    weights_digest,
)
from ._native import compare as _compare

__all__ = [
    "__version__",
    "Trace",
    "TraceWriter",
    "TraceError",
    "weights_digest",
    "parse_shard",
    "FORMAT_VERSION",
    "compare",
    "Report",
    "CompareError",
]

# numpy dtype -> trace dtype; bf16 is given explicitly (uint16 bits) or via ml_dtypes.
_TO_TRACE = {
    np.dtype("<f8"): "f64",
    np.dtype("<f4"): "f32",
    np.dtype("<f2"): "f16",
    np.dtype("<i8"): "i64",
    np.dtype("<i4"): "i32",
    np.dtype("<i2"): "i16",
    np.dtype("i1"): "i8",
    np.dtype("u1"): "u8",
    np.dtype("bool"): "bool",
}
# What each trace dtype reads back as (the native `array`: bf16 as its uint16 bits).
_TO_NUMPY = {v: k for k, v in _TO_TRACE.items()}
_TO_NUMPY["bf16"] = np.dtype("<u2")


def _torch_bf16_bits(array, dtype: str | None):
    """A torch bfloat16 tensor as its bits (numpy has no bf16, and np.asarray fails on it with
    "Got unsupported ScalarType BFloat16"): stored as bf16, its values unchanged. torch is not
    imported here: a tensor of another library passes through."""
    if (
        type(array).__module__.split(".")[0] != "torch"
        or str(getattr(array, "dtype", "")) != "torch.bfloat16"
    ):
        return array, dtype
    if dtype not in (None, "bf16"):
        raise _refused(f"dtype={dtype!r} does not match the tensor's dtype torch.bfloat16 (bf16)")
    import torch

    return array.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16), "bf16"


def _trace_dtype(array: np.ndarray, dtype: str | None) -> tuple[str, np.ndarray]:
    if array.dtype.name == "bfloat16":
        return "bf16", array.view(np.uint16)
    if dtype == "bf16":
        # Only bits are accepted: an f16 or i16 array has the right size but other numbers.
        if array.dtype.kind != "u" or array.dtype.itemsize != 2:
            raise _refused(
                f"dtype='bf16' takes the bits as a uint16 array (or an ml_dtypes.bfloat16 array), got {array.dtype}"
            )
        return "bf16", array.astype("<u2", copy=False)
    native = array.dtype.newbyteorder("<") if array.dtype.byteorder == ">" else array.dtype
    name = _TO_TRACE.get(native)
    if name is None:
        raise _refused(
            f"numpy dtype {array.dtype} has no trace dtype (supported: {sorted(_TO_TRACE.values())} and bf16)"
        )
    if dtype is not None and dtype != name:
        raise _refused(f"dtype={dtype!r} does not match the array's dtype {array.dtype} ({name})")
    return name, array.astype(native, copy=False)


def _refused(message: str, kind: str = "Invalid") -> TraceError:
    """A TraceError with its `kind` (docs/trace-format.md, "Refusals in Python"): what the
    binding refuses before the container sees it is `Invalid`, as the container's own."""
    e = TraceError(message)
    e.kind = kind
    return e


_I64 = (-(1 << 63), (1 << 63) - 1)


def _int64(value, what: str) -> int:
    """An integer the trace stores as i64, or a TraceError naming `what`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise _refused(f"{what} must be an integer, got {value!r}")
    v = int(value)
    if not _I64[0] <= v <= _I64[1]:
        raise _refused(f"{what} {v} is outside the i64 range a trace stores")
    return v


def _check_provenance_ints(value, where: str) -> None:
    """JSON integers beyond 64 bits would come back as approximate floats: refuse them, so the
    provenance is recorded verbatim or not at all."""
    if isinstance(value, bool):
        return
    if isinstance(value, int):
        if not -(1 << 63) <= value < (1 << 64):
            raise _refused(
                f"{where} = {value} does not fit 64 bits and would not be recorded exactly; store it as a string"
            )
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_provenance_ints(v, f"{where}.{k}")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_provenance_ints(v, f"{where}[{i}]")


def _provenance_json(provenance) -> str:
    """The provenance's JSON text, or a TraceError saying why it cannot be recorded."""
    if not isinstance(provenance, dict):
        raise _refused(
            f"provenance must be a JSON object (a dict), got {type(provenance).__name__}"
        )
    try:
        text = json.dumps(provenance, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _refused(f"provenance is not JSON-serialisable: {e}") from None
    _check_provenance_ints(provenance, "provenance")
    return text


class TraceWriter:
    """Streams a trace to a temporary file beside `path`; `finish()` renames it into place.

    Each tensor and decision goes to the file as it is added (the writer keeps only the index).
    The provenance may come later: ``TraceWriter(path)``, then ``set_provenance(dict)`` any time
    before ``finish()`` (a producer learns some of it only at the end); finishing without one
    is refused. Until ``finish()`` nothing is at `path`: a crash leaves at most the temporary."""

    def __init__(self, path, provenance: dict | None = None):
        text = "{}" if provenance is None else _provenance_json(provenance)
        self._native = NativeWriter(str(path), text)
        self._has_provenance = provenance is not None
        self.path = path
        self.digest: str | None = None

    def set_provenance(self, provenance: dict) -> None:
        """Replaces the provenance the index will hold (checked as the constructor's)."""
        self._native.set_provenance(_provenance_json(provenance))
        self._has_provenance = True

    def tensor(
        self,
        name: str,
        array,
        dtype: str | None = None,
        path: str | None = None,
        mask: str | None = None,
        positions=None,
        step: int | None = None,
        **extra: str,
    ) -> None:
        array, dtype = _torch_bf16_bits(array, dtype)
        array = np.asarray(array)
        trace_dtype, array = _trace_dtype(array, dtype)
        # np.ascontiguousarray would turn a rank-0 array into rank 1; keep the shape exactly.
        data = array if array.flags.c_contiguous else np.array(array, order="C")
        if positions is not None:
            positions = [_int64(p, f"tensor {name!r}: positions") for p in positions]
        if step is not None:
            step = _int64(step, f"tensor {name!r}: step")
        for key, value in extra.items():
            if not isinstance(value, str):
                raise _refused(
                    f"tensor {name!r}: extra attribute {key!r} must be a string, got {type(value).__name__}"
                )
        self._native.tensor(
            name,
            trace_dtype,
            list(data.shape),
            data.reshape(-1).view(np.uint8).data,
            path,
            mask,
            positions,
            step,
            extra or None,
        )

    def decision(self, name: str, values, margins=None) -> None:
        values = np.asarray(values)
        if values.dtype.kind not in "iu":
            raise _refused(f"decision {name!r}: values must be integers, got {values.dtype}")
        flat = [_int64(v, f"decision {name!r}: value") for v in values.reshape(-1)]
        m = None
        if margins is not None:
            m = [float(x) for x in np.asarray(margins, dtype=np.float32).reshape(-1)]
        self._native.decision(name, list(values.shape), flat, m)

    def finish(self) -> str:
        if not self._has_provenance:
            raise _refused(
                f"{self.path}: no provenance to finish the trace with: pass it to "
                "TraceWriter(path, provenance) or to set_provenance() before finish()"
            )
        self.digest = self._native.finish()
        return self.digest

    def abort(self) -> None:
        self._native.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            if self.digest is None:
                try:
                    self.finish()
                except BaseException:
                    self.abort()  # the temporary goes now, not when the writer is collected
                    raise
        else:
            self.abort()
        return False


class Trace:
    """A finished trace, memory-mapped; opening validates its structure, `verify()` its bytes."""

    def __init__(self, path):
        self.path = path
        self._native = NativeTrace(str(path))
        self._names = None
        self._decisions = None

    @property
    def names(self) -> list:
        """Tensor names in capture order. Built on first use: it is the one Python object per
        tensor (dtype and shape are asked of the native index by name)."""
        if self._names is None:
            self._names = self._native.names()
        return self._names

    def __getitem__(self, name: str) -> np.ndarray:
        """A read-only numpy array over the mapped file (no copy); its ``base`` keeps the
        mapping open, so the array stays valid after this Trace is gone."""
        try:
            return self._native.array(name)
        except (ValueError, OverflowError, MemoryError) as e:
            # A valid trace may hold a shape numpy cannot represent (an empty [0, 2**62]).
            shape = self._native.meta(name)[1]
            raise _refused(
                f"{self.path}: tensor {name!r} of shape {list(shape)} cannot be a numpy array: {e}",
                "NotViewable",
            ) from None

    def __contains__(self, name: str) -> bool:
        return self._native.contains(name)

    def __len__(self) -> int:
        return self._native.count()

    def dtype(self, name: str) -> str:
        return self._native.meta(name)[0]

    def attributes(self, name: str) -> dict:
        return json.loads(self._native.attributes_json(name))

    def tensor_digest(self, name: str) -> str:
        return self._native.tensor_digest(name)

    def _load_decisions(self):
        if self._decisions is None:
            values, margins = {}, {}
            for name, shape, vbytes, mbytes in self._native.decisions():
                try:
                    values[name] = np.frombuffer(vbytes, dtype="<i8").reshape(shape)
                except (ValueError, OverflowError, MemoryError) as e:
                    raise _refused(
                        f"{self.path}: decision {name!r} of shape {list(shape)} cannot be a numpy array: {e}",
                        "NotViewable",
                    ) from None
                margins[name] = None if mbytes is None else np.frombuffer(mbytes, dtype="<f4")
            self._decisions = (values, margins)
        return self._decisions

    @property
    def decisions(self) -> dict:
        return self._load_decisions()[0]

    @property
    def margins(self) -> dict:
        return self._load_decisions()[1]

    @property
    def provenance(self) -> dict:
        return json.loads(self._native.provenance_json())

    @property
    def digest(self) -> str:
        return self._native.digest()

    @property
    def version(self) -> tuple:
        return self._native.version()

    def verify(self) -> None:
        self._native.verify()

    def __repr__(self) -> str:
        return f"Trace({str(self.path)!r}, digest={self.digest[:16]})"


def _globs(value, what: str) -> list | None:
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return [os.fspath(value)]
    globs = list(value)
    if not all(isinstance(g, str) for g in globs):
        raise CompareError(f"{what} takes a glob or a list of globs, got {value!r}")
    return globs


def compare(reference, candidate, policy=None, all: bool = False, only=None, skip=None) -> Report:
    """Compare two traces as ``trace-diff`` does, in-process (the Rust comparison, no subprocess).

    ``policy``: None (by bits), a bundled name (``"f32"``, ``"bf16"``, ``"f16"``) or a policy
    file's path; ``all``: keep scanning past the first differing tensor (implied by a policy);
    ``only`` / ``skip``: a glob or a list of globs, as ``--only`` / ``--skip``.
    An unreadable or tampered trace raises TraceError naming its path; a bad policy or a filter
    that selects nothing raises CompareError. Every other outcome is a :class:`Report`.
    """
    if policy is not None and not isinstance(policy, (str, os.PathLike)):
        raise CompareError(f"policy takes a bundled name or a path, got {type(policy).__name__}")
    native = _compare(
        os.fspath(reference),
        os.fspath(candidate),
        None if policy is None else os.fspath(policy),
        bool(all),
        _globs(only, "only"),
        _globs(skip, "skip"),
    )
    return Report(native)


class Report:
    """The outcome of :func:`compare`: the fields of ``trace-diff --json``'s report
    (docs/diff-report.schema.json) as attributes, their values as ``json.loads`` gives them:
    ``verdict``, ``first_bit_difference``, ``first_violation``, ``per_tensor``, ``decisions``,
    ``findings``, ``tensors``, ``policy``, ... ``to_json()`` is that report's text,
    ``to_html(path)`` writes the ``trace-diff --html`` page."""

    def __init__(self, native):
        self._native = native
        self._fields = json.loads(native.to_json())

    def __getattr__(self, name):
        fields = self.__dict__.get("_fields", {})
        if name in fields:
            return fields[name]
        raise AttributeError(f"Report has no field {name!r} (fields: {', '.join(fields)})")

    def __dir__(self):
        return [*super().__dir__(), *self._fields]

    @property
    def fields(self) -> dict:
        """Every field, as a dict (the parsed JSON report)."""
        return self._fields

    @property
    def ok(self) -> bool:
        """Identical, or within the policy: what ``trace-diff`` exits 0 for."""
        return self._native.exit_code() == 0

    @property
    def exit_code(self) -> int:
        return self._native.exit_code()

    @property
    def flipped_decisions(self) -> list:
        """Every flipped decision row: ``{"decision", "row", "reference", "candidate", "label", ...}``."""
        return [
            {"decision": r["name"], **f}
            for r in self._fields["decisions"]["results"]
            for f in r["flips"]
        ]

    def to_json(self) -> str:
        return self._native.to_json()

    def to_html(self, path) -> None:
        self._native.write_html(os.fspath(path))

    def __str__(self) -> str:
        return self._native.to_text()

    def __repr__(self) -> str:
        return f"Report(verdict={self.verdict!r}, reference={self.reference['path']!r}, candidate={self.candidate['path']!r})"
