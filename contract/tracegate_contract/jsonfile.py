"""JSON as the engine's parser (serde_json) accepts it: nesting deeper than its limit is refused
with one line naming the file, never a `RecursionError`, and a caller can learn whether the
top-level object repeats a key. A JSON input file is read as the engine reads it
(trace/src/json.rs): one regular file of at most `MAX_JSON_LEN` bytes, no object repeating a key."""

from __future__ import annotations

import json
import os
import stat

from .errors import ContractError

# trace/src/json.rs MAX_JSON_LEN: the most bytes a JSON input file may hold.
MAX_JSON_LEN = 64 << 20


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_bytes(path, shown: str, limit: int = MAX_JSON_LEN) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes. Opened with O_NONBLOCK (a
    FIFO would block the open until a writer came) and checked by fstat of the opened file, so
    what is read is what was checked; the read stops one byte past the bound. FileNotFoundError
    passes through (callers name what is missing); anything else is a ContractError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ContractError(f"{shown}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ContractError(
                f"{shown}: not a regular file ({_kind(st.st_mode)}): "
                "a JSON input is one regular file"
            )
        if st.st_size > limit:
            raise ContractError(
                f"{shown}: {st.st_size} bytes, more than the limit of {limit} for a JSON input"
            )
        chunks, got = [], 0
        while got <= limit:
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
    except OSError as e:
        raise ContractError(f"{shown}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if got > limit:
        raise ContractError(
            f"{shown}: grew past the limit of {limit} bytes for a JSON input while being read"
        )
    return b"".join(chunks)


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
