"""A 101-layer model through every tool: layer numbers past 99 are read with all their digits.

Capture-point names are built and parsed in one place per language (trace/src/names.rs,
tracegate.names); a two-digit reader would take `layer.100.x` for layer 10. The engine, the
contract and the oracle write `layer.100.*`; trace-diff compares the engine with the oracle; gate
bisect blames a defect planted in layer 100 (gate/tests/producers/defective_contract.py
--defect mlp-add@100: the MLP block adds its input), and nothing else.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import tracegate
from tracegate import names

from conftest import make_model_dir, release_binary

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENGINE, NO_ENGINE = release_binary("engine")
TRACE_DIFF, NO_TRACE_DIFF = release_binary("trace-diff")
GATE, NO_GATE = release_binary("gate")
LAYERS = 101
TOKENS = "3,17,5,9,30,1"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("layers101")
    return d, make_model_dir(d / "model", num_hidden_layers=LAYERS)


def run(cmd, **kw):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=ROOT, **kw)
    assert r.returncode == 0, f"$ {' '.join(map(str, cmd))}\n{r.stdout}\n{r.stderr}"
    return r


def layer_numbers(path) -> set[int]:
    return {names.parse(n).layer for n in tracegate.Trace(str(path)).names} - {None}


@pytest.mark.skipif(bool(NO_ENGINE or NO_TRACE_DIFF), reason=NO_ENGINE or NO_TRACE_DIFF or "")
def test_engine_contract_oracle_and_trace_diff_number_101_layers(models):
    d, good = models
    args = ["trace", "--model", good, "--tokens", TOKENS, "--capture", "internals"]
    run([ENGINE, *args, "--out", d / "engine.trace"])
    run([sys.executable, "-m", "tracegate_contract", *args, "--out", d / "contract.trace"])
    run([sys.executable, "-m", "tracegate_oracle", *args, "--out", d / "oracle.trace"])
    for p in ("engine", "contract", "oracle"):
        assert layer_numbers(d / f"{p}.trace") == set(range(LAYERS)), p
    e, c = tracegate.Trace(str(d / "engine.trace")), tracegate.Trace(str(d / "contract.trace"))
    mlp_outs = [n for n in e.names if n.endswith(".mlp_out")]
    assert len(mlp_outs) == LAYERS and mlp_outs[-1] == "layer.100.mlp_out", mlp_outs[-3:]
    assert [e.tensor_digest(n) for n in e.names] == [c.tensor_digest(n) for n in c.names]
    r = subprocess.run(
        [TRACE_DIFF, "--policy", "f32", "--json", d / "engine.trace", d / "oracle.trace"],
        capture_output=True,
        text=True,
    )
    report = json.loads(r.stdout)
    assert r.returncode == 0, report["verdict"]
    rows = {row["tensor"] for row in report["per_tensor"]}
    assert {"layer.99.hidden_out", "layer.100.hidden_out"} <= rows


@pytest.mark.skipif(bool(NO_GATE), reason=NO_GATE or "")
def test_bisect_blames_layer_100_not_10(models):
    d, good = models
    script = os.path.join(ROOT, "gate/tests/producers/defective_contract.py")
    cand = f"'{sys.executable}' '{script}' --defect mlp-add@100 {{verb|serve}} {{args}}"
    out = d / "bisect.json"
    b = subprocess.run(
        [GATE, "--root", ROOT, "bisect", "--model", good, "--tokens", TOKENS]
        + ["--reference", "engine", "--candidate", "cmd", "--candidate-cmd", cand]
        + ["--work", d / "work", "--report", out],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert b.returncode == 1, b.stdout + b.stderr
    report = json.loads(out.read_text())
    assert report["first_wrong_layer"] == LAYERS - 1, b.stdout
    assert report["stage"]["tensor"] == "layer.100.mlp_out", report["stage"]
    # Negative control: the same bisection against the good checkpoint finds nothing wrong.
    good_cand = cand.replace("mlp-add@100", "none")
    b = subprocess.run(
        [GATE, "--root", ROOT, "bisect", "--model", good, "--tokens", TOKENS]
        + ["--reference", "engine", "--candidate", "cmd", "--candidate-cmd", good_cand]
        + ["--work", d / "work-good"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert b.returncode == 0, b.stdout + b.stderr
