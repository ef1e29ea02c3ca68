"""Text prompts: a prompt given as text, tokenized by the model directory's own tokenizer
(docs/producers.md, "Text prompts").

    python -m tracegate.text --model DIR --text TEXT [--chat]
    python -m tracegate.text --model DIR --prompts FILE

`tokenize(model_dir, text, chat=False)` gives ``{"tokens": [ids], "tokenizer_digest": HEX,
"template": None | the chat template used}``, through
``transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)`` (imported only
here, when asked: ``import tracegate`` never needs transformers). Plain text is ``tok(text)``'s
``input_ids``, with the tokenizer's own special-token rule (a BOS, say, where its post-processor
adds one); with ``chat`` the text is one user message through ``tok.apply_chat_template(...,
add_generation_prompt=True, tokenize=True)``.

**The tokenizer digest** (`tokenizer_digest`; a Rust twin computes the same hex from this text):

    SHA-256, as lowercase hex, over the concatenation, for each name of TOKENIZER_FILES in that
    order (tokenizer.json, tokenizer_config.json, special_tokens_map.json, added_tokens.json,
    tokenizer.model, vocab.json, merges.txt, chat_template.jinja, chat_template.json) that exists
    in the model directory as a regular file (stat following symlinks, as the Hugging Face
    cache's snapshot links are followed; a name that is absent, a directory, a broken link or
    anything but a regular file is skipped), of:
        the name's UTF-8 bytes,
        one 0x00 byte,
        the file's length in bytes as an unsigned 64-bit little-endian integer (8 bytes),
        the file's bytes.
    No other file of the directory takes part (config.json, the weights). A directory holding
    none of the names is refused: "DIR: no tokenizer (looked for tokenizer.json, ...)".

Known answers (pinned in binding/tests/test_text.py): a directory holding only
``tokenizer.json`` with the two bytes ``{}`` digests to
``17120e8581415f4473d7a6fe45a9aca632bfe53e6a6a2ef7c2ab81905d25e7f2``; with also ``merges.txt``
holding the four bytes ``a b\\n`` (``a``, space, ``b``, newline), to
``f0575d0f69217ab81f87d45aebc4e2173b8c6bfb6c86d2af281f4707472b71f7``.

**Bounds** (docs/producers.md, "Text prompts"): a tokenizer file over MAX_TOKENIZER_FILE_BYTES
(256 MiB) is refused from its size before anything reads it (the digest streams files in 1 MiB
chunks); loading the tokenizer, and each text's template and encoding, run under
TRACEGATE_TEXT_TIMEOUT seconds (default 60) and, for a text, TRACEGATE_TEXT_MAX_MB MiB of growth
of resident memory (default 1024), both whole numbers >= 1 read strictly, enforced by an interval
timer's SIGALRM handler in the main thread (`_bounded`); a Rust panic of the tokenizers library
(`pyo3_runtime.PanicException`, not an Exception) is a refusal naming the tokenizer file, its
hook's output held back (`_stderr_held`).

Every refusal is a `TextError` (a ValueError) with a one-line message.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Mapping

__all__ = [
    "TOKENIZER_FILES",
    "TextError",
    "prompt",
    "tokenize",
    "tokenizer_digest",
    "tokenize_prompts",
    "limits",
    "MAX_TOKENIZER_FILE_BYTES",
]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


# A tokenizer file larger than this is refused before anything reads it (the module docstring).
MAX_TOKENIZER_FILE_BYTES = 256 << 20
# What the digest reads of a file at once.
_CHUNK = 1 << 20

TIMEOUT_VAR = "TRACEGATE_TEXT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60
MAX_MB_VAR = "TRACEGATE_TEXT_MAX_MB"
DEFAULT_MAX_MB = 1024
# How often the limits are checked while a step runs.
_TICK_S = 0.05


class TextError(ValueError):
    """A text prompt refused: no tokenizer, no chat template, no transformers, no ids."""


def _whole(name: str, default: int, unit: str) -> int:
    """The setting `name`: a whole number >= 1, digits only; `default` when unset; anything else
    (an empty value too) refused, as the gate's settings are (docs/producers.md, "Settings")."""
    v = os.environ.get(name)
    if v is None:
        return default
    if not (v.isascii() and v.isdigit() and int(v) >= 1):
        eg = {"seconds": 30, "MiB": 2048}[unit]
        raise TextError(
            f"{name}={v!r} is not accepted: {name} takes a whole number of {unit}, at least 1 "
            f"(e.g. {eg})"
        )
    return int(v)


