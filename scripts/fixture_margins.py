#!/usr/bin/env python3
"""Measure a fixture's decision margins and activation scales with transformers in fp32.

Loads DIR with AutoModelForCausalLM (fp32, eager attention, eager experts; for a multimodal
Qwen3.5 checkpoint that is transformers' Qwen3_5ForCausalLM, the language model alone), refuses
any missing / unexpected / mismatched key, runs the seeded prompt set (20 prompts of random token
ids, lengths 1..70, some with repeated tokens) or, with --prompts frozen, the gates' frozen prompts
(fixtures/prompts/frozen.json), and prints:
  - logits argmax margin  top1 - top2 (absolute, and relative to the row's max |logit|);
  - router margin         p_k - p_(k+1) of the fp32 softmax of the router logits (absolute,
                          and relative to p_k), per MoE layer, from a hook on each `mlp.gate`;
  - rms of every layer's output (vanishing / exploding check) and how many distinct argmax
    tokens appear (degeneracy check).
Exit status 1 if a check fails (--min-rel, default 1e-3).

  python scripts/fixture_margins.py fixtures/tiny-qwen3 [--json] [--prompts frozen]
  python scripts/fixture_margins.py --search PRESET N [--start SEED]   # seeded and frozen sets
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

FROZEN = Path(__file__).resolve().parent.parent / "fixtures/prompts/frozen.json"


def prompt_set(vocab: int, n: int = 20, seed: int = 1234) -> list[list[int]]:
    """The seeded prompt set: lengths 1..70 (1 and 70 always present), some with repeats."""
    rng = np.random.default_rng(seed)
    lengths = [1, 70] + [int(x) for x in rng.integers(2, 70, size=n - 2)]
    prompts = []
    for i, t in enumerate(lengths):
        if i % 4 == 3:  # a short motif repeated: repeated tokens and repeated n-grams
            motif = rng.integers(0, vocab, size=max(1, t // 5))
            prompts.append([int(x) for x in np.resize(motif, t)])
        else:
            prompts.append([int(x) for x in rng.integers(0, vocab, size=t)])
    return prompts


def frozen_prompts(vocab: int) -> list[list[int]]:
    """The gates' frozen prompts; refuses a vocabulary below the file's `vocab_min`."""
    d = json.loads(FROZEN.read_text())
    if vocab < d["vocab_min"]:
        raise SystemExit(f"{FROZEN}: vocab_size {vocab} < vocab_min {d['vocab_min']}")
    return [p["tokens"] for p in d["prompts"]]


PROMPT_SETS = {"seeded": prompt_set, "frozen": frozen_prompts}


def load(model_dir: str):
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=torch.float32,
        attn_implementation="eager",
        experts_implementation="eager",
        output_loading_info=True,
    )
    bad = {
        k: v
        for k, v in info.items()
        if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")
    }
    if bad:
        raise SystemExit(f"{model_dir}: loading info not clean: {bad}")
    return model.eval()


def _run(model, ids, gates):
    """One forward: (logits [T,V] f64, {gate: router logits [T,E] f64}, hidden states)."""
    import torch

    got = {}
    hooks = [
        m.register_forward_hook(lambda mod, inp, out, n=n: got.__setitem__(n, out[0].detach()))
        for n, m in gates.items()
    ]
    try:
        with torch.no_grad():
            out = model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return (
        out.logits[0].double().numpy(),
        {n: v.double().numpy() for n, v in got.items()},
        out.hidden_states,
    )


def _gaps(x: np.ndarray, k: int):
    """(x_k - x_(k+1)) per row with k 1-based, and the row's max |x|."""
    s = np.sort(x, axis=-1)[:, ::-1]
    return s[:, k - 1] - s[:, k], np.abs(x).max(-1)


