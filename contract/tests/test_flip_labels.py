"""A real bug's flips are labelled `consequence`, never `near-tie` (docs/diff.md, "Labels").

The contract with one planted defect — layer 1 attends bidirectionally (gate/tests/producers/
defective_contract.py, which monkeypatches the contract without changing it) — against the
engine, judged by trace-diff under the shipped oracle policy: on the frozen prompt `short` the
dense fixture's argmax flips, and every flip must name the planted layer's `attn_probs`, the
first tensor outside the policy. The unplanted contract is the control: no flip at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import FIXTURES, ROOT, release_binary

ENGINE, _NO_ENGINE = release_binary("engine")
TRACE_DIFF, _NO_TRACE_DIFF = release_binary("trace-diff")
pytestmark = pytest.mark.skipif(
    bool(_NO_ENGINE or _NO_TRACE_DIFF),
    reason=" and ".join(r for r in (_NO_ENGINE, _NO_TRACE_DIFF) if r) or "built",
)

WRAPPER = os.path.join(ROOT, "gate", "tests", "producers", "defective_contract.py")
POLICY = os.path.join(ROOT, "fixtures", "policy", "oracle-default.json")
PLANTED_LAYER = "layer.01"  # where bidir-mask plants the defect


def short_prompt() -> list[int]:
    with open(os.path.join(ROOT, "fixtures", "prompts", "frozen.json")) as f:
        return next(p["tokens"] for p in json.load(f)["prompts"] if p["id"] == "short")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)


def traces(tmp_path, defect: str) -> tuple[str, str]:
    tokens = ",".join(map(str, short_prompt()))
    eng, cand = str(tmp_path / "engine.trace"), str(tmp_path / f"{defect}.trace")
    args = ["trace", "--model", FIXTURES["dense"], "--tokens", tokens, "--capture", "internals"]
    r = run([ENGINE, *args, "--out", eng])
    assert r.returncode == 0, r.stderr
    r = run([sys.executable, WRAPPER, "--defect", defect, *args, "--out", cand])
    assert r.returncode == 0, r.stderr
    return eng, cand


def diff(eng: str, cand: str) -> tuple[int, dict, str]:
    r = run([TRACE_DIFF, "--policy", POLICY, "--json", eng, cand])
    human = run([TRACE_DIFF, "--policy", POLICY, eng, cand])
    return r.returncode, json.loads(r.stdout), human.stdout


def test_flips_after_a_bidirectional_layer_are_its_consequences(tmp_path):
    code, rep, human = diff(*traces(tmp_path, "bidir-mask"))
    assert code == 1 and rep["verdict"] == "different"
    # The first tensor outside the policy, read from the per-tensor rows, is in the planted
    # layer: every tensor before it is within the policy.
    outside = [t["tensor"] for t in rep["per_tensor"] if t["status"] == "outside_policy"]
    assert outside and outside[0] == f"{PLANTED_LAYER}.attn_probs", outside
    flips = [(d["name"], f) for d in rep["decisions"]["results"] for f in d["flips"]]
    assert flips, "the planted defect must flip a decision on this prompt"
    for name, f in flips:
        assert (f["label"], f["upstream"]) == ("consequence", f"{PLANTED_LAYER}.attn_probs"), (
            name,
            f,
        )
    assert rep["decisions"]["near_ties"]["excused"] == []
    assert f"→ consequence of {PLANTED_LAYER}.attn_probs" in human
    assert "near-tie" not in human.splitlines()[0]


def test_the_unplanted_contract_flips_nothing(tmp_path):
    code, rep, _ = diff(*traces(tmp_path, "none"))
    assert code == 0 and rep["verdict"] == "identical", rep["findings"]
    assert all(not d["flips"] for d in rep["decisions"]["results"])
