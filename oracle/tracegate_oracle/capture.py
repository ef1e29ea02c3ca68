"""The oracle's verbs on transformers' own model classes: `load_model` (loading.py, or
diffusion_gemma.py's own loader), `capture_prompt` (the `trace` verb: a whole forward, then
optional greedy decode) and `capture_layer` (the `layer` verb, optionally as cached decode steps),
each observed by taps.py's hooks and returned as a records.Capture for records.write_trace.

Everything numeric is done by transformers/torch: the run is pinned (torch_setup.py), each
router's decision is the experts its own `torch.topk` chose (at an exact tie that may be another
index than the lowest), and the output logits become decisions with the shared tie rule
(records.py), each with its margin.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np
from tracegate import names

from . import diffusion_gemma, gguf_source
from .diffusion_config import is_diffusion
from .errors import OracleError
from .families import resolve
from .force import Forcing, RouterForcing
from .linear_attn import torch_paths
from .loading import load_causal, load_gguf, preflight
from .records import Capture, Decision, Record, argmax_decision, force_decision, provenance
from .taps import Tap
from .torch_setup import RunConfig, deterministic, execution_device


def load_model(model_dir: str | os.PathLike, rc: RunConfig):
    """Load with transformers' own classes; refuse anything but a clean one-to-one load: a GGUF
    file (gguf_source), diffusion_gemma (its own class, diffusion_gemma.py), else the family
    table's causal LM (loading.py)."""
    d = Path(model_dir)
    found = gguf_source.locate(d)
    if found is not None:
        return load_gguf(found, rc)
    inv = preflight(d)
    if is_diffusion(d):  # not a causal LM: its own loader (no family table entry)
        return diffusion_gemma.load_model(d, rc, inv)
    return load_causal(d, rc, inv)


def _check_tokens(model, tokens, extra: int = 0):
    V = model.config.get_text_config().vocab_size
    if not tokens:
        raise OracleError("--tokens: empty prompt")
    bad = [t for t in tokens if not 0 <= t < V]
    if bad:
        raise OracleError(f"--tokens: ids {bad[:5]} outside the vocabulary [0, {V})")
    P = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if P is not None and len(tokens) + extra > P:
        raise OracleError(
            f"--tokens/--generate: {len(tokens) + extra} positions exceed max_position_embeddings {P}"
        )


def _generate(
    model, tokens, n: int, rc: RunConfig, forcing=None, sharding=None, stream=None
) -> tuple[list[Record], list[Decision], list[tuple[str, list[int]]]]:
    """Greedy decode with the model's own KV cache (the DynamicCache its forward creates, sliding
    layers included), or by recomputing the whole sequence. Step 0 decides from the prompt's last
    logits row; step s >= 1 first runs token s-1 at position n+s-1 (cached: that one row on the
    cache; uncached: the whole sequence, its last row kept). Each step's forward is tapped
    (`Tap(decode=True)`): `decode.SSSS.logits` always, and for s >= 1 under --capture internals
    the layers' points and `final_norm.out`. Under --force-decisions step s feeds the forcing
    trace's decode.SSSS.argmax, and the prompt's rows are routed as forced in every forward (as
    in the captured prefill). Returns the tensors (none with a `stream`: written to it), the
    decisions and the forced record (name, the rows overridden)."""
    import torch

    records, out, forced = [], [], []
    seq = list(tokens)
    cache = rc.cache == "on"
    layers = range(len(resolve(model).layers)) if rc.capture == "internals" else []
    routing = (
        RouterForcing(resolve(model), forcing) if forcing is not None else contextlib.nullcontext()
    )
    past = None
    dev = execution_device(model.get_input_embeddings(), rc)

    with torch.no_grad(), routing, torch.autocast(device_type=rc.device, enabled=False):
        for s in range(n):
            p = len(seq) - 1
            ids, positions, kw = seq, range(len(seq)), {"use_cache": cache}
            if cache and s > 0:
                ids, positions, kw = seq[-1:], [p], {"use_cache": True, "past_key_values": past}
            if forcing is not None:
                routing.positions = list(positions)
            with Tap(
                model,
                path="decode",
                positions=[p],
                layers=layers if s > 0 else [],
                internals=False,
                whole=True,
                forcing=forcing,
                decode=True,
                step=s,
                sharding=sharding,
                stream=stream,
            ) as tap:
                r = model(torch.tensor([ids], device=dev), **kw)
            records += tap.records
            past = r.past_key_values
            row = r.logits[0, -1].float().cpu().numpy()[None]
            d = argmax_decision(names.decode(s, "argmax"), row)
            if forcing is not None:
                d, over = force_decision(d, row, forcing.values(d.name), [0])
                forced.append((d.name, over))
            out.append(d)
            seq.append(int(d.values[0]))
    return records, out, forced


