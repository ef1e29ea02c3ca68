"""Capture-point names (docs/capture-points.md), built and parsed here and nowhere else in Python.

A name is ``[decode.SSSS.][layer.NN.[expert.EEE.]]POINT``. Numbers are written zero-padded to at
least 4, 2 and 3 digits and read with every digit they have, so layer 100 is ``layer.100.x``,
never read as layer 10. The Rust side is ``tracegate_trace::names``; both follow the same rules.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["Name", "decode", "expert", "layer", "layer_prefix", "parse"]


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


class Name(NamedTuple):
    """A name taken apart; one without the prefixes is all ``point``."""

    decode_step: int | None
    layer: int | None
    expert: int | None
    point: str

    def without_step(self) -> Name:
        return self._replace(decode_step=None)

    def __str__(self) -> str:
        out = ""
        if self.decode_step is not None:
            out += f"decode.{self.decode_step:04d}."
        if self.layer is not None:
            out += f"layer.{self.layer:02d}."
        if self.expert is not None:
            out += f"expert.{self.expert:03d}."
        return out + self.point


_NUMBERED = {p: re.compile(rf"{p}\.([0-9]+)\.(.*)", re.S) for p in ("decode", "layer", "expert")}


def _numbered(prefix: str, s: str) -> tuple[int | None, str]:
    m = _NUMBERED[prefix].fullmatch(s)
    return (int(m.group(1)), m.group(2)) if m else (None, s)


def parse(name: str) -> Name:
    """Takes ``name`` apart: ``parse("decode.0001.layer.100.mlp_out")`` is
    ``Name(decode_step=1, layer=100, expert=None, point="mlp_out")``."""
    step, rest = _numbered("decode", name)
    lay, rest = _numbered("layer", rest)
    exp, rest = _numbered("expert", rest) if lay is not None else (None, rest)
    return Name(step, lay, exp, rest)
