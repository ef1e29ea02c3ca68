"""A test-only producer: the numpy contract with one planted defect of a class that ports have
shipped (docs/traps.md, traps 17-20), answering the producer protocol's verbs and `serve`
(docs/producers.md). The gate's tests run it as a port would be run and require the defect to
be named at its place.

  field_plants.py --defect NAME {verb|serve} {args}

Defects:
  bf16-trunc      the trace verb's f32 tensors stored as bf16 by truncation (the low 16 bits
                  dropped) where they should be rounded to nearest even (trap 17); the
                  provenance says precision bf16. Every value is otherwise the contract's.
  bf16-rne        the same store, rounded to nearest even: the honest bf16 store (a control)
  bf16-up         the same store, rounded away from zero (a wrong mode that is not truncation:
                  a control for the truncation finding, which must not name it)
  expert-rows@L:E layer L's routed expert E computes only the first `rows` elements of its
                  output [rows, H] (an element-wise kernel dispatched over rows where it should
                  be rows x width): the rest stay zero (trap 18)
  gdn-no-repeat@L linear-attention layer L's delta rule reads query and key head h for value
                  head h, where it should read head h // (value heads / key heads): the key-head
                  repeat is missing. The kernel reads the conv output in place, so for h beyond
                  the key heads its query is a key head and its key a slice of the values; with
                  as many key heads as value heads it is correct (trap 19)
  dg-cache-prenorm@L  diffusion Gemma: layer L's prompt cache holds k and v projected from the
                  layer's input hidden state before its input_layernorm (the pre-norm residual)
                  where the prompt's own attention used the normed one; the prompt pass and its
                  recorded k and v are correct, the canvas reads the wrong cache (trap 20)
  dg-cache-prev@L     the same, from layer L-1's input normed by layer L's input_layernorm
                  (the previous layer's hidden state)
  none            the contract unchanged
"""

import os
import sys
import tempfile

import defect_cli
import numpy as np
from tracegate_contract import __main__ as cli
from tracegate_contract import diffusion_gemma, feed_forward, model, ops
from tracegate_contract.ops import F32

_current = [None]  # the layer Model.layer is running
_orig_layer = model.Model.layer


def _tracking_layer(self, i, *a, **k):
    _current[0] = i
    try:
        return _orig_layer(self, i, *a, **k)
    finally:
        _current[0] = None


def _at(defect: str) -> str:
    return defect.partition("@")[2]


def plant(defect: str) -> None:
    model.Model.layer = _tracking_layer
    if defect.startswith("expert-rows@"):
        layer, _, expert = _at(defect).partition(":")
        plant_expert_rows(int(layer), int(expert))
    elif defect.startswith("gdn-no-repeat@"):
        plant_gdn_no_repeat(int(_at(defect)))
    elif defect.startswith(("dg-cache-prenorm@", "dg-cache-prev@")):
        plant_dg_cache(defect.partition("@")[0], int(_at(defect)))
    elif defect not in ("none", "bf16-trunc", "bf16-rne", "bf16-up"):
        raise SystemExit(f"unknown defect {defect!r}")


def plant_expert_rows(at: int, expert: int) -> None:
    orig = feed_forward.Mlp.__call__
    experts = {}  # id(Mlp) -> (layer, expert id), filled as the model loads

    def call(self, x):
        y = orig(self, x)
        if _current[0] != at or experts.get(id(self)) != (at, expert):
            return y
        flat = np.zeros(y.size, dtype=y.dtype)
        n = y.shape[0]  # the grid: one thread per row, each writing one element
        flat[:n] = y.reshape(-1)[:n]
        return flat.reshape(y.shape)

    orig_init = model.Model.__init__

    def init(self, *a, **k):
        orig_init(self, *a, **k)
        for i, L in enumerate(self.layers):
            if getattr(L, "moe", False):
                for e, m in enumerate(L.feed_forward.experts):
                    experts[id(m)] = (i, e)
        if (at, expert) not in experts.values():
            raise SystemExit(f"field_plants: layer {at} has no routed expert {expert}")

    feed_forward.Mlp.__call__ = call
    model.Model.__init__ = init


