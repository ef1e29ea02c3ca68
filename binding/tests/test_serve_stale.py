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


def _serve(monkeypatch, lines, main):
    """serve() over `lines` on stdin; its answers (it writes them to a dup of fd 1)."""
    import io
    import json

    r, w = os.pipe()
    saved1 = os.dup(1)
    saved2 = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(json.dumps(x) + "\n" for x in lines)))
    monkeypatch.setenv("TRACEGATE_SERVE_STALE_CHECK", "0")
    monkeypatch.setattr(sys, "path", list(sys.path))
    cwd = os.getcwd()
    try:
        os.dup2(w, 1)
        os.dup2(devnull, 2)
        serve.serve(main, "prog")
        sys.stdout.flush()
    finally:
        os.dup2(saved1, 1)
        os.dup2(saved2, 2)
        os.close(w)
        os.close(devnull)
        os.chdir(cwd)
    with os.fdopen(r) as f:
        return [json.loads(x) for x in f.read().splitlines()]


def test_a_request_runs_in_the_cwd_it_carries(tmp_path, monkeypatch):
    # A resident worker serves several project roots: a relative path resolves against the
    # request's cwd. Negative control: a request without one stays where the worker is.
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "only-here").write_text("x")
    seen = []

    def main(argv):
        seen.append((os.getcwd(), os.path.exists(argv[0])))
        return 0

    monkeypatch.chdir(tmp_path / "a")
    answers = _serve(
        monkeypatch,
        [
            {"argv": ["only-here"], "cwd": str(tmp_path / "b")},
            {"argv": ["only-here"], "cwd": str(tmp_path / "a")},
        ],
        main,
    )
    assert answers == [{"exit": 0}, {"exit": 0}]
    assert seen == [(str(tmp_path / "b"), True), (str(tmp_path / "a"), False)]


def test_a_request_with_a_bad_cwd_is_refused_and_the_worker_goes_on(tmp_path, monkeypatch):
    ran = []
    answers = _serve(
        monkeypatch,
        [
            {"argv": ["x"], "cwd": str(tmp_path / "missing")},
            {"argv": ["x"], "cwd": 5},
            {"argv": ["x"]},
        ],
        lambda argv: ran.append(argv) or 0,
    )
    assert answers == [{"exit": 2}, {"exit": 2}, {"exit": 0}]
    assert ran == [["x"]]


def test_a_bad_setting_ends_the_worker_in_one_line(monkeypatch, capsys):
    """Issue 51: a switch the worker cannot read is refused, exit 2, never read as on."""
    for name, value in [
        ("TRACEGATE_SERVE_STALE_CHECK", "disabled"),
        ("TRACEGATE_SERVE_TEST_SLEEP", "2s"),
        ("TRACEGATE_SERVE_TEST_SLEEP", "-1"),
    ]:
        monkeypatch.delenv("TRACEGATE_SERVE_STALE_CHECK", raising=False)
        monkeypatch.setenv(name, value)
        assert serve.serve(lambda argv: 0, "prog") == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: serve: {name}={value!r} is not accepted: {name} takes ")
        assert err.count("\n") == 1, err
        monkeypatch.delenv(name)
    monkeypatch.setenv("TRACEGATE_SERVE_STALE_CHECK", "OFF")
    assert serve.switch("TRACEGATE_SERVE_STALE_CHECK") is False
