"""Test-only producer: a real producer (the contract or the oracle) whose finished trace claims
another run's provenance, as a producer on the wrong checkpoint or prompt would write it: its
tensors and decisions unchanged, so only the comparability rule can tell.

    python gate/tests/producers/foreign_provenance.py --base contract|oracle \\
        --set KEY=JSON... {verb} {args}

  --set KEY=JSON   provenance KEY set to the JSON value (e.g. weights_digest='"00ff"')

Per call only (no `serve`). Not for real use.
"""

import json
import os
import sys
import tempfile

import numpy as np
import tracegate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planted_trace import base_main  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    if argv[:1] != ["--base"] or len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    run = base_main(argv[1])
    argv = argv[2:]
    sets = {}
    while argv[:1] == ["--set"]:
        key, _, value = argv[1].partition("=")
        sets[key] = json.loads(value)
        argv = argv[2:]
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
        provenance = {**t.provenance, **sets}
        with tracegate.TraceWriter(out, provenance) as w:
            for name in t.names:
                w.tensor(name, np.array(t[name]), **dict(t.attributes(name)))
            for name, values in t.decisions.items():
                w.decision(name, np.array(values), margins=t.margins[name])
    return 0


if __name__ == "__main__":
    sys.exit(main())
