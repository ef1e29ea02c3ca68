"""The oracle's CLI refuses hostile inputs in one line, exit 2, as the engine and the contract do:
an integer tensor as a layer input (never read as f32), a layer input with no rows, an --out that
cannot be written (a full disk). Each input is a trace an adversary writes with TraceWriter."""

from __future__ import annotations

import resource
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

from tracegate_oracle.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"
H = 52  # the fixture's hidden_size


def _input(path: Path, x: np.ndarray) -> Path:
    with tg.TraceWriter(str(path), {"producer": "adversary"}) as w:
        w.tensor("rows", x, path="prefill", mask="causal", positions=list(range(len(x))))
        w.finish()
    return path


def _layer(inp: Path, out: Path) -> list[str]:
    return [
        "layer",
        "--model",
        str(DENSE),
        "--layer",
        "0",
        "--input",
        str(inp),
        "--input-name",
        "rows",
        "--out",
        str(out),
    ]


@pytest.mark.parametrize(
    "x, msg",
    [
        (np.ones((3, H), np.int32), "tensor rows is i32, not f32"),
        (np.zeros((0, H), np.float32), f"tensor shape [0, {H}] is not [rows, {H}] with rows ≥ 1"),
    ],
    ids=["i32", "zero-rows"],
)
def test_a_layer_input_the_engine_refuses_is_refused_in_one_line(x, msg, tmp_path, capsys):
    out = tmp_path / "o.trace"
    assert main(_layer(_input(tmp_path / "in.trace", x), out)) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1, err
    assert not out.exists()
    # The control: f32 rows of the right shape are run.
    ok = _input(tmp_path / "ok.trace", np.full((3, H), 0.25, np.float32))
    assert main(_layer(ok, out)) == 0, capsys.readouterr().err
    assert out.is_file()


def _full_disk():
    # RLIMIT_FSIZE stands in for a full disk: writes past 4 KiB fail (EFBIG; SIGXFSZ ignored).
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))


def test_an_unwritable_out_is_one_line_not_a_traceback(tmp_path):
    out = tmp_path / "o.trace"
    # A real process, not oracle_runner's fork server: the file size limit is set on it (preexec_fn).
    argv = [sys.executable, "-m", "tracegate_oracle", "trace", "--model", str(DENSE)]
    argv += ["--tokens", "3,17,5", "--out", str(out)]
    p = subprocess.run(argv, capture_output=True, text=True, preexec_fn=_full_disk, timeout=600)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert f"--out {out}: cannot write the trace" in p.stderr, p.stderr
    # Nothing at the final path, and no temporary beside it.
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    # The control: the same command without the limit writes the trace.
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and out.is_file(), p.stderr
