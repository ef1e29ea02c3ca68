"""Test-only producer: the contract, with one element of one tensor moved by 1 ULP afterwards.

    python gate/tests/producers/ulp_nudge.py TENSOR {verb} {args}

It exists so the gate's tests can show that a contract differing by a single ULP fails the
`matches` check at exactly that tensor. Not for real use.
"""

import os
import sys
import tempfile

import numpy as np

import tracegate
from tracegate_contract.__main__ import main as contract_main


def main() -> int:
    target, argv = sys.argv[1], sys.argv[2:]
    out = argv[argv.index("--out") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "clean.trace")
        argv[argv.index("--out") + 1] = clean
        rc = contract_main(argv)
        if rc:
            return rc
        t = tracegate.Trace(clean)
        with tracegate.TraceWriter(out, t.provenance) as w:
            for name in t.names:
                array = np.array(t[name])
                if name == target:
                    flat = array.reshape(-1)
                    flat[0] = np.nextafter(flat[0], np.float32(np.inf))
                w.tensor(name, array, **t.attributes(name))
            for name, values in t.decisions.items():
                w.decision(name, values, margins=t.margins[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
