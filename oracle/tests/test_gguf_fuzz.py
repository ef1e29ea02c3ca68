"""The three GGUF readers give one verdict on every file (issue 51): the engine (its CLI), the
contract and the oracle (their CLIs' `main`, in-process) on issue 51's hand-made hostile files
and on seeded random mutants of a small valid file (gguf_mutants.py). On each file either all
three refuse — exit 2, one printable line, no traceback — or all three compute it, recording the
same weights digest, the engine's and the contract's logits the same bits. A file the engine
refuses and the oracle computes (a tensor offset pointing at another tensor, ...) records golden
traces of weights no other reader sees.

`TRACEGATE_GGUF_FUZZ=N` runs N random mutants instead of the CI's 300 (`TRACEGATE_GGUF_FUZZ_SEED`
another seed than 51) and prints the counts and every disagreement (1500 take about a minute)."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

import gguf_mutants as gm  # noqa: E402
from binaries import release_binary  # noqa: E402
from tracegate_contract.__main__ import main as contract_main  # noqa: E402
from tracegate_oracle import gguf_source  # noqa: E402
from tracegate_oracle.cli import main as oracle_main  # noqa: E402

ENGINE, NO_ENGINE = release_binary("engine")
SEED = int(os.environ.get("TRACEGATE_GGUF_FUZZ_SEED", "51"))
COUNT = int(os.environ.get("TRACEGATE_GGUF_FUZZ", "300"))
HANG = 60  # seconds: a reader still busy after this is a failure (the valid file takes < 1 s)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf-fuzz")
    base = gm.base_gguf(d / "base.gguf").read_bytes()
    head = gm.base_gguf(d / "head.gguf", head=True).read_bytes()
    return d, base, head


class _Hang(Exception):
    pass


@contextlib.contextmanager
def _deadline(seconds: int):
    def ring(*_):
        raise _Hang(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _verdict(rc, err: str, out: Path):
    """("refused", line) | ("accepted", (weights digest, logits)) | ("broken", why)."""
    err = err.strip()
    if rc == 2:
        lines = err.splitlines()
        if len(lines) != 1 or "Traceback" in err or "panicked" in err:
            return "broken", f"exit 2 but not one line: {err[-600:]!r}"
        if not lines[0].isprintable():
            return "broken", f"a refusal with control characters: {lines[0]!r}"
        return "refused", lines[0]
    if rc == 0:
        t = tg.Trace(str(out))
        return "accepted", (t.provenance["weights_digest"], np.asarray(t["logits"]))
    return "broken", f"exit {rc}: {err[-600:]!r}"


def _engine(model: Path, out: Path):
    try:
        r = subprocess.run(
            [ENGINE, "trace", "--model", model, "--tokens", "1,2,3", "--out", out],
            capture_output=True,
            text=True,
            timeout=HANG,
        )
    except subprocess.TimeoutExpired:
        return "broken", f"still running after {HANG} s"
    return _verdict(r.returncode, r.stderr, out)


def _in_process(main, model: Path, out: Path):
    err = io.StringIO()
    try:
        with (
            _deadline(HANG),
            contextlib.redirect_stderr(err),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            rc = main(["trace", "--model", str(model), "--tokens", "1,2,3", "--out", str(out)])
    except BaseException as e:  # a traceback, a hang, a MemoryError: never a verdict
        return "broken", f"{type(e).__name__}: {str(e)[:300]}"
    return _verdict(rc, err.getvalue(), out)


def _three(d: Path, data: bytes) -> dict:
    model = d / "m.gguf"
    model.write_bytes(data)
    got = {}
    for who, run in (
        ("engine", _engine),
        ("contract", lambda m, o: _in_process(contract_main, m, o)),
        ("oracle", lambda m, o: _in_process(oracle_main, m, o)),
    ):
        out = d / f"{who}.trace"
        out.unlink(missing_ok=True)
        got[who] = run(model, out)
    return got


def _disagreement(got: dict) -> str | None:
    """Why the three verdicts on one file are not one verdict (None: they are)."""
    kinds = {who: v[0] for who, v in got.items()}
    if "broken" in kinds.values() or len(set(kinds.values())) > 1:
        return "; ".join(f"{who}: {k} {str(got[who][1])[:240]}" for who, k in kinds.items())
    if kinds["engine"] == "refused":
        return None
    digests = {who: v[1][0] for who, v in got.items()}
    if len(set(digests.values())) > 1:
        return f"weights digests differ: {digests}"
    e, c = got["engine"][1][1], got["contract"][1][1]
    if e.shape != c.shape or not np.array_equal(e.view(np.uint32), c.view(np.uint32)):
        return "the engine's and the contract's logits differ"
    return None


def _run_all(d: Path, cases) -> tuple[Counter, list]:
    counts, bad = Counter(), []
    for name, data in cases:
        got = _three(d, data)
        why = _disagreement(got)
        counts["mutants"] += 1
        if why:
            counts["disagreements"] += 1
            bad.append(f"{name}: {why}")
        else:
            counts[f"{got['engine'][0]} by all"] += 1
    return counts, bad


@pytest.mark.skipif(NO_ENGINE is not None, reason=f"NOT CHECKED: {NO_ENGINE}")
def test_issue_51_hostile_files_get_one_verdict_from_all_three(files):
    d, base, head = files
    hostile = gm.hostile(base, head)
    cases = [("valid", base, True), ("valid, untied head", head, True)]
    cases += [(name, data, legal) for name, (data, legal) in hostile.items()]
    bad = []
    for name, data, legal in cases:
        got = _three(d, data)
        why = _disagreement(got)
        if why:
            bad.append(f"{name}: {why}")
        elif (got["engine"][0] == "accepted") != legal:
            bad.append(f"{name}: all three {got['engine'][0]} it, §21.1 says legal={legal}")
    assert not bad, "\n".join(bad)


@pytest.mark.skipif(NO_ENGINE is not None, reason=f"NOT CHECKED: {NO_ENGINE}")
def test_random_mutants_get_one_verdict_from_all_three(files):
    d, base, _ = files
    counts, bad = _run_all(d, gm.mutants(base, SEED, COUNT))
    print(f"\nGGUF fuzz (seed {SEED}): {dict(counts)}")
    if COUNT > 200:
        for line in bad:
            print(line)
    # Both verdicts occur: a fuzz whose mutants all fail at the magic tests nothing.
    assert counts["refused by all"] > COUNT // 4 and counts["accepted by all"] > 0, counts
    assert not bad, f"{len(bad)} of {COUNT} mutants:\n" + "\n".join(bad[:20])


def test_a_disagreement_is_reported():
    """The checker's negative control: verdicts that differ, a traceback, two lines, control
    bytes and digests that differ are each a disagreement."""
    ok = ("refused", "engine: error: x")
    acc = ("accepted", ("d1", np.zeros((3, 4), np.float32)))
    assert _disagreement({"engine": ok, "contract": ok, "oracle": ok}) is None
    assert _disagreement({"engine": acc, "contract": acc, "oracle": acc}) is None
    assert _disagreement({"engine": ok, "contract": ok, "oracle": acc})
    other = ("accepted", ("d2", np.zeros((3, 4), np.float32)))
    assert _disagreement({"engine": acc, "contract": acc, "oracle": other})
    nudged = ("accepted", ("d1", np.full((3, 4), 1e-30, np.float32)))
    assert _disagreement({"engine": acc, "contract": nudged, "oracle": acc})
    assert _verdict(2, "a\nb", Path("x"))[0] == "broken"
    assert _verdict(2, "Traceback (most recent call last): x", Path("x"))[0] == "broken"
    assert _verdict(2, "error: key t.\x1b[2J", Path("x"))[0] == "broken"
    assert _verdict(1, "error", Path("x"))[0] == "broken"


def test_many_strings_cost_the_oracle_what_they_cost_the_contract(files, tmp_path):
    """A 4 MB file of 500,000 empty strings in one metadata array: ggml's GGUFReader made two
    numpy views of each (2.3 GB, 32 s in issue 51); the oracle's reader steps over what
    transformers does not read, and the config it makes is the valid file's."""
    _, base, _ = files
    big = tmp_path / "strings.gguf"
    big.write_bytes(gm.many_empty_strings(base))
    small = tmp_path / "base.gguf"
    small.write_bytes(base)
    tracemalloc.start()
    try:
        with _deadline(HANG):
            src = gguf_source.read(big)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 300 << 20, f"reading {big.stat().st_size} bytes took {peak >> 20} MiB"
    assert src.config == gguf_source.read(small).config
