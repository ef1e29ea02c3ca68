"""Engine ≡ contract, bit for bit (docs/numerics.md): both tiny fixtures, prompts of lengths
1, 5, 17, 64 and 65 (with repeated tokens), default and internals capture, and greedy
generation on the cached and uncached paths — every pair of traces must be IDENTICAL (same
digest, and every tensor, attribute, decision and margin equal).

The negative controls plant a defect in a *copy* of the contract (softmax summed in reverse;
the MoE output added to the residual twice) and show that the same comparison reports it, at
the tensor where the defect first shows.

The identity tests need the engine and trace-diff release binaries where cargo puts them
(`cargo metadata`'s target directory, so CARGO_TARGET_DIR is honoured; scripts/setup.sh builds
them); without them they skip saying which path was looked at and why. The negative controls
also run against the unplanted contract, which needs no engine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES, ROOT, diff_report, release_binary

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

ENGINE, _NO_ENGINE = release_binary("engine")
TRACE_DIFF, _NO_TRACE_DIFF = release_binary("trace-diff")
CONTRACT_SRC = os.path.join(ROOT, "contract", "tracegate_contract")

needs_engine = pytest.mark.skipif(
    bool(_NO_ENGINE or _NO_TRACE_DIFF),
    reason=" and ".join(r for r in (_NO_ENGINE, _NO_TRACE_DIFF) if r) or "built",
)


def prompts(vocab: int) -> dict[int, list[int]]:
    rng = np.random.default_rng(20240601)
    out = {1: [7], 5: [3, 17, 5, 17, 3]}
    for n in (17, 64, 65):
        t = rng.integers(0, vocab, n).tolist()
        t[n // 2 : n // 2 + 4] = [t[1]] * 4  # a run of one token, equal to an earlier one
        t[-1] = t[0]
        out[n] = t
    return out


def engine_trace(model, tokens, out, capture="default", generate=0, cache="on"):
    cmd = [
        ENGINE,
        "trace",
        "--model",
        model,
        "--tokens",
        ",".join(map(str, tokens)),
        "--out",
        out,
        "--capture",
        capture,
    ]
    if generate:
        cmd += ["--generate", str(generate), "--cache", cache]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"engine failed ({r.returncode}): {r.stderr.strip()}"
    return out


def contract_trace(model, tokens, out, capture="default", generate=0, cache="on", src_root=None):
    """Run the contract's CLI (in a subprocess, so a planted copy can be run the same way)."""
    env = dict(os.environ)
    if src_root is not None:  # the planted copy comes before the installed package
        env["PYTHONPATH"] = os.pathsep.join([src_root, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "tracegate_contract",
        "trace",
        "--model",
        model,
        "--tokens",
        ",".join(map(str, tokens)),
        "--out",
        out,
        "--capture",
        capture,
    ]
    if generate:
        cmd += ["--generate", str(generate), "--cache", cache]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, f"contract failed ({r.returncode}): {r.stderr.strip()}"
    return out


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Distance in f32 steps (crossing zero counts the steps on both sides)."""

    def ordered(x):
        i = x.view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)

    return np.abs(ordered(a) - ordered(b))


def trace_diff(path_a: str, path_b: str) -> dict:
    """The project's own `trace-diff --json` report (the issue's criterion: IDENTICAL under it)."""
    r = subprocess.run(
        [TRACE_DIFF, "--json", path_a, path_b], capture_output=True, text=True, timeout=120
    )
    assert r.returncode in (0, 1), (
        f"trace-diff refused ({r.returncode}): {r.stdout[:500]} {r.stderr.strip()}"
    )
    return diff_report(r.stdout)


def trace_diff_verdict(path_a: str, path_b: str) -> str:
    return trace_diff(path_a, path_b)["verdict"]


@needs_engine
def test_diff_report_checker_rejects_a_report_that_breaks_the_schema(tmp_path):
    """Negative control of `diff_report`: a real report passes, and a wrong type or a missing
    required field in it is refused."""
    import jsonschema

    paths = []
    for name, v in (("a", 1.0), ("b", 2.0)):
        paths.append(str(tmp_path / f"{name}.trace"))
        with tracegate.TraceWriter(paths[-1], {"producer": "test"}) as w:
            w.tensor("x", np.array([v, 0.5], dtype=np.float32))
    r = subprocess.run([TRACE_DIFF, "--json", *paths], capture_output=True, text=True, timeout=60)
    good = diff_report(r.stdout)
    assert good["first_bit_difference"]["tensor"] == "x" and good["first_violation"] is None
    for plant in (
        lambda v: v.__setitem__("verdict", 1),
        lambda v: v.pop("first_violation"),
        lambda v: v["per_tensor"][0].__setitem__("violations", ["relative L2 1 > 0.0001"]),
    ):
        bad = json.loads(r.stdout)
        plant(bad)
        with pytest.raises(jsonschema.ValidationError):
            diff_report(json.dumps(bad))


def differences(path_a: str, path_b: str, label_a="engine", label_b="contract") -> list[str]:
    """Every way two traces differ, first divergence first. Empty list means identical."""
    a, b = tracegate.Trace(path_a), tracegate.Trace(path_b)
    a.verify()
    b.verify()
    out = []
    if a.names != b.names:
        for i, (x, y) in enumerate(zip(a.names + [None], b.names + [None], strict=False)):
            if x != y:
                out.append(f"tensor list differs at #{i}: {label_a} {x!r} vs {label_b} {y!r}")
                break
    for name in [n for n in a.names if n in b]:
        if a.attributes(name) != b.attributes(name):
            out.append(f"{name}: attributes {a.attributes(name)} vs {b.attributes(name)}")
        x, y = a[name], b[name]
        if a.dtype(name) != b.dtype(name) or x.shape != y.shape:
            out.append(f"{name}: {a.dtype(name)}{list(x.shape)} vs {b.dtype(name)}{list(y.shape)}")
            continue
        if x.dtype == np.float32:
            diff = x.view(np.uint32) != y.view(np.uint32)
        else:
            diff = x != y
        if diff.any():
            first = tuple(int(i) for i in np.argwhere(diff)[0])
            u = _ulps(x[diff], y[diff]) if x.dtype == np.float32 else np.array([0])
            out.append(
                f"{name}: {int(diff.sum())} of {x.size} elements differ; first at {first}: "
                f"{label_a} {x[first]!r} (0x{int(x.view(np.uint32)[first]):08x}) vs "
                f"{label_b} {y[first]!r} (0x{int(y.view(np.uint32)[first]):08x}); max {int(u.max())} ulp"
            )
    da, db = a.decisions, b.decisions
    if list(da) != list(db):
        out.append(f"decision list: {list(da)} vs {list(db)}")
    for name in [n for n in da if n in db]:
        if da[name].shape != db[name].shape or not np.array_equal(da[name], db[name]):
            rows = np.argwhere((da[name] != db[name]).reshape(da[name].shape[0], -1).any(axis=1))
            r = int(rows[0][0]) if len(rows) else 0
            out.append(
                f"decision {name}: row {r}: {label_a} {da[name][r].tolist()} vs {label_b} {db[name][r].tolist()}"
            )
        ma, mb = a.margins[name], b.margins[name]
        if (ma is None) != (mb is None) or (
            ma is not None and not np.array_equal(ma.view(np.uint32), mb.view(np.uint32))
        ):
            out.append(f"decision {name}: margins differ")
    if not out and a.digest != b.digest:
        out.append(
            f"digests differ ({a.digest} vs {b.digest}) though every tensor and decision is equal"
        )
    return out


FIX = [pytest.param(k, v, id=k) for k, v in FIXTURES.items()]
# The Qwen3.5 fixtures (hybrid Gated DeltaNet; numerics.md §§15–20), for the frozen-prompt check.
FIX_QWEN3_5 = [
    pytest.param(k, os.path.join(ROOT, "fixtures", k), id=k)
    for k in ("tiny-qwen3_5", "tiny-qwen3_5-moe")
]


def _vocab(model):
    import json

    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]


@needs_engine
@pytest.mark.parametrize("capture", ["default", "internals"])
@pytest.mark.parametrize("fixture,model", FIX)
def test_prefill_identical(tmp_path, fixture, model, capture):
    failures = []
    for n, toks in prompts(_vocab(model)).items():
        e = engine_trace(model, toks, str(tmp_path / f"e{n}.trace"), capture)
        c = contract_trace(model, toks, str(tmp_path / f"c{n}.trace"), capture)
        d = differences(e, c)
        if d:
            failures.append(
                f"[{fixture} T={n} {capture}] first: {d[0]}"
                + (f" (+{len(d) - 1} more)" if len(d) > 1 else "")
            )
        else:
            assert tracegate.Trace(e).digest == tracegate.Trace(c).digest
    assert not failures, "engine ≠ contract:\n" + "\n".join(failures)


def frozen_prompts() -> dict[str, list[int]]:
    with open(os.path.join(ROOT, "fixtures", "prompts", "frozen.json")) as f:
        return {p["id"]: p["tokens"] for p in json.load(f)["prompts"]}


@needs_engine
@pytest.mark.parametrize("fixture,model", FIX + FIX_QWEN3_5)
def test_frozen_prompts_identical_with_internals_and_generation(tmp_path, fixture, model):
    """Every frozen prompt (the gate's set), internal capture points, 4 greedy tokens; the
    engine's cached path against the contract's uncached one."""
    failures = []
    for pid, toks in frozen_prompts().items():
        e = engine_trace(
            model, toks, str(tmp_path / f"e-{pid}.trace"), "internals", generate=4, cache="on"
        )
        c = contract_trace(
            model, toks, str(tmp_path / f"c-{pid}.trace"), "internals", generate=4, cache="off"
        )
        d = differences(e, c)
        if d:
            failures.append(f"[{fixture} {pid}] first: {d[0]}")
        else:
            assert tracegate.Trace(e).digest == tracegate.Trace(c).digest
            assert trace_diff_verdict(e, c) == "identical"
            # The decode steps' tensors are in what was compared (docs/producers.md).
            names = tracegate.Trace(e).names
            assert {
                "decode.0000.logits",
                "decode.0003.layer.00.attn_out",
                "decode.0003.final_norm.out",
            } <= set(names)
    assert not failures, "engine ≠ contract:\n" + "\n".join(failures)


@needs_engine
@pytest.mark.parametrize("fixture,model", FIX)
def test_generation_identical_on_both_paths(tmp_path, fixture, model):
    toks = prompts(_vocab(model))[17]
    paths = {}
    for who, fn in (("engine", engine_trace), ("contract", contract_trace)):
        for cache in ("on", "off"):
            paths[who, cache] = fn(
                model, toks, str(tmp_path / f"{who}-{cache}.trace"), "internals", 12, cache
            )
    digests = {k: tracegate.Trace(p).digest for k, p in paths.items()}
    problems = []
    for cache in ("on", "off"):
        d = differences(paths["engine", cache], paths["contract", cache])
        problems += [f"[{fixture} --cache {cache}] {x}" for x in d[:3]]
    for who in ("engine", "contract"):
        d = differences(paths[who, "on"], paths[who, "off"], f"{who} cache on", f"{who} cache off")
        problems += [f"[{fixture} {who} on vs off] {x}" for x in d[:3]]
    assert not problems, "\n".join(problems)
    assert len(set(digests.values())) == 1, digests
    assert trace_diff_verdict(paths["engine", "on"], paths["contract", "off"]) == "identical"
    t = tracegate.Trace(paths["contract", "on"])
    assert [n for n in t.decisions if n.startswith("decode.")] == [
        f"decode.{s:04d}.argmax" for s in range(12)
    ]
    # Decode tensors are compared above, cached against uncached: every step has its logits and
    # from step 1 its layer points, path=decode, one row at the step's position.
    assert [n for n in t.names if n.endswith(".logits") and n.startswith("decode.")] == [
        f"decode.{s:04d}.logits" for s in range(12)
    ]
    a = t.attributes("decode.0011.layer.00.hidden_out")
    assert (a["path"], list(a["positions"]), t["decode.0011.layer.00.hidden_out"].shape[0]) == (
        "decode",
        [len(toks) + 10],
        1,
    )


# ---- negative controls ----------------------------------------------------------------------


def planted_copy(tmp_path, file: str, old: str, new: str) -> str:
    """A copy of the contract package with one op changed; returns the sys.path root to use."""
    root = tmp_path / "planted"
    shutil.copytree(
        CONTRACT_SRC, root / "tracegate_contract", ignore=shutil.ignore_patterns("__pycache__")
    )
    p = root / "tracegate_contract" / file
    src = p.read_text()
    assert src.count(old) == 1, f"planting site not found exactly once in {file}: {old!r}"
    p.write_text(src.replace(old, new))
    return str(root)


@pytest.mark.parametrize("reference", [pytest.param("engine", marks=needs_engine), "contract"])
@pytest.mark.parametrize(
    "fixture,file,old,new,capture,expected",
    [
        # softmax denominator summed right to left: attention probabilities change first.
        (
            "dense",
            "ops.py",
            "z = ordered_sum(e, axis=-1)",
            "z = ordered_sum(e[..., ::-1], axis=-1)",
            "internals",
            "layer.00.attn_probs",
        ),
        # the same defect seen with the default capture points: attention output is where it shows.
        (
            "dense",
            "ops.py",
            "z = ordered_sum(e, axis=-1)",
            "z = ordered_sum(e[..., ::-1], axis=-1)",
            "default",
            "layer.00.attn_out",
        ),
        # MoE block output added to the residual twice: mlp_out is still right, hidden_out is not.
        (
            "moe",
            "layer.py",
            "out = h1 + m\n",
            "out = (h1 + m) + m if L.moe else h1 + m\n",
            "default",
            "layer.00.hidden_out",
        ),
    ],
    ids=["softmax-reversed-internals", "softmax-reversed-default", "moe-residual-twice"],
)
def test_negative_control_is_caught_at_the_expected_tensor(
    tmp_path, reference, fixture, file, old, new, capture, expected
):
    """Against the engine when it is built; against the unplanted contract always (so the
    comparison's ability to localise a defect is checked even where no engine exists)."""
    model = FIXTURES[fixture]
    toks = prompts(_vocab(model))[65]
    c = contract_trace(model, toks, str(tmp_path / "c.trace"), capture)
    if reference == "engine":
        e = engine_trace(model, toks, str(tmp_path / "e.trace"), capture)
        assert differences(e, c) == [], (
            "the unplanted contract must match before the control means anything"
        )
    else:
        e = c
    bad = contract_trace(
        model,
        toks,
        str(tmp_path / "bad.trace"),
        capture,
        src_root=planted_copy(tmp_path, file, old, new),
    )
    d = differences(e, bad, reference, "planted contract")
    assert d, "planted defect was not detected"
    assert d[0].startswith(expected + ":"), f"expected first divergence at {expected}, got: {d[0]}"
    assert tracegate.Trace(e).digest != tracegate.Trace(bad).digest
    if reference == "engine":
        rep = trace_diff(e, bad)
        assert (
            rep["verdict"] == "different" and rep["first_bit_difference"]["tensor"] == expected
        ), rep["first_bit_difference"]


def engine_layer(model, layer, inp, name, out, capture, decode_from=None):
    extra = [] if decode_from is None else ["--decode-from", str(decode_from)]
    r = subprocess.run(
        [
            ENGINE,
            "layer",
            "--model",
            model,
            "--layer",
            str(layer),
            "--input",
            inp,
            "--input-name",
            name,
            "--out",
            out,
            "--capture",
            capture,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, f"engine layer failed ({r.returncode}): {r.stderr.strip()}"
    return out


def contract_layer(model, layer, inp, name, out, capture, decode_from=None):
    extra = [] if decode_from is None else ["--decode-from", str(decode_from)]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "tracegate_contract",
            "layer",
            "--model",
            model,
            "--layer",
            str(layer),
            "--input",
            inp,
            "--input-name",
            name,
            "--out",
            out,
            "--capture",
            capture,
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, f"contract layer failed ({r.returncode}): {r.stderr.strip()}"
    return out


@needs_engine
@pytest.mark.parametrize("fixture,model", FIX)
def test_layer_verb_identical(tmp_path, fixture, model):
    """`layer` on every layer: on a prefill trace's hidden_in, and on rows at scattered,
    non-contiguous positions (causal by positions, not by row index)."""
    import json

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    whole = engine_trace(
        model, prompts(cfg["vocab_size"])[17], str(tmp_path / "whole.trace"), "internals"
    )
    scattered = str(tmp_path / "scattered.trace")
    x = np.random.default_rng(9).standard_normal((5, cfg["hidden_size"])).astype(np.float32)
    with tracegate.TraceWriter(scattered, {"producer": "test"}) as w:
        w.tensor("h", x, path="prefill", mask="causal", positions=[40, 3, 9, 9, 100])
    problems = []
    for i in range(cfg["num_hidden_layers"]):
        for inp, name in ((whole, f"layer.{i:02d}.hidden_in"), (scattered, "h")):
            e = engine_layer(model, i, inp, name, str(tmp_path / "e.trace"), "internals")
            c = contract_layer(model, i, inp, name, str(tmp_path / "c.trace"), "internals")
            d = differences(e, c)
            if d:
                problems.append(f"[{fixture} layer {i} on {name}] {d[0]}")
    assert not problems, "\n".join(problems)


@needs_engine
@pytest.mark.parametrize(
    "fixture,model", [p for p in FIX if p.id == "moe"]
)  # the MoE layer is the dense one plus routing
def test_layer_decode_from_identical(tmp_path, capsys, fixture, model):
    """`layer --decode-from P` (docs/producers.md): engine ≡ contract bit for bit; the contract's
    rows equal its plain layer verb's same rows and the whole run's cached decode step; a bad P
    and rows not at 0..m−1 are refused (exit 2) by name."""
    import json

    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    toks = prompts(cfg["vocab_size"])[17]
    n, L = len(toks), cfg["num_hidden_layers"] - 1
    whole = contract_trace(
        model, toks, str(tmp_path / "whole.trace"), "internals", generate=3, cache="on"
    )
    t = tracegate.Trace(whole)
    x = np.concatenate(
        [t[f"layer.{L:02d}.hidden_in"]]
        + [t[f"decode.{s:04d}.layer.{L:02d}.hidden_in"] for s in (1, 2)]
    )
    inp = str(tmp_path / "in.trace")
    with tracegate.TraceWriter(inp, {"producer": "test"}) as w:
        w.tensor("h", x, path="prefill", mask="causal", positions=list(range(n + 2)))
        w.tensor(
            "shuffled",
            x[::-1].copy(),
            path="prefill",
            mask="causal",
            positions=list(range(n + 2))[::-1],
        )
    P = n + 1
    e = engine_layer(model, L, inp, "h", str(tmp_path / "e.trace"), "internals", P)
    c = contract_layer(model, L, inp, "h", str(tmp_path / "c.trace"), "internals", P)
    assert differences(e, c) == []
    plain = tracegate.Trace(
        contract_layer(model, L, inp, "h", str(tmp_path / "p.trace"), "internals")
    )
    ct = tracegate.Trace(c)
    assert ct.names == [
        f"layer.{L:02d}.{s}" for s in ("hidden_in", "attn_out", "mlp_out", "hidden_out")
    ]
    for name in ct.names:
        assert ct.attributes(name)["decode_from"] == str(P) and list(
            ct.attributes(name)["positions"]
        ) == [P]
        assert ct[name].view(np.uint32).tolist() == plain[name][P:].view(np.uint32).tolist(), name
        step = t[f"decode.0002.{name}"]
        assert ct[name].view(np.uint32).tolist() == step.view(np.uint32).tolist(), name
    # Refusals (the engine's are tested in engine/tests/engine.rs), in-process: exit 2, one line.
    from tracegate_contract.__main__ import main

    for name, p, said in (
        ("h", n + 2, f"--decode-from {n + 2} outside 0..{n + 1}"),
        ("shuffled", 0, f"row 0 is at position {n + 1}"),
    ):
        args = [
            "layer",
            "--model",
            model,
            "--layer",
            "0",
            "--input",
            inp,
            "--input-name",
            name,
            "--out",
            str(tmp_path / "x.trace"),
        ]
        assert main(args + ["--decode-from", str(p)]) == 2
        err = capsys.readouterr().err
        assert said in err and f"tensor {name}" in err, err


VARIANTS = {
    "dense-f16-legacy-rope": dict(
        family="dense", dtype="F16", rope_theta=500000.0, drop=("rope_parameters",)
    ),
    "dense-bf16-untied-nobias-default-head-dim": dict(
        family="dense",
        dtype="BF16",
        tie_word_embeddings=False,
        attention_bias=False,
        drop=("head_dim",),
    ),
    "moe-f32-sparse-step-2-no-renorm": dict(
        family="moe",
        dtype="F32",
        decoder_sparse_step=2,
        mlp_only_layers=[],
        norm_topk_prob=False,
        num_hidden_layers=4,
    ),
    "moe-bf16-sharded-eps-1e-5-default-head-dim": dict(
        family="moe", dtype="BF16", rms_norm_eps=1e-5, shard=True, drop=("head_dim",)
    ),
    "moe-f32-no-rope-theta": dict(family="moe", dtype="F32", drop=("rope_parameters",)),
}


def _variant_dir(tmp_path, spec):
    import json

    from conftest import tiny_config, tiny_tensors, write_safetensors

    spec = dict(spec)
    family, dtype, drop, shard = (
        spec.pop("family"),
        spec.pop("dtype"),
        spec.pop("drop", ()),
        spec.pop("shard", False),
    )
    cfg = tiny_config(family, **spec)
    if "head_dim" in drop:  # §13's default: 128 for qwen3, hidden / heads for qwen3_moe
        cfg["head_dim"] = (
            128 if family == "dense" else cfg["hidden_size"] // cfg["num_attention_heads"]
        )
    tensors = tiny_tensors(cfg, seed=11, dtype=dtype)
    if dtype == "F16":
        tensors = {k: ("F16", v.astype(np.float16)) for k, (_, v) in tensors.items()}
    for k in drop:
        cfg.pop(k)
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    if shard:
        names = sorted(tensors)
        wm = {}
        for s in range(2):
            fname = f"model-{s + 1:05d}-of-00002.safetensors"
            write_safetensors(str(d / fname), {k: tensors[k] for k in names[s::2]})
            wm.update({k: fname for k in names[s::2]})
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    else:
        write_safetensors(str(d / "model.safetensors"), tensors)
    return str(d), cfg["vocab_size"]


@needs_engine
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_and_storage_variants_identical(tmp_path, variant):
    """Config fields and storage formats the fixtures do not exercise: f16/bf16 weights, legacy
    rope keys, default head_dim, untied head without biases, sparse step, no renormalisation,
    sharded checkpoints."""
    model, vocab = _variant_dir(tmp_path, VARIANTS[variant])
    toks = [int(t) for t in np.random.default_rng(3).integers(0, vocab, 19)]
    e = engine_trace(model, toks, str(tmp_path / "e.trace"), "internals", 5, "on")
    c = contract_trace(model, toks, str(tmp_path / "c.trace"), "internals", 5, "off")
    d = differences(e, c)
    assert not d, f"[{variant}] " + "\n".join(d[:3])


def _eps_just_above_an_f32_midpoint() -> str:
    """A decimal rms_norm_eps near 1e-6 that lies a quarter of an f64 ulp above the midpoint of
    two f32s whose lower one is even: rounded once (§6) it goes up; rounded through binary64
    first it lands on the midpoint and ties-to-even takes it down."""
    from decimal import Decimal, localcontext
    from fractions import Fraction

    a = np.float32(1e-6)
    while int(a.view(np.uint32)) & 1:
        a = np.nextafter(a, np.float32(1))
    b = np.nextafter(a, np.float32(1))
    mid = (Fraction(float(a)) + Fraction(float(b))) / 2
    ulp64 = Fraction(float(np.nextafter(float(mid), 1.0)) - float(mid))
    v = mid + ulp64 / 4
    with localcontext() as ctx:
        ctx.prec = 200
        return format(Decimal(v.numerator) / Decimal(v.denominator), "f")


@needs_engine
def test_eps_near_an_f32_midpoint_is_read_the_same_way(tmp_path):
    """§6: eps goes decimal -> binary64 -> f32; a decimal that rounds differently when rounded
    once directly must still give engine == contract."""
    from decimal import Decimal

    from tracegate_contract import ops

    eps = _eps_just_above_an_f32_midpoint()
    from fractions import Fraction

    once = np.float32(
        min(
            (np.nextafter(np.float32(float(eps)), np.float32(s)) for s in (-1, 1)),
            key=lambda c: abs(Fraction(float(c)) - Fraction(Decimal(eps))),
        )
    )
    assert once != np.float32(float(eps))  # the case is a real one: direct rounding would differ
    assert ops.f32_of_config_number(Decimal(eps)) == np.float32(float(eps))
    model = tmp_path / "m"
    shutil.copytree(FIXTURES["dense"], model)
    cfg = (model / "config.json").read_text()
    assert '"rms_norm_eps": 1e-06' in cfg
    (model / "config.json").write_text(
        cfg.replace('"rms_norm_eps": 1e-06', f'"rms_norm_eps": {eps}')
    )
    # Rows of ~1e-6: the mean square is far below eps, so eps's last bit reaches the output.
    x = (np.random.default_rng(0).standard_normal((4, 52)) * 1e-6).astype(np.float32)
    inp = str(tmp_path / "in.trace")
    with tracegate.TraceWriter(inp, {"producer": "test"}) as w:
        w.tensor("h", x, path="prefill", mask="causal", positions=[0, 1, 2, 3])
    e = engine_layer(str(model), 0, inp, "h", str(tmp_path / "e.trace"), "default")
    c = contract_layer(str(model), 0, inp, "h", str(tmp_path / "c.trace"), "default")
    d = differences(e, c)
    assert not d, d[0]


# ---- where the binaries are looked for ------------------------------------------------------


def test_binaries_are_looked_for_where_cargo_puts_them(tmp_path):
    """CARGO_TARGET_DIR moves cargo's output: the tests must follow it (they once looked only at
    ./target and skipped silently), and say where they looked when nothing is there."""
    env = dict(os.environ, CARGO_TARGET_DIR=str(tmp_path / "t"))
    path, why = release_binary("engine", env)
    assert path == str(tmp_path / "t" / "release" / "engine")
    assert why and path in why and "not built" in why
    os.makedirs(tmp_path / "t" / "release")
    with open(path, "w") as f:
        f.write("#!/bin/sh\n")
    os.chmod(path, 0o755)
    assert release_binary("engine", env) == (path, None)