def _routing(model, forcing, positions):
    """Forced routing for one forward at `positions`, or nothing."""
    if forcing is None:
        return contextlib.nullcontext()
    r = RouterForcing(resolve(model), forcing)
    r.positions = list(positions)
    return r


def _require_forced(
    model,
    forcing: Forcing,
    tokens: list[int] | None,
    generate: int,
    layer: int | None = None,
    positions: list[int] | None = None,
) -> None:
    """What this run needs from the forcing trace, checked before anything runs."""
    lay = resolve(model)
    cfg = lay.config
    if tokens is not None:
        forcing.check_prompt(tokens)
    for L in lay.moe_layers if layer is None else [L for L in lay.moe_layers if L == layer]:
        name = names.layer(L, "router.topk")
        router = lay.router(L)
        rows = forcing.require(
            name, None if tokens is None else len(tokens), router.top_k, router.num_experts
        )
        beyond = next((p for p in positions or [] if p >= rows), None)
        if beyond is not None:
            raise OracleError(
                f"--force-decisions {forcing.path}: decision {name} has {rows} rows, the input holds position {beyond}"
            )
    if tokens is not None:
        forcing.require("logits.argmax", len(tokens), None, cfg.vocab_size)
        for s in range(generate):
            forcing.require(names.decode(s, "argmax"), 1, None, cfg.vocab_size)


def _forced_provenance(
    prov: dict, forcing: Forcing | None, records: list[tuple[str, list[int]]]
) -> None:
    if forcing is not None:
        forcing.check_weights(prov.get("weights_digest"))
        prov["forced_decisions"] = forcing.provenance(records)


def capture_prompt(
    model,
    model_dir,
    tokens: list[int],
    rc: RunConfig,
    det: dict | None = None,
    forcing: Forcing | None = None,
    sharding=None,
    stream=None,
) -> Capture:
    """The `trace` verb: the whole forward over `tokens` (path=prefill), then optional greedy decode;
    under --force-decisions with the forcing trace's decisions (force.py); with `sharding`
    (distributed.Sharding) as one rank of a sharded run, each tensor saying what part it holds;
    with `stream` (records.Stream) each tensor written as it is recorded, none kept."""
    import torch

    det = det if det is not None else {"use_deterministic_algorithms": None, "refusals": []}
    _check_tokens(model, tokens, rc.generate)
    if forcing is not None:
        _require_forced(model, forcing, tokens, rc.generate)
    n_layers = len(resolve(model).layers)

    def run():
        if stream is not None:
            stream.begin()
        with Tap(
            model,
            path="prefill",
            positions=range(len(tokens)),
            layers=range(n_layers),
            internals=rc.capture == "internals",
            whole=True,
            forcing=forcing,
            sharding=sharding,
            stream=stream,
        ) as tap:
            # Forced routing: the Tap answers each router's topk itself (it records them all).
            with torch.autocast(device_type=rc.device, enabled=False):
                model(
                    torch.tensor(
                        [tokens], device=execution_device(model.get_input_embeddings(), rc)
                    ),
                    use_cache=False,
                )
            tap.finish()
        return tap, _generate(model, tokens, rc.generate, rc, forcing, sharding, stream)

    with torch_paths(resolve(model)):  # Gated DeltaNet: transformers' torch references
        tap, (gen_tensors, gen, gen_forced) = deterministic(run, det)
    prov = provenance(model, model_dir, rc, det, tokens, "trace")
    if sharding is not None:
        prov.update(sharding.provenance())
    _forced_provenance(prov, forcing, tap.forced + gen_forced)
    if tap.notes:
        prov["notes"] = tap.notes
    return Capture(tap.records + gen_tensors, tap.decisions + gen, prov)


