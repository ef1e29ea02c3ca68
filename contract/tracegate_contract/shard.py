"""Sharded runs (docs/numerics.md §23): `trace --shards tp=W|ep=W` splits the model over W ranks,
here threads of this process (the claim is the arithmetic, not the transport). Each rank holds
only its blocks of the weights (the `share` methods of model.Model, layer.Layer,
mixers.Attention, feed_forward.Mlp and .Moe) and exchanges values with the other ranks only
through `Carry`, the ordered carry of §23.3; each writes its own trace, whose `shard` attributes
(`attribute`) say what part of each tensor it holds (docs/trace-format.md, "Sharded traces").
`trace-merge` of the rank traces has the one-process trace's content digest.

A one-process run is rank 0 of 1 (`ONE`): the same code, whose carry is rank 0's own steps.
"""

from __future__ import annotations

import argparse
import re
import threading
from typing import NamedTuple

import numpy as np
from tracegate import names

from . import ops
from .errors import ContractError
from .ops import F32

_SPEC = re.compile(r"(tp|ep)=(0|[1-9][0-9]*)")


class Shards(NamedTuple):
    """`--shards MODE=W`: `mode` tp (tensor parallel) or ep (expert parallel), W ranks."""

    mode: str
    world: int

    def __str__(self) -> str:
        return f"{self.mode}={self.world}"


def parse(text: str) -> Shards:
    """`--shards` as argparse reads it: `tp=N` or `ep=N`, N a decimal ≥ 1 without leading zeros."""
    m = _SPEC.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected tp=N or ep=N (N a decimal number ≥ 1), got {text!r}"
        )
    if int(m.group(2)) < 1:
        raise argparse.ArgumentTypeError(f"{text}: the number of ranks must be ≥ 1")
    return Shards(m.group(1), int(m.group(2)))


def refuse_unshardable(cfg, shards: Shards) -> None:
    """§23.5: what a split of §23.1–§23.2 does not allow, in one line naming the numbers."""
    w = shards.world
    if cfg.has_linear_layer():
        raise ContractError(
            f"--shards {shards}: {cfg.model_type} has linear-attention layers (docs/numerics.md §18), "
            "which are not sharded (§23.5)"
        )
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if nh % w or nkv % w:
        raise ContractError(
            f"--shards {shards}: num_attention_heads {nh} and num_key_value_heads {nkv} must both "
            f"be divisible by {w} (docs/numerics.md §23.1)"
        )
    if shards.mode == "ep" and not cfg.num_experts:
        raise ContractError(
            f"--shards {shards}: {cfg.model_type} has no routed experts to split "
            "(ep=N needs a MoE model; tp=N splits the rest)"
        )
    if shards.mode == "ep" and cfg.num_experts % w:
        raise ContractError(
            f"--shards {shards}: num_experts {cfg.num_experts} is not divisible by {w} "
            "(docs/numerics.md §23.5)"
        )


def block(n: int, rank: int, world: int) -> tuple[int, int]:
    """§23.1: rank ρ's contiguous block [⌊ρ·n/W⌋, ⌊(ρ+1)·n/W⌋) of a length n."""
    return rank * n // world, (rank + 1) * n // world


class Abandoned(Exception):
    """Another rank failed: this one stops waiting for it (its own error is the one to say)."""


class Carry:
    """§23.3 the ordered carry among the `world` ranks of one run, the only way ranks exchange
    values. `__call__(rank, start, step)` is called by every rank at the same point of its
    program, in the same order: rank 0 applies its `step` (its own terms, in §2's / §10's
    ascending order) to `start`, hands the accumulator to rank 1, which applies its step to it,
    and so on; rank W−1's accumulator is the result, sent to every rank. The blocks ascend with
    the rank, so the sequence of operations is the one-process loop's, bit for bit.

    The same carry gathers a column-parallel output (a copy, no arithmetic): `step` appends the
    rank's block to the accumulator (`Place.gather`)."""

    def __init__(self, world: int):
        self.world = world
        self._cv = threading.Condition()
        self._box: dict[tuple[str, int, int], np.ndarray] = {}  # (what, carry no., rank)
        self._calls = [0] * world  # carries each rank has entered
        self._abandoned = False

    def __call__(self, rank: int, start: np.ndarray, step) -> np.ndarray:
        if self.world == 1:  # rank 0 is the last: its steps are the whole loop (ONE keeps no state)
            return step(start)
        n = self._calls[rank]
        self._calls[rank] += 1
        acc = step(start if rank == 0 else self._receive(("next", n, rank)))
        if rank + 1 < self.world:
            self._send(("next", n, rank + 1), acc)
            return self._receive(("result", n, rank))
        for r in range(rank):  # the broadcast: every rank holds the result from here on
            self._send(("result", n, r), acc.copy())
        return acc

    def _send(self, key, value: np.ndarray) -> None:
        with self._cv:
            self._box[key] = value
            self._cv.notify_all()

    def _receive(self, key) -> np.ndarray:
        with self._cv:
            while key not in self._box:
                if self._abandoned:
                    raise Abandoned()
                self._cv.wait()
            return self._box.pop(key)

    def abandon(self) -> None:
        """A rank failed: every rank waiting in the carry raises Abandoned."""
        with self._cv:
            self._abandoned = True
            self._cv.notify_all()


