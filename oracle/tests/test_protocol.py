"""The producer protocol's grammar is tracegate.protocol's, for the contract and the oracle alike:
the same command lines parse to the same values and are refused alike; the oracle's own flags
come on top (and the contract refuses them, which shows the two parsers are told apart)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from tracegate import protocol
from tracegate_contract import ContractError
from tracegate_contract.__main__ import parser as contract_parser
from tracegate_oracle.cli import parser as oracle_parser

TRACE = ["trace", "--model", "m", "--tokens", "3,17,5", "--out", "o.trace"]
LAYER = ["layer", "--model", "m", "--layer", "2", "--input", "i.trace", "--input-name", "x"]
LAYER += ["--out", "o.trace"]
PROTOCOL = {  # argv -> the protocol's values it must parse to
    "trace": (TRACE, {"tokens": [3, 17, 5], "generate": 0, "cache": "on", "capture": "default"}),
    "trace-all": (
        TRACE
        + ["--capture", "internals", "--generate", "4", "--cache", "off"]
        + ["--force-decisions", "f.trace"],
        {"generate": 4, "cache": "off", "capture": "internals", "force_decisions": "f.trace"},
    ),
    "layer": (LAYER, {"layer": 2, "input": "i.trace", "input_name": "x", "decode_from": None}),
    "layer-all": (
        LAYER + ["--capture", "internals", "--force-decisions", "f.trace", "--decode-from", "3"],
        {"capture": "internals", "force_decisions": "f.trace", "decode_from": 3},
    ),
}
REFUSED = {
    "no-verb": [],
    "unknown-verb": ["frobnicate"],
    "no-out": TRACE[:-2],
    "tokens-syntax": ["trace", "--model", "m", "--tokens", "1,x", "--out", "o"],
    "tokens-empty-part": ["trace", "--model", "m", "--tokens", "1,,2", "--out", "o"],
    "tokens-empty": ["trace", "--model", "m", "--tokens", "", "--out", "o"],
    "generate-negative": TRACE + ["--generate", "-1"],
    "capture-bogus": TRACE + ["--capture", "all"],
    "cache-bogus": TRACE + ["--cache", "maybe"],
    "decode-from-on-trace": TRACE + ["--decode-from", "1"],
    "generate-on-layer": LAYER + ["--generate", "1"],
    "layer-not-int": LAYER[:4] + ["two"] + LAYER[5:],
}


def _oracle(argv):
    try:
        return oracle_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        return None


def _contract(argv):
    try:
        return contract_parser().parse_args(argv)
    except ContractError:
        return None


@pytest.mark.parametrize("case", PROTOCOL)
def test_both_producers_parse_the_protocol_to_the_same_values(case):
    argv, want = PROTOCOL[case]
    c, o = _contract(argv), _oracle(argv)
    assert c is not None and o is not None
    for key, value in want.items():
        assert getattr(c, key) == getattr(o, key) == value, key
    # Each has its own sharded mode (the contract's --shards, the oracle's --distributed); the
    # oracle adds flags, never drops one of the protocol's.
    own = {"shards"}
    assert getattr(c, "shards", None) is None
    shared = set(vars(c)) - own
    assert shared <= set(vars(o))
    assert {k: getattr(o, k) for k in shared} == {k: v for k, v in vars(c).items() if k not in own}


@pytest.mark.parametrize("case", REFUSED)
def test_both_producers_refuse_the_same_command_lines(case, capsys):
    argv = REFUSED[case]
    assert _contract(argv) is None
    assert _oracle(argv) is None


def test_the_oracles_own_flags_are_its_own(capsys):
    argv = TRACE + ["--device", "cuda", "--dtype", "bf16", "--threads", "2"]
    o = _oracle(argv)
    assert (o.device, o.dtype, o.threads) == ("cuda", "bf16", 2)
    assert _contract(argv) is None


def test_value_types():
    assert protocol.tokens("3,17,5") == [3, 17, 5]
    assert protocol.tokens("-1") == [-1]  # a range check is the producer's, with the vocabulary
    count, positive = protocol.at_least(0), protocol.at_least(1)
    assert count("0") == 0 and count("7") == 7 and positive("1") == 1
    # One grammar with the engine and the gate (tracegate_trace::protocol::token_id): no spaces,
    # `+` or `_`, which int() alone would take.
    for bad in ("", "1,", ",1", "1;2", "x", "3, 17, 5", " 17", "+5", "1_0", "٣"):
        with pytest.raises(argparse.ArgumentTypeError, match="comma-separated integers"):
            protocol.tokens(bad)
    for of, bad, why in (
        (count, "-1", "must be ≥ 0, got -1"),
        (count, "x", "expected an integer ≥ 0, got 'x'"),
        (count, "1.5", "expected an integer ≥ 0"),
        (positive, "0", "must be ≥ 1, got 0"),
    ):
        with pytest.raises(argparse.ArgumentTypeError, match=why):
            of(bad)


def test_every_producer_says_success_in_one_format(tmp_path, capsys):
    """`DIGEST PATH`, one line, from the engine, the contract and the oracle alike."""
    import subprocess

    from tracegate_contract.__main__ import main as contract_main
    from tracegate_oracle.cli import main as oracle_main

    pytest.importorskip("torch")
    import tracegate
    from binaries import release_binary

    engine, why = release_binary("engine")
    if why:
        pytest.skip(why)
    model = str(Path(__file__).resolve().parents[2] / "fixtures" / "tiny-qwen3")
    lines = {}
    for who in ("engine", "contract", "oracle"):
        out = tmp_path / f"{who}.trace"
        argv = ["trace", "--model", model, "--tokens", "3,17,5", "--out", str(out)]
        if who == "engine":
            lines[who] = subprocess.run(
                [str(engine), *argv], capture_output=True, text=True, check=True
            ).stdout
        else:
            capsys.readouterr()
            assert {"contract": contract_main, "oracle": oracle_main}[who](argv) == 0
            lines[who] = capsys.readouterr().out
        digest = tracegate.Trace(str(out)).digest
        assert lines[who] == f"{digest} {out}\n", (who, lines[who])
