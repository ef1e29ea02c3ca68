"""tracegate.compare on hostile patterns and policy files (issue 33 items 5, 7, 8, 12, 13).

Each case runs in a child interpreter: on main a 200,000-star pattern overflowed the matcher's
stack and killed the interpreter (SIGSEGV), a backtracking pattern on a 4000-byte name ran for
minutes (Ctrl-C ignored), and a FIFO as the policy blocked forever. The child's timeout is the
harness's generous bound, not a timing claim: the results are what is asserted."""

import os
import subprocess
import sys

import numpy as np
import tracegate

LONG = "a" * 4000


def _trace(path):
    with tracegate.TraceWriter(path, {"producer": "test"}) as w:
        for name in (LONG, LONG + "b", "layer.00.out", "logits"):
            w.tensor(name, np.ones(2, np.float32))
    return path


def _child(code: str, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
    )


SELECTED = """
import pathlib, sys, tracegate
pattern = pathlib.Path(sys.argv[2]).read_text()  # one argument holds at most 128 KiB
r = tracegate.compare(sys.argv[1], sys.argv[1], only=pattern)
print(r.verdict, r.filter["tensors_left_out"])
"""


def test_hostile_only_patterns_answer_with_the_right_selection(tmp_path):
    t = _trace(tmp_path / "t.trace")
    for pattern, left_out in [
        ("*" * 200_000, 0),  # a star run is one token; `**…` matches every name
        ("*" * 200_000 + "b", 3),  # only LONG + "b" ends in b
        ("*a" * 30 + "*b", 3),  # LONG + "b" has 30 a's before its b, LONG no b
        ("**a" * 30 + "**x", None),  # nothing: CompareError, not minutes of backtracking
    ]:
        (tmp_path / "pattern").write_text(pattern)
        r = _child(SELECTED, t, tmp_path / "pattern")
        if left_out is None:
            assert r.returncode == 1 and "selects no tensor" in r.stderr, r.stderr[-2000:]
            continue
        assert r.returncode == 0, (pattern[:40], r.returncode, r.stderr[-2000:])
        assert r.stdout.split() == ["identical", str(left_out)], (pattern[:40], r.stdout)


POLICY = """
import sys, tracegate
try:
    tracegate.compare(sys.argv[1], sys.argv[1], policy=sys.argv[2])
except tracegate.CompareError as e:
    print(e)
else:
    print("loaded")
"""


def test_hostile_policy_files_are_refused_with_the_file_and_the_reason(tmp_path):
    t = _trace(tmp_path / "t.trace")
    head = '{"format": "tracegate-policy/1", "name": "t", "rules": ['
    cases = {
        "ok.json": (head + '{"pattern": "**", "max_ulp": 0}]}', "loaded"),
        "stars.json": (head + '{"pattern": "' + "*" * 200_000 + '", "max_ulp": 0}]}', "loaded"),
        "dup.json": (
            head + '{"pattern": "**", "max_rel_l2": 1e-6, "max_rel_l2": 1e9}]}',
            'duplicate key "max_rel_l2" in rules[0]',
        ),
        "range.json": (
            head + '{"pattern": "**", "min_cosine": -5}]}',
            "min_cosine is -5, outside its range: [-1, 1]",
        ),
    }
    for name, (text, want) in cases.items():
        (tmp_path / name).write_text(text)
        r = _child(POLICY, t, tmp_path / name)
        assert r.returncode == 0 and want in r.stdout, (name, r.returncode, r.stdout, r.stderr)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    for path, want in [(fifo, "a FIFO"), ("/dev/zero", "a device"), (tmp_path, "a directory")]:
        r = _child(POLICY, t, path)
        assert r.returncode == 0 and f"{want}, not a regular file" in r.stdout, (path, r.stdout)
