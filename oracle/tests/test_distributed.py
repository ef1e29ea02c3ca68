"""`trace --distributed tp=N|ep=N`: the oracle sharded by transformers' own tensor / expert
parallelism under torchrun (gloo, CPU), one rank trace per rank. What must hold: trace-merge of
the rank traces is within the oracle-default policy of the one-process oracle trace, every
decision equal, internals and decode, on every fixture transformers' class can shard (tiny-llama,
tiny-qwen2, tiny-qwen3, tiny-qwen3_5 tp=2; tiny-qwen3-moe and tiny-qwen3_5-moe tp=2 and ep=2;
tiny-gemma3's one key/value head and diffusion Gemma are refused, below); replicas
are bit-identical across ranks (trace-merge checks it); a planted defect in one rank's shard is
caught and named; what cannot be sharded is refused in one line; a rank that fails is named and
a hung one is killed after the timeout.

Slow (each torchrun launch is three torch imports): every case's ranks run in one launch, its
traces shared by the assertions on them (`Runs`), and the launcher's own path runs once, for one
case, whose rank traces must equal the shared launch's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

from binaries import copy_trace, judge, needs_built, release_binary  # noqa: E402
from tracegate_oracle import distributed  # noqa: E402
from tracegate_oracle.errors import OracleError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "fixtures"
TOKENS = "3,17,5,9,11,40,2"
FLAGS = ("--capture", "internals", "--generate", "2")
# id: (fixture, --distributed); the one-process reference runs the same flags (once per fixture).
CASES = {
    "llama-tp2": ("tiny-llama", "tp=2"),
    "qwen2-tp2": ("tiny-qwen2", "tp=2"),
    "qwen3-tp2": ("tiny-qwen3", "tp=2"),
    "qwen3_5-tp2": ("tiny-qwen3_5", "tp=2"),
    "moe-tp2": ("tiny-qwen3-moe", "tp=2"),
    "moe-ep2": ("tiny-qwen3-moe", "ep=2"),
    "qwen3_5-moe-tp2": ("tiny-qwen3_5-moe", "tp=2"),
    "qwen3_5-moe-ep2": ("tiny-qwen3_5-moe", "ep=2"),
}

pytestmark = needs_built("trace-merge", "trace-diff")


def oracle(*argv, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracegate_oracle", *map(str, argv)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )


def merge(*ranks, out) -> subprocess.CompletedProcess:
    argv = [release_binary("trace-merge")[0], *map(str, ranks), "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


# Every case's ranks in one torchrun launch (each launch costs three torch start-ups): each rank
# joins the process group once and runs the oracle's own `main` per case, which keeps a group
# its caller made (distributed.finish). The launcher's own path, `trace --distributed` starting
# torchrun itself, runs for LAUNCHED, and its rank traces must equal the shared launch's.
LAUNCHED = "qwen3-tp2"
RANKS = """import json, sys
import torch.distributed as dist
from tracegate_oracle import distributed
from tracegate_oracle.cli import main

dist.init_process_group(distributed.BACKEND)
try:
    for argv in json.load(open(sys.argv[1])):
        if main(argv) != 0:
            sys.exit(f"{argv}: failed")
finally:
    dist.destroy_process_group()
