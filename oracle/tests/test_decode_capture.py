"""Decode steps in the oracle (docs/producers.md, the decode-step extension): the tensors of
`trace --generate N --cache on|off`, and `layer --decode-from P`.

What torch promises, and so what is asserted bit for bit: the same ops on the same shapes and
inputs, in one process with deterministic algorithms and fixed threads, give the same bits. So
`decode.0000.logits` is the prefill's last logits row, and `layer --decode-from n` (the prompt as
one prefill, then every generated row alone on the cache) is the cached run's own computation,
bit for bit. What it does not promise is that a one-row forward on a cache equals the last row of
a full recompute, or that a prefix run as one block fills the cache with the bits it got row by
row: those are judged by the oracle-default policy's bound for the point (relative L2), and the
measured worst values are printed (-s) and listed in oracle/README.md.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from oracle_runner import run_oracle  # noqa: E402
from test_families import CASES, FAMS, TOKENS, make_checkpoint  # noqa: E402
from tracegate_oracle.cli import main  # noqa: E402
from tracegate_oracle.errors import OracleError  # noqa: E402

DENSE = ROOT / "fixtures" / "tiny-qwen3"
MOE = ROOT / "fixtures" / "tiny-qwen3-moe"
PROMPT = [3, 17, 5, 99, 41, 7, 250, 11, 300]  # fixtures' vocabulary is 499
N = 4  # step 0 (the prompt's last row) and three one-row forwards
POINTS = ("hidden_in", "attn_out", "mlp_out", "hidden_out")
RULES = json.loads((ROOT / "fixtures/policy/oracle-default.json").read_text())["rules"]
# Every fixture and every family of the table (test_families.py's tiny checkpoints).
SUBJECTS = ["tiny-qwen3", "tiny-qwen3-moe", *FAMS]


def bound(name: str) -> float:
    """The oracle-default policy's relative-L2 bound for the point a decode tensor holds."""
    point = re.sub(r"^decode\.\d{4}\.", "", name)
    rule = next(r for r in RULES if fnmatch.fnmatchcase(point, r["pattern"]))
    return rule["max_rel_l2"]


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a.astype(np.float64) - b) / np.linalg.norm(b.astype(np.float64)))


def masks(subject: str, layers: int) -> list[str]:
    """The mask of each layer, as test_families.py writes it out (the fixtures are causal)."""
    return CASES[subject][2] if subject in CASES else ["causal"] * layers


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """subject -> (model dir, model, prompt, cached capture, uncached capture), --capture internals."""
    cp.setup_torch(cp.RunConfig())
    base = tmp_path_factory.mktemp("decode")
    out = {}
    for s in SUBJECTS:
        d, prompt = (
            ({"tiny-qwen3": DENSE, "tiny-qwen3-moe": MOE}[s], PROMPT)
            if s.startswith("tiny")
            else (make_checkpoint(s, base / s), TOKENS)
        )
        model = cp.load_model(d, cp.RunConfig())
        on, off = (
            cp.capture_prompt(
                model, d, prompt, cp.RunConfig(capture="internals", generate=N, cache=c)
            )
            for c in ("on", "off")
        )
        out[s] = (d, model, prompt, on, off)
    return out


def expected_decode_names(layers: int) -> list[str]:
    names = ["decode.0000.logits"]
    for s in range(1, N):
        for L in range(layers):
            names += [f"decode.{s:04d}.layer.{L:02d}.{p}" for p in POINTS]
        names += [f"decode.{s:04d}.final_norm.out", f"decode.{s:04d}.logits"]
    return names


# ------------------------------------------------------------------------------ trace --generate


