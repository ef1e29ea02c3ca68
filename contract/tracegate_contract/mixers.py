"""Qwen3.5 (dense) and Qwen3.5-MoE, both layouts (docs/numerics.md §§15–20), read top to bottom:
the linear-attention state, the two token mixers, the sparse block with its shared expert, the
model. Embedding, head, generation and decisions are Qwen3's (qwen3.Model, which this model
extends); all arithmetic goes through ops.py.
"""

from __future__ import annotations

import math

import numpy as np
from tracegate import names

from . import ops, qwen3
from .capture import NO_CAPTURE, Capture
from .config import FULL, UNUSED_PREFIXES, Config, check_sizes, load_config
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint


class LinearState:
    """§18: a linear-attention layer's conv state C [conv_dim, K−1] and recurrent state
    S [nv, dk, dv], all +0.0 before position 0, and the position of the next row they expect."""

    def __init__(self, cfg: Config):
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.conv = np.zeros((2 * nk * dk + nv * dv, cfg.linear_conv_kernel_dim - 1), dtype=F32)
        self.rec = np.zeros((nv, dk, dv), dtype=F32)
        self.next = 0


class HybridCache(qwen3.KVCache):
    """Qwen3's k/v rows for the full-attention layers, a LinearState per linear one (§18.7)."""

    def __init__(self, n_layers: int):
        super().__init__(n_layers)
        self.linear: list[LinearState | None] = [None] * n_layers


def _vec(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    return np.array(ck.take(name, (n,)), dtype=F32)


class FullAttention:
    """§17's weights: q_proj holds, per head, the query rows then the gate rows."""

    def __init__(self, cfg: Config, ck: Checkpoint, a: str):
        H, nh, nkv, d = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        wq = ck.take(f"{a}.q_proj.weight", (2 * nh * d, H))
        wk = ck.take(f"{a}.k_proj.weight", (nkv * d, H))
        wv = ck.take(f"{a}.v_proj.weight", (nkv * d, H))
        self.wqkv_t = ops.transpose_weight(np.concatenate([wq, wk, wv]))  # see qwen3._Mlp
        self.wo_t = ops.transpose_weight(ck.take(f"{a}.o_proj.weight", (H, nh * d)))
        self.bqkv = self.bo = None
        if cfg.attention_bias:
            self.bqkv = np.concatenate(
                [
                    _vec(ck, f"{a}.q_proj.bias", 2 * nh * d),
                    _vec(ck, f"{a}.k_proj.bias", nkv * d),
                    _vec(ck, f"{a}.v_proj.bias", nkv * d),
                ]
            )
            self.bo = _vec(ck, f"{a}.o_proj.bias", H)
        self.q_norm = _vec(ck, f"{a}.q_norm.weight", d)
        self.k_norm = _vec(ck, f"{a}.k_norm.weight", d)


class GatedDeltaNet:
    """§18's weights: the four input projections as one ordered matmul (outputs are independent
    column by column, so concatenating them changes no bit), the conv taps [conv_dim, K]."""

    def __init__(self, cfg: Config, ck: Checkpoint, a: str):
        H = cfg.hidden_size
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        nv, dv, K = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        )
        self.key_dim, self.value_dim = nk * dk, nv * dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        w = [
            ck.take(f"{a}.in_proj_qkv.weight", (self.conv_dim, H)),
            ck.take(f"{a}.in_proj_z.weight", (self.value_dim, H)),
            ck.take(f"{a}.in_proj_b.weight", (nv, H)),
            ck.take(f"{a}.in_proj_a.weight", (nv, H)),
        ]
        self.win_t = ops.transpose_weight(np.concatenate(w))
        self.wconv = np.ascontiguousarray(
            ck.take(f"{a}.conv1d.weight", (self.conv_dim, 1, K))[:, 0, :], dtype=F32
        )
        self.dt_bias = _vec(ck, f"{a}.dt_bias", nv)
        self.a_log = _vec(ck, f"{a}.A_log", nv)
        self.norm = _vec(ck, f"{a}.norm.weight", dv)
        self.wout_t = ops.transpose_weight(ck.take(f"{a}.out_proj.weight", (H, self.value_dim)))
        # §18.3: the §8.4 scale with d = dk (binary64 sqrt and division, rounded once).
        self.scale_k = F32(1.0 / math.sqrt(float(dk)))
        # §18.5: value head h reads key head h // (nv / nk).
        self.key_of = np.arange(nv) // (nv // nk)


