"""Test-only producer that misbehaves the ways a real one can, for the gate's process handling:

    python gate/tests/producers/misbehaving.py MODE {verb} {args}

Modes:
  hang          sleeps (never writes a trace): the gate's --timeout must kill it
  background    starts `sleep 600` holding stdout and stderr open (its pid written to
                `<--out>.sleeper-pid`), then runs the contract and exits: the gate must not wait
                for the sleeper
  escaped       as background, but the sleeper starts a session of its own (it leaves the
                producer's process group, so only the gate's read deadline can end the wait)
  flood         writes FIRST-LINE, 50,000,000 bytes of 'x' and LAST-LINE to stderr, then exits 1
  hang-layer    the contract for `trace`; sleeps on `layer`
  endless       writes to stderr as fast as it can, forever

Not for real use.
"""

import os
import subprocess
import sys
import time


def main() -> int:
    mode, argv = sys.argv[1], sys.argv[2:]
    if mode == "hang":
        time.sleep(600)
        return 0
    if mode == "hang-layer" and argv[0] == "layer":
        time.sleep(600)
        return 0
    if mode == "hang-layer":
        from tracegate_contract.__main__ import main as contract_main

        return contract_main(argv)
    if mode in ("background", "escaped"):
        out = argv[argv.index("--out") + 1]
        # Inherits our stdout and stderr.
        sleeper = subprocess.Popen(["sleep", "600"], start_new_session=mode == "escaped")
        with open(out + ".sleeper-pid", "w") as f:
            f.write(str(sleeper.pid))
        from tracegate_contract.__main__ import main as contract_main

        rc = contract_main(argv)
        os._exit(rc)  # without waiting for the sleeper
    if mode == "endless":
        chunk = b"y" * 65536
        while True:
            sys.stderr.buffer.write(chunk)
    if mode == "flood":
        err = sys.stderr.buffer
        err.write(b"FIRST-LINE\n")
        chunk = b"x" * 1_000_000
        for _ in range(50):
            err.write(chunk)
        err.write(b"\nLAST-LINE\n")
        err.flush()
        return 1
    print(f"unknown mode {mode!r}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
