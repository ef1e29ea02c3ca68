"""Measure what a tolerance policy must allow, per capture-point pattern.

Three measurements, the basis of the bundled policies (fixtures/policy/MEASUREMENTS.md):

- default: the oracle's fp32 error against the same transformers model cast to float64 (a proxy
  for "exact") and run with transformers' fp32 casts made float64 (`float64_throughout`: else
  RMSNorm, softmax and the whole Gated DeltaNet recurrence stay fp32), over 8 seeded prompts.
  Basis of the f32 policy.

      python -m tracegate_oracle.measure_policy fixtures/tiny-qwen3 fixtures/tiny-qwen3-moe

- `--precision`: the oracle in bf16 and in f16 against the oracle in f32 and the engine in f32
  (`target/release/engine trace --capture internals`), over every frozen prompt, capture
  internals, prefill. Basis of the bf16 and f16 policies; each candidate is also judged by the
  bundled policy of its dtype (fixtures/policy/<dtype>.json). `--save DIR` writes the oracle's
  captures (DIR/<model>.pkl.gz), `--load DIR` compares captures so written elsewhere (a GPU
  machine without the engine) against this machine's engine. Pickles run code when loaded:
  load only files this tool wrote.

      python -m tracegate_oracle.measure_policy --precision fixtures/tiny-qwen3 fixtures/tiny-qwen3-moe
      python -m tracegate_oracle.measure_policy --precision --device cuda --engine none --save DIR MODELS...
      python -m tracegate_oracle.measure_policy --precision --load DIR MODELS...

  `--seeded-prompts`: over the default measurement's 8 seeded prompts instead of the frozen
  ones, for a model whose vocabulary the frozen prompts' ids exceed (tiny-qwen3_5*).

- `--planted SCALES`: one layer's weight scaled in a copy of an f32 checkpoint (`--plant`: the
  MLP down projection, default; or in a linear-attention layer the decay, beta's projection, the
  gated norm's weight or out_proj): how far that moves the layer's points (relative L2, norm
  ratio, scale error), next to each dtype's own rounding (scale 1), in the whole run and with the
  layer run alone on the engine's input to it, and the first tensor outside the dtype's policy in
  each.

      python -m tracegate_oracle.measure_policy --planted 1,1.01,1.02,1.05,1.1 fixtures/tiny-qwen3
      python -m tracegate_oracle.measure_policy --planted 1,1.01,1.05 --layers 1,9,29 MODEL

  `--layers`: plant in those layers only (every layer of a 30-layer model is hours of runs).
      python -m tracegate_oracle.measure_policy --planted 1,1.01,1.02,1.05 --plant norm \
          --dtypes bf16 fixtures/tiny-qwen3_5

  Two plants are no weight scale: `--plant rope` multiplies config.json's rope_theta by s (every
  layer at once; `--layers` are then the layers run alone), `--plant eps` puts a share s of eps
  outside the square root in one layer's RMSNorms (s = 1: x / (sqrt(mean(x^2)) + eps); s = 0 is
  the clean run).

      python -m tracegate_oracle.measure_policy --planted 1,0.1 --plant rope --layers 1,9,29 MODEL
      python -m tracegate_oracle.measure_policy --planted 0,1 --plant eps --layers 1,9,29 MODEL

Quantities as trace-diff computes them, mixed precision included: the finer side rounded to the
coarser dtype (round to nearest even) for the ULP distance, counted in the coarser dtype's
steps; max |a-b|, max element-wise |a-b|/|b| (b = reference), relative L2 ||a-b||/||b|| and cosine
from the real values widened to float64. Every decision row that differs is listed with the
reference margin m and d = max |reference - candidate| over the row of the tensor the decision
was taken from (`logits` for `logits.argmax`, `layer.NN.router.logits` for
`layer.NN.router.topk`), and |m|/d, the quantity a near-tie factor bounds.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gzip
import pickle
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from tracegate import names

from . import capture as cp
from . import checkpoint
from .records import Capture
from .torch_setup import RunConfig, setup_torch

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "fixtures" / "policy"
FROZEN = ROOT / "fixtures" / "prompts" / "frozen.json"

# Significand bits: the dtype with fewer is the coarser one, whose steps count ULPs.
BITS = {"f64": 53, "f32": 24, "f16": 11, "bf16": 8}
_NUMPY_NAME = {np.dtype("float64"): "f64", np.dtype("float32"): "f32", np.dtype("float16"): "f16"}


def prompts(vocab: int, n: int = 8, seed: int = 99) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    lengths = [1, 70] + [int(x) for x in rng.integers(2, 70, size=n - 2)]
    out = [[int(t) for t in rng.integers(0, vocab, size=t)] for t in lengths]
    out[-1] = [int(t) for t in np.resize(rng.integers(0, vocab, size=4), 40)]  # repeats
    return out


def pattern(name: str) -> str:
    """A prefill name with its layer and expert numbers as `*` (`layer.03.expert.007.out` is
    `layer.*.expert.*.out`); any other name, a decode step's included, as it is."""
    n = names.parse(name)
    if n.layer is None or n.decode_step is not None:
        return name
    return "layer.*." + ("" if n.expert is None else "expert.*.") + n.point


# ---------------------------------------------------------------------------------------------
# numbers


