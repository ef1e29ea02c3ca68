"""Command line: the two verbs every producer answers.

  python -m tracegate_contract trace --model DIR --tokens 3,17,5 --out PATH
         [--capture default|internals] [--generate N] [--cache on|off] [--force-decisions TRACE]
  python -m tracegate_contract trace --model DIR --text TEXT [--chat] --out PATH ...
         (tokenized by the model dir's own tokenizer: tracegate.text, which imports transformers)
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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the usage too)
        raise ContractError(message)


def parser() -> argparse.ArgumentParser:
    """The protocol's two verbs (tracegate.protocol) and the diffusion_gemma knobs of `trace`
    (docs/diffusion-gemma.md DG0, DG16); errors raise ContractError."""
    g = protocol.parser(
        "python -m tracegate_contract", "numpy contract producer", parser_class=_Parser
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
        if args.verb == "trace":
            ids, prompt_text = _prompt(args)
            given = {k: getattr(args, k) for k in DIFFUSION_FLAGS if getattr(args, k) is not None}
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
    # Success is one line, `DIGEST PATH`, from every producer (docs/producers.md).
    print(f"{digest} {args.out}")
    return 0


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
