"""The contract refuses what the engine refuses (issue 12, items 13 and 15): absurd config sizes,
hostile safetensors files and JSON, and `layer` inputs the engine will not take. Both sides
must exit 2 with one line naming the field or file — never a crash, a traceback or a result.

The engine runs as its CLI (an abort or panic there is an exit status, not a dead test run);
the contract runs its CLI's `main` in-process (a Python exception would fail the test)."""

from __future__ import annotations

import json
import os
import struct
import subprocess

import numpy as np
import pytest

from conftest import make_model_dir, tiny_config

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

from test_engine_identity import ENGINE, needs_engine  # noqa: E402
from tracegate_contract.__main__ import main  # noqa: E402


def engine_refusal(*args) -> str:
    r = subprocess.run([ENGINE, *map(str, args)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, f"engine {args[0]}: exit {r.returncode}: {r.stderr.strip()[-500:]}"
    assert len(r.stderr.strip().splitlines()) == 1 and "panicked" not in r.stderr, r.stderr
    return r.stderr.strip()


def contract_refusal(capsys, *args) -> str:
    capsys.readouterr()
    assert main([str(a) for a in args]) == 2, "the contract accepted it"
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def both_refuse_trace(capsys, tmp_path, model, named):
    """`trace` on `model` is refused by both, each naming `named`."""
    out = tmp_path / "x.trace"
    e = engine_refusal("trace", "--model", model, "--tokens", "1,2", "--out", out)
    c = contract_refusal(capsys, "trace", "--model", model, "--tokens", "1,2", "--out", out)
    assert named in e and named in c, f"engine: {e}\ncontract: {c}"
    assert not out.exists()


# ---- item 13: sizes -------------------------------------------------------------------------

DENSE_SIZES = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "max_position_embeddings",
]
# num_experts = 0 is a valid config (every layer dense, §10), refused only by the tensors it leaves.
MOE_SIZES = [
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "num_hidden_layers",
    "hidden_size",
]
ABSURD = {"2^40": 1 << 40, "2^62": 1 << 62, "0": 0, "-1": -1}


@needs_engine
@pytest.mark.parametrize(
    "family,field", [("dense", f) for f in DENSE_SIZES] + [("moe", f) for f in MOE_SIZES]
)
def test_absurd_sizes_refused_by_both_naming_the_field(capsys, tmp_path, family, field):
    """2^40 layers once aborted the engine on a 518 TB allocation, 2^62 panicked; each size is
    now checked against the checkpoint before anything is allocated, on both sides."""
    model = make_model_dir(tmp_path / "m", family, dtype="BF16" if family == "moe" else "F32")
    good = json.loads(open(os.path.join(model, "config.json")).read())
    for _label, value in ABSURD.items():
        if field == "num_experts" and value == 0:
            continue
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump({**good, field: value}, f)
        both_refuse_trace(capsys, tmp_path, model, field)


@needs_engine
def test_all_sparse_config_with_2_62_layers_refused_by_both_at_once(capsys, tmp_path):
    """No intermediate_size, every layer sparse: 'is any layer dense?' once visited all 2^62."""
    model = make_model_dir(tmp_path / "m", "moe", mlp_only_layers=[])
    cfg = json.loads(open(os.path.join(model, "config.json")).read())
    del cfg["intermediate_size"]
    cfg["num_hidden_layers"] = 1 << 62
    with open(os.path.join(model, "config.json"), "w") as f:
        json.dump(cfg, f)
    both_refuse_trace(capsys, tmp_path, model, "num_hidden_layers")


# ---- item 15: files -------------------------------------------------------------------------


def _rewrite_safetensors(model, edit):
    """Rewrite model.safetensors from its header and data, through `edit(header, data)`."""
    p = os.path.join(model, "model.safetensors")
    raw = open(p, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8 : 8 + n]), raw[8 + n :])
    h = header.encode() if isinstance(header, str) else json.dumps(header).encode()
    with open(p, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + data)


def _duplicate_first(header, data):
    first = next(iter(header))
    text = json.dumps(header)
    return text[:-1] + f", {json.dumps(first)}: {json.dumps(header[first])}}}", data


def _nested_metadata(depth):
    def edit(header, data):
        text = json.dumps(header)
        return text[:-1] + ', "__junk__": ' + "[" * (depth - 1) + "]" * (depth - 1) + "}", data

    return edit


SAFETENSORS_CASES = {
    "duplicate-tensor-name": (_duplicate_first, "duplicate"),
    "trailing-junk": (lambda h, d: (h, d + b"\0" * 8), "trailing"),
    "nested-128-deep": (_nested_metadata(128), "model.safetensors"),
    "nested-100000-deep": (_nested_metadata(100000), "model.safetensors"),
}


