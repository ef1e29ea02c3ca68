"""A serving oracle keys its loaded model on the checkpoint's content, never on its files' size and
mtime (issue 33 item 2): weights replaced by others of the same size with the old mtime kept (as
`cp -p` and `rsync -a` leave them) are the weights the next request computes with, and the digest
its trace records is theirs; the contract's serving worker likewise. Run from the repo root: .venv/bin/python -m pytest oracle/tests
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
tracegate = pytest.importorskip(
    "tracegate", reason="tracegate binding not built (scripts/setup.sh)"
)

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"
TOKENS = "3,17,5,9,5,5,42"


def _replace_weights_keeping_size_and_mtime(ck: Path) -> None:
    """model.safetensors rewritten with other weights (the embedding's rows reversed in place: the
    same header, so the same size), renamed over the old one (a new inode, as rsync leaves it),
    its atime and mtime set back to the old ones to the nanosecond."""
    f = ck / "model.safetensors"
    old = f.stat()
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    meta = json.loads(data[8 : 8 + n])["model.embed_tokens.weight"]
    start, end = (8 + n + o for o in meta["data_offsets"])
    rows, cols = meta["shape"]
    width = (end - start) // rows
    body = bytes(data[start:end])
    data[start:end] = b"".join(body[r * width : (r + 1) * width] for r in reversed(range(rows)))
    assert cols and bytes(data[start:end]) != body
    tmp = ck / "new.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, f)
    os.utime(f, ns=(old.st_atime_ns, old.st_mtime_ns))
    new = f.stat()
    # What the old cache keyed on is unchanged; only the bytes differ.
    assert (new.st_size, new.st_mtime_ns) == (old.st_size, old.st_mtime_ns)


class _Worker:
    """`python -m MODULE serve`, asked over its stdin/stdout as the gate asks it."""

    def __init__(self, module: str, err: Path):
        self._err = open(err, "w")
        self.p = subprocess.Popen(
            [sys.executable, "-m", module, "serve"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env={**os.environ, "TRACEGATE_SERVE_STALE_CHECK": "0"},
        )

    def ask(self, argv: list[str]) -> int:
        self.p.stdin.write(json.dumps({"argv": argv}) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, "the worker ended without answering"
        return json.loads(line)["exit"]

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=120)
        self._err.close()


def _trace(ck: Path, out: Path) -> list[str]:
    return ["trace", "--model", str(ck), "--tokens", TOKENS, "--out", str(out)]


def _tensors(path: Path) -> dict:
    tr = tracegate.Trace(str(path))
    return {n: tr[n] for n in tr.names}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


# The contract keeps no model between requests; it is held to the same (a size-and-mtime cache
# added to its serve loop fails it).
@pytest.mark.parametrize("module", ["tracegate_oracle", "tracegate_contract"])
def test_weights_replaced_with_the_same_size_and_mtime_are_the_ones_served(tmp_path, module):
    ck = tmp_path / "ck"
    shutil.copytree(DENSE, ck)
    w = _Worker(module, tmp_path / "worker.err")
    try:
        assert w.ask(_trace(ck, tmp_path / "before.trace")) == 0
        old_digest = tracegate.weights_digest(str(ck))
        _replace_weights_keeping_size_and_mtime(ck)
        new_digest = tracegate.weights_digest(str(ck))
        assert new_digest != old_digest
        assert w.ask(_trace(ck, tmp_path / "after.trace")) == 0
    finally:
        w.close()
    # What a fresh process computes with the new weights (nothing cached): a real one, not
    # oracle_runner's fork server (whose children share the server's imports).
    subprocess.run(
        [sys.executable, "-m", module, *_trace(ck, tmp_path / "fresh.trace")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    before, after, fresh = (_tensors(tmp_path / f"{t}.trace") for t in ("before", "after", "fresh"))
    # Negative control: the replacement changes what is computed (else the check below could not
    # tell old weights from new).
    assert not _same(before, fresh)
    assert _same(after, fresh), "the served trace was computed with the old weights"
    prov = tracegate.Trace(str(tmp_path / "after.trace")).provenance
    assert prov["weights_digest"] == new_digest
    assert (
        tracegate.Trace(str(tmp_path / "before.trace")).provenance["weights_digest"] == old_digest
    )


def test_an_unchanged_checkpoint_is_loaded_once(tmp_path, monkeypatch):
    """The cache still serves: the same content is not loaded twice (the other side of keying on
    content; counted in-process)."""
    from tracegate_oracle import capture as cp
    from tracegate_oracle import cli

    ck = tmp_path / "ck"
    shutil.copytree(DENSE, ck)
    loads = []
    real = cp.load_model
    monkeypatch.setattr(cp, "load_model", lambda d, rc: loads.append(d) or real(d, rc))
    monkeypatch.setattr(cli, "_MODELS", {})
    for i in range(2):
        assert cli.main(_trace(ck, tmp_path / f"{i}.trace")) == 0
    assert len(loads) == 1
    # Touching the files (same content) does not reload either; new content does.
    os.utime(ck / "model.safetensors")
    assert cli.main(_trace(ck, tmp_path / "touched.trace")) == 0
    assert len(loads) == 1
    _replace_weights_keeping_size_and_mtime(ck)
    assert cli.main(_trace(ck, tmp_path / "replaced.trace")) == 0
    assert len(loads) == 2
