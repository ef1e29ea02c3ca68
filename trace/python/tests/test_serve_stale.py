"""The serving loop's staleness check (tracegate.serve._Imported): what it watches."""

import os
import sys
import types

from tracegate import serve


def _fake_module(monkeypatch, name: str, path) -> None:
    mod = types.ModuleType(name)
    mod.__file__ = str(path)
    monkeypatch.setitem(sys.modules, name, mod)


def _rewrite(path) -> None:
    path.write_text("version = 2\n")
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


def test_a_reinstalled_stack_package_makes_the_worker_stale(tmp_path, monkeypatch):
    init = tmp_path / "transformers_init.py"
    init.write_text("version = 1\n")
    _fake_module(monkeypatch, "transformers", init)
    imported = serve._Imported()
    assert imported.changed() is None
    _rewrite(init)
    assert "transformers_init.py changed" in (imported.changed() or "")


def test_a_package_outside_tracegate_and_the_stack_is_not_watched(tmp_path, monkeypatch):
    # The negative control: the check is not "any file changed", it names what it watches.
    init = tmp_path / "other_init.py"
    init.write_text("version = 1\n")
    _fake_module(monkeypatch, "transformers_extra", init)
    imported = serve._Imported()
    _rewrite(init)
    assert imported.changed() is None
