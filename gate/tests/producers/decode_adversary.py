"""Test-only producer: a candidate that records its decode steps the ways a real port can get
wrong, for `gate bisect --generate N`'s tests (docs/bisect.md, "Decode"). Its base is
defective_contract.py with one defect (`none`: the contract unchanged); the base's trace is
then rewritten with tracegate.TraceWriter:

    python gate/tests/producers/decode_adversary.py --base DEFECT EDIT... {verb} {args}

Edits (of the `trace` verb's output; the `layer` verb is the base's):
  --uncached other-prompt  a `--cache off` run records another prompt (its first token + 1) in
                           its provenance: that trace cannot be compared with the cached one
  --uncached no-decode     a `--cache off` run records no decode step (no decode.* tensor or
                           decision): there is nothing to compare
  --tokens-only            every decode.* tensor left out; the decode tokens (decode.SSSS.argmax)
                           are kept
  --flip-token S           decode.SSSS.argmax's value v -> v ^ 1: another token at step S
  --tie S=ref|cand         decode.SSSS.logits row 0's runner-up set just below its top logit
                           (ref) or just above it (cand, which then takes it), the decision and
                           its margin to match: the two sides meet in a near-tie at step S

Not for real use.
"""

import importlib.util
import os
import sys
import tempfile

import numpy as np
import tracegate

HERE = os.path.dirname(os.path.abspath(__file__))


def base(defect: str, argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(
        "defective_contract", os.path.join(HERE, "defective_contract.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main(["--defect", defect, *argv])


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] != ["--base"] or len(argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    defect, argv = argv[1], argv[2:]
    edits = {"--uncached": [], "--tokens-only": [], "--flip-token": [], "--tie": []}
    while argv and argv[0] in edits:
        if argv[0] == "--tokens-only":
            edits["--tokens-only"].append(True)
            argv = argv[1:]
        else:
            edits[argv[0]].append(argv[1])
            argv = argv[2:]
    if argv[0] != "trace":
        return base(defect, argv)
    uncached = "--cache" in argv and argv[argv.index("--cache") + 1] == "off"
    out = argv[argv.index("--out") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean.trace")
        argv[argv.index("--out") + 1] = clean
        rc = base(defect, argv)
        if rc:
            return rc
        t = tracegate.Trace(clean)
        prov = dict(t.provenance)
        drop_decode = bool(edits["--tokens-only"])
        keep_decisions = True
        if uncached and "other-prompt" in edits["--uncached"]:
            prov["prompt_tokens"] = [prov["prompt_tokens"][0] + 1, *prov["prompt_tokens"][1:]]
        if uncached and "no-decode" in edits["--uncached"]:
            drop_decode, keep_decisions = True, False
        ties = dict(e.split("=") for e in edits["--tie"])
        flips = {f"decode.{int(s):04d}.argmax" for s in edits["--flip-token"]}
        for name in flips | {f"decode.{int(s):04d}.argmax" for s in ties}:
            if name not in t.decisions:
                print(f"decode_adversary: no decision {name} to edit", file=sys.stderr)
                return 3
        tied = {}  # decision -> (new value, new margin)
        with tracegate.TraceWriter(out, prov) as w:
            for name in t.names:
                if drop_decode and name.startswith("decode."):
                    continue
                array = np.array(t[name])
                step = name.split(".")[1] if name.startswith("decode.") else None
                if step is not None and name.endswith(".logits") and str(int(step)) in ties:
                    row = array[0]
                    top, second = np.argsort(-row, kind="stable")[:2]
                    delta = np.float32(max(abs(float(row[top])), 1.0) * 1e-6)
                    if ties[str(int(step))] == "ref":
                        row[second] = row[top] - delta
                        tied[f"decode.{step}.argmax"] = (int(top), row[top] - row[second])
                    else:
                        row[second] = row[top] + delta
                        tied[f"decode.{step}.argmax"] = (int(second), row[second] - row[top])
                w.tensor(name, array, **dict(t.attributes(name)))
            for name, values in t.decisions.items():
                if name.startswith("decode.") and not keep_decisions:
                    continue
                values = np.array(values)
                margins = t.margins[name]
                if name in flips:
                    values.reshape(-1)[0] ^= 1
                if name in tied:
                    values.reshape(-1)[0] = tied[name][0]
                    margins = np.array(margins, dtype=np.float32)
                    margins.reshape(-1)[0] = tied[name][1]
                w.decision(name, values, margins=margins)
    return 0


if __name__ == "__main__":
    sys.exit(main())