"""


class Runs:
    """Each case's one-process trace, rank traces and merged trace, made once per module."""

    def __init__(self, tmp: Path):
        self.tmp, self.done, self.one = tmp, {}, {}

    def _common(self, case: str) -> tuple:
        fixture, _ = CASES[case]
        return ("trace", "--model", FIX / fixture, "--tokens", TOKENS, *FLAGS)

    def _all_ranks(self) -> None:
        jobs = []
        for case, (_, spec) in CASES.items():
            (self.tmp / case).mkdir()
            out = self.tmp / case / "rank{rank}.trace"
            jobs.append(
                [str(x) for x in (*self._common(case), "--distributed", spec, "--out", out)]
            )
        (self.tmp / "jobs.json").write_text(json.dumps(jobs))
        (self.tmp / "ranks.py").write_text(RANKS)
        target = [str(self.tmp / "ranks.py"), str(self.tmp / "jobs.json")]
        distributed.run_ranks(
            target, 2, timeout=600, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}
        )
        d = self.tmp / "launched"
        d.mkdir()
        r = oracle(*self._common(LAUNCHED), "--distributed", CASES[LAUNCHED][1],
                   "--out", d / "rank{rank}.trace")  # fmt: skip
        assert r.returncode == 0, r.stderr[-1500:]
        ranks = [d / "rank0.trace", d / "rank1.trace"]
        # Success: one `DIGEST PATH` line per rank trace, in rank order.
        assert [ln.split()[1] for ln in r.stdout.splitlines()] == list(map(str, ranks))
        shared = [self.tmp / LAUNCHED / f"rank{i}.trace" for i in (0, 1)]
        assert [tg.Trace(str(p)).digest for p in ranks] == [
            tg.Trace(str(p)).digest for p in shared
        ], "a case run in the shared launch differs from its own launch"

    def __call__(self, case: str) -> dict:
        if not self.done:
            self._all_ranks()
        if case not in self.done:
            fixture, _ = CASES[case]
            d = self.tmp / case
            if fixture not in self.one:
                self.one[fixture] = self.tmp / f"{fixture}.one.trace"
                r = oracle(*self._common(case), "--out", self.one[fixture])
                assert r.returncode == 0, r.stderr[-800:]
            ranks = [d / "rank0.trace", d / "rank1.trace"]
            m = merge(*ranks, out=d / "merged.trace")
            assert m.returncode == 0, m.stderr
            self.done[case] = {
                "one": self.one[fixture],
                "ranks": ranks,
                "merged": d / "merged.trace",
                "merge_report": m.stdout,
            }
        return self.done[case]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("distributed"))


def shards(path: Path) -> dict[str, str]:
    t = tg.Trace(str(path))
    return {n: t.attributes(n).get("shard") for n in t.names}


@pytest.mark.parametrize("case", list(CASES))
def test_merged_ranks_are_within_the_oracle_policy_of_one_process(runs, case):
    run = runs(case)
    code, report = judge(run["one"], run["merged"])
    worst = max(
        (t["rel_l2"] for t in report["per_tensor"] if t.get("rel_l2") is not None), default=0
    )
    print(f"{case}: {report['verdict']}, worst relative L2 {worst:.2g}")
    assert code == 0, report["first_violation"]
    d = report["decisions"]
    assert d["compared"] == d["reference_count"] > 0 and d["differing"] == 0, d
    assert report["first_decision_divergence"] is None
    one, merged = tg.Trace(str(run["one"])), tg.Trace(str(run["merged"]))
    assert merged.names == one.names  # every point of the unsharded run, none extra
    assert list(merged.decisions) == list(one.decisions)


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_says_what_it_holds(runs, case):
    """The kinds each rank recorded (distributed.py's docstring says why): heads sliced (with
    Qwen3.5's output gate), expert outputs partial under tp and whole experts under ep,
    everything else replicated (a Qwen3.5 linear-attention layer too: transformers' plan leaves
    it whole); and the provenance that makes the ranks one run."""
    run = runs(case)
    kinds = [shards(p) for p in run["ranks"]]
    provs = [tg.Trace(str(p)).provenance for p in run["ranks"]]
    for r, (held, prov) in enumerate(zip(kinds, provs, strict=True)):
        for name, shard in held.items():
            point = name.split(".")[-1] if ".expert." not in name else "expert"
            kind = shard.split(";", 1)[1].split(";")[0]
            want = {
                "q": "slice",
                "k": "slice",
                "v": "slice",
                "attn_probs": "slice",
                "attn_gate": "slice",
                "expert": "experts" if CASES[case][1].startswith("ep") else "partial",
            }.get(point, "replicated")
            if ".linear." in name:
                want = "replicated"
            assert shard.startswith(f"rank={r}/2;") and kind == want, (name, shard)
        assert prov["distributed"]["spec"] == CASES[case][1]
        assert (prov["distributed"]["backend"], prov["distributed"]["world_size"]) == ("gloo", 2)
        assert prov["distributed"]["rank"] == r
    assert provs[0]["run_id"] == provs[1]["run_id"]
    if CASES[case][1] == "ep=2":  # rank 0 holds experts 0-3 of 8, rank 1 experts 4-7
        for r, held in enumerate(kinds):
            experts = {int(n.split(".")[3]) for n in held if ".expert." in n}
            assert experts and experts <= set(range(4 * r, 4 * r + 4)), (r, experts)
            assert all(
                f"experts;held={','.join(map(str, range(4 * r, 4 * r + 4)))};of=8" in s
                for n, s in held.items()
                if ".expert." in n
            )


