"""Test-only producer: the contract, with its trace rewritten so that only content beyond the
tensors' bytes and the decisions' values changes (issue 12: such traces passed `matches`).

    python gate/tests/producers/content_edit.py EDIT {verb} {args}

EDIT is one of:
  margins-1e6    every margin of every decision set to 1e6 (decision values unchanged)
  logits-attr    an extra attribute `note=""` added on `logits` (bytes unchanged)

Not for real use.
"""

import os
import sys
import tempfile

import numpy as np

import tracegate
from tracegate_contract.__main__ import main as contract_main


def main() -> int:
    edit, argv = sys.argv[1], sys.argv[2:]
    if edit not in ("margins-1e6", "logits-attr"):
        print(f"content_edit.py: unknown edit {edit!r}", file=sys.stderr)
        return 2
    if argv[:1] != ["trace"]:
        return contract_main(argv)
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
                attrs = dict(t.attributes(name))
                if edit == "logits-attr" and name == "logits":
                    attrs["note"] = ""
                w.tensor(name, np.array(t[name]), **attrs)
            for name, values in t.decisions.items():
                margins = t.margins[name]
                if edit == "margins-1e6" and margins is not None:
                    margins = np.full_like(np.asarray(margins), 1e6, dtype=np.float32)
                w.decision(name, values, margins=margins)
    return 0


if __name__ == "__main__":
    sys.exit(main())