class SharedExpert:
    """§19: a gated MLP beside the routed experts, scaled by the sigmoid of its own one-output
    gate (`mlp.shared_expert_gate.weight` [1, H])."""

    def __init__(self, cfg: Config, ck: Checkpoint, mlp: str):
        H, SI = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.mlp = qwen3._Mlp.load(ck, f"{mlp}.shared_expert", H, SI)
        self.gate_t = ops.transpose_weight(ck.take(f"{mlp}.shared_expert_gate.weight", (1, H)))

    def add_to(self, i: int, routed: np.ndarray, x: np.ndarray, pos, cap: Capture) -> np.ndarray:
        """§19 steps 3–4: routed ⊕ (sigmoid(sg) ⊗ sh), the routed sum complete first."""
        sg = ops.matmul(x, self.gate_t)
        cap.tensor(names.layer(i, "shared_expert.gate"), sg, pos, internal=True)
        sh = self.mlp(x)
        cap.tensor(names.layer(i, "shared_expert.out"), sh, pos, internal=True)
        return routed + ops.sigmoid(sg) * sh


class _Layer:
    def __init__(self, cfg: Config, ck: Checkpoint, i: int):
        p, H = f"{cfg.prefix}layers.{i}", cfg.hidden_size
        self.kind = cfg.layer_kind(i)
        if self.kind == FULL:
            self.attn = FullAttention(cfg, ck, f"{p}.self_attn")
        else:
            self.attn = GatedDeltaNet(cfg, ck, f"{p}.linear_attn")
        self.input_layernorm = _vec(ck, f"{p}.input_layernorm.weight", H)
        self.post_attention_layernorm = _vec(ck, f"{p}.post_attention_layernorm.weight", H)
        self.moe = cfg.is_sparse(i)
        if self.moe:  # §19: Qwen3-MoE's router and experts, then the shared expert
            self.router_t, self.experts = qwen3.load_router_and_experts(ck, f"{p}.mlp", cfg)
            self.shared = SharedExpert(cfg, ck, f"{p}.mlp")
        else:
            self.mlp = qwen3._Mlp.load(ck, f"{p}.mlp", H, cfg.intermediate_size)


