"""Gated DeltaNet (Qwen3.5's linear attention) in the oracle: transformers' torch paths, observed.

transformers' Gated DeltaNet calls module-level functions of its modeling file
(`causal_conv1d_fn`, `causal_conv1d_update`, `l2norm`, `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`). The decorated ones are bound at import time to a hub
kernel or an installed `causal_conv1d` / `fla` package when there is one, else to their torch
reference. `TorchPaths` replaces them for the duration of a run with wrappers that call the
torch reference (never a package, whichever is installed) with the arguments transformers'
fallback passes it, and hand their inputs and outputs to an observer: the wrappers select and
reshape, they compute nothing. Everything is restored on exit, also after an error.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

from tracegate import names

FUNCS = (
    "causal_conv1d_fn",
    "causal_conv1d_update",
    "l2norm",
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
)

_active: TorchPaths | None = None


def _modules(lay) -> list:
    return sorted(
        {sys.modules[type(lay.attn(L)).__module__] for L in lay.linear_layers},
        key=lambda m: m.__name__,
    )


def _resolved(fn) -> str:
    """What transformers bound `fn` to at import: its fallback wrapper's `implementation`."""
    impl = inspect.getclosurevars(fn).nonlocals.get("implementation", inspect.unwrap(fn))
    return f"{impl.__module__}.{impl.__qualname__}"


def provenance(lay) -> dict:
    """Per modeling module: the functions run as their torch references, and, for any that
    transformers had bound to something else (a package or hub kernel), what was bypassed."""
    out = {}
    for mod in _modules(lay):
        bypassed = {}
        for name in FUNCS:
            fn = getattr(mod, name)
            fn = fn.orig if isinstance(fn, Wrapped) else fn
            torch_fn = inspect.unwrap(fn)
            bound = _resolved(fn)
            if bound != f"{torch_fn.__module__}.{torch_fn.__qualname__}":
                bypassed[name] = bound
        out[mod.__name__] = {"torch_reference": list(FUNCS), "bypassed": bypassed}
    return out


class Wrapped:
    """A module-level function replaced by its torch reference plus an observer call."""

    def __init__(self, paths: TorchPaths, name: str, orig):
        self.paths, self.name, self.orig = paths, name, orig
        self.torch_fn = inspect.unwrap(orig)
        # transformers' fallback passes only the parameters the implementation names
        self.params = (
            None if orig is self.torch_fn else set(inspect.signature(self.torch_fn).parameters)
        )

    def __call__(self, *args, **kwargs):
        if self.params is not None:
            kwargs = {k: v for k, v in kwargs.items() if k in self.params}
        obs = self.paths.observer
        if obs is None:
            return self.torch_fn(*args, **kwargs)
        return obs(self.name, self.torch_fn, args, kwargs)


class TorchPaths:
    """Context manager: the model's Gated DeltaNet runs transformers' torch references, and
    `observer(name, fn, args, kwargs)` (when set) makes each call. Re-entrant: an inner use
    for the same model reuses the active one."""

    def __init__(self, lay):
        self.lay = lay
        self.observer = None
        self._undo: list = []

    def __enter__(self):
        global _active
        if _active is not None:
            self._outer = _active
            return _active
        self._outer = None
        for mod in _modules(self.lay):
            for name in FUNCS:
                orig = getattr(mod, name)
                setattr(mod, name, Wrapped(self, name, orig))
                self._undo.append((mod, name, orig))
        _active = self
        return self

    def __exit__(self, *exc):
        global _active
        if self._outer is not None:
            return False
        for mod, name, orig in reversed(self._undo):
            setattr(mod, name, orig)
        self._undo.clear()
        _active = None
        return False


def active_paths() -> TorchPaths | None:
    return _active


def torch_paths(lay):
    """TorchPaths for a hybrid model, else nothing to do."""
    return TorchPaths(lay) if lay.linear_layers else contextlib.nullcontext()


class LinearTap:
    """The internals of one prefill call of a tapped linear-attention layer (no cache: the
    call's rows are the layer's whole input, from a zero state), in capture order:
    `linear.conv_out` [rows, conv_dim] (conv1d + SiLU, q|k|v channels as in_proj_qkv lays them
    out), `linear.q` / `linear.k` [rows, key_heads, key_dim] (after L2 normalisation, before the
    query scale; one per key head, the first of its repeated copies), `linear.g` and
    `linear.beta` [rows, value_heads], `linear.core` [rows, value_heads, value_dim] (the delta
    rule's output), `linear.norm_out` [rows, value_heads, value_dim] (gated RMSNorm output),
    `linear.state` [1, value_heads, key_dim, value_dim] (the recurrent state after the last row).
    """

    def __init__(self, module):
        self.module = module
        self.rep = module.num_v_heads // module.num_k_heads
        self.points: dict[str, object] = {}
        self._l2 = []

    def __call__(self, name, fn, args, kwargs):
        if name == "causal_conv1d_fn":
            out = fn(*args, **kwargs)
            self.points["linear.conv_out"] = out[0].transpose(0, 1)
            return out
        if name == "l2norm":
            out = fn(*args, **kwargs)
            self._l2.append(out)  # query first, then key (torch_chunk_gated_delta_rule's order)
            return out
        if name == "torch_chunk_gated_delta_rule":
            wants_state = kwargs.get("output_final_state", False)
            # The state is computed either way; asking for it only keeps it from being dropped.
            core, state = fn(*args, **{**kwargs, "output_final_state": True})
            q, k = self._l2[-2:]
            for point, t in (("linear.q", q), ("linear.k", k)):
                # [1, value_heads, rows, key_dim], each key head repeated `rep` times
                self.points[point] = t[0, :: self.rep].transpose(0, 1)
            self.points["linear.g"] = kwargs["g"][0]
            self.points["linear.beta"] = kwargs["beta"][0]
            self.points["linear.core"] = core[0]
            self.points["linear.state"] = state
            return core, state if wants_state else None
        raise RuntimeError(
            f"linear-attention tap: {name} called in a prefill without cache (transformers internals changed?)"
        )

    def norm_out(self, out):
        rows = self.points["linear.core"].shape[0]
        self.points["linear.norm_out"] = out.reshape(rows, self.module.num_v_heads, -1)

    # The registry's linear-attention points, in its (computation) order.
    ORDER = tuple(p.name for p in names.POINTS if p.needs == "linear_attention")

    def records(self):
        missing = [p for p in self.ORDER if p not in self.points]
        if missing:
            raise RuntimeError(
                f"linear-attention tap: {', '.join(missing)} not seen (transformers internals changed?)"
            )
        return [(p, self.points[p]) for p in self.ORDER]
