"""The hooks that observe transformers' modules at the shared capture points. `Hooks` holds every
forward hook and instance patch of one capture and undoes them all on close, also when the
forward raised; `Tap` is the causal LMs' (the family table's paths); diffusion_gemma.py's
generate is observed through the same `Hooks`, `registered` and `expert_tap_class`. The hooks
compute nothing themselves."""

from __future__ import annotations

import sys

import numpy as np
from tracegate import names

from .errors import OracleError
from .families import resolve
from .force import forced_answer, intercept_topk, shadow
from .linear_attn import LinearTap, active_paths
from .records import Decision, Record, argmax_decision, force_decision, margin_of, to_numpy


def registered(name: str):
    """The registry's capture point `name`. A hook for a point the registry does not know would make
    every other tool guess its layout and policy, so it is refused where it was added."""
    p = names.point(name)
    if p is None:
        raise OracleError(
            f"capture point {name!r} is not in the capture-point registry "
            "(tracegate_trace::names::POINTS, trace/src/names.rs): register it there first"
        )
    return p


class Hooks:
    """The forward hooks and instance patches of one capture, undone by `close` in reverse order."""

    def __init__(self):
        self._undo: list = []

    def hook(self, module, fn, pre=False):
        h = (
            module.register_forward_pre_hook(fn, with_kwargs=True)
            if pre
            else module.register_forward_hook(fn)
        )
        self._undo.append(h.remove)

    def shadow(self, obj, attr: str, new):
        """`obj.attr = new` on the instance for the capture; the class's stays untouched."""
        self._undo.append(shadow(obj, attr, new))

    def on_close(self, undo):
        self._undo.append(undo)

    def close(self):
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()


def expert_tap_class():
    import torch
    from torch.overrides import TorchFunctionMode

    linear = torch.nn.functional.linear

    def slice_index(w, p):
        """Which p[e] the tensor w is (a view of the stacked expert parameter), or None."""
        if w.dim() != p.dim() - 1 or tuple(w.shape) != tuple(p.shape[1:]):
            return None
        if w.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
            return None
        return (w.storage_offset() - p.storage_offset()) // p.stride(0)

    class ExpertTap(TorchFunctionMode):
        """Observes transformers' eager experts loop: for each expert, the rows it received
        (from its `torch.where`) and the output of its down projection, before the routing
        weight is applied. It computes nothing itself."""

        def __init__(self, experts):
            super().__init__()
            self.experts = experts
            self.token_idx = None
            self.outs: dict[int, tuple] = {}

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func is torch.where and len(args) == 1 and not kwargs:
                self.token_idx = out[1]
            elif func is linear:
                # Looked up at each call: accelerate's offload hook (--device-map auto, a module kept
                # in CPU memory) puts the parameter in place only once the experts' forward runs.
                e = slice_index(
                    args[1] if len(args) > 1 else kwargs["weight"], self.experts.down_proj
                )
                if e is not None:
                    self.outs[int(e)] = (self.token_idx, out)
            return out

    return ExpertTap


