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

With `--engine-shards SPLIT` (tp=N|ep=N) the base is the engine itself, run with `--shards SPLIT`
(its own honest rank traces, docs/numerics.md §23), each rank's trace then copied with these
plants (its `layer` verb runs unsharded, as without):
  --expert-none RANK:E    RANK leaves expert E's tensors out, its held= lists intact (the
                          engine's ExpertNone: computed on no rank)
  --expert-unheld RANK:E  the same, and E left out of RANK's held= lists (held by no rank)
  --expert-twice RANK:E   RANK also writes expert E's tensors (its holder's) and lists E as held
  --expert-layer-none L   every rank leaves out every expert tensor of layer L (the merge holds
                          no rank to a layer with no expert tensor: the comparison must say it)

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


def expert_of(name: str):
    """E of `...layer.NN.expert.EEE.out`, else None."""
    parts = name.split(".")
    if "expert" in parts and parts[-1] == "out":
        return int(parts[parts.index("expert") + 1])
    return None


def with_held(shard: str, drop=(), add=()) -> str:
    """`shard` (`rank=R/W;experts;held=…;of=E`) with `drop` left out of its held= list and `add`
    put in."""
    fields = shard.split(";")
    for i, f in enumerate(fields):
        if f.startswith("held="):
            held = [int(x) for x in f[len("held=") :].split(",") if x]
            held = (set(held) - set(drop)) | set(add)
            fields[i] = "held=" + ",".join(str(x) for x in sorted(held))
    return ";".join(fields)


def engine_ranks(exe: str, split: str, argv: list, pattern: str, plants: dict) -> int:
    """The engine's own sharded run (`--shards split`), each rank's trace copied to `pattern`
    with the expert plants: {"none"|"unheld"|"twice": (rank, expert)}."""
    with tempfile.TemporaryDirectory() as tmp:
        theirs = os.path.join(tmp, "r{rank}.trace")
        argv = list(argv)
        argv[argv.index("--out") + 1] = theirs
        rc = subprocess.call([exe, *argv, "--shards", split], stdout=subprocess.DEVNULL)
        if rc:
            return rc
        world = int(split.split("=")[1])
        traces = [tracegate.Trace(theirs.replace("{rank}", str(r))) for r in range(world)]
        dropped = plants.pop("layer", None)
        dropped = None if dropped is None else f"layer.{dropped:02}.expert."
        if dropped is not None and not any(n.startswith(dropped) for t in traces for n in t.names):
            print(f"sharded_port: no tensor {dropped}* to leave out", file=sys.stderr)
            return 3
        for kind, (rank, e) in plants.items():
            if kind != "twice" and not any(expert_of(n) == e for n in traces[rank].names):
                print(f"sharded_port: rank {rank} wrote no tensor of expert {e}", file=sys.stderr)
                return 3
        twice = plants.get("twice")
        # The doubled expert's tensors by layer prefix, from the rank that holds them.
        doubled = {}
        if twice is not None:
            for t in traces:
                for n in t.names:
                    if expert_of(n) == twice[1]:
                        doubled[n.split("expert.")[0]] = (t, n)
            if not doubled or any(expert_of(n) == twice[1] for n in traces[twice[0]].names):
                print(
                    f"sharded_port: no rank but {twice[0]} wrote expert {twice[1]}", file=sys.stderr
                )
                return 3
        for rank, t in enumerate(traces):
            left_out = {plants[k][1] for k in ("none", "unheld") if plants.get(k, (-1,))[0] == rank}
            unheld = plants.get("unheld", (-1, -1))
            added = twice[1] if twice is not None and twice[0] == rank else None
            with tracegate.TraceWriter(pattern.replace("{rank}", str(rank)), t.provenance) as w:
                for name in t.names:
                    attrs = dict(t.attributes(name))
                    shard = attrs.pop("shard")
                    if expert_of(name) is not None:
                        if expert_of(name) in left_out or (dropped and name.startswith(dropped)):
                            continue
                        if rank == unheld[0]:
                            shard = with_held(shard, drop=[unheld[1]])
                        if added is not None:
                            shard = with_held(shard, add=[added])
                    w.tensor(name, np.array(t[name]), shard=shard, **attrs)
                    if added is not None and name.endswith("router.logits"):
                        # The doubled expert right after its layer's router, with this rank's
                        # held= list (its first expert tensor's, or one built from it).
                        prefix = name[: -len("router.logits")]
                        if prefix in doubled:
                            src, n = doubled[prefix]
                            a = dict(src.attributes(n))
                            theirs_shard = a.pop("shard")
                            mine = next(
                                (
                                    dict(t.attributes(m))["shard"]
                                    for m in t.names
                                    if expert_of(m) is not None
                                ),
                                theirs_shard,
                            )
                            mine = with_held(mine, add=[added])
                            w.tensor(n, np.array(src[n]), shard=mine, **a)
                for name, values in t.decisions.items():
                    w.decision(name, np.array(values), margins=t.margins[name])
    return 0


def main() -> int:
    argv = sys.argv[1:]
    exe, world, wrong, perturb, skip, say = None, 2, None, [], None, None
    skip_carry, partials, no_layer = None, False, False
    engine_split, expert_plants = None, {}
    experts = {"--expert-none": "none", "--expert-unheld": "unheld", "--expert-twice": "twice"}
    experts["--expert-layer-none"] = "layer"
    flags = ("--exe", "--world", "--wrong-offset", "--perturb", "--skip", "--say-world")
    flags = (*flags, "--skip-carry", "--engine-shards", *experts)
    while argv and argv[0] in (*flags, "--partials", "--no-layer"):
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
        elif flag == "--engine-shards":
            engine_split = value
        elif flag == "--expert-layer-none":
            expert_plants["layer"] = int(value)
        elif flag in experts:
            rank, _, e = value.partition(":")
            expert_plants[experts[flag]] = (int(rank), int(e))
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
    if engine_split is not None:
        return engine_ranks(exe, engine_split, argv, pattern, expert_plants)
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
