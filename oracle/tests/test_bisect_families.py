"""`gate bisect --reference oracle` on a checkpoint the engine does not compute (Gemma 3 with
attention-score softcapping, which the bit-exact producers refuse: sliding layers, softcaps, four
norms per layer), on a tiny seeded checkpoint (test_families.py's). The
candidate is the oracle itself with a planted defect: after transformers loads the checkpoint,
one layer's MLP down projection is scaled by 1.1 (the weights file, hence its digest, unchanged:
a port that computes that layer wrong). Slow-ish: each producer run is a Python process (4 for
the planted bisection, 2 for the control).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
from binaries import release_binary  # noqa: E402
from test_families import TOKENS, make_checkpoint  # noqa: E402

# The oracle with layer L's MLP down projection scaled after loading (a test producer shared with
# gate/tests/bisect.rs), served: one process answers every run of a bisection.
CANDIDATE = ROOT / "gate/tests/producers/planted_oracle.py"


def _gate() -> str:
    path, why = release_binary("gate")
    if why:
        pytest.skip(f"NOT CHECKED (gate bisect): {why}")
    return path


def _bisect(tmp: Path, model: Path, layer: int, scale: float, *extra: str) -> dict:
    report = tmp / f"report-{layer}-{scale}.json"
    cmd = f"'{sys.executable}' '{CANDIDATE}' --scale-mlp {layer}:{scale} {{verb|serve}} {{args}}"
    r = subprocess.run(
        [
            _gate(),
            "bisect",
            "--model",
            str(model),
            "--tokens",
            ",".join(map(str, TOKENS)),
            "--reference",
            "oracle",
            "--candidate",
            "cmd",
            "--candidate-cmd",
            cmd,
            "--work",
            str(tmp / f"work-{layer}-{scale}"),
            "--report",
            str(report),
            *extra,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=ROOT,
    )
    assert report.exists(), r.stderr
    rep = json.loads(report.read_text())
    assert rep["exit_code"] == r.returncode, (rep["summary"], r.stderr)
    return rep


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return make_checkpoint("gemma3_text", tmp_path_factory.mktemp("bisect") / "gemma3_text")


def test_bisect_against_oracle_finds_planted_layer_in_gemma3(gemma, tmp_path):
    rep = _bisect(tmp_path, gemma, 1, 1.1)
    assert rep["verdict"] == "wrong_layer" and rep["exit_code"] == 1, rep["summary"]
    assert rep["first_wrong_layer"] == 1 and rep["stage"]["tensor"] == "layer.01.mlp_out", rep[
        "summary"
    ]
    assert rep["stage"]["matching"] == ["hidden_in", "attn_out"]


def test_bisect_negative_control_unperturbed_candidate(gemma, tmp_path):
    """Same candidate, scale 1: nothing wrong (the layer verb's isolation of every Gemma layer is
    checked bit for bit in test_families.py, in process, without a process per layer)."""
    rep = _bisect(tmp_path, gemma, 1, 1.0)
    assert rep["verdict"] == "nothing_wrong" and rep["exit_code"] == 0, rep["summary"]