def plant_gdn_no_repeat(at: int) -> None:
    orig_gdn = model.Model._gated_deltanet
    orig_step = ops.delta_rule_step
    state = {}  # the layer's conv output and head counts while it runs

    orig_conv = ops.causal_conv1d

    def causal_conv1d(mixed, w, conv):
        out, st = orig_conv(mixed, w, conv)
        if "layer" in state:
            state["conv_out"] = out
        return out, st

    def gated_deltanet(self, i, G, xn, pos, cap, cache):
        if i != at:
            return orig_gdn(self, i, G, xn, pos, cap, cache)
        cfg = self.cfg
        state.update(layer=i, row=0, G=G, cfg=cfg)
        try:
            return orig_gdn(self, i, G, xn, pos, cap, cache)
        finally:
            state.clear()

    def delta_rule_step(S, q, k, v, alpha, beta):
        if "layer" not in state:
            return orig_step(S, q, k, v, alpha, beta)
        cfg, G, r = state["cfg"], state["G"], state["row"]
        state["row"] = r + 1
        nv, dk = cfg.linear_num_value_heads, cfg.linear_key_head_dim
        kd = G.key_dim
        row = state["conv_out"][r]
        # Value head h reads the h-th head's slot of q and of k in the conv output, in place.
        qh = np.stack([row[h * dk : (h + 1) * dk] for h in range(nv)])
        kh = np.stack([row[kd + h * dk : kd + (h + 1) * dk] for h in range(nv)])
        qn = ops.l2norm(qh[None])[0] * G.scale_k
        kn = ops.l2norm(kh[None])[0]
        return orig_step(S, qn.astype(F32), kn.astype(F32), v, alpha, beta)

    model.Model._gated_deltanet = gated_deltanet
    ops.causal_conv1d = causal_conv1d  # the mixer calls them through the module
    ops.delta_rule_step = delta_rule_step


def plant_dg_cache(kind: str, at: int) -> None:
    DG = diffusion_gemma.DiffusionGemma
    orig_encode, orig_layer = DG.encode, DG.layer
    orig_extend = diffusion_gemma.Cache.extend
    seen = {}  # while an encoder pass runs: the model, and each layer's input hidden state

    def encode(self, tokens, pos, ps, cap, cache):
        seen["model"] = self
        try:
            return orig_encode(self, tokens, pos, ps, cap, cache)
        finally:
            seen.clear()

    def layer(self, i, x, pos, ps, cap, cache):
        if "model" in seen:
            seen[i] = x
        return orig_layer(self, i, x, pos, ps, cap, cache)

    def extend(self, i, k, v, pos):
        m = seen.get("model")
        if i != at or m is None or i not in seen:
            return orig_extend(self, i, k, v, pos)
        L = m.layers[i]
        if kind == "dg-cache-prenorm":
            x = seen[i]  # the residual before input_layernorm
        else:
            prev = seen.get(i - 1)
            if prev is None:
                raise SystemExit(f"field_plants: {kind}@{at} needs a layer before it")
            x = m._norm(prev, L.input_layernorm)
        k, v = _project_kv(m, i, L, x, pos)
        return orig_extend(self, i, k, v, pos)

    DG.encode, DG.layer = encode, layer
    diffusion_gemma.Cache.extend = extend


def _project_kv(m, i, L, xn, pos):
    """DiffusionGemma.attention's k and v of `xn` (DG5), as the cache-filling kernel computes
    them from the hidden state it was given."""
    cfg = m.cfg
    dt, kt = cfg.dims(i)
    t = xn.shape[0]
    cos, sin = m.rope[cfg.layer_types[i]].tables(pos)
    kr = ops.matmul(xn, L.wk_t).reshape(t, kt, dt)
    vr = ops.matmul(xn, L.wv_t).reshape(t, kt, dt) if L.sliding else kr
    k = ops.Rope.apply(m._norm(kr, L.k_norm), cos, sin)
    return k, m._plain(vr)


def bf16_bits(a: np.ndarray, mode: str) -> np.ndarray:
    """f32 values as bf16 bits: truncated, rounded to nearest even, or rounded away from zero."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    if mode == "bf16-trunc":
        out = bits >> 16
    elif mode == "bf16-rne":
        out = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    else:  # away from zero: any discarded bit rounds the magnitude up
        out = (bits + 0xFFFF) >> 16
    return out.astype(np.uint16)


def stored_bf16(run, mode: str, argv: list[str]) -> int:
    """The trace verb with every f32 tensor stored as bf16 by `mode`; other verbs unchanged."""
    if argv[:1] != ["trace"]:
        return run(argv)
    import tracegate

    out = argv[argv.index("--out") + 1]
    with tempfile.TemporaryDirectory() as tmp:
        clean = os.path.join(tmp, "f32.trace")
        argv = list(argv)
        argv[argv.index("--out") + 1] = clean
        rc = run(argv)
        if rc:
            return rc
        t = tracegate.Trace(clean)
        prov = {**t.provenance, "precision": "bf16", "dtype": "bf16"}
        with tracegate.TraceWriter(out, prov) as w:
            for name in t.names:
                a, attrs = np.array(t[name]), dict(t.attributes(name))
                if t.dtype(name) == "f32":
                    w.tensor(name, bf16_bits(a, mode), dtype="bf16", **attrs)
                else:
                    w.tensor(name, a, **attrs)
            for name, values in t.decisions.items():
                w.decision(name, np.array(values), margins=t.margins[name])
    return 0


def answer(defect: str, request: list[str]) -> int:
    sys.argv = [sys.argv[0], "--defect", defect, *request]  # the per-call command line
    if defect.startswith("bf16-"):
        return stored_bf16(cli.main, defect, request)
    return cli.main(request)


def main(argv) -> int:
    return defect_cli.main(argv, "field_plants.py", plant, answer)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
