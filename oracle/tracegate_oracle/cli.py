"""Command line: `trace` (a whole forward, optionally greedy decode) and `layer` (one decoder layer,
optionally as cached decode steps with --decode-from); `serve` answers many of them from one process
(docs/producers.md, "Serving").

`trace --text TEXT [--chat]` instead of `--tokens IDS`: the text is tokenized by the model dir's
own tokenizer (tracegate.text) before anything else, and provenance records `prompt_text`.

User errors (arguments, paths, checkpoints, input traces) exit 2 with one line naming the
problem; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tracegate import protocol

from . import capture as cp
from . import diffusion_config as dcfg
from . import diffusion_gemma as dg
from . import distributed as dist
from .errors import OracleError
from .families import resolve
from .force import Forcing
from .gguf_source import locate
from .loading import preflight
from .records import Stream, weights_digest
from .torch_setup import RunConfig, check_device_map, setup_torch

PROG = "python -m tracegate_oracle"


def parse_max_memory(s: str) -> dict:
    """`0=70GiB,cpu=200GiB` -> {0: "70GiB", "cpu": "200GiB"}: accelerate's own max_memory (its keys are
    GPU indices or cpu; each size is read by accelerate's parser when the model loads)."""
    out: dict = {}
    for part in s.split(","):
        key, eq, size = (x.strip() for x in part.partition("="))
        if not eq or not size or not (key == "cpu" or key.isdigit()):
            raise argparse.ArgumentTypeError(
                f"{part!r} is not DEVICE=SIZE (DEVICE a GPU index or cpu, e.g. 0=70GiB,cpu=200GiB)"
            )
        k = "cpu" if key == "cpu" else int(key)
        if k in out:
            raise argparse.ArgumentTypeError(f"device {key} given twice")
        out[k] = size
    return out


