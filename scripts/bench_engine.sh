#!/usr/bin/env bash
# Engine vs torch fp32 on CPU, same model, prompts and thread count (an observation, not a test).
#   scripts/bench_engine.sh [--preset bench|0.6b|moe|qwen3_5-moe] [--model DIR] [--threads 1,2,all]
#                           [--repeat N] [--prefill 64,512] [--decode 32]
# Defaults: --preset bench, --threads 1,2,all, --repeat 3, --prefill 64,512, --decode 32. The
# model dir defaults to /tmp/bench-qwen3, /tmp/bench-qwen3-0.6b, /tmp/bench-qwen3-moe or
# /tmp/bench-qwen3_5-moe and is generated with scripts/make_fixtures.py if it has no config.json.
# Each repeat runs the engine, then torch, back to back, per thread count; every ratio is the
# median of the per-pair ratios with their min–max. Also printed: the engine's decode GB/s
# (weight bytes one token reads / time per token) against the machine's read and copy bandwidth
# on the same threads, peak RSS against the f32 weight size, and for a hybrid model which
# Gated DeltaNet functions torch ran (always transformers' torch references). See
# docs/benchmarks.md.
# Environment: PY (python with torch + transformers; default .venv/bin/python, else python3),
# BENCH_BIN (a prebuilt engine bench binary: skips cargo, e.g. on a machine without Rust).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESET=bench MODEL= THREADS=1,2,all REPEAT=3 PREFILL=64,512 DECODE=32
usage() { sed -n '2,16p' "$0" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) PRESET=${2:?}; shift 2 ;;
    --model) MODEL=${2:?}; shift 2 ;;
    --threads) THREADS=${2:?}; shift 2 ;;
    --repeat) REPEAT=${2:?}; shift 2 ;;
    --prefill) PREFILL=${2:?}; shift 2 ;;
    --decode) DECODE=${2:?}; shift 2 ;;
    *) echo "bench_engine.sh: unknown argument $1" >&2; usage ;;
  esac
done
case "$PRESET" in
  bench) FIXTURE=bench-qwen3 ;;
  0.6b) FIXTURE=bench-qwen3-0.6b ;;
  moe) FIXTURE=bench-qwen3-moe ;;
  qwen3_5-moe) FIXTURE=bench-qwen3_5-moe ;;
  *) echo "bench_engine.sh: --preset must be bench, 0.6b, moe or qwen3_5-moe, not $PRESET" >&2; exit 2 ;;
esac
MODEL=${MODEL:-/tmp/$FIXTURE}
if [ -z "${PY:-}" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
[ -f "$MODEL/config.json" ] || $PY scripts/make_fixtures.py "$FIXTURE" --out "$MODEL"
BIN=${BENCH_BIN:-}
if [ -z "$BIN" ]; then
  cargo build -q --release -p tracegate-engine --example bench
  BIN=target/release/examples/bench
fi
ALL=$(nproc)
RESULTS=$(mktemp)
trap 'rm -f "$RESULTS"' EXIT
echo "preset $PRESET ($MODEL), prefill $PREFILL tokens, $DECODE cached greedy decode steps;" \
  "$REPEAT repeats, each an engine run then a torch run; load average $(cut -d' ' -f1-3 /proc/loadavg), $ALL cores"
for t in ${THREADS//,/ }; do
  [ "$t" = all ] && t=$ALL
  for _ in $(seq "$REPEAT"); do
    e=$("$BIN" "$MODEL" "$t" "$PREFILL" "$DECODE")
    o=$($PY scripts/bench_torch.py "$MODEL" "$t" "$PREFILL" "$DECODE" 2>/dev/null)
    echo "{\"threads\": $t, \"engine\": $e, \"torch\": $o}" >>"$RESULTS"
  done
done
$PY - "$RESULTS" <<'PY'
import json
import statistics as st
import sys

runs = [json.loads(line) for line in open(sys.argv[1])]
gib = 2**30


def span(xs, scale=1.0, fmt="{:.1f}"):
    xs = [x * scale for x in xs]
    return f"{fmt.format(st.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


for t in dict.fromkeys(r["threads"] for r in runs):
    rs = [r for r in runs if r["threads"] == t]
    e0 = rs[0]["engine"]
    print(f"threads {t} (engine kernel {e0['kernel']}), median (min–max) over {len(rs)} pairs:")
    for n in e0["prefill_s"]:
        e = [r["engine"]["prefill_s"][n] for r in rs]
        o = [r["torch"]["prefill_s"][n] for r in rs]
        ratio = [a / b for a, b in zip(e, o)]
        print(f"  prefill {n:>4} tok  engine {span(e, 1e3)} ms  torch {span(o, 1e3)} ms  "
              f"ratio {span(ratio, fmt='{:.2f}')}x")
    e = [r["engine"]["decode_s_per_token"] for r in rs]
    o = [r["torch"]["decode_s_per_token"] for r in rs]
    ratio = [a / b for a, b in zip(e, o)]
    print(f"  decode per token  engine {span(e, 1e3)} ms  torch {span(o, 1e3)} ms  "
          f"ratio {span(ratio, fmt='{:.2f}')}x")
    gb = e0["decode_weight_bytes_per_token"] / 1e9
    print(f"  decode reads {gb:.3f} GB of weights per token: "
          f"{span([r['engine']['decode_gbps'] for r in rs])} GB/s; this machine on {t} threads: "
          f"read {span([r['engine']['read_gbps'] for r in rs])} GB/s, "
          f"copy {span([r['engine']['copy_gbps'] for r in rs])} GB/s")
    rss = max(r["engine"]["peak_rss_bytes"] for r in rs)
    f32 = e0["f32_weight_bytes"]
    print(f"  peak RSS (max) {rss / gib:.2f} GiB (mapped pages included) vs f32 weights "
          f"{f32 / gib:.2f} GiB: {rss / f32:.2f}x")
    agree = [sum(a == b for a, b in zip(r["engine"]["tokens"], r["torch"]["tokens"])) for r in rs]
    steps = len(rs[0]["torch"]["tokens"])
    print("  greedy tokens agree: " + ", ".join(f"{a}/{steps}" for a in agree))
    paths = rs[0]["torch"].get("torch_paths")
    if paths:
        bypassed = {k: v for r in rs for m in r["torch"]["torch_paths"].values() for k, v in m.items()}
        print("  torch Gated DeltaNet: transformers' torch references"
              + (f" (bypassed: {bypassed})" if bypassed else " (nothing else was bound)"))
PY
