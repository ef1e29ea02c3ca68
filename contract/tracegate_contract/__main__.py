"""Command line: the two verbs every producer answers.

  python -m tracegate_contract trace --model DIR --tokens 3,17,5 --out PATH
         [--capture default|internals] [--generate N] [--cache on|off] [--force-decisions TRACE]
  python -m tracegate_contract trace --model DIR --text TEXT [--chat] --out PATH ...
         (tokenized by the model dir's own tokenizer: tracegate.text, which imports transformers)
  python -m tracegate_contract trace ... --shards tp=N|ep=N --out PATH_WITH_{rank}
         (a sharded run, docs/numerics.md §23: one trace per rank, one `DIGEST PATH` line each)
  python -m tracegate_contract layer --model DIR --layer L --input TRACE --input-name NAME
         --out PATH [--capture default|internals] [--force-decisions TRACE] [--decode-from P]
  python -m tracegate_contract serve     (one request per stdin line; docs/producers.md, "Serving")

User errors (bad arguments, config or checkpoint refusals, bad input traces) exit 2 with one
line on stderr and no traceback.
"""

from __future__ import annotations

import argparse
import sys

# A declared dependency (contract/pyproject.toml), already imported by the package itself.
import tracegate
from tracegate import protocol

from .errors import ContractError
from .shard import parse as parse_shards


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise ContractError(message)


def parser() -> argparse.ArgumentParser:
    """The protocol's two verbs (tracegate.protocol) and the diffusion_gemma knobs of `trace`
    (docs/diffusion-gemma.md DG0, DG16); errors raise ContractError."""
    g = protocol.parser(
        "python -m tracegate_contract", "numpy contract producer", parser_class=_Parser
    )
    g.trace.add_argument(
        "--shards",
        type=parse_shards,
        metavar="tp=N|ep=N",
        help="split the run over N ranks (docs/numerics.md §23), tensor or expert parallel; "
        "--out must then hold {rank}: each rank writes its own trace",
    )
    return g.parser


# dest -> flag of the block-diffusion knobs (defined once, in tracegate.protocol).
DIFFUSION_FLAGS = {dest: spec[0] for dest, spec in protocol.DIFFUSION_FLAGS.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == [protocol.SERVE]:
        return _serve(argv[1:])
    from . import run

    try:
        args = parser().parse_args(argv)
        # The command as it can be re-run (under -m, sys.argv[0] is this file's path).
        command = [sys.executable, "-m", "tracegate_contract", *argv]
        sharded = args.verb == "trace" and args.shards is not None
        _check_rank_in_out(args.out, sharded, args.shards if sharded else None)
        if sharded and args.force_decisions is not None:
            raise ContractError(f"--force-decisions: not with --shards {args.shards}")
        if args.verb == "trace":
            ids, prompt_text = _prompt(args)
            given = {k: getattr(args, k) for k in DIFFUSION_FLAGS if getattr(args, k) is not None}
        if sharded:
            written = run.trace_sharded(
                args.model,
                ids,
                args.out,
                args.capture == "internals",
                args.generate,
                args.cache == "on",
                command,
                args.shards,
                prompt_text,
                [DIFFUSION_FLAGS[k] for k in given],
            )
        elif args.verb == "trace":
            digest = run.trace(
                args.model,
                ids,
                args.out,
                args.capture == "internals",
                args.generate,
                args.cache == "on",
                command,
                args.force_decisions,
                prompt_text,
                given,
                [DIFFUSION_FLAGS[k] for k in given],
            )
            written = [(digest, args.out)]
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
            written = [(digest, args.out)]
    except ContractError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (tracegate.TraceError, OSError) as e:
        print(f"error: {e}".splitlines()[0], file=sys.stderr)
        return 2
    # Success is one line, `DIGEST PATH`, from every producer (docs/producers.md); a sharded
    # run's is one per rank trace.
    for digest, path in written:
        print(f"{digest} {path}")
    return 0


def _check_rank_in_out(out: str, sharded: bool, shards) -> None:
    """A sharded run's --out names each rank's trace by {rank}; one trace has no rank."""
    from .run import RANK

    if sharded and RANK not in out:
        raise ContractError(
            f"--out {out}: a sharded run (--shards {shards}) writes one trace per rank; put {RANK} in the path"
        )
    if not sharded and RANK in out:
        raise ContractError(f"--out {out}: {RANK} is only for a sharded run (--shards)")


def _prompt(args) -> tuple[list[int], dict | None]:
    """The prompt's token ids, and provenance `prompt_text` when it came as `--text` (tokenized
    here, before anything else; transformers is imported only then)."""
    if args.text is None:
        return args.tokens, None
    from tracegate import text

    try:
        return text.prompt(args.model, args.text, args.chat)
    except text.TextError as e:
        raise ContractError(str(e)) from None


def _serve(rest: list[str]) -> int:
    if rest:
        print(f"error: serve takes no arguments, got {' '.join(rest)}", file=sys.stderr)
        return 2
    from tracegate.serve import serve

    return serve(main, sys.argv[0])


if __name__ == "__main__":
    sys.exit(main())
