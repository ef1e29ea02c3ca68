"""The producer protocol's command line (docs/producers.md), defined once for Python producers.

    PRODUCER trace --model DIR --tokens IDS --out PATH [--capture default|internals]
                   [--generate N] [--cache on|off] [--force-decisions TRACE]
    PRODUCER trace --model DIR --text TEXT [--chat] --out PATH ...   (tracegate.text)
    PRODUCER trace ... [--seed S] [--denoising-steps N] [--t-max F] ...  (block diffusion)
    PRODUCER layer --model DIR --layer L --input TRACE --input-name NAME --out PATH
                   [--capture default|internals] [--force-decisions TRACE] [--decode-from P]
    PRODUCER serve     (one request per stdin line: tracegate.serve)

`parser()` builds the argparse grammar of the two verbs; a producer adds its own flags to the
verbs it returns (the oracle's --device, --dtype, …) and keeps its own error style through
`parser_class`. The values are checked here (token ids, a count ≥ 0), so every producer refuses
the same command lines with the same words.

`--text TEXT [--chat]` is the alternative to `--tokens` (exactly one of the two; `--chat` only
with `--text`): the producer turns it into token ids with `tracegate.text.tokenize` before
anything else, and records `prompt_text` in provenance (docs/producers.md, "Text prompts").
"""

from __future__ import annotations

import argparse
import re
from typing import NamedTuple

__all__ = ["DIFFUSION_FLAGS", "SERVE", "Grammar", "at_least", "parser", "prompt_text", "tokens"]

SERVE = "serve"  # the worker verb: its requests are the per-call command lines (tracegate.serve)


_TOKEN_ID = re.compile(r"-?[0-9]+")


def tokens(text: str) -> list[int]:
    """`--tokens IDS`: comma-separated integers, at least one (`3,17,5` is [3, 17, 5]). Each id
    is ASCII digits with an optional leading `-`, as the Rust side's `protocol::token_id`: no
    spaces, `+` or `_`, which Python's `int` would take and the engine refuses."""
    parts = text.split(",")
    bad = next((s for s in parts if not _TOKEN_ID.fullmatch(s)), None)
    if bad is not None:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers (digits only, no spaces), got {bad!r}"
        )
    return [int(s) for s in parts]


def prompt_text(text: str) -> str:
    """`--text TEXT`: any non-empty string (tokenized later, by the model's own tokenizer)."""
    if text == "":
        raise argparse.ArgumentTypeError("the text is empty")
    return text


