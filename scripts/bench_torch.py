#!/usr/bin/env python3
"""torch fp32 CPU timings for scripts/bench_engine.sh (an observation, not a test).

    python scripts/bench_torch.py MODEL_DIR THREADS PREFILLS DECODE

Same prompts and step counts as engine/examples/bench.rs: PREFILLS is a comma-separated list of
prompt lengths, each forward timed once after an untimed warm-up forward, then greedy cached
decode after the first prompt with transformers' AutoModelForCausalLM (eager attention). Prints
one JSON line.
"""

import json
import sys
import time

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    model_dir, threads = sys.argv[1], int(sys.argv[2])
    lens, steps = [int(n) for n in sys.argv[3].split(",")], int(sys.argv[4])
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    v = m.config.vocab_size

    def prompt(n: int) -> torch.Tensor:
        return torch.tensor([[(i * 7919 + 13) % v for i in range(n)]])

    with torch.inference_mode():
        m(prompt(lens[0]), use_cache=True)
        prefill = {}
        for n in lens:
            ids = prompt(n)
            t0 = time.perf_counter()
            m(ids, use_cache=True)
            prefill[str(n)] = time.perf_counter() - t0
        out = m(prompt(lens[0]), use_cache=True)
        past, tok = out.past_key_values, out.logits[0, -1].argmax()
        tokens = [int(tok)]
        t0 = time.perf_counter()
        for _ in range(steps):
            out = m(tok.view(1, 1), past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[0, -1].argmax()
            tokens.append(int(tok))
        decode = (time.perf_counter() - t0) / steps
    print(json.dumps({"prefill_s": prefill, "decode_s_per_token": decode, "tokens": tokens}))


if __name__ == "__main__":
    main()
