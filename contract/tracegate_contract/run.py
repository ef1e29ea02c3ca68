"""The two verbs: build the model, run it, write the trace through the `tracegate` binding."""

from __future__ import annotations

import contextlib
import json
import os
import uuid

import numpy as np
import tracegate
from tracegate import names

from . import diffusion_gemma, gguf, shard
from .capture import NO_CAPTURE, Capture, Stream, by_layer, write
from .config import MAX_POSITIONS
from .errors import ContractError
from .force import Forcing
from .model import Model, open_model
from .provenance import provenance, unused


def _model(model_dir: str) -> Model:
    if gguf.locate(model_dir) is None and not os.path.isdir(model_dir):
        raise ContractError(f"--model: {model_dir} is not a directory or a .gguf file")
    return open_model(model_dir)


def _trace_model(model_dir, tokens, generate) -> Model:
    """The `trace` verb's model, after the position limits are checked."""
    if len(tokens) + generate > MAX_POSITIONS:
        raise ContractError(
            f"--generate {generate}: {len(tokens)} prompt tokens plus the generated ones exceed the position limit 2^24 = {MAX_POSITIONS}"
        )
    model = _model(model_dir)
    mpe = model.cfg.max_position_embeddings
    if mpe and len(tokens) + generate > mpe:
        raise ContractError(
            f"--tokens/--generate: {len(tokens)} prompt tokens plus {generate} generated = "
            f"{len(tokens) + generate} positions exceed max_position_embeddings {mpe}"
        )
    return model


def _trace_provenance(
    model_dir, model, command, tokens, prompt_text, internals, cached, generate
) -> dict:
    return provenance(
        model_dir,
        command,
        "trace",
        prompt_tokens=list(tokens),
        **({"prompt_text": prompt_text} if prompt_text is not None else {}),
        capture="internals" if internals else "default",
        cache="on" if cached else "off",
        generate=generate,
        **unused(model),
    )


def trace(
    model_dir,
    tokens,
    out,
    internals,
    generate,
    cached,
    command,
    force_decisions=None,
    prompt_text=None,
    diffusion=None,
    diffusion_flags=(),
) -> str:
    """The `trace` verb. `prompt_text`: provenance `prompt_text` of a `--text` prompt (the text,
    chat, template, tokenizer digest) recorded beside `prompt_tokens`, or None for `--tokens`.
    `diffusion`: the diffusion_gemma knobs given on the command line (`diffusion_flags`, their
    flags), refused for every other family."""
    if gguf.locate(model_dir) is None and diffusion_gemma.is_family(model_dir):
        return _trace_diffusion(
            model_dir,
            tokens,
            out,
            internals,
            generate,
            cached,
            command,
            force_decisions,
            prompt_text,
            diffusion or {},
        )
    if diffusion_flags:
        raise ContractError(f"{diffusion_flags[0]}: only for diffusion_gemma models")
    model = _trace_model(model_dir, tokens, generate)
    if force_decisions is not None:
        f = Forcing(force_decisions)
        f.check_prompt(tokens)
        c, t = model.cfg, len(tokens)
        for i in range(c.num_hidden_layers):
            if c.is_sparse(i):
                f.require(names.layer(i, "router.topk"), t, c.num_experts_per_tok, c.num_experts)
        f.require("logits.argmax", t, None, c.vocab_size)
        for s in range(generate):
            f.require(names.decode(s, "argmax"), 1, None, c.vocab_size)
        model.forcing = f
    with Stream(out, by_layer("prefill", model.cfg.mask), model.forcing) as stream:
        cap = Capture(internals, stream)
        model.run(tokens, cap, generate=generate, cached=cached)
        prov = _trace_provenance(
            model_dir, model, command, tokens, prompt_text, internals, cached, generate
        )
        return stream.finish(prov, cap)


