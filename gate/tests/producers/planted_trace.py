"""Test-only producer: a real producer (the contract or the oracle) whose finished trace is then
rewritten with one planted defect, so the gate's tests can show that each check catches it.

    python gate/tests/producers/planted_trace.py --base contract|oracle EDIT... {verb|serve} {args}

Served (`serve`), one worker answers every request with the same edits, each as the per-call
process would (docs/producers.md, "Serving").

Edits, of the `trace` verb's output only (the `layer` verb is the base's, unchanged); each may
repeat, and the trace must hold what it names:
  --push TENSOR     the first element of TENSOR moved far outside any policy (x -> 1000 * (|x| + 1))
  --nudge TENSOR    the first element of TENSOR moved by one f32 ULP (towards +inf)
  --flip DECISION   the first value of DECISION changed (v -> v ^ 1): another token or expert
  --drop TENSOR     TENSOR left out of the trace
  --attr TENSOR     an extra attribute `note=""` added on TENSOR (its bytes unchanged)
  --margins VALUE   every margin of every decision set to VALUE (decision values unchanged)
  --bits TENSOR=HEX the first element of the f32 TENSOR given these bits (0x80000000 is -0,
                    0x7fc00001 a NaN with another payload, 0xff800000 -inf)
  --near-tie ROW    logits row ROW's runner-up raised above its top logit by half their gap, and
                    logits.argmax row ROW set to it with the margin of the edited row: a flip the
                    moved logit explains (a near-tie)
  --far-flip ROW    the same moved runner-up, but logits.argmax row ROW set to the row's lowest
                    logit (its margin recomputed): a flip no movement of that size explains,
                    which a near-tie rule that believed the recorded margin would excuse

--flip leaves the margin as recorded: the decision no longer follows its scores, and where the
trace holds them its margin contradicts them.

Not for real use.
"""

import os
import sys
import tempfile

import numpy as np
import tracegate


def base_main(base: str):
    if base == "contract":
        from tracegate_contract.__main__ import main
    elif base == "oracle":
        from tracegate_oracle.cli import main
    else:
        raise SystemExit(f"--base {base!r}: expected contract or oracle")
    return main


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] != ["--base"] or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    run = base_main(argv[1])
    argv = argv[2:]
    edits = {
        "--push": [],
        "--nudge": [],
        "--flip": [],
        "--drop": [],
        "--attr": [],
        "--margins": [],
        "--near-tie": [],
        "--far-flip": [],
        "--bits": [],
    }
    while argv and argv[0] in edits:
        edits[argv[0]].append(argv[1])
        argv = argv[2:]
    if argv == ["serve"]:
        from tracegate.serve import serve

        argv0, words = sys.argv[0], sys.argv[1:-1]  # the per-call words before the verb

        def request(req: list[str]) -> int:
            sys.argv = [argv0, *words, *req]  # as the per-call process sees it
            return answer(run, edits, list(req))

        return serve(request, argv0)
    return answer(run, edits, argv)


def answer(run, edits: dict, argv: list[str]) -> int:
    """One run of the verb in `argv`, with the trace verb's output edited."""
    if argv[0] != "trace":
        return run(argv)
    out = argv[argv.index("--out") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean.trace")
        argv[argv.index("--out") + 1] = clean
        rc = run(argv)
        if rc:
            return rc
        t = tracegate.Trace(clean)
        # The trace must hold what is to be edited: a test that edits nothing proves nothing.
        for name in (
            edits["--push"]
            + edits["--nudge"]
            + edits["--drop"]
            + edits["--attr"]
            + ["logits"] * bool(edits["--near-tie"] or edits["--far-flip"])
            + [b.split("=")[0] for b in edits["--bits"]]
        ):
            if name not in t.names:
                print(f"planted_trace: no tensor {name} to edit", file=sys.stderr)
                return 3
        for name in edits["--flip"]:
            if name not in t.decisions:
                print(f"planted_trace: no decision {name} to flip", file=sys.stderr)
                return 3
        near_ties = {}  # logits row -> the new argmax: its runner-up (or lowest, --far-flip)
        new_margins = {}  # logits row -> the margin of the new choice in the edited row
        with tracegate.TraceWriter(out, t.provenance) as w:
            for name in t.names:
                if name in edits["--drop"]:
                    continue
                array = np.array(t[name])
                flat = array.reshape(-1)
                if name in edits["--push"]:
                    flat[0] = 1000 * (abs(flat[0]) + 1)
                if name in edits["--nudge"]:
                    flat[0] = np.nextafter(flat[0], np.float32(np.inf))
                for b in edits["--bits"]:
                    tensor, bits = b.split("=")
                    if tensor == name:
                        flat.view(np.uint32)[0] = int(bits, 16)
                if name == "logits":
                    far = set(map(int, edits["--far-flip"]))
                    for row in map(int, edits["--near-tie"] + edits["--far-flip"]):
                        order = np.argsort(-array[row], kind="stable")
                        top, second = order[:2]
                        array[row, second] = (
                            array[row, top] + (array[row, top] - array[row, second]) / 2
                        )
                        choice = int(order[-1] if row in far else second)
                        near_ties[row] = choice
                        others = np.delete(array[row], choice)
                        new_margins[row] = np.float32(array[row, choice] - others.max())
                attrs = dict(t.attributes(name))
                if name in edits["--attr"]:
                    attrs["note"] = ""
                w.tensor(name, array, **attrs)
            for name, values in t.decisions.items():
                values = np.array(values)
                if name in edits["--flip"]:
                    flat = values.reshape(-1)
                    flat[0] ^= 1
                margins = t.margins[name]
                if name == "logits.argmax":
                    margins = None if margins is None else np.array(margins, dtype=np.float32)
                    for row, choice in near_ties.items():
                        values[row] = choice
                        if margins is not None:
                            margins[row] = new_margins[row]
                if edits["--margins"] and margins is not None:
                    margins = np.full_like(
                        np.asarray(margins), float(edits["--margins"][-1]), dtype=np.float32
                    )
                w.decision(name, values, margins=margins)
    return 0


if __name__ == "__main__":
    sys.exit(main())