def layer_mask(model, L: int, x, position_ids, cache=None):
    """The model's own mask for a forward over these rows (causal in row order; with `cache`,
    sized by layer L's cache as the model's forward sizes it), of the kind its forward gives
    layer L (the family table's mask rule)."""
    from transformers import masking_utils as mu

    lay = resolve(model)
    if L in lay.linear_layers:  # the model's own (None without padding: nothing to mask)
        return mu.create_recurrent_attention_mask(
            config=lay.config, inputs_embeds=x, attention_mask=None, past_key_values=cache
        )
    fn = mu.create_causal_mask if lay.window(L) is None else mu.create_sliding_window_causal_mask
    return fn(
        config=lay.config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=cache,
        position_ids=position_ids,
        layer_idx=L if cache is not None else None,
    )


def _positions_text(positions: list[int]) -> str:
    p = list(positions)
    return str(p) if len(p) <= 8 else f"[{', '.join(map(str, p[:8]))}, ...] ({len(p)} rows)"


def check_decode_from(P: int, positions: list[int], name: str) -> None:
    """--decode-from needs rows at positions exactly 0..m-1, and 0 <= P < m."""
    bad = next((i for i, p in enumerate(positions) if p != i), None)
    if bad is not None:
        raise OracleError(
            f"--input-name {name}: --decode-from needs rows at positions 0..{len(positions) - 1} in order; "
            f"row {bad} is at position {positions[bad]}"
        )
    if not 0 <= P < len(positions):
        raise OracleError(
            f"--decode-from {P}: must be in 0..{len(positions) - 1} (--input-name {name} has "
            f"{len(positions)} rows)"
        )


def _decode_layer(model, L: int, x, positions: list[int], P: int, forcing) -> list[Record]:
    """Layer L the way the model's cached generation runs it: rows < P in one prefill forward
    filling the layer's cache (the DynamicCache the model's forward creates from its config, so
    a sliding layer keeps its window), then each row >= P alone on that cache, tapped
    (`Tap(decode=True)`). Returns one record per point, the decode rows stacked in order."""
    import torch
    from transformers import DynamicCache

    lay = resolve(model)
    cache = DynamicCache(config=lay.config)

    def forward(rows: slice):
        xs, pos = x[:, rows], torch.tensor([positions[rows]], device=x.device)
        with _routing(model, forcing, positions[rows]):
            lay.layers[L](
                xs,
                attention_mask=layer_mask(model, L, xs, pos, cache),
                position_ids=pos,
                position_embeddings=lay.rope(xs, pos, L),
                past_key_values=cache,
                use_cache=True,
            )

    if P > 0:
        forward(slice(0, P))
    rows: dict[str, list[Record]] = {}
    for p in range(P, len(positions)):
        with Tap(
            model,
            path="layer",
            positions=[p],
            layers=[L],
            internals=False,
            whole=False,
            forcing=forcing,
            decode=True,
        ) as tap:
            forward(slice(p, p + 1))
        for r in tap.records:
            rows.setdefault(r.name, []).append(r)
    return [
        Record(
            n,
            np.concatenate([r.array for r in rs]),
            rs[0].dtype,
            {**rs[0].attrs, "positions": positions[P:], "decode_from": str(P)},
        )
        for n, rs in rows.items()
    ]


