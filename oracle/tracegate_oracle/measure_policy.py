"""Measure the oracle's fp32 error per capture-point pattern, against the same transformers model
cast to float64 (a proxy for "exact"; later re-measured against the engine).

For each pattern (layer / expert indices replaced by `*`) it reports, as maxima over all tensors
of all prompts: max ULP (in f32 steps, against the f64 value rounded to f32), max abs diff, max
element-wise relative diff (|a-b|/|b|, ref = f64), max relative L2 (||a-b||/||b||) and min
cosine — the quantities trace-diff's policies bound (diff/src/numeric.rs).

    python -m tracegate_oracle.measure_policy fixtures/tiny-qwen3 fixtures/tiny-qwen3-moe [--markdown]
"""
from __future__ import annotations

import argparse
import copy
import re
import sys

import numpy as np

from . import capture as cp


def prompts(vocab: int, n: int = 8, seed: int = 99) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 70] + [int(x) for x in rng.integers(2, 70, size=n - 2)]
    out = [[int(t) for t in rng.integers(0, vocab, size=t)] for t in lengths]
    out[-1] = [int(t) for t in np.resize(rng.integers(0, vocab, size=4), 40)]  # repeats
    return out


def pattern(name: str) -> str:
    return re.sub(r"\.\d{3}\.", ".*.", re.sub(r"^layer\.\d{2}\.", "layer.*.", name))


def _ord(x: np.ndarray) -> np.ndarray:
    """f32 bits -> integers that order like the floats (so ULP distance crosses zero)."""
    i = x.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(i < 0, -(i & 0x7FFFFFFF), i)


def compare(a32: np.ndarray, a64: np.ndarray) -> dict:
    a, b = a32.astype(np.float64).ravel(), a64.astype(np.float64).ravel()
    d = np.abs(a - b)
    nz = b != 0
    return {
        "max_ulp": int(np.abs(_ord(a32.ravel()) - _ord(a64.astype(np.float32).ravel())).max()),
        "max_abs": float(d.max()),
        "max_rel": float((d[nz] / np.abs(b[nz])).max()) if nz.any() else 0.0,
        "rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.any(b) else 0.0,
        "cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))) if np.any(a) and np.any(b) else 1.0,
    }


def measure(model_dir: str) -> dict[str, dict]:
    rc = cp.RunConfig(capture="internals")
    cp.setup_torch(rc)
    m32 = cp.load_model(model_dir, rc)
    m64 = copy.deepcopy(m32).double()
    agg: dict[str, dict] = {}
    for ids in prompts(m32.config.vocab_size):
        c32 = cp.capture_prompt(m32, model_dir, ids, rc)
        c64 = cp.capture_prompt(m64, model_dir, ids, rc)
        names64 = set(c64.names)
        for r in c32.tensors:
            if r.name not in names64:  # an expert routed differently in f64: not comparable
                continue
            s = compare(r.array, c64[r.name].array)
            a = agg.setdefault(pattern(r.name), {"n": 0, "max_ulp": 0, "max_abs": 0.0, "max_rel": 0.0, "rel_l2": 0.0, "cosine": 1.0})
            a["n"] += 1
            for k in ("max_ulp", "max_abs", "max_rel", "rel_l2"):
                a[k] = max(a[k], s[k])
            a["cosine"] = min(a["cosine"], s["cosine"])
        flips = sum(int(np.any(d.values != c64.decision(d.name).values)) for d in c32.decisions)
        agg.setdefault("(decisions differing f32 vs f64)", {"n": 0, "flips": 0})
        agg["(decisions differing f32 vs f64)"]["n"] += len(c32.decisions)
        agg["(decisions differing f32 vs f64)"]["flips"] += flips
    return agg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("models", nargs="+")
    a = ap.parse_args(argv)
    for d in a.models:
        agg = measure(d)
        print(f"\n### {d}\n")
        print("| pattern | tensors | max ULP | max abs | max rel (elementwise) | max rel L2 | min cosine |")
        print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
        for p, s in agg.items():
            if "flips" in s:
                continue
            print(f"| `{p}` | {s['n']} | {s['max_ulp']} | {s['max_abs']:.3g} | {s['max_rel']:.3g} | {s['rel_l2']:.3g} | {1 - s['cosine']:.3g} below 1 |")
        f = agg["(decisions differing f32 vs f64)"]
        print(f"\ndecisions: {f['flips']} of {f['n']} differ between fp32 and float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
