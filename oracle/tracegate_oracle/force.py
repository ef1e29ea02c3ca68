"""`--force-decisions TRACE`: router top-k and greedy tokens taken from another trace instead of
computed, so the model's numbers can be compared past a decision that flipped legitimately
(docs/producers.md, "Forced decisions").

Routing is forced without re-implementing any router: while transformers' own router module
runs, the one `torch.topk` it calls on its probabilities is answered with the forced experts and
the router's own probabilities at them; everything after — its renormalisation, its dtype cast,
the experts loop — is transformers' code. A router that does not call `torch.topk` exactly once
on `[rows, num_experts]` is refused for forcing, naming the family and layer. Greedy tokens are
forced by feeding the forced token to the next generation step.

`intercept_topk` is that interception, the one every router tap uses: the recording of
`router.topk` (capture.Tap, diffusion_gemma) reads the experts torch.topk chose there, and
`forced_answer` replaces the rows the forcing trace holds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from tracegate import names
from tracegate_contract.force import Forcing as _ContractForcing

from .errors import OracleError


def shadow(obj, attr: str, new):
    """Set `new` as `obj`'s instance attribute `attr` (it shadows the class's); returns the undo,
    which restores what was there: accelerate's hook (--device-map auto) is such an attribute of
    a module's `forward` too, and must survive the capture."""
    had, prev = attr in obj.__dict__, obj.__dict__.get(attr)
    setattr(obj, attr, new)
    return lambda: setattr(obj, attr, prev) if had else obj.__dict__.pop(attr, None)


class Forcing(_ContractForcing):
    """The contract's reader of the forcing trace (the same checks and refusals), raising the
    oracle's error, after a preflight that keeps a FIFO from blocking the reader."""

    error = OracleError

    def __init__(self, path: str):
        try:
            import tracegate  # noqa: F401
        except ImportError:
            raise OracleError(
                "the `tracegate` Python module is not installed (run scripts/setup.sh)"
            ) from None
        if not Path(path).is_file():  # a FIFO would block the reader
            raise OracleError(f"--force-decisions {path}: not a regular file")
        super().__init__(path)


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
            forced = self.forcing.values(names.layer(L, "router.topk"))
            if forced is not None:
                self._wrap(L, self.lay.router(L), forced)
        return self

    def __exit__(self, *exc):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False

    def _wrap(self, L: int, router, forced: np.ndarray):
        fam = self.lay.family
        self._undo.append(
            intercept_topk(
                router,
                refuse=lambda calls: (
                    f"--force-decisions: cannot force routing of {fam} layer {L}: its router "
                    f"({type(router).__name__}) called torch.topk {calls} times, not once"
                ),
                answer=forced_answer(fam, L, router, forced, lambda: self.positions),
            )
        )


def forced_answer(family: str, L: int, router, forced: np.ndarray, positions):
    """An `answer` for intercept_topk: torch's own indices with row r replaced by the forcing
    trace's row p where it holds one, p = positions()[r] (the positions of this forward's rows).
    A top-k of a tensor other than `[rows, num_experts]` is refused, naming family and layer."""

    def answer(probs, own):
        import torch

        rows = positions()
        if probs.dim() != 2 or len(rows) != probs.shape[0] or probs.shape[1] != router.num_experts:
            raise OracleError(
                f"--force-decisions: cannot force routing of {family} layer {L}: its "
                f"router took top-k of a {list(probs.shape)} tensor, not [rows {len(rows)}, "
                f"num_experts {router.num_experts}]"
            )
        idx = own.clone()
        for r, p in enumerate(rows):
            if p < forced.shape[0]:
                idx[r] = torch.as_tensor(forced[p], device=idx.device)
        return idx

    return answer


def intercept_topk(router, refuse, answer=None, after=None):
    """Shadow `router`'s forward (transformers' router module; `shadow`) so that the one
    `torch.topk` it calls on its probabilities is seen. At that call `answer(probs, own)` — the
    tensor torch.topk was given and the indices torch returned — may return other indices to
    answer with, their values the router's own probabilities at them (`probs` gathered), or None
    to let torch's answer stand. After the forward `after(result, own, used)` gets what the router
    returned, torch's own indices, and the indices the router was answered with (`own` itself
    when not replaced). A forward that calls torch.topk other than once raises
    OracleError(refuse(calls)) before `after`. Returns the undo."""
    import torch
    from torch.overrides import TorchFunctionMode

    class Topk(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls, self.own, self.used = 0, None, None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.topk, torch.Tensor.topk):
                self.calls += 1
                self.own = self.used = out.indices
                idx = answer(args[0], out.indices) if answer is not None else None
                if idx is not None:
                    self.used = idx
                    return torch.return_types.topk((torch.gather(args[0], -1, idx), idx))
            return out

    orig = router.forward  # the bound forward of transformers' router class (or accelerate's hook)

    def forward(*args, **kwargs):
        mode = Topk()
        with mode:
            result = orig(*args, **kwargs)
        if mode.calls != 1:
            raise OracleError(refuse(mode.calls))
        if after is not None:
            after(result, mode.own, mode.used)
        return result

    return shadow(router, "forward", forward)