def capture_layer(
    model,
    model_dir,
    L: int,
    hidden: np.ndarray,
    positions: list[int],
    rc: RunConfig,
    det: dict | None = None,
    input_dtype: str | None = None,
    source: dict | None = None,
    forcing: Forcing | None = None,
    decode_from: int | None = None,
    stream=None,
) -> Capture:
    """The `layer` verb: the model's own decoder layer L on `hidden` [T, H] at `positions`; under
    --force-decisions its router takes the forcing trace's rows at those positions. With
    `decode_from` P (docs/producers.md, `layer --decode-from`): rows < P fill the layer's KV
    cache, each row >= P runs as a cached decode step, and only those rows are written. With
    `stream` (records.Stream) the tensors are written as they are recorded (under
    --decode-from, joined from one row per step, they are kept and written at its finish)."""
    import torch

    det = det if det is not None else {"use_deterministic_algorithms": None, "refusals": []}
    lay = resolve(model)
    layers = lay.layers
    if not 0 <= L < len(layers):
        raise OracleError(f"--layer {L}: the model has layers 0..{len(layers) - 1}")
    H = lay.config.hidden_size
    if hidden.ndim != 2 or hidden.shape[1] != H or hidden.shape[0] < 1:
        raise OracleError(
            f"--input-name: tensor shape {list(hidden.shape)} is not [rows, {H}] with rows ≥ 1"
        )
    if len(positions) != hidden.shape[0]:
        raise OracleError(f"--input-name: {len(positions)} positions for {hidden.shape[0]} rows")
    if any(b <= a for a, b in zip(positions, positions[1:], strict=False)) or (
        positions and positions[0] < 0
    ):
        raise OracleError("--input-name: positions must be non-negative and strictly increasing")
    name = (source or {}).get("input_name", "")
    if decode_from is not None:
        check_decode_from(decode_from, positions, name)
    elif L in lay.linear_layers and list(positions) != list(range(len(positions))):
        # Run alone, a linear-attention layer starts from zero conv and recurrent states, which
        # is position 0: its rows must be the whole prefix.
        raise OracleError(
            f"--input-name {name}: layer {L} is a linear-attention layer, which runs from a zero "
            f"state at position 0: its rows must be at positions 0..{len(positions) - 1} in "
            f"order, not {_positions_text(positions)}"
        )
    if forcing is not None:
        # Under --decode-from the rows the forcing trace holds are forced and later ones route
        # themselves, as generated rows do in `trace`; the cache's prefix must be covered.
        _require_forced(
            model,
            forcing,
            None,
            0,
            layer=L,
            positions=positions if decode_from is None else positions[:decode_from],
        )
    dt = next(model.parameters()).dtype
    if input_dtype == "bf16":
        x = torch.from_numpy(np.array(hidden, copy=True).view(np.int16)).view(torch.bfloat16)
    else:
        x = torch.from_numpy(np.array(hidden, copy=True))  # the trace view is read-only
    dev = execution_device(layers[L], rc)
    x = x.to(dev, dt)[None]
    pos = torch.tensor([positions], device=dev)

    def run():
        if decode_from is not None:
            with torch.no_grad(), torch.autocast(device_type=rc.device, enabled=False):
                return _decode_layer(model, L, x, list(positions), decode_from, forcing), None
        if stream is not None:
            stream.begin()
        with Tap(
            model,
            path="layer",
            positions=positions,
            layers=[L],
            internals=rc.capture == "internals",
            whole=False,
            forcing=forcing,
            stream=stream,
        ) as tap:
            # Forced routing: the Tap answers layer L's router itself.
            with torch.autocast(device_type=rc.device, enabled=False):
                mask = layer_mask(model, L, x, pos)
                pe = lay.rope(x, pos, L)
                layers[L](
                    x,
                    attention_mask=mask,
                    position_ids=pos,
                    position_embeddings=pe,
                    past_key_values=None,
                    use_cache=False,
                )
        return tap.records, tap

    with torch_paths(lay):  # Gated DeltaNet: transformers' torch references
        records, tap = deterministic(run, det)
    prov = provenance(model, model_dir, rc, det, None, "layer")
    prov.update(layer=L, positions=list(positions), **(source or {}))
    if decode_from is not None:
        prov["decode_from"] = decode_from
    # Under --decode-from no decision is recorded (a decode row's routing is not one, as in `trace`).
    _forced_provenance(prov, forcing, tap.forced if tap else [])
    if tap and tap.notes:
        prov["notes"] = tap.notes
    return Capture(records, tap.decisions if tap else [], prov)
