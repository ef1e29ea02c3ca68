"""Capture-point names (docs/capture-points.md), built and parsed here and nowhere else in Python,
and the capture-point registry (``POINTS``, ``FAMILIES``: read from the Rust one,
``tracegate_trace::names::POINTS``, so there is one table).

A name is ``[decode.SSSS.][layer.NN.[expert.EEE.]]POINT``, or for a diffusion model
(docs/diffusion-gemma.md DG16) ``encode.BBBB.``, ``denoise.BBBB.SSSS.`` or ``denoise.BBBB.`` in
place of the decode prefix. Numbers are written zero-padded to at
least 4, 2 and 3 digits and read with every digit they have, so layer 100 is ``layer.100.x``,
never read as layer 10. The Rust side is ``tracegate_trace::names``; both follow the same rules.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from ._native import capture_families, capture_points

__all__ = [
    "FAMILIES",
    "Diffusion",
    "POINTS",
    "Name",
    "Point",
    "decode",
    "denoise",
    "denoise_block",
    "encode",
    "expert",
    "family_has",
    "layer",
    "layer_prefix",
    "parse",
    "point",
]


def layer(layer: int, point: str) -> str:
    """``layer.NN.POINT``: ``layer(3, "mlp_out")`` is ``layer.03.mlp_out``."""
    return f"layer.{layer:02d}.{point}"


def layer_prefix(layer: int) -> str:
    """``layer.NN.``, the prefix of every name of that layer."""
    return f"layer.{layer:02d}."


def expert(layer: int, expert: int, point: str) -> str:
    """``layer.NN.expert.EEE.POINT``: ``expert(1, 7, "out")`` is ``layer.01.expert.007.out``."""
    return f"layer.{layer:02d}.expert.{expert:03d}.{point}"


def decode(step: int, rest: str) -> str:
    """``decode.SSSS.REST``: ``decode(2, "logits")`` is ``decode.0002.logits``."""
    return f"decode.{step:04d}.{rest}"


def denoise(block: int, step: int, rest: str) -> str:
    """``denoise.BBBB.SSSS.REST``: step ``step`` of diffusion block ``block``
    (docs/diffusion-gemma.md DG16): ``denoise(1, 3, "logits")`` is ``denoise.0001.0003.logits``."""
    return f"denoise.{block:04d}.{step:04d}.{rest}"


def denoise_block(block: int, rest: str) -> str:
    """``denoise.BBBB.REST``: a decision of block ``block`` as a whole (``init_canvas``,
    ``commit``): ``denoise_block(0, "commit")`` is ``denoise.0000.commit``."""
    return f"denoise.{block:04d}.{rest}"


def encode(block: int, rest: str) -> str:
    """``encode.BBBB.REST``: the encoder pass over block ``block``'s committed canvas:
    ``encode(0, "embed.out")`` is ``encode.0000.embed.out``. The prompt's pass is unprefixed."""
    return f"encode.{block:04d}.{rest}"


class Diffusion(NamedTuple):
    """A diffusion model's pass: ``kind`` ``encode`` (``encode.BBBB.``, the encoder over block
    ``block``'s committed canvas), ``denoise`` (``denoise.BBBB.SSSS.``, step ``step``) or ``block``
    (``denoise.BBBB.``, the block's own decisions; ``step`` None)."""

    kind: str
    block: int
    step: int | None = None

    def __str__(self) -> str:
        if self.kind == "encode":
            return f"encode.{self.block:04d}."
        if self.kind == "denoise":
            return f"denoise.{self.block:04d}.{self.step:04d}."
        return f"denoise.{self.block:04d}."


