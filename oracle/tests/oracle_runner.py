"""`run_oracle`: `python -m tracegate_oracle ARGV` for the tests, through a fork server.

Each oracle process spends seconds of CPU importing torch and transformers before it computes
anything (transformers 5.23 pulls torch._dynamo and torch.distributed.tensor). One resident
server per pytest process (started on first use, ended at exit) imports them once and computes
nothing itself: no torch op runs in it, so no torch thread pool exists when it forks. For each
run it forks a child that starts a session (its own process group, killed whole on timeout),
chdirs to `cwd`, replaces os.environ with `env`, puts files on fds 0/1/2, sets sys.argv and runs
the module as `-m` does (runpy, run_name "__main__", sys.argv[0] its __main__.py); SystemExit
gives the exit code as the interpreter maps it, an uncaught exception prints its traceback to
stderr and gives 1; atexit handlers run, the streams are flushed, and the child `os._exit`s.

Real subprocess instead (`fresh=True`, or automatically): a test about a fresh process or the
process boundary asks for one; and the server's modules were imported under its own
environment, so a run whose environment differs from the server's in any variable read at
import time falls back to a real subprocess. The rule: any difference (added, removed or
changed) in a variable whose name starts with one of IMPORT_TIME_PREFIXES (torch, OpenMP, MKL,
OpenBLAS, CUDA, Hugging Face, transformers, the interpreter's own PYTHON* such as PYTHONPATH,
and the dynamic loader's LD_*). `stats` counts forked and fresh runs; with
TRACEGATE_FORKSRV_STATS=PATH set, each pytest process appends them to PATH as a JSON line at exit.
"""

from __future__ import annotations

import atexit
import json
import locale
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

IMPORT_TIME_PREFIXES = (
    "TORCH",
    "PYTORCH",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA",
    "NVIDIA_",
    "HF_",
    "HUGGINGFACE",
    "TRANSFORMERS",
    "TOKENIZERS",
    "SAFETENSORS",
    "PYTHON",
    "LD_",
)
MODULE = "tracegate_oracle"
# What `python -m tracegate_oracle trace` on tiny-qwen3 imports (the same set of modules).
_PRELOAD = (
    "import torch, transformers\n"
    "from transformers import Qwen3ForCausalLM\n"
    "import tracegate, tracegate_oracle.cli, tracegate_oracle.quantized_activations\n"
)

stats = {"forked": 0, "fresh": 0}


def _dump_stats():
    path = os.environ.get("TRACEGATE_FORKSRV_STATS")
    if path and any(stats.values()):
        with open(path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), **stats}) + "\n")


atexit.register(_dump_stats)


def import_time_env(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def run_oracle(*argv, **kw) -> subprocess.CompletedProcess:
    """`python -m tracegate_oracle *argv` (each item as str), as subprocess.run(capture_output=True,
    text=True) runs it: a CompletedProcess with args, returncode (negative: the signal), stdout
    and stderr; subprocess.TimeoutExpired after `timeout` seconds, the child killed. Keywords:
    cwd, env (None: os.environ), timeout (300), input (text for stdin), fresh (a real process)."""
    return run_module(MODULE, *argv, **kw)


def run_module(
    module, *argv, cwd=None, env=None, timeout=300, input=None, fresh=False, server=None
) -> subprocess.CompletedProcess:
    """`python -m module *argv` through `server` (None: this process's one); run_oracle's."""
    args = [sys.executable, "-m", module, *map(str, argv)]
    env = dict(os.environ if env is None else env)
    cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
    server = None if fresh else (server or Server.get())
    if server is None or import_time_env(env) != server.import_env:
        stats["fresh"] += 1
        return subprocess.run(
            args, cwd=cwd, env=env, input=input, capture_output=True, text=True, timeout=timeout
        )
    stats["forked"] += 1
    return server.run(args, cwd, env, timeout, input)


class Server:
    _one = None
    _lock = threading.Lock()

    @classmethod
    def get(cls) -> Server:
        with cls._lock:
            if cls._one is None:
                cls._one = cls()
                atexit.register(cls._one.close)
            return cls._one

    def __init__(self, preload: str = _PRELOAD):
        """A server that runs `preload` (Python source) before it serves; get() gives the one
        this process shares."""
        self.import_env = import_time_env(os.environ)
        self.dir = tempfile.TemporaryDirectory(prefix="tg-forksrv-")
        self.log = Path(self.dir.name) / "server.log"
        ours, theirs = socket.socketpair()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _SERVER, str(theirs.fileno()), preload],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
            )
        theirs.close()
        self.sock, self.buf, self.n = ours, b"", 0
        self.ready = self._recv(300, "start")

    def _recv(self, timeout, what) -> dict:
        self.sock.settimeout(timeout)
        while b"\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise RuntimeError(
                    f"oracle fork server (pid {self.proc.pid}) ended during {what}: "
                    f"exit {self.proc.wait(5)}; its log:\n{self.log.read_text()[-3000:]}"
                )
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, args, cwd, env, timeout, input):
        with self._lock:
            self.n += 1
            d = Path(self.dir.name)
            paths = {k: d / f"{self.n}.{k}" for k in ("stdin", "stdout", "stderr")}
            paths["stdin"].write_text(input or "", encoding=locale.getpreferredencoding(False))
            req = {"argv": args[3:], "module": args[2], "cwd": cwd, "env": env}
            req.update({k: str(p) for k, p in paths.items()})
            self.sock.sendall(json.dumps(req).encode() + b"\n")
            pid = self._recv(60, "fork")["pid"]
            try:
                code = self._recv(timeout, "run")["returncode"]
                timed_out = False
            except TimeoutError:
                # Its session: the child and whatever it started.
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                self._recv(60, "kill")
                timed_out = True
            out, err = (_read(paths[k]) for k in ("stdout", "stderr"))
            for p in paths.values():
                p.unlink()
        if timed_out:
            raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
        return subprocess.CompletedProcess(args, code, out, err)

    def close(self):
        try:
            self.sock.close()
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.dir.cleanup()


def _read(path: Path) -> str:
    # As subprocess's text mode decodes (locale encoding, universal newlines).
    with open(path, encoding=locale.getpreferredencoding(False)) as f:
        return f.read()


# The server, run as `python -c _SERVER FD PRELOAD`: requests and replies are JSON lines on FD.
_SERVER = r"""
import json, os, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
exec(sys.argv[2])
import atexit, runpy, threading, traceback

def reply(**kw):
    sock.sendall(json.dumps(kw).encode() + b"\n")

def exit_code(code):
    # As the interpreter maps SystemExit.code.
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1

def child(req):
    code = 1
    try:
        sock.close()
        os.setsid()
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for fd, key, flags in (
            (0, "stdin", os.O_RDONLY),
            (1, "stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
            (2, "stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        ):
            f = os.open(req[key], flags, 0o600)
            os.dup2(f, fd)
            os.close(f)
        sys.argv = ["-m", *req["argv"]]
        sys.path[0] = os.getcwd()  # -m puts the working directory first
        try:
            runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = exit_code(e.code)
        except BaseException:
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)

sys.stdout.flush()
sys.stderr.flush()
reply(ready=True, pid=os.getpid(), python_threads=threading.active_count(),
      os_threads=len(os.listdir("/proc/self/task")), modules=sorted(sys.modules))
buf = b""
while True:
    while b"\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            sys.exit(0)
        buf += chunk
    line, buf = buf.split(b"\n", 1)
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    reply(pid=pid)
    reply(returncode=os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
