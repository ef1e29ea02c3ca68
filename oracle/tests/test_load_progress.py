"""The oracle's loading progress (tracegate_oracle/checkpoint.py, LoadProgress): a checkpoint of at
least LOAD_PROGRESS_BYTES says each loading phase on stderr, one line each (config, weights with
their size, placement), and transformers' own bars stay off; a smaller one says nothing, so a
refused load stays one line (test_refusals.py). The threshold is lowered here so the tiny fixture
counts as large."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "oracle") not in sys.path:
    sys.path.insert(0, str(ROOT / "oracle"))

import tracegate_oracle as cp  # noqa: E402
from tracegate_oracle import checkpoint  # noqa: E402

MODEL = ROOT / "fixtures" / "tiny-qwen3"


def data_bytes(path: Path) -> int:
    """A safetensors file's data region: the file less its 8-byte length and its header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return path.stat().st_size - 8 - n


def test_a_large_load_says_each_phase_and_a_small_one_nothing(capsys, monkeypatch):
    cp.load_model(MODEL, cp.RunConfig())
    assert capsys.readouterr().err == "", "a model below the threshold says nothing"

    monkeypatch.setattr(checkpoint, "LOAD_PROGRESS_BYTES", 0)
    cp.load_model(MODEL, cp.RunConfig(dtype="bf16"))
    err = capsys.readouterr().err
    size = data_bytes(MODEL / "model.safetensors")
    assert size > 1 << 10
    lines = err.splitlines()
    assert [line.split(": ")[1] for line in lines] == ["config", "weights", "placement"], err
    pfx = f"[oracle] loading {MODEL}: "
    assert all(line.startswith(pfx) for line in lines), err
    assert lines[0].endswith("qwen3, 5 layers, shapes checked on the meta device"), err
    kib = f"{size / 1024:.2f} KiB" if size < 1 << 20 else f"{size / (1 << 20):.2f} MiB"
    assert f"weights: {kib} in 1 safetensors file (" in lines[1], (size, err)
    assert lines[1].endswith("tensors), loading as bf16"), err
    assert lines[2] == pfx + "placement: every module on cpu", err
    # No bar of transformers' ("Loading weights" with carriage returns) in a captured log.
    assert "\r" not in err and "Loading weights" not in err, err
