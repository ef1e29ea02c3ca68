"""The root conftest.py's CI rule, run on a throwaway test tree: outside CI a skip is a skip
(listed with its reason), with CI=true every kind of skip fails the run and prints its reason."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SKIPPING = {
    "test_a.py": """
import pytest

def test_passes():
    pass

def test_body():
    pytest.skip("reason-body")

@pytest.mark.skipif(True, reason="reason-marker")
def test_marked():
    pass

@pytest.fixture
def fx():
    pytest.skip("reason-fixture")

def test_fixture(fx):
    pass

@pytest.mark.xfail(reason="reason-xfail", strict=True)
def test_expected_failure():
    assert False
""",
    "test_b.py": """
import pytest
pytest.importorskip("tracegate_no_such_module", reason="reason-module")

def test_never_collected():
    pass
""",
}
REASONS = ["reason-body", "reason-marker", "reason-fixture", "reason-module"]


def _pytest(tmp: Path, ci: str | None):
    for name, text in SKIPPING.items():
        (tmp / name).write_text(text)
    shutil.copy(ROOT / "conftest.py", tmp / "conftest.py")
    shutil.copy(
        ROOT / "pytest.ini", tmp / "pytest.ini"
    )  # the repo's flags (-rfEs); its testpaths yield to the path given
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", str(tmp)],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_outside_ci_skips_are_skips_with_reasons(tmp_path):
    for ci in (None, "false", "0"):
        r = _pytest(tmp_path, ci)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "1 passed, 4 skipped, 1 xfailed" in r.stdout, r.stdout
        for why in REASONS:  # -rs lists each skip with its reason
            assert f": {why}" in r.stdout, (why, r.stdout)


def test_in_ci_every_skip_fails_and_says_why(tmp_path):
    for ci in ("true", "1"):
        r = _pytest(tmp_path, ci)
        assert r.returncode == 1, r.stdout + r.stderr
        # The module-level skip does not stop the session: every skip is reported in one run.
        assert "1 failed, 1 passed, 1 xfailed, 3 errors" in r.stdout, r.stdout
        for why in REASONS:
            assert f"CI={ci} forbids skips: Skipped: {why}" in r.stdout, (why, r.stdout)
