"""Measures what `gate bisect`'s outlier check reads on clean pairs and on the planted RMSNorm-eps
defect (docs/bisect.md, "Outliers"): per layer, the isolated error (relative L2 of the
candidate's `layer` verb on the reference's `layer.LL.hidden_in`, against the reference's
whole-run tensor) and its ratio to the median of the other layers' errors.

  .venv/bin/python scripts/bisect_outliers.py [--fixtures tiny-qwen3,tiny-qwen3-moe] [--prompts short,...]

The same runs as `gate bisect --all-layers` (the producers' own verbs, the frozen prompts), in one
process so the oracle imports torch once: the engine through the gate's own engine child
(target/release/gate), the contract, the oracle (f32 and --dtype bf16) and the planted contract
through their CLIs' main(). Prints one line per pair and prompt, then the largest clean ratio per
measured tensor and the plant's.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
from pathlib import Path

import numpy as np
from tracegate import names

ROOT = Path(__file__).resolve().parent.parent
MEASURES = ["hidden_out", "attn_out", "mlp_out"]


def array(trace, name):
    import tracegate

    t = tracegate.Trace(str(trace))
    a = np.array(t[name])
    if t.dtype(name) == "bf16":  # raw bits: the upper half of an f32
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64)


def rel_l2(ref, cand):
    r, c = array(*ref), array(*cand)
    return float(np.sqrt(((c - r) ** 2).sum() / (r**2).sum()))


def layer_args(model, ref, L, out):
    return [
        "layer",
        "--model",
        model,
        "--layer",
        str(L),
        "--input",
        str(ref),
        "--input-name",
        names.layer(L, "hidden_in"),
        "--out",
        str(out),
        "--capture",
        "default",
    ]


def ratios(errors):
    out = []
    for i, e in enumerate(errors):
        m = statistics.median(errors[:i] + errors[i + 1 :])
        out.append(e / m if m > 0 else (float("inf") if e > 0 else None))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fixtures", default="tiny-qwen3,tiny-qwen3-moe")
    ap.add_argument("--prompts", default="short,repeat,mid,edge64,long")
    a = ap.parse_args()
    from tracegate_contract import __main__ as contract
    from tracegate_oracle import cli as oracle

    spec = importlib.util.spec_from_file_location(
        "defective", ROOT / "gate/tests/producers/defective_contract.py"
    )
    defective = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(defective)
    prompts = {
        p["id"]: p["tokens"]
        for p in json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
    }
    gate = str(ROOT / "target/release/gate")

    def engine(*args):
        subprocess.run(
            [gate, "__engine-producer", "engine", *args, "--threads", "1"],
            check=True,
            capture_output=True,
        )

    def quiet(f, argv):
        import contextlib
        import io

        with contextlib.redirect_stdout(io.StringIO()):
            assert f(argv) == 0, argv

    runs = []  # (fixture, prompt, pair, work, n, reference trace, layer runner)
    for fx in a.fixtures.split(","):
        model = str(ROOT / "fixtures" / fx)
        n = json.loads((ROOT / "fixtures" / fx / "config.json").read_text())["num_hidden_layers"]
        for p in a.prompts.split(","):
            work = ROOT / "target/outliers" / f"{fx}-{p}"
            work.mkdir(parents=True, exist_ok=True)
            toks = ",".join(map(str, prompts[p]))
            o_ref, e_ref = work / "oracle.trace", work / "engine.trace"
            quiet(
                oracle.main,
                [
                    "trace",
                    "--model",
                    model,
                    "--tokens",
                    toks,
                    "--out",
                    str(o_ref),
                    "--threads",
                    "1",
                ],
            )
            engine(
                "trace",
                "--model",
                model,
                "--tokens",
                toks,
                "--out",
                str(e_ref),
                "--capture",
                "default",
            )

            runs += [
                (
                    fx,
                    p,
                    "engine vs oracle",
                    work,
                    n,
                    o_ref,
                    lambda ref, L, out, m=model: engine(*layer_args(m, ref, L, out)),
                ),
                (
                    fx,
                    p,
                    "contract vs oracle",
                    work,
                    n,
                    o_ref,
                    lambda ref, L, out, m=model: quiet(contract.main, layer_args(m, ref, L, out)),
                ),
                (
                    fx,
                    p,
                    "oracle vs engine",
                    work,
                    n,
                    e_ref,
                    lambda ref, L, out, m=model: quiet(
                        oracle.main, layer_args(m, ref, L, out) + ["--threads", "1"]
                    ),
                ),
                (
                    fx,
                    p,
                    "oracle-bf16 vs engine",
                    work,
                    n,
                    e_ref,
                    lambda ref, L, out, m=model: quiet(
                        oracle.main,
                        layer_args(m, ref, L, out) + ["--threads", "1", "--dtype", "bf16"],
                    ),
                ),
            ]
    # The plant last: defective.plant patches the contract for the rest of this process.
    planted = [
        (fx, p, "rms-eps vs oracle", w, n, ref, run)
        for fx, p, pair, w, n, ref, run in runs
        if pair == "contract vs oracle"
    ]

    worst = {}
    for i, (fx, p, pair, work, n, ref, run) in enumerate(runs + planted):
        if i == len(runs):
            defective.plant("rms-eps")  # from here on the contract is the planted one
        errs = {m: [] for m in MEASURES}
        for L in range(n):
            out = work / f"{pair.split()[0]}.{names.layer_prefix(L)}trace"
            run(ref, L, out)
            for m in MEASURES:
                errs[m].append(rel_l2((ref, names.layer(L, m)), (out, names.layer(L, m))))
        line = [f"{fx:15} {p:7} {pair:22}"]
        for m in MEASURES:
            r = ratios(errs[m])
            top = max(range(n), key=lambda L: -1 if r[L] is None else r[L])
            line.append(
                f"{m} max {r[top]:.3f} (layer {top})" if r[top] is not None else f"{m} max -"
            )
            key = (pair if pair.startswith("rms") else "clean", m)
            if r[top] is not None and (key not in worst or r[top] > worst[key][0]):
                worst[key] = (r[top], fx, p, pair, top)
        print(
            " | ".join(line)
            + " | hidden_out rel L2 "
            + " ".join(f"{e:.2e}" for e in errs["hidden_out"]),
            flush=True,
        )
    for (what, m), (r, fx, p, pair, L) in sorted(worst.items()):
        print(f"largest {what} ratio of {m}: {r:.3f} ({pair}, {fx}, {p}, layer {L})")


if __name__ == "__main__":
    main()