class Place:
    """Where a block of weights computes: rank `rank` of `world` in a `mode` (tp, ep) run whose
    ranks exchange through `carry`. `ONE` is the one-process run."""

    def __init__(self, rank: int = 0, world: int = 1, mode: str | None = None, carry=None):
        self.rank, self.world, self.mode = rank, world, mode
        self._carry = carry if carry is not None else Carry(world)

    @property
    def last(self) -> bool:
        """The last rank: it adds a row-parallel projection's bias (§23.3)."""
        return self.rank == self.world - 1

    def block(self, n: int) -> tuple[int, int]:
        return block(n, self.rank, self.world)

    def carry(self, start: np.ndarray, step) -> np.ndarray:
        return self._carry(self.rank, start, step)

    def row_parallel(self, x: np.ndarray, wt: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        """§23.3 x·Wᵀ (+ b) with K split over the ranks: `x` [rows, K block] and `wt` [K block,
        out] are this rank's; the accumulation goes on from the previous rank's. `bias` is held
        by the last rank only, so it is added once, after the whole accumulation (§2)."""
        start = np.zeros((x.shape[0], wt.shape[1]), dtype=F32)
        return self.carry(start, lambda acc: ops.matmul(x, wt, bias, acc))

    def gather(self, local: np.ndarray) -> np.ndarray:
        """A column-parallel output's blocks along the last axis, in rank order (a copy)."""
        start = np.zeros((*local.shape[:-1], 0), dtype=local.dtype)
        return self.carry(start, lambda acc: np.concatenate([acc, local], axis=-1))


ONE = Place()


def attribute(place: Place, cfg, name: str) -> str:
    """The `shard` attribute of tensor `name` on rank `place` (§23.2; docs/trace-format.md):
    a slice of the heads for q, k, v, attn_gate and attn_probs, of the vocabulary for logits,
    `experts` for an expert's output under ep; every other tensor replicated."""
    rank = f"rank={place.rank}/{place.world};"
    n = names.parse(name)

    def sliced(axis: int, size: int) -> str:
        lo, hi = place.block(size)
        return f"{rank}slice;axis={axis};offset={lo};length={hi - lo};size={size}"

    if n.layer is None:
        return sliced(1, cfg.vocab_size) if n.point == "logits" else rank + "replicated"
    if n.expert is not None:
        if place.mode != "ep":
            return rank + "replicated"  # tp: the broadcast result of its carried Wd
        lo, hi = place.block(cfg.num_experts)
        held = ",".join(str(e) for e in range(lo, hi))
        return f"{rank}experts;held={held};of={cfg.num_experts}"
    heads = {
        "q": (1, cfg.num_attention_heads),
        "attn_gate": (1, cfg.num_attention_heads),
        "k": (1, cfg.num_key_value_heads),
        "v": (1, cfg.num_key_value_heads),
        "attn_probs": (0, cfg.num_attention_heads),
    }.get(n.point)
    return rank + "replicated" if heads is None else sliced(*heads)


def run_ranks(carry: Carry, bodies: list) -> list:
    """Runs `bodies[r]()` as rank r, one thread each, and returns their results in rank order.
    When a rank raises, the carry is abandoned (no rank waits for it forever) and the lowest
    rank's own error is raised."""
    results: list = [None] * len(bodies)
    errors: list[BaseException | None] = [None] * len(bodies)

    def run(r: int) -> None:
        try:
            results[r] = bodies[r]()
        except BaseException as e:  # handed to the caller below
            errors[r] = e
            carry.abandon()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not isinstance(e, Abandoned)), None)
    if first is not None:
        raise first
    return results