def real(a: np.ndarray, dtype: str) -> np.ndarray:
    """The stored values as float64 (bf16 arrives as its uint16 bits)."""
    if dtype == "bf16":
        return (np.asarray(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return np.asarray(a).astype(np.float64)


def round_to(a: np.ndarray, dtype: str, to: str) -> np.ndarray:
    """`a` (stored as `dtype`) rounded to nearest even in the coarser `to`, as stored there."""
    if dtype == to:
        return np.asarray(a)
    if to == "bf16":
        if dtype != "f32":
            raise ValueError(f"rounding {dtype} to bf16 is not needed here")
        u = np.asarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
        r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(a), ((u >> 16) | 0x40).astype(np.uint16), r)  # NaN stays NaN
    return real(a, dtype).astype({"f32": np.float32, "f16": np.float16}[to])  # numpy rounds RNE


def _ordinal(a: np.ndarray, dtype: str) -> np.ndarray:
    """Bits as integers that order like the values, so ULP distance crosses zero."""
    width = {"f64": np.int64, "f32": np.int32, "f16": np.int16, "bf16": np.int16}[dtype]
    i = np.ascontiguousarray(a).view(width).astype(np.int64)
    sign = np.int64(1) << (np.dtype(width).itemsize * 8 - 1)
    return np.where(i < 0, -(i & (sign - 1)), i)


def compare(ref: np.ndarray, ref_dt: str, cand: np.ndarray, cand_dt: str) -> dict:
    """trace-diff's quantities for one tensor, reference `ref`, possibly of another precision."""
    coarse = min(ref_dt, cand_dt, key=BITS.__getitem__)
    a, b = real(cand, cand_dt).ravel(), real(ref, ref_dt).ravel()
    d = np.abs(a - b)
    nz = b != 0
    ulp = np.abs(
        _ordinal(round_to(cand, cand_dt, coarse), coarse)
        - _ordinal(round_to(ref, ref_dt, coarse), coarse)
    )
    return {
        "max_ulp": int(ulp.max()),
        "max_abs": float(d.max()),
        "max_rel": float((d[nz] / np.abs(b[nz])).max()) if nz.any() else 0.0,
        "rel_l2": float(np.linalg.norm(a - b) / np.linalg.norm(b)) if np.any(b) else 0.0,
        "cosine": float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
        if np.any(a) and np.any(b)
        else 1.0,
        "scale_error": float(a @ b / (b @ b) - 1) if np.any(b) else 0.0,
    }


# ---------------------------------------------------------------------------------------------
# runs: what one producer captured for one prompt, read from a capture or a trace


@dataclass
class Run:
    tensors: dict  # name -> (array as stored, dtype, positions)
    decisions: dict  # name -> (values, margins or None)
    provenance: dict = field(default_factory=dict)


def plain(c: Capture) -> dict:
    """A capture as plain data (what --save writes)."""
    return {
        "tensors": [(r.name, r.array, r.dtype, r.attrs) for r in c.tensors],
        "decisions": [(d.name, d.values, d.margins) for d in c.decisions],
        "provenance": c.provenance,
    }


def from_plain(p: dict) -> Run:
    return Run(
        {n: (a, dt or _NUMPY_NAME[a.dtype], at.get("positions")) for n, a, dt, at in p["tensors"]},
        {n: (v, m) for n, v, m in p["decisions"]},
        p["provenance"],
    )


def from_trace(path: str) -> Run:
    import tracegate

    t = tracegate.Trace(path)
    t.verify()
    return Run(
        {n: (np.array(t[n]), t.dtype(n), t.attributes(n).get("positions")) for n in t.names},
        {n: (np.array(v), t.margins.get(n)) for n, v in t.decisions.items()},
        t.provenance,
    )


def oracle_runs(
    model_dir: str,
    dtype: str,
    device: str,
    tokens: dict[str, list[int]],
    isolate_on: dict[str, Run] | None = None,
    layers: list[int] | None = None,
    patch=None,
):
    """The oracle's whole run of each prompt; with `isolate_on` (a reference run per prompt) also
    each of `layers` (default: every layer) run alone (the `layer` verb) on the reference's
    `layer.NN.hidden_in`, as {prompt: {name: (array, dtype, positions)}}. `patch(model)`, if
    given, changes the loaded model first (a planted defect that is no weight)."""
    rc = RunConfig(device=device, dtype=dtype, capture="internals")
    det = setup_torch(rc)
    model = cp.load_model(model_dir, rc)
    if patch is not None:
        patch(model)
    runs = {
        pid: plain(cp.capture_prompt(model, model_dir, t, rc, det)) for pid, t in tokens.items()
    }
    if isolate_on is None:
        return runs
    iso = {}
    for pid, ref in isolate_on.items():
        iso[pid] = {}
        for L in (
            layers
            if layers is not None
            else range(model.config.get_text_config().num_hidden_layers)
        ):
            a, _, positions = ref.tensors[names.layer(L, "hidden_in")]
            run = from_plain(
                plain(cp.capture_layer(model, model_dir, L, a, list(positions), rc, det))
            )
            # A token routed differently in isolation (a near-tie flip in bf16) gets other experts:
            # its mlp_out row is not comparable, as trace-diff excludes it; keep the rest.
            topk = names.layer(L, "router.topk")
            if topk in run.decisions:
                same = np.all(run.decisions[topk][0] == ref.decisions[topk][0], axis=1)
                name = names.layer(L, "mlp_out")
                x, dt_, pos = run.tensors[name]
                run.tensors[name] = (x[same], dt_, pos)
                run.tensors[f"{name}.ref"] = ref.tensors[name][0][same]
            iso[pid].update(run.tensors)
    return runs, iso


def engine_runs(
    model_dir: str, engine: str, tokens: dict[str, list[int]], generate: int = 0
) -> dict[str, Run]:
    out = {}
    with tempfile.TemporaryDirectory() as d:
        for pid, t in tokens.items():
            path = f"{d}/{pid}.trace"
            subprocess.run(
                [
                    engine,
                    "trace",
                    "--model",
                    model_dir,
                    "--tokens",
                    ",".join(map(str, t)),
                    "--out",
                    path,
                    "--capture",
                    "internals",
                    "--threads",
                    "1",
                    "--generate",
                    str(generate),
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            out[pid] = from_trace(path)
    return out


# ---------------------------------------------------------------------------------------------
# policies (the same first-match glob as diff/src/policy.rs)


def policy_file(dtype: str) -> Path:
    """The bundled policy for a candidate computing in `dtype` (trace-diff --policy DTYPE)."""
    return POLICIES / ("oracle-default.json" if dtype == "f32" else f"{dtype}.json")


def glob_match(pat: str, name: str) -> bool:
    """diff/src/policy.rs `glob_match`: `*` any run without `.`, `**` (any longer star run) any
    run, `?` one character. The same automaton: the set of token positions reachable after each
    character, so the cost is at most (tokens + 1) x (characters + 1) steps, never the
    exponential backtracking a regex takes on `*a*a*...b`."""
    toks = [
        ("*" if len(t) == 1 else "**") if t[0] == "*" else t for t in re.findall(r"\*+|[^*]", pat)
    ]
    if sum(t[0] != "*" for t in toks) > len(name):
        return False  # every non-star token takes one character

    def close(live: set[int]) -> set[int]:
        for k in list(live):  # a star run is one token: the one after a star is no star
            if k < len(toks) and toks[k][0] == "*":
                live.add(k + 1)
        return live

    live = close({0})
    for c in name:
        nxt = set()
        for k in live:
            if k == len(toks):
                continue
            t = toks[k]
            if t == "**" or (t == "*" and c != "."):
                nxt.add(k)
            elif t == "?" or t == c:
                nxt.add(k + 1)
        if not nxt:
            return False
        live = close(nxt)
    return len(toks) in live


def rule_for(policy: dict, name: str, path: str = "prefill") -> dict | None:
    return next(
        (
            r
            for r in policy["rules"]
            if glob_match(r["pattern"], name) and r.get("path", path) == path
        ),
        None,
    )


def violations(rule: dict, s: dict) -> list[str]:
    checks = [
        ("max_ulp", s["max_ulp"], ">"),
        ("max_abs", s["max_abs"], ">"),
        ("max_rel", s["max_rel"], ">"),
        ("max_rel_l2", s["rel_l2"], ">"),
        ("min_cosine", s["cosine"], "<"),
        ("max_scale_error", abs(s["scale_error"]), ">"),
    ]
    return [
        f"{k} {v:.4g} {op} {rule[k]}"
        for k, v, op in checks
        if k in rule and (v > rule[k] if op == ">" else v < rule[k])
    ]


# ---------------------------------------------------------------------------------------------
# one reference against one candidate


def source_of(decision: str) -> str | None:
    if decision == "logits.argmax":
        return "logits"
    if decision.endswith(".router.topk"):
        return decision[: -len("topk")] + "logits"
    return None


# The near-tie factor the labelling in trace-diff assumes when a policy sets none: these
# measurements calibrate it (MEASUREMENTS.md), so rows are left out with this value.
NEAR_TIE_FACTOR = 2.0


@dataclass
class Result:
    per_tensor: list = field(
        default_factory=list
    )  # (prompt, name, pattern, stats, stats without near-tie rows)
    rerouted: int = 0  # expert outputs holding other rows on the two sides: not comparable
    decision_rows: int = 0
    flips: list = field(default_factory=list)


def _flip(
    ref: Run, cand: Run, prompt: str, name: str, row: int, rv: np.ndarray, cv: np.ndarray, rm, cm
) -> dict:
    """One differing decision row: the reference margin m, the divergence d of the source row,
    and the gap trace-diff's labels compare with d (for a reorder inside the chosen set, the
    largest reference score gap between two choices whose order inverted; else |m|)."""
    f = {
        "prompt": prompt,
        "name": name,
        "row": row,
        "reference": rv.tolist(),
        "candidate": cv.tolist(),
        "margin": float(rm[row]) if rm is not None else None,
        "d": None,
        "gap": None,
        "near_tie": False,
        "reorder": sorted(rv.tolist()) == sorted(cv.tolist()),
    }
    src = source_of(name)
    if src in ref.tensors and src in cand.tensors:
        (sa, sdt, _), (ta, tdt, _) = ref.tensors[src], cand.tensors[src]
        score = real(sa, sdt)[row]
        f["d"] = float(np.abs(score - real(ta, tdt)[row]).max())
        if f["reorder"]:
            rank = {int(e): i for i, e in enumerate(cv)}
            f["gap"] = max(
                abs(score[hi] - score[lo])
                for i, hi in enumerate(rv)
                for lo in rv[i + 1 :]
                if rank[hi] > rank[lo]
            )
        elif f["margin"] is not None:
            f["gap"] = abs(f["margin"])
        f["near_tie"] = f["gap"] is not None and f["d"] > 0 and f["gap"] <= NEAR_TIE_FACTOR * f["d"]
        f["source"] = src
    return f


def _without_rows(name: str, a: np.ndarray, positions, drop: set[int]) -> np.ndarray:
    """`a` without the rows of the token positions in `drop` (attn_probs: [heads, tokens, keys])."""
    axis = 1 if name.endswith(".attn_probs") else 0
    pos = (
        positions
        if positions is not None and len(positions) == a.shape[axis]
        else range(a.shape[axis])
    )
    keep = [i for i, p in enumerate(pos) if p not in drop]
    return np.take(a, keep, axis=axis)


def measure_pair(ref: Run, cand: Run, prompt: str, pattern_of, out: Result) -> None:
    """Adds one prompt's tensors and decision flips to `out`. Each tensor is measured whole and
    again as trace-diff judges it under a policy once a flip is a near-tie: without that token's
    rows in every tensor captured after the flip's source."""
    order = {n: i for i, n in enumerate(ref.tensors)}
    excused: list[tuple[int, int]] = []  # (token position, capture index of the flip's source)
    for name, (rv, rm) in ref.decisions.items():
        if name not in cand.decisions:
            continue
        cv, cm = cand.decisions[name]
        rv2, cv2 = rv.reshape(rv.shape[0], -1), cv.reshape(cv.shape[0], -1)
        out.decision_rows += rv2.shape[0]
        for row in np.nonzero((rv2 != cv2).any(axis=1))[0]:
            f = _flip(ref, cand, prompt, name, int(row), rv2[row], cv2[row], rm, cm)
            out.flips.append(f)
            if f["near_tie"]:
                excused.append((int(row), order[f["source"]]))
    for name, (ra, rdt, rpos) in ref.tensors.items():
        if name not in cand.tensors:
            continue
        ca, cdt, cpos = cand.tensors[name]
        if rpos != cpos:
            out.rerouted += 1
            continue
        s = compare(ra, rdt, ca, cdt)
        drop = {p for p, at in excused if at < order[name]}
        kept = s
        if drop:
            ra2, ca2 = _without_rows(name, ra, rpos, drop), _without_rows(name, ca, cpos, drop)
            kept = compare(ra2, rdt, ca2, cdt) if ra2.size else None
        out.per_tensor.append((prompt, name, pattern_of(name), s, kept))


def aggregate(per_tensor: list, kept: bool = False) -> dict[str, dict]:
    """Worst values per pattern, of whole tensors or (kept) without the near-tie rows."""
    agg: dict[str, dict] = {}
    for prompt, name, pat, whole, without in per_tensor:
        a = agg.setdefault(
            pat,
            {
                "n": 0,
                "max_ulp": 0,
                "max_abs": 0.0,
                "max_rel": 0.0,
                "rel_l2": 0.0,
                "cosine": 1.0,
                "scale_error": 0.0,
                "where": "",
            },
        )
        a["n"] += 1
        s = without if kept else whole
        if s is None:  # every row left out
            continue
        for k in ("max_ulp", "max_abs", "max_rel"):
            a[k] = max(a[k], s[k])
        if s["rel_l2"] >= a["rel_l2"]:
            a["rel_l2"], a["where"] = s["rel_l2"], f"{name} ({prompt})"
        a["cosine"] = min(a["cosine"], s["cosine"])
        a["scale_error"] = max(a["scale_error"], abs(s["scale_error"]))
    return agg


# ---------------------------------------------------------------------------------------------
# the two measurements


class _Torch64:
    """The `torch` a modeling module sees inside `float64_throughout`: `torch.float32` and
    `torch.float` are float64, everything else is torch's own."""

    def __getattr__(self, name):
        import torch

        return torch.float64 if name in ("float32", "float") else getattr(torch, name)


@contextlib.contextmanager
def float64_throughout(model):
    """transformers' own code for `model` (a `.double()` copy) with its fp32 casts made float64.

    A float64 model alone is not a float64 reference: transformers' modeling code casts to fp32
    by name — `x.float()` in every RMSNorm (input, post-attention, q/k, final) and for the decay
    `g`'s `A_log` and `a`, `.to(torch.float32)` in the gated RMSNorm (the norm and SiLU(z)) and
    for every input of both gated-delta-rule functions (which then keep the recurrent state and
    compute the output in fp32, L2-normalising q and k there), `dtype=torch.float32` for the
    eager attention softmax, `torch.float` for the MoE router softmax and the RoPE angles. So the
    modeling modules see a `torch` whose `float32`/`float` are float64 and `Tensor.float` widens
    to float64; the arithmetic is transformers', in float64 (restored on exit, also on error).
    The RoPE `inv_freq` buffer was computed in fp32 when the model was built and is widened
    exactly: the same frequencies on both sides, not an error of either."""
    import torch

    mods = {
        sys.modules[type(m).__module__]
        for m in model.modules()
        if type(m).__module__.startswith("transformers.models.")
    }
    undo = [(m, m.torch) for m in mods if getattr(m, "torch", None) is torch]
    tensor_float = torch.Tensor.float
    try:
        for m, _ in undo:
            m.torch = _Torch64()
        torch.Tensor.float = lambda self, *a, **k: self.double()
        yield
    finally:
        torch.Tensor.float = tensor_float
        for m, t in undo:
            m.torch = t


def text_config(model_dir: str) -> dict:
    """config.json's language-model fields (under `text_config` in a multimodal layout)."""
    cfg = checkpoint.read_config(Path(model_dir))  # bounded, regular, no repeated key
    return cfg.get("text_config", cfg)


def measure(model_dir: str) -> dict[str, dict]:
    """Oracle fp32 against float64 (the f32 policy's basis): the model cast to float64 run by
    transformers' own code with its fp32 casts made float64 (`float64_throughout`), so every
    capture point, the Gated DeltaNet's included, has a float64 reference."""
    rc = RunConfig(capture="internals")
    setup_torch(rc)
    m32 = cp.load_model(model_dir, rc)
    m64 = copy.deepcopy(m32).double()
    res = Result()
    for i, ids in enumerate(prompts(m32.config.get_text_config().vocab_size)):
        c32 = from_plain(plain(cp.capture_prompt(m32, model_dir, ids, rc)))
        with float64_throughout(m64):
            c64 = from_plain(plain(cp.capture_prompt(m64, model_dir, ids, rc)))
        narrow = [n for n, (a, dt, _) in c64.tensors.items() if dt != "f64"]
        if narrow:  # a part transformers still ran narrower than float64: no reference there
            raise RuntimeError(f"float64 reference holds narrower tensors: {', '.join(narrow)}")
        measure_pair(c64, c32, str(i), pattern, res)
    agg = aggregate(res.per_tensor)
    agg["(decisions differing f32 vs f64)"] = {"n": res.decision_rows, "flips": len(res.flips)}
    return agg


def precision(
    model_dir: str,
    dtypes: list[str],
    device: str,
    engine: str | None,
    load: str | None,
    save: str | None,
    seeded: bool = False,
) -> dict:
    """The oracle in each of `dtypes` against the oracle and the engine in f32, over every
    frozen prompt or (`seeded`) the default measurement's 8 seeded prompts, named 0..7: for a
    model whose vocabulary is smaller than the frozen prompts' ids (tiny-qwen3_5*)."""
    tokens = (
        {str(i): t for i, t in enumerate(prompts(text_config(model_dir)["vocab_size"]))}
        if seeded
        else {p["id"]: p["tokens"] for p in checkpoint.read_json_file(FROZEN)["prompts"]}
    )
    name = Path(model_dir).name
    if load:
        with gzip.open(Path(load) / f"{name}.pkl.gz", "rb") as f:
            caps = pickle.load(f)
    else:
        caps = {d: oracle_runs(model_dir, d, device, tokens) for d in ["f32", *dtypes]}
    if save:
        Path(save).mkdir(parents=True, exist_ok=True)
        with gzip.open(Path(save) / f"{name}.pkl.gz", "wb") as f:
            pickle.dump(caps, f)
    runs = {d: {pid: from_plain(p) for pid, p in caps[d].items()} for d in caps}
    refs = {"oracle f32": runs["f32"]}
    if engine:
        refs["engine f32"] = engine_runs(model_dir, engine, tokens)
    # Grouped by the f32 policy's rules, which the bf16 and f16 policies keep.
    f32_policy = checkpoint.read_json_file(POLICIES / "oracle-default.json")
    pattern_of = lambda n: (rule_for(f32_policy, n) or {}).get("pattern", "(no rule)")  # noqa: E731
    out = {
        "provenance": next(iter(runs["f32"].values())).provenance,
        "prompts": "the 8 seeded prompts" if seeded else "every frozen prompt",
        "results": {},
    }
    for d in dtypes:
        for ref_name, ref_runs in refs.items():
            res = Result()
            for pid in tokens:
                measure_pair(ref_runs[pid], runs[d][pid], pid, pattern_of, res)
            out["results"][(d, ref_name)] = res
    return out


# What `--plant` changes in a copy of the checkpoint: the weight (its name after `layers.N.`) or
# the kind of change, how the scale enters it, the capture points whose rows the table shows (the
# first is where the defect shows first), and which layers have the weight.
PLANTS = {
    "mlp": ("mlp.down_proj.weight", "times", ("mlp_out",), "every"),
    # exp(A_log + ln s) = s exp(A_log): the decay g = -exp(A_log) softplus(a + dt_bias) times s
    "decay": ("linear_attn.A_log", "log", ("linear.g", "attn_out"), "linear_attention"),
    # b times s, so beta = sigmoid(s b)
    "beta": (
        "linear_attn.in_proj_b.weight",
        "times",
        ("linear.beta", "attn_out"),
        "linear_attention",
    ),
    "norm": (
        "linear_attn.norm.weight",
        "times",
        ("linear.norm_out", "attn_out"),
        "linear_attention",
    ),
    "out_proj": ("linear_attn.out_proj.weight", "times", ("attn_out",), "linear_attention"),
    # config.json's rope_theta times s (SmolLM2: 100000 x 0.1 = 10000, a port that hardcodes
    # Llama's default): every layer at once, so its rows are "all" layers, and the layers run
    # alone are `--layers` (default every layer)
    "rope": ("rope_theta", "config", ("q", "k", "attn_out"), "every"),
    # every plain RMSNorm of the layer (input, post-attention, q/k norms) with a share s of eps
    # outside the square root, x / (sqrt(mean(x^2) + (1-s) eps) + s eps): s = 1 is
    # x / (sqrt(mean(x^2)) + eps), the defect of gate/tests/producers/defective_contract.py
    # --defect rms-eps; s = 0 the model itself (a patched forward: no weight changes)
    "eps": ("RMSNorm", "eps", ("attn_out", "mlp_out"), "every"),
}


def identity(plant: str) -> float:
    """The `--planted` value that leaves the model as it is (the clean run)."""
    return 0.0 if PLANTS[plant][1] == "eps" else 1.0


def plant_layers(model_dir: str, plant: str) -> list[int]:
    """The layers holding `plant`'s weight (`layer_types`; a model without it is all full
    attention)."""
    cfg = text_config(model_dir)
    kinds = cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"]
    want = PLANTS[plant][3]
    layers = [i for i, k in enumerate(kinds) if want in ("every", k)]
    if not layers:
        raise ValueError(f"--plant {plant}: {model_dir} has no {want} layer")
    return layers


def plant_into(model_dir: str, out: Path, plant: str, layer: int | None, scale: float) -> None:
    """A copy of `model_dir` at `out` with `plant`'s weight in `layer` scaled by `scale` (the
    weight must be f32, so the scale is exact before the run rounds), or its config's value
    (`rope`: every layer) scaled."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    if PLANTS[plant][1] == "config":
        key = PLANTS[plant][0]
        cfg = checkpoint.read_config(out)
        text = cfg.get("text_config", cfg)
        if key not in text:
            raise ValueError(f"--plant {plant}: no {key} in {model_dir}/config.json")
        text[key] = float(text[key]) * scale
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
        return
    w = load_file(out / "model.safetensors")
    suffix, how = f".layers.{layer}.{PLANTS[plant][0]}", PLANTS[plant][1]
    k = next((k for k in w if k.endswith(suffix) and not k.startswith("mtp.")), None)
    if k is None:
        raise ValueError(f"--plant {plant}: no tensor *{suffix} in {model_dir}")
    if str(w[k].dtype) != "torch.float32":
        raise ValueError(f"--plant {plant}: {k} is {w[k].dtype}, not f32: a scale would round")
    x = w[k].double()
    w[k] = (x + np.log(scale) if how == "log" else x * scale).float()
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})


def eps_outside(layer: int, share: float):
    """A patch for `oracle_runs`: every plain RMSNorm of decoder layer `layer` computes
    w * x / (sqrt(mean(x^2) + (1-share) eps) + share eps), in f32 as transformers' does."""
    import types

    import torch

    def forward(self, h):
        dt = h.dtype
        h = h.to(torch.float32)
        ms = h.pow(2).mean(-1, keepdim=True)
        eps = self.variance_epsilon
        h = h / (torch.sqrt(ms + (1 - share) * eps) + share * eps)
        return self.weight * h.to(dt)

    def patch(model):
        blocks = model.get_decoder().layers
        norms = [
            m
            for m in blocks[layer].modules()
            if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon")
        ]
        others = [
            m
            for m in blocks[layer].modules()
            if "RMSNorm" in type(m).__name__ and not hasattr(m, "variance_epsilon")
        ]
        if not norms or others:  # another formula (Qwen3.5's 1 + w, a gated norm): not written
            raise ValueError(f"--plant eps: layer {layer}'s norms are not all w * x / rms(x)")
        for m in norms:
            m.forward = types.MethodType(forward, m)

    return patch


def planted(
    model_dir: str,
    dtypes: list[str],
    scales: list[float],
    engine: str,
    device: str,
    plant: str = "mlp",
    only_layers: list[int] | None = None,
) -> list[dict]:
    """How far a scale error planted in one layer (`plant`: its MLP down projection, or in a
    linear-attention layer the decay, beta's projection, the gated norm weight or out_proj, in a
    copy of the checkpoint) moves that layer's capture points (`PLANTS`), against the rounding of
    each dtype: per dtype, scale and layer, the relative L2, norm ratio and scale error of each
    point against the engine's f32 trace of the clean checkpoint over every frozen prompt — in
    the whole run, and with the layer run alone (the oracle's `layer` verb) on the engine's input
    to it, as `gate bisect` isolates it — and the first tensor outside the bundled policy of the
    dtype in each. Scale 1 is the clean run (every layer holding the weight). Each row keeps
    every compared tensor's quantities (`whole`, `isolated`: {prompt: {name: stats}})."""
    import shutil

    tokens = {p["id"]: p["tokens"] for p in checkpoint.read_json_file(FROZEN)["prompts"]}
    eng = engine_runs(model_dir, engine, tokens)
    layers, points = plant_layers(model_dir, plant), PLANTS[plant][2]
    if only_layers is not None:  # `--layers`: a deep model's every layer is hours of runs
        missing = sorted(set(only_layers) - set(layers))
        if missing:
            raise ValueError(f"--layers {missing}: not layers holding --plant {plant}'s weight")
        layers = only_layers
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for dt in dtypes:
            policy = checkpoint.read_json_file(policy_file(dt))
            for scale in scales:
                # The clean run reads the checkpoint itself (a bf16 one cannot be rewritten here)
                # and has no planted layer: every layer holding the weight. So has a config plant
                # (rope), which changes every layer.
                clean = scale == identity(plant)
                every = clean or PLANTS[plant][1] == "config"
                for layer in [None] if every else layers:
                    patch = None
                    if clean or PLANTS[plant][1] == "eps":
                        d = Path(model_dir)  # eps: the norms are patched after the load
                        patch = None if clean else eps_outside(layer, scale)
                    else:
                        d = Path(tmp) / f"{dt}-{scale}-{layer}"
                        plant_into(model_dir, d, plant, layer, scale)
                    at = layers if layer is None else [layer]
                    runs, iso = oracle_runs(
                        str(d), dt, device, tokens, isolate_on=eng, layers=at, patch=patch
                    )
                    row = {"dtype": dt, "scale": scale, "layer": layer, "points": points}
                    row.update(first_outside=set(), iso_first_outside=set(), whole={}, isolated={})
                    row["norm_ratio"] = []
                    for pid in tokens:
                        c, e = from_plain(runs[pid]), eng[pid]
                        row["whole"][pid] = {
                            n: compare(*e.tensors[n][:2], *c.tensors[n][:2])
                            for n in e.tensors
                            if n in c.tensors and c.tensors[n][2] == e.tensors[n][2]
                        }
                        # mlp_out: the rows routed alike (oracle_runs keeps those); an expert
                        # holding other rows in isolation is not comparable (first_outside names it)
                        ref_of = {n: iso[pid].get(f"{n}.ref", e.tensors[n][0]) for n in e.tensors}
                        row["isolated"][pid] = {
                            n: compare(ref_of[n], e.tensors[n][1], *iso[pid][n][:2])
                            for n in e.tensors
                            if n in iso[pid] and iso[pid][n][0].shape == ref_of[n].shape
                        }
                        row["norm_ratio"] += [  # of the first point, in the whole run
                            float(
                                np.linalg.norm(real(*c.tensors[n][:2]))
                                / np.linalg.norm(real(*e.tensors[n][:2]))
                            )
                            for n in (names.layer(x, points[0]) for x in at)
                        ]
                        row["first_outside"].add(first_outside(policy, e, c.tensors, "prefill"))
                        row["iso_first_outside"].add(first_outside(policy, e, iso[pid], "layer"))
                    for p in points:
                        for key in ("whole", "isolated"):
                            st = [s[names.layer(x, p)] for s in row[key].values() for x in at]
                            pre = "" if key == "whole" else "iso_"
                            row[f"{pre}{p}"] = {
                                q: [x[q] for x in st] for q in ("rel_l2", "scale_error")
                            }
                    row["clean"] = clean
                    out.append(row)
                    if d != Path(model_dir):
                        shutil.rmtree(d)
    return out


def first_outside(policy: dict, ref: Run, cand: dict, path: str) -> str | None:
    """The first tensor of `cand` (in the reference's order) outside `policy` for that `path`."""
    for n, (ra, rdt, _) in ref.tensors.items():
        if n in cand:
            ra = cand.get(f"{n}.ref", ra)
            if cand[n][0].shape != ra.shape:
                return f"{n} (rows routed differently)"
            rule = rule_for(policy, n, path)
            if rule is None or violations(rule, compare(ra, rdt, *cand[n][:2])):
                return n
    return None


def print_planted(d: str, plant: str, rows: list[dict]) -> None:
    weight, how, points, _ = PLANTS[plant]
    what = {
        "config": f"`{weight}` times s in config.json (every layer)",
        "eps": "eps outside the square root in one layer's RMSNorms (a share s of it)",
    }.get(how, f"a scale planted in one layer's `{weight}`")
    print(f"\n### {d}: {what}\n")
    print(
        "Whole run, then the layer alone on the engine's input to it (isolated). Ranges are min to max over prompts "
        "(and, for scale 1, over layers).\n"
    )
    first, rest = points[0], points[1:]
    whole = [f"{first} rel L2", "norm ratio - 1", "scale error"]
    whole += [f"{p} {q}" for p in rest for q in ("rel L2", "scale error")]
    iso = [f"isolated {p} {q}" for p in points for q in ("rel L2", "scale error")]
    cols = ["dtype", "scale", "layer", *whole, "first outside the policy", *iso]
    print("| " + " | ".join([*cols, "isolated: first outside the policy"]) + " |")
    print("| --- | ---: | ---: |" + " --- |" * (len(cols) - 2))
    rng = lambda xs, f: f"{min(xs):{f}} to {max(xs):{f}}"  # noqa: E731
    listed = lambda xs: ", ".join(sorted("none" if x is None else f"`{x}`" for x in xs))  # noqa: E731
    for r in rows:
        at = "-" if r["clean"] else "all" if r["layer"] is None else str(r["layer"])
        cells = [r["dtype"], f"{r['scale']:g}", at]
        cells += [rng(r[first]["rel_l2"], ".4f"), rng([x - 1 for x in r["norm_ratio"]], "+.4f")]
        cells.append(rng(r[first]["scale_error"], "+.4f"))
        cells += [
            rng(r[p][q], f) for p in rest for q, f in (("rel_l2", ".4f"), ("scale_error", "+.4f"))
        ]
        cells.append(listed(r["first_outside"]))
        cells += [
            rng(r[f"iso_{p}"][q], f)
            for p in points
            for q, f in (("rel_l2", ".4f"), ("scale_error", "+.4f"))
        ]
        cells.append(listed(r["iso_first_outside"]))
        print("| " + " | ".join(cells) + " |")


# ---------------------------------------------------------------------------------------------
# output


def fmt3(x: float) -> str:
    return f"{x:.3g}"


def print_fp64(d: str, agg: dict) -> None:
    print(f"\n### {d}\n")
    print(
        "| pattern | tensors | max ULP | max abs | max rel (elementwise) | max rel L2 | min cosine |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for p, s in agg.items():
        if "flips" in s:
            continue
        print(
            f"| `{p}` | {s['n']} | {s['max_ulp']} | {fmt3(s['max_abs'])} | {fmt3(s['max_rel'])} | {fmt3(s['rel_l2'])} | {fmt3(1 - s['cosine'])} below 1 |"
        )
    f = agg["(decisions differing f32 vs f64)"]
    print(f"\ndecisions: {f['flips']} of {f['n']} rows differ between fp32 and float64")


def judge(policy: dict, per_tensor: list, kept: bool) -> tuple[int, list]:
    """(tensors judged, [(prompt, name, violations)]) under `policy`, as trace-diff rules do."""
    bad, n = [], 0
    for prompt, name, _, whole, without in per_tensor:
        s = without if kept else whole
        if s is None:
            continue
        n += 1
        rule = rule_for(policy, name)
        v = ["no rule"] if rule is None else violations(rule, s)
        if v:
            bad.append((prompt, name, v))
    return n, bad


def print_precision(d: str, m: dict) -> None:
    v = m["provenance"].get("versions", {})
    dev = m["provenance"].get("device", {})
    print(
        f"\n### {d} (oracle on {dev.get('type')} {dev.get('name')}; torch {v.get('torch')}, transformers {v.get('transformers')}; "
        f"{m.get('prompts', 'every frozen prompt')})"
    )
    res = m["results"]
    for dt in dict.fromkeys(k[0] for k in res):
        refs = [k[1] for k in res if k[0] == dt]
        whole = {r: aggregate(res[(dt, r)].per_tensor) for r in refs}
        kept = {r: aggregate(res[(dt, r)].per_tensor, kept=True) for r in refs}
        print(f"\n#### oracle {dt} against " + " and ".join(refs) + f" (ULPs in {dt} steps)\n")
        print(
            'Worst over both references unless a column names one; "no near-tie rows": without the rows of tokens '
            f"whose decision flipped as a near-tie (factor {NEAR_TIE_FACTOR:g}), as trace-diff judges under a policy.\n"
        )
        print(
            "| pattern | tensors | max ULP | max abs | max rel (elementwise) | "
            + " | ".join(f"max rel L2 vs {r}" for r in refs)
            + " | max rel L2, no near-tie rows | min cosine | min cosine, no near-tie rows |"
            " max \\|scale error\\|, no near-tie rows | worst rel L2 (no near-tie rows) at |"
        )
        print(
            "| --- | ---: | ---: | ---: | ---: | "
            + " | ".join("---:" for _ in refs)
            + " | ---: | ---: | ---: | ---: | --- |"
        )
        for p in whole[refs[0]]:
            w, k = [whole[r][p] for r in refs], [kept[r][p] for r in refs]
            worst = max(k, key=lambda x: x["rel_l2"])
            print(
                f"| `{p}` | {w[0]['n']} | {max(x['max_ulp'] for x in w)} | {fmt3(max(x['max_abs'] for x in w))} | "
                f"{fmt3(max(x['max_rel'] for x in w))} | "
                + " | ".join(fmt3(x["rel_l2"]) for x in w)
                + f" | {fmt3(worst['rel_l2'])} | {fmt3(1 - min(x['cosine'] for x in w))} below 1 | "
                f"{fmt3(1 - min(x['cosine'] for x in k))} below 1 | "
                f"{fmt3(max(x['scale_error'] for x in k))} | {worst['where']} |"
            )
        for r in refs:
            x = res[(dt, r)]
            print(
                f"\nvs {r}: {len(x.flips)} of {x.decision_rows} decision rows differ "
                f"({sum(f['near_tie'] for f in x.flips)} near-ties at factor {NEAR_TIE_FACTOR:g}); "
                f"{x.rerouted} expert outputs not comparable (rows routed differently)"
            )
        # One row per flip; the references that show it and the largest ratio over them.
        flips: dict[tuple, list] = {}
        for r in refs:
            for f in res[(dt, r)].flips:
                flips.setdefault(
                    (f["prompt"], f["name"], f["row"], str(f["reference"]), str(f["candidate"])), []
                ).append((r, f))
        if flips:
            print(
                "\n| prompt | decision | row | reference / candidate | against | margin m | d | \\|m\\|/d | label gap / d |"
            )
            print("| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: |")
            for seen in flips.values():
                f = seen[0][1]
                fs = [x for _, x in seen if x["d"]]
                ratio = (
                    fmt3(max(abs(x["margin"]) / x["d"] for x in fs))
                    if fs and f["margin"] is not None
                    else "-"
                )
                gap = (
                    (
                        fmt3(max(x["gap"] / x["d"] for x in fs))
                        + (" (reorder: score gap)" if f["reorder"] else "")
                    )
                    if fs and f["gap"] is not None
                    else "-"
                )
                print(
                    f"| {f['prompt']} | `{f['name']}` | {f['row']} | {f['reference']} / {f['candidate']} | {', '.join(r for r, _ in seen)} | "
                    f"{fmt3(f['margin']) if f['margin'] is not None else '-'} | {fmt3(f['d']) if f['d'] is not None else '-'} | {ratio} | {gap} |"
                )
        pol = policy_file(dt)
        if pol.exists():
            policy = checkpoint.read_json_file(pol)
            for kept_rows, how in ((False, "whole tensors"), (True, "no near-tie rows")):
                judged = [(r, *judge(policy, res[(dt, r)].per_tensor, kept_rows)) for r in refs]
                total, bad = sum(j[1] for j in judged), [(r, *b) for r, _, bs in judged for b in bs]
                by_prompt = {
                    pr: sum(b[1] == pr for b in bad) for pr in dict.fromkeys(b[1] for b in bad)
                }
                print(
                    f'\nunder {pol.relative_to(ROOT)} ("{policy["name"]}"), {how}: {total - len(bad)} of {total} tensors within'
                    + (
                        ""
                        if not bad
                        else f"; {len(bad)} outside (by prompt: {by_prompt}), e.g. "
                        + "; ".join(
                            f"{n} ({pr}, vs {r}): {', '.join(v)}" for r, pr, n, v in bad[:4]
                        )
                    )
                )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("models", nargs="+")
    ap.add_argument(
        "--precision", action="store_true", help="bf16/f16 oracle against f32 oracle and engine"
    )
    ap.add_argument(
        "--dtypes", default="bf16,f16", help="candidate dtypes for --precision (default bf16,f16)"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument(
        "--engine",
        default=str(ROOT / "target" / "release" / "engine"),
        help="engine binary for the f32 engine reference; 'none' to skip it",
    )
    ap.add_argument(
        "--seeded-prompts",
        action="store_true",
        help="--precision over the default measurement's 8 seeded prompts instead of the frozen"
        " ones (a vocabulary smaller than the frozen prompts' ids)",
    )
    ap.add_argument("--save", metavar="DIR", help="write the oracle captures to DIR/<model>.pkl.gz")
    ap.add_argument(
        "--load", metavar="DIR", help="compare captures --save wrote instead of running the oracle"
    )
    ap.add_argument(
        "--planted",
        metavar="SCALES",
        help="scale errors to plant in each layer, e.g. 1,1.01,1.05 (f32 checkpoints); for"
        " --plant eps the share of eps outside the root, e.g. 0,1",
    )
    ap.add_argument(
        "--layers",
        help="--planted in these layers only (comma separated; default every layer holding the"
        " weight)",
    )
    ap.add_argument(
        "--plant",
        choices=sorted(PLANTS),
        default="mlp",
        help="--planted's weight: the MLP down projection (mlp, every layer) or, in each"
        " linear-attention layer, the decay (A_log + ln s), beta's projection, the gated norm"
        " weight or out_proj; or rope (config.json's rope_theta times s, every layer at once)"
        " or eps (a share s of eps outside the square root in one layer's RMSNorms; 0 is clean)",
    )
    a = ap.parse_args(argv)
    for d in a.models:
        if a.planted:
            scales = [float(x) for x in a.planted.split(",")]
            only = [int(x) for x in a.layers.split(",")] if a.layers else None
            rows = planted(d, a.dtypes.split(","), scales, a.engine, a.device, a.plant, only)
            print_planted(d, a.plant, rows)
        elif a.precision:
            engine = None if a.engine == "none" else a.engine
            print_precision(
                d,
                precision(
                    d, a.dtypes.split(","), a.device, engine, a.load, a.save, a.seeded_prompts
                ),
            )
        else:
            print_fp64(d, measure(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
