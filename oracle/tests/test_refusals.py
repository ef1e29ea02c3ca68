"""The oracle CLI refuses what the engine and contract refuse, before transformers builds a model:
each case is a mutated copy of a committed fixture, and each refusal is exit 2 with one line on
stderr naming the file and the field, no traceback and no trace written. Before these checks the
same inputs hung (2^40 layers), ended in tracebacks (ZeroDivisionError, SafetensorError,
`selected index k out of range`), wrote NaN traces with exit 0, or loaded pytorch_model.bin.

Most refusals come before torch is imported (about a second each); those marked `torch` need
transformers' classes.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from oracle_runner import run_oracle

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"
MOE = ROOT / "fixtures" / "tiny-qwen3-moe"


def _cfg(key, value, sub=None):
    def edit(c):
        (c[sub] if sub else c)[key] = value

    return edit


def _header(raw: bytes):
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[8 : 8 + n].decode(), raw[8 + n :]


def _with_header(text: str, data: bytes) -> bytes:
    b = text.encode()
    b += b" " * (-len(b) % 8)
    return struct.pack("<Q", len(b)) + b + data


def _duplicate_name(raw: bytes) -> bytes:
    text, data = _header(raw)
    name, entry = next((k, v) for k, v in json.loads(text).items() if k != "__metadata__")
    # The same name twice, both entries valid: json (and the safetensors library) keep the last.
    return _with_header(text.rstrip()[:-1] + f", {json.dumps(name)}: {json.dumps(entry)}}}", data)


def _torch_bin(d: Path) -> None:
    """A pytorch_model.bin with the real weights; the safetensors file renamed to a decoy that
    transformers skips (it looks for model.safetensors) but the weights digest would cover."""
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, torch; from safetensors.torch import load_file; "
            "torch.save(load_file(sys.argv[1] + '/model.safetensors'), sys.argv[1] + '/pytorch_model.bin')",
            str(d),
        ],
        check=True,
        timeout=120,
    )
    (d / "model.safetensors").rename(d / "decoy.safetensors")


CASES = {
    # id: (fixture, config edit, safetensors edit, directory edit, words the line must hold)
    "layers-2pow40": (
        DENSE,
        _cfg("num_hidden_layers", 2**40),
        None,
        None,
        ["config.json", "num_hidden_layers = 1099511627776", "0..4"],
    ),
    "layers-2pow62": (
        DENSE,
        _cfg("num_hidden_layers", 2**62),
        None,
        None,
        ["config.json", "num_hidden_layers"],
    ),
    "layers-more": (DENSE, _cfg("num_hidden_layers", 6), None, None, ["num_hidden_layers = 6"]),
    "heads-0": (DENSE, _cfg("num_attention_heads", 0), None, None, ["num_attention_heads = 0"]),
    "kv-heads-0": (DENSE, _cfg("num_key_value_heads", 0), None, None, ["num_key_value_heads = 0"]),
    "kv-heads-not-divisor": (
        DENSE,
        _cfg("num_key_value_heads", 3),
        None,
        None,
        ["num_key_value_heads 3"],
    ),
    "head-dim-0": (DENSE, _cfg("head_dim", 0), None, None, ["head_dim = 0"]),
    "hidden-0": (DENSE, _cfg("hidden_size", 0), None, None, ["hidden_size = 0"]),
    "positions-2pow40": (
        DENSE,
        _cfg("max_position_embeddings", 2**40),
        None,
        None,
        ["max_position_embeddings = 1099511627776", "2^24"],
    ),
    "vocab-1": (DENSE, _cfg("vocab_size", 1), None, None, ["vocab_size = 1"]),
    "eps-nan": (DENSE, _cfg("rms_norm_eps", float("nan")), None, None, ["rms_norm_eps = nan"]),
    "eps-not-number": (DENSE, _cfg("rms_norm_eps", "1e-6"), None, None, ["rms_norm_eps"]),
    "theta-0": (
        DENSE,
        _cfg("rope_theta", 0.0, sub="rope_parameters"),
        None,
        None,
        ["rope_parameters.rope_theta = 0.0"],
    ),
    "theta-negative": (
        DENSE,
        _cfg("rope_theta", -10000.0, sub="rope_parameters"),
        None,
        None,
        ["rope_parameters.rope_theta = -10000.0"],
    ),
    "theta-inf-top-level": (
        DENSE,
        _cfg("rope_theta", float("inf")),
        None,
        None,
        ["rope_theta = inf"],
    ),
    "config-not-object": (DENSE, lambda c: [c], None, None, ["config.json", "not a JSON object"]),
    "config-duplicate-key": (
        DENSE,
        lambda c: json.dumps(c)[:-1] + ', "hidden_size": 64}',
        None,
        None,
        ["config.json", "duplicate key 'hidden_size'"],
    ),
    "moe-top-k-0": (MOE, _cfg("num_experts_per_tok", 0), None, None, ["num_experts_per_tok = 0"]),
    "moe-top-k-above-experts": (
        MOE,
        _cfg("num_experts_per_tok", 9),
        None,
        None,
        ["num_experts_per_tok = 9"],
    ),
    "moe-top-k-all-experts": (
        MOE,
        _cfg("num_experts_per_tok", 8),
        None,
        None,
        ["num_experts_per_tok = 8"],
    ),
    "moe-sparse-step-0": (
        MOE,
        _cfg("decoder_sparse_step", 0),
        None,
        None,
        ["decoder_sparse_step = 0"],
    ),
    "moe-experts-2pow40": (
        MOE,
        _cfg("num_experts", 2**40),
        None,
        None,
        ["num_experts = 1099511627776", "holds 8 experts"],
    ),
    "st-duplicate-name": (
        DENSE,
        None,
        _duplicate_name,
        None,
        ["model.safetensors", "duplicate tensor name 'model.embed_tokens.weight'"],
    ),
    "st-nested-header": (
        DENSE,
        None,
        lambda raw: _with_header("[" * 100_000 + "]" * 100_000, b""),
        None,
        ["model.safetensors", "nested"],
    ),
    "st-truncated": (
        DENSE,
        None,
        lambda raw: raw[: len(raw) // 2],
        None,
        ["model.safetensors", "data_offsets"],
    ),
    "st-header-length": (
        DENSE,
        None,
        lambda raw: struct.pack("<Q", 2**60) + raw[8:],
        None,
        ["model.safetensors", "header length 1152921504606846976"],
    ),
    "st-trailing-bytes": (
        DENSE,
        None,
        lambda raw: raw + b"\0" * 8,
        None,
        ["model.safetensors", "8 trailing bytes"],
    ),
    "st-integer-weights": (
        DENSE,
        None,
        lambda raw: raw.replace(b'"F32"', b'"I32"', 1),
        None,
        ["model.safetensors", "dtype I32"],
    ),
    "pytorch-model-bin": (DENSE, None, None, _torch_bin, ["pytorch_model.bin", "safetensors only"]),
    "stray-safetensors": (
        DENSE,
        None,
        None,
        lambda d: shutil.copy(d / "model.safetensors", d / "decoy.safetensors"),
        ["decoy.safetensors"],
    ),
    # These reach transformers (its config class, its model class on the meta device, its loader).
    "torch:architectures-other": (
        DENSE,
        _cfg("architectures", ["LlamaForCausalLM"]),
        None,
        None,
        ["architectures", "Qwen3ForCausalLM"],
    ),
    "torch:rope-type-unknown": (
        DENSE,
        _cfg("rope_parameters", {"rope_type": "weird", "rope_theta": 10000.0}),
        None,
        None,
        ["config.json", "weird"],
    ),
    "torch:hidden-2pow40": (
        DENSE,
        _cfg("hidden_size", 2**40),
        None,
        None,
        ["model.embed_tokens.weight", "[499, 52]", "1099511627776"],
    ),
    "torch:moe-intermediate-2pow40": (
        MOE,
        _cfg("moe_intermediate_size", 2**40),
        None,
        None,
        ["mlp.experts", "size mismatch"],
    ),
}


def _mutated(tmp: Path, src: Path, cfg_edit, st_edit, dir_edit) -> Path:
    d = tmp / "model"
    d.mkdir()
    c = json.loads((src / "config.json").read_text())
    if cfg_edit:
        c = cfg_edit(c) or c
    (d / "config.json").write_text(c if isinstance(c, str) else json.dumps(c))
    raw = (src / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(st_edit(raw) if st_edit else raw)
    if dir_edit:
        dir_edit(d)
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_cli_refuses_bad_model_with_one_line(tmp_path, case):
    src, cfg_edit, st_edit, dir_edit, words = CASES[case]
    d = _mutated(tmp_path, src, cfg_edit, st_edit, dir_edit)
    out = tmp_path / "x.trace"
    r = run_oracle("trace", "--model", d, "--tokens", "1,2,3", "--out", out, cwd=ROOT, timeout=120)
    lines = r.stderr.splitlines()
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert lines[0].startswith("python -m tracegate_oracle trace: error: "), lines
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not out.exists() and not list(tmp_path.glob("x.trace*"))
