"""Test-only sharded port: another producer (the example producer) run as one process, its `trace`
output written as WORLD rank traces with tracegate.TraceWriter and honest `shard` attributes
(docs/producers.md, "Sharded engines"): the heads of q/k/v/attn_gate (axis 1) and attn_probs
(axis 0) and the vocabulary of logits (axis 1) sliced in contiguous blocks, attn_out and mlp_out
partial (rank 0 the value, every other rank -0.0, which adds exactly: x + -0.0 is x, -0.0
included), everything else replicated.

    python gate/tests/producers/sharded_port.py --exe PATH [--world W] [PLANT...] {verb} {args}

`--out` must hold `{rank}`; rank r's trace goes there with `{rank}` replaced by r. Plants (each a
defect a sharded port could have, for the gate to name):
  --wrong-offset RANK     RANK's slices written at offset 0 (the blocks overlap)
  --perturb RANK:TENSOR   RANK's shard of TENSOR with its first element moved by 1.0
  --skip RANK             RANK writes no trace
  --say-world N           every rank's `shard` says world size N (the files are still WORLD)
  --skip-carry RANK:TENSOR  in a cached run (`--cache on`) only, TENSOR (a decode step's partial
                          sum) recorded as the carry's result, replicated, but RANK's copy its
                          own partial (its first element moved by 1.0): a rank that skips the
                          all-reduce in cached decode, the prefill and the uncached run right
  --partials              every partial sum split into real summands (rank r < WORLD-1 holds
                          x*0.37/(WORLD-1) rounded, the last rank the rest): reduced in rank
                          order they differ from x by rounding, another order within f32

  --no-layer              the `layer` verb is not answered (exit 2): a port that only shards

The `layer` verb is otherwise the base's, unchanged (unsharded). Not for real use.
"""

import os
import subprocess
import sys
import tempfile

import numpy as np
import tracegate

# The points sliced, and along which axis (docs/trace-format.md, "Sharded traces").
SLICED = {"q": 1, "k": 1, "v": 1, "attn_gate": 1, "attn_probs": 0}
PARTIAL = ("attn_out", "mlp_out")


def how(name: str):
    """(kind, axis) of a tensor by its point: ("slice", axis), ("partial", None) or
    ("replicated", None)."""
    if name == "logits" or (name.startswith("decode.") and name.endswith(".logits")):
        return "slice", 1
    point = name.rsplit(".", 1)[-1]
    if name.startswith("layer.") and ".expert." not in name:
        if point in SLICED:
            return "slice", SLICED[point]
        if point in PARTIAL:
            return "partial", None
    if name.startswith("decode.") and point in PARTIAL:
        return "partial", None
    return "replicated", None


def blocks(size: int, world: int):
    """Contiguous blocks tiling 0..size, the first ones one longer when it does not divide."""
    base, extra = divmod(size, world)
    out, start = [], 0
    for r in range(world):
        n = base + (1 if r < extra else 0)
        out.append((start, n))
        start += n
    return out


def summand(x, rank: int, world: int):
    """Rank `rank`'s summand of x: x*0.37/(world-1) rounded to f32 on every rank but the last,
    which holds x minus the others' (in f32, left to right)."""
    x = x.astype(np.float32)
    if world == 1:
        return x
    share = (x * np.float32(0.37 / (world - 1))).astype(np.float32)
    if rank < world - 1:
        return share
    rest = x
    for _ in range(world - 1):
        rest = (rest - share).astype(np.float32)
    return rest


def main() -> int:
    argv = sys.argv[1:]
    exe, world, wrong, perturb, skip, say = None, 2, None, [], None, None
    skip_carry, partials, no_layer = None, False, False
    flags = ("--exe", "--world", "--wrong-offset", "--perturb", "--skip", "--say-world")
    while argv and argv[0] in (*flags, "--skip-carry", "--partials", "--no-layer"):
        if argv[0] in ("--partials", "--no-layer"):
            partials = partials or argv[0] == "--partials"
            no_layer = no_layer or argv[0] == "--no-layer"
            argv = argv[1:]
            continue
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--exe":
            exe = value
        elif flag == "--world":
            world = int(value)
        elif flag == "--wrong-offset":
            wrong = int(value)
        elif flag == "--perturb":
            rank, _, tensor = value.partition(":")
            perturb.append((int(rank), tensor))
        elif flag == "--skip":
            skip = int(value)
        elif flag == "--skip-carry":
            rank, _, tensor = value.partition(":")
            skip_carry = (int(rank), tensor)
        else:
            say = int(value)
    if exe is None or not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "layer" and no_layer:
        print("sharded_port: no layer verb (this port runs sharded only)", file=sys.stderr)
        return 2
    if argv[0] != "trace":
        return subprocess.call([exe, *argv])
    pattern = argv[argv.index("--out") + 1]
    if "{rank}" not in pattern:
        print(f"sharded_port: --out {pattern} holds no {{rank}}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        whole = os.path.join(tmp, "whole.trace")
        argv[argv.index("--out") + 1] = whole
        rc = subprocess.call([exe, *argv], stdout=subprocess.DEVNULL)
        if rc:
            return rc
        t = tracegate.Trace(whole)
        cached = "--cache" in argv and argv[argv.index("--cache") + 1] == "on"
        if skip_carry is not None and skip_carry[1] not in t.names:
            print(f"sharded_port: no tensor {skip_carry[1]} to skip the carry of", file=sys.stderr)
            return 3
        carry = skip_carry if cached else None
        for _, tensor in perturb:
            if tensor not in t.names:  # a plant of nothing proves nothing
                print(f"sharded_port: no tensor {tensor} to perturb", file=sys.stderr)
                return 3
        said = world if say is None else say
        for rank in range(world):
            if rank == skip:
                continue
            with tracegate.TraceWriter(
                pattern.replace("{rank}", str(rank)), dict(t.provenance)
            ) as w:
                for name in t.names:
                    array = np.array(t[name])
                    kind, axis = how(name)
                    if kind == "slice":
                        offset, length = blocks(array.shape[axis], world)[rank]
                        part = np.take(array, range(offset, offset + length), axis=axis)
                        at = 0 if rank == wrong else offset
                        shard = f"slice;axis={axis};offset={at};length={length};size={array.shape[axis]}"
                    elif carry is not None and name == carry[1]:
                        part, shard = array.copy(), "replicated"
                        if rank == carry[0]:
                            part.reshape(-1)[0] += np.float32(1.0)
                    elif kind == "partial" and partials:
                        part, shard = summand(array, rank, world), "partial"
                    elif kind == "partial":
                        part = array if rank == 0 else np.full_like(array, -0.0)
                        shard = "partial"
                    else:
                        part, shard = array, "replicated"
                    part = np.ascontiguousarray(part)
                    if (rank, name) in perturb:
                        part.reshape(-1)[0] += np.float32(1.0)
                    w.tensor(
                        name, part, shard=f"rank={rank}/{said};{shard}", **dict(t.attributes(name))
                    )
                for name, values in t.decisions.items():
                    w.decision(name, np.array(values), margins=t.margins[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