def _trace_diffusion(
    model_dir,
    tokens,
    out,
    internals,
    generate,
    cached,
    command,
    force_decisions,
    prompt_text,
    given,
) -> str:
    """`trace` for a diffusion_gemma model: `given` holds the diffusion flags that were set."""
    if not cached:
        raise ContractError(
            "--cache off: not supported for diffusion_gemma (the encoder's cache is the model)"
        )
    model = diffusion_gemma.DiffusionGemma(model_dir)
    cfg = model.cfg
    knobs = diffusion_gemma.resolve_knobs(model_dir, cfg, generate, given)
    C = cfg.canvas_length
    total = len(tokens) + -(-generate // C) * C
    if total > MAX_POSITIONS:
        raise ContractError(
            f"--generate {generate}: {len(tokens)} prompt tokens plus whole canvases of {C} exceed the position limit 2^24"
        )
    if force_decisions is not None:
        f = Forcing(force_decisions)
        f.check_prompt(tokens)
        model.forcing = f
    with Stream(out, diffusion_gemma.place(cfg), model.forcing) as stream:
        cap = Capture(internals, stream)
        output, blocks = model.generate(tokens, knobs, cap)
        prov = provenance(
            model_dir,
            command,
            "trace",
            prompt_tokens=list(tokens),
            **({"prompt_text": prompt_text} if prompt_text is not None else {}),
            capture="internals" if internals else "default",
            cache="on",
            generate=generate,
            generation=knobs.provenance(),
            rng=diffusion_gemma.RNG,
            blocks=blocks,
            output_tokens=output,
            **unused(model),
        )
        prov["seed"] = knobs.seed
        return stream.finish(prov, cap)


RANK = "{rank}"  # in --out of a sharded run: where each rank's number goes


def trace_sharded(
    model_dir,
    tokens,
    out,
    internals,
    generate,
    cached,
    command,
    shards: shard.Shards,
    prompt_text=None,
    diffusion_flags=(),
) -> list[tuple[str, str]]:
    """The `trace` verb split over `shards` (docs/numerics.md §23): the ranks run as threads,
    each on its share of the model, and rank r writes `out` with {rank} replaced by r, its
    tensors' `shard` attributes set (shard.attribute) and provenance `shards` and a `run_id`
    common to the ranks, each rank's tensors streamed as they are recorded. Returns each rank
    trace's (digest, path) in rank order; when a rank fails, no rank's trace is left."""
    if gguf.locate(model_dir) is None and diffusion_gemma.is_family(model_dir):
        raise ContractError(
            f"--shards {shards}: diffusion_gemma is not sharded (docs/numerics.md §23.5)"
        )
    if diffusion_flags:
        raise ContractError(f"{diffusion_flags[0]}: only for diffusion_gemma models")
    model = _trace_model(model_dir, tokens, generate)
    cfg = model.cfg
    shard.refuse_unshardable(cfg, shards)
    prov = _trace_provenance(
        model_dir, model, command, tokens, prompt_text, internals, cached, generate
    )
    carry = shard.Carry(shards.world)
    places = [shard.Place(r, shards.world, shards.mode, carry) for r in range(shards.world)]
    ranks = [model.share(p) for p in places]
    del model  # from here each rank holds only its share of the weights
    with contextlib.ExitStack() as opened:
        streams = [
            opened.enter_context(
                Stream(
                    out.replace(RANK, str(p.rank)),
                    by_layer("prefill", cfg.mask),
                    shard_of=lambda name, p=p: shard.attribute(p, cfg, name),
                )
            )
            for p in places
        ]
        caps = [Capture(internals, s) for s in streams]
        shard.run_ranks(
            carry,
            [
                lambda m=m, c=c: m.run(tokens, c, generate=generate, cached=cached)
                for m, c in zip(ranks, caps, strict=True)
            ],
        )
        run_id = uuid.uuid4().hex
        written = []
        for p, s, c in zip(places, streams, caps, strict=True):
            rank_prov = {
                **prov,
                "shards": {"mode": shards.mode, "world": shards.world, "rank": p.rank},
                "run_id": run_id,
            }
            written.append((s.finish(rank_prov, c), out.replace(RANK, str(p.rank))))
        return written


def _layer_input(input_path: str, input_name: str, hidden: int):
    """The `layer` verb's input: (the trace, its tensor `input_name` as [rows, hidden] f32, the
    rows' positions), each refused in one line naming the file and the tensor."""
    src = tracegate.Trace(input_path)
    if input_name not in src.names:
        raise ContractError(f"--input-name: {input_name} is not a tensor of {input_path}")
    # As the engine: the rows are taken as they are, never converted from another dtype.
    if src.dtype(input_name) != "f32":
        raise ContractError(
            f"{input_path}: tensor {input_name} is {src.dtype(input_name)}, not f32"
        )
    x = np.ascontiguousarray(src[input_name])
    if x.ndim != 2 or x.shape[1] != hidden or x.shape[0] < 1:
        raise ContractError(
            f"{input_name}: shape {list(x.shape)} is not [rows, {hidden}] with rows ≥ 1"
        )
    return src, x, _positions_of(src.attributes(input_name), input_name, x.shape[0])


def _positions_of(attrs: dict, name: str, rows: int) -> list[int]:
    pos = attrs.get("positions")
    if isinstance(pos, str):  # tolerate a JSON-encoded list
        pos = json.loads(pos)
    if pos is None:
        raise ContractError(f"{name}: the input tensor has no positions attribute")
    pos = [int(p) for p in pos]
    if len(pos) != rows:
        raise ContractError(f"{name}: {len(pos)} positions for {rows} rows")
    bad = next((p for p in pos if not 0 <= p < MAX_POSITIONS), None)
    if bad is not None:
        raise ContractError(f"{name}: position {bad} outside [0, 2^24)")
    return pos


def _check_decode_from(pos: list[int], p: int) -> None:
    """--decode-from P: rows at positions exactly 0..m−1 in order, and 0 ≤ P < m."""
    bad = next(((i, q) for i, q in enumerate(pos) if q != i), None)
    if bad is not None:
        raise ContractError(
            f"--decode-from needs rows at positions 0..{len(pos) - 1} in order; row {bad[0]} is at position {bad[1]}"
        )
    if not 0 <= p < len(pos):
        raise ContractError(
            f"--decode-from {p} outside 0..{len(pos) - 1} (the input's {len(pos)} rows)"
        )


def layer(
    model_dir,
    index,
    input_path,
    input_name,
    out,
    internals,
    command,
    force_decisions=None,
    decode_from=None,
) -> str:
    """Layer `index` alone on a tensor from another trace (gate bisect's probe): its positions
    come from the tensor's attribute, the mask is causal by those positions. With
    `decode_from` P (docs/producers.md) the rows below P fill the layer's KV cache through the
    prefill path, then each later row goes alone through the cached decode path — `Model.layer`
    on one row and the filled cache, the call a cached --generate step makes for every layer —
    and only those rows are written."""
    if gguf.locate(model_dir) is None and diffusion_gemma.is_family(model_dir):
        if decode_from is not None:
            raise ContractError(
                "--decode-from: not for diffusion_gemma (there is no greedy decode step; name a denoise step's input instead)"
            )
        return _layer_diffusion(
            model_dir, index, input_path, input_name, out, internals, command, force_decisions
        )
    model = _model(model_dir)
    n = model.cfg.num_hidden_layers
    if not (0 <= index < n):
        raise ContractError(f"--layer: {index} is outside 0..{n - 1}")
    src, x, pos = _layer_input(input_path, input_name, model.cfg.hidden_size)
    if decode_from is not None:
        try:
            _check_decode_from(pos, decode_from)
        except ContractError as e:
            raise ContractError(f"{input_path}: tensor {input_name}: {e}") from None
    if force_decisions is not None:
        f = Forcing(force_decisions)
        c = model.cfg
        if c.is_sparse(index):
            name = names.layer(index, "router.topk")
            rows = f.require(name, None, c.num_experts_per_tok, c.num_experts)
            # Row i of the forcing decision is position i's: every input row needs one.
            beyond = next((p for p in pos if p >= rows), None)
            if beyond is not None:
                raise ContractError(
                    f"--force-decisions {force_decisions}: decision {name} has {rows} rows, the input holds position {beyond}"
                )
        model.forcing = f
    place = by_layer("layer", model.cfg.mask)

    def prov(internals, run) -> dict:
        return provenance(
            model_dir,
            command,
            "layer",
            layer=index,
            input=os.path.abspath(input_path),
            input_name=input_name,
            input_digest=src.digest,
            capture="internals" if internals else "default",
            **run,
            **unused(model),
        )

    if decode_from is None:
        with Stream(out, place, model.forcing) as stream:
            cap = Capture(internals, stream)
            model.layer(index, x, pos, cap)
            return stream.finish(prov(internals, {}), cap)
    # One row per call, joined at the end: this capture is kept, then written. No internal
    # points under --decode-from.
    cap, cache, P = Capture(False), model.new_cache(), decode_from
    if P > 0:
        model.layer(index, x[:P], pos[:P], NO_CAPTURE, cache)
    for r in range(P, x.shape[0]):
        model.layer(index, x[r : r + 1], pos[r : r + 1], cap, cache)
    cap.join_rows()
    return write(
        out, prov(False, {"decode_from": P}), cap, place, model.forcing, {"decode_from": str(P)}
    )


def _layer_diffusion(
    model_dir, index, input_path, input_name, out, internals, command, force_decisions
) -> str:
    """`layer` for a diffusion_gemma model (docs/producers.md, "Block diffusion"): layer `index`
    alone on `P.layer.LL.hidden_in` of the input trace, its keys DG6's for pass P — the cached
    rows read back from the same trace's encoder k/v — through `DiffusionGemma.layer`, the call
    the whole run makes, so the output repeats the whole run's points for that layer and pass."""
    cfg = diffusion_gemma.load_config(model_dir)
    n = cfg.num_hidden_layers
    if not (0 <= index < n):
        raise ContractError(f"--layer: {index} is outside 0..{n - 1}")
    ps = diffusion_gemma.layer_input_pass(input_name, index, cfg.sliding_window)
    src, x, pos = _layer_input(input_path, input_name, cfg.hidden_size)
    bad = next((p for p in pos if p >= cfg.max_position_embeddings), None)
    if bad is not None:
        raise ContractError(
            f"{input_name}: position {bad} outside [0, max_position_embeddings {cfg.max_position_embeddings})"
        )
    d, kv = cfg.dims(index)
    cache = diffusion_gemma.cache_from_trace(src, input_path, ps, index, n, kv * d)
    model = diffusion_gemma.DiffusionGemma(model_dir)
    if force_decisions is not None:
        model.forcing = Forcing(force_decisions)
    with Stream(out, diffusion_gemma.place(cfg), model.forcing) as stream:
        cap = Capture(internals, stream)
        model.layer_alone(index, x, pos, ps, cap, cache)
        prov = provenance(
            model_dir,
            command,
            "layer",
            layer=index,
            input=os.path.abspath(input_path),
            input_name=input_name,
            input_digest=src.digest,
            capture="internals" if internals else "default",
            **unused(model),
        )
        return stream.finish(prov, cap)
