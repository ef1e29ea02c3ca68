"""`--force-decisions` (docs/producers.md, "Forced decisions"): engine and contract forced from
the same trace — one with router rows and greedy tokens deliberately altered — stay bit-identical
to each other on the cached and uncached paths and carry the forced choices; without forcing
the same comparison shows the flip (negative control). A trace that cannot serve the run is
refused, exit 2, in one line naming the file and the decision.

Needs the engine and trace-diff release binaries (scripts/setup.sh builds them).
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

from conftest import FIXTURES, release_binary

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

from tracegate_contract.__main__ import main as contract_main  # noqa: E402

ENGINE, _NO_ENGINE = release_binary("engine")
TRACE_DIFF, _NO_TRACE_DIFF = release_binary("trace-diff")
pytestmark = pytest.mark.skipif(
    bool(_NO_ENGINE or _NO_TRACE_DIFF),
    reason=" and ".join(r for r in (_NO_ENGINE, _NO_TRACE_DIFF) if r) or "built",
)

MOE = FIXTURES["moe"]  # 8 experts, top-2, layers 0, 1, 3 sparse, vocab 503
TOKENS = [12, 218, 345, 152, 81]
TOK = ",".join(map(str, TOKENS))


def engine(out, *extra):
    subprocess.run(
        [
            ENGINE,
            "trace",
            "--model",
            MOE,
            "--tokens",
            TOK,
            "--out",
            str(out),
            "--capture",
            "internals",
            "--generate",
            "3",
            "--threads",
            "1",
            *extra,
        ],
        check=True,
        capture_output=True,
    )
    return tracegate.Trace(str(out))


def contract(out, *extra):
    rc = contract_main(
        [
            "trace",
            "--model",
            MOE,
            "--tokens",
            TOK,
            "--out",
            str(out),
            "--capture",
            "internals",
            "--generate",
            "3",
            *extra,
        ]
    )
    assert rc == 0
    return tracegate.Trace(str(out))


def diff(a, b, *extra):
    r = subprocess.run(
        [TRACE_DIFF, "--json", *extra, str(a), str(b)], capture_output=True, text=True
    )
    return r.returncode, json.loads(r.stdout)


def altered(src: tracegate.Trace, out, edits: dict) -> str:
    """A copy of `src` whose decision NAME has values edits[NAME](values) (margins kept)."""
    with tracegate.TraceWriter(str(out), src.provenance) as w:
        for n in src.names:
            w.tensor(n, np.array(src[n]), **src.attributes(n))
        for n, v in src.decisions.items():
            v = np.array(v)
            if n in edits:
                v = edits[n](v)
            w.decision(n, v, margins=src.margins[n])
    return str(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("force")
    own = engine(d / "own.trace")
    layer1 = np.array(own.decisions["layer.01.router.topk"])

    def reroute(v):  # row 3 of layer 1 goes to the two lowest experts it did not choose
        v[3] = [e for e in range(8) if e not in v[3]][:2]
        return v

    def next_token(v):
        v[0] = (v[0] + 1) % 503
        return v

    alt = altered(
        own, d / "alt.trace", {"layer.01.router.topk": reroute, "decode.0001.argmax": next_token}
    )
    out = {"own": own, "alt": tracegate.Trace(alt), "layer1": layer1, "dir": d}
    for cache in ("on", "off"):
        out[f"engine-{cache}"] = engine(
            d / f"engine-{cache}.trace", "--cache", cache, "--force-decisions", alt
        )
        out[f"contract-{cache}"] = contract(
            d / f"contract-{cache}.trace", "--cache", cache, "--force-decisions", alt
        )
    out["contract-unforced"] = contract(d / "contract-unforced.trace")
    return out


def test_engine_and_contract_forced_from_an_altered_trace_are_bit_identical(runs):
    alt = runs["alt"]
    digests = {
        k: runs[k].digest for k in ("engine-on", "engine-off", "contract-on", "contract-off")
    }
    assert len(set(digests.values())) == 1, digests
    rc, rep = diff(runs["engine-on"].path, runs["contract-off"].path)
    assert rc == 0 and rep["verdict"] == "identical", rep["findings"]
    t = runs["contract-on"]
    for name, v in alt.decisions.items():
        np.testing.assert_array_equal(t.decisions[name], v, err_msg=name)
    forced = t.provenance["forced_decisions"]
    assert forced["trace_digest"] == alt.digest
    assert (
        forced["overridden"]["layer.01.router.topk"] == 1
        and forced["overridden"]["decode.0001.argmax"] == 1
    ), forced
    assert t.margins["layer.01.router.topk"][3] < 0  # it would have chosen otherwise
    # Which rows, as the engine lists them (docs/producers.md, "Recorded."): the bisection
    # judges each by its own margin.
    rows = forced["overridden_rows"]
    assert rows["layer.01.router.topk"] == [3] and rows["decode.0001.argmax"] == [0], forced
    assert {n: len(r) for n, r in rows.items()} == forced["overridden"], forced
    engine = runs["engine-on"].provenance["forced_decisions"]
    assert engine["overridden_rows"] == rows and engine["overridden"] == forced["overridden"]
    assert all(
        t.attributes(n).get("forced") == alt.digest
        for n in t.names[t.names.index("layer.00.mlp_out") :]
    )


def test_the_layer_verbs_forced_alike_are_bit_identical(runs, tmp_path):
    """Layer 1 alone on the engine's own input, its router row 3 taken from the altered trace."""
    own, alt = runs["own"], runs["alt"]
    args = [
        "--model",
        MOE,
        "--layer",
        "1",
        "--input",
        own.path,
        "--input-name",
        "layer.01.hidden_in",
        "--force-decisions",
        alt.path,
    ]
    e, c = tmp_path / "e.trace", tmp_path / "c.trace"
    subprocess.run(
        [ENGINE, "layer", *args, "--out", str(e), "--threads", "1"], check=True, capture_output=True
    )
    assert contract_main(["layer", *args, "--out", str(c)]) == 0
    e, c = tracegate.Trace(str(e)), tracegate.Trace(str(c))
    assert e.digest == c.digest
    np.testing.assert_array_equal(
        c.decisions["layer.01.router.topk"], alt.decisions["layer.01.router.topk"]
    )
    assert c.provenance["forced_decisions"]["overridden"] == {"layer.01.router.topk": 1}
    for t in (e, c):
        assert t.provenance["forced_decisions"]["overridden_rows"] == {"layer.01.router.topk": [3]}
    # Only layer 1 and a decode step were altered, so the forced whole run reaches layer 1 with
    # this same input: the forced layer verb reproduces its layer 1.
    np.testing.assert_array_equal(c["layer.01.mlp_out"], runs["contract-on"]["layer.01.mlp_out"])


