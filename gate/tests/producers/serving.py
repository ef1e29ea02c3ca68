"""Test-only serving producer (docs/producers.md, "Serving"), for the gate's worker handling:

    python gate/tests/producers/serving.py MODE {verb|serve} {args}

`serve` answers requests with the contract, writing its pid to `<--out>.worker-pid` each time;
per-call, it is the contract. On the worker's second request, by MODE:
  crash-second  writes SECOND-REQUEST-CRASH to stderr and exits 7 without answering
  hang-second   sleeps (never answers): the gate's --timeout must kill it
MODE `slow-leave:MARK` answers every request; when its stdin closes it does not leave: it starts
a child in its process group (`python -c … MARK`) and sleeps, as a worker whose teardown hangs
and leaves a process behind would (MARK, e.g. a unique temp directory, finds both in /proc).

Not for real use.
"""

import os
import subprocess
import sys
import time

from tracegate.serve import serve
from tracegate_contract.__main__ import main as contract_main


def main() -> int:
    mode, argv = sys.argv[1], sys.argv[2:]
    if argv[:1] != ["serve"]:
        return contract_main(argv)
    seen = 0

    def answer(request: list[str]) -> int:
        nonlocal seen
        seen += 1
        out = request[request.index("--out") + 1]
        with open(out + ".worker-pid", "w") as f:
            f.write(str(os.getpid()))
        if seen == 2 and mode == "crash-second":
            sys.stderr.write("SECOND-REQUEST-CRASH\n")
            sys.stderr.flush()
            os._exit(7)
        if seen == 2 and mode == "hang-second":
            time.sleep(600)
        return contract_main(request)

    status = serve(answer, sys.argv[0])
    if mode.startswith("slow-leave:"):
        mark = mode.split(":", 1)[1]
        subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(300)", mark],
            stdin=subprocess.DEVNULL,
        )
        time.sleep(300)
    return status


if __name__ == "__main__":
    sys.exit(main())
