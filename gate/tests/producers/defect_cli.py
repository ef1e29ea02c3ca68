"""The command line shared by the test producers that plant one named defect in the contract
(defective_contract.py, field_plants.py): `--defect NAME {verb|serve} {args}`, the defect planted
once, then the per-call verb or a resident worker answering every request with it. Not for real
use."""

import sys


def main(argv, prog: str, plant, answer) -> int:
    if len(argv) < 2 or argv[0] != "--defect":
        print(f"usage: {prog} --defect NAME {{verb|serve}} {{args}}", file=sys.stderr)
        return 2
    defect, rest = argv[1], argv[2:]
    plant(defect)
    if rest == ["serve"]:
        from tracegate.serve import serve

        argv0 = sys.argv[0]
        return serve(lambda request: answer(defect, request), argv0)
    return answer(defect, rest)
