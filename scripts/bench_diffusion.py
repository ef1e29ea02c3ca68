#!/usr/bin/env python3
"""Block diffusion: the engine's `trace` against transformers' own `generate` (an observation,
not a test; docs/benchmarks.md, "Diffusion Gemma").

    python scripts/bench_diffusion.py MODEL_DIR --tokens N --generate G --threads T [--runs R]

Both run the same prompt (N token ids), G new tokens (whole canvases), seed 3 and the
checkpoint's generation config, on T threads, R times each (median and range printed):

- torch: `DiffusionGemmaForBlockDiffusion.generate` in f32, eager attention and experts, timed
  in process after one untimed warm-up (import and load excluded);
- engine: `target/release/engine trace --capture default` as a whole process (loading the
  weights and writing the trace included), so the ratio is the engine's worst case.

The two draw from different generators, so their blocks may stop after different numbers of
steps: each side's denoising steps are printed, and the ratio is per step as well.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=64, help="prompt length (default 64)")
    ap.add_argument("--generate", type=int, default=64, help="new tokens (default 64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    a = ap.parse_args()
    cfg = json.loads((Path(a.model) / "config.json").read_text())
    vocab = cfg["text_config"]["vocab_size"]
    prompt = [(i * 7919 + 13) % vocab for i in range(a.tokens)]

    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.set_num_threads(a.threads)
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(
        a.model, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    ids = torch.tensor([prompt])

    def generate():
        torch.manual_seed(3)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.generate)
        # tokens_per_forward = committed tokens / decoder forwards
        return round(out.sequences.shape[1] - len(prompt)) / float(out.tokens_per_forward[0])

    generate()  # warm-up
    torch_s, torch_steps = [], 0.0
    for _ in range(a.runs):
        t = time.perf_counter()
        torch_steps = generate()
        torch_s.append(time.perf_counter() - t)

    engine = ROOT / "target" / "release" / "engine"
    engine_s, engine_steps = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "e.trace"
        cmd = [str(engine), "trace", "--model", a.model, "--tokens", ",".join(map(str, prompt))]
        cmd += ["--out", str(out), "--generate", str(a.generate), "--seed", "3"]
        cmd += ["--threads", str(a.threads), "--capture", "default"]
        for _ in range(a.runs):
            t = time.perf_counter()
            subprocess.run(cmd, check=True, capture_output=True)
            engine_s.append(time.perf_counter() - t)
        import tracegate

        trace = tracegate.Trace(str(out))
        engine_steps = sum(1 for n in trace.decisions if n.endswith(".stop"))
    tm, em = statistics.median(torch_s), statistics.median(engine_s)
    print(
        json.dumps(
            {
                "model": a.model,
                "prompt_tokens": a.tokens,
                "generate": a.generate,
                "threads": a.threads,
                "torch_generate_s": {"median": tm, "min": min(torch_s), "max": max(torch_s)},
                "torch_steps": torch_steps,
                "engine_trace_s": {"median": em, "min": min(engine_s), "max": max(engine_s)},
                "engine_steps": engine_steps,
                "engine_over_torch": em / tm,
                "engine_over_torch_per_step": (em / engine_steps) / (tm / torch_steps),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