def limits() -> tuple[int, int]:
    """(seconds, MiB): TRACEGATE_TEXT_TIMEOUT and TRACEGATE_TEXT_MAX_MB, read strictly."""
    return _whole(TIMEOUT_VAR, DEFAULT_TIMEOUT_S, "seconds"), _whole(
        MAX_MB_VAR, DEFAULT_MAX_MB, "MiB"
    )


class _Exceeded(BaseException):
    """Raised by the limits' timer in the main thread. A BaseException, so that no `except
    Exception` (of transformers, jinja2, a template's own) swallows it; turned into a TextError
    where the step began."""


def _rss() -> int | None:
    """This process's resident memory in bytes (Linux's /proc/self/statm), None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


@contextlib.contextmanager
def _bounded(seconds: int, max_mb: int | None):
    """Runs the body under the limits: past `seconds`, or with resident memory grown by more
    than `max_mb` MiB (None: not checked), an interval timer's SIGALRM handler raises _Exceeded
    in the main thread, between two Python bytecodes — which interrupts a Jinja template's loops
    (compiled to Python). Native code (the tokenizers library) is interrupted only when it
    returns to Python: the callers' own deadlines (the engine's, the gate's --timeout) bound it.
    Outside the main thread (where signal handlers cannot be set) the body runs unbounded."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(
        signal, "setitimer"
    ):
        yield
        return
    start, rss0 = time.monotonic(), (_rss() if max_mb is not None else None)
    armed = [True]

    def tick(_signum, _frame):
        if not armed[0]:
            return
        if time.monotonic() - start > seconds:
            armed[0] = False
            raise _Exceeded(f"ran past the time limit of {seconds} s ({TIMEOUT_VAR})")
        if rss0 is not None:
            now = _rss()
            if now is not None and now - rss0 > max_mb << 20:
                armed[0] = False
                raise _Exceeded(
                    f"grew this process by {(now - rss0) >> 20} MiB, over the limit of "
                    f"{max_mb} MiB ({MAX_MB_VAR})"
                )

    previous = signal.signal(signal.SIGALRM, tick)
    if previous is None:  # a handler not set from Python: it cannot be put back, the default can
        previous = signal.SIG_DFL
    prev_timer = signal.setitimer(signal.ITIMER_REAL, _TICK_S, _TICK_S)
    try:
        yield
    finally:
        try:
            armed[0] = False  # the handler raises at most once, so the restoring below runs
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            if prev_timer[0] > 0:
                signal.setitimer(signal.ITIMER_REAL, *prev_timer)


def _is_panic(e: BaseException) -> bool:
    """A Rust panic that a PyO3 library (tokenizers) let through: `pyo3_runtime.PanicException`,
    a BaseException and not an Exception."""
    return any(c.__name__ == "PanicException" for c in type(e).__mro__)


@contextlib.contextmanager
def _stderr_held():
    """File descriptor 2 goes to a temporary file while the body runs: a Rust panic's hook
    writes its message (and with RUST_BACKTRACE a backtrace) there, not to the user. When the
    body succeeds what was written is passed on (the first MiB); when it raises, dropped: the
    refusal says what happened, in one line."""
    try:
        sys.stderr.flush()
    except (OSError, ValueError, AttributeError):
        pass
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to hold
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            try:
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            if ok:
                held.seek(0)
                said = held.read(_CHUNK)
                if said:
                    os.write(2, said)


def _line(e: BaseException) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _files(d: str):
    """(name, path) of each tokenizer file of `d` that is a regular file, in digest order."""
    for name in TOKENIZER_FILES:
        path = os.path.join(d, name)
        if os.path.isfile(path):  # stat follows symlinks; any failure counts as absent
            yield name, path


