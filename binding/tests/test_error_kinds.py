"""`TraceError.kind`: the container's refusal named as a stable string, the message unchanged
(docs/trace-format.md, "Refusals in Python")."""

import re
from pathlib import Path

import numpy as np
import pytest
import tracegate
from tracegate._native import ERROR_KINDS

ROOT = Path(__file__).resolve().parents[2]


def _sample(path) -> bytes:
    """A one-tensor trace at `path` (64 f32 of 0..15 at offset 64), its bytes."""
    with tracegate.TraceWriter(path, {}) as w:
        w.tensor("x", np.arange(16, dtype=np.float32))
    return path.read_bytes()


def _refusal(action):
    with pytest.raises(tracegate.TraceError) as e:
        action()
    return e.value.kind, str(e.value)


def test_the_reader_refusals_are_matched_by_kind_with_their_messages_unchanged(tmp_path):
    """Each file is refused as its own kind (a truncated one, a foreign one, an edited payload),
    with the message the binding raised before it had kinds, written out here."""
    p = tmp_path / "a.trace"
    data = _sample(p)
    assert tracegate.Trace(p).verify() is None  # the intact file: no refusal to name

    p.write_bytes(data[:100])
    assert _refusal(lambda: tracegate.Trace(p)) == (
        "TooShort",
        f"{p}: malformed trace: file is 100 bytes, shorter than header + footer (104)",
    )
    p.write_bytes(data[:-1])
    assert _refusal(lambda: tracegate.Trace(p)) == (
        "NoFooter",
        f"{p}: malformed trace: no footer: the file is truncated or was never finished",
    )
    p.write_bytes(b"GGUF" + data[4:])
    assert _refusal(lambda: tracegate.Trace(p)) == (
        "BadMagic",
        f"{p}: malformed trace: bad magic [47, 47, 55, 46, 41, 43, 45, 00] "
        '(expected "TGTRACE\\0"): not a tracegate trace',
    )
    edited = bytearray(data)
    edited[64] ^= 1  # the first payload byte
    p.write_bytes(bytes(edited))
    t = tracegate.Trace(p)  # well formed: opening does not hash payloads
    assert _refusal(t.verify) == (
        "TensorDigestMismatch",
        f'{p}: edited after capture: tensor "x" (bytes 64..128) no longer matches its xxh3-128',
    )


def test_other_refusals_have_kinds_and_only_compare_has_none(tmp_path):
    # The container's writer, and the binding's own checks before it: the same kind.
    with tracegate.TraceWriter(tmp_path / "w.trace", {}) as w:
        w.tensor("x", np.zeros(2, np.float32))
        assert _refusal(lambda: w.tensor("x", np.zeros(2, np.float32))) == (
            "Invalid",
            'invalid trace content: duplicate tensor name "x"',
        )
        assert _refusal(lambda: w.tensor("c", np.zeros(2, np.complex64)))[0] == "Invalid"
    assert _refusal(lambda: w.tensor("late", np.zeros(1, np.float32))) == (
        "Invalid",
        "trace writer is already finished or aborted",
    )
    assert _refusal(lambda: tracegate.TraceWriter(tmp_path / "no" / "a.trace", {})) == (
        "NotFound",
        f"{tmp_path / 'no' / 'a.trace'}: the directory {tmp_path / 'no'} does not exist",
    )
    assert _refusal(lambda: tracegate.Trace(tmp_path / "missing.trace"))[0] == "Io"
    assert _refusal(lambda: tracegate.parse_shard("rank=2/2;partial"))[0] == "Invalid"
    # compare words an unreadable trace as its finding: no kind, and it says so (None).
    (tmp_path / "bad.trace").write_bytes(b"x" * 200)
    kind, message = _refusal(
        lambda: tracegate.compare(tmp_path / "w.trace", tmp_path / "bad.trace")
    )
    assert kind is None and "bad magic" in message


def _documented() -> dict[str, list[str]]:
    """The kinds docs/trace-format.md lists under "Refusals in Python", by bullet."""
    text = (ROOT / "docs" / "trace-format.md").read_text()
    section = text[text.index("**Refusals in Python.**") :]
    section = section[: section.index("\n\n`kind` is")]
    bullets = section.split("\n- ")[1:]
    names = [re.findall(r"`([A-Z][A-Za-z0-9]+)`", b) for b in bullets]
    return dict(zip(["Malformed", "Tampered", "Error"], names, strict=True))


def test_the_documented_kinds_are_the_bindings():
    """The binding's list is an exhaustive match (a new Rust kind does not build until it is
    named there); the docs list each kind once, under its class, in the same order."""
    by_class: dict[str, list[str]] = {}
    for kind, cls in ERROR_KINDS:
        by_class.setdefault(cls, []).append(kind)
    assert {c: len(k) for c, k in by_class.items()} == {"Malformed": 31, "Tampered": 5, "Error": 5}
    assert _documented() == by_class
    # Negative control: a kind left out of the docs is seen.
    missing = {c: [k for k in ks if k != "NoFooter"] for c, ks in by_class.items()}
    assert _documented() != missing