def test_without_forcing_the_flip_shows(runs):
    """Negative control: the unforced contract keeps its own row 3 and token, so against the
    altered trace its decisions differ, and from the forced runs its numbers differ from the
    rerouted row's layer on."""
    own, alt, free = runs["own"], runs["alt"], runs["contract-unforced"]
    assert free.digest == own.digest  # the unforced run is the engine's, bit for bit
    np.testing.assert_array_equal(free.decisions["layer.01.router.topk"], runs["layer1"])
    rc, rep = diff(alt.path, free.path)
    differ = {
        d["name"]: d["differing_rows"] for d in rep["decisions"]["results"] if d["differing_rows"]
    }
    assert rc == 1 and differ["layer.01.router.topk"] == 1 and differ["decode.0001.argmax"] == 1, (
        differ
    )
    forced = runs["contract-on"]
    np.testing.assert_array_equal(free["layer.01.attn_out"], forced["layer.01.attn_out"])
    assert not np.array_equal(free["layer.01.mlp_out"], forced["layer.01.mlp_out"])


def test_forced_by_its_own_trace_trace_diff_notes_it_and_finds_nothing(runs, tmp_path):
    own = runs["own"]
    forced = contract(tmp_path / "self.trace", "--force-decisions", own.path)
    rc, rep = diff(own.path, forced.path)
    assert rc == 0 and rep["verdict"] == "identical", rep["findings"]
    [note] = rep["findings"]
    assert (
        note["kind"] == "decisions_forced"
        and own.digest in note["detail"]
        and "candidate's decisions" in note["detail"]
    ), note
    # Negative control: the same attribute naming another trace is a difference.
    with tracegate.TraceWriter(str(tmp_path / "renamed.trace"), forced.provenance) as w:
        for n in forced.names:
            a = dict(forced.attributes(n))
            if "forced" in a:
                a["forced"] = runs["alt"].digest
            w.tensor(n, np.array(forced[n]), **a)
        for n, v in forced.decisions.items():
            w.decision(n, v, margins=forced.margins[n])
    rc, rep = diff(own.path, str(tmp_path / "renamed.trace"))
    # A DIFFERENT verdict verifies only what it compared; the note saying so is not this test's.
    kinds = {f["kind"] for f in rep["findings"]} - {"verified_in_part"}
    assert rc == 1 and kinds == {"attribute_differs"}, kinds


@pytest.mark.parametrize(
    "edit, says",
    [
        (["--generate", "4"], "decision decode.0003.argmax is missing (this run needs it)"),
        (
            ["--tokens", "12,218,345,152,82"],
            "its prompt_tokens [12, 218, 345, 152, 81] are not this run's [12, 218, 345, 152, 82]",
        ),
        ("expert", "decision layer.03.router.topk row 4: value 8 outside [0, 8)"),
    ],
)
def test_refusals_exit_2_in_one_line(runs, tmp_path, capsys, edit, says):
    own = runs["own"]
    src = own.path
    args = [
        "trace",
        "--model",
        MOE,
        "--tokens",
        TOK,
        "--out",
        str(tmp_path / "x.trace"),
        "--generate",
        "3",
    ]
    if edit == "expert":
        src = altered(
            own,
            tmp_path / "bad.trace",
            {"layer.03.router.topk": lambda v: (v.__setitem__((4, 1), 8), v)[1]},
        )
    else:
        i = args.index(edit[0])
        args[i + 1] = edit[1]
    capsys.readouterr()
    assert contract_main([*args, "--force-decisions", src]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and err.startswith(f"error: --force-decisions {src}: ") and says in err
    ), err
    assert not os.path.exists(tmp_path / "x.trace")