def _planted(run, tmp_path, name, delta) -> Path:
    """Rank 1's trace with `delta` added to element 0 of its shard of tensor `name`."""

    def tensor(n, a):
        if n != name:
            return a
        a = np.array(a, copy=True)
        a.flat[0] += delta
        return a

    return copy_trace(run["ranks"][1], tmp_path / "rank1-planted.trace", tensor=tensor)


@pytest.mark.parametrize(
    "case, name",
    [("qwen3-tp2", "layer.01.q"), ("moe-tp2", "layer.01.expert.005.out")],
    ids=["head-slice", "expert-partial"],
)
def test_a_defect_in_one_ranks_shard_is_caught_and_named(runs, case, tmp_path, name):
    """The negative control: one element of rank 1's slice (or partial summand) moved by 0.05;
    the merge takes it (it is well-formed) and trace-diff names the tensor."""
    run = runs(case)
    assert name in shards(run["ranks"][1])
    bad = _planted(run, tmp_path, name, np.float32(0.05))
    m = merge(run["ranks"][0], bad, out=tmp_path / "merged.trace")
    assert m.returncode == 0, m.stderr
    code, report = judge(run["one"], tmp_path / "merged.trace")
    assert code == 1 and report["first_violation"]["tensor"] == name, report["first_violation"]


def test_a_replica_that_differs_on_one_rank_is_refused_by_the_merge(runs, tmp_path):
    run = runs("qwen3-tp2")
    bad = _planted(run, tmp_path, "layer.02.attn_out", np.float32(1e-6))
    m = merge(run["ranks"][0], bad, out=tmp_path / "merged.trace")
    assert m.returncode == 2 and "layer.02.attn_out" in m.stderr, m.stderr
    assert not (tmp_path / "merged.trace").exists()


def test_ranks_of_another_run_are_refused_by_the_merge(runs, tmp_path):
    run = runs("qwen3-tp2")
    other = copy_trace(
        run["ranks"][1], tmp_path / "r1.trace", edit=lambda p: {**p, "run_id": "another"}
    )
    m = merge(run["ranks"][0], other, out=tmp_path / "merged.trace")
    assert m.returncode == 2 and "run_id" in m.stderr, m.stderr


# ---------------------------------------------------------------------------------------------
# refusals: one line, exit 2


@pytest.mark.parametrize(
    "fixture, spec, out, msg",
    [
        ("tiny-qwen3", "tp=2", "o.trace", "with --distributed tp=2 each rank writes its own trace"),
        (
            "tiny-qwen3",
            None,
            "o{rank}.trace",
            "{rank} names a rank's trace, only with --distributed",
        ),
        (
            "tiny-diffusion-gemma",
            "tp=2",
            "o{rank}.trace",
            "--distributed tp=2: not for diffusion_gemma",
        ),
    ],
    ids=["no-rank-field", "rank-field-alone", "diffusion-gemma"],
)
def test_refused_in_one_line(tmp_path, fixture, spec, out, msg):
    flags = ("--distributed", spec) if spec else ()
    r = oracle(
        "trace", "--model", FIX / fixture, "--tokens", "3,4", *flags, "--out", tmp_path / out
    )
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert msg in r.stderr, r.stderr


