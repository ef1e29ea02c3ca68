"""Test-only port: another producer (the example producer, say) whose `trace` output is rewritten
with tracegate.TraceWriter, to try to make a port milestone's rules pass a real defect.

    python gate/tests/producers/port_adversary.py --exe PATH [--when on|off|both] EDIT... {verb} {args}

`--when` picks the runs edited by their `--cache` (default both; a run without --generate is
`on`). Edits:
  --drop TENSOR      TENSOR left out of the trace
  --bits TENSOR=HEX  the first element of the f32 TENSOR given these bits (0x7fc00000: a NaN)
  --flip DECISION    the first value of DECISION changed (v -> v ^ 1), its margin and every
                     tensor as computed: a choice no score explains
  --declare P        provenance precision P: the port declares it computes in P (no value changed);
                     a JSON object (`{"*": "f32", "vision.*": "q8"}`) declares per pattern
  --bf16 TENSOR      TENSOR written as bf16 (its values rounded to nearest even)
  --unset KEY        provenance KEY left out (`cache`: a run that does not say how it ran)
  --set KEY=JSON     provenance KEY given the value JSON (`weights_digest="..."`: foreign weights)

The `layer` verb is the base's, unchanged. Not for real use.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import tracegate


def to_bf16_bits(array) -> np.ndarray:
    """f32 values rounded to bf16 (nearest, ties to even) as their uint16 bits (finite values)."""
    bits = np.asarray(array, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def main() -> int:
    argv = sys.argv[1:]
    exe, when, drop, bits, flip, declare, bf16, unset, put = (
        None,
        "both",
        [],
        [],
        [],
        None,
        [],
        [],
        [],
    )
    flags = (
        "--exe",
        "--when",
        "--drop",
        "--bits",
        "--flip",
        "--declare",
        "--bf16",
        "--unset",
        "--set",
    )
    while argv and argv[0] in flags:
        flag, value, argv = argv[0], argv[1], argv[2:]
        if flag == "--exe":
            exe = value
        elif flag == "--when":
            when = value
        elif flag == "--drop":
            drop.append(value)
        elif flag == "--flip":
            flip.append(value)
        elif flag == "--declare":
            declare = json.loads(value) if value.startswith("{") else value
        elif flag == "--bf16":
            bf16.append(value)
        elif flag == "--unset":
            unset.append(value)
        elif flag == "--set":
            key, _, raw = value.partition("=")
            put.append((key, json.loads(raw)))
        else:
            bits.append(value)
    if exe is None or not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cache = argv[argv.index("--cache") + 1] if "--cache" in argv else "on"
    if argv[0] != "trace" or when not in ("both", cache):
        return subprocess.call([exe, *argv])
    out = argv[argv.index("--out") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean.trace")
        argv[argv.index("--out") + 1] = clean
        rc = subprocess.call([exe, *argv], stdout=subprocess.DEVNULL)
        if rc:
            return rc
        t = tracegate.Trace(clean)
        for name in drop + bf16 + [b.split("=")[0] for b in bits]:
            if name not in t.names:  # an edit of nothing proves nothing
                print(f"port_adversary: no tensor {name} to edit", file=sys.stderr)
                return 3
        for name in flip:
            if name not in t.decisions:
                print(f"port_adversary: no decision {name} to flip", file=sys.stderr)
                return 3
        provenance = dict(t.provenance)
        if declare is not None:
            provenance["precision"] = declare
        for key in unset:
            if key not in provenance:  # an edit of nothing proves nothing
                print(f"port_adversary: no provenance {key} to unset", file=sys.stderr)
                return 3
            del provenance[key]
        for key, value in put:
            provenance[key] = value
        with tracegate.TraceWriter(out, provenance) as w:
            for name in t.names:
                if name in drop:
                    continue
                array = np.array(t[name])
                for b in bits:
                    tensor, hexbits = b.split("=")
                    if tensor == name:
                        array.reshape(-1).view(np.uint32)[0] = int(hexbits, 16)
                if name in bf16:
                    w.tensor(name, to_bf16_bits(array), dtype="bf16", **dict(t.attributes(name)))
                    continue
                w.tensor(name, array, **dict(t.attributes(name)))
            for name, values in t.decisions.items():
                values = np.array(values)
                if name in flip:
                    values.reshape(-1)[0] ^= 1
                w.decision(name, values, margins=t.margins[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
