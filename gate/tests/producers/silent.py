"""Test-only producer that exits 0 without writing its output, for `gate bisect`'s stale-output
tests (docs/bisect.md, "Work directory"):

    python gate/tests/producers/silent.py VERB {verb} {args}

VERB (`trace` or `layer`) is answered with exit 0 and no file at `--out`; the other verb is the
contract's. Run in a work directory an earlier bisection filled, it must fail, never be judged
on the earlier run's file.

Not for real use.
"""

import sys


def main() -> int:
    silent, argv = sys.argv[1], sys.argv[2:]
    if argv[0] == silent:
        return 0
    from tracegate_contract.__main__ import main as contract_main

    return contract_main(argv)


if __name__ == "__main__":
    sys.exit(main())
