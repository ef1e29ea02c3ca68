#!/usr/bin/env bash
# Engine vs torch fp32 on CPU, same model, prompt and thread count (an observation, not a test).
#   scripts/bench_engine.sh [MODEL_DIR] [THREADS]      (defaults: /tmp/bench-qwen3, 2)
# Generates the bench model with scripts/make_fixtures.py if MODEL_DIR lacks one. Prints
# prefill ratio (target ≤ 2× torch), decode per-token ratio (target ≤ 1×) and peak RSS vs the
# model's f32 weight size. See docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-/tmp/bench-qwen3}
THREADS=${2:-2}
PREFILL=64
DECODE=32
PY=.venv/bin/python
[ -f "$MODEL/config.json" ] || $PY scripts/make_fixtures.py bench-qwen3 --out "$MODEL"
cargo build -q --release -p tracegate-engine --example bench
ENGINE_JSON=$(target/release/examples/bench "$MODEL" "$THREADS" $PREFILL $DECODE)
TORCH_JSON=$($PY scripts/bench_torch.py "$MODEL" "$THREADS" $PREFILL $DECODE 2>/dev/null)
$PY - "$ENGINE_JSON" "$TORCH_JSON" "$THREADS" <<'PY'
import json, sys
e, t, threads = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
print(f"threads {threads}, prefill 64 tokens, 32 cached greedy decode steps")
print(f"prefill   engine {e['prefill_s']*1e3:8.1f} ms   torch {t['prefill_s']*1e3:8.1f} ms   ratio {e['prefill_s']/t['prefill_s']:.2f}x (target <= 2)")
print(f"decode    engine {e['decode_s_per_token']*1e3:8.1f} ms/tok torch {t['decode_s_per_token']*1e3:8.1f} ms/tok ratio {e['decode_s_per_token']/t['decode_s_per_token']:.2f}x (target <= 1)")
print(f"peak RSS  engine {e['peak_rss_bytes']/2**20:8.1f} MiB (mapped bf16 pages included) vs f32 weights {e['f32_weight_bytes']/2**20:.1f} MiB: {e['peak_rss_bytes']/e['f32_weight_bytes']:.2f}x")
print(f"greedy tokens agree: {e['tokens'] == t['tokens']} ({sum(a == b for a, b in zip(e['tokens'], t['tokens']))}/{len(t['tokens'])})")
PY
