"""A JSON input file read as the Rust side reads it (trace/src/json.rs): one regular file of at
most `MAX_JSON_LEN` bytes. The contract and the oracle read their users' JSON through this one
function and say the refusal in their own error type."""

from __future__ import annotations

import os
import stat

# trace/src/json.rs MAX_JSON_LEN: the most bytes a JSON input file may hold.
MAX_JSON_LEN = 64 << 20


class JsonInputError(ValueError):
    """A JSON input refused before it was parsed; the message names the file and why."""


def file_kind(mode: int) -> str:
    """What a path that is not a regular file is, in words (for a one-line refusal)."""
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def read_bytes(path, shown, limit: int = MAX_JSON_LEN) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes. Opened with O_NONBLOCK (a
    FIFO would block the open until a writer came) and checked by fstat of the opened file, so
    what is read is what was checked; the read stops one byte past the bound (a file growing
    while read). FileNotFoundError passes through (callers name what is missing); anything else
    is a JsonInputError naming `shown`."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise JsonInputError(f"{shown}: cannot open: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise JsonInputError(
                f"{shown}: not a regular file ({file_kind(st.st_mode)}): "
                "a JSON input is one regular file"
            )
        if st.st_size > limit:
            raise JsonInputError(
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
        raise JsonInputError(f"{shown}: cannot read: {e.strerror}") from None
    finally:
        os.close(fd)
    if got > limit:
        raise JsonInputError(
            f"{shown}: grew past the limit of {limit} bytes for a JSON input while being read"
        )
    return b"".join(chunks)
