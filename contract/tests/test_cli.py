"""The CLI and the trace it writes: names, attributes, decisions, provenance; `--cache on|off`
give one digest; the `layer` verb reproduces the whole run's layer tensors bit for bit; user
errors exit 2 with one line and no traceback."""

import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import FIXTURES

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

from tracegate_contract.__main__ import main  # noqa: E402


def cli(*args):
    return main([str(a) for a in args])


def test_trace_contents_and_provenance(moe_dir, tmp_path):
    out = tmp_path / "t.trace"
    assert (
        cli(
            "trace",
            "--model",
            moe_dir,
            "--tokens",
            "3,17,5,17",
            "--out",
            out,
            "--capture",
            "internals",
            "--generate",
            "3",
        )
        == 0
    )
    t = tracegate.Trace(str(out))
    t.verify()
    prefill = [n for n in t.names if not n.startswith("decode.")]
    assert t.names[: len(prefill)] == prefill, "the prefill's tensors come first"
    assert prefill[0] == "embed.out" and prefill[-1] == "logits"
    for name in prefill:
        a = t.attributes(name)
        assert a["path"] == "prefill" and a["mask"] == "causal" and t.dtype(name) == "f32"
        if ".expert." not in name:
            assert a["positions"] == [0, 1, 2, 3]
    # Decode steps (docs/producers.md): step 0 its logits only, steps 1-2 the layers' points too.
    body = [
        f"layer.{l:02d}.{p}"
        for l in range(3)
        for p in ("hidden_in", "attn_out", "mlp_out", "hidden_out")
    ]
    assert t.names[len(prefill) :] == ["decode.0000.logits"] + [
        f"decode.{s:04d}.{n}" for s in (1, 2) for n in [*body, "final_norm.out", "logits"]
    ]
    for name in t.names[len(prefill) :]:
        a, s = t.attributes(name), int(name[7:11])
        assert (
            a["path"] == "decode"
            and a["mask"] == "causal"
            and a["positions"] == [3 + s]
            and t[name].shape[0] == 1
        )
    assert t["decode.0000.logits"].tobytes() == t["logits"][-1:].tobytes()
    assert list(t.decisions) == [
        "layer.00.router.topk",
        "layer.02.router.topk",
        "logits.argmax",
        "decode.0000.argmax",
        "decode.0001.argmax",
        "decode.0002.argmax",
    ]
    assert t.decisions["layer.00.router.topk"].shape == (4, 2) and t.margins[
        "layer.00.router.topk"
    ].shape == (4,)
    assert t.decisions["decode.0000.argmax"][0] == t.decisions["logits.argmax"][-1]
    p = t.provenance
    assert (
        p["producer"] == "contract"
        and p["threads"] == 1
        and p["device"] == "cpu"
        and p["dtype"] == "f32"
    )
    assert p["weights_digest"] == tracegate.weights_digest(moe_dir)
    assert (
        p["prompt_tokens"] == [3, 17, 5, 17] and p["capture"] == "internals" and p["generate"] == 3
    )
    assert set(p["versions"]) == {"numpy", "python", "tracegate"}


def test_cache_on_and_off_have_one_digest(tmp_path):
    for model in FIXTURES.values():
        digests = set()
        for cache in ("on", "off"):
            out = tmp_path / f"{cache}.trace"
            assert (
                cli(
                    "trace",
                    "--model",
                    model,
                    "--tokens",
                    "5,1,5,9,2,2",
                    "--out",
                    out,
                    "--generate",
                    "7",
                    "--cache",
                    cache,
                )
                == 0
            )
            digests.add(tracegate.Trace(str(out)).digest)
        assert len(digests) == 1


