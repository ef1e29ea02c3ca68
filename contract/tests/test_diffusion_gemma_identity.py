"""Engine ≡ contract on block diffusion (docs/diffusion-gemma.md), bit for bit: the same digest
on fixtures/tiny-diffusion-gemma for prompts of 1, 8 and 17 tokens (past the sliding window),
both capture levels, seeds at both ends of their range, the knobs that change the loop (an early
stop, S = 0, EOS with pad, a longer schedule), `--generate 0`, and each producer forced by the
other's trace. The two share a generator (DG15), so every draw is the same.

The negative control is in test_diffusion_gemma_plants.py: the same comparison names each of the
five incident classes where it first shows."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, release_binary

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)
ENGINE, _NO_ENGINE = release_binary("engine")
pytestmark = pytest.mark.skipif(bool(_NO_ENGINE), reason=_NO_ENGINE or "built")

MODEL = os.path.join(ROOT, "fixtures", "tiny-diffusion-gemma")
P8 = "5,17,300,42,9,77,101,3"
P17 = "499,0,1,2,3,250,250,250,250,7,8,9,10,11,12,13,499"

CASES = {
    "internals-seed-3": (P8, ["--capture", "internals", "--generate", "14", "--seed", "3"]),
    "one-token-max-seed": ("7", ["--generate", "14", "--seed", str(2**64 - 1)]),
    "past-the-window": (P17, ["--capture", "internals", "--generate", "8", "--seed", "11"]),
    "early-stop": (P8, ["--generate", "14", "--confidence-threshold", "10"]),
    "always-stable": (P8, ["--generate", "14", "--stability-threshold", "0", "--seed", "5"]),
    "eos-pad": (P8, ["--generate", "21", "--eos", "467", "--pad", "0", "--seed", "3"]),
    "long-hot-schedule": (
        P8,
        ["--generate", "7", "--denoising-steps", "9", "--t-max", "2.5", "--t-min", "0.1"],
    ),
    "prompt-only": (P17, ["--capture", "internals", "--generate", "0"]),
}


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr}"


def engine(tokens: str, out, extra: list[str]) -> str:
    run([ENGINE, "trace", "--model", MODEL, "--tokens", tokens, "--out", str(out), *extra])
    return str(out)


def contract(tokens: str, out, extra: list[str]) -> str:
    env_cmd = [sys.executable, "-m", "tracegate_contract", "trace", "--model", MODEL]
    run([*env_cmd, "--tokens", tokens, "--out", str(out), *extra])
    return str(out)


def assert_identical(a: str, b: str) -> None:
    rep = tracegate.compare(a, b)
    assert rep.verdict == "identical", rep.to_json()[:2000]


@pytest.mark.parametrize("case", list(CASES))
def test_engine_and_contract_are_bit_identical(tmp_path, case):
    tokens, extra = CASES[case]
    e = engine(tokens, tmp_path / "e.trace", extra)
    c = contract(tokens, tmp_path / "c.trace", extra)
    assert_identical(e, c)
    assert tracegate.Trace(e).digest == tracegate.Trace(c).digest


def test_each_forced_by_the_others_trace_with_another_seed_is_identical(tmp_path):
    tokens, extra = CASES["internals-seed-3"]
    e = engine(tokens, tmp_path / "e.trace", extra)
    other = [*extra[:-1], "9"]  # seed 9: every draw comes from the forcing trace instead
    fc = contract(tokens, tmp_path / "fc.trace", [*other, "--force-decisions", e])
    c = contract(tokens, tmp_path / "c.trace", extra)
    fe = engine(tokens, tmp_path / "fe.trace", [*other, "--force-decisions", c])
    # A forced run differs from its reference only in provenance and the `forced` attribute.
    t_e, t_fc, t_fe = (tracegate.Trace(p) for p in (e, fc, fe))
    for forced in (t_fc, t_fe):
        assert forced.names == t_e.names
        for n in t_e.names:
            assert (forced[n] == t_e[n]).all(), n
        assert {k: v.tolist() for k, v in forced.decisions.items()} == {
            k: v.tolist() for k, v in t_e.decisions.items()
        }


def test_the_comparison_sees_a_planted_defect(tmp_path):
    # Negative control: the engine against the contract with self-conditioning skipped at
    # step 0 (gate/tests/producers/defective_contract.py) is not identical, first at sc.out.
    tokens, extra = CASES["internals-seed-3"]
    e = engine(tokens, tmp_path / "e.trace", extra)
    defective = os.path.join(ROOT, "gate", "tests", "producers", "defective_contract.py")
    out = str(tmp_path / "d.trace")
    run(
        [
            sys.executable,
            defective,
            "--defect",
            "dg-sc-skip",
            "trace",
            "--model",
            MODEL,
            "--tokens",
            tokens,
            "--out",
            out,
            *extra,
        ]
    )
    rep = tracegate.compare(e, out)
    assert rep.verdict == "different"
    assert rep.first_bit_difference["tensor"] == "denoise.0000.0000.sc.out"


def test_the_layer_verb_is_bit_identical(tmp_path):
    # On the engine's --capture internals trace (two blocks, 17-token prompt: past the window),
    # the prompt pass, a commit pass and denoise steps of block 1, a sliding and a full layer,
    # unforced and forced by the same trace: the two layer traces have the same digest.
    tokens, extra = CASES["past-the-window"]
    src = engine(tokens, tmp_path / "e.trace", ["--capture", "internals", "--generate", "14"])
    names = ["layer.{L}.hidden_in", "encode.0000.layer.{L}.hidden_in"]
    names += ["denoise.0001.0000.layer.{L}.hidden_in", "denoise.0000.0002.layer.{L}.hidden_in"]
    for i, pattern in enumerate(names):
        for lay in (0, 1):
            name = pattern.format(L=f"{lay:02d}")
            for j, force in enumerate([[], ["--force-decisions", src]]):
                args = ["layer", "--model", MODEL, "--layer", str(lay), "--input", src]
                args += ["--input-name", name, "--capture", "internals", *force, "--out"]
                e, c = tmp_path / f"le{i}{lay}{j}", tmp_path / f"lc{i}{lay}{j}"
                run([ENGINE, *args, str(e)])
                run([sys.executable, "-m", "tracegate_contract", *args, str(c)])
                assert_identical(str(e), str(c))
                assert tracegate.Trace(str(e)).digest == tracegate.Trace(str(c)).digest, name