def _hash_file(h, name: str, path: str) -> None:
    """Adds `name`'s entry to `h`, reading the file in chunks of _CHUNK bytes (a tokenizer file
    of gigabytes costs the digest one chunk of memory, not its size)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.update(name.encode("utf-8"))
            h.update(b"\x00")
            h.update(size.to_bytes(8, "little"))
            n = 0
            while chunk := f.read(_CHUNK):
                h.update(chunk)
                n += len(chunk)
    except OSError as e:
        raise TextError(f"{path}: cannot read: {e.strerror}") from None
    if n != size:
        raise TextError(f"{path}: changed while it was read ({size} bytes, then {n})")


def tokenizer_digest(model_dir) -> str:
    """SHA-256 hex of the tokenizer files in `model_dir`, as the module docstring defines it."""
    d = os.fspath(model_dir)
    if d.endswith(".gguf") and os.path.isfile(d):
        # A GGUF's tokenizer is its metadata, which this module does not read: its digest would
        # be a second definition beside the files'.
        raise TextError(
            f"{d}: a text prompt needs the tokenizer's files (tokenizer.json, ...), not a GGUF "
            f"file: {GGUF_FIX}"
        )
    if not os.path.isdir(d):
        raise TextError(f"{d}: not a directory")
    h = hashlib.sha256()
    found = False
    for name, path in _files(d):
        _hash_file(h, name, path)
        found = True
    if not found:
        msg = f"{d}: no tokenizer (looked for {', '.join(TOKENIZER_FILES)})"
        # A GGUF directory (its tokenizer in the metadata): the same way out as the file's.
        if any(n.endswith(".gguf") for n in _listing(d)):
            msg += f"; a GGUF's tokenizer is in its metadata, which a text prompt does not read: {GGUF_FIX}"
        raise TextError(msg)
    return h.hexdigest()


# The way out for a GGUF model, as the gate's own tokenizer digest says it
# (gate/src/milestone/tokenizer.rs, GGUF_FIX).
GGUF_FIX = (
    'give token ids (--tokens, or "tokens" in a prompt set), or a directory holding the '
    "tokenizer's files (transformers' AutoTokenizer.from_pretrained(dir, gguf_file=...)"
    ".save_pretrained(dir) writes them; scripts/real_model.py convert does this)"
)


def _listing(d: str) -> list[str]:
    try:
        return os.listdir(d)
    except OSError:
        return []


def _check_sizes(d: str) -> None:
    """Refuses a tokenizer file over MAX_TOKENIZER_FILE_BYTES before anything reads it: the
    tokenizers library and transformers read each file whole."""
    for _, path in _files(d):
        try:
            size = os.stat(path).st_size
        except OSError as e:
            raise TextError(f"{path}: cannot read: {e.strerror}") from None
        if size > MAX_TOKENIZER_FILE_BYTES:
            raise TextError(
                f"{path}: {size} bytes, over the {MAX_TOKENIZER_FILE_BYTES >> 20} MiB a tokenizer "
                "file may have for a text prompt (the tokenizer library reads it whole): refused"
            )


def _tokenizer_file(model_dir: str) -> str:
    """The file a refusal about the tokenizer library names: tokenizer.json where there is one."""
    path = os.path.join(model_dir, "tokenizer.json")
    return path if os.path.isfile(path) else model_dir


def _load(model_dir: str, seconds: int):
    """(the AutoTokenizer of `model_dir`, its tokenizer digest taken before loading it)."""
    _check_sizes(model_dir)
    digest = tokenizer_digest(model_dir)
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise TextError("--text needs transformers (pip install transformers)") from None
    try:
        with _stderr_held(), _bounded(seconds, None):
            tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    except _Exceeded as e:
        raise TextError(f"{model_dir}: loading the tokenizer {e}: refused") from None
    except Exception as e:  # a library's refusal of the user's files: one line, no traceback
        raise TextError(f"{model_dir}: cannot load the tokenizer: {_line(e)}") from None
    except BaseException as e:
        if not _is_panic(e):
            raise  # KeyboardInterrupt, SystemExit: not a refusal
        raise TextError(
            f"{_tokenizer_file(model_dir)}: the tokenizers library panicked loading it: {_line(e)}"
        ) from None
    return tok, digest


def _flat_ids(out) -> list[int] | None:
    """The ids of one sequence: `out` is a BatchEncoding (a Mapping) or the ids themselves; a
    batch of exactly one sequence is taken as that sequence. None when it is neither."""
    if isinstance(out, Mapping):
        out = out.get("input_ids")
    if hasattr(out, "tolist"):  # a tensor or an array, should a tokenizer return one
        out = out.tolist()
    if isinstance(out, (list, tuple)) and len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = out[0]
    if not isinstance(out, (list, tuple)):
        return None
    ids = []
    for t in out:
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            return None
        ids.append(int(t))
    return ids


def _encode(
    tok, model_dir: str, text: str, chat: bool, lim: tuple[int, int]
) -> tuple[list[int], str | None]:
    if not isinstance(text, str) or text == "":
        raise TextError("--text: the text is empty")
    if chat and not getattr(tok, "chat_template", None):
        raise TextError(
            f"--chat: the tokenizer in {model_dir} has no chat template "
            "(tokenizer_config.json chat_template, chat_template.jinja or chat_template.json)"
        )
    how = "the chat template" if chat else "the tokenizer"
    template = None
    try:
        with _stderr_held(), _bounded(*lim):
            if chat:
                template = tok.get_chat_template()
                out = tok.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
                )
            else:
                out = tok(text)
    except _Exceeded as e:
        raise TextError(f"{model_dir}: {how} {e} on the text: refused") from None
    except Exception as e:  # a template that raises, a tokenizer that cannot encode
        raise TextError(f"{model_dir}: {how} failed on the text: {_line(e)}") from None
    except BaseException as e:
        if not _is_panic(e):
            raise  # KeyboardInterrupt, SystemExit: not a refusal
        raise TextError(
            f"{_tokenizer_file(model_dir)}: the tokenizers library panicked on the text: {_line(e)}"
        ) from None
    ids = _flat_ids(out)
    if ids is None:
        raise TextError(
            f"{model_dir}: the tokenizer returned {type(out).__name__}, not one list of token ids"
        )
    if not ids:
        raise TextError(f"--text: {text!r} tokenizes to no ids with the tokenizer in {model_dir}")
    return ids, template


def _check_unchanged(model_dir: str, digest: str) -> None:
    after = tokenizer_digest(model_dir)
    if after != digest:
        raise TextError(
            f"{model_dir}: the tokenizer files changed while they were used "
            f"(tokenizer digest {digest} before, {after} after)"
        )


def tokenize(model_dir, text: str, chat: bool = False) -> dict:
    """``{"tokens": [ids], "tokenizer_digest": HEX, "template": None | str}`` for `text`,
    tokenized by `model_dir`'s own tokenizer (with `chat`: one user message in its chat template,
    with the generation prompt; `template` is that template's source)."""
    d = os.fspath(model_dir)
    if not isinstance(text, str) or text == "":
        raise TextError("--text: the text is empty")
    lim = limits()
    tok, digest = _load(d, lim[0])
    ids, template = _encode(tok, d, text, chat, lim)
    _check_unchanged(d, digest)
    return {"tokens": ids, "tokenizer_digest": digest, "template": template}


