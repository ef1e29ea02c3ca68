#!/usr/bin/env python3
"""How long the numpy contract takes on a 65-token prompt (an observation, not a test).

    .venv/bin/python scripts/bench_contract.py [MODEL_DIR ...] [--tokens N] [--repeat R]

With no MODEL_DIR: the two tiny fixtures, plus fixtures/bench-* if present. For each model
it prints the contract's load time and prefill time (in-process, best of R), the contract's
whole CLI run (`python -m tracegate_contract trace`, a fresh process, default capture), and,
when target/release/engine exists, the engine's CLI run (--engine-threads, default 1) on the same prompt, the
ratio contract / engine of the two CLI runs, and whether the two traces have the same digest.
The bench model is made by `scripts/make_fixtures.py bench-qwen3 --out DIR`.
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
ENGINE = os.path.join(ROOT, "target", "release", "engine")


def _cli(cmd, env=None) -> tuple[float, str]:
    """Wall seconds of one run, and the digest it printed."""
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    dt = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{r.stderr.strip()}")
    return dt, r.stdout.split()[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="*")
    ap.add_argument("--tokens", type=int, default=65)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument(
        "--engine-threads",
        type=int,
        default=1,
        help="engine threads (1: like the contract, whose numpy loops run on one core; the engine's bits do not depend on it)",
    )
    args = ap.parse_args()
    models = args.models or (
        [os.path.join(ROOT, "fixtures", f) for f in ("tiny-qwen3", "tiny-qwen3-moe")]
        + sorted(glob.glob(os.path.join(ROOT, "fixtures", "bench-*")))
    )
    from tracegate_contract import Capture, Model

    print(
        f"{'model':<20} {'load s':>7} {'prefill s':>10} {'contract CLI s':>15} {'engine CLI s':>13} {'ratio':>7}  same digest"
    )
    for m in models:
        t0 = time.perf_counter()
        model = Model(m)
        load = time.perf_counter() - t0
        V = model.cfg.vocab_size
        toks = [(7 * i + 3) % V for i in range(args.tokens)]
        best = float("inf")
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            model.run(toks, Capture())
            best = min(best, time.perf_counter() - t0)
        tok_arg = ",".join(map(str, toks))
        with tempfile.TemporaryDirectory() as tmp:
            c_cli, c_digest = _cli(
                [
                    sys.executable,
                    "-m",
                    "tracegate_contract",
                    "trace",
                    "--model",
                    m,
                    "--tokens",
                    tok_arg,
                    "--out",
                    os.path.join(tmp, "c.trace"),
                ]
            )
            e_cli = e_digest = None
            if os.access(ENGINE, os.X_OK):
                runs = [
                    _cli(
                        [
                            ENGINE,
                            "trace",
                            "--model",
                            m,
                            "--tokens",
                            tok_arg,
                            "--threads",
                            str(args.engine_threads),
                            "--out",
                            os.path.join(tmp, "e.trace"),
                        ]
                    )
                    for _ in range(args.repeat)
                ]
                e_cli, e_digest = min(runs)
        e_txt = f"{e_cli:13.3f}" if e_cli is not None else f"{'(no engine)':>13}"
        ratio = f"{c_cli / e_cli:7.1f}" if e_cli else f"{'-':>7}"
        same = (
            "-"
            if e_digest is None
            else ("yes" if e_digest == c_digest else f"NO ({e_digest[:12]} vs {c_digest[:12]})")
        )
        print(
            f"{os.path.basename(m.rstrip('/')):<20} {load:7.3f} {best:10.3f} {c_cli:15.3f} {e_txt} {ratio}  {same}"
        )


if __name__ == "__main__":
    main()
