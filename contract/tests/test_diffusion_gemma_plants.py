"""The five incident classes of block diffusion (docs/diffusion-gemma.md DG18), each planted in
the contract's computation (gate/tests/producers/defective_contract.py `dg-*`) and each named by
trace-diff at the pass, block, step, layer and point where it first shows. The negative control
of every plant is the same producer with `--defect none`: bit-identical to the reference, the
clean contract (the engine is bit-identical to it: test_diffusion_gemma_identity.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
from tracegate import names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODEL = "fixtures/tiny-diffusion-gemma"
DEFECTIVE = ROOT / "gate/tests/producers/defective_contract.py"
PROMPT = "5,17,300,42,9,77,101,3"
# Two blocks of canvas 7; four steps a block at most, so the last step runs at a temperature
# where the sampled canvas differs from the argmax at some rows (checked, not assumed).
RUN = ["--generate", "14", "--seed", "3", "--denoising-steps", "4"]


def produce(tmp: Path, defect: str, *extra: str, file: str | None = None) -> Path:
    out = tmp / (file or f"{defect}{'-'.join(extra)}.trace")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "contract")}
    cmd = [sys.executable, str(DEFECTIVE), "--defect", defect, "trace", "--model", MODEL]
    cmd += ["--tokens", PROMPT, "--out", str(out), "--capture", "default", *RUN, *extra]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{defect}: {r.stderr}"
    return out


def report(ref: Path, cand: Path) -> dict:
    return json.loads(tg.compare(str(ref), str(cand)).to_json())


def first_tensor(rep: dict) -> tuple[str, list[int]]:
    """The first tensor that differs by bits, and its differing rows."""
    first = rep["first_bit_difference"]
    assert first is not None, "no tensor differs"
    return first["tensor"], first["coords"]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plants")
    return tmp, produce(tmp, "none")


def test_the_unplanted_producer_is_identical(clean):
    tmp, ref = clean
    again = produce(tmp, "none", file="again.trace")
    rep = report(ref, again)
    assert rep["verdict"] == "identical", rep["findings"][:3]


def test_a_bidirectional_prompt_shows_at_the_prompt_pass_first_attention(clean):
    tmp, ref = clean
    rep = report(ref, produce(tmp, "dg-bidir-prompt"))
    name, coords = first_tensor(rep)
    # Unprefixed: the prompt's encoder pass; row 0 saw only itself and now sees every row.
    assert (name, coords[0]) == ("layer.00.attn_out", 0)
    assert names.parse(name).diffusion is None


def test_an_added_mlp_shows_at_the_dense_branch_of_layer_0(clean):
    tmp, ref = clean
    rep = report(ref, produce(tmp, "dg-mlp-add"))
    name, _ = first_tensor(rep)
    # Attention and its residual are untouched; the dense branch is the first point after.
    assert name == "layer.00.dense_mlp.branch"


def test_skipped_self_conditioning_shows_at_step_0s_sc_out(clean):
    tmp, ref = clean
    rep = report(ref, produce(tmp, "dg-sc-skip"))
    name, _ = first_tensor(rep)
    n = names.parse(name)
    assert (n.diffusion, n.point) == (names.Diffusion("denoise", 0, 0), "sc.out")
    # The prompt pass, the canvas, its embeddings and the (zero) signal are all equal before it.
    rows = {r["tensor"]: r["status"] for r in rep["per_tensor"]}
    for before in [
        "layer.03.hidden_out",
        "denoise.0000.0000.embed.out",
        "denoise.0000.0000.sc.soft",
    ]:
        assert rows[before] == "identical", before


def test_a_reply_from_the_sampled_canvas_shows_at_the_commit(clean):
    tmp, ref = clean
    t = tg.Trace(str(ref))
    steps = sorted(
        n for n in t.decisions if n.startswith("denoise.0000.") and n.endswith(".argmax")
    )
    last = steps[-1].rsplit(".", 1)[0]
    argmax, sampled = t.decisions[f"{last}.argmax"], t.decisions[f"{last}.sampled"]
    differ = [r for r in range(len(argmax)) if argmax[r] != sampled[r]]
    assert differ, "precondition: the last step of block 0 samples off the argmax somewhere"
    rep = report(ref, produce(tmp, "dg-reply-sampled"))
    first = rep["first_decision_divergence"]
    assert first["name"] == "denoise.0000.commit"
    assert first["row"] == differ[0]
    # Every tensor of block 0's steps is equal; the first tensor to differ is the commit pass's.
    name, _ = first_tensor(rep)
    assert name == "encode.0000.embed.out"


def test_or_in_the_stop_rule_shows_at_the_first_step_where_one_condition_holds(clean):
    tmp, _ = clean
    # Always confident (the bound is above ln V), never stable at step 0 (S = 1): AND runs on,
    # OR stops at once.
    ref = produce(tmp, "none", "--confidence-threshold", "100")
    rep = report(ref, produce(tmp, "dg-stop-or", "--confidence-threshold", "100"))
    first = rep["first_decision_divergence"]
    assert (first["name"], first["row"]) == ("denoise.0000.0000.stop", 2)
    assert (first["reference"], first["candidate"]) == ([0], [1])
    # Rows 0 and 1 (stable, confident) are equal; the defective run then lacks step 1.
    t, c = tg.Trace(str(ref)), tg.Trace(str(tmp / "dg-stop-or--confidence-threshold-100.trace"))
    assert list(t.decisions["denoise.0000.0000.stop"][:2]) == list(
        c.decisions["denoise.0000.0000.stop"][:2]
    )
    assert "denoise.0000.0001.canvas" in t.names and "denoise.0000.0001.canvas" not in c.names
