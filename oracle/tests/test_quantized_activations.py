"""The simulated quantized-activation candidate (tracegate_oracle.quantized_activations) and the
q8 policy it calibrates (fixtures/policy/q8.json): the round trips are ggml's (Q8_0 bit for bit
against gguf.quants, ggml's Python reference; Q8_K and the Q8_1 block sum by hand), the honest
candidate on a tiny llama GGUF of every quantized type is within `--policy q8` and outside the
f32 policy (the simulation does perturb), and a 10% scale planted in one layer's MLP down
projection is caught by `--policy q8` at that layer's mlp_out (a 5% scale overlaps 8-bit rounding
on a trained model and is not claimed: fixtures/policy/MEASUREMENTS.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
from binaries import diff_report, release_binary  # noqa: E402
from gguf_models import Q, tiny_llama  # noqa: E402
from oracle_runner import run_module  # noqa: E402
from tracegate_oracle import quantized_activations as qa  # noqa: E402

LAYERS = 3
TOKENS = "1,17,250,5,42,7,99,3,64,128,11,200"
DIFF, why_diff = release_binary("trace-diff")
needs_diff = pytest.mark.skipif(bool(why_diff), reason=str(why_diff))


# -- the round trips


def test_q8_0_is_ggmls_reference_bit_for_bit():
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((16, 256)) * rng.exponential(1, (16, 256))).astype(np.float32)
    x[0, :32] = 0  # an all-zero block
    x[1, :32] = np.arange(32, dtype=np.float32) - 15.5  # amax 16.5: no exact ties
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5
    x[2, 0] = 127  # d = 1: half-integers, roundf rounds them away from zero
    x[3, :32] = np.float32(0.49999997)
    x[3, 0] = 127  # in f32, 0.49999997 + 0.5 rounds to 1: roundf must still give 0
    ref = gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0)
    got = qa.q8_0(torch.from_numpy(x)).numpy()
    assert np.array_equal(ref.view(np.uint32), got.view(np.uint32))
    # negative control: rounding half to even (torch.round; d = 1 in that block) is not ggml's
    even = torch.round(torch.from_numpy(x[2, :32])).numpy()
    assert not np.array_equal(even, ref[2, :32])
    assert got[2, 1] == -15.0 and even[1] == -14.0


def test_q8_K_by_hand():
    b = np.zeros((2, 256), dtype=np.float32)
    b[0, :6] = [-127, 2.5, 3.5, -0.25, 127, 1e-3]  # max: the first of |-127| = |127|, signed
    got = qa.q8_K(torch.from_numpy(b)).numpy()
    # iscale = -127/-127 = 1: nearest_int rounds half to even, 127 stays, tiny values go to +0
    assert got[0, :6].tolist() == [-127, 2, 4, 0, 127, 0]
    assert not np.signbit(got[0, 3])
    assert np.all(got[1] == 0)  # an all-zero block stays zero
    c = np.zeros((1, 256), dtype=np.float32)
    c[0, :3] = [3.0, -1.0, 1.5]  # max 3: iscale = -127/3, d = 1/iscale (f32)
    iscale = np.float32(-127) / np.float32(3)
    want = [np.float32(round(float(np.float32(iscale * v)))) / iscale for v in c[0, :3]]
    got = qa.q8_K(torch.from_numpy(c)).numpy()[0, :3]
    assert np.allclose(got, np.array(want, dtype=np.float32), rtol=0, atol=1e-6)
    assert not np.array_equal(got, c[0, :3])  # 3 * 127/3 is not exact: a round trip, not identity


def test_q8_1_block_sum_term():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    q, d, d16 = qa.q8_0_parts(torch.from_numpy(x))
    sq = q.sum(-1).numpy().astype(np.float64)
    s = (sq.astype(np.float32) * d.squeeze(-1).numpy()).astype(np.float16).astype(np.float64)
    want = s - d16.squeeze(-1).numpy().astype(np.float64) * sq
    assert np.array_equal(qa.q8_1_sum_error(torch.from_numpy(x)).numpy(), want)
    assert np.any(want != 0)  # the term exists: f16(Σq·d) is not f16(d)·Σq


def test_unknown_width_is_refused_with_the_path():
    with pytest.raises(qa.OracleError, match="model.layers.0.mlp.down_proj: input width 40"):
        qa.q8_0(torch.zeros(2, 40), "model.layers.0.mlp.down_proj")


# -- a tiny llama GGUF of every type, and trace-diff on the simulated candidate


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("q8act") / "tiny-llama-q8act.gguf"
    types = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K, Q.F16, Q.Q4_1, Q.Q4_K]
    return tiny_llama(path, LAYERS, types, Q.Q4_1)


def _run(module: str, model: Path, out: Path, *extra: str) -> Path:
    # Prefill only: on this random-weight model one decode row's MLP amplifies 8-bit rounding past
    # the bounds measured on a trained one (fixtures/policy/MEASUREMENTS.md, "Quantized activations").
    args = ["trace", "--model", str(model), "--tokens", TOKENS]
    args += ["--capture", "internals", "--out", str(out), *extra]
    r = run_module(module, *args, timeout=600)
    assert r.returncode == 0, f"{module}: exit {r.returncode}: {r.stderr[-1500:]}"
    return out


@pytest.fixture(scope="module")
def traces(model, tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("q8act-traces")
    return {
        "oracle": _run("tracegate_oracle", model, d / "oracle.trace"),
        "q8": _run("tracegate_oracle.quantized_activations", model, d / "q8.trace"),
        "planted": _run(
            "tracegate_oracle.quantized_activations",
            model,
            d / "planted.trace",
            "--plant-down",
            "1:1.1",
        ),
    }


def judge(reference: Path, candidate: Path, policy: str) -> tuple[int, dict]:
    r = subprocess.run(
        [str(DIFF), str(reference), str(candidate), "--json", "--policy", policy],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, diff_report(r.stdout)


def test_the_candidate_says_what_it_is(model, traces):
    import tracegate

    prov = tracegate.Trace(str(traces["q8"])).provenance
    assert prov["producer"] == "oracle-q8-activations"
    by = prov["activations"]["by_weight_type"]
    assert {k: v["activations"] for k, v in by.items()} == {
        "Q8_0": "q8_0",
        "Q4_0": "q8_0",
        "Q4_1": "q8_1",
        "Q6_K": "q8_K",
        "Q4_K": "q8_K",
        "F16": "f16",
    }
    assert sum(v["linears"] for v in by.values()) == 7 * LAYERS + 1  # and the head (output.weight)
    assert prov["activations"]["q4_1_sum_term"] is True
    assert "planted" not in prov["activations"]
    planted = tracegate.Trace(str(traces["planted"])).provenance["activations"]["planted"]
    assert planted == [{"layer": 1, "mlp.down_proj scale": 1.1}]


@needs_diff
def test_the_honest_candidate_is_within_q8_and_outside_f32(traces):
    rc, rep = judge(traces["oracle"], traces["q8"], "q8")
    assert rc == 0, rep.get("first_violation")
    assert rep["policy"]["name"] == "q8-activations"
    # negative control: the simulation moves every matmul's output beyond f32 rounding
    rc, rep = judge(traces["oracle"], traces["q8"], "f32")
    assert rc == 1
    assert rep["first_violation"]["tensor"] == "layer.00.q"


@needs_diff
def test_a_ten_percent_mlp_scale_is_caught_at_its_layer(traces):
    rc, rep = judge(traces["oracle"], traces["planted"], "q8")
    assert rc == 1
    fv = rep["first_violation"]
    assert fv["tensor"] == "layer.01.mlp_out", json.dumps(fv)[:800]
    assert [v["bound"] for v in fv["violations"]] == ["max_scale_error"]


def test_a_safetensors_checkpoint_is_refused(tmp_path):
    # The weight types set the scheme: without a GGUF file there is nothing to simulate.
    with pytest.raises(qa.OracleError, match=f"--model {tmp_path}: not a GGUF file"):
        qa.capture(None, tmp_path, [1, 2], None, None)
