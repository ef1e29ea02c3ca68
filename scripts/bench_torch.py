#!/usr/bin/env python3
"""torch fp32 CPU timings for scripts/bench_engine.sh (an observation, not a test).

    python scripts/bench_torch.py MODEL_DIR THREADS PREFILLS DECODE

Same prompts and step counts as engine/examples/bench.rs: PREFILLS is a comma-separated list of
prompt lengths, each forward timed once after an untimed warm-up forward, then greedy cached
decode after the first prompt with transformers' AutoModelForCausalLM (eager attention). A
hybrid model's Gated DeltaNet runs transformers' torch references, as the oracle runs them
(oracle/tracegate_oracle/linear_attn.py, loaded by path: the oracle package itself needs the
tracegate binding), never an installed `fla` / `causal_conv1d` or a hub kernel. Prints one JSON
line; `torch_paths` lists, per modeling module, what transformers had bound instead and was
bypassed (empty when nothing was).
"""

import contextlib
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parent.parent


class _Layout:
    """The two things linear_attn reads of the oracle's Layout: the linear-attention layers and
    their modules."""

    def __init__(self, mods: list) -> None:
        self.mods, self.linear_layers = mods, list(range(len(mods)))

    def attn(self, i: int):
        return self.mods[i]


def torch_paths(m) -> tuple[object, dict]:
    """(context that runs the model's Gated DeltaNet on transformers' torch references, what it
    bypassed per module); a model without linear attention gets a no-op and {}."""
    mods = [x for x in m.modules() if type(x).__name__.endswith("GatedDeltaNet")]
    if not mods:
        return contextlib.nullcontext(), {}
    path = ROOT / "oracle" / "tracegate_oracle" / "linear_attn.py"
    spec = importlib.util.spec_from_file_location("bench_linear_attn", path)
    la = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(la)
    lay = _Layout(mods)
    return la.TorchPaths(lay), {k: v["bypassed"] for k, v in la.provenance(lay).items()}


def main() -> None:
    model_dir, threads = sys.argv[1], int(sys.argv[2])
    lens, steps = [int(n) for n in sys.argv[3].split(",")], int(sys.argv[4])
    torch.set_num_threads(threads)
    m = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    v = m.config.vocab_size
    paths, bypassed = torch_paths(m)

    def prompt(n: int) -> torch.Tensor:
        return torch.tensor([[(i * 7919 + 13) % v for i in range(n)]])

    with torch.inference_mode(), paths:
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
    print(
        json.dumps(
            {
                "prefill_s": prefill,
                "decode_s_per_token": decode,
                "tokens": tokens,
                "torch_paths": bypassed,
            }
        )
    )


if __name__ == "__main__":
    main()