def measure(model_dir: str, with_f64: bool = True, prompts: str = "seeded") -> dict:
    import copy

    import torch

    torch.manual_seed(0)
    model = load(model_dir)
    # float64 copy of the same weights: its deviation from fp32 is the fp32 noise the margins must beat
    m64 = copy.deepcopy(model).double() if with_f64 else None
    cfg = model.config
    k = getattr(cfg, "num_experts_per_tok", 0)

    def gates(m):
        return {n: g for n, g in m.named_modules() if n.endswith("mlp.gate")}

    g32 = gates(model)
    arg_abs, arg_rel, arg_safe, argmaxes = [], [], [], set()
    r_abs, r_rel, r_lrel, r_safe = ({n: [] for n in g32} for _ in range(4))
    rms = np.zeros(cfg.num_hidden_layers + 1)
    nrows = 0
    for ids in PROMPT_SETS[prompts](cfg.vocab_size):
        lg, rl, hs = _run(model, ids, g32)
        gap, mx = _gaps(lg, 1)
        arg_abs.append(gap)
        arg_rel.append(gap / mx)
        argmaxes.update(lg.argmax(-1).tolist())
        for i, h in enumerate(hs):
            rms[i] += float((h[0].double() ** 2).sum())
        nrows += len(ids)
        if m64 is not None:
            lg64, rl64, _ = _run(m64, ids, gates(m64))
            # safety factor: gap over twice the row's worst fp32 deviation (both competitors may move)
            arg_safe.append(gap / (2 * np.abs(lg - lg64).max(-1) + 1e-300))
        for n, x in rl.items():
            p = torch.softmax(torch.from_numpy(x).float(), dim=-1).double().numpy()
            pg, _ = _gaps(p, k)
            r_abs[n].append(pg)
            r_rel[n].append(pg / np.sort(p, axis=-1)[:, ::-1][:, k - 1])
            lgap, lmx = _gaps(x, k)
            # scale-free: logit gap over the row's logit magnitude (fp32 noise scales with it)
            r_lrel[n].append(lgap / lmx)
            if m64 is not None:
                r_safe[n].append(lgap / (2 * np.abs(x - rl64[n]).max(-1) + 1e-300))
    cat = np.concatenate
    res = {
        "model": model_dir,
        "prompts": prompts,
        "rows": nrows,
        "argmax_min_abs": float(cat(arg_abs).min()),
        "argmax_min_rel": float(cat(arg_rel).min()),
        "argmax_median_rel": float(np.median(cat(arg_rel))),
        "argmax_min_safety_vs_f64": float(cat(arg_safe).min()) if arg_safe else None,
        "distinct_argmax": len(argmaxes),
        "rms_by_depth": [float(np.sqrt(x / nrows / cfg.hidden_size)) for x in rms],
        "router": {
            n: {
                "min_abs": float(cat(r_abs[n]).min()),
                "min_rel": float(cat(r_rel[n]).min()),
                "min_logit_rel": float(cat(r_lrel[n]).min()),
                "min_safety_vs_f64": float(cat(r_safe[n]).min()) if r_safe[n] else None,
            }
            for n in g32
        },
    }
    return res


def search(preset: str, n: int, start: int | None = None) -> None:
    """Try n seeds from `start` (default: the preset's); print each seed's smallest relative
    margin (argmax, router) on the seeded and on the frozen prompt set; `score` is the smaller."""
    import importlib.util
    import tempfile
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "make_fixtures", Path(__file__).with_name("make_fixtures.py")
    )
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    base = mf.PRESETS[preset]["seed"] if start is None else start
    for seed in range(base, base + n):
        line, score = [], float("inf")
        with tempfile.TemporaryDirectory() as d:
            mf.make(preset, Path(d), seed)
            for prompts in PROMPT_SETS:
                r = measure(d, with_f64=False, prompts=prompts)
                rr = min(
                    [min(v["min_rel"], v["min_logit_rel"]) for v in r["router"].values()],
                    default=float("inf"),
                )
                score = min(score, r["argmax_min_rel"], rr)
                line.append(
                    f"{prompts}: argmax min rel {r['argmax_min_rel']:.3g} router min rel {rr:.3g}"
                    f" distinct {r['distinct_argmax']}"
                )
        print(f"seed {seed}: " + "; ".join(line) + f"; score {score:.3g}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("model_dirs", nargs="*")
    ap.add_argument(
        "--search", nargs=2, metavar=("PRESET", "N"), help="try N seeds of a make_fixtures preset"
    )
    ap.add_argument(
        "--start",
        type=int,
        metavar="SEED",
        help="with --search: the first seed (default: preset's)",
    )
    ap.add_argument("--min-rel", type=float, default=1e-3)
    ap.add_argument("--prompts", choices=list(PROMPT_SETS), default="seeded")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # deterministic and frugal; margins do not depend on it
    if a.search:
        search(a.search[0], int(a.search[1]), a.start)
        return 0
    ok = True
    for d in a.model_dirs:
        r = measure(d, prompts=a.prompts)
        fails = []
        if r["argmax_min_rel"] < a.min_rel:
            fails.append("argmax margin")
        if any(min(v["min_rel"], v["min_logit_rel"]) < a.min_rel for v in r["router"].values()):
            fails.append("router margin")
        if r["distinct_argmax"] < 10:
            fails.append("degenerate argmax")
        d_rms = r["rms_by_depth"]
        if max(d_rms) / min(d_rms) > 10:
            fails.append("activation scale drifts >10x with depth")
        r["fails"] = fails
        ok &= not fails
        if a.json:
            print(json.dumps(r, indent=1))
        else:
            print(
                f"{d} ({a.prompts} prompts): rows={r['rows']} argmax min margin {r['argmax_min_abs']:.4g} abs, {r['argmax_min_rel']:.4g} rel"
                f" (median rel {r['argmax_median_rel']:.3g}), min safety vs f64 {r['argmax_min_safety_vs_f64']:.3g}x,"
                f" distinct argmax {r['distinct_argmax']}"
            )
            print("  rms by depth: " + " ".join(f"{x:.3g}" for x in d_rms))
            for n, v in r["router"].items():
                print(
                    f"  {n}: router min margin {v['min_abs']:.4g} abs, {v['min_rel']:.4g} rel to p_k,"
                    f" logit gap {v['min_logit_rel']:.4g} rel to max|logit|, min safety vs f64 {v['min_safety_vs_f64']:.3g}x"
                )
            print("  " + ("OK" if not fails else "FAIL: " + ", ".join(fails)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
