"""A test-only contract whose sharded mode is wrong in one way; `gate m2`'s negative controls run
it as `--contract-cmd` and it must fail the milestone (gate/tests/sharded.rs).

  sharded_plants.py --defect NAME {verb} {args}

Defects:
  skip-carry-decode  rank 1 skips the ordered carry in a one-row step (a cached decode step):
                     it starts its partial sum from zero and the result is its own partial plus
                     the carried one, not the carry continued (docs/numerics.md §23.3); the
                     prefill is correct
  replicated         every rank computes the whole model (the contract's one-process run) and
                     writes every tensor whole, marked `replicated`: merged, it is the one-process
                     trace bit for bit, so only what each rank holds shows the run was not split
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import uuid

CARRY_STEP = "lambda acc: ops.matmul(x, wt, bias, acc)"
SKIP_IN_DECODE = (
    "lambda acc: acc + ops.matmul(x, wt, bias) if (self.rank == 1 and x.shape[0] == 1) "
    "else ops.matmul(x, wt, bias, acc)"
)


def planted(tmp: str) -> str:
    """A copy of the contract package with the carry skipped by rank 1 in decode."""
    import tracegate_contract

    src = os.path.dirname(tracegate_contract.__file__)
    dst = os.path.join(tmp, "tracegate_contract")
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    p = os.path.join(dst, "shard.py")
    text = open(p).read()
    if text.count(CARRY_STEP) != 1:
        print("sharded_plants: the carry's step is not found once in shard.py", file=sys.stderr)
        sys.exit(3)
    with open(p, "w") as f:
        f.write(text.replace(CARRY_STEP, SKIP_IN_DECODE))
    return tmp


def replicated(argv: list[str]) -> int:
    """The one-process run, written whole on every rank."""
    import tracegate
    from tracegate_contract.__main__ import main

    args = list(argv)
    i = args.index("--shards")
    world = int(args[i + 1].split("=")[1])
    del args[i : i + 2]
    j = args.index("--out")
    pattern = args[j + 1]
    with tempfile.TemporaryDirectory() as tmp:
        whole = os.path.join(tmp, "whole.trace")
        args[j + 1] = whole
        rc = main(args)
        if rc:
            return rc
        t = tracegate.Trace(whole)
        run_id = uuid.uuid4().hex
        for r in range(world):
            prov = {**t.provenance, "run_id": run_id}
            prov["shards"] = {"mode": "tp", "world": world, "rank": r}
            with tracegate.TraceWriter(pattern.replace("{rank}", str(r)), prov) as w:
                for name in t.names:
                    attrs = dict(t.attributes(name))
                    w.tensor(name, t[name], shard=f"rank={r}/{world};replicated", **attrs)
                for name, values in t.decisions.items():
                    w.decision(name, values, margins=t.margins[name])
    return 0


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] != ["--defect"] or len(argv) < 2:
        print("usage: sharded_plants.py --defect NAME VERB ARGS", file=sys.stderr)
        return 2
    defect, rest = argv[1], argv[2:]
    if defect == "replicated":
        return replicated(rest)
    if defect != "skip-carry-decode":
        print(f"sharded_plants: unknown defect {defect!r}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, planted(tmp))
        for m in [m for m in sys.modules if m.startswith("tracegate_contract")]:
            del sys.modules[m]
        from tracegate_contract.__main__ import main as contract

        return contract(rest)


if __name__ == "__main__":
    sys.exit(main())