def parser() -> argparse.ArgumentParser:
    """The protocol's two verbs (tracegate.protocol), each with the oracle's own flags."""
    g = protocol.parser(PROG, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for p in (g.trace, g.layer):
        p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
        p.add_argument(
            "--dtype",
            choices=["f32", "bf16", "f16"],
            default="f32",
            help="compute dtype (default f32)",
        )
        p.add_argument(
            "--device-map",
            choices=["auto"],
            help="with --device cuda: spread the model over the visible GPUs as transformers/accelerate "
            "place it (from_pretrained(device_map='auto')); the map is in provenance",
        )
        p.add_argument(
            "--max-memory",
            type=parse_max_memory,
            metavar="DEV=SIZE,...",
            help="with --device-map auto: accelerate's max_memory per device, e.g. 0=70GiB,cpu=200GiB "
            "(modules placed on cpu are kept in CPU memory and computed on the first GPU)",
        )
        p.add_argument(
            "--threads",
            type=protocol.at_least(1),
            default=1,
            help="torch intra-op threads (default 1)",
        )
    # torch's seed; `trace` has the protocol's --seed (block diffusion's sampler, default 0 here)
    g.layer.add_argument("--seed", type=int, default=0)
    g.trace.add_argument(
        "--distributed",
        type=dist.parse,
        metavar="tp=N|ep=N",
        help="run sharded by transformers' own tensor parallelism over N ranks (ep=N: experts "
        "too, tp_size=ep_size=N), launched with torchrun on this host (gloo, CPU), or as this "
        "rank when already under torchrun; --out must hold {rank}: one trace per rank, for "
        "trace-merge",
    )
    g.trace.add_argument(
        "--distributed-timeout",
        type=protocol.at_least(1),
        default=600,
        metavar="SECONDS",
        help="with --distributed: the ranks are killed after this long, and a collective waits "
        "at most this long for a peer (default 600)",
    )
    return g.parser


def check_out(out: str) -> Path:
    p = Path(out)
    if p.is_dir():
        raise OracleError(f"--out {p}: is a directory")
    if not p.parent.is_dir():
        raise OracleError(f"--out {p}: directory {p.parent} does not exist")
    return p


def _positions(v) -> list[int]:
    if isinstance(v, str):
        import json

        v = json.loads(v) if v.strip().startswith("[") else [x for x in v.split(",") if x.strip()]
    return [int(x) for x in v]


def _read_input(path: str, name: str):
    """(array, positions, dtype name or None, source provenance) of tensor `name` in trace `path`."""
    import tracegate

    if not Path(path).exists():
        raise OracleError(f"--input {path}: no such file")
    if not Path(path).is_file():  # a FIFO would block the reader
        raise OracleError(f"--input {path}: not a regular file")
    try:
        tr = tracegate.Trace(path)
        tr.verify()
    except tracegate.TraceError as e:
        raise OracleError(f"--input {path}: not a valid trace: {e}") from None
    if name not in tr.names:
        near = [n for n in tr.names if n.endswith(name.split(".")[-1])][:5]
        raise OracleError(
            f"--input-name {name}: not in {path}" + (f" (e.g. {', '.join(near)})" if near else "")
        )
    attrs = tr.attributes(name)
    if "positions" not in attrs:
        raise OracleError(f"--input-name {name}: tensor has no positions attribute")
    arr = tr[name]
    # As the engine and the contract: rows are taken as they are, never converted from integers
    # (an i32 tensor read as f32 is other numbers); a bf16 row is a bf16 candidate's.
    stored = tr.dtype(name)
    if stored not in ("f32", "bf16"):
        raise OracleError(f"{path}: tensor {name} is {stored}, not f32 (or bf16)")
    dt = "bf16" if stored == "bf16" else None
    src = {
        "input_trace": str(path),
        "input_name": name,
        "input_digest": tr.digest,
        "input_path": attrs.get("path"),
    }
    return arr, _positions(attrs["positions"]), dt, src


_MODELS: dict = {}


def _content_key(d: Path) -> tuple | None:
    """What the checkpoint directory holds, by content: the weights digest the trace records
    (tracegate.weights_digest over *.safetensors) and a SHA-256 of every other file (config.json
    and its like, small). Never size and mtime: `cp -p` and `rsync -a` keep both while replacing
    the bytes. None when the digest cannot be computed (no tracegate, no xxhash)."""
    import hashlib

    weights = weights_digest(d)
    if weights is None:
        return None

    def sha256(p: Path) -> str:
        h = hashlib.sha256()
        try:
            with open(p, "rb") as f:  # streamed: a stray large file costs time, not its size
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        except OSError as e:
            raise OracleError(f"--model {d}: cannot read {p.name}: {e}") from None
        return h.hexdigest()

    # A GGUF file is its own whole content (its config is its metadata, in the digest).
    others = (
        ()
        if d.is_file()
        else tuple(
            sorted(
                (p.name, sha256(p))
                for p in d.iterdir()
                if p.is_file() and not p.name.endswith((".safetensors", ".gguf"))
            )
        )
    )
    return weights, others


def _load(model_dir: str, rc: RunConfig):
    """The model, loaded once per (checkpoint content, dtype, device, placement) in a serving
    process: a run only reads its weights (hooks are removed after each capture). One model is
    kept, so a worker holds no more than a per-call process. The weights digest the key was made
    of is the one the trace records (`model.tracegate_weights_digest`): a trace's tensors are
    those of the weights it names."""
    d = Path(model_dir).resolve()
    content = _content_key(d)
    key = (
        str(d),
        rc.dtype,
        rc.device,
        rc.device_map,
        repr(rc.max_memory),
        str(rc.distributed),
        content,
    )
    if content is None or key not in _MODELS:
        _MODELS.clear()
        model = cp.load_model(model_dir, rc)  # the module attribute: test producers replace it
        if content is not None:
            # Replaced while loading: the model may hold either; neither key nor record would say.
            after = _content_key(d)
            if after != content:
                raise OracleError(
                    f"--model {model_dir}: the checkpoint changed while it was loading "
                    f"(weights digest {content[0]} before, {after and after[0]} after)"
                )
            model.tracegate_weights_digest = content[0]
            _MODELS[key] = model
        return model
    return _MODELS[key]


def _serve(rest: list[str]) -> int:
    if rest:
        print(f"{PROG} serve: error: takes no arguments, got {' '.join(rest)}", file=sys.stderr)
        return 2
    import torch  # noqa: F401  (the seconds of importing it go before the first request)
    import transformers  # noqa: F401
    from tracegate.serve import serve

    return serve(main, sys.argv[0])


def _versions(rest: list[str]) -> int:
    """`versions --out PATH`: the stack's versions as JSON, what the gate records (its probe of
    the oracle's interpreter, asked of the serving worker so torch is imported once)."""
    if len(rest) != 2 or rest[0] != "--out":
        print(
            f"{PROG} versions: error: expected --out PATH, got {' '.join(rest)!r}", file=sys.stderr
        )
        return 2
    import json

    import numpy
    import torch
    import transformers

    Path(rest[1]).write_text(
        json.dumps(
            {
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "numpy": numpy.__version__,
            }
        )
    )
    return 0


def prompt_of(a) -> tuple[list[int], dict | None]:
    """The prompt's token ids, and provenance `prompt_text` when it came as `--text`."""
    if a.text is None:
        return a.tokens, None
    from tracegate import text

    try:
        return text.prompt(a.model, a.text, a.chat)
    except text.TextError as e:
        raise OracleError(str(e)) from None


def insert_after(d: dict, key: str, new_key: str, value) -> dict:
    """`d` with `new_key: value` placed right after `key` (at the end when `key` is absent)."""
    out = {}
    for k, v in d.items():
        out[k] = v
        if k == key:
            out[new_key] = value
    out.setdefault(new_key, value)
    return out


def _check_distributed(a, rc: RunConfig, diffusion: bool, gguf: bool) -> None:
    """--distributed with what it does not run (each untested under it), refused before a rank starts."""
    spec = getattr(a, "distributed", None)
    dist.check_out(a.out, spec)
    if spec is None:
        return
    why = None
    if diffusion:
        why = f"not for {dcfg.FAMILY} (it runs through its own loader, not transformers' sharding)"
    elif gguf:
        why = "not for a GGUF checkpoint (the oracle builds it, not from_pretrained's sharding)"
    elif rc.device != "cpu":
        why = f"runs on CPU over {dist.BACKEND}, not --device {rc.device}"
    elif a.force_decisions is not None:
        why = "not with --force-decisions (forced routing under sharding is not tested)"
    if why:
        raise OracleError(f"--distributed {spec}: {why}")


def _check_family_flags(a, rc: RunConfig, diffusion: bool) -> None:
    """diffusion_gemma's flags only for it; what it does not run refused for it (DG16)."""
    if not diffusion:
        given = dcfg.given_flags(a)
        if given:
            raise OracleError(
                f"{next(iter(given))}: a {dcfg.FAMILY} generation knob; --model {a.model} is not {dcfg.FAMILY}"
            )
        return
    if a.verb == "layer":
        raise OracleError(
            f"layer: not supported for {dcfg.FAMILY} (its layers run inside generate: use trace)"
        )
    if rc.cache == "off":
        raise OracleError(
            f"--cache off: not supported for {dcfg.FAMILY} (the decoder reads the encoder's cache)"
        )


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == [protocol.SERVE]:
        return _serve(args[1:])
    if args[:1] == ["versions"]:
        return _versions(args[1:])
    ap = parser()
    a = ap.parse_args(argv)
    rc = RunConfig(
        device=a.device,
        dtype=a.dtype,
        threads=a.threads,
        seed=a.seed if a.seed is not None else 0,
        capture=a.capture,
        cache=getattr(a, "cache", "on"),
        generate=getattr(a, "generate", 0),
        device_map=a.device_map,
        max_memory=a.max_memory,
        distributed=getattr(a, "distributed", None),
    )
    spec, ranked = rc.distributed, None
    try:
        ranked = dist.under_torchrun() if spec else None
        tokens, prompt_text = prompt_of(a) if a.verb == "trace" else (None, None)
        outs = [check_out(o) for o in (dist.rank_paths(a.out, spec.n) if spec else [a.out])]
        out = outs[0]
        check_device_map(rc)
        # Refusals that need no torch come before the seconds its import takes (load_model
        # repeats them for callers of the API). A GGUF checkpoint is checked as it loads.
        if locate(a.model) is None:
            preflight(a.model)
        diffusion = locate(a.model) is None and dcfg.is_diffusion(a.model)
        _check_distributed(a, rc, diffusion, locate(a.model) is not None)
        _check_family_flags(a, rc, diffusion)
        if spec and ranked is None:
            # The launcher: torchrun re-runs this command line once per rank (each a branch below).
            paths = dist.launch(args, spec, a.out, a.distributed_timeout)
            import tracegate

            for p in paths:
                print(f"{tracegate.Trace(p).digest} {p}")
            return 0
        forcing = Forcing(a.force_decisions) if a.force_decisions is not None else None
        if a.verb == "layer":
            arr, positions, dt, src = _read_input(a.input, a.input_name)
            if a.decode_from is not None:
                cp.check_decode_from(a.decode_from, positions, a.input_name)
        det = setup_torch(rc)
        sharding = None
        if ranked is not None:
            rank, world = ranked
            run_id = dist.init(spec, rank, world, a.distributed_timeout)
            out = outs[rank]
        model = _load(a.model, rc)
        # Each tensor goes to the trace as the run records it (records.Stream).
        with Stream(out) as stream:
            if a.verb == "layer":
                cap = cp.capture_layer(
                    model,
                    a.model,
                    a.layer,
                    arr,
                    positions,
                    rc,
                    det,
                    input_dtype=dt,
                    source=src,
                    forcing=forcing,
                    decode_from=a.decode_from,
                    stream=stream,
                )
            elif diffusion:
                knobs = dcfg.cli_knobs(a)
                cap = dg.capture(model, a.model, tokens, rc, det, knobs, forcing, stream)
            else:
                if ranked is not None:
                    sharding = dist.Sharding(model, resolve(model), spec, rank, world, run_id)
                cap = cp.capture_prompt(
                    model,
                    a.model,
                    tokens,
                    rc,
                    det,
                    forcing=forcing,
                    sharding=sharding,
                    stream=stream,
                )
            if prompt_text is not None:  # beside prompt_tokens
                cap.provenance = insert_after(
                    cap.provenance, "prompt_tokens", "prompt_text", prompt_text
                )
            digest = stream.finish(cap)
    except OracleError as e:
        # A rank's refusal names it: the launcher reports the first rank's line as its own.
        who = f"rank {ranked[0]}/{ranked[1]}: " if spec and ranked else ""
        print(f"{PROG} {a.verb}: error: {who}{e}", file=sys.stderr)
        return 2
    finally:
        if spec and ranked:
            dist.finish()
    # Success is one line, `DIGEST PATH`, from every producer (docs/producers.md).
    print(f"{digest} {out}")
    return 0
