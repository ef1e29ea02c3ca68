"""The contract writes each tensor as it is recorded (issue 54 item 1; docs/benchmarks.md,
"Streaming"): its peak memory does not grow with its trace, and a run that fails leaves nothing
at --out."""

import os
import subprocess
import sys

import pytest
import tracegate

from conftest import FIXTURES, deep_model_dir, peak_grows_with_trace, peak_rss_of_trace

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="peak memory is read from Linux's /proc"
)


def test_a_contract_trace_streams_so_peak_memory_does_not_grow_with_it(tmp_path):
    """A prompt twice as long (128 -> 256 tokens) grows the `--capture internals` trace of a
    32-layer model by ~25 MB and the contract's peak memory by far less than 3/4 of that.
    Negative control: the same runs with the stream planted to keep every tensor until its
    finish (how the contract wrote before it streamed) break the rule."""
    model = deep_model_dir(tmp_path / "deep")

    def runs(hold: str) -> tuple[int, int]:
        (p0, s0), (p1, s1) = (
            peak_rss_of_trace("contract", model, tmp_path / f"{t}.trace", t, hold)
            for t in (128, 256)
        )
        return p1 - p0, s1 - s0

    d_peak, d_trace = runs("-")
    print(f"trace +{d_trace >> 20} MiB, peak +{d_peak >> 20} MiB", end="; ")
    assert d_trace > 20 << 20, f"the trace grew by {d_trace} bytes only"
    assert not peak_grows_with_trace(d_peak, d_trace), (
        f"peak RSS grew by {d_peak} bytes for {d_trace} more trace bytes"
    )
    held_peak, held_trace = runs("tracegate_contract.capture:Stream.tensor")
    print(f"held: peak +{held_peak >> 20} MiB")
    assert held_trace == d_trace, "the planted hold changed what is written"
    assert peak_grows_with_trace(held_peak, held_trace), (
        f"a contract holding its trace grew its peak by {held_peak} bytes only: the rule is blind"
    )


def _contract(*args):
    return subprocess.run(
        [sys.executable, "-m", "tracegate_contract", *args], capture_output=True, text=True
    )


def test_a_failed_run_leaves_nothing_at_out(tmp_path):
    """A refusal raised once tensors are written (the forcing trace's weights are checked at
    the end, against this run's) leaves no trace and no temporary. Control: the same run
    without the forcing trace writes its trace."""
    dense = FIXTURES["dense"]
    forcing = tmp_path / "other.trace"
    other = tmp_path / "other"
    other.mkdir()
    for f in os.listdir(dense):  # the same model, other weights bytes (a changed README is not)
        data = open(os.path.join(dense, f), "rb").read()
        if f == "model.safetensors":
            data = data[:-4] + bytes(4)
        (other / f).write_bytes(data)
    r = _contract("trace", "--model", str(other), "--tokens", "1,2,3", "--out", str(forcing))
    assert r.returncode == 0, r.stderr
    out = tmp_path / "run" / "forced.trace"
    out.parent.mkdir()
    args = ["trace", "--model", dense, "--tokens", "1,2,3", "--out", str(out)]
    r = _contract(*args, "--force-decisions", str(forcing))
    assert r.returncode == 2 and "is not this run's" in r.stderr, r.stderr
    assert os.listdir(out.parent) == [], "a refused run left a file"
    r = _contract(*args)
    assert r.returncode == 0 and tracegate.Trace(out).digest == r.stdout.split()[0], r.stderr


def test_a_failing_rank_leaves_no_rank_trace(tmp_path, monkeypatch):
    """Rank 1 fails once both ranks have written tensors (its `shard` attribute of layer 1's
    first point raises): neither rank's trace nor any temporary remains. Control: the same
    run without the defect writes both rank files."""
    from tracegate_contract import run, shard

    out = str(tmp_path / "r{rank}.trace")

    def sharded():
        return run.trace_sharded(
            FIXTURES["dense"], [1, 2, 3], out, True, 0, True, ["test"], shard.parse("tp=2")
        )

    attribute = shard.attribute

    def broken(place, cfg, name):
        if place.rank == 1 and name == "layer.01.hidden_in":
            raise ValueError("rank 1 broke")
        return attribute(place, cfg, name)

    monkeypatch.setattr(shard, "attribute", broken)
    with pytest.raises(ValueError, match="rank 1 broke"):
        sharded()
    assert os.listdir(tmp_path) == [], "a failed sharded run left a file"
    monkeypatch.setattr(shard, "attribute", attribute)
    assert [os.path.basename(p) for _, p in sharded()] == ["r0.trace", "r1.trace"]