@pytest.mark.parametrize("fixture", list(FIXTURES))
def test_layer_verb_reproduces_whole_run(tmp_path, fixture):
    model = FIXTURES[fixture]
    whole = tmp_path / "whole.trace"
    assert (
        cli(
            "trace",
            "--model",
            model,
            "--tokens",
            "9,8,7,9,1,2,3,4,9",
            "--out",
            whole,
            "--capture",
            "internals",
        )
        == 0
    )
    w = tracegate.Trace(str(whole))
    n_layers = sum(1 for n in w.names if n.endswith(".hidden_in"))
    for i in range(n_layers):
        out = tmp_path / f"l{i}.trace"
        assert (
            cli(
                "layer",
                "--model",
                model,
                "--layer",
                i,
                "--input",
                whole,
                "--input-name",
                f"layer.{i:02d}.hidden_in",
                "--out",
                out,
                "--capture",
                "internals",
            )
            == 0
        )
        t = tracegate.Trace(str(out))
        assert t.names == [n for n in w.names if n.startswith(f"layer.{i:02d}.")]
        for name in t.names:
            assert np.array_equal(t[name].view(np.uint32), w[name].view(np.uint32)), name
            a, b = t.attributes(name), w.attributes(name)
            assert (
                a["path"] == "layer" and b["path"] == "prefill" and a["positions"] == b["positions"]
            )
        for name in t.decisions:
            assert np.array_equal(t.decisions[name], w.decisions[name])
            assert np.array_equal(t.margins[name].view(np.uint32), w.margins[name].view(np.uint32))
        assert t.provenance["layer"] == i


def run_module(*args):
    return subprocess.run(
        [sys.executable, "-m", "tracegate_contract", *map(str, args)],
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize(
    "args,msg",
    [
        (
            ["trace", "--model", "{dense}", "--tokens", "1,37", "--out", "{tmp}/x.trace"],
            "token id 37",
        ),
        (
            ["trace", "--model", "{tmp}/nowhere", "--tokens", "1", "--out", "{tmp}/x.trace"],
            "not a directory",
        ),
        (["trace", "--model", "{dense}", "--tokens", "1,a", "--out", "{tmp}/x.trace"], "--tokens"),
        (
            [
                "trace",
                "--model",
                "{dense}",
                "--tokens",
                "1",
                "--out",
                "{tmp}/x.trace",
                "--cache",
                "maybe",
            ],
            "--cache",
        ),
        (
            [
                "layer",
                "--model",
                "{dense}",
                "--layer",
                "5",
                "--input",
                "{tmp}/x.trace",
                "--input-name",
                "a",
                "--out",
                "{tmp}/y.trace",
            ],
            "--layer",
        ),
        (
            [
                "layer",
                "--model",
                "{dense}",
                "--layer",
                "0",
                "--input",
                "{tmp}/none.trace",
                "--input-name",
                "a",
                "--out",
                "{tmp}/y.trace",
            ],
            "none.trace",
        ),
        (["frobnicate"], "invalid choice"),
        (
            [
                "trace",
                "--model",
                "{dense}",
                "--tokens",
                "1",
                "--out",
                "{tmp}/x.trace",
                "--generate",
                "16777216",
            ],
            "2^24",
        ),
    ],
)
def test_user_errors_exit_2_with_one_line(dense_dir, tmp_path, args, msg):
    args = [a.format(dense=dense_dir, tmp=tmp_path) for a in args]
    r = run_module(*args)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and msg in lines[0] and "Traceback" not in r.stderr
    assert not os.path.exists(tmp_path / "x.trace") and not os.path.exists(tmp_path / "y.trace")


def test_config_refusal_exits_2(tmp_path):
    from conftest import make_model_dir

    d = make_model_dir(tmp_path / "m", use_sliding_window=True)
    r = run_module("trace", "--model", d, "--tokens", "1", "--out", tmp_path / "x.trace")
    assert (
        r.returncode == 2
        and "use_sliding_window" in r.stderr
        and len(r.stderr.strip().splitlines()) == 1
    )


def test_layer_verb_rejects_wrong_input(dense_dir, tmp_path):
    whole = tmp_path / "w.trace"
    assert cli("trace", "--model", dense_dir, "--tokens", "1,2", "--out", whole) == 0
    r = run_module(
        "layer",
        "--model",
        dense_dir,
        "--layer",
        "0",
        "--input",
        whole,
        "--input-name",
        "nope",
        "--out",
        tmp_path / "y.trace",
    )
    assert r.returncode == 2 and "nope" in r.stderr
    r = run_module(
        "layer",
        "--model",
        dense_dir,
        "--layer",
        "0",
        "--input",
        whole,
        "--input-name",
        "logits",
        "--out",
        tmp_path / "y.trace",
    )
    assert r.returncode == 2 and "logits" in r.stderr
