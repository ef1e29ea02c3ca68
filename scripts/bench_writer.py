#!/usr/bin/env python3
"""Benchmark (prints ratios; not a test): the trace writer's cost per GB against `ndarray.tofile`
of the same bytes (issue 54 item 1's target: within 1.5x).

    .venv/bin/python scripts/bench_writer.py [GiB=1] [DIR=target/bench]

Writes 16 f32 tensors (GiB in all) through `tracegate.TraceWriter` (the Rust writer every
producer uses: each tensor hashed and written as it is added) and the same arrays with
`ndarray.tofile` into one file; both end with fsync. The writer's file is then opened and
verified, so a fast wrong write cannot pass. The two writes
alternate, 5 each, after a `sync`; the figures are medians. On a tmpfs DIR (`/dev/shm`) the
ratio is the writer's CPU cost against numpy's; on a disk it includes the device.
"""

import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import tracegate

PROVENANCE = {"producer": "bench_writer", "model": "none"}


def timed(fn) -> float:
    os.sync()  # the previous run's dirty pages are written back before this one is timed
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> int:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    out = Path(sys.argv[2] if len(sys.argv) > 2 else "target/bench")
    out.mkdir(parents=True, exist_ok=True)
    n = 16
    per = max(1, int(gib * (1 << 30)) // n // 4)
    arrays = [np.sin(np.arange(per, dtype=np.float32) + i) for i in range(n)]
    total = sum(a.nbytes for a in arrays)
    trace, plain = out / "bench_writer.trace", out / "bench_writer.bin"

    def write_trace():
        w = tracegate.TraceWriter(str(trace))
        for i, a in enumerate(arrays):
            w.tensor(f"layer.{i:02}.hidden_out", a.reshape(1, -1), path="prefill", mask="causal")
        w.set_provenance(PROVENANCE)
        w.finish()
        with open(trace, "rb") as f:
            os.fsync(f.fileno())

    def write_plain():
        with open(plain, "wb") as f:
            for a in arrays:
                a.tofile(f)
            f.flush()
            os.fsync(f.fileno())

    # Alternated, so page-cache writeback and disk state weigh on both alike.
    runs = [(timed(write_trace), timed(write_plain)) for _ in range(5)]
    tw = statistics.median(t for t, _ in runs)
    pw = statistics.median(p for _, p in runs)
    t = tracegate.Trace(str(trace))
    t.verify()
    assert len(t) == n and np.array_equal(t["layer.03.hidden_out"].ravel(), arrays[3])
    gb = total / 1e9
    print(f"payload: {n} tensors, {total / (1 << 30):.2f} GiB in {out}")
    print(f"trace writer + fsync: {tw:.3f} s ({tw / gb:.3f} s/GB)")
    print(f"ndarray.tofile + fsync: {pw:.3f} s ({pw / gb:.3f} s/GB)")
    print(f"RATIO writer / tofile = {tw / pw:.2f} (target <= 1.5)")
    trace.unlink()
    plain.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
