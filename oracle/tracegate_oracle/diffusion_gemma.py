"""diffusion_gemma (docs/diffusion-gemma.md): transformers' own
`DiffusionGemmaForBlockDiffusion.generate`, observed (DG19) and, under --force-decisions, steered
(DG17). Nothing here computes the model: every tensor is one transformers computed, every decision
the value transformers used, with the margin read off transformers' own numbers.

How a generate is observed. For the duration of one capture (and undone after, also on error):
  * forward hooks on the encoder's and the decoder's modules record the capture points; the
    first encoder call of a generate is the prompt pass, each later one block b's commit pass
    (`encode.BBBB.`); each decoder call is the next step of the current block;
  * the model's `forward` (what `generate` calls for each step), `_denoising_step`,
    `_prepare_sampler`, `_prepare_diffusion_stopping_criteria` and `_finalize_canvas` are
    shadowed on the instance; `LinearTemperatureScheduleLogitsProcessor.__call__` on its class
    (a call on an instance looks its `__call__` up on the type);
  * inside `_denoising_step` a torch function mode sees the one `torch.multinomial` (`sampled`)
    and the `torch.argmax` of the tempered logits (`argmax`); under forcing it answers them with
    the forcing trace's values, so the RNG is not consulted for a forced draw;
  * the sampler's `initialize_canvas` (the block's first call: `init_canvas`; later ones: the
    renoise draw) and `accept_canvas` are wrapped on the sampler instance; the stopping criteria
    behind a proxy whose `__call__` recomputes stable and confident from the criteria's own
    history and inputs before calling it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tracegate import names
from tracegate_contract.force import rows_differing

from .diffusion_config import FAMILY, resolve_knobs
from .errors import CheckpointError, OracleError
from .families import FAMILIES
from .force import intercept_topk
from .loading import (
    check_shapes_on_meta,
    check_tied_head,
    one_line,
    placement,
    replay,
    report_rows,
    transformers_log,
)
from .records import (
    Capture,
    Decision,
    Record,
    margin_of,
    model_weights_digest,
    run_provenance,
    to_numpy,
)
from .taps import Hooks, expert_tap_class, registered
from .torch_setup import TORCH_DTYPES, deterministic, execution_device

# The family table's entry (families.py): the class, and the checkpoint tensors a token-ids-only
# run does not compute with (DG0, "Weights").
ARCH = FAMILIES[FAMILY].auto
UNUSED_PREFIXES = FAMILIES[FAMILY].unused_prefixes

# ------------------------------------------------------------------------------------ loading


def load_model(d: Path, rc, inv: dict):
    """transformers' own class, eager attention and eager experts, every text tensor from the
    checkpoint: a MISSING one is refused; the vision tower (unused) may be missing."""
    import torch
    import transformers

    transformers.utils.logging.disable_progress_bar()
    cls = getattr(transformers, ARCH)
    with transformers_log() as log:
        try:
            cfg = transformers.AutoConfig.from_pretrained(d)
        except Exception as e:
            raise OracleError(
                f"--model {d}: config.json not understood by transformers: {one_line(e)}"
            ) from None
        archs = getattr(cfg, "architectures", None)
        if archs and ARCH not in archs:
            raise OracleError(f"{d / 'config.json'}: architectures = {archs}, not {ARCH}")

        class _Meta:  # capture's shape check builds through an auto class's from_config
            from_config = staticmethod(cls._from_config)

        check_shapes_on_meta(d, cfg, inv, _Meta)
    try:
        with transformers_log() as load_log:
            model, info = cls.from_pretrained(
                d,
                dtype=getattr(torch, TORCH_DTYPES[rc.dtype]),
                attn_implementation="eager",  # attn_probs are eager attention's weights
                experts_implementation="eager",  # the per-expert loop; grouped_mm otherwise
                use_safetensors=True,
                output_loading_info=True,
                **placement(rc),
            )
    except (OSError, ValueError, RuntimeError) as e:
        rows = report_rows(load_log)
        detail = "; ".join(rows[:3]) if rows else one_line(e)
        raise CheckpointError(f"--model {d}: transformers could not load it: {detail}") from None
    problems = {}
    for key, v in info.items():
        v = sorted(map(str, v))
        if key == "missing_keys":  # the vision tower is initialised, unused (DG0)
            v = [n for n in v if not n.startswith(UNUSED_PREFIXES)]
        if v:
            problems[key] = v
    if problems:
        detail = "; ".join(
            f"{k}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in problems.items()
        )
        raise CheckpointError(f"--model {d}: checkpoint does not match {ARCH}: {detail}")
    counts = {p: sum(n.startswith(p) for n in inv) for p in UNUSED_PREFIXES}
    model.tracegate_unused_tensors = {p: n for p, n in counts.items() if n}
    check_tied_head(model, d)
    replay([r for r in log + load_log if "MISSING" not in r.getMessage()])
    return (model if rc.device_map else model.to(rc.device)).eval()


# ------------------------------------------------------------------------------------ capture


def _margin_of(rows: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """Per row: value at the chosen index ⊖ the largest value elsewhere (docs/producers.md's
    margin for a one-index choice: the strongest unchosen ranks first by value)."""
    x = np.array(rows, dtype=np.float32, copy=True)
    r = np.arange(x.shape[0])
    top = x[r, chosen].copy()
    x[r, chosen] = -np.inf
    return (top - x.max(axis=1)).astype(np.float32)


@dataclass
class _Step:
    """What one denoise step decided, held until its stop call writes them in DG16's order."""

    tempered: object = None  # the tempered logits tensor [1, C, V]
    own_argmax: np.ndarray | None = None
    argmax: np.ndarray | None = None
    sampled: np.ndarray | None = None
    sampled_p: np.ndarray | None = None
    accept: np.ndarray | None = None
    accept_margins: np.ndarray | None = None
    own_accept: np.ndarray | None = None
    renoise: np.ndarray | None = None