def at_least(low: int):
    """An argparse type: an integer ≥ `low` (`--generate`: 0; the oracle's `--threads`: 1)."""

    def integer(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer ≥ {low}, got {text!r}") from None
        if n < low:
            raise argparse.ArgumentTypeError(f"must be ≥ {low}, got {n}")
        return n

    return integer


def _integer(text: str) -> int:
    if not _TOKEN_ID.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    return int(text)


def _number(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if v != v or v in (float("inf"), float("-inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


# A block-diffusion model's generation knobs on `trace` (docs/diffusion-gemma.md DG0): dest (the
# generation_config key) -> (flag, type, metavar, what). Default None, so a flag that was given
# can be told apart: a producer refuses them for other families, and for block diffusion they
# override the checkpoint's generation_config.json. Ranges are checked once that file is merged,
# so a refusal names the flag or the file that set the value.
DIFFUSION_FLAGS = {
    "seed": ("--seed", _integer, "S", "the sampler's seed, 0 ≤ S < 2^64 (default 0)"),
    "max_denoising_steps": (
        "--denoising-steps",
        _integer,
        "N",
        "denoising steps per block at most (≥ 1)",
    ),
    "t_max": ("--t-max", _number, "F", "temperature at the first step (> --t-min)"),
    "t_min": ("--t-min", _number, "F", "the temperature schedule's floor (≥ 0)"),
    "entropy_bound": ("--entropy-bound", _number, "F", "the sampler's accept bound (> 0)"),
    "stability_threshold": (
        "--stability-threshold",
        _integer,
        "N",
        "stop: steps of an unchanged argmax (≥ 0)",
    ),
    "confidence_threshold": (
        "--confidence-threshold",
        _number,
        "F",
        "stop: mean entropy below this (> 0)",
    ),
    "eos_token_id": ("--eos", tokens, "ID[,ID…]", "end-of-sequence token ids"),
    "pad_token_id": ("--pad", _integer, "ID", "replaces the tokens after an EOS"),
}


class Grammar(NamedTuple):
    """The whole parser, and the parsers of its two verbs (to add a producer's own flags to)."""

    parser: argparse.ArgumentParser
    trace: argparse.ArgumentParser
    layer: argparse.ArgumentParser


def parser(
    prog: str,
    description: str | None = None,
    parser_class: type[argparse.ArgumentParser] = argparse.ArgumentParser,
    **kwargs,
) -> Grammar:
    """The `trace` and `layer` verbs with the protocol's arguments. `parser_class` and `kwargs`
    (e.g. `formatter_class`) go to the top parser and both verbs' parsers."""
    top = parser_class(prog=prog, description=description, **kwargs)
    sub = top.add_subparsers(dest="verb", required=True, parser_class=parser_class)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--model",
            required=True,
            help="HF-layout model dir (config.json + *.safetensors), or a .gguf file (or a dir "
            "holding one; docs/numerics.md §21)",
        )
        p.add_argument(
            "--out",
            required=True,
            help="trace file to write (into a temporary file beside it, renamed when complete)",
        )
        p.add_argument("--capture", choices=["default", "internals"], default="default")

    t = sub.add_parser("trace", help="whole forward over a prompt (+ greedy decode)", **kwargs)
    common(t)
    prompt = t.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", type=tokens, help="prompt token ids, e.g. 3,17,5")
    prompt.add_argument(
        "--text",
        type=prompt_text,
        metavar="TEXT",
        help="instead of --tokens: prompt text, tokenized by the --model dir's own tokenizer "
        "(tracegate.text; --text=-x for a text starting with -)",
    )
    t.add_argument(
        "--chat",
        action="store_true",
        help="with --text: the text as one user message in the tokenizer's chat template, "
        "with the generation prompt",
    )
    t.add_argument(
        "--generate",
        type=at_least(0),
        default=0,
        metavar="N",
        help="greedy decode N tokens: decode.SSSS.argmax decisions, decode.SSSS.logits rows, "
        "and the steps' layer points under --capture internals",
    )
    t.add_argument(
        "--cache",
        choices=["on", "off"],
        default="on",
        help="decode with the KV cache or recompute the whole sequence",
    )
    t.add_argument(
        "--force-decisions",
        metavar="TRACE",
        help="take router top-k and greedy tokens from this trace instead of computing them",
    )
    for dest, (flag, typ, metavar, what) in DIFFUSION_FLAGS.items():
        t.add_argument(
            flag,
            dest=dest,
            type=typ,
            default=None,
            metavar=metavar,
            help=f"block diffusion only: {what}",
        )

    # --chat without --text is a usage error of the verb. argparse checks no relation between two
    # flags but mutual exclusion, so the trace parser's own parse checks it once it has parsed
    # (the subparsers action, and a direct parse_args, both call this instance's method).
    parse_known = t.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, rest = parse_known(args, namespace)
        if ns.chat and ns.text is None:
            t.error("--chat goes only with --text (it wraps the text in the chat template)")
        return ns, rest

    t.parse_known_args = parse_known_args

    l = sub.add_parser("layer", help="run decoder layer L on a tensor taken from a trace", **kwargs)
    common(l)
    l.add_argument("--layer", required=True, type=int, help="decoder layer, 0-based")
    l.add_argument("--input", required=True, help="trace holding the layer input")
    l.add_argument(
        "--input-name", required=True, help="tensor name in --input, e.g. layer.02.hidden_in"
    )
    l.add_argument(
        "--force-decisions",
        metavar="TRACE",
        help="take the layer's router top-k from this trace (row i: position i)",
    )
    # Any integer: a value outside 0..rows-1 is refused by the producer once the rows are known.
    l.add_argument(
        "--decode-from",
        type=int,
        metavar="P",
        help="rows at positions < P fill the layer's KV cache; each later row runs as a cached "
        "decode step; only those rows are written (input rows at positions 0..m-1)",
    )
    return Grammar(top, t, l)
