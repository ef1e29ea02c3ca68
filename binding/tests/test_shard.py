"""The `shard` attribute from Python (docs/trace-format.md, "Sharded traces"): written as the
keyword `shard=` of `TraceWriter.tensor`, checked by the Rust writer (grammar and the registry's
ways for each point), read back, parsed by `tracegate.parse_shard`; and two rank traces written
here merged by `trace-merge`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import tracegate
from tracegate import names

ROOT = Path(__file__).resolve().parents[2]
PROVENANCE = {"producer": "python-port", "prompt_tokens": [3, 17, 5], "weights_digest": "0" * 32}


def _bin(name: str) -> Path | None:
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    path = Path(ROOT, target, "release", name)  # a relative target: from the root
    return path if os.access(path, os.X_OK) else None


def test_a_shard_keyword_is_written_read_and_parsed(tmp_path):
    q = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    value = "rank=1/2;slice;axis=1;offset=2;length=2;size=4"
    with tracegate.TraceWriter(tmp_path / "r1.trace", PROVENANCE) as w:
        w.tensor("layer.00.q", q, path="prefill", positions=[0, 1, 2], shard=value)
    t = tracegate.Trace(tmp_path / "r1.trace")
    assert t.attributes("layer.00.q")["shard"] == value
    assert tracegate.parse_shard(value) == {
        "rank": 1,
        "world": 2,
        "kind": "slice",
        "axis": 1,
        "offset": 2,
        "length": 2,
        "size": 4,
    }
    assert tracegate.parse_shard("rank=0/2;experts;held=0,1;of=4") == {
        "rank": 0,
        "world": 2,
        "kind": "experts",
        "held": [0, 1],
        "of": 4,
    }


@pytest.mark.parametrize(
    ("name", "shape", "value", "words"),
    [
        # Malformed: a leading zero, a rank past the world size.
        ("layer.00.attn_out", (3, 4), "rank=01/2;partial", ["leading zeros"]),
        ("layer.00.attn_out", (3, 4), "rank=2/2;partial", ["not below the world size 2"]),
        # Well formed, but not a way the registry lets this point be held.
        ("layer.00.hidden_in", (3, 4), "rank=0/2;partial", ["may be sharded only as replicated"]),
        ("layer.00.q", (3, 2, 4), "rank=0/2;slice;axis=2;offset=0;length=4;size=8", ["axis 1"]),
        # A slice whose length is not the tensor's along its axis.
        ("layer.00.q", (3, 2, 4), "rank=0/2;slice;axis=1;offset=0;length=1;size=4", ["length 1"]),
    ],
)
def test_a_refused_shard_is_one_line_naming_tensor_and_value(tmp_path, name, shape, value, words):
    with tracegate.TraceWriter(tmp_path / "t.trace", PROVENANCE) as w:
        with pytest.raises(tracegate.TraceError) as e:
            w.tensor(name, np.zeros(shape, np.float32), shard=value)
        message = str(e.value)
        assert "\n" not in message
        for word in [name, value, *words]:
            assert word in message, message
        # Negative control: the writer goes on, and the same tensor replicated is written.
        w.tensor(name, np.zeros(shape, np.float32), shard="rank=0/2;replicated")
    assert tracegate.Trace(tmp_path / "t.trace").attributes(name)["shard"] == "rank=0/2;replicated"
    with pytest.raises(tracegate.TraceError, match="rank=1/1;partial"):
        tracegate.parse_shard("rank=1/1;partial")


def test_the_registry_says_how_each_point_may_be_sharded():
    assert names.point("layer.00.q").shard == {"slice_axis": 1, "partial": False, "experts": False}
    assert names.point("layer.00.attn_probs").shard["slice_axis"] == 0
    assert names.point("decode.0001.layer.00.attn_out").shard["partial"] is True
    assert names.point("layer.00.expert.003.out").shard["experts"] is True
    assert names.point("layer.00.hidden_in").shard == {
        "slice_axis": None,
        "partial": False,
        "experts": False,
    }


def test_two_python_rank_traces_merge_with_trace_merge(tmp_path):
    merge = _bin("trace-merge")
    if merge is None:
        pytest.skip("trace-merge not built (cargo build --release --bins)")
    rng = np.random.default_rng(53)
    x = rng.standard_normal((3, 4), dtype=np.float32)
    w = rng.standard_normal((4, 6), dtype=np.float32)
    for rank in (0, 1):
        half = slice(2 * rank, 2 * rank + 2)
        with tracegate.TraceWriter(tmp_path / f"r{rank}.trace", PROVENANCE) as tw:
            tw.tensor("x", x, shard=f"rank={rank}/2;replicated")
            # A row-parallel product: each rank's half of the reduction.
            tw.tensor("layer.00.attn_out", x[:, half] @ w[half, :], shard=f"rank={rank}/2;partial")
            tw.tensor(
                "logits",
                (x @ w)[:, 3 * rank : 3 * rank + 3],
                shard=f"rank={rank}/2;slice;axis=1;offset={3 * rank};length=3;size=6",
            )
    out = tmp_path / "merged.trace"
    p = subprocess.run(
        [merge, tmp_path / "r1.trace", tmp_path / "r0.trace", "--out", out],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "(rank 0 + rank 1)" in p.stdout
    t = tracegate.Trace(out)
    assert t.names == ["x", "layer.00.attn_out", "logits"]
    np.testing.assert_array_equal(t["x"], x)
    np.testing.assert_array_equal(t["logits"], (x @ w))
    parts = [x[:, 2 * r : 2 * r + 2] @ w[2 * r : 2 * r + 2, :] for r in (0, 1)]
    np.testing.assert_array_equal(t["layer.00.attn_out"], parts[0] + parts[1])
    assert "shard" not in t.attributes("logits")
    ranks = t.provenance["shards"]["ranks"]
    assert [r["digest"] for r in ranks] == [
        tracegate.Trace(tmp_path / f"r{r}.trace").digest for r in (0, 1)
    ]
    # Negative control: rank 1 of another prompt is refused, in one line naming it.
    other = dict(PROVENANCE, prompt_tokens=[3, 17, 6])
    with tracegate.TraceWriter(tmp_path / "r1.trace", other) as tw:
        tw.tensor("x", x, shard="rank=1/2;replicated")
    p = subprocess.run(
        [merge, tmp_path / "r0.trace", tmp_path / "r1.trace", "--out", tmp_path / "bad.trace"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "rank 1" in p.stderr and "prompt_tokens" in p.stderr
    assert not (tmp_path / "bad.trace").exists()