# As the gate's refusal says it (gate/src/prompts.rs, SHAPE).
PROMPT_SET_SHAPE = (
    'a prompt set is one JSON object: {"schema": 1, "prompts": [{"id": "short", "tokens": '
    '[3, 17, 5]}, {"id": "hello", "text": "Hello", "chat": true}]} (docs/gate.md, "Prompt sets")'
)


def _kind(v) -> str:
    """What a JSON value is, for a refusal, as the gate says it (gate/src/prompts.rs, kind)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return f"the number {v}"
    if isinstance(v, str):
        return f"the string {json.dumps(v)}"
    return "an array" if isinstance(v, list) else "an object"


def _prompt_set(path: str) -> list[tuple[int, str, str, bool]]:
    """(index, id, text, chat) of every entry of prompt-set `path` that has `text`; entries with
    `tokens` are checked and skipped."""
    from .jsonfile import JsonInputError, read_bytes

    try:
        raw = read_bytes(path, path)
    except FileNotFoundError:
        raise TextError(f"--prompts {path}: no such file") from None
    except JsonInputError as e:
        raise TextError(f"--prompts {e}") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise TextError(f"--prompts {path}: not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise TextError(f"--prompts {path}: the file is {_kind(doc)}: {PROMPT_SET_SHAPE}")
    if doc.get("schema") != 1:
        raise TextError(f"--prompts {path}: schema {doc.get('schema')!r}, expected 1")
    prompts = doc.get("prompts")
    if not isinstance(prompts, list):
        raise TextError(f"--prompts {path}: no `prompts` list")
    out, seen = [], set()
    for i, p in enumerate(prompts):
        pid = p.get("id") if isinstance(p, dict) else None
        where = f"--prompts {path}: prompt {i} (id {pid!r})"
        if not isinstance(p, dict):
            raise TextError(f"{where}: not a JSON object")
        if not isinstance(pid, str) or not pid:
            raise TextError(f"{where}: `id` must be a non-empty string")
        if pid in seen:
            raise TextError(f"{where}: id given twice")
        seen.add(pid)
        has_text, has_tokens = "text" in p, "tokens" in p
        if has_text and has_tokens:
            raise TextError(f"{where}: has both `text` and `tokens` (give one)")
        if not has_text and not has_tokens:
            raise TextError(f"{where}: has neither `text` nor `tokens`")
        chat = p.get("chat", False)
        if not isinstance(chat, bool):
            raise TextError(f'{where}: field "chat" is {_kind(chat)}, expected true or false')
        if has_tokens:
            if chat:
                raise TextError(f"{where}: `chat` goes only with `text`")
            continue
        text = p["text"]
        if not isinstance(text, str) or text == "":
            raise TextError(f"{where}: `text` must be a non-empty string")
        out.append((i, pid, text, chat))
    return out


def prompt(model_dir, text: str, chat: bool = False) -> tuple[list[int], dict]:
    """A producer's `trace --text TEXT [--chat]`: the ids, and the provenance record
    `prompt_text` (docs/producers.md, "Text prompts") that goes beside `prompt_tokens`."""
    t = tokenize(model_dir, text, chat)
    return t["tokens"], {
        "text": text,
        "chat": chat,
        "template": t["template"],
        "tokenizer_digest": t["tokenizer_digest"],
    }


def tokenize_prompts(model_dir, path) -> dict:
    """``{"tokenizer_digest": HEX, "prompts": {ID: {"tokens": [...], "template": ...}}}`` for
    every entry of prompt-set `path` that has `text` (one tokenizer load for them all)."""
    d, path = os.fspath(model_dir), os.fspath(path)
    entries = _prompt_set(path)
    lim = limits()
    tok, digest = _load(d, lim[0])
    result = {}
    for i, pid, text, chat in entries:
        try:
            ids, template = _encode(tok, d, text, chat, lim)
        except TextError as e:
            raise TextError(f"--prompts {path}: prompt {i} (id {pid!r}): {e}") from None
        result[pid] = {"tokens": ids, "template": template}
    _check_unchanged(d, digest)
    return {"tokenizer_digest": digest, "prompts": result}


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise TextError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m tracegate.text",
        description="Tokenize a text prompt (or a prompt set's text prompts) with the model "
        "directory's own tokenizer; prints one JSON line.",
    )
    p.add_argument("--model", required=True, help="model dir holding the tokenizer files")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="the prompt text (--text=-x for a text starting with -)")
    src.add_argument("--prompts", metavar="FILE", help="a prompt-set JSON file (schema 1)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="with --text: one user message in the tokenizer's chat template",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        a = _parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        if a.chat and a.text is None:
            raise TextError("--chat goes only with --text (a prompt set says `chat` per prompt)")
        if a.text is not None:
            result = tokenize(a.model, a.text, a.chat)
        else:
            result = tokenize_prompts(a.model, a.prompts)
    except TextError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