@pytest.mark.parametrize("subject", SUBJECTS)
def test_decode_tensors_names_order_attributes(runs, subject):
    d, model, prompt, on, off = runs[subject]
    n, layers, H, V = (
        len(prompt),
        model.config.num_hidden_layers,
        model.config.hidden_size,
        model.config.vocab_size,
    )
    layer_masks = masks(subject, layers)
    for cap in (on, off):
        first = next(i for i, r in enumerate(cap.tensors) if r.name.startswith("decode."))
        assert all(r.attrs["path"] == "prefill" for r in cap.tensors[:first])
        assert cap.names[first:] == expected_decode_names(layers)
        for r in cap.tensors[first:]:
            s = int(r.name[7:11])
            L = int(r.name[18:20]) if ".layer." in r.name else None
            assert r.array.shape == ((1, V) if r.name.endswith("logits") else (1, H)), r.name
            assert r.attrs == {
                "path": "decode",
                "positions": [n + s - 1],
                "mask": "causal" if L is None else layer_masks[L],
            }, r.name
            assert r.dtype is None and r.array.dtype == np.float32
        # Step 0 decides from the prompt's last logits row: the same forward, the same bits.
        np.testing.assert_array_equal(cap["decode.0000.logits"].array, cap["logits"].array[-1:])
        # Each step's decision is the argmax of its recorded row (lowest index on a tie, as np.argmax).
        for s in range(N):
            assert cap.decision(f"decode.{s:04d}.argmax").values[0] == np.argmax(
                cap[f"decode.{s:04d}.logits"].array[0]
            )


@pytest.mark.parametrize("subject", SUBJECTS)
def test_cached_and_uncached_agree_within_policy(runs, subject):
    """The KV cache path against the full recompute, per family: the same greedy tokens, the same
    names; embedding rows (layer 0's input) bit for bit; everything else within the policy."""
    _, model, prompt, on, off = runs[subject]
    assert on.names == off.names
    for a in on.decisions:
        np.testing.assert_array_equal(a.values, off.decision(a.name).values, err_msg=a.name)
    worst, equal, dec = (0.0, ""), 0, [r for r in on.tensors if r.name.startswith("decode.")]
    for r in dec:
        b = off[r.name].array
        equal += np.array_equal(r.array, b)
        if ".layer.00.hidden_in" in r.name or r.name == "decode.0000.logits":
            np.testing.assert_array_equal(r.array, b, err_msg=r.name)
        e = rel(r.array, b)
        assert e <= bound(r.name), (r.name, e)
        worst = max(worst, (e, r.name))
    print(
        f"{subject}: cached vs uncached, {equal}/{len(dec)} decode tensors bit-equal, worst rel L2 {worst[0]:.2e} ({worst[1]})"
    )


def _planted_position_plus_one(model):
    """A cached decode step whose new row gets position p+1 for RoPE (the defect of issue 14):
    the model's rotary module, shadowed on the instance, adds 1 when it gets one position."""
    rot = cp.resolve(model).rotary
    orig = rot.forward

    def forward(x, position_ids, *a, **kw):
        return orig(x, position_ids + (position_ids.shape[-1] == 1), *a, **kw)

    rot.forward = forward
    return lambda: rot.__dict__.pop("forward")


def test_negative_control_position_off_by_one_in_the_cached_step_is_caught(runs):
    """The two checks that judge decode steps — cached against uncached (above) and against the
    contract (below) — both see a cached step placed at position+1."""
    d, model, prompt, _, off = runs["tiny-qwen3"]
    undo = _planted_position_plus_one(model)
    try:
        bad = cp.capture_prompt(
            model, d, prompt, cp.RunConfig(capture="internals", generate=2, cache="on")
        )
    finally:
        undo()
    name = "decode.0001.layer.00.attn_out"
    np.testing.assert_array_equal(
        bad["decode.0000.logits"].array, off["decode.0000.logits"].array
    )  # prefill untouched
    assert rel(bad[name].array, off[name].array) > bound(name)
    ref = _contract_rows(d, prompt + [int(bad.decision("decode.0000.argmax").values[0])])
    assert rel(bad[name].array, ref["layer.00.attn_out"][-1:]) > bound(name)