class Name(NamedTuple):
    """A name taken apart; one without the prefixes is all ``point``. ``diffusion`` is a
    diffusion model's pass (never together with a decode step)."""

    decode_step: int | None
    layer: int | None
    expert: int | None
    point: str
    diffusion: Diffusion | None = None

    def without_step(self) -> Name:
        return self._replace(decode_step=None)

    def __str__(self) -> str:
        out = ""
        if self.decode_step is not None:
            out += f"decode.{self.decode_step:04d}."
        if self.diffusion is not None:
            out += str(self.diffusion)
        if self.layer is not None:
            out += f"layer.{self.layer:02d}."
        if self.expert is not None:
            out += f"expert.{self.expert:03d}."
        return out + self.point


_NUMBERED = {
    p: re.compile(rf"{p}([0-9]+)\.(.*)", re.S)
    for p in ("decode.", "layer.", "expert.", "encode.", "denoise.", "")
}


def _numbered(prefix: str, s: str) -> tuple[int | None, str]:
    m = _NUMBERED[prefix + "." if prefix else ""].fullmatch(s)
    return (int(m.group(1)), m.group(2)) if m else (None, s)


def parse(name: str) -> Name:
    """Takes ``name`` apart: ``parse("decode.0001.layer.100.mlp_out")`` is
    ``Name(decode_step=1, layer=100, expert=None, point="mlp_out")``."""
    step, rest = _numbered("decode", name)
    diffusion = None
    if step is None:
        diffusion, rest = _diffusion(rest)
    lay, rest = _numbered("layer", rest)
    exp, rest = _numbered("expert", rest) if lay is not None else (None, rest)
    return Name(step, lay, exp, rest, diffusion)


def _diffusion(s: str) -> tuple[Diffusion | None, str]:
    block, rest = _numbered("encode", s)
    if block is not None:
        return Diffusion("encode", block), rest
    block, rest = _numbered("denoise", s)
    if block is None:
        return None, s
    step, after = _numbered("", rest)
    if step is not None:
        return Diffusion("denoise", block, step), after
    return Diffusion("block", block), rest


class Point(NamedTuple):
    """One registered capture point: ``name`` after its prefixes; ``scope`` model, layer or
    expert; ``kind`` tensor or decision; ``block`` (input, attention, router, experts,
    feed_forward, residual, embedding, head); ``capture`` default or internals; ``token_axis``
    (None: not token-major); ``stored`` computed (the producer's dtype) or f32; ``needs`` the
    feature a layer must have (any, softmax_attention, linear_attention, output_gate, moe,
    shared_expert); ``in_decode`` never, also or only (written per decode step as
    ``decode.SSSS.`` + its name); ``shard`` how a rank of a sharded run may hold it besides
    replicated: ``{"slice_axis": int | None, "partial": bool, "experts": bool}``
    (docs/trace-format.md, "Sharded traces")."""

    name: str
    scope: str
    kind: str
    block: str
    capture: str
    token_axis: int | None
    stored: str
    needs: str
    in_decode: str
    shard: dict | None = None

    def example(self, layer_no: int = 0, expert_no: int = 0) -> str:
        """A full name of this point: ``layer.00.mlp_out``, ``layer.00.expert.000.out``."""
        if self.scope == "model":
            return self.name
        if self.scope == "layer":
            return layer(layer_no, self.name)
        return expert(layer_no, expert_no, self.name)


POINTS: tuple[Point, ...] = tuple(Point(**p) for p in capture_points())
FAMILIES: dict[str, tuple[str, ...]] = {f: tuple(v) for f, v in capture_families().items()}


def point(name: str) -> Point | None:
    """The registered point ``name`` is an instance of (decode step, layer and expert numbers
    set aside); None for a name outside the registry."""
    n = parse(name)
    scope = "model" if n.layer is None else ("layer" if n.expert is None else "expert")
    return next((p for p in POINTS if p.scope == scope and p.name == n.point), None)


def family_has(model_type: str, p: Point) -> bool | None:
    """Whether family ``model_type`` has point ``p``; None for a family not in the registry."""
    features = FAMILIES.get(model_type)
    return None if features is None else (p.needs == "any" or p.needs in features)
