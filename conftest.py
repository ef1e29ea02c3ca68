"""Repository-wide pytest policy: in CI a skipped test is a failure, with its reason printed.

Outside CI a skip stays a skip (pytest.ini's `-rs` lists each one with its reason), so a
developer without, say, CUDA still gets a green run. In CI (`CI` set and not 0/false/no, as CI
services set CI=true) nothing may pass by not running: a test, fixture or whole module
(`importorskip` at module level) that skips fails the run, and the report says why.

Residency off (docs/producers.md, "Resident workers"): a gate these tests start serves them
with per-run workers and leaves no process behind.

Kept free of importable names: contract/tests imports its own `conftest` by name.
"""

from __future__ import annotations

import os

import pytest

os.environ["TRACEGATE_RESIDENT"] = "0"


def _ci() -> str | None:
    v = os.environ.get("CI", "").strip()
    return v if v and v.lower() not in ("0", "false", "no") else None


def _reason(longrepr) -> str:
    # A skip's longrepr is (path, line, "Skipped: reason").
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        path, line, msg = longrepr
        return f"{msg} ({path}:{line})"
    return str(longrepr)


def _fail_skip(rep, what: str) -> None:
    rep.outcome = "failed"
    rep.longrepr = (
        f"{what} skipped, and CI={os.environ['CI']} forbids skips: {_reason(rep.longrepr)}"
    )


def pytest_configure(config):
    if _ci():
        # A skipped module becomes a collection error, which would stop the session before the
        # rest ran: keep going, so one CI run lists every skip (the run still fails).
        config.option.continue_on_collection_errors = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    rep = yield
    # xfail is reported as its own outcome (wasxfail), not a skip: left alone.
    if _ci() and rep.skipped and not hasattr(rep, "wasxfail"):
        _fail_skip(rep, f"test ({rep.when})")
    return rep


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    rep = yield
    if _ci() and rep.skipped:
        _fail_skip(rep, "module" if isinstance(collector, pytest.Module) else "collector")
    return rep
