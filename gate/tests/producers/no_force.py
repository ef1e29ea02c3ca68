"""Test-only: another producer's command that declines forcing — `--force-decisions TRACE` is
dropped from every request, so its trace takes its own decisions and does not say it was forced
(docs/producers.md: forcing is optional for a port).

    python gate/tests/producers/no_force.py COMMAND... -- {verb} {args}

Not for real use.
"""

import subprocess
import sys


def main() -> int:
    argv = sys.argv[1:]
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    cut = argv.index("--")
    cmd, request = argv[:cut], argv[cut + 1 :]
    if "--force-decisions" in request:
        i = request.index("--force-decisions")
        del request[i : i + 2]
    return subprocess.call([*cmd, *request])


if __name__ == "__main__":
    sys.exit(main())
