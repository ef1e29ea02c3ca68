"""JSON as the engine's parser (serde_json) accepts it: nesting deeper than its limit is refused
with one line naming the file, never a `RecursionError`, and a caller can learn whether the
top-level object repeats a key. A JSON input file is read as the engine reads it
(trace/src/json.rs): one regular file of at most `MAX_JSON_LEN` bytes, no object repeating a key."""

from __future__ import annotations

import json

from tracegate.jsonfile import MAX_JSON_LEN, JsonInputError
from tracegate.jsonfile import read_bytes as _read_bytes

from .errors import ContractError

__all__ = ["MAX_JSON_LEN", "read_bytes", "loads", "loads_unique"]


def read_bytes(path, shown: str, limit: int = MAX_JSON_LEN) -> bytes:
    """tracegate.jsonfile.read_bytes, its refusal a ContractError."""
    try:
        return _read_bytes(path, shown, limit)
    except JsonInputError as e:
        raise ContractError(str(e)) from None


def loads_unique(text, where: str, parse_float=None):
    """`text` parsed as `loads` does, refusing any object (at any depth) that repeats a key:
    json keeps the last of two equal keys silently."""

    def pairs(kv):
        seen: set = set()
        for k, _ in kv:
            if k in seen:
                raise _Repeated(k)
            seen.add(k)
        return dict(kv)

    try:
        return _parse(text, where, parse_float, pairs)
    except _Repeated as e:
        raise ContractError(f"{where}: duplicate key {e.args[0]!r}") from None


class _Repeated(ValueError):
    pass


# serde_json's recursion limit: 127 nested arrays/objects parse, 128 do not.
MAX_DEPTH = 127


def _too_deep(v) -> bool:
    stack = [(v, 1)]
    while stack:  # iterative: the value may be as deep as Python's own parser allowed
        x, depth = stack.pop()
        if isinstance(x, (dict, list)):
            if depth > MAX_DEPTH:
                return True
            stack.extend((c, depth + 1) for c in (x.values() if isinstance(x, dict) else x))
    return False


def loads(text, where: str, parse_float=None):
    """Parse `text`; returns (value, first key the top-level object repeats or None)."""
    repeats: list = []

    def pairs(kv):
        seen: set = set()
        repeats.append(next((k for k, _ in kv if k in seen or seen.add(k)), None))
        return dict(kv)

    v = _parse(text, where, parse_float, pairs)
    # Objects complete innermost first, so the top-level one is the last seen.
    return v, (repeats[-1] if isinstance(v, dict) else None)


def _parse(text, where: str, parse_float, pairs):
    try:
        v = json.loads(text, parse_float=parse_float, object_pairs_hook=pairs)
    except _Repeated:
        raise
    except RecursionError:
        raise ContractError(
            f"{where} is not valid JSON: nested deeper than {MAX_DEPTH} levels"
        ) from None
    except (UnicodeDecodeError, ValueError) as e:  # JSONDecodeError is a ValueError
        raise ContractError(f"{where} is not valid JSON: {e}") from None
    if _too_deep(v):
        raise ContractError(f"{where} is not valid JSON: nested deeper than {MAX_DEPTH} levels")
    return v
