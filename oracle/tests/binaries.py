"""Where cargo put the release binaries (engine, trace-diff, gate): the contract tests' locator
(cargo metadata, honouring CARGO_TARGET_DIR), and their checked reader of `trace-diff --json`,
loaded by path because both test trees import their own `conftest` by that name. Also the
family tests' runs: a producer's trace through its CLI, and trace-diff's verdict on two."""

from __future__ import annotations

import functools
import importlib.util
import subprocess
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
ORACLE_POLICY = _ROOT / "fixtures" / "policy" / "oracle-default.json"


@functools.cache
def _conftest():
    spec = importlib.util.spec_from_file_location(
        "contract_tests_conftest", _ROOT / "contract/tests/conftest.py"
    )
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    return conf


def release_binary(name: str) -> tuple[str, str | None]:
    """(path, None) when the release binary `name` is built, else (path, the reason it is not)."""
    return _conftest().release_binary(name)


def needs_built(*names: str):
    """A skip marker for tests that run these release binaries: skipped, with the reason, while
    one of them is not built."""
    import pytest

    why = next((w for _, w in map(release_binary, names) if w), None)
    return pytest.mark.skipif(why is not None, reason=str(why))


def planted_contract(tmp_path: Path, file: str, old: str, new: str) -> dict:
    """An environment whose `tracegate_contract` is a copy with `old` replaced by `new` (once)
    in `file`: a planted defect, run as the contract's CLI is."""
    import os
    import shutil

    import tracegate_contract

    root = tmp_path / "planted"
    shutil.copytree(
        Path(tracegate_contract.__file__).parent,
        root / "tracegate_contract",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    src = root / "tracegate_contract" / file
    text = src.read_text()
    assert text.count(old) == 1, f"planting site not found exactly once in {file}: {old!r}"
    src.write_text(text.replace(old, new))
    return {**os.environ, "PYTHONPATH": str(root)}


def copy_trace(src, dst, edit=lambda prov: prov, tensor=lambda name, array: array):
    """Rewrite a trace through the binding: every tensor with its dtype and attributes (its
    array passed through `tensor`), every decision with its margins, and provenance passed
    through `edit`."""
    import tracegate as tg

    t = tg.Trace(str(src))
    with tg.TraceWriter(str(dst), edit(t.provenance)) as w:
        for n in t.names:
            w.tensor(n, tensor(n, t[n]), dtype=t.dtype(n), **t.attributes(n))
        for n, v in t.decisions.items():
            w.decision(n, v, margins=t.margins[n])
    return dst


def diff_report(text: str) -> dict:
    """A `trace-diff --json` report, parsed and checked against docs/diff-report.schema.json."""
    return _conftest().diff_report(text)


def run_checked(*argv, env=None) -> subprocess.CompletedProcess:
    """Runs `argv` (each item as str); the test fails with the tail of its stderr unless it
    exits 0."""
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{argv[:3]}: exit {r.returncode}: {r.stderr[-800:]}"
    return r


def producer_trace(
    who: str,
    model: Path,
    tokens: str,
    out: Path,
    *,
    capture: str = "internals",
    cache: str | None = "on",
    generate: int = 4,
    extra: tuple = (),
    env=None,
) -> Path:
    """`trace` by `who` (engine, contract or oracle), each through its CLI, `extra` appended;
    `generate` 0 and `cache` None leave those flags out."""
    args = ["trace", "--model", model, "--tokens", tokens, "--capture", capture]
    args += ["--generate", generate] if generate else []
    args += ["--cache", cache] if cache else []
    args += ["--out", out, *extra]
    if who == "engine":
        run_checked(release_binary("engine")[0], *args, env=env)
    elif who == "oracle":
        from oracle_runner import run_oracle

        r = run_oracle(*args, env=env)
        assert r.returncode == 0, f"oracle {args[0]}: exit {r.returncode}: {r.stderr[-800:]}"
    else:
        run_checked(sys.executable, "-m", f"tracegate_{who}", *args, env=env)
    return out


def judge(reference: Path, candidate: Path, policy=ORACLE_POLICY) -> tuple[int, dict]:
    """trace-diff's exit code (0 or 1; anything else fails the test) and its checked report;
    `policy` None compares by bits."""
    argv = [release_binary("trace-diff")[0], reference, candidate, "--json"]
    argv += ["--policy", policy] if policy else []
    r = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=120)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode, diff_report(r.stdout)