class Model(qwen3.Model):
    """The Qwen3.5 families. `unused_tensors`: {prefix: count} of the tensors present and not
    read (the vision tower, the multi-token-prediction head; §20)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        cfg = self.cfg = load_config(model_dir)
        if not cfg.hybrid:
            raise ContractError(f"{model_dir}: {cfg.model_type} is not a Qwen3.5 model")
        ck = Checkpoint(model_dir)
        check_sizes(cfg, ck)
        V, H, P = cfg.vocab_size, cfg.hidden_size, cfg.prefix
        self._embed, self._embed_dtype = ck.take_stored(f"{P}embed_tokens.weight", (V, H))
        self.layers = [_Layer(cfg, ck, i) for i in range(cfg.num_hidden_layers)]
        self.norm = _vec(ck, f"{P}norm.weight", H)
        head = f"{P}embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.head_t = ops.transpose_weight(ck.take(head, (V, H)))
        self.unused_tensors = ck.finish(UNUSED_PREFIXES)
        self.forcing = None
        self.rope = ops.Rope(cfg.rope_theta, cfg.head_dim, cfg.rotary_dim)
        self.scale = F32(1.0 / math.sqrt(float(cfg.head_dim)))  # §8.4

    def norm_op(self, x, w, eps):
        """§15.1 wherever Qwen3 uses §6: the layer norms, q_norm/k_norm, the final norm."""
        return ops.rmsnorm_zero_centred(x, w, eps)

    def new_cache(self) -> HybridCache:
        return HybridCache(self.cfg.num_hidden_layers)

    # §20
    def _layer(self, i, L, x, pos, cap: Capture, cache):
        eps = self.cfg.rms_norm_eps
        xn = self.norm_op(x, L.input_layernorm, eps)
        if L.kind == FULL:
            a = self._full_attention(i, L.attn, xn, pos, cap, cache)
        else:
            a = self._gated_deltanet(i, L.attn, xn, pos, cap, cache)
        cap.tensor(names.layer(i, "attn_out"), a, pos)
        h1 = x + a
        hn = self.norm_op(h1, L.post_attention_layernorm, eps)
        if L.moe:  # §19: the routed sum (§10, renormalised), then the shared expert added
            m = L.shared.add_to(i, self._moe(L, hn, pos, i, cap), hn, pos, cap)
        else:
            m = L.mlp(hn)
        cap.tensor(names.layer(i, "mlp_out"), m, pos)
        out = h1 + m
        cap.tensor(names.layer(i, "hidden_out"), out, pos)
        return out

    # §17
    def _full_attention(self, i, A: FullAttention, xn, pos, cap, cache):
        cfg = self.cfg
        nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        t = xn.shape[0]
        qkv = ops.matmul(xn, A.wqkv_t, A.bqkv)
        qg = qkv[:, : 2 * nh * d].reshape(t, nh, 2 * d)  # per head: query, then gate
        q, gate = qg[:, :, :d], np.ascontiguousarray(qg[:, :, d:])
        k = qkv[:, 2 * nh * d : (2 * nh + nkv) * d].reshape(t, nkv, d)
        v = np.ascontiguousarray(qkv[:, (2 * nh + nkv) * d :].reshape(t, nkv, d))
        o = self._attend(i, A, q, k, v, pos, cap, cache, gate)
        og = o * ops.sigmoid(gate)
        return ops.matmul(og.reshape(t, nh * d), A.wo_t, A.bo)

    # §18
    def _gated_deltanet(self, i, G: GatedDeltaNet, xn, pos, cap, cache):
        cfg = self.cfg
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        t = xn.shape[0]
        if cache is None:
            st = LinearState(cfg)
        else:
            st = cache.linear[i] = cache.linear[i] or LinearState(cfg)
        want = list(range(st.next, st.next + t))
        if pos != want:  # the state holds rows st.next−1, st.next−2, ...: only st.next comes next
            first = next(r for r, (p, w) in enumerate(zip(pos, want, strict=True)) if p != w)
            raise ContractError(
                f"{names.layer(i, 'linear_attn')}: a linear-attention layer's state continues at position {st.next} "
                f"(from a zero state at position 0), so its rows must be at positions {st.next}..{st.next + t - 1}; "
                f"row {first} is at position {pos[first]}"
            )
        proj = ops.matmul(xn, G.win_t)  # §18.1
        c, vd = G.conv_dim, G.value_dim
        mixed, z = proj[:, :c], proj[:, c : c + vd].reshape(t, nv, dv)
        b, a = proj[:, c + vd : c + vd + nv], proj[:, c + vd + nv :]
        conv_out, st.conv = ops.causal_conv1d(mixed, G.wconv, st.conv)  # §18.2
        cap.tensor(names.layer(i, "linear.conv_out"), conv_out, pos, internal=True)
        kd = G.key_dim
        qn = ops.l2norm(conv_out[:, :kd].reshape(t, nk, dk))  # §18.3
        kn = ops.l2norm(conv_out[:, kd : 2 * kd].reshape(t, nk, dk))
        v = conv_out[:, 2 * kd :].reshape(t, nv, dv)
        cap.tensor(names.layer(i, "linear.q"), qn, pos, internal=True)
        cap.tensor(names.layer(i, "linear.k"), kn, pos, internal=True)
        qs = qn * G.scale_k
        g = ops.gdn_decay(a, G.dt_bias, G.a_log)  # §18.4
        beta = ops.sigmoid(b)
        alpha = ops.exp_to_f32(g)
        cap.tensor(names.layer(i, "linear.g"), g, pos, internal=True)
        cap.tensor(names.layer(i, "linear.beta"), beta, pos, internal=True)
        core = np.empty((t, nv, dv), dtype=F32)
        for r in range(t):  # §18.5, row by row
            kh = G.key_of
            core[r] = ops.delta_rule_step(st.rec, qs[r, kh], kn[r, kh], v[r], alpha[r], beta[r])
        st.next += t
        cap.tensor(names.layer(i, "linear.core"), core, pos, internal=True)
        norm_out = ops.gated_rmsnorm(core, G.norm, z, cfg.rms_norm_eps)  # §18.6
        cap.tensor(names.layer(i, "linear.norm_out"), norm_out, pos, internal=True)
        cap.tensor(names.layer(i, "linear.state"), st.rec[None].copy(), pos[-1:], internal=True)
        return ops.matmul(norm_out.reshape(t, vd), G.wout_t)


def open_model(model_dir: str) -> qwen3.Model:
    """The model of `model_dir`'s config: Qwen3.5's for its families, Qwen3's otherwise."""
    return Model(model_dir) if load_config(model_dir).hybrid else qwen3.Model(model_dir)


__all__ = ["NO_CAPTURE", "HybridCache", "LinearState", "Model", "SharedExpert", "open_model"]
