#!/usr/bin/env python3
"""How far a candidate sits from the reference in units of the noise run (fixtures/policy/
MEASUREMENTS.md, "The noise ratio" and "Defects against the noise run (bf16, f16, q8)"): per
tensor, the candidate's relative L2 against the reference over the noise run's.

f32 (the original form): the reference is the oracle (transformers, f32), the noise run the
engine (ordered f32, the f32 noise run of `gate init`):

    .venv/bin/python scripts/noise_ratio.py MODEL_DIR short,mid [example,f64-sumsq,eps-x10,...]

Candidates: `example` (examples/producer), and the defects of gate/tests/producers/
defective_contract.py named here (`f64-sumsq` is an honest, not bit-exact contract).

Any producers (a precision's noise run): each command is a shell line in which `{trace}` stands
for `trace --model M --tokens T --out OUT --capture default` (appended if absent):

    .venv/bin/python scripts/noise_ratio.py --model M --prompts short,mid [--text TEXT --chat] \\
        --reference '.venv/bin/python -m tracegate_oracle {trace}' \\
        --noise '.venv/bin/python -m tracegate_oracle {trace} --dtype bf16' \\
        --candidate 'NAME=CMD' ... [--policy bf16] [--work DIR] [--json OUT]

`--layer L` compares layer L alone: the reference's whole `trace` supplies the input, and every
command (the reference too) runs its `layer` verb on it (`{trace}` then stands for `layer --model M
--layer L --input REF --input-name layer.LL.hidden_in --out OUT`); each candidate line also gives
the worst gap between its scale error and the noise run's.

`--text` adds a prompt `text` (tokenized once by `--tokenizer`, default MODEL, with `--chat` in its
chat template) given to every producer as `--tokens`. `--policy P` also runs `trace-diff REF CAND
--policy P --json`, without and with `--noise-reference NOISE`, and prints each verdict and first
violation. `--work DIR` keeps the traces there (DIR/PROMPT.NAME.trace) and reuses one already there.

Prints, per prompt and candidate, the three worst ratios (tensor, candidate's and noise's
relative L2), how many tensors have a noise of 0 and a candidate that is not, and the median;
the original form also prints trace-diff's ratio per token row (`--policy f32
--noise-reference`): the worst row, the rows where it is undefined, and the verdict;
`--json OUT` writes every row (each tensor's two relative L2s) as JSON lines.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import tracegate
import tracegate.text

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
DIFF = str(ROOT / "target/release/trace-diff")
DEFECTIVE = str(ROOT / "gate/tests/producers/defective_contract.py")
CANDIDATES = {
    "example": [str(ROOT / "target/release/example-producer")],
    **{d: [PY, DEFECTIVE, "--defect", d] for d in ("f64-sumsq", "eps-x10", "eps-div10", "rms-eps")},
}


def run(cmd: list[str], model: str, out: Path, tokens: list[int]) -> None:
    argv = ["trace", "--model", model, "--tokens", ",".join(map(str, tokens))]
    argv += ["--out", str(out), "--capture", "default"]
    subprocess.run(cmd + argv, check=True, capture_output=True, cwd=ROOT)


def run_line(line: str, argv: list[str], out: Path, reuse: bool) -> None:
    if reuse and out.exists():
        return
    argv = argv + ["--out", str(out)]
    words = shlex.split(line)
    if "{trace}" in words:
        i = words.index("{trace}")
        words = words[:i] + argv + words[i + 1 :]
    else:
        words += argv
    r = subprocess.run(words, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{line}: exit {r.returncode}: {r.stderr[-2000:]}")


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = np.linalg.norm(a)
    return float(np.linalg.norm(a - b) / n) if n > 0 else 0.0


def values(tr, name: str) -> np.ndarray:
    """A tensor's values: a bf16 tensor is stored (and read) as raw bits, the upper half of an f32."""
    a = np.array(tr[name])
    if tr.dtype(name) == "bf16":
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a


def scale_error(ref, cand) -> float:
    """trace-diff's scale error: <c, r> / <r, r> - 1, in f64."""
    r, c = np.asarray(ref, dtype=np.float64).ravel(), np.asarray(cand, dtype=np.float64).ravel()
    rr = float(r @ r)
    return float(c @ r) / rr - 1.0 if rr > 0 else float("nan")


SCALES: dict = {}  # (id(cand), tensor) -> (candidate's scale error, noise's): --json's rows


