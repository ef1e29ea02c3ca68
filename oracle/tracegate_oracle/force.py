"""`--force-decisions TRACE`: router top-k and greedy tokens taken from another trace instead of
computed, so the model's numbers can be compared past a decision that flipped legitimately
(docs/producers.md, "Forced decisions").

Routing is forced without re-implementing any router: while transformers' own router module
runs, the one `torch.topk` it calls on its probabilities is answered with the forced experts and
the router's own probabilities at them; everything after — its renormalisation, its dtype cast,
the experts loop — is transformers' code. A router that does not call `torch.topk` exactly once
on `[rows, num_experts]` is refused for forcing, naming the family and layer. Greedy tokens are
forced by feeding the forced token to the next generation step.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .errors import OracleError


class Forcing:
    """The forcing trace's decisions, checked before anything runs; refusals name the file and
    the decision."""

    def __init__(self, path: str):
        try:
            import tracegate
        except ImportError:
            raise OracleError("the `tracegate` Python module is not installed (run scripts/setup.sh)") from None
        if not Path(path).is_file():  # a FIFO would block the reader
            raise OracleError(f"--force-decisions {path}: not a regular file")
        try:
            t = tracegate.Trace(path)
            # The digest recorded with the forced run must be that of the bytes the choices came from.
            t.verify()
        except tracegate.TraceError as e:
            raise OracleError(f"--force-decisions {path}: not a valid trace: {e}".splitlines()[0]) from None
        self.path = str(path)
        self.digest = t.digest
        self.decisions = {n: np.array(v, dtype=np.int64) for n, v in t.decisions.items()}
        self._provenance = t.provenance

    def _refuse(self, what: str) -> OracleError:
        return OracleError(f"--force-decisions {self.path}: {what}")

    def check_prompt(self, tokens) -> None:
        theirs = self._provenance.get("prompt_tokens")
        if theirs is not None and list(theirs) != [int(t) for t in tokens]:
            raise self._refuse(f"its prompt_tokens {theirs} are not this run's {[int(t) for t in tokens]}")

    def check_weights(self, weights_digest: str | None) -> None:
        theirs = self._provenance.get("weights_digest")
        if isinstance(theirs, str) and weights_digest is not None and theirs != weights_digest:
            raise self._refuse(f"its weights_digest {theirs} is not this run's {weights_digest}")

    def require(self, name: str, rows: int | None, width: int | None, value_range: int) -> int:
        """Decision `name` exists, has `width` values per row (rank 1 when None) and, when `rows`
        is given, that many rows; values in [0, value_range), none twice in a row. Returns rows."""
        v = self.decisions.get(name)
        if v is None:
            raise self._refuse(f"decision {name} is missing (this run needs it)")
        want = [str(rows) if rows is not None else "rows"] + ([str(width)] if width is not None else [])
        ok = v.ndim == (1 if width is None else 2) and (rows is None or v.shape[0] == rows) and (width is None or v.shape[1] == width)
        if not ok:
            raise self._refuse(f"decision {name} has shape {list(v.shape)}, this run needs [{', '.join(want)}]")
        for r, row in enumerate(v.reshape(v.shape[0], -1)):
            bad = [int(x) for x in row if not 0 <= int(x) < value_range]
            if bad:
                raise self._refuse(f"decision {name} row {r}: value {bad[0]} outside [0, {value_range})")
            for i, x in enumerate(row):
                if x in row[:i]:
                    raise self._refuse(f"decision {name} row {r}: value {int(x)} repeated (position {i})")
        return int(v.shape[0])

    def values(self, name: str) -> np.ndarray | None:
        return self.decisions.get(name)

    def provenance(self, records: list[tuple[str, int]]) -> dict:
        return {
            "trace": self.path,
            "trace_digest": self.digest,
            "decisions": [n for n, _ in records],
            "rows_overridden": sum(k for _, k in records),
            "overridden": {n: k for n, k in records if k > 0},
        }


class RouterForcing:
    """While active, every MoE router of `lay` takes the forced experts for its rows at positions
    the forcing trace holds (row i of `layer.NN.router.topk` is position i's); rows at other
    positions (generated tokens) route themselves. `positions` is set per forward by the caller."""

    def __init__(self, lay, forcing: Forcing):
        self.lay, self.forcing = lay, forcing
        self.positions: list[int] = []
        self._undo = []

    def __enter__(self):
        for L in self.lay.moe_layers:
            forced = self.forcing.values(f"layer.{L:02d}.router.topk")
            if forced is not None:
                self._wrap(L, self.lay.router(L), forced)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False

    def _wrap(self, L: int, router, forced: np.ndarray):
        import torch
        from torch.overrides import TorchFunctionMode

        outer = self
        orig = router.forward  # the bound forward of transformers' router class

        class Topk(TorchFunctionMode):
            calls = 0

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if func in (torch.topk, torch.Tensor.topk):
                    self.calls += 1
                    probs = args[0]
                    if probs.dim() != 2 or len(outer.positions) != probs.shape[0] or probs.shape[1] != router.num_experts:
                        raise OracleError(f"--force-decisions: cannot force routing of {outer.lay.family} layer {L}: its "
                                          f"router took top-k of a {list(probs.shape)} tensor, not [rows {len(outer.positions)}, "
                                          f"num_experts {router.num_experts}]")
                    vals, idx = out.values.clone(), out.indices.clone()
                    for r, p in enumerate(outer.positions):
                        if p < forced.shape[0]:
                            idx[r] = torch.as_tensor(forced[p], device=idx.device)
                    # The router's own probabilities at the forced experts.
                    vals = torch.gather(probs, -1, idx)
                    return torch.return_types.topk((vals, idx))
                return out

        def forward(*args, **kwargs):
            mode = Topk()
            with mode:
                result = orig(*args, **kwargs)
            if mode.calls != 1:
                fam = self.lay.family
                raise OracleError(f"--force-decisions: cannot force routing of {fam} layer {L}: its router "
                                  f"({type(router).__name__}) called torch.topk {mode.calls} times, not once")
            return result

        router.forward = forward  # instance attribute shadows the class method
        self._undo.append(lambda: router.__dict__.pop("forward", None))
