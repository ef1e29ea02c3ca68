"""Shared helpers: a tiny random checkpoint written from scratch (so the loader and model tests
do not depend on the committed fixtures), and the paths of the committed fixtures."""

from __future__ import annotations

import functools
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

FIXTURES = {
    "dense": os.path.join(ROOT, "fixtures", "tiny-qwen3"),
    "moe": os.path.join(ROOT, "fixtures", "tiny-qwen3-moe"),
    "llama": os.path.join(ROOT, "fixtures", "tiny-llama"),
    "qwen2": os.path.join(ROOT, "fixtures", "tiny-qwen2"),
    "gemma3": os.path.join(ROOT, "fixtures", "tiny-gemma3"),
}


@functools.cache
def _target_dir_here() -> tuple[str, str]:
    return cargo_target_dir(os.environ)


def cargo_target_dir(env=None) -> tuple[str, str]:
    """Where cargo puts this workspace's builds, and how that was learnt: cargo's own answer
    (it honours CARGO_TARGET_DIR and .cargo/config), else CARGO_TARGET_DIR, else ./target."""
    if env is None:
        return _target_dir_here()
    try:
        r = subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--no-deps", "--offline"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        if r.returncode == 0:
            return json.loads(r.stdout)["target_directory"], "cargo metadata"
        why = f"cargo metadata failed: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode}"
    except (OSError, subprocess.TimeoutExpired, ValueError, KeyError) as e:
        why = f"cargo metadata unavailable ({e})"
    if env.get("CARGO_TARGET_DIR"):
        return os.path.join(ROOT, env["CARGO_TARGET_DIR"]), f"CARGO_TARGET_DIR ({why})"
    return os.path.join(ROOT, "target"), f"the default ./target ({why})"


def release_binary(name: str, env=None) -> tuple[str, str | None]:
    """(path of the release binary `name`, None) when it is built, else (path, the reason to skip)."""
    target, how = cargo_target_dir(env)
    path = os.path.join(target, "release", name)
    if os.access(path, os.X_OK):
        return path, None
    return (
        path,
        f"{name} binary not built: {path} is absent (target directory from {how}); build it with scripts/setup.sh or cargo build --release --bins",
    )


@functools.cache
def _diff_report_validator():
    import jsonschema

    with open(os.path.join(ROOT, "docs", "diff-report.schema.json")) as f:
        schema = json.load(f)
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def diff_report(text: str) -> dict:
    """A `trace-diff --json` report, parsed and checked against docs/diff-report.schema.json
    with the pinned jsonschema package (raises jsonschema.ValidationError naming the field)."""
    report = json.loads(text)
    _diff_report_validator().validate(report)
    return report