def _contract_rows(d: Path, seq: list[int]) -> dict[str, np.ndarray]:
    """The contract's prefill of the whole sequence (an ordered producer: its rows are its cached
    decode rows bit for bit, docs/producers.md)."""
    from tracegate_contract.capture import Capture
    from tracegate_contract.model import Model

    cap = Capture(False)
    Model(str(d)).forward(seq, range(len(seq)), cap)
    return {name: a for name, a, _ in cap.tensors}


@pytest.mark.parametrize("subject", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_decode_rows_agree_with_the_contract(runs, subject):
    """Oracle decode rows (cached and uncached) against the contract's rows at the same
    positions, within the policy; the greedy tokens equal the contract's own generation."""
    from tracegate_contract.capture import Capture
    from tracegate_contract.model import Model

    d, model, prompt, on, off = runs[subject]
    n = len(prompt)
    gen = [int(on.decision(f"decode.{s:04d}.argmax").values[0]) for s in range(N)]
    assert Model(str(d)).run(prompt, Capture(False), generate=N) == gen
    ref = _contract_rows(d, prompt + gen[:-1])
    worst = (0.0, "")
    for cap in (on, off):
        for r in cap.tensors:
            if r.name.startswith("decode."):
                s = int(r.name[7:11])
                want = ref[r.name[12:]][n + s - 1 : n + s]
                e = rel(r.array, want)
                assert e <= bound(r.name), (cap.provenance["cache"], r.name, e)
                worst = max(worst, (e, r.name))
    print(f"{subject}: oracle decode rows vs contract, worst rel L2 {worst[0]:.2e} ({worst[1]})")


# ------------------------------------------------------------------------------ layer --decode-from


def _hidden_in(cap, L: int, steps: int) -> np.ndarray:
    """Layer L's input rows at positions 0..n+steps-1 of a whole run: the prefill rows, then
    decode steps 1..steps (what gate bisect --generate feeds)."""
    rows = [cap[f"layer.{L:02d}.hidden_in"].array]
    return np.concatenate(
        rows + [cap[f"decode.{s:04d}.layer.{L:02d}.hidden_in"].array for s in range(1, steps + 1)]
    )


@pytest.mark.parametrize("subject", SUBJECTS)
def test_decode_from_reproduces_the_cached_run(runs, subject):
    """Every layer: from P = n (the prompt as one prefill, every generated row on the cache) the
    cached run's rows bit for bit; from P = n+s-1 (what bisect asks for step s) step 1 bit for bit
    and later steps, whose cached prefix rows are now one block, within the policy."""
    d, model, prompt, on, _ = runs[subject]
    n, layers = len(prompt), model.config.num_hidden_layers
    worst = (0.0, "")
    for L in range(layers):
        x = _hidden_in(on, L, N - 1)
        c = cp.capture_layer(
            model,
            d,
            L,
            x,
            list(range(len(x))),
            cp.RunConfig(capture="internals"),
            decode_from=n,
            source={"input_name": "x"},
        )
        assert c.names == [f"layer.{L:02d}.{p}" for p in POINTS]  # no internals under --decode-from
        for r in c.tensors:
            assert r.attrs == {
                "path": "layer",
                "positions": list(range(n, n + N - 1)),
                "decode_from": str(n),
                "mask": masks(subject, layers)[L],
            }, r.name
            want = np.concatenate([on[f"decode.{s:04d}.{r.name}"].array for s in range(1, N)])
            np.testing.assert_array_equal(r.array, want, err_msg=r.name)
        assert (
            c.provenance["verb"] == "layer" and c.provenance["decode_from"] == n and not c.decisions
        )
        for s in range(1, N):
            xs = _hidden_in(on, L, s)
            one = cp.capture_layer(
                model, d, L, xs, list(range(len(xs))), cp.RunConfig(), decode_from=n + s - 1
            )
            for p in POINTS:
                got, want = (
                    one[f"layer.{L:02d}.{p}"].array,
                    on[f"decode.{s:04d}.layer.{L:02d}.{p}"].array,
                )
                assert got.shape == want.shape == (1, model.config.hidden_size)
                if s == 1:
                    np.testing.assert_array_equal(got, want, err_msg=f"{L} {p}")
                e = rel(got, want)
                assert e <= bound(f"layer.{L:02d}.{p}"), (s, L, p, e)
                worst = max(worst, (e, f"step {s} layer {L} {p}"))
    print(
        f"{subject}: decode-from n+s-1 vs the cached run, worst rel L2 {worst[0]:.2e} ({worst[1]})"
    )


@pytest.mark.parametrize("subject", ["tiny-qwen3", "gemma3_text", "mistral"])
def test_negative_control_shifted_prefix_is_caught(runs, subject):
    """The comparison above fails when --decode-from gets its prefix rows one position off (the
    last rows of a sliding layer's window included)."""
    d, model, prompt, on, _ = runs[subject]
    n, s, L = len(prompt), 2, 1
    x = _hidden_in(on, L, s)
    shifted = x.copy()
    shifted[: n + s - 1] = np.roll(x[: n + s - 1], 1, axis=0)
    name = f"layer.{L:02d}.attn_out"
    want = on[f"decode.{s:04d}.{name}"].array
    good = cp.capture_layer(
        model, d, L, x, list(range(len(x))), cp.RunConfig(), decode_from=n + s - 1
    )
    bad = cp.capture_layer(
        model, d, L, shifted, list(range(len(x))), cp.RunConfig(), decode_from=n + s - 1
    )
    assert rel(good[name].array, want) <= bound(name)
    assert rel(bad[name].array, want) > bound(name)


def _write(path: Path, name: str, x: np.ndarray, positions: list[int]) -> Path:
    tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    with tg.TraceWriter(str(path), {"producer": "test"}) as w:
        w.tensor(name, x, path="prefill", mask="causal", positions=positions)
        w.finish()
    return path


def test_cli_trace_and_layer_decode_from_write_what_they_captured(runs, tmp_path, capsys):
    """Through the CLI and the trace binding: the trace verb's decode tensors keep their order and
    attributes in the file; `layer --decode-from` writes `decode_from` as a string attribute and in
    provenance, and its rows are the cached run's."""
    tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    d, model, prompt, on, _ = runs["tiny-qwen3"]
    n = len(prompt)
    out = tmp_path / "t.trace"
    assert (
        main(
            [
                "trace",
                "--model",
                str(d),
                "--tokens",
                ",".join(map(str, prompt)),
                "--out",
                str(out),
                "--capture",
                "internals",
                "--generate",
                str(N),
            ]
        )
        == 0
    )
    t = tg.Trace(str(out))
    t.verify()
    assert t.names == on.names
    for name in on.names[-6:]:
        assert t.attributes(name) == {k: v for k, v in on[name].attrs.items()}, name
        np.testing.assert_array_equal(np.asarray(t[name]), on[name].array)
    inp = _write(tmp_path / "in.trace", "rows", _hidden_in(on, 2, N - 1), list(range(n + N - 1)))
    lo = tmp_path / "l.trace"
    assert (
        main(
            [
                "layer",
                "--model",
                str(d),
                "--layer",
                "2",
                "--input",
                str(inp),
                "--input-name",
                "rows",
                "--out",
                str(lo),
                "--capture",
                "internals",
                "--decode-from",
                str(n),
            ]
        )
        == 0
    )
    t = tg.Trace(str(lo))
    t.verify()
    assert t.names == [f"layer.02.{p}" for p in POINTS]
    assert t.attributes("layer.02.hidden_out")["decode_from"] == str(n)
    assert t.provenance["decode_from"] == n and t.provenance["verb"] == "layer"
    want = np.concatenate([on[f"decode.{s:04d}.layer.02.hidden_out"].array for s in range(1, N)])
    np.testing.assert_array_equal(np.asarray(t["layer.02.hidden_out"]), want)
    capsys.readouterr()


def test_decode_from_refusals(runs, tmp_path, capsys):
    """Exit 2 and one line: rows not at positions 0..m-1 in order (naming the tensor and the first
    bad position), P outside 0..m-1. The API refuses alike."""
    d, model, prompt, on, _ = runs["tiny-qwen3"]
    x = _hidden_in(on, 0, 2)
    m = len(x)
    ok_pos, gap_pos, late_pos = list(range(m)), [*range(m - 1), m], list(range(3, m + 3))
    ok = _write(tmp_path / "ok.trace", "rows", x, ok_pos)
    cases = [
        (
            gap_pos,
            3,
            f"--input-name rows: --decode-from needs rows at positions 0..{m - 1} in order; "
            f"row {m - 1} is at position {m}",
        ),
        (
            late_pos,
            3,
            "--input-name rows: --decode-from needs rows at positions 0..15 in order; row 0 is at position 3".replace(
                "15", str(m - 1)
            ),
        ),  # a --decode-from output's positions
        (ok_pos, m, f"--decode-from {m}: must be in 0..{m - 1} (--input-name rows has {m} rows)"),
        (ok_pos, -1, f"--decode-from -1: must be in 0..{m - 1}"),
    ]
    base = [
        "layer",
        "--model",
        str(d),
        "--layer",
        "0",
        "--input-name",
        "rows",
        "--out",
        str(tmp_path / "x.trace"),
    ]
    for i, (positions, P, msg) in enumerate(cases):
        path = _write(tmp_path / f"{i}.trace", "rows", x, positions)
        assert main([*base, "--input", str(path), "--decode-from", str(P)]) == 2
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1, err
        with pytest.raises(OracleError, match=re.escape(msg)):
            cp.capture_layer(
                model,
                d,
                0,
                x,
                positions,
                cp.RunConfig(),
                decode_from=P,
                source={"input_name": "rows"},
            )
    assert not (tmp_path / "x.trace").exists()
    # The exit status of the process itself (refused before torch is imported: a fraction of a second).
    r = run_oracle(*base, "--input", ok, "--decode-from", m, cwd=ROOT, timeout=120)
    assert (
        r.returncode == 2
        and r.stderr.count("\n") == 1
        and f"--decode-from {m}: must be in" in r.stderr
    ), r.stderr


def test_decode_from_forced_by_the_runs_own_trace(runs, tmp_path):
    """--force-decisions with --decode-from: the rows the forcing trace routes are forced, the
    generated ones route themselves (as in `trace`); forced by the run's own trace, the rows are
    the unforced ones. A prefix the forcing trace does not route is refused."""
    pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    from tracegate_oracle.force import Forcing

    d, model, prompt, on, _ = runs["tiny-qwen3-moe"]
    n, L = len(prompt), 1
    ref = tmp_path / "own.trace"
    cp.write_trace(on, ref)
    x = _hidden_in(on, L, N - 1)
    c = cp.capture_layer(
        model,
        d,
        L,
        x,
        list(range(len(x))),
        cp.RunConfig(),
        decode_from=n,
        forcing=Forcing(str(ref)),
    )
    assert c.provenance["forced_decisions"]["rows_overridden"] == 0
    np.testing.assert_array_equal(
        c[f"layer.{L:02d}.mlp_out"].array,
        np.concatenate([on[f"decode.{s:04d}.layer.{L:02d}.mlp_out"].array for s in range(1, N)]),
    )
    with pytest.raises(
        OracleError,
        match=f"decision layer.01.router.topk has {n} rows, the input holds position {n}",
    ):
        cp.capture_layer(
            model,
            d,
            L,
            x,
            list(range(len(x))),
            cp.RunConfig(),
            decode_from=n + 1,
            forcing=Forcing(str(ref)),
        )