@pytest.mark.parametrize("spec", ["tp=1", "tp=x", "pp=2", "tp=02"])
def test_a_malformed_distributed_is_refused(tmp_path, spec):
    r = oracle(
        "trace", "--model", FIX / "tiny-qwen3", "--tokens", "3", "--distributed", spec,
        "--out", tmp_path / "o{rank}.trace",
    )  # fmt: skip
    assert r.returncode == 2 and "argument --distributed" in r.stderr.splitlines()[-1], r.stderr


@pytest.mark.parametrize(
    "fixture, spec, msg",
    [
        # one key/value head cannot be split over two ranks: transformers' attention would fail
        (
            "tiny-gemma3",
            "tp=2",
            "rank 0/2: --distributed tp=2: transformers cannot shard Gemma3ForCausalLM",
        ),
        # a dense model has no expert-parallel plan: transformers' own refusal, named
        ("tiny-qwen3", "ep=2", "transformers cannot shard Qwen3ForCausalLM (qwen3)"),
    ],
    ids=["gemma3-one-kv-head", "dense-ep"],
)
def test_what_transformers_cannot_shard_is_refused_naming_the_class(tmp_path, fixture, spec, msg):
    r = oracle(
        "trace", "--model", FIX / fixture, "--tokens", "3,4", "--distributed", spec,
        "--out", tmp_path / "o{rank}.trace",
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert msg in r.stderr, r.stderr
    assert not list(tmp_path.iterdir())  # no rank wrote a trace


# ---------------------------------------------------------------------------------------------
# the launcher


def _script(tmp_path, body: str) -> Path:
    p = tmp_path / "rank.py"
    p.write_text("import os, sys, time\nrank = int(os.environ['RANK'])\n" + body)
    return p


def test_a_rank_that_fails_is_named(tmp_path):
    s = _script(tmp_path, "if rank == 1:\n    raise RuntimeError('planted failure')\n")
    with pytest.raises(OracleError, match=r"^rank 1/2: failed: RuntimeError: planted failure$"):
        distributed.run_ranks([str(s)], 2, timeout=120)


def test_a_hung_rank_is_killed_after_the_timeout(tmp_path):
    s = _script(tmp_path, "if rank == 1:\n    open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                "    time.sleep(3600)\n")  # fmt: skip
    pid_file = tmp_path / "pid"
    with pytest.raises(OracleError, match=r"did not finish within 20 s .* killed"):
        distributed.run_ranks([str(s), str(pid_file)], 2, timeout=20)
    pid = int(pid_file.read_text())
    for _ in range(50):  # the hung rank is gone, not left behind (once init has reaped it)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    pytest.fail(f"rank 1 (pid {pid}) still runs after the launcher's timeout")


def test_an_expert_routed_to_but_not_seen_on_its_rank_is_an_error():
    """The excuse for a rank with no expert tensors (none of its experts got a row) cannot hide
    a tap that saw nothing: an expert the router sent rows to, held here, must have computed."""
    from tracegate_oracle.records import Decision
    from tracegate_oracle.taps import Tap

    class Held:  # a rank holding experts 4..7 of layer 1 (what Sharding.experts says under ep)
        def experts(self, L):
            return "experts;held=4,5,6,7;of=8", range(4, 8)

    class Seen:  # the experts tap, having seen no expert compute
        outs = {}

    tap = Tap.__new__(Tap)
    tap.sharding, tap.notes, tap.records = Held(), [], []
    tap.decisions = [Decision("layer.01.router.topk", np.array([[0, 1], [2, 3]]), None)]
    tap._on_experts(1, Seen())  # routed only to rank 0's experts: nothing to see here
    assert tap.records == []
    tap.decisions = [Decision("layer.01.router.topk", np.array([[0, 5], [2, 3]]), None)]
    with pytest.raises(RuntimeError, match="expert 5, held on this rank"):
        tap._on_experts(1, Seen())