def write_safetensors(
    path: str, tensors: dict[str, tuple[str, np.ndarray]], header_extra: dict | None = None
) -> None:
    """tensors: name -> (safetensors dtype, array of the storage type: f32, f16, or uint16 bf16 bits)."""
    header, blobs, off = {}, [], 0
    for name, (dt, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    if header_extra:
        header.update(header_extra)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round f32 to bf16 (nearest-even) and return the uint16 bit patterns."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def tiny_config(family: str = "dense", **over) -> dict:
    cfg = {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 37,
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 6,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": True,
        "attention_bias": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
    }
    if family == "moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_hidden_layers=3,
            tie_word_embeddings=False,
            attention_bias=False,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=10,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    cfg.update(over)
    return cfg


def tiny_tensors(cfg: dict, seed: int = 0, dtype: str = "F32") -> dict[str, tuple[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    H, V, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape, scale=0.3):
        a = (rng.standard_normal(shape) * scale).astype(np.float32)
        if dtype == "BF16":
            return ("BF16", to_bf16_bits(a))
        return ("F32", a)

    def norm(n):
        a = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        return ("BF16", to_bf16_bits(a)) if dtype == "BF16" else ("F32", a)

    t = {"model.embed_tokens.weight": w(V, H, scale=1.0), "model.norm.weight": norm(H)}
    moe = cfg["model_type"] == "qwen3_moe"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = norm(H)
        t[f"{p}.post_attention_layernorm.weight"] = norm(H)
        for n, o in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            t[f"{p}.self_attn.{n}_proj.weight"] = w(o, H)
            if cfg.get("attention_bias"):
                t[f"{p}.self_attn.{n}_proj.bias"] = w(o, scale=0.1)
        t[f"{p}.self_attn.o_proj.weight"] = w(H, nh * d)
        if cfg.get("attention_bias"):
            t[f"{p}.self_attn.o_proj.bias"] = w(H, scale=0.1)
        t[f"{p}.self_attn.q_norm.weight"] = norm(d)
        t[f"{p}.self_attn.k_norm.weight"] = norm(d)
        sparse = (
            moe
            and i not in cfg.get("mlp_only_layers", [])
            and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
        )
        if sparse:
            E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[f"{p}.mlp.gate.weight"] = w(E, H)
            for e in range(E):
                t[f"{p}.mlp.experts.{e}.gate_proj.weight"] = w(I, H)
                t[f"{p}.mlp.experts.{e}.up_proj.weight"] = w(I, H)
                t[f"{p}.mlp.experts.{e}.down_proj.weight"] = w(H, I)
        else:
            I = cfg["intermediate_size"]
            t[f"{p}.mlp.gate_proj.weight"] = w(I, H)
            t[f"{p}.mlp.up_proj.weight"] = w(I, H)
            t[f"{p}.mlp.down_proj.weight"] = w(H, I)
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = w(V, H)
    return t


def make_model_dir(path, family="dense", dtype="F32", seed=0, tensors_hook=None, **over) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    cfg = tiny_config(family, **over)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    t = tiny_tensors(cfg, seed, dtype)
    if tensors_hook:
        tensors_hook(t)
    write_safetensors(os.path.join(path, "model.safetensors"), t)
    return path


@pytest.fixture
def dense_dir(tmp_path):
    return make_model_dir(tmp_path / "dense", "dense")


@pytest.fixture
def moe_dir(tmp_path):
    return make_model_dir(tmp_path / "moe", "moe", dtype="BF16")


def have_tracegate() -> bool:
    try:
        import tracegate  # noqa: F401

        return True
    except ImportError:
        return False


# A producer's CLI run in a child (argv: the module whose `main` it calls, the model loader to
# wrap as "module:attr", the stream method to plant a hold in as "module:Class.method" or "-",
# then the CLI's arguments). Prints `main`'s status and the child's peak resident memory (KiB)
# since its model was loaded: VmHWM is reset to the RSS of that moment (/proc/self/clear_refs,
# Linux ≥ 4.0), so the imports and the load (torch's alone ~0.5 GB), the same at every prompt
# length, do not hide the run's own peak. The planted hold keeps every tensor the stream is
# given and writes them all at its finish: a producer that collects its capture first.
_PEAK_RUNNER = """
import importlib, sys
main_mod, loader, hold, argv = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
mod, attr = loader.split(":")
m = importlib.import_module(mod)
load = getattr(m, attr)
def loaded(*a, **k):
    model = load(*a, **k)
    reset_peak()
    return model
setattr(m, attr, loaded)
if hold != "-":
    mod, rest = hold.split(":")
    cls_name, meth = rest.split(".")
    cls = getattr(importlib.import_module(mod), cls_name)
    write, finish, kept = getattr(cls, meth), cls.finish, []
    setattr(cls, meth, lambda self, *a, **k: kept.append((self, a, k)))
    def finish_held(self, *a, **k):
        for s, a2, k2 in kept:
            write(s, *a2, **k2)
        return finish(self, *a, **k)
    cls.finish = finish_held
status = importlib.import_module(main_mod).main(argv)
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:"))
print(status, peak)
"""


def deep_model_dir(path, layers: int = 32) -> str:
    """A tiny dense model of many layers (4 heads): its `--capture internals` trace is mostly
    attention probabilities, 64·layers·T² bytes, so a prompt twice as long grows it by far
    more than the memory a layer computes with (a few [heads, T, T] arrays) grows."""
    return make_model_dir(path, "dense", num_hidden_layers=layers, max_position_embeddings=4096)


def peak_rss_of_trace(producer: str, model, out, tokens: int, hold: str = "-") -> tuple[int, int]:
    """(the peak resident memory in bytes of `producer`'s `trace --capture internals` of a
    `tokens`-long prompt, from its model's load on; the trace's size in bytes). `producer`:
    "contract" or "oracle"; `hold`: a stream method to plant a hold in (see _PEAK_RUNNER)."""
    main, loader = {
        "contract": ("tracegate_contract.__main__", "tracegate_contract.run:open_model"),
        "oracle": ("tracegate_oracle.cli", "tracegate_oracle.capture:load_model"),
    }[producer]
    ids = ",".join(str(i * 7 % 37) for i in range(tokens))
    args = ["trace", "--capture", "internals", "--model", str(model), "--tokens", ids]
    r = subprocess.run(
        [sys.executable, "-c", _PEAK_RUNNER, main, loader, hold, *args, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    status, peak = map(int, r.stdout.split()[-2:])
    assert status == 0, r.stderr
    return peak * 1024, os.path.getsize(out)


def peak_grows_with_trace(d_peak: int, d_trace: int) -> bool:
    """The rule of the streaming tests: the peak grew by 3/4 or more of what the trace grew by."""
    return d_peak * 4 >= d_trace * 3


def holding_peak(nbytes: int) -> int:
    """The peak resident memory in bytes of a Python child that holds `nbytes` bytes (written,
    so resident): the negative control's process."""
    script = "import sys; b = bytearray(int(sys.argv[1])); b[::4096] = b'x' * len(b[::4096])\n"
    script += "print(next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
    r = subprocess.run([sys.executable, "-c", script, str(nbytes)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return int(r.stdout) * 1024
