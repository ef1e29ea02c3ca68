"""The writer with its provenance given last (docs/trace-format.md, "Writing"): the same bytes as
the writer given it first, nothing at the final path before `finish`, and tensors not held."""

import subprocess
import sys

import numpy as np
import pytest
import tracegate

PROVENANCE = {"producer": "stream-test", "dtype": "f32", "forced_decisions": {"n": 2}}


def _record(w) -> None:
    """Tensors of several dtypes and attributes, and decisions with and without margins."""
    w.tensor("embed", np.arange(24, dtype=np.float32).reshape(2, 3, 4), path="prefill")
    w.tensor("ids", np.array([5, -1, 7], np.int64), positions=[0, 1, 2], extra="a")
    w.tensor("bits", np.array([0x3F80, 0x4000], np.uint16), dtype="bf16", step=3)
    w.tensor("mask", np.array([[True, False]]), mask="causal")
    w.decision("logits.argmax", np.array([3, 1]), margins=[0.5, 0.25])
    w.decision("stop", np.array(1))


def test_provenance_given_last_writes_the_same_bytes_as_given_first(tmp_path):
    first, last, other = tmp_path / "first.trace", tmp_path / "last.trace", tmp_path / "o.trace"
    with tracegate.TraceWriter(first, PROVENANCE) as w:
        _record(w)
    w = tracegate.TraceWriter(last)
    _record(w)
    w.set_provenance({"producer": "not yet"})  # replaced: the last one given is written
    assert not last.exists(), "a streaming trace appeared at its final path before finish()"
    w.set_provenance(PROVENANCE)
    assert w.finish() == tracegate.Trace(first).digest
    assert last.read_bytes() == first.read_bytes()
    assert tracegate.Trace(last).provenance == PROVENANCE
    assert sorted(p.name for p in tmp_path.iterdir()) == ["first.trace", "last.trace"]
    # Negative control: the comparison of bytes sees the provenance (another one, other bytes;
    # the content digest leaves the provenance out, docs/trace-format.md).
    with tracegate.TraceWriter(other) as w:
        _record(w)
        w.set_provenance({**PROVENANCE, "producer": "other"})
    assert other.read_bytes() != first.read_bytes()


def test_finishing_without_a_provenance_is_refused_and_leaves_nothing(tmp_path):
    out = tmp_path / "none.trace"
    with pytest.raises(tracegate.TraceError) as e:
        with tracegate.TraceWriter(out) as w:
            w.tensor("x", np.zeros(4, np.float32))
    assert e.value.kind == "Invalid"
    assert str(e.value) == (
        f"{out}: no provenance to finish the trace with: pass it to "
        "TraceWriter(path, provenance) or to set_provenance() before finish()"
    )
    assert list(tmp_path.iterdir()) == [], "the refused writer's temporary was left behind"
    # The same checks as the constructor's, before anything is replaced.
    w = tracegate.TraceWriter(out)
    with pytest.raises(tracegate.TraceError, match="must be a JSON object"):
        w.set_provenance([1])
    with pytest.raises(tracegate.TraceError, match=r"provenance.big = \d+ does not fit 64 bits"):
        w.set_provenance({"big": 2**70})
    w.abort()
    with pytest.raises(tracegate.TraceError, match="already finished or aborted"):
        w.set_provenance({})


# Writes MB MiB as 2 MiB f32 tensors, made one at a time: `stream` writes each as it is
# made and drops it; `hold` keeps them all, then writes them (a producer collecting its capture
# first). Prints the growth of the process's peak RSS, in MiB, over what it was before the first
# tensor (its RSS then), and the number of tensors in the finished trace.
PEAK_RSS = """
import sys
import numpy as np, tracegate
mode, out, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
def status(field):  # this process's own, in MiB (getrusage's peak is inherited across fork)
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
w = tracegate.TraceWriter(out)
w.tensor("warm", np.zeros(1 << 19, np.float32))
before = status("VmRSS")
held = []
for i in range(mb // 2):
    a = np.full(1 << 19, i, np.float32)
    if mode == "stream":
        w.tensor(f"t{i}", a)
    else:
        held.append(a)
    del a
for i, a in enumerate(held):
    w.tensor(f"t{i}", a)
w.set_provenance({"producer": "rss-test", "tensors": mb // 2})
w.finish()
print(round(status("VmHWM") - before), len(tracegate.Trace(out)))
"""


def _peak_growth(mode: str, out, mb: int) -> int:
    r = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, mode, str(out), str(mb)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    growth, tensors = map(int, r.stdout.split())
    assert tensors == 1 + mb // 2, r.stdout
    return growth


def test_a_streamed_trace_is_not_held_in_memory(tmp_path):
    """200 MiB written through the streaming writer grow the peak RSS by far less than 200 MiB
    (the bound, 40 MiB, leaves room for the allocator and the writer's 1 MiB buffer). Negative
    control: the same tensors held before writing grow it by nearly all of them, so the
    measure sees a trace held in memory."""
    streamed = _peak_growth("stream", tmp_path / "s.trace", 200)
    print(f"peak RSS growth: streamed {streamed} MiB", end=", ")
    assert streamed < 40, f"streaming 200 MiB grew the peak RSS by {streamed} MiB"
    (tmp_path / "s.trace").unlink()
    held = _peak_growth("hold", tmp_path / "h.trace", 200)
    print(f"held {held} MiB")
    assert held > 180, f"holding 200 MiB grew the peak RSS by only {held} MiB: the measure is blind"