class _Run(Hooks):
    """The hooks, wrappers and records of one generate."""

    def __init__(self, model, rc, knobs: dict, forcing, stream=None):
        super().__init__()
        self.model, self.rc, self.knobs, self.forcing = model, rc, knobs, forcing
        self.stream = stream  # records.Stream: each record written as it is made, none kept
        self.cfg = model.config.get_text_config()
        self.C = model.config.canvas_length
        self.V = self.cfg.vocab_size
        self.W = self.cfg.sliding_window
        self.types = list(self.cfg.layer_types)
        self.internals = rc.capture == "internals"
        self.records: list = []
        self.decisions: list = []
        self.forced: list[tuple[str, list[int]]] = []
        self.notes: list[str] = []
        self.encoder_calls = 0
        self.mode = None  # "encode" | "denoise"
        self.block, self.step = 0, -1
        self.positions: list[int] = []
        self.cached = 0  # rows in the cache before this encoder pass
        self.pending_init = False
        self.cur: _Step | None = None
        self.last_argmax_margins = self.last_argmax = None
        self.history: list[list[int]] = []
        self.blocks = 0

    # -- names and records
    def name(self, rest: str) -> str:
        if self.mode == "denoise":
            return names.denoise(self.block, self.step, rest)
        return rest if self.encoder_calls <= 1 else names.encode(self.encoder_calls - 2, rest)

    def mask(self, L: int | None) -> str:
        sliding = L is not None and self.types[L] == "sliding_attention"
        if self.mode == "denoise":
            return f"bidirectional,sliding:{self.W}" if sliding else "bidirectional"
        return f"sliding:{self.W}" if sliding else "causal"

    def add(self, rest: str, t, L: int | None = None, positions=None) -> None:
        import torch

        name = self.name(rest)
        p = registered(name)
        if (
            getattr(p, "stored", None) == "f32"
            and t.is_floating_point()
            and t.dtype != torch.float32
        ):
            t = t.float()
        arr, dt = to_numpy(t)
        attrs = {
            "path": "denoise" if self.mode == "denoise" else "encode",
            "mask": self.mask(L),
            "positions": list(self.positions if positions is None else positions),
        }
        if self.forced:
            attrs["forced"] = self.forcing.digest
        (self.records.append if self.stream is None else self.stream.add)(
            Record(name, arr, dt, attrs)
        )

    def decide(self, name: str, values, margins, own=None) -> None:
        registered(name)
        values = np.asarray(values, dtype=np.int64)
        m = None if margins is None else np.asarray(margins, dtype=np.float32).reshape(-1)
        self.decisions.append(Decision(name, values, m))
        if self.forcing is not None:
            over = [] if own is None else rows_differing(values, own)
            self.forced.append((name, over))

    # -- forcing: REF's values, checked as they are consumed
    def forced_values(self, name: str, shape: tuple, low: int, high: int) -> np.ndarray:
        v = self.forcing.values(name)
        where = f"--force-decisions {self.forcing.path}"
        if v is None:
            raise OracleError(f"{where}: decision {name} is missing (this run needs it)")
        if tuple(v.shape) != tuple(shape):
            raise OracleError(
                f"{where}: decision {name} has shape {list(v.shape)}, this run needs {list(shape)}"
            )
        bad = v[(v < low) | (v >= high)]
        if bad.size:
            raise OracleError(
                f"{where}: decision {name}: value {int(bad[0])} outside [{low}, {high})"
            )
        return v

    # -- install / remove
    def __enter__(self):
        try:
            self._install()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def _install(self):
        m = self.model
        enc, dec = m.model.encoder, m.model.decoder
        self.hook(enc, self._on_encoder, pre=True)
        self.hook(
            enc.language_model.embed_tokens, lambda mod, a, out: self.add("embed.out", out[0])
        )
        for L, layer in enumerate(enc.language_model.layers):
            self._hook_layer(L, layer)
        self.hook(dec, self._on_decoder, pre=True)
        self.hook(dec.embed_tokens, lambda mod, a, out: self.add("embed.out", out[0]))
        sc = dec.self_conditioning
        self.hook(
            sc,
            lambda mod, a, kw: self.add(
                "sc.soft", (a[1] if len(a) > 1 else kw["self_conditioning_signal"])[0]
            ),
            pre=True,
        )
        if self.internals:
            self.hook(sc.down_proj, lambda mod, a, out: self.add("sc.mlp_out", out[0]))
        self.hook(sc, lambda mod, a, out: self.add("sc.out", out[0]))
        for L, layer in enumerate(dec.layers):
            self._hook_layer(L, layer)
        self.hook(dec.norm, lambda mod, a, out: self.add("final_norm.out", out[0]))
        if self.internals:
            self.hook(m.lm_head, lambda mod, a, out: self.add("logits.uncapped", out[0]))
        self._wrap_generation()
        if self.internals:
            self._patch_attention()

    # -- passes
    def _on_encoder(self, mod, args, kwargs):
        pos = kwargs.get("position_ids")
        if pos is None:
            raise OracleError("the encoder was called without position_ids (transformers changed?)")
        self.mode = "encode"
        self.encoder_calls += 1
        self.positions = [int(p) for p in pos[0].tolist()]
        self.cached = self.positions[0]
        self.block = self.encoder_calls - 1  # the block its cache is for
        self.step = -1
        self.pending_init = True

    def _on_decoder(self, mod, args, kwargs):
        self.mode = "denoise"
        self.step += 1
        self.positions = [int(p) for p in kwargs["decoder_position_ids"][0].tolist()]
        self.cur = _Step()
        self.add("canvas", kwargs["decoder_input_ids"][0])

    # -- a layer's points (the same names in every pass)
    def _hook_layer(self, L: int, layer):
        lay = lambda rest: names.layer(L, rest)  # noqa: E731
        self.hook(
            layer,
            lambda mod, a, kw: self.add(
                lay("hidden_in"), (a[0] if a else kw["hidden_states"])[0], L
            ),
            pre=True,
        )
        self.hook(layer.self_attn, lambda mod, a, out: self.add(lay("attn_out"), out[0][0], L))
        if self.internals:
            self.hook(
                layer.pre_feedforward_layernorm,
                lambda mod, a, kw: self.add(lay("attn_residual"), a[0][0], L),
                pre=True,
            )
            self.hook(layer.mlp, lambda mod, a, out: self.add(lay("dense_mlp.out"), out[0], L))
        self.hook(
            layer.post_feedforward_layernorm_1,
            lambda mod, a, out: self.add(lay("dense_mlp.branch"), out[0], L),
        )
        router = layer.router
        if self.internals:
            self.hook(router.proj, lambda mod, a, out: self.add(lay("router.logits"), out, L))
        self._wrap_router(L, router)
        if self.internals:
            self._tap_experts(L, layer.experts)
            self.hook(layer.experts, lambda mod, a, out: self.add(lay("moe.out"), out, L))
        self.hook(
            layer.post_feedforward_layernorm_2,
            lambda mod, a, out: self.add(lay("moe.branch"), out[0], L),
        )
        self.hook(
            layer.post_feedforward_layernorm,
            lambda mod, a, out: self.add(lay("mlp_out"), out[0], L),
        )
        self.hook(layer, lambda mod, a, out: self.add(lay("hidden_out"), out[0], L))

    def _wrap_router(self, L: int, router):
        """Record `router.topk` from what transformers' router returned; under forcing answer its
        one `torch.topk` with the forced experts and the router's own probabilities at them
        (force.intercept_topk)."""
        import torch

        run = self

        def answer(probs, own):
            if run.forcing is None:
                return None
            # missing, shape, range and repeated experts refused
            name = run.name(names.layer(L, "router.topk"))
            k, E = router.config.top_k_experts, router.config.num_experts
            run.forcing.require(name, len(run.positions), k, E)
            return torch.as_tensor(run.forcing.values(name), device=own.device)

        def after(result, own, used):
            probs, weights, idx = result
            p = probs.float().cpu().numpy()
            chosen = idx.cpu().numpy()
            margins = np.array(
                [margin_of(p[r], chosen[r]) for r in range(len(chosen))], dtype=np.float32
            )
            run.decide(
                run.name(names.layer(L, "router.topk")), chosen, margins, own=own.cpu().numpy()
            )

        self.on_close(
            intercept_topk(
                router,
                refuse=lambda calls: (
                    f"{FAMILY} layer {L}: its router called torch.topk {calls} times, not once "
                    "(transformers changed?)"
                ),
                answer=answer,
                after=after,
            )
        )

    def _tap_experts(self, L: int, experts):
        ExpertTap = expert_tap_class()
        orig = experts.forward

        def forward(*args, **kwargs):
            tap = ExpertTap(experts)
            with tap:
                out = orig(*args, **kwargs)
            for e in sorted(tap.outs):  # ascending expert id, each its rows ascending
                tok, y = tap.outs[e]
                tok = tok.cpu().numpy()
                order = np.argsort(tok, kind="stable")
                pos = [self.positions[i] for i in tok[order]]
                self.add(names.expert(L, e, "out"), y[order.tolist()], L, pos)
            return out

        self.shadow(experts, "forward", forward)

    def _patch_attention(self):
        """q, k, v after their norms and RoPE, and the attention probabilities, as transformers'
        eager attention function receives and returns them (it is looked up at call time)."""
        import torch

        mod = sys.modules[type(self.model.model.decoder.layers[0].self_attn).__module__]
        orig = mod.eager_attention_forward
        run = self

        def wrapped(module, query, key, value, attention_mask, *a, **kw):
            out, weights = orig(module, query, key, value, attention_mask, *a, **kw)
            L, T = module.layer_idx, query.shape[2]
            lay = lambda rest: names.layer(L, rest)  # noqa: E731
            run.add(lay("q"), query[0].transpose(0, 1), L)
            run.add(lay("k"), key[0, :, -T:].transpose(0, 1), L)
            run.add(lay("v"), value[0, :, -T:].transpose(0, 1), L)
            w = weights[0]
            if run.mode == "encode" and w.shape[-1] < run.cached + T:
                # A sliding layer's cache holds only the last W-1 rows: the earlier keys, outside
                # every row's window, are the +0.0 of masked entries (DG16: every cached position).
                w = torch.nn.functional.pad(w, (run.cached + T - w.shape[-1], 0))
            run.add(lay("attn_probs"), w, L)
            return out, weights

        mod.eager_attention_forward = wrapped
        self.on_close(lambda: setattr(mod, "eager_attention_forward", orig))

    # -- the generation loop's decisions
    def _wrap_generation(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen

        m, run = self.model, self
        # The step's logits: the forward generate calls is `self.forward` (not the module call).
        orig_forward = m.forward

        def forward(*args, **kwargs):
            out = orig_forward(*args, **kwargs)
            if run.mode == "denoise":
                run.add("logits", out.logits[0])
            return out

        self.shadow(m, "forward", forward)

        proc = gen.LinearTemperatureScheduleLogitsProcessor
        orig_call = proc.__call__

        def tempered(p, input_ids, scores, cur_step):
            out = orig_call(p, input_ids, scores, cur_step)
            run.cur.tempered = out
            run.add("logits.tempered", out[0])
            ent = torch.distributions.Categorical(logits=out).entropy()
            run.add("entropy", ent[0])
            return out

        proc.__call__ = tempered
        self.on_close(lambda: setattr(proc, "__call__", orig_call))

        class StepMode(TorchFunctionMode):
            """`sampled` (the one multinomial) and `argmax` (of the tempered logits)."""

            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                cur = run.cur
                if func is torch.multinomial and cur is not None and cur.tempered is not None:
                    probs = args[0]
                    if run.forcing is not None:
                        v = run.forced_values(run.name("sampled"), (run.C,), 0, run.V)
                        out = torch.as_tensor(v, device=probs.device).view(-1, 1)
                    else:
                        out = func(*args, **kwargs)
                    cur.sampled = out.view(-1).cpu().numpy()
                    # its margin: the probability it was drawn with (DG13.2), its own when forced
                    cur.sampled_p = probs.gather(-1, out).view(-1).float().cpu().numpy()
                    return out
                out = func(*args, **kwargs)
                if (
                    func in (torch.argmax, torch.Tensor.argmax)
                    and cur is not None
                    and args
                    and args[0] is cur.tempered
                ):
                    cur.own_argmax = out.view(-1).cpu().numpy()
                    if run.forcing is not None:
                        v = run.forced_values(run.name("argmax"), (run.C,), 0, run.V)
                        out = torch.as_tensor(v, device=out.device, dtype=out.dtype).view(out.shape)
                    cur.argmax = out.view(-1).cpu().numpy()
                return out

        orig_step = m._denoising_step

        def denoising_step(*args, **kwargs):
            with StepMode():
                return orig_step(*args, **kwargs)

        self.shadow(m, "_denoising_step", denoising_step)

        orig_sampler = m._prepare_sampler

        def prepare_sampler(generation_config):
            s = orig_sampler(generation_config)
            run._wrap_sampler(s)
            return s

        self.shadow(m, "_prepare_sampler", prepare_sampler)

        orig_crit = m._prepare_diffusion_stopping_criteria

        def prepare_criteria(generation_config):
            c = orig_crit(generation_config)
            if c is None:
                raise OracleError(
                    "transformers built no diffusion stopping criteria (a knob is None)"
                )
            return _StopProxy(run, c)

        self.shadow(m, "_prepare_diffusion_stopping_criteria", prepare_criteria)

        orig_final = m._finalize_canvas  # a staticmethod: called without self

        def finalize(input_ids, *args, **kwargs):
            run._on_commit(input_ids[0, -run.C :].cpu().numpy())
            return orig_final(input_ids, *args, **kwargs)

        self.shadow(m, "_finalize_canvas", finalize)

    def _wrap_sampler(self, sampler):
        import torch

        run = self
        orig_init, orig_accept = sampler.initialize_canvas, sampler.accept_canvas

        def initialize_canvas(batch_size, device):
            if run.pending_init:  # the block's first call (DG19; also with a canvas passed)
                run.pending_init = False
                name = names.denoise_block(run.block, "init_canvas")
                if run.forcing is not None:
                    v = run.forced_values(name, (run.C,), 0, run.V)
                    out = torch.as_tensor(v, device=device).view(1, -1)
                else:
                    out = orig_init(batch_size, device)
                run.decide(name, out[0].cpu().numpy(), None)
                return out
            cur = run.cur
            if run.forcing is not None:
                name = run.name("renoise")
                v = run.forced_values(name, (run.C,), -1, run.V)
                wrong = np.nonzero((v == -1) != (cur.accept == 1))[0]
                if wrong.size:
                    raise OracleError(
                        f"--force-decisions {run.forcing.path}: decision {name} row {int(wrong[0])}: "
                        f"{int(v[wrong[0]])} where accept is {int(cur.accept[wrong[0]])} (-1 exactly where accepted)"
                    )
                out = torch.as_tensor(np.where(v < 0, 0, v), device=device).view(1, -1)
            else:
                out = orig_init(batch_size, device)
            drawn = out[0].cpu().numpy()
            cur.renoise = np.where(cur.accept == 1, -1, drawn)
            return out

        def accept_canvas(current, denoiser, logits, cur_step):
            accepted = orig_accept(current, denoiser, logits, cur_step)
            cur = run.cur
            own = sampler.accepted_token_mask[0].cpu().numpy().astype(np.int64)
            mask = own
            if run.forcing is not None:
                mask = run.forced_values(run.name("accept"), (run.C,), 0, 2)
                fm = torch.as_tensor(mask == 1, device=current.device).view(1, -1)
                sampler.accepted_token_mask = fm
                accepted = torch.where(fm, denoiser, current)
            # x_j = cumsum - sorted entropy, as the sampler compares it with the bound (DG13.3)
            ent = torch.distributions.Categorical(logits=logits).entropy()
            srt, idx = torch.sort(ent, dim=-1, descending=False)
            x_sorted = (torch.cumsum(srt, dim=-1) - srt).float()
            x = torch.zeros_like(x_sorted).scatter(-1, idx, x_sorted)[0].cpu().numpy()
            bound = np.float32(sampler.entropy_bound)
            cur.accept = np.asarray(mask, dtype=np.int64)
            cur.own_accept = own
            cur.accept_margins = np.where(cur.accept == 1, bound - x, x - bound).astype(np.float32)
            return accepted

        self.shadow(sampler, "initialize_canvas", initialize_canvas)
        self.shadow(sampler, "accept_canvas", accept_canvas)

    def _on_stop(self, crit, argmax_canvas, logits, kwargs):
        import torch

        cur = self.cur
        S, thr = crit.stability_threshold, crit.confidence_threshold
        now = argmax_canvas[0].cpu().numpy().tolist()
        hist = crit.argmax_canvas_history
        if S == 0:
            stable = True
        elif hist is None:  # transformers' history starts as -1: never equal to a canvas
            stable = False
        else:
            stable = bool((hist == argmax_canvas[None, :, :]).all(dim=-1).all(dim=0)[0])
        run_len = 0
        for prev in reversed(self.history):
            if prev != now:
                break
            run_len += 1
        if stable != (run_len >= S):
            self.notes.append(
                f"block {self.block} step {self.step}: stopping criteria's history says stable={stable}, "
                f"the block's argmax canvases give a run of {run_len} (threshold {S})"
            )
        ent = torch.distributions.Categorical(logits=logits).entropy()
        mu = torch.mean(ent, dim=-1)
        confident = bool((mu < thr)[0])
        mu = np.float32(mu[0].float().cpu().item())
        stop_t = crit(argmax_canvas, logits, **kwargs)
        own = np.array([stable, confident, bool(stop_t[0])], dtype=np.int64)
        values = own
        if self.forcing is not None:
            values = self.forced_values(self.name("stop"), (3,), 0, 2)
            stop_t = torch.tensor([bool(values[2])], device=stop_t.device)
        st, cf = bool(values[0]), bool(values[1])
        stab_m = np.float32(run_len - S) if st else np.float32(S - run_len)
        conf_m = np.float32(np.float32(thr) - mu) if cf else np.float32(mu - np.float32(thr))
        margins = np.array([stab_m, conf_m, conf_m if st else stab_m], dtype=np.float32)
        self.history.append(now)
        # DG16's order for the step: argmax, sampled, accept, renoise, stop
        t = cur.tempered[0].float().cpu().numpy()
        am = _margin_of(t, cur.argmax)
        self.last_argmax_margins, self.last_argmax = am, cur.argmax.copy()
        self.decide(self.name("argmax"), cur.argmax, am, own=cur.own_argmax)
        self.decide(self.name("sampled"), cur.sampled, cur.sampled_p)
        self.decide(self.name("accept"), cur.accept, cur.accept_margins, own=cur.own_accept)
        self.decide(self.name("renoise"), cur.renoise, None)
        self.decide(self.name("stop"), values, margins, own=own)
        return stop_t

    def _on_commit(self, commit: np.ndarray):
        name = names.denoise_block(self.block, "commit")
        if self.last_argmax is None or not np.array_equal(commit, self.last_argmax):
            raise RuntimeError(
                f"{name}: the committed canvas is not the last step's argmax (transformers changed?)"
            )
        if self.forcing is not None:
            ref = self.forcing.values(name)
            if ref is not None and not np.array_equal(np.asarray(ref).reshape(-1), commit):
                raise OracleError(
                    f"--force-decisions {self.forcing.path}: decision {name} is {np.asarray(ref).tolist()}, "
                    f"this run commits {commit.tolist()} (DG17: a defect between the two)"
                )
        registered(name)
        self.decisions.append(Decision(name, commit.astype(np.int64), self.last_argmax_margins))
        self.blocks += 1
        self.mode = None


class _StopProxy:
    """The stopping criteria as generate calls them (`crit(argmax, logits)`, `crit.reset()`)."""

    def __init__(self, run: _Run, crit):
        self.run, self.crit = run, crit

    def reset(self):
        self.crit.reset()
        self.run.history = []

    def __call__(self, argmax_canvas, logits, **kwargs):
        return self.run._on_stop(self.crit, argmax_canvas, logits, kwargs)


def _check_tokens(model, tokens: list[int], knobs: dict) -> None:
    cfg = model.config.get_text_config()
    if not tokens:
        raise OracleError("--tokens: empty prompt")
    bad = [t for t in tokens if not 0 <= t < cfg.vocab_size]
    if bad:
        raise OracleError(f"--tokens: ids {bad[:5]} outside the vocabulary [0, {cfg.vocab_size})")
    C = model.config.canvas_length
    blocks = -(-knobs["max_new_tokens"] // C)
    P = getattr(cfg, "max_position_embeddings", None)
    if P is not None and len(tokens) + blocks * C > P:
        raise OracleError(
            f"--tokens/--generate: {len(tokens)} prompt tokens plus {blocks} canvases of {C} = "
            f"{len(tokens) + blocks * C} positions exceed max_position_embeddings {P}"
        )


def capture(
    model,
    model_dir,
    tokens: list[int],
    rc,
    det: dict | None,
    given: dict,
    forcing=None,
    stream=None,
):
    """The `trace` verb for diffusion_gemma: the prompt's encoder pass, then (--generate N > 0)
    transformers' generate with max_new_tokens N, recorded as DG16 says; with `stream`
    (records.Stream) each tensor written as it is recorded."""
    import torch

    det = det if det is not None else {"use_deterministic_algorithms": None, "refusals": []}
    cfg = model.config.get_text_config()
    knobs = resolve_knobs(model_dir, given, cfg.vocab_size, rc.generate)
    _check_tokens(model, tokens, knobs)
    if forcing is not None:  # a trace of another prompt or other weights cannot steer this one
        forcing.check_prompt(tokens)
        forcing.check_weights(model_weights_digest(model, model_dir))
    dev = execution_device(model.model.decoder.embed_tokens, rc)

    def go():
        from transformers import DynamicCache
        from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
            EntropyBoundSamplerConfig,
        )

        torch.manual_seed(rc.seed)  # the generator generate draws from (DG19)
        ids = torch.tensor([tokens], device=dev)
        if stream is not None:
            stream.begin()
        with (
            _Run(model, rc, knobs, forcing, stream) as run,
            torch.no_grad(),
            torch.autocast(device_type=rc.device, enabled=False),
        ):
            if rc.generate == 0:
                # transformers' generate refuses max_new_tokens 0: its own prompt pass, alone.
                n = len(tokens)
                cache = DynamicCache(config=model.config.get_text_config(decoder=True))
                pos = torch.arange(n, dtype=torch.int32, device=dev)[None]
                x, masks = model._prepare_encoder_inputs(
                    input_ids=ids,
                    attention_mask=torch.ones((1, n), dtype=torch.bool, device=dev),
                    encoder_position_ids=pos,
                    past_key_values=cache,
                    is_prefill=True,
                    canvas_length=model.config.canvas_length,
                    batch_size=1,
                )
                model.model.encoder(
                    input_ids=x, attention_mask=masks, past_key_values=cache, position_ids=pos
                )
                out = []
            else:
                seq = model.generate(
                    ids,
                    max_new_tokens=knobs["max_new_tokens"],
                    max_denoising_steps=knobs["max_denoising_steps"],
                    sampler_config=EntropyBoundSamplerConfig(entropy_bound=knobs["entropy_bound"]),
                    t_min=knobs["t_min"],
                    t_max=knobs["t_max"],
                    stability_threshold=knobs["stability_threshold"],
                    confidence_threshold=knobs["confidence_threshold"],
                    eos_token_id=knobs["eos_token_id"],
                    pad_token_id=knobs["pad_token_id"],
                    cache_implementation="dynamic",
                    return_dict_in_generate=True,
                )
                out = [int(t) for t in seq.sequences[0, len(tokens) :].tolist()]
        return run, out

    run, out = deterministic(go, det)
    prov = provenance(model, model_dir, rc, det, tokens, knobs, run, out)
    if forcing is not None:
        prov["forced_decisions"] = forcing.provenance(run.forced)
    if run.notes:
        prov["notes"] = run.notes
    return Capture(run.records, run.decisions, prov)


def provenance(model, model_dir, rc, det, tokens, knobs, run, out) -> dict:
    """The shared run record (records.run_provenance) with diffusion_gemma's family record and its
    generation: the knobs, the generator, the blocks committed and the tokens generated."""
    import torch

    cfg = model.config
    tc = cfg.get_text_config()
    gen = {
        k: knobs[k]
        for k in (
            "max_new_tokens",
            "max_denoising_steps",
            "entropy_bound",
            "t_max",
            "t_min",
            "stability_threshold",
            "confidence_threshold",
            "eos_token_id",
            "pad_token_id",
        )
    }
    gen = {"max_new_tokens": gen.pop("max_new_tokens"), "canvas_length": cfg.canvas_length, **gen}
    emb = model.model.decoder.embed_tokens
    return run_provenance(
        model,
        model_dir,
        rc,
        det,
        tokens,
        "trace",
        experts_implementation=tc._experts_implementation,
        family={
            "family": FAMILY,
            "layer_types": list(tc.layer_types),
            "sliding_window": tc.sliding_window,
            "canvas_length": cfg.canvas_length,
            "final_logit_softcapping": tc.final_logit_softcapping,
            "embed_scale": float(emb.scalar_embed_scale),
            "tied_head": model.lm_head.weight is emb.weight,
            "rope_parameters": tc.rope_parameters,
            "cache": "DynamicCache",
        },
        extra={
            "generation": gen,
            # torch's global generator, seeded with --seed before generate (DG15 is not reproduced)
            "rng": f"torch:{torch.device(rc.device).type}",
            "blocks": run.blocks,
            "output_tokens": out,
        },
    )
