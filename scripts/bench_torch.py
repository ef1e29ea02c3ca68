#!/usr/bin/env python3
"""torch fp32 CPU timings for scripts/bench_engine.sh (an observation, not a test).

    .venv/bin/python scripts/bench_torch.py MODEL_DIR THREADS PREFILL DECODE

Same prompt and step counts as engine/examples/bench.rs: prefill best of 3, then greedy cached
decode with transformers' Qwen3ForCausalLM (eager attention). Prints one JSON line.
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    model_dir, threads, n, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    v = m.config.vocab_size
    ids = torch.tensor([[(i * 7919 + 13) % v for i in range(n)]])
    with torch.inference_mode():
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            m(ids, use_cache=True)
            best = min(best, time.perf_counter() - t0)
        out = m(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[0, -1].argmax()
        tokens = [int(tok)]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
            tokens.append(int(tok))
        decode = (time.perf_counter() - t0) / steps
    print(json.dumps({"prefill_s": best, "decode_s_per_token": decode, "tokens": tokens}))


if __name__ == "__main__":
    main()