class Tap(Hooks):
    """Hooks at the capture points of `layers` (and, for a whole run, embed/final norm/logits).

    Records in execution order, which is the shared capture order. All hooks and patches are
    removed on exit, also when the forward raised.

    `decode=True` taps one decode step (docs/producers.md, decode steps): only the last row of
    each point (the step's row, whether the forward ran one row on the cache or recomputed the
    whole sequence), names under `decode.SSSS.` for `step` S, no embedding, no internals and
    no router decisions; `final_norm.out` only with layers; the logits always (when `whole`).

    With a `stream` (records.Stream) each record goes to the trace as it is made and `records`
    stays empty.
    """

    def __init__(
        self,
        model,
        *,
        path: str,
        positions: list[int],
        layers,
        internals: bool,
        whole: bool,
        forcing=None,
        decode: bool = False,
        step: int | None = None,
        sharding=None,
        stream=None,
    ):
        super().__init__()
        self.model, self.path, self.positions = model, path, list(positions)
        self.stream = stream
        # --distributed: each record says what part of the logical tensor this rank holds.
        self.sharding = sharding
        self.lay = resolve(model)
        self.layers, self.internals, self.whole = list(layers), internals and not decode, whole
        self.decode, self.step = decode, step
        self.records: list[Record] = []
        self.decisions: list[Decision] = []
        self.notes: list[str] = []
        self._gates: dict = {}  # layer -> its attn_gate, until _patch_attention records it
        # --force-decisions: (name, the rows overridden) per forced decision; tensors recorded
        # after the first carry `forced = <the forcing trace's digest>`.
        self.forcing = forcing
        self.forced: list[tuple[str, list[int]]] = []

    # -- recording
    def add(self, name: str, t, positions=None, layer_idx=None):
        registered(name)
        arr, dt = to_numpy(t[-1:] if self.decode else t)
        attrs = {
            "path": self.path,
            "mask": self.lay.mask(layer_idx),
            "positions": list(positions or self.positions),
        }
        # A decode step of `trace` comes after its forced logits.argmax (the first forced decision).
        if self.forced or (self.decode and self.forcing is not None and self.whole):
            attrs["forced"] = self.forcing.digest
        if self.sharding is not None:
            attrs["shard"] = self.sharding.kind(name, layer_idx)
        if self.step is not None:
            name = names.decode(self.step, name)
        (self.records.append if self.stream is None else self.stream.add)(
            Record(name, arr, dt, attrs)
        )

    def decide(self, d: Decision, scores: np.ndarray, rows: list[int]) -> None:
        """Record decision `d`, forced when a forcing trace is given."""
        if self.forcing is None:
            self.decisions.append(d)
            return
        d, overridden = force_decision(d, scores, self.forcing.values(d.name), rows)
        self.decisions.append(d)
        self.forced.append((d.name, overridden))

    # -- hook installation
    def __enter__(self):
        import torch

        lay = self.lay
        try:
            if self.whole and not self.decode:
                self.hook(lay.embed, lambda mod, a, out: self.add("embed.out", out[0]))
            for L in self.layers:
                self._hook_layer(L, lay.layers[L])
            if self.whole and (self.layers or not self.decode):
                self.hook(lay.final_norm, lambda mod, a, out: self.add("final_norm.out", out[0]))
            if self.whole:
                # The model's output logits, not the head's: a final softcap (Gemma) comes after it.
                self.hook(self.model, self._on_logits)
            if self.internals:
                self._patch_attention()
        except BaseException:
            self.close()
            raise
        self._grad = torch.no_grad()
        self._grad.__enter__()
        return self

    def __exit__(self, *exc):
        self._grad.__exit__(*exc)
        self.close()
        return False

    def _hook_layer(self, L: int, layer):
        def hidden_in(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            self.add(names.layer(L, "hidden_in"), x[0], layer_idx=L)

        self.hook(layer, hidden_in, pre=True)
        lay = self.lay
        if self.internals and L in lay.linear_layers:
            self._tap_linear(L, lay.attn(L))
        if self.internals and lay.spec.attn_gate and L not in lay.linear_layers:
            self._tap_attn_gate(L, lay.attn(L))

        def attn_out(mod, a, out):  # self-attention returns (output, weights); linear, the output
            self.add(
                names.layer(L, "attn_out"),
                (out[0] if isinstance(out, tuple) else out)[0],
                layer_idx=L,
            )

        self.hook(lay.attn(L), attn_out)
        mlp = lay.mlp(L)
        if L in lay.moe_layers and not self.decode:
            self._tap_router(L, lay.router(L))
            if self.internals:
                self._tap_experts(L, lay.experts(L))
                if lay.shared_expert(L):
                    self._tap_shared_expert(L, *lay.shared_expert(L))
        self.hook(mlp, lambda mod, a, out: self.add(names.layer(L, "mlp_out"), out[0], layer_idx=L))

        def hidden_out(mod, args, out):
            self.add(
                names.layer(L, "hidden_out"),
                (out[0] if isinstance(out, tuple) else out)[0],
                layer_idx=L,
            )

        self.hook(layer, hidden_out)

    def _tap_linear(self, L: int, module):
        """Layer L's Gated DeltaNet internals (linear_attn.LinearTap), recorded before attn_out."""
        paths = active_paths()
        if paths is None:
            raise RuntimeError("linear-attention internals need the torch paths (TorchPaths)")
        taps: list[LinearTap] = []

        def pre(mod, args, kwargs):
            taps.append(LinearTap(mod))
            paths.observer = taps[-1]

        def post(mod, args, out):
            paths.observer = None
            for name, t in taps.pop().records():
                # the state is after the call's last row: that row's position
                pos = self.positions[-1:] if name == "linear.state" else None
                self.add(names.layer(L, name), t, pos, L)

        self.hook(module, pre, pre=True)
        self.hook(module.norm, lambda mod, a, out: taps[-1].norm_out(out))
        self.hook(module, post)
        self.on_close(lambda: setattr(paths, "observer", None))

    def _tap_attn_gate(self, L: int, attn):
        """The gate half of q_proj's output, per head `[rows, heads, head_dim]` before the
        sigmoid (Qwen3.5: q_proj's output is, per head, head_dim query then head_dim gate
        values); recorded after v by _patch_attention."""
        hd = attn.head_dim

        def hook(mod, a, out):
            self._gates[L] = out[0].view(out.shape[1], -1, 2 * hd)[..., hd:]

        self.hook(attn.q_proj, hook)

    def _tap_shared_expert(self, L: int, shared, shared_gate):
        """`shared_expert.gate` [rows, 1] (the gate logit, before the sigmoid), then
        `shared_expert.out` [rows, hidden] (the shared MLP, before its gate). transformers runs
        the shared MLP first and its gate after the routed experts; the output is held until the
        gate is recorded, so the trace order is router, experts, gate, output."""
        held = []
        self.hook(shared, lambda mod, a, out: held.append(out))

        def gate(mod, a, out):
            self.add(names.layer(L, "shared_expert.gate"), out, layer_idx=L)
            self.add(names.layer(L, "shared_expert.out"), held.pop(), layer_idx=L)

        self.hook(shared_gate, gate)

    def _tap_router(self, L: int, router):
        """Layer L's router, through its one `torch.topk` call (force.intercept_topk): the
        decision is the experts that call chose, and under --force-decisions it is answered with
        the forced experts at the rows the forcing trace holds (force.forced_answer), as
        RouterForcing does where no decision is recorded."""
        answer = None
        if self.forcing is not None:
            forced = self.forcing.values(names.layer(L, "router.topk"))
            if forced is not None:
                answer = forced_answer(self.lay.family, L, router, forced, lambda: self.positions)
        self.on_close(
            intercept_topk(
                router,
                refuse=lambda calls: (
                    f"{self.lay.family} layer {L}: its router ({type(router).__name__}) called "
                    f"torch.topk {calls} times, not once: the oracle records and forces its "
                    "routing at that call (transformers changed?)"
                ),
                answer=answer,
                after=lambda result, own, used: self._on_router(L, result[0], own),
            )
        )

    def _on_router(self, L: int, logits, own):
        """`router.logits` (internals) and `router.topk`: `own`, the experts the router's own
        `torch.topk` returned, in its rank order, so the recorded routing is the one the experts
        computed with. Margins: the model's own for that choice (margin_of) over the fp32
        softmax of its logits — at an exact tie torch may have taken another index than the
        lowest, margin 0. Under forcing, decide() writes the forced rows and counts those that
        differ from `own`."""
        import torch

        if self.internals:
            self.add(names.layer(L, "router.logits"), logits, layer_idx=L)
        # The model's own probabilities: fp32 softmax of its router logits, as its router does.
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32).cpu().numpy()
        chosen = own.cpu().numpy().astype(np.int64)
        margins = np.array([margin_of(probs[r], c) for r, c in enumerate(chosen)], np.float32)
        name = names.layer(L, "router.topk")
        self.decide(Decision(name, chosen, margins), probs, self.positions)

    def _tap_experts(self, L: int, experts):
        ExpertTap = expert_tap_class()
        orig = experts.forward  # the bound, dispatching forward (eager selected at load)

        def forward(*args, **kwargs):
            tap = ExpertTap(experts)
            with tap:
                out = orig(*args, **kwargs)
            self._on_experts(L, tap)
            return out

        self.shadow(experts, "forward", forward)

    def _on_experts(self, L: int, tap):
        # Expert parallel: the tap sees the rank's own experts, numbered from 0; a rank none of
        # whose experts received a row computes nothing.
        held = self.sharding.experts(L)[1] if self.sharding else None
        if not tap.outs and held is None:
            raise RuntimeError(
                f"layer {L}: the experts tap saw no expert computation (transformers internals changed?)"
            )
        expected = {}
        topk = self.decisions[-1].values if self.decisions else None
        if topk is not None:
            for e in np.unique(topk):
                expected[int(e)] = np.nonzero((topk == e).any(-1))[0].tolist()
        if held is not None:
            # ...but one the router sent rows to must have computed: no silent hole in the shard.
            unseen = [e for e in held if e in expected and e - held.start not in tap.outs]
            if unseen:
                raise RuntimeError(
                    f"layer {L}: the router sent rows to expert {unseen[0]}, held on this rank, "
                    "and the experts tap saw no computation for it (transformers internals changed?)"
                )
        for local in sorted(tap.outs):
            tok, out = tap.outs[local]
            e = local + (held.start if held is not None else 0)
            tok = tok.cpu().numpy()
            order = np.argsort(tok, kind="stable")  # ascending token order
            rows = tok[order]
            if expected.get(e) != rows.tolist():
                self.notes.append(
                    f"layer {L} expert {e}: model routed rows {rows.tolist()}, router.topk records {expected.get(e)}"
                )
            self.add(
                names.expert(L, e, "out"),
                out[order],
                positions=[self.positions[i] for i in rows],
                layer_idx=L,
            )

    def _patch_attention(self):
        """Wrap the modeling module's eager attention function (looked up at call time) to see
        q and k after norm and RoPE, v, and the attention probabilities."""
        mods = {sys.modules[type(self.lay.attn(L)).__module__] for L in self.layers}
        for mod in mods:
            orig = getattr(mod, "eager_attention_forward", None)
            if orig is None:
                raise RuntimeError(
                    f"{mod.__name__} has no eager_attention_forward: cannot capture internals"
                )
            tapped = set(self.layers)

            def wrapped(
                module, query, key, value, attention_mask, *a, _orig=orig, _tapped=tapped, **kw
            ):
                out, weights = _orig(module, query, key, value, attention_mask, *a, **kw)
                L = getattr(module, "layer_idx", None)
                if L in _tapped:
                    self.add(names.layer(L, "q"), query[0].transpose(0, 1), layer_idx=L)
                    self.add(names.layer(L, "k"), key[0].transpose(0, 1), layer_idx=L)
                    self.add(names.layer(L, "v"), value[0].transpose(0, 1), layer_idx=L)
                    if L in self._gates:
                        self.add(names.layer(L, "attn_gate"), self._gates.pop(L), layer_idx=L)
                    self.add(names.layer(L, "attn_probs"), weights[0], layer_idx=L)
                return out, weights

            mod.eager_attention_forward = wrapped
            self.on_close(lambda mod=mod, orig=orig: setattr(mod, "eager_attention_forward", orig))

    def _on_logits(self, mod, args, out):
        logits = out.logits[0]
        self.add("logits", logits)
        if not self.decode:  # a decode step's decision is taken by _generate
            self._logits = logits.float().cpu().numpy()

    def finish(self) -> None:
        if self.whole:
            self.decide(
                argmax_decision("logits.argmax", self._logits),
                self._logits,
                list(range(len(self._logits))),
            )
