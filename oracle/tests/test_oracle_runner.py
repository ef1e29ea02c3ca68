"""The tests' fork server (oracle_runner.py) against real subprocesses: a probe module run both
ways gives the same exit code, stdout and stderr (exit 3, an exception's traceback, a string
exit, separated streams, stdin), the requested cwd and environment (replaced, not merged); a
timeout kills the child; an import-time variable falls back to a real process; the server
holds no torch thread pool; and an oracle trace through it has the fresh process's digest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from oracle_runner import Server, run_module, run_oracle, stats

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DENSE = ROOT / "fixtures" / "tiny-qwen3"

PROBE = textwrap.dedent(
    """
    import json, os, sys, time
    what = sys.argv[1]
    if what == "exit":
        print("before exit")
        sys.exit(int(sys.argv[2]))
    if what == "exit-str":
        sys.exit("a string exit")
    if what == "raise":
        print("to stdout", flush=True)
        raise ValueError("planted failure")
    if what == "sleep":
        open(sys.argv[2], "w").write(str(os.getpid()))
        time.sleep(600)
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "ppid": os.getppid(),
        "probe": os.environ.get("TG_PROBE"), "home": "HOME" in os.environ,
        "omp": os.environ.get("OMP_NUM_THREADS"), "stdin": sys.stdin.read(),
    }))
    print("to stderr", file=sys.stderr)
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """A directory holding the module `tg_probe` (importable from it as cwd, as -m finds it)."""
    d = tmp_path_factory.mktemp("probe")
    (d / "tg_probe").mkdir()
    (d / "tg_probe" / "__main__.py").write_text(PROBE)
    return d


def _both(probe, *argv, **kw):
    forked0 = stats["forked"]
    f = run_module("tg_probe", *argv, cwd=probe, **kw)
    assert stats["forked"] == forked0 + 1, "not run through the fork server"
    s = run_module("tg_probe", *argv, cwd=probe, fresh=True, **kw)
    return f, s


@pytest.mark.parametrize("code", [0, 3, 255])
def test_exit_codes_and_stdout_as_a_real_process(probe, code):
    f, s = _both(probe, "exit", code)
    assert (f.returncode, f.stdout, f.stderr) == (s.returncode, s.stdout, s.stderr)
    assert f.returncode == code and f.stdout == "before exit\n" and f.stderr == ""
    assert f.args == [sys.executable, "-m", "tg_probe", "exit", str(code)] == s.args


def test_an_uncaught_exception_is_exit_1_with_its_traceback(probe):
    f, s = _both(probe, "raise")
    assert f.returncode == s.returncode == 1
    assert f.stdout == s.stdout == "to stdout\n"
    for r in (f, s):
        assert r.stderr.startswith("Traceback (most recent call last):"), r.stderr
        assert r.stderr.rstrip().endswith("ValueError: planted failure"), r.stderr


def test_a_string_exit_is_1_with_the_string_on_stderr(probe):
    f, s = _both(probe, "exit-str")
    assert (f.returncode, f.stdout, f.stderr) == (s.returncode, s.stdout, s.stderr)
    assert f.returncode == 1 and f.stderr == "a string exit\n"


def test_cwd_environment_argv_stdin_and_separate_streams(probe, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    env["TG_PROBE"] = "requested"
    f, s = _both(probe, "echo", "x y", env=env, input="to stdin\n")
    a, b = json.loads(f.stdout), json.loads(s.stdout)
    assert f.returncode == s.returncode == 0
    assert f.stderr == s.stderr == "to stderr\n"
    assert a["argv"][0].endswith(os.path.join("tg_probe", "__main__.py"))
    for r in (a, b):
        assert r["argv"][1:] == ["echo", "x y"] and r["cwd"] == str(probe)
        # The environment is replaced: HOME, which the server has, is not in the child's.
        assert r["probe"] == "requested" and r["home"] is False and r["stdin"] == "to stdin\n"
    # Negative control: forked from the server, not from this process as the real one is.
    assert a["ppid"] == Server.get().proc.pid and b["ppid"] == os.getpid()


def test_an_import_time_variable_falls_back_to_a_real_process(probe):
    env = {**os.environ, "OMP_NUM_THREADS": str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1)}
    fresh0 = stats["fresh"]
    r = run_module("tg_probe", "echo", cwd=probe, env=env)
    assert stats["fresh"] == fresh0 + 1
    got = json.loads(r.stdout)
    assert got["ppid"] == os.getpid() and got["omp"] == env["OMP_NUM_THREADS"]


def test_a_timeout_kills_the_child_and_the_server_goes_on(probe, tmp_path):
    pidfile = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        run_module("tg_probe", "sleep", pidfile, cwd=probe, timeout=3)
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped
        os.kill(pid, 0)
    assert run_module("tg_probe", "exit", 3, cwd=probe).returncode == 3


def _threads_after(code: str) -> int:
    r = subprocess.run(
        [sys.executable, "-c", code + "\nimport os; print(len(os.listdir('/proc/self/task')))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(r.stdout)


def test_the_server_imported_torch_and_started_no_torch_threads():
    ready = Server.get().ready
    assert {"torch", "transformers", "tracegate_oracle.cli"} <= set(ready["modules"])
    assert ready["python_threads"] == 1
    # numpy's BLAS may start its own pool at import (fork-safe); torch ops would add theirs.
    assert ready["os_threads"] == _threads_after("import numpy")
    # Negative control: one torch op starts threads that the comparison above would catch.
    assert _threads_after("import torch; torch.ones(256, 256)") > ready["os_threads"]


def test_an_oracle_trace_through_the_server_matches_a_fresh_process(tmp_path):
    tg = pytest.importorskip("tracegate")
    argv = ["trace", "--model", DENSE, "--generate", "1", "--tokens"]
    forked0 = stats["forked"]
    runs = {
        "forked": run_oracle(*argv, "1,2,3", "--out", tmp_path / "f.trace"),
        "fresh": run_oracle(*argv, "1,2,3", "--out", tmp_path / "s.trace", fresh=True),
        "other": run_oracle(*argv, "1,2,4", "--out", tmp_path / "o.trace"),
    }
    assert stats["forked"] == forked0 + 2
    for k, r in runs.items():
        assert r.returncode == 0, (k, r.stderr[-2000:])
    d = {k: tg.Trace(str(tmp_path / f"{k[0]}.trace")).digest for k in runs}
    assert d["forked"] == d["fresh"]
    assert d["other"] != d["forked"]  # negative control: other tokens, another digest
    # A refusal: the same exit code and one-line message both ways.
    bad = ["trace", "--model", DENSE, "--tokens", "1,x", "--out", tmp_path / "bad.trace"]
    f, s = run_oracle(*bad), run_oracle(*bad, fresh=True)
    assert f.returncode == s.returncode == 2 and f.stderr == s.stderr and f.stdout == s.stdout
