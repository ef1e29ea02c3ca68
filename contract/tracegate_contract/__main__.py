"""Command line: the two verbs every producer answers.

  python -m tracegate_contract trace --model DIR --tokens 3,17,5 --out PATH
         [--capture default|internals] [--generate N] [--cache on|off] [--force-decisions TRACE]
  python -m tracegate_contract layer --model DIR --layer L --input TRACE --input-name NAME
         --out PATH [--capture default|internals] [--force-decisions TRACE] [--decode-from P]
  python -m tracegate_contract serve     (one request per stdin line; docs/producers.md, "Serving")

User errors (bad arguments, config or checkpoint refusals, bad input traces) exit 2 with one
line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import sys

from .errors import ContractError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise ContractError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m tracegate_contract", description="numpy contract producer")
    sub = p.add_subparsers(dest="verb", required=True, parser_class=_Parser)
    t = sub.add_parser("trace", help="run a prompt and write its trace")
    t.add_argument("--model", required=True)
    t.add_argument("--tokens", required=True, help="comma-separated token ids")
    t.add_argument("--out", required=True)
    t.add_argument("--capture", choices=["default", "internals"], default="default")
    t.add_argument("--generate", type=int, default=0)
    t.add_argument("--cache", choices=["on", "off"], default="on")
    t.add_argument("--force-decisions", help="take router top-k and greedy tokens from this trace")
    l = sub.add_parser("layer", help="run one layer on a tensor taken from a trace")
    l.add_argument("--model", required=True)
    l.add_argument("--layer", type=int, required=True)
    l.add_argument("--input", required=True)
    l.add_argument("--input-name", required=True)
    l.add_argument("--out", required=True)
    l.add_argument("--capture", choices=["default", "internals"], default="default")
    l.add_argument(
        "--force-decisions",
        help="take the layer's router top-k from this trace (row i: position i)",
    )
    l.add_argument(
        "--decode-from",
        type=int,
        metavar="P",
        help="rows at positions < P fill the layer's KV cache; each later row runs through the cached decode path; only those are written",
    )
    return p


def _tokens(text: str) -> list[int]:
    try:
        toks = [int(s) for s in text.split(",")]
    except ValueError:
        raise ContractError(f"--tokens: expected comma-separated integers, got {text!r}") from None
    if not toks:
        raise ContractError("--tokens: empty prompt")
    return toks


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"]:
        return _serve(argv[1:])
    try:
        import tracegate  # noqa: F401  (the trace writer; refuse early and plainly if absent)
    except ImportError:
        print(
            "error: the tracegate Python module is not installed (run scripts/setup.sh)",
            file=sys.stderr,
        )
        return 2
    from . import run

    try:
        args = _parser().parse_args(argv)
        # The command as it can be re-run (under -m, sys.argv[0] is this file's path).
        command = [sys.executable, "-m", "tracegate_contract", *argv]
        if args.verb == "trace":
            if args.generate < 0:
                raise ContractError("--generate: must be ≥ 0")
            digest = run.trace(
                args.model,
                _tokens(args.tokens),
                args.out,
                args.capture == "internals",
                args.generate,
                args.cache == "on",
                command,
                args.force_decisions,
            )
        else:
            digest = run.layer(
                args.model,
                args.layer,
                args.input,
                args.input_name,
                args.out,
                args.capture == "internals",
                command,
                args.force_decisions,
                args.decode_from,
            )
    except ContractError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (tracegate.TraceError, OSError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    print(digest)
    return 0


def _serve(rest: list[str]) -> int:
    if rest:
        print(f"error: serve takes no arguments, got {' '.join(rest)}", file=sys.stderr)
        return 2
    try:
        from tracegate.serve import serve
    except ImportError:
        print(
            "error: the tracegate Python module is not installed (run scripts/setup.sh)",
            file=sys.stderr,
        )
        return 2
    return serve(main, sys.argv[0])


if __name__ == "__main__":
    sys.exit(main())