def ratios_of(ref, noise, cand):
    """[(ratio, tensor, cand rel L2, noise rel L2)] worst first, and the count of tensors whose
    noise is 0 while the candidate's is not."""
    ratios, unmeasured = [], 0
    for t in ref.names:
        if t not in noise.names or t not in cand.names:
            continue
        r, n, c = values(ref, t), values(noise, t), values(cand, t)
        if not r.shape == n.shape == c.shape:
            continue
        rn, rc = rel_l2(r, n), rel_l2(r, c)
        SCALES[id(cand), t] = (scale_error(r, c), scale_error(r, n))
        if rn > 0:
            ratios.append((rc / rn, t, rc, rn))
        elif rc > 0:
            unmeasured += 1
    ratios.sort(reverse=True)
    return ratios, unmeasured


def summary(ratios, unmeasured, cand=None) -> str:
    worst = [f"{k:.1f} {t} ({c:.1e}/{n:.1e})" for k, t, c, n in ratios[:3]]
    median = float(np.median([k for k, *_ in ratios])) if ratios else float("nan")
    line = f"worst {worst}; noise 0: {unmeasured}; median {median:.2f}"
    if cand is not None:
        # The scale error the candidate adds to the noise run's own: a scale defect moves it by
        # its size, honest rounding by little (MEASUREMENTS.md, "Layer isolation").
        gaps = [(abs(SCALES[id(cand), t][0] - SCALES[id(cand), t][1]), t) for _, t, *_ in ratios]
        gap, t = max(gaps) if gaps else (float("nan"), "-")
        c, n = SCALES.get((id(cand), t), (float("nan"), float("nan")))
        line += f"; worst scale gap {gap:.4f} {t} (C {c:+.4f}, N {n:+.4f})"
    return line


