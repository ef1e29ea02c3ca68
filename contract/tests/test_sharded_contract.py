"""The contract's sharded runs (docs/numerics.md §23): `trace --shards tp=W|ep=W` writes one
trace per rank, and `trace-merge` of them has the content digest of the one-process trace, on
the dense and MoE fixtures, a Qwen3.5-MoE layout with only full-attention layers (gated
attention, shared expert, attention biases) built here, and qwen2 (q/k/v biases only), with the
default and internal capture and generation with and without the cache.

That the rank traces really are ranks is checked apart from the digest (a run that computed
everything on every rank and wrote it replicated would merge to the same digest): the heads,
vocabulary and experts each rank records, and the weights each rank model holds.

Negative controls: the carry replaced by independent partial sums (what a real tensor-parallel
engine does, §23.3), everywhere or only on a one-row decode step, planted in a copy of the
contract and caught by the same comparison at the tensor where it first shows. The refusals
(§23.5, the --shards grammar, {rank} in --out) are one line, exit 2, nothing written.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from test_engine_identity import differences, planted_copy

from conftest import FIXTURES, ROOT, make_model_dir, release_binary

tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

from tracegate import names  # noqa: E402
from tracegate_contract import open_model, ops, shard  # noqa: E402
from tracegate_contract.__main__ import main  # noqa: E402

TRACE_MERGE, _NO_MERGE = release_binary("trace-merge")
needs_merge = pytest.mark.skipif(_NO_MERGE is not None, reason=_NO_MERGE or "built")

PROMPT = [3, 17, 5, 17, 9]  # short: the contract is slow; a repeated token
QWEN2 = os.path.join(ROOT, "fixtures", "tiny-qwen2")


def contract(model, out, *extra, src_root=None) -> subprocess.CompletedProcess:
    """The contract's CLI in a subprocess (so a planted copy runs the same way)."""
    env = dict(os.environ)
    if src_root is not None:  # the planted copy comes before the installed package
        env["PYTHONPATH"] = os.pathsep.join([src_root, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "tracegate_contract", "trace", "--model", model]
    cmd += ["--tokens", ",".join(map(str, PROMPT)), "--out", out, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)


def sharded_and_merged(tmp_path, model, shards, extra, src_root=None) -> tuple[str, list[str]]:
    """Runs `--shards` and merges the rank traces: (the merged trace, the rank traces)."""
    world = int(shards.partition("=")[2])
    pattern = str(tmp_path / "rank-{rank}.trace")
    r = contract(model, pattern, "--shards", shards, *extra, src_root=src_root)
    assert r.returncode == 0, f"sharded contract failed ({r.returncode}): {r.stderr.strip()}"
    ranks = [pattern.replace("{rank}", str(i)) for i in range(world)]
    # One `DIGEST PATH` line per rank trace, in rank order.
    lines = [ln.split(" ", 1) for ln in r.stdout.splitlines()]
    assert [p for _, p in lines] == ranks
    assert [d for d, _ in lines] == [tracegate.Trace(p).digest for p in ranks]
    merged = str(tmp_path / "merged.trace")
    m = subprocess.run(
        [TRACE_MERGE, *ranks, "--out", merged], capture_output=True, text=True, timeout=120
    )
    assert m.returncode == 0, f"trace-merge refused the rank traces: {m.stderr.strip()}"
    return merged, ranks


def one_process(tmp_path, model, extra) -> str:
    out = str(tmp_path / "one.trace")
    r = contract(model, out, *extra)
    assert r.returncode == 0, f"contract failed ({r.returncode}): {r.stderr.strip()}"
    return out


@pytest.fixture(scope="module")
def full_attention_moe(tmp_path_factory) -> str:
    """Qwen3.5-MoE with only full-attention layers (so it may be sharded): gated attention
    (§17), the shared expert (§19), attention biases, 4 experts (ep=2 divides them), 4 heads
    over 2 kv heads."""
    from test_qwen3_5_model import F, config, tensors, write

    c = config(moe=True, layer_types=[F, F], num_hidden_layers=2, num_experts=4)
    c["attention_bias"] = True
    return write(tmp_path_factory.mktemp("fullmoe"), c, tensors(c, seed=3))


CASES = [
    ("dense", "tp=2", ["--capture", "internals"]),
    ("qwen2", "tp=2", ["--generate", "3", "--cache", "off"]),
    ("moe", "tp=2", ["--generate", "3", "--cache", "on"]),
    ("moe", "ep=2", ["--capture", "internals", "--generate", "3", "--cache", "on"]),
    ("full-attention-moe", "tp=2", ["--capture", "internals", "--generate", "2"]),
    ("full-attention-moe", "ep=2", ["--capture", "internals", "--generate", "2"]),
]


def _model(which, request) -> str:
    if which == "full-attention-moe":
        return request.getfixturevalue("full_attention_moe")
    return QWEN2 if which == "qwen2" else FIXTURES[which]


@needs_merge
@pytest.mark.parametrize(
    "which,shards,extra", CASES, ids=[f"{w}-{s}-{' '.join(e)}" for w, s, e in CASES]
)
def test_merged_rank_traces_are_the_one_process_trace(tmp_path, request, which, shards, extra):
    model = _model(which, request)
    one = one_process(tmp_path, model, extra)
    merged, ranks = sharded_and_merged(tmp_path, model, shards, extra)
    assert differences(one, merged, "one process", "merged ranks") == []
    assert tracegate.Trace(merged).digest == tracegate.Trace(one).digest
    _check_ranks(ranks, one, shards)
    if which == "full-attention-moe":  # what this layout is here for
        assert {"layer.00.attn_gate", "layer.01.shared_expert.out"} <= set(
            tracegate.Trace(one).names
        )


def _check_ranks(ranks: list[str], one: str, shards: str) -> None:
    """Each rank trace is one rank's: every tensor names it, slices and experts are the rank's
    blocks (and not the whole tensor), provenance ties the ranks into one run of the same
    prompt and weights as the one-process trace."""
    mode, world = shards.split("=")[0], len(ranks)
    u = tracegate.Trace(one)
    cfg = open_model(u.provenance["model_dir"]).cfg
    experts_on: dict[str, int] = {}
    run_ids = set()
    for r, path in enumerate(ranks):
        t = tracegate.Trace(path)
        t.verify()
        p = t.provenance
        assert p["shards"] == {"mode": mode, "world": world, "rank": r}
        run_ids.add(p["run_id"])
        for key in ("prompt_tokens", "weights_digest", "capture", "generate", "cache"):
            assert p[key] == u.provenance[key], key
        for name in t.names:
            s = tracegate.parse_shard(t.attributes(name)["shard"])
            assert (s["rank"], s["world"]) == (r, world), name
            n = names.parse(name)
            point = n.point if n.layer is not None or n.point == "logits" else "model-wide"
            if s["kind"] == "slice":
                size = {"logits": cfg.vocab_size, "k": cfg.num_key_value_heads}.get(
                    point, cfg.num_key_value_heads if point == "v" else cfg.num_attention_heads
                )
                lo, hi = shard.block(size, r, world)
                assert (s["offset"], s["length"], s["size"]) == (lo, hi - lo, size), name
                assert t[name].shape[s["axis"]] == hi - lo < u[name].shape[s["axis"]], name
            elif s["kind"] == "experts":
                assert mode == "ep" and n.expert is not None, name
                lo, hi = shard.block(cfg.num_experts, r, world)
                assert s["held"] == list(range(lo, hi)) and s["of"] == cfg.num_experts
                assert n.expert in s["held"], name
                assert name not in experts_on, f"{name} on ranks {experts_on[name]} and {r}"
                experts_on[name] = r
            else:
                assert s["kind"] == "replicated", name
                assert point not in ("q", "k", "v", "attn_gate", "attn_probs", "logits"), name
                assert n.expert is None or mode == "tp", name
        # What must be split is: logits always, the heads' points under internals.
        kinds = {n: tracegate.parse_shard(t.attributes(n)["shard"])["kind"] for n in t.names}
        assert kinds["logits"] == "slice"
        if "layer.00.q" in t.names:
            assert kinds["layer.00.q"] == kinds["layer.00.attn_probs"] == "slice"
    assert len(run_ids) == 1
    if mode == "ep" and u.provenance["capture"] == "internals":
        expert_names = {n for n in u.names if ".expert." in n}
        assert expert_names and set(experts_on) == expert_names
        assert len(set(experts_on.values())) == world  # every rank computed some expert


@needs_merge
def test_ranks_of_two_runs_do_not_merge(tmp_path):
    """Each run has its own run_id: rank 0 of one run and rank 1 of another (same prompt, same
    weights, same bits) are refused by trace-merge, naming run_id."""
    runs = []
    for name in ("a", "b"):
        pattern = str(tmp_path / f"{name}-{{rank}}.trace")
        r = contract(FIXTURES["dense"], pattern, "--shards", "tp=2")
        assert r.returncode == 0, r.stderr
        runs.append([pattern.replace("{rank}", str(i)) for i in range(2)])
    m = subprocess.run(
        [TRACE_MERGE, runs[0][0], runs[1][1], "--out", str(tmp_path / "m.trace")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert m.returncode == 2 and "run_id" in m.stderr, m.stderr
    assert not (tmp_path / "m.trace").exists()


# ---- negative controls ------------------------------------------------------------------------

# The carry's step in a row-parallel projection (shard.Place.row_parallel), and two plants:
# each rank begins its own partial sum from zero and adds it to the carried one (the independent
# partials of a real tensor-parallel engine), everywhere, or only where the projection has one
# row (a cached decode step of a dense model).
CARRY_STEP = "lambda acc: ops.matmul(x, wt, bias, acc)"
PARTIALS = "lambda acc: acc + ops.matmul(x, wt, bias)"
PARTIALS_IN_DECODE = (
    "lambda acc: acc + ops.matmul(x, wt, bias) if x.shape[0] == 1 else ops.matmul(x, wt, bias, acc)"
)
PLANTS = [
    ("dense", "tp=2", [], PARTIALS, "layer.00.attn_out"),
    (
        "dense",
        "tp=2",
        ["--generate", "3", "--cache", "on"],
        PARTIALS_IN_DECODE,
        "decode.0001.logits",
    ),
]


@needs_merge
@pytest.mark.parametrize(
    "which,shards,extra,new,expected", PLANTS, ids=["partial-sums", "partial-sums-in-decode"]
)
def test_a_planted_reduction_is_caught(tmp_path, which, shards, extra, new, expected):
    model = FIXTURES[which]
    one = one_process(tmp_path, model, extra)
    root = planted_copy(tmp_path, "shard.py", CARRY_STEP, new)
    merged, _ = sharded_and_merged(tmp_path, model, shards, extra, src_root=root)
    d = differences(one, merged, "one process", "planted ranks")
    assert d, "the planted reduction was not detected"
    assert d[0].startswith(expected + ":"), f"first difference expected at {expected}: {d[0]}"
    assert tracegate.Trace(merged).digest != tracegate.Trace(one).digest


# ---- the carry itself --------------------------------------------------------------------------


def _ranks_of(world: int) -> list[shard.Place]:
    carry = shard.Carry(world)
    return [shard.Place(r, world, "tp", carry) for r in range(world)]


def test_the_carry_is_the_one_process_loop_and_partials_are_not():
    """x·w over K = 4 split 1|1|2 over 3 ranks: 1e8 then 1 then −1e8 then 1. In order the 1 is
    lost against 1e8 and the last 1 survives: 1. Independent partials lose the other 1 too: 0."""
    x = np.array([[1e8, 1.0, -1e8, 1.0]], dtype=np.float32)
    wt = np.ones((4, 1), dtype=np.float32)
    places = _ranks_of(3)
    blocks = [(0, 1), (1, 2), (2, 4)]
    assert [shard.block(4, r, 3) for r in range(3)] == blocks
    got = shard.run_ranks(
        places[0]._carry,
        [
            lambda p=p, b=b: p.row_parallel(x[:, b[0] : b[1]], wt[b[0] : b[1]], None)
            for p, b in zip(places, blocks, strict=True)
        ],
    )
    whole = ops.matmul(x, wt)
    assert whole[0, 0] == 1.0
    for g in got:  # every rank holds the result, bit for bit
        assert g.view(np.uint32).tolist() == whole.view(np.uint32).tolist()
    partials = [ops.matmul(x[:, a:b], wt[a:b]) for a, b in blocks]
    assert ((partials[0] + partials[1]) + partials[2])[0, 0] == 0.0  # the control differs


def test_gather_is_rank_order_and_one_rank_holds_everything():
    places = _ranks_of(3)
    pieces = [np.full((2, n), r, dtype=np.float32) for r, n in enumerate((1, 0, 2))]
    got = shard.run_ranks(
        places[0]._carry,
        [lambda p=p, a=a: p.gather(a) for p, a in zip(places, pieces, strict=True)],
    )
    for g in got:
        assert g.tolist() == [[0, 2, 2], [0, 2, 2]]
    assert shard.ONE.gather(pieces[2]).tolist() == pieces[2].tolist()


def test_a_failing_rank_does_not_leave_the_others_waiting():
    """Rank 1 fails before the carry: rank 0 (waiting for its result) and rank 2 (waiting for
    rank 1's accumulator) give up, and rank 1's own error is raised."""
    places = _ranks_of(3)

    def body(p):
        if p.rank == 1:
            raise ValueError("rank 1 broke")
        return p.carry(np.zeros(1, np.float32), lambda acc: acc + np.float32(1))

    done = []
    t = threading.Thread(
        target=lambda: done.append(
            pytest.raises(
                ValueError, shard.run_ranks, places[0]._carry, [lambda p=p: body(p) for p in places]
            )
        ),
        daemon=True,
    )
    t.start()
    t.join(timeout=30)
    assert done, "run_ranks did not return: a rank was left waiting in the carry"
    assert "rank 1 broke" in str(done[0].value)


def test_each_rank_holds_only_its_share_of_the_weights():
    m = open_model(FIXTURES["moe"])
    c = m.cfg
    d, E = c.head_dim, c.num_experts
    tp = [m.share(p) for p in _ranks_of(2)]
    ep = [m.share(shard.Place(r, 2, "ep", shard.Carry(2))) for r in range(2)]
    for r, (a, b) in enumerate(zip(tp, ep, strict=True)):
        v0, v1 = shard.block(c.vocab_size, r, 2)
        for rank in (a, b):
            assert rank.head_t.shape == (c.hidden_size, v1 - v0)
            att = rank.layers[0].mixer
            assert (
                att.heads == c.num_attention_heads // 2
                and att.kv_heads == c.num_key_value_heads // 2
            )
            assert att.wo_t.shape == (att.heads * d, c.hidden_size)
            assert att.wqkv_t.shape[1] == (att.heads + 2 * att.kv_heads) * d
            dense = rank.layers[2].feed_forward  # mlp_only_layers [2]
            i0, i1 = shard.block(c.intermediate_size, r, 2)
            assert dense.wd_t.shape[0] == dense.inter == i1 - i0
        moe_tp, moe_ep = a.layers[0].feed_forward, b.layers[0].feed_forward
        assert all(x.wd_t.shape[0] == c.moe_intermediate_size // 2 for x in moe_tp.experts)
        e0, e1 = shard.block(E, r, 2)
        assert list(moe_ep.held) == list(range(e0, e1))
        assert [x is not None for x in moe_ep.experts] == [e0 <= e < e1 for e in range(E)]
        assert all(moe_ep.experts[e].wd_t.shape[0] == c.moe_intermediate_size for e in moe_ep.held)
    # The q/k/v columns of rank 1 are the one-process columns of its heads.
    full, r1 = m.layers[0].mixer, tp[1].layers[0].mixer
    nh, nkv = c.num_attention_heads, c.num_key_value_heads
    q = full.wqkv_t[:, nh // 2 * d : nh * d]
    k = full.wqkv_t[:, (nh + nkv // 2) * d : (nh + nkv) * d]
    v = full.wqkv_t[:, (nh + nkv + nkv // 2) * d :]
    assert np.array_equal(r1.wqkv_t, np.concatenate([q, k, v], axis=1))


# ---- refusals ----------------------------------------------------------------------------------


def _moe_five_experts(tmp_path) -> str:
    return make_model_dir(tmp_path / "moe5", "moe")  # 5 experts, 4 heads over 2 kv heads


REFUSALS = [
    ("gemma3", ["--shards", "tp=2"], "num_attention_heads 4 and num_key_value_heads 1"),
    ("moe5", ["--shards", "ep=2"], "num_experts 5 is not divisible by 2"),
    ("tiny-qwen3_5", ["--shards", "tp=2"], "linear-attention layers"),
    ("tiny-diffusion-gemma", ["--shards", "tp=2"], "diffusion_gemma is not sharded"),
    ("dense", ["--shards", "tp=0"], "must be ≥ 1"),
    ("dense", ["--shards", "tp=02"], "expected tp=N or ep=N"),
    ("dense", ["--shards", "dp=2"], "expected tp=N or ep=N"),
    ("dense", ["--shards", "tp=2,ep=2"], "expected tp=N or ep=N"),
    ("dense", ["--shards", "tp="], "expected tp=N or ep=N"),
    ("dense", ["--shards", "ep=2"], "no routed experts to split"),
    ("dense", ["--shards", "tp=3"], "num_attention_heads 4 and num_key_value_heads 2"),
    ("dense", ["--shards", "tp=2", "--out", "{dir}/plain.trace"], "put {rank} in the path"),
    ("dense", ["--out", "{dir}/r{rank}.trace"], "{rank} is only for a sharded run"),
    ("dense", ["--shards", "tp=2", "--force-decisions", "x.trace"], "not with --shards tp=2"),
]


@pytest.mark.parametrize(
    "which,argv,words", REFUSALS, ids=[f"{w}-{' '.join(a)}" for w, a, _ in REFUSALS]
)
def test_refusals_are_one_line_exit_2_and_write_nothing(tmp_path, capsys, which, argv, words):
    if which == "moe5":
        model = _moe_five_experts(tmp_path)
    elif which in FIXTURES:
        model = FIXTURES[which]
    else:
        model = os.path.join(ROOT, "fixtures", which)
    argv = [a.replace("{dir}", str(tmp_path)) for a in argv]
    out = [] if "--out" in argv else ["--out", str(tmp_path / "r{rank}.trace")]
    rc = main(["trace", "--model", model, "--tokens", "3,17,5", *out, *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("error: "), err
    assert words in err, err
    written = [f for f in os.listdir(tmp_path) if f.endswith(".trace")]
    assert written == [], written
