"""What a run records (tensors with their rows' absolute positions, decisions), in the order it
happens; a decode step's capture and the capture that records nothing; and the trace it is
written to, as it records (`Stream`) or at the end (`write`). Every family records through it
(block diffusion too). The engine's mirror is engine/src/capture.rs.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import tracegate
from tracegate import names

from .ops import F32


class Capture:
    """Collects tensors (with the rows' absolute positions) and decisions in recording order.
    `internals` adds q/k/v/attn_probs/router logits/expert outputs (§ capture convention).
    With a `stream` each tensor goes to the trace as it is recorded and is not kept (`tensors`
    stays empty), so a run's memory does not grow with its trace; decisions are kept."""

    def __init__(self, internals: bool = False, stream: Stream | None = None):
        self.internals = internals
        self.stream = stream
        self.tensors: list[tuple[str, np.ndarray, list[int]]] = []
        self.count = 0  # tensors recorded, kept or streamed
        self.decisions: list[tuple[str, np.ndarray, np.ndarray]] = []
        # --force-decisions: (name, the rows overridden) per forced decision, and how many tensors
        # were captured before the first (those after it carry the `forced` attribute).
        self.forced: list[tuple[str, list[int]]] = []
        self.first_forced: int | None = None

    def tensor(self, name: str, array: np.ndarray, positions, internal: bool = False) -> None:
        if internal and not self.internals:
            return
        a = np.asarray(array)
        # Token ids (a diffusion canvas) stay int64; every other point is f32.
        a = np.ascontiguousarray(a if a.dtype == np.int64 else a.astype(F32, copy=False))
        positions = [int(p) for p in positions]
        if self.stream is None:
            self.tensors.append((name, a, positions))
        else:
            self.stream.tensor(name, a, positions, forced=self.first_forced is not None)
        self.count += 1

    def decision(self, name: str, values: np.ndarray, margins: np.ndarray | None) -> None:
        """`margins` None: a decision without margins (a draw, docs/diffusion-gemma.md DG13)."""
        m = None if margins is None else np.asarray(margins, dtype=F32)
        self.decisions.append((name, np.asarray(values, dtype=np.int64), m))

    def decided(self, name: str, values, margins, overridden: list[int] | None) -> None:
        """Decision `name`, and under --force-decisions (`overridden` not None: the forced values
        were recorded) the rows this producer would have decided otherwise."""
        self.decision(name, values, margins)
        if overridden is not None:
            self.mark_forced(name, overridden)

    def mark_forced(self, name: str, overridden: list[int]) -> None:
        """The decision just recorded was forced; `overridden`: the rows (ascending) this producer
        would have decided otherwise."""
        if self.first_forced is None:
            self.first_forced = self.count
        self.forced.append((name, [int(r) for r in overridden]))

    def join_rows(self) -> None:
        """Rows recorded one at a time (`layer --decode-from`: one decode row per call, so the
        capture is kept, not streamed), joined into one tensor per name in first-seen order;
        decisions dropped. A joined tensor counts as captured after the first forced decision
        when any of its rows was."""
        joined: dict[str, tuple[list, list, bool]] = {}
        for i, (name, array, positions) in enumerate(self.tensors):
            forced = self.first_forced is not None and i >= self.first_forced
            arrays, pos, was = joined.setdefault(name, ([], [], False))
            arrays.append(array)
            pos.extend(positions)
            joined[name] = (arrays, pos, was or forced)
        if self.first_forced is not None:
            flags = [f for _, _, f in joined.values()]
            self.first_forced = flags.index(True) if True in flags else len(flags)
        self.tensors = [(name, np.concatenate(a), p) for name, (a, p, _) in joined.items()]
        self.count = len(self.tensors)
        self.decisions = []


class StepCapture(Capture):
    """Decode step `s`'s forward, cached (one row) or uncached (the whole sequence): records into
    `parent` `decode.SSSS.logits` and, under internals, the layers' hidden_in, attn_out, mlp_out,
    hidden_out and final_norm.out, each of the last row only — so a cached and an uncached step
    record the same tensors (docs/producers.md). No internal points, no decisions."""

    def __init__(self, parent: Capture, step: int):
        super().__init__(parent.internals)
        self.parent, self.step = parent, step

    def tensor(self, name: str, array: np.ndarray, positions, internal: bool = False) -> None:
        point = names.point(name)
        keep = name == "logits" or (
            self.internals and point is not None and point.in_decode == "also"
        )
        if keep and not internal:
            self.parent.tensor(
                names.decode(self.step, name), np.asarray(array)[-1:], [int(positions[-1])]
            )

    def decision(self, *a, **k):
        pass

    def mark_forced(self, *a, **k):
        pass


class _NoCapture(Capture):
    def tensor(self, *a, **k):
        pass

    def decision(self, *a, **k):
        pass

    def mark_forced(self, *a, **k):
        pass


NO_CAPTURE = _NoCapture()


# Where a tensor sits: its `path` and `mask` attributes (docs/trace-format.md), by its name.
Place = Callable[[str], tuple[str, str | None]]


def by_layer(path: str, mask_of: Callable[[int | None], str | None]) -> Place:
    """The place of a tensor of a prefill or layer run: `path`, or `decode` for a decode step's;
    the mask of its layer (`mask_of(None)` for a model-wide point)."""

    def place(name: str) -> tuple[str, str | None]:
        n = names.parse(name)
        return ("decode" if n.decode_step is not None else path), mask_of(n.layer)

    return place


class Stream:
    """The trace a run writes as it records (docs/trace-format.md, "Writing"): open it before the
    run, give it to `Capture`, then `finish` with the provenance. Each tensor is written when it
    is recorded, where `place` puts it; `attrs`: extra attributes on every tensor; `shard_of`: a
    rank trace's `shard` attribute of a tensor by its name; `forcing`: the run's force.Forcing
    (None without --force-decisions), whose digest a tensor recorded after the first forced
    decision carries as `forced`. The decisions are written at `finish`, after the tensors (a
    few bytes a row; a producer may still change one it recorded): the file is byte for byte
    the one written from a whole capture. Leaving the `with` block unfinished, by an error or
    not, leaves nothing at `out`."""

    def __init__(self, out: str, place: Place, forcing=None, attrs=None, shard_of=None):
        self.place, self.forcing, self.attrs, self.shard_of = place, forcing, attrs, shard_of
        self.writer = tracegate.TraceWriter(out)

    def tensor(self, name: str, array: np.ndarray, positions: list[int], forced: bool) -> None:
        extra = {**(self.attrs or {}), **({"forced": self.forcing.digest} if forced else {})}
        if self.shard_of is not None:
            extra["shard"] = self.shard_of(name)
        path, mask = self.place(name)
        self.writer.tensor(name, array, path=path, mask=mask, positions=positions, **extra)

    def finish(self, prov: dict, cap: Capture) -> str:
        """`cap`'s decisions, then the provenance (under --force-decisions, its weights checked
        against this run's, with the `forced_decisions` record); returns the digest."""
        if self.forcing is not None:
            self.forcing.check_weights(prov["weights_digest"])
            prov = {**prov, "forced_decisions": self.forcing.provenance(cap.forced)}
        for name, values, margins in cap.decisions:
            self.writer.decision(name, values, margins=margins)
        self.writer.set_provenance(prov)
        return self.writer.finish()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> bool:
        if self.writer.digest is None:
            self.writer.abort()  # an error, or a run that never finished: no file at `out`
        return False


def write(
    out: str,
    prov: dict,
    cap: Capture,
    place: Place,
    forcing=None,
    attrs: dict | None = None,
    shard_of=None,
) -> str:
    """A capture kept whole (`layer --decode-from` joins its rows first) written through a
    `Stream` with these arguments: tensors in capture order, then decisions; returns the
    digest."""
    with Stream(out, place, forcing, attrs, shard_of) as s:
        for i, (name, array, positions) in enumerate(cap.tensors):
            forced = cap.first_forced is not None and i >= cap.first_forced
            s.tensor(name, array, positions, forced)
        return s.finish(prov, cap)
