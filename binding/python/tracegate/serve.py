"""`PRODUCER serve`: one process answers many protocol requests (docs/producers.md, "Serving").

Shared by the contract and the oracle (both need this package anyway) so the loop exists once.

stdin: one request per line, ``{"argv": [VERB, ARG, ...]}``: exactly the words the per-call form
takes after the program (``trace --model DIR ...``). stdout: one answer per request, in order,
``{"exit": N}`` with N the exit status the per-call process would have had. Everything the
producer itself prints (its digest line, a library's chatter, tracebacks) goes to stderr, so
stdout carries answers only. EOF on stdin ends the worker (exit 0); so does the end of the
process that started it (the gate), even while a request runs.

Never stale: before each request the worker compares the size and mtime of every tracegate
module it has imported (``tracegate*`` in ``sys.modules``, the compiled binding included) with
what they were when it imported them, and likewise the ``__init__`` of torch, transformers and
numpy (a ``pip install`` of another version rewrites it); once one changed it answers
``{"stale": WHY}`` instead of running the request and exits, and the gate starts a fresh worker for it (a resident worker
outlives the edit that changed them). Test-only hooks: ``TRACEGATE_SERVE_WATCH`` (one more file
to watch), ``TRACEGATE_SERVE_STALE_CHECK=0`` (no check: the negative control) and
``TRACEGATE_SERVE_TEST_SLEEP=S`` (each request first says so on stderr and sleeps S seconds: a
request in flight). Each is read strictly (``switch``, ``seconds``): a value outside what is
accepted ends the worker, exit 2, with one line naming it, never a default (issue 51).

A request may carry ``"cwd": ABS`` (a resident worker serves gate runs of several project roots):
the worker runs it in that directory, with that directory as ``sys.path[0]`` where ``python -m``
had put its starting one, as a per-call process started there would.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback


def _exit_status(code) -> int:
    # As the interpreter maps SystemExit's code to a process status.
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _watch_parent(ppid: int) -> None:
    # A gate killed mid-request cannot close our stdin in time to matter; leave with it.
    while True:
        time.sleep(1.0)
        if os.getppid() != ppid:
            os._exit(1)


def _stat(path: str):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns)


# The pinned stack a trace depends on: an upgrade rewrites each package's __init__.py.
_STACK = ("torch", "transformers", "numpy")


class _Imported:
    """The files of the tracegate modules imported so far, and of the stack's top-level packages
    (``_STACK``), with their (size, mtime) when first seen (a module imported during a request is
    recorded right after it)."""

    def __init__(self) -> None:
        self.seen: dict[str, tuple[int, int] | None] = {}
        watch = os.environ.get("TRACEGATE_SERVE_WATCH")
        if watch:
            self.seen[watch] = _stat(watch)
        self.update()

    def update(self) -> None:
        for name, mod in list(sys.modules.items()):
            path = getattr(mod, "__file__", None)
            ours = name.split(".")[0].startswith("tracegate")
            if (ours or name in _STACK) and path and path not in self.seen:
                self.seen[path] = _stat(path)

    def changed(self) -> str | None:
        for path, was in self.seen.items():
            now = _stat(path)
            if now != was:
                return f"{path} changed since the worker imported it (size, mtime {was} -> {now})"
        return None


_SWITCH = "1, true, yes, on (on) or 0, false, no, off (off), any case"


class SettingError(ValueError):
    """A setting's value that is not accepted; its message is the one line to print."""


def switch(name: str) -> bool | None:
    """The switch ``name``: None when unset; the words the gate's switches take (the Rust
    ``tracegate_producers::settings``), anything else refused."""
    v = os.environ.get(name)
    if v is None:
        return None
    low = v.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise SettingError(f"{name}={v!r} is not accepted: {name} takes {_SWITCH}")


def seconds(name: str) -> float | None:
    """The number of seconds ``name``: None when unset; a finite number >= 0, else refused."""
    v = os.environ.get(name)
    if v is None:
        return None
    try:
        s = float(v)
    except ValueError:
        s = float("nan")
    if not (0 <= s < float("inf")):
        raise SettingError(f"{name}={v!r} is not accepted: {name} takes a number of seconds >= 0")
    return s


def serve(main, argv0: str) -> int:
    """Run ``main(argv) -> int`` once per request line. ``sys.argv`` is set per request to
    ``[argv0, *argv]`` as the per-call process would see it (the oracle records it as its command)."""
    try:
        stale_check = switch("TRACEGATE_SERVE_STALE_CHECK") is not False
        sleep = seconds("TRACEGATE_SERVE_TEST_SLEEP") or 0.0
    except SettingError as e:
        print(f"error: serve: {e}", file=sys.stderr, flush=True)
        return 2
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # fd 1 (and sys.stdout, which writes to it) now goes to stderr
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    imported = _Imported() if stale_check else None
    path0 = sys.path[0] if sys.path and sys.path[0] == os.getcwd() else None
    for line in sys.stdin:
        if not line.strip():
            continue
        stale = imported and imported.changed()
        if stale:
            answers.write(json.dumps({"stale": stale}) + "\n")
            return 0
        try:
            req = json.loads(line)
            argv = req["argv"]
            if not (isinstance(argv, list) and all(isinstance(a, str) for a in argv)):
                raise ValueError("argv is not a list of strings")
            cwd = req.get("cwd")
            if cwd is not None:
                if not isinstance(cwd, str):
                    raise ValueError("cwd is not a string")
                try:
                    os.chdir(cwd)
                except OSError as e:
                    raise ValueError(f"cwd {cwd!r}: {e}") from e
                if path0 is not None and sys.path and sys.path[0] == path0:
                    path0 = sys.path[0] = os.getcwd()
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            print(f"error: serve: bad request line {line.strip()[:200]!r}: {e}", file=sys.stderr)
            status = 2
        else:
            sys.argv = [argv0, *argv]
            if sleep:
                print(
                    f"serve: test sleep of {sleep:g} s before the request",
                    file=sys.stderr,
                    flush=True,
                )
                time.sleep(sleep)
            try:
                status = _exit_status(main(argv))
            except SystemExit as e:  # argparse refusals, as in the per-call form
                status = _exit_status(e.code)
            except Exception:  # a bug keeps its traceback, as an uncaught exception would
                traceback.print_exc()
                status = 1
        if imported:
            imported.update()
        sys.stdout.flush()
        sys.stderr.flush()
        answers.write(json.dumps({"exit": status}) + "\n")
    return 0
