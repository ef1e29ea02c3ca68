"""The oracle writes each tensor as it is recorded (issue 54 item 1; docs/benchmarks.md,
"Streaming"): its peak memory does not grow with its trace, a run that fails leaves nothing at
--out, and a capture that torch_setup.deterministic runs again starts an empty trace. The
peak-memory helpers are the contract tests' (contract/tests/conftest.py), loaded by path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from binaries import _conftest
from oracle_runner import run_oracle

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"


@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="peak memory is read from Linux's /proc"
)
def test_an_oracle_trace_streams_so_peak_memory_does_not_grow_with_it(tmp_path):
    """A prompt twice as long (128 -> 256 tokens) grows the `--capture internals` trace of a
    32-layer model by ~25 MB and the oracle's peak memory after its load by far less than 3/4
    of that. Negative control: processes holding as many bytes as the two traces break the
    rule. (The contract's test plants the hold in the producer itself; here two more torch
    runs would double the test's time.)"""
    c = _conftest()
    model = c.deep_model_dir(tmp_path / "deep")
    (p0, s0), (p1, s1) = (
        c.peak_rss_of_trace("oracle", model, tmp_path / f"{t}.trace", t) for t in (128, 256)
    )
    d_peak, d_trace = p1 - p0, s1 - s0
    print(f"trace +{d_trace >> 20} MiB, peak +{d_peak >> 20} MiB")
    assert d_trace > 20 << 20, f"the trace grew by {d_trace} bytes only"
    assert not c.peak_grows_with_trace(d_peak, d_trace), (
        f"peak RSS grew by {d_peak} bytes for {d_trace} more trace bytes ({p0} -> {p1})"
    )
    d_held = c.holding_peak(s1) - c.holding_peak(s0)
    assert c.peak_grows_with_trace(d_held, d_trace), (
        f"a process holding {d_trace} more bytes grew by {d_held} only: the rule is blind"
    )


def test_a_refusal_after_the_run_leaves_nothing_at_out(tmp_path):
    """The forcing trace's weights are checked against this run's once the run is done, so
    its tensors are in the temporary when it is refused: no trace and no temporary remain."""
    other = tmp_path / "other"
    other.mkdir()
    for f in DENSE.iterdir():  # the same model, other weights bytes
        data = f.read_bytes()
        (other / f.name).write_bytes(data[:-4] + bytes(4) if f.suffix == ".safetensors" else data)
    forcing = tmp_path / "other.trace"
    r = subprocess.run(
        [sys.executable, "-m", "tracegate_contract", "trace", "--model", str(other)]
        + ["--tokens", "1,2,3", "--out", str(forcing)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run" / "forced.trace"
    out.parent.mkdir()
    r = run_oracle(
        *["trace", "--model", DENSE, "--tokens", "1,2,3"],
        *["--force-decisions", forcing, "--out", out],
    )
    assert r.returncode == 2 and "is not this run's" in r.stderr, r.stderr
    assert list(out.parent.iterdir()) == [], "a refused run left a file"


def test_a_capture_run_again_starts_an_empty_trace(tmp_path, monkeypatch):
    """torch_setup.deterministic runs a capture again when an op refuses determinism (on CUDA,
    mostly): the streamed trace of the second run alone is written, the digest of a run that
    was not repeated. Negative control: without Stream.begin the first run's tensors stay and
    the second's are refused as duplicates."""
    import torch
    from tracegate_oracle import capture as cp
    from tracegate_oracle import records
    from tracegate_oracle.errors import OracleError
    from tracegate_oracle.torch_setup import RunConfig

    rc = RunConfig(device="cpu", dtype="f32", threads=1, seed=0, capture="internals")
    model = cp.load_model(DENSE, rc)
    tokens = [3, 17, 5, 42]

    def streamed(out) -> str:
        with records.Stream(out) as s:
            return s.finish(cp.capture_prompt(model, DENSE, tokens, rc, stream=s))

    once = streamed(tmp_path / "once.trace")

    refused = []

    def refuse_once(mod, args, out):  # as an op that refuses determinism, after layer 0 ran
        if not refused:
            refused.append(1)
            raise RuntimeError("index_add_cpu does not have a deterministic implementation")

    h = model.model.layers[1].register_forward_hook(refuse_once)
    try:
        assert streamed(tmp_path / "again.trace") == once
        assert refused == [1]
        refused.clear()
        begin = records.Stream.begin  # planted: a stream that opens once and never starts again
        monkeypatch.setattr(records.Stream, "begin", lambda s: None if s.writer else begin(s))
        with pytest.raises(OracleError, match="duplicate"):
            streamed(tmp_path / "dup.trace")
        assert refused == [1]
    finally:
        h.remove()
        torch.use_deterministic_algorithms(False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again.trace", "once.trace"]
