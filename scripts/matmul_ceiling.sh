#!/usr/bin/env bash
# The prefill ceiling under docs/numerics.md (an observation, not a test):
#   scripts/matmul_ceiling.sh [ROWS=64] [SHAPES=bench|0.6b]
# Runs engine/examples/matmul_ceiling.rs (one core: the peak rate of vector multiply-then-add
# pairs and of FMA; the engine's matmul on a benchmark preset's prefill shapes, ROWS × in × out),
# then times torch's fp32 sgemm (`F.linear`, best of 10) on the same shapes with 1 and 2
# threads, and prints each rate as a fraction of the matching peak and the lowest engine/torch
# time any engine without FMA could reach (its time at the no-FMA peak over torch's). See
# docs/benchmarks.md ("Why the prefill ratio ...").
# Environment: PY (python with torch; default .venv/bin/python, else python3), CEILING_BIN (a
# prebuilt matmul_ceiling binary: skips cargo, e.g. on a machine without Rust).
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS=${1:-64}
SHAPES=${2:-bench}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
BIN=${CEILING_BIN:-}
if [ -z "$BIN" ]; then
  cargo build -q --release -p tracegate-engine --example matmul_ceiling
  BIN=target/release/examples/matmul_ceiling
fi
echo "load average $(cut -d' ' -f1-3 /proc/loadavg), $(nproc) cores"
E=$("$BIN" "$ROWS" "$SHAPES")
echo "$E"
$PY - "$E" <<'PY'
import json
import sys
import time

import torch
import torch.nn.functional as F

e = json.loads(sys.argv[1])
peaks = e["peak_gflops"]
width = "avx512" if "avx512_fma" in peaks else "avx2"
nofma, fma = peaks[f"{width}_mul_add"], peaks[f"{width}_fma"]
print(
    f"one core, {width}: multiply-then-add peak {nofma:.1f} GFLOP/s, FMA peak {fma:.1f} GFLOP/s"
    f" (no-FMA / FMA = {nofma / fma:.2f}); engine kernel {e['kernel']}"
)


def torch_gflops(rows: int, k: int, n: int, threads: int) -> float:
    torch.set_num_threads(threads)
    x, w = torch.randn(rows, k), torch.randn(n, k)
    for _ in range(3):
        F.linear(x, w)
    best = float("inf")
    for _ in range(10):
        t0 = time.perf_counter()
        F.linear(x, w)
        best = min(best, time.perf_counter() - t0)
    return 2 * rows * k * n / best / 1e9


print(
    "| shape (rows × in × out) | per forward | engine 1 core GFLOP/s (% of no-FMA peak) |"
    " torch 1 thread (% of FMA peak) | torch 2 threads (% of 2 × FMA peak) |"
    " engine/torch 1 thread | floor: no-FMA peak/torch, 1 thread | 2 threads |"
)
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
tot = {"flop": 0.0, "engine": 0.0, "t1": 0.0, "t2": 0.0}
for s in e["shapes"]:
    rows, k, n, per = s["rows"], s["in"], s["out"], s["per_forward"]
    g_e, g1, g2 = s["gflops"], torch_gflops(rows, k, n, 1), torch_gflops(rows, k, n, 2)
    flop = 2.0 * rows * k * n * per
    tot["flop"] += flop
    tot["engine"] += flop / g_e
    tot["t1"] += flop / g1
    tot["t2"] += flop / g2
    print(
        f"| {s['name']} ({rows} × {k} × {n}) | {per} | {g_e:.1f} ({g_e / nofma:.0%}) |"
        f" {g1:.1f} ({g1 / fma:.0%}) | {g2:.1f} ({g2 / (2 * fma):.0%}) | {g1 / g_e:.2f}× |"
        f" {g1 / nofma:.2f}× | {g2 / (2 * nofma):.2f}× |"
    )
floor = tot["flop"] / nofma
print(
    f"| one forward's matmuls | | {tot['flop'] / tot['engine']:.1f}"
    f" ({tot['flop'] / tot['engine'] / nofma:.0%}) | {tot['flop'] / tot['t1']:.1f}"
    f" ({tot['flop'] / tot['t1'] / fma:.0%}) | {tot['flop'] / tot['t2']:.1f}"
    f" ({tot['flop'] / tot['t2'] / (2 * fma):.0%}) | {tot['engine'] / tot['t1']:.2f}× |"
    f" {floor / tot['t1']:.2f}× | {floor / 2 / tot['t2']:.2f}× |"
)
PY