@needs_engine
@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_hostile_safetensors_refused_by_both(capsys, tmp_path, case):
    edit, named = SAFETENSORS_CASES[case]
    model = make_model_dir(tmp_path / "m")
    _rewrite_safetensors(model, edit)
    both_refuse_trace(capsys, tmp_path, model, named)


@pytest.mark.parametrize("producer", ["contract", pytest.param("engine", marks=needs_engine)])
@pytest.mark.parametrize("depth,accepted", [(127, True), (128, False), (100000, False)])
def test_config_nesting_limit_is_the_engines(capsys, tmp_path, producer, depth, accepted):
    """serde_json (the engine's parser) takes 127 nested levels and refuses 128; the contract
    draws the line at the same place, and a very deep file is one line, not a RecursionError."""
    model = make_model_dir(tmp_path / "m")
    text = (
        json.dumps(tiny_config())[:-1]
        + ', "__junk__": '
        + "[" * (depth - 1)
        + "]" * (depth - 1)
        + "}"
    )
    with open(os.path.join(model, "config.json"), "w") as f:
        f.write(text)
    args = ("trace", "--model", model, "--tokens", "1,2", "--out", tmp_path / "x.trace")
    if producer == "contract" and accepted:
        assert main([str(a) for a in args]) == 0
    elif producer == "contract":
        assert "config.json" in contract_refusal(capsys, *args)
    elif accepted:
        r = subprocess.run([ENGINE, *map(str, args)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
    else:
        assert "config.json" in engine_refusal(*args)


# ---- item 15: layer inputs ------------------------------------------------------------------


def _input(tmp_path, array, positions):
    p = str(tmp_path / "in.trace")
    with tracegate.TraceWriter(p, {"producer": "test"}) as w:
        w.tensor("h", array, path="prefill", mask="causal", positions=positions)
    return p


LAYER_INPUTS = {
    "integer-dtype": (lambda: np.arange(2 * 16, dtype=np.int32).reshape(2, 16), [0, 1], "i32"),
    "position-2^24": (lambda: np.ones((2, 16), np.float32), [0, 1 << 24], "position"),
    "position-negative": (lambda: np.ones((2, 16), np.float32), [-1, 0], "position"),
    "zero-rows": (lambda: np.ones((0, 16), np.float32), [], "h"),
}


@needs_engine
@pytest.mark.parametrize("case", list(LAYER_INPUTS))
def test_bad_layer_inputs_refused_by_both(capsys, tmp_path, case):
    make, positions, named = LAYER_INPUTS[case]
    model = make_model_dir(tmp_path / "m")
    inp = _input(tmp_path, make(), positions)
    out = tmp_path / "y.trace"
    args = (
        "layer",
        "--model",
        model,
        "--layer",
        0,
        "--input",
        inp,
        "--input-name",
        "h",
        "--out",
        out,
    )
    e = engine_refusal(*args)
    c = contract_refusal(capsys, *args)
    assert named in e and named in c, f"engine: {e}\ncontract: {c}"
    assert not out.exists()


# ---- a run past max_position_embeddings (the oracle and the gate refuse it too) ---------------


@needs_engine
def test_a_run_past_max_position_embeddings_is_refused_by_both(capsys, tmp_path):
    model = make_model_dir(tmp_path / "m", max_position_embeddings=4)
    out = tmp_path / "x.trace"
    args = ["trace", "--model", model, "--tokens", "1,2", "--out", out]
    msg = "2 prompt tokens plus 3 generated = 5 positions exceed max_position_embeddings 4"
    e = engine_refusal(*args, "--generate", "3")
    c = contract_refusal(capsys, *args, "--generate", "3")
    assert msg in e and msg in c, f"engine: {e}\ncontract: {c}"
    assert not out.exists()
    # The control: 4 positions fit.
    r = subprocess.run([ENGINE, *map(str, args), "--generate", "2"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert main([str(a) for a in [*args, "--generate", "2"]]) == 0


@needs_engine
def test_token_ids_with_spaces_are_refused_by_both(capsys, tmp_path):
    """One grammar (tracegate.protocol, tracegate_trace::protocol): `3, 17, 5` is refused by the
    engine and the contract alike, where int() alone would have let the contract read it."""
    model = make_model_dir(tmp_path / "m")
    out = tmp_path / "x.trace"
    for ids in ("3, 17, 5", "+5", "1_0"):
        args = ["trace", "--model", model, "--tokens", ids, "--out", out]
        r = subprocess.run([ENGINE, *map(str, args)], capture_output=True, text=True)
        assert r.returncode == 2 and "digits only" in r.stderr, r.stderr
        capsys.readouterr()
        assert main([str(a) for a in args]) == 2
        assert "digits only" in capsys.readouterr().err
        assert not out.exists()
