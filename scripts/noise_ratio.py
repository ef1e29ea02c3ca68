#!/usr/bin/env python3
"""How far a candidate sits from the reference in units of the noise run (fixtures/policy/
MEASUREMENTS.md, "The noise ratio"): per tensor, the candidate's relative L2 against the oracle
(transformers, f32) over the engine's (ordered f32, the f32 noise run of `gate init`).

    .venv/bin/python scripts/noise_ratio.py MODEL_DIR short,mid [example,f64-sumsq,eps-x10,...]

Prints, per prompt and candidate, the three worst ratios (tensor, candidate's and noise's
relative L2), how many tensors have a noise of 0 and a candidate that is not, and the median.
Candidates: `example` (examples/producer), and the defects of gate/tests/producers/
defective_contract.py named here (`f64-sumsq` is an honest, not bit-exact contract).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import tracegate

ROOT = Path(__file__).resolve().parent.parent
PY = str(ROOT / ".venv/bin/python")
DEFECTIVE = str(ROOT / "gate/tests/producers/defective_contract.py")
CANDIDATES = {
    "example": [str(ROOT / "target/release/example-producer")],
    **{d: [PY, DEFECTIVE, "--defect", d] for d in ("f64-sumsq", "eps-x10", "eps-div10", "rms-eps")},
}


def run(cmd: list[str], model: str, out: Path, tokens: list[int]) -> None:
    argv = ["trace", "--model", model, "--tokens", ",".join(map(str, tokens))]
    argv += ["--out", str(out), "--capture", "default"]
    subprocess.run(cmd + argv, check=True, capture_output=True, cwd=ROOT)


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    n = np.linalg.norm(a)
    return float(np.linalg.norm(a - b) / n) if n > 0 else 0.0


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    model, prompts = sys.argv[1], sys.argv[2].split(",")
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CANDIDATES)
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
                ratios, unmeasured = [], 0
                for t in ref.names:
                    if t not in noise.names or t not in cand.names:
                        continue
                    r, n, c = np.array(ref[t]), np.array(noise[t]), np.array(cand[t])
                    if not r.shape == n.shape == c.shape:
                        continue
                    rn, rc = rel_l2(r, n), rel_l2(r, c)
                    if rn > 0:
                        ratios.append((rc / rn, t, rc, rn))
                    elif rc > 0:
                        unmeasured += 1
                ratios.sort(reverse=True)
                worst = [f"{k:.1f} {t} ({c:.1e}/{n:.1e})" for k, t, c, n in ratios[:3]]
                median = float(np.median([k for k, *_ in ratios])) if ratios else float("nan")
                print(f"{pid} {name}: worst {worst}; noise 0: {unmeasured}; median {median:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
