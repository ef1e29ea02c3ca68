"""A weights file that is not a regular file (issue 51): a FIFO blocks the open that reads it,
/dev/zero never ends. The oracle's weights digest (tracegate.weights_digest) looks first and
refuses in one line, exit 2, instead of hanging."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from oracle_runner import run_oracle

ROOT = Path(__file__).resolve().parents[2]


def _oracle(*args) -> subprocess.CompletedProcess:
    # A hang is a TimeoutExpired, i.e. a failure, never a stuck suite.
    return run_oracle(*args, cwd=ROOT, timeout=120)


def test_a_gguf_weights_file_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    d = tmp_path / "m"
    d.mkdir()
    os.mkfifo(d / "model.gguf")
    r = _oracle("trace", "--model", d, "--tokens", "1,2", "--out", tmp_path / "x.trace")
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"python -m tracegate_oracle trace: error: --model: {d / 'model.gguf'}: "
        "a FIFO, not a regular file: a weights file must be one"
    ]
    assert not list(tmp_path.glob("x.trace*"))


def test_the_weights_digest_refuses_dev_zero_behind_a_symlink(tmp_path):
    pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.gguf").symlink_to("/dev/zero")
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from tracegate_oracle import records\n"
        "from tracegate_oracle.errors import CheckpointError\n"
        "try:\n"
        "    records.weights_digest(Path(sys.argv[1]))\n"
        "except CheckpointError as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout == (
        f"--model: {d / 'model.gguf'}: a device, not a regular file: a weights file must be one\n"
    )
