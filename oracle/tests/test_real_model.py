"""The real-model tier: SmolLM2-135M-Instruct (llama, trained weights, Q4_1 GGUF with its tokenizer;
scripts/real_model.py fetches it pinned and sha256-checked, and converts it to a safetensors
directory with its tokenizer). The three producers run it from the GGUF and from the directory:
the engine's trace is the contract's bit for bit, the oracle (transformers' LlamaForCausalLM)
agrees under the f32 policy, the GGUF and the directory give the same tensors, and a chat prompt
is tokenized by the model's own tokenizer and chat template. Skipped, saying why, where the
model could not be fetched — and failed under CI=true (the root conftest.py)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
from binaries import diff_report, release_binary  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("real_model", ROOT / "scripts" / "real_model.py")
real_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(real_model)

GGUF, why_gguf = real_model.path()
CONVERTED, why_converted = real_model.converted()
ENGINE, why_engine = release_binary("engine")
DIFF, why_diff = release_binary("trace-diff")
needs = pytest.mark.skipif(
    bool(why_gguf or why_engine or why_diff),
    reason=str(why_gguf or why_engine or why_diff),
)
needs_converted = pytest.mark.skipif(bool(why_converted), reason=str(why_converted))
QUESTION = "What is the capital of France?"


def trace(who: str, model: Path, out: Path, prompt: list[str]) -> Path:
    args = ["trace", "--model", str(model), *prompt, "--generate", "4", "--out", str(out)]
    cmd = (
        [str(ENGINE), *args]
        if who == "engine"
        else [sys.executable, "-m", f"tracegate_{who}", *args]
    )
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"{who}: exit {r.returncode}: {r.stderr[-1500:]}"
    return out


def judge(reference: Path, candidate: Path, policy: str | None = "f32") -> tuple[int, dict]:
    args = [str(DIFF), str(reference), str(candidate), "--json"]
    args += ["--policy", policy] if policy else []
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, diff_report(r.stdout)


def three_producers(tmp_path: Path, model: Path, prompt: list[str]):
    e = trace("engine", model, tmp_path / "e.trace", prompt)
    c = trace("contract", model, tmp_path / "c.trace", prompt)
    code, report = judge(e, c, policy=None)
    assert code == 0 and report["verdict"] == "identical", report["first_bit_difference"]
    o = trace("oracle", model, tmp_path / "o.trace", prompt)
    code, report = judge(o, e)
    assert code == 0, report["first_violation"]
    assert len(report["per_tensor"]) > 100 and report["decisions"]["compared"] == 5
    return e


@needs
@needs_converted
def test_gguf_and_its_conversion_three_producers_and_the_same_tensors(tmp_path):
    import tracegate
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(CONVERTED))
    enc = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )
    ids = [int(i) for i in enc["input_ids"]]
    (tmp_path / "gguf").mkdir()
    gguf_trace = three_producers(tmp_path / "gguf", GGUF, ["--tokens", ",".join(map(str, ids))])
    # The directory, prompted by text: tokenized by its own tokenizer and chat template.
    (tmp_path / "dir").mkdir()
    dir_trace = three_producers(tmp_path / "dir", CONVERTED, ["--text", QUESTION, "--chat"])
    a, b = tracegate.Trace(str(gguf_trace)), tracegate.Trace(str(dir_trace))
    assert b.provenance["prompt_tokens"] == ids == a.provenance["prompt_tokens"]
    # Other files, so other weights digests; the same values, so the same tensors.
    assert a.provenance["weights_digest"] != b.provenance["weights_digest"]
    assert a.names == b.names
    different = [n for n in a.names if a.tensor_digest(n) != b.tensor_digest(n)]
    assert different == [], f"the GGUF and its conversion differ at {different[:5]}"


@needs
def test_the_pinned_file_is_the_one_here():
    """The sha256 path() trusts was checked when fetched; checked again here, from the bytes."""
    assert real_model.sha256(GGUF) == real_model.GGUF_SHA256


@needs
def test_a_gguf_port_gated_against_golden_traces(tmp_path):
    """`gate init` on the GGUF itself (golden traces by the oracle, the engine as the port), then
    `gate run port` passes without torch; a model file changed by one byte of tensor data is
    refused before anything runs (its weights digest is no longer the golden traces')."""
    import json
    import shutil

    gate, why = release_binary("gate")
    if why:
        pytest.skip(why)
    shutil.copy(GGUF, tmp_path / "model.gguf")
    prompts = {
        "schema": 1,
        "about": "two prompts of SmolLM2 token ids",
        "prompts": [
            {"id": "a", "tokens": [1, 504, 3250, 314, 260, 3575, 28]},
            {"id": "b", "tokens": [1, 1534, 253, 1789, 3596, 282, 260, 5166, 30]},
        ],
    }
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    cmd = f"{ENGINE} {{verb}} {{args}}"
    init = [gate, "init", "--model", "model.gguf", "--candidate-cmd", cmd]
    init += ["--prompts", "prompts.json", "--generate", "4"]
    r = subprocess.run(init, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    run = [gate, "run", "port", "--report", "r.json"]
    env = {"PATH": "/usr/bin:/bin", "TRACEGATE_PYTHON": "/nonexistent"}  # no torch
    r = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-1500:]
    data = bytearray((tmp_path / "model.gguf").read_bytes())
    data[-100] ^= 1  # in the last tensor's data
    (tmp_path / "model.gguf").write_bytes(bytes(data))
    r = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 2 and "weights" in r.stderr, r.stdout[-800:] + r.stderr[-800:]
