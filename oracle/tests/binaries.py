"""Where cargo put the release binaries (engine, trace-diff, gate): the contract tests' locator
(cargo metadata, honouring CARGO_TARGET_DIR), and their checked reader of `trace-diff --json`,
loaded by path because both test trees import their own `conftest` by that name."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]


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


def diff_report(text: str) -> dict:
    """A `trace-diff --json` report, parsed and checked against docs/diff-report.schema.json."""
    return _conftest().diff_report(text)
