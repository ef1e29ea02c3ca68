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
from tracegate import names
from tracegate_contract.force import Forcing as _ContractForcing

from .errors import OracleError


def shadow_forward(module, forward):
    """Set `forward` as `module`'s instance attribute (it shadows the class method); returns the
    undo, which restores what was there: accelerate's hook (--device-map auto) is such an
    attribute too, and must survive the capture."""
    prev = module.__dict__.get("forward")
    module.forward = forward
    return lambda: (
        module.__dict__.pop("forward", None) if prev is None else setattr(module, "forward", prev)
    )


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
                    if (
                        probs.dim() != 2
                        or len(outer.positions) != probs.shape[0]
                        or probs.shape[1] != router.num_experts
                    ):
                        raise OracleError(
                            f"--force-decisions: cannot force routing of {outer.lay.family} layer {L}: its "
                            f"router took top-k of a {list(probs.shape)} tensor, not [rows {len(outer.positions)}, "
                            f"num_experts {router.num_experts}]"
                        )
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
                raise OracleError(
                    f"--force-decisions: cannot force routing of {fam} layer {L}: its router "
                    f"({type(router).__name__}) called torch.topk {mode.calls} times, not once"
                )
            return result

        self._undo.append(shadow_forward(router, forward))
