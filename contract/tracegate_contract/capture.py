"""What a run records (tensors with their rows' absolute positions, decisions), in the order it
happens; a decode step's capture and the capture that records nothing. The engine's mirror is
engine/src/capture.rs.
"""

from __future__ import annotations

import numpy as np
from tracegate import names

from .ops import F32


class Capture:
    """Collects tensors (with the rows' absolute positions) and decisions in recording order.
    `internals` adds q/k/v/attn_probs/router logits/expert outputs (§ capture convention)."""

    def __init__(self, internals: bool = False):
        self.internals = internals
        self.tensors: list[tuple[str, np.ndarray, list[int]]] = []
        self.decisions: list[tuple[str, np.ndarray, np.ndarray]] = []
        # --force-decisions: (name, the rows overridden) per forced decision, and how many tensors
        # were captured before the first (those after it carry the `forced` attribute).
        self.forced: list[tuple[str, list[int]]] = []
        self.first_forced: int | None = None

    def tensor(self, name: str, array: np.ndarray, positions, internal: bool = False) -> None:
        if internal and not self.internals:
            return
        self.tensors.append(
            (name, np.ascontiguousarray(array, dtype=F32), [int(p) for p in positions])
        )

    def decision(self, name: str, values: np.ndarray, margins: np.ndarray) -> None:
        self.decisions.append(
            (name, np.asarray(values, dtype=np.int64), np.asarray(margins, dtype=F32))
        )

    def mark_forced(self, name: str, overridden: list[int]) -> None:
        """The decision just recorded was forced; `overridden`: the rows (ascending) this producer
        would have decided otherwise."""
        if self.first_forced is None:
            self.first_forced = len(self.tensors)
        self.forced.append((name, [int(r) for r in overridden]))

    def join_rows(self) -> None:
        """Rows recorded one at a time (`layer --decode-from`: one decode row per call), joined
        into one tensor per name in first-seen order; decisions dropped. A joined tensor counts
        as captured after the first forced decision when any of its rows was."""
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
