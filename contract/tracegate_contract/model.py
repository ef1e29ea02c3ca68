"""Qwen3 (dense) and Qwen3-MoE, read top to bottom: weights, layer, model, generation.

The two families differ only in the MLP of some layers (§10), so one file covers both. All
arithmetic goes through ops.py; this file only says which op runs on what, in the order of
docs/numerics.md §5–§12. The config is config.py, the capture capture.py.
"""

from __future__ import annotations

import math

import numpy as np
from tracegate import names

from . import ops
from .capture import NO_CAPTURE, Capture, StepCapture
from .config import MAX_POSITIONS, Config, check_sizes, load_config
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint, widen

__all__ = ["MAX_POSITIONS", "NO_CAPTURE", "Capture", "Config", "KVCache", "Model", "load_config"]


class KVCache:
    """Per layer, the k (normed and rotated) and v rows seen so far, with their positions."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.pos: list[list[int]] = [[] for _ in range(n_layers)]

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray, positions):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
        self.pos[layer].extend(int(p) for p in positions)
        return self.k[layer], self.v[layer], self.pos[layer]


# --------------------------------------------------------------------------------------------
# Model


def _ieee():
    """Overflow, underflow and NaN are IEEE results the contract keeps (§1), not warnings."""
    return np.errstate(all="ignore")


class _Mlp:
    """Gated SiLU MLP (§9). gate and up share one ordered matmul: their outputs are computed
    independently column by column, so concatenating them changes no bit."""

    def __init__(self, gate_up: np.ndarray, down: np.ndarray, bias=None):
        """gate_up: [2I, H], the gate rows then the up rows; down: [H, I]; bias (llama's
        mlp_bias): (gate and up biases concatenated, down's)."""
        self.inter = down.shape[1]
        self.wgu_t = ops.transpose_weight(gate_up)
        self.wd_t = ops.transpose_weight(down)
        self.bgu, self.bd = bias if bias is not None else (None, None)

    @classmethod
    def load(cls, ck: Checkpoint, prefix: str, hidden: int, inter: int, bias=False) -> _Mlp:
        g = ck.take(f"{prefix}.gate_proj.weight", (inter, hidden))
        u = ck.take(f"{prefix}.up_proj.weight", (inter, hidden))
        b = None
        if bias:
            b = (
                np.concatenate(
                    [
                        ck.take(f"{prefix}.gate_proj.bias", (inter,)),
                        ck.take(f"{prefix}.up_proj.bias", (inter,)),
                    ]
                ).astype(F32),
                np.array(ck.take(f"{prefix}.down_proj.bias", (hidden,)), dtype=F32),
            )
        down = ck.take(f"{prefix}.down_proj.weight", (hidden, inter))
        return cls(np.concatenate([g, u]), down, b)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gu = ops.matmul(x, self.wgu_t, self.bgu)
        h = ops.silu(gu[:, : self.inter]) * gu[:, self.inter :]
        return ops.matmul(h, self.wd_t, self.bd)


def load_router_and_experts(ck: Checkpoint, mlp: str, cfg: Config):
    """The router's Wᵀ and the experts' MLPs under `mlp` (§10)."""
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    router_t = ops.transpose_weight(ck.take(f"{mlp}.gate.weight", (E, H)))
    # Experts on disk: per-expert modules (what save_pretrained writes), or transformers 5's
    # fused `gate_up_proj` [E, 2I, H] (expert e: gate rows, then up rows) and `down_proj`
    # [E, H, I] — the two layouts the engine accepts; the fused pair wins when present.
    fused = f"{mlp}.experts.gate_up_proj"
    if ck.has(fused):
        gu = ck.take(fused, (E, 2 * I, H))
        dn = ck.take(f"{mlp}.experts.down_proj", (E, H, I))
        return router_t, [_Mlp(gu[e], dn[e]) for e in range(E)]
    return router_t, [_Mlp.load(ck, f"{mlp}.experts.{e}", H, I) for e in range(E)]


class _Layer:
    def __init__(self, cfg: Config, ck: Checkpoint, i: int):
        p = f"model.layers.{i}"
        H, nh, nkv, d = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        a = f"{p}.self_attn"
        wq = ck.take(f"{a}.q_proj.weight", (nh * d, H))
        wk = ck.take(f"{a}.k_proj.weight", (nkv * d, H))
        wv = ck.take(f"{a}.v_proj.weight", (nkv * d, H))
        self.wqkv_t = ops.transpose_weight(np.concatenate([wq, wk, wv]))  # one matmul, see _Mlp
        self.wo_t = ops.transpose_weight(ck.take(f"{a}.o_proj.weight", (H, nh * d)))
        if cfg.attention_bias:
            self.bqkv = np.concatenate(
                [
                    ck.take(f"{a}.q_proj.bias", (nh * d,)),
                    ck.take(f"{a}.k_proj.bias", (nkv * d,)),
                    ck.take(f"{a}.v_proj.bias", (nkv * d,)),
                ]
            ).astype(F32)
            self.bo = np.array(ck.take(f"{a}.o_proj.bias", (H,)), dtype=F32)
        else:
            self.bqkv = self.bo = None
        if cfg.qk_norm:
            self.q_norm = np.array(ck.take(f"{a}.q_norm.weight", (d,)), dtype=F32)
            self.k_norm = np.array(ck.take(f"{a}.k_norm.weight", (d,)), dtype=F32)
        else:  # llama: RoPE straight after the projections
            self.q_norm = self.k_norm = None
        self.input_layernorm = np.array(ck.take(f"{p}.input_layernorm.weight", (H,)), dtype=F32)
        self.post_attention_layernorm = np.array(
            ck.take(f"{p}.post_attention_layernorm.weight", (H,)), dtype=F32
        )
        self.moe = cfg.is_sparse(i)
        if self.moe:
            self.router_t, self.experts = load_router_and_experts(ck, f"{p}.mlp", cfg)
        else:
            self.mlp = _Mlp.load(ck, f"{p}.mlp", H, cfg.intermediate_size, cfg.mlp_bias)


class Model:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        cfg = self.cfg = load_config(model_dir)
        if cfg.hybrid:  # a Qwen3.5 family: qwen3_5.Model (open_model picks it)
            raise ContractError(
                f"{model_dir}: {cfg.model_type} is not a Qwen3 model; use open_model"
            )
        ck = Checkpoint(model_dir)
        check_sizes(cfg, ck)
        V, H = cfg.vocab_size, cfg.hidden_size
        self._embed, self._embed_dtype = ck.take_stored("model.embed_tokens.weight", (V, H))
        self.layers = [_Layer(cfg, ck, i) for i in range(cfg.num_hidden_layers)]
        self.norm = np.array(ck.take("model.norm.weight", (H,)), dtype=F32)
        if cfg.tie_word_embeddings:
            self.head_t = ops.transpose_weight(ck.take("model.embed_tokens.weight", (V, H)))
        else:
            self.head_t = ops.transpose_weight(ck.take("lm_head.weight", (V, H)))
        ck.finish()
        # --force-decisions (force.Forcing): router rows at the positions it holds are taken from it.
        self.forcing = None
        self.rope = ops.Rope(cfg.rope_theta, cfg.head_dim, scaling=cfg.rope_scaling)
        # §8.4: binary64 sqrt and division, rounded once.
        self.scale = F32(1.0 / math.sqrt(float(cfg.head_dim)))

    # §5
    def embed(self, tokens) -> np.ndarray:
        V = self.cfg.vocab_size
        for t in tokens:
            if not (0 <= int(t) < V):
                raise ContractError(f"token id {int(t)} is outside the vocabulary [0, {V})")
        rows = self._embed[np.asarray(tokens, dtype=np.int64)]
        return widen(self._embed_dtype, rows)

    # §8, §9, §10, §11
    def layer(
        self,
        i: int,
        x: np.ndarray,
        positions,
        cap: Capture = NO_CAPTURE,
        cache: KVCache | None = None,
    ):
        L = self.layers[i]
        pos = [int(p) for p in positions]
        cap.tensor(names.layer(i, "hidden_in"), x, pos)
        with _ieee():
            return self._layer(i, L, x, pos, cap, cache)

    def _layer(self, i, L, x, pos, cap, cache):
        cfg = self.cfg
        nh, nkv, d, eps = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
        )
        t = x.shape[0]

        xn = ops.rmsnorm(x, L.input_layernorm, eps)
        qkv = ops.matmul(xn, L.wqkv_t, L.bqkv)
        q = qkv[:, : nh * d].reshape(t, nh, d)
        k = qkv[:, nh * d : (nh + nkv) * d].reshape(t, nkv, d)
        v = np.ascontiguousarray(qkv[:, (nh + nkv) * d :].reshape(t, nkv, d))
        o = self._attend(i, L, q, k, v, pos, cap, cache)
        a = ops.matmul(o.reshape(t, nh * d), L.wo_t, L.bo)
        cap.tensor(names.layer(i, "attn_out"), a, pos)

        h1 = x + a
        hn = ops.rmsnorm(h1, L.post_attention_layernorm, eps)
        m = self._moe(L, hn, pos, i, cap) if L.moe else L.mlp(hn)
        cap.tensor(names.layer(i, "mlp_out"), m, pos)
        out = h1 + m
        cap.tensor(names.layer(i, "hidden_out"), out, pos)
        return out

    def norm_op(self, x, w, eps):
        """The model's RMSNorm: §6 for Qwen3 (qwen3_5.Model: §15.1). Looked up in ops at each
        call, so a patched ops.rmsnorm (gate's planted defects) reaches every norm."""
        return ops.rmsnorm(x, w, eps)

    def _attend(self, i, A, q, k, v, pos, cap, cache, gate=None):
        """§8 steps 2–7: q_norm/k_norm (none for llama) and RoPE, the cache, attention; returns
        o [T, heads, d]. `A` holds q_norm/k_norm; `gate` (§17) is captured as attn_gate before
        attn_probs."""
        eps = self.cfg.rms_norm_eps
        cos, sin = self.rope.tables(pos)
        if A.q_norm is not None:
            q, k = self.norm_op(q, A.q_norm, eps), self.norm_op(k, A.k_norm, eps)
        q = ops.Rope.apply(q, cos, sin)
        k = ops.Rope.apply(k, cos, sin)
        cap.tensor(names.layer(i, "q"), q, pos, internal=True)
        cap.tensor(names.layer(i, "k"), k, pos, internal=True)
        cap.tensor(names.layer(i, "v"), v, pos, internal=True)
        if gate is not None:
            cap.tensor(names.layer(i, "attn_gate"), gate, pos, internal=True)
        if cache is not None:
            keys, vals, kpos = cache.extend(i, k, v, pos)
        else:
            keys, vals, kpos = k, v, pos
        o, probs = ops.attention(q, keys, vals, pos, kpos, self.scale)
        cap.tensor(names.layer(i, "attn_probs"), probs, pos, internal=True)
        return o

    def _moe(self, L: _Layer, x: np.ndarray, pos: list[int], i: int, cap: Capture) -> np.ndarray:
        """§10: router softmax, top-k (ties to the lowest id), optional renormalisation in rank
        order, experts accumulated in ascending id with each weight ⊗ out rounded first."""
        cfg = self.cfg
        g = ops.matmul(x, L.router_t)
        cap.tensor(names.layer(i, "router.logits"), g, pos, internal=True)
        p = ops.softmax(g)
        bad = np.nonzero(np.isnan(p).any(axis=-1))[0]
        if bad.size:
            raise ContractError(
                f"{names.layer(i, 'router')}: NaN router probability in row {int(bad[0])}"
            )
        chosen, margin = ops.topk(p, cfg.num_experts_per_tok)
        name = names.layer(i, "router.topk")
        forced = self.forcing.values(name) if self.forcing is not None else None
        if forced is not None:
            # Row i of the forcing decision is position i's; later positions route themselves.
            overridden = 0
            for r, P in enumerate(pos):
                if P < forced.shape[0]:
                    overridden += not np.array_equal(forced[P], chosen[r])
                    margin[r] = ops.margin_of(p[r], forced[P])
                    chosen[r] = forced[P]
        cap.decision(name, chosen, margin)
        if forced is not None:
            cap.mark_forced(name, overridden)
        rows = np.arange(x.shape[0])[:, None]
        w = p[rows, chosen]  # [T, k] in rank (or forced) order
        if cfg.norm_topk_prob:
            w = w / ops.ordered_sum(w, axis=-1)[:, None]
        out = np.zeros_like(x)
        for e in range(cfg.num_experts):
            r, j = np.nonzero(chosen == e)  # r ascending; a row picks an expert at most once
            if r.size == 0:
                continue
            y = L.experts[e](x[r])
            cap.tensor(names.expert(i, e, "out"), y, [pos[row] for row in r], internal=True)
            out[r] = out[r] + w[r, j][:, None] * y
        return out

    # §11 head
    def head(self, h: np.ndarray, pos, cap: Capture = NO_CAPTURE) -> np.ndarray:
        with _ieee():
            f = self.norm_op(h, self.norm, self.cfg.rms_norm_eps)
            logits = ops.matmul(f, self.head_t)
        cap.tensor("final_norm.out", f, pos)
        cap.tensor("logits", logits, pos)
        return logits

    def forward(
        self, tokens, positions, cap: Capture = NO_CAPTURE, cache: KVCache | None = None
    ) -> np.ndarray:
        pos = [int(p) for p in positions]
        h = self.embed(tokens)
        cap.tensor("embed.out", h, pos)
        for i in range(self.cfg.num_hidden_layers):
            h = self.layer(i, h, pos, cap, cache)
        return self.head(h, pos, cap)

    def new_cache(self) -> KVCache:
        """An empty cache for cached decoding (`run`, the `layer` verb's --decode-from)."""
        return KVCache(self.cfg.num_hidden_layers)

    # §12
    def run(self, tokens, cap: Capture, generate: int = 0, cached: bool = True) -> list[int]:
        """Prefill of the prompt with capture, `logits.argmax`, then `generate` greedy steps, each
        recorded as its decision and its tensors (`StepCapture`). Returns the generated tokens."""
        n = len(tokens)
        if n == 0:
            raise ContractError("the prompt is empty")
        cache = self.new_cache() if (generate > 0 and cached) else None
        logits = self.forward(tokens, range(n), cap, cache)
        self._decide(cap, "logits.argmax", logits)
        out: list[int] = []
        lg = logits
        for s in range(generate):
            step = StepCapture(cap, s)
            if s > 0:
                if cached:
                    lg = self.forward([out[-1]], [n + s - 1], step, cache)
                else:
                    seq = list(tokens) + out
                    lg = self.forward(seq, range(len(seq)), step)
            else:  # step 0 runs no forward: its logits are the prompt's last row
                step.tensor("logits", lg, [n - 1])
            top = self._decide(
                cap, names.decode(s, "argmax"), lg[-1:], what=f"decode.{s:04d} logits"
            )
            out.append(int(top[0]))
        return out

    def _decide(
        self, cap: Capture, name: str, logits: np.ndarray, what: str = "logits"
    ) -> np.ndarray:
        """§12 argmax of each row, recorded as decision `name`; under --force-decisions the forced
        values, each with this model's margin for it (ops.margin_of)."""
        top, margin = ops.argmax_margin(logits, what=what)
        forced = self.forcing.values(name) if self.forcing is not None else None
        if forced is not None:
            overridden = int(np.count_nonzero(forced != top))
            margin = np.array(
                [ops.margin_of(row, [tok]) for row, tok in zip(logits, forced, strict=False)],
                dtype=F32,
            )
            top = forced
        cap.decision(name, top, margin)
        if forced is not None:
            cap.mark_forced(name, overridden)
        return top