def verdict(ref: Path, cand: Path, policy: str, noise: Path | None) -> str:
    cmd = [DIFF, str(ref), str(cand), "--policy", policy, "--json"]
    if noise is not None:
        cmd += ["--noise-reference", str(noise)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    try:
        d = json.loads(r.stdout)
    except json.JSONDecodeError:
        return f"exit {r.returncode}: {r.stderr.strip()[-300:]}"
    fv = d.get("first_violation") or {}
    where = fv.get("tensor") or fv.get("decision") or ""
    v = (fv.get("violations") or [{}])[0]
    val = v.get("value")
    val = f"{val:.3g}" if isinstance(val, float) else val
    why = f" {v['bound']} {val} > {v['limit']}" if v.get("bound") else ""
    if not fv and d.get("verdict") != "within_policy":
        why = f" (first decision divergence: {d.get('first_decision_divergence')})"
    return f"{d.get('verdict')}{' at ' + where if where else ''}{why}"


def rows_of(ref: Path, cand: Path, noise: Path, policy: str = "f32") -> str:
    """trace-diff's noise ratio per token row (`rule.noise_rows`, docs/diff.md "Noise-relative
    bound"): the worst row over every tensor (its ratio, tensor and position), how many rows
    are undefined (the noise run exact there while the candidate is not), and the verdict."""
    cmd = [DIFF, str(ref), str(cand), "--policy", policy, "--json"]
    r = subprocess.run(cmd + ["--noise-reference", str(noise)], capture_output=True, text=True)
    try:
        d = json.loads(r.stdout)
    except json.JSONDecodeError:
        return f"rows: exit {r.returncode}: {r.stderr.strip()[-300:]}"
    worst, undefined, none = None, 0, 0
    for t in d["per_tensor"]:
        rows = (t.get("rule") or {}).get("noise_rows")
        if rows is None:
            continue
        if rows["layout"] == "none":
            none += 1
            continue
        undefined += rows["undefined"]
        w = rows["worst"]
        if w is not None and (worst is None or w["ratio"] > worst[0]):
            worst = (w["ratio"], t["tensor"], w["position"])
    top = f"{worst[0]:.1f} {worst[1]} row {worst[2]}" if worst else "none"
    return f"rows: worst {top}; undefined {undefined}; no row layout {none}; {policy} + noise: {d['verdict']}"


def legacy(argv: list[str]) -> int:
    model, prompts = argv[0], argv[1].split(",")
    names = argv[2].split(",") if len(argv) > 2 else list(CANDIDATES)
    frozen = json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
    tokens_of = {p["id"]: p["tokens"] for p in frozen}
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for pid in prompts:
            tokens = tokens_of[pid]
            run([PY, "-m", "tracegate_oracle"], model, d / "ref.trace", tokens)
            run([str(ROOT / "target/release/engine")], model, d / "noise.trace", tokens)
            ref, noise = tracegate.Trace(d / "ref.trace"), tracegate.Trace(d / "noise.trace")
            for name in names:
                run(CANDIDATES[name], model, d / f"{name}.trace", tokens)
                cand = tracegate.Trace(d / f"{name}.trace")
                print(f"{pid} {name}: {summary(*ratios_of(ref, noise, cand))}")
                rows = rows_of(d / "ref.trace", d / f"{name}.trace", d / "noise.trace")
                print(f"    {rows}", flush=True)
    return 0


def general(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="noise_ratio.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", default="", help="frozen prompt ids, comma-separated")
    p.add_argument("--text", help="a text prompt (its id: text)")
    p.add_argument("--chat", action="store_true")
    p.add_argument(
        "--tokenizer", help="the model dir whose tokenizer reads --text (default --model)"
    )
    p.add_argument("--reference", required=True)
    p.add_argument("--noise", required=True)
    p.add_argument("--candidate", action="append", default=[], metavar="NAME=CMD")
    p.add_argument("--policy")
    p.add_argument("--work")
    p.add_argument("--json")
    p.add_argument(
        "--layer",
        type=int,
        help="compare layer L alone: every command runs its `layer` verb on the reference's input",
    )
    a = p.parse_args(argv)
    frozen = json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
    tokens_of = {q["id"]: q["tokens"] for q in frozen}
    prompts = [(pid, tokens_of[pid]) for pid in a.prompts.split(",") if pid]
    if a.text:
        prompts.append(
            ("text", tracegate.text.tokenize(a.tokenizer or a.model, a.text, a.chat)["tokens"])
        )
    cands = [c.split("=", 1) for c in a.candidate]
    out = open(a.json, "a") if a.json else None
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(a.work) if a.work else Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        for pid, tokens in prompts:
            paths = {}
            argv = ["trace", "--model", a.model, "--tokens", ",".join(map(str, tokens))]
            argv += ["--capture", "default"]
            if a.layer is not None:
                # Every side's layer verb on the reference's own input to layer L: the noise run
                # without the upstream drift a whole run carries (docs/bisect.md, isolation).
                whole = d / f"{pid}.reference.whole.trace"
                run_line(a.reference, argv, whole, reuse=bool(a.work))
                argv = ["layer", "--model", a.model, "--layer", str(a.layer)]
                argv += ["--input", str(whole), "--input-name", f"layer.{a.layer:02}.hidden_in"]
                pid = f"{pid}.layer{a.layer:02}"
            for name, line in [("reference", a.reference), ("noise", a.noise), *cands]:
                paths[name] = d / f"{pid}.{name}.trace"
                run_line(line, argv, paths[name], reuse=bool(a.work))
            ref, noise = tracegate.Trace(paths["reference"]), tracegate.Trace(paths["noise"])
            for name, _ in cands:
                cand = tracegate.Trace(paths[name])
                ratios, unmeasured = ratios_of(ref, noise, cand)
                line = f"{pid} ({len(tokens)} tokens) {name}: {summary(ratios, unmeasured, cand)}"
                row = {
                    "prompt": pid,
                    "candidate": name,
                    "unmeasured": unmeasured,
                    "ratios": [
                        {
                            "tensor": t,
                            "ratio": k,
                            "cand": c,
                            "noise": n,
                            "scale_cand": SCALES[id(cand), t][0],
                            "scale_noise": SCALES[id(cand), t][1],
                        }
                        for k, t, c, n in ratios
                    ],
                }
                if a.policy:
                    row["policy"] = verdict(paths["reference"], paths[name], a.policy, None)
                    row["policy_noise"] = verdict(
                        paths["reference"], paths[name], a.policy, paths["noise"]
                    )
                    line += f"\n    --policy {a.policy}: {row['policy']}\n    with --noise-reference: {row['policy_noise']}"
                print(line, flush=True)
                if out:
                    out.write(json.dumps(row) + "\n")
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if argv and argv[0].startswith("--"):
        return general(argv)
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    return legacy(argv)


if __name__ == "__main__":
    sys.exit(main())
