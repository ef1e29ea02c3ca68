"""The token mixers of a decoder layer, read top to bottom: softmax attention (§8; §17 gated) and
Gated DeltaNet (§18) with its linear-attention state, each as its weights then its computation
(`attention`, `gated_deltanet`, run as model.Model._attention and ._gated_deltanet). All
arithmetic goes through ops.py."""

from __future__ import annotations

import copy
import math

import numpy as np
from tracegate import names

from . import ops, shard
from .config import Config
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint


def _vec(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    return np.array(ck.take(name, (n,)), dtype=F32)


class Attention:
    """§8's weights: q, k and v projections as one ordered matmul (see feed_forward.Mlp), o_proj,
    the optional biases (qwen2: on q, k and v only) and q_norm/k_norm (none for llama and qwen2). §17 (`cfg.gated_attention`): q_proj
    holds, per head, the query rows then the gate rows."""

    def __init__(self, cfg: Config, ck: Checkpoint, a: str):
        H, nh, nkv, d = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.gated = cfg.gated_attention
        nq = 2 * nh if self.gated else nh  # q_proj's rows: a gated head's query, then its gate
        wq = ck.take(f"{a}.q_proj.weight", (nq * d, H))
        wk = ck.take(f"{a}.k_proj.weight", (nkv * d, H))
        wv = ck.take(f"{a}.v_proj.weight", (nkv * d, H))
        self.wqkv_t = ops.transpose_weight(np.concatenate([wq, wk, wv]))
        self.wo_t = ops.transpose_weight(ck.take(f"{a}.o_proj.weight", (H, nh * d)))
        self.bqkv = self.bo = None
        if cfg.attention_bias:
            self.bqkv = np.concatenate(
                [
                    _vec(ck, f"{a}.q_proj.bias", nq * d),
                    _vec(ck, f"{a}.k_proj.bias", nkv * d),
                    _vec(ck, f"{a}.v_proj.bias", nkv * d),
                ]
            )
        if cfg.o_proj_bias:  # qwen2: q, k and v only (§8.1)
            self.bo = _vec(ck, f"{a}.o_proj.bias", H)
        if cfg.qk_norm:
            self.q_norm = _vec(ck, f"{a}.q_norm.weight", d)
            self.k_norm = _vec(ck, f"{a}.k_norm.weight", d)
        else:  # llama, qwen2: RoPE straight after the projections
            self.q_norm = self.k_norm = None
        # The heads held here (all of them but in a sharded run) and where o_proj's sum is carried.
        self.heads, self.kv_heads, self.head_dim, self.place = nh, nkv, d, shard.ONE

    def share(self, place: shard.Place) -> Attention:
        """§23.2 rank `place`'s share: the q, k and v rows (a gated head's query and gate rows)
        and biases of its block of heads and kv heads, o_proj's columns of its heads (a
        row-parallel projection carried by `place`) and o_proj's bias on the last rank only."""
        h0, h1 = place.block(self.heads)
        g0, g1 = place.block(self.kv_heads)
        d, nkv = self.head_dim, self.kv_heads
        per = 2 * d if self.gated else d  # q_proj's rows per head
        k0 = self.heads * per  # where k's rows begin, then v's
        cols = np.r_[h0 * per : h1 * per, k0 + g0 * d : k0 + g1 * d]
        cols = np.r_[cols, k0 + nkv * d + g0 * d : k0 + nkv * d + g1 * d]
        a = copy.copy(self)
        a.wqkv_t = np.ascontiguousarray(self.wqkv_t[:, cols])
        a.bqkv = None if self.bqkv is None else np.ascontiguousarray(self.bqkv[cols])
        a.wo_t = np.ascontiguousarray(self.wo_t[h0 * d : h1 * d])
        a.bo = self.bo if place.last else None
        a.heads, a.kv_heads, a.place = h1 - h0, g1 - g0, place
        return a


def attention(model, i, A: Attention, xn, pos, cap, cache):
    """§8 (§17 when gated) on xn (input_layernorm's output) at positions `pos`, over the cached
    rows of `cache` (when given) and these; returns attn_out (after o_proj). Run as
    model.Model._attention."""
    nh, nkv, d = A.heads, A.kv_heads, A.head_dim
    t = xn.shape[0]
    qkv = ops.matmul(xn, A.wqkv_t, A.bqkv)
    if A.gated:  # §17.1 per head: query, then gate
        qg = qkv[:, : 2 * nh * d].reshape(t, nh, 2 * d)
        q, gate = qg[:, :, :d], np.ascontiguousarray(qg[:, :, d:])
        nq = 2 * nh
    else:
        q, gate = qkv[:, : nh * d].reshape(t, nh, d), None
        nq = nh
    k = qkv[:, nq * d : (nq + nkv) * d].reshape(t, nkv, d)
    v = np.ascontiguousarray(qkv[:, (nq + nkv) * d :].reshape(t, nkv, d))
    o = _attend(model, i, A, q, k, v, pos, cap, cache, gate)
    if gate is not None:  # §17.3 the output gate
        o = o * ops.sigmoid(gate)
    return A.place.row_parallel(o.reshape(t, nh * d), A.wo_t, A.bo)


def _attend(model, i, A: Attention, q, k, v, pos, cap, cache, gate):
    """§8 steps 2–7: q_norm/k_norm (none for llama) and RoPE, the cache, attention; returns
    o [T, heads, d]. `gate` (§17) is captured as attn_gate before attn_probs."""
    eps = model.cfg.rms_norm_eps
    cos, sin = model.rope_of(i).tables(pos)
    if A.q_norm is not None:
        q, k = model.norm_op(q, A.q_norm, eps), model.norm_op(k, A.k_norm, eps)
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
    w = model.cfg.window(i)
    if w is None:
        o, probs = ops.attention(q, keys, vals, pos, kpos, model.scale)
    else:  # §22.3 a sliding layer: key c visible to row r iff p − W < kpos[c] ≤ p
        kp, qp = np.asarray(kpos)[None, :], np.asarray(pos)[:, None]
        visible = (kp <= qp) & (kp > qp - w)
        o, probs = ops.attention_visible(q, keys, vals, visible, model.scale)
    cap.tensor(names.layer(i, "attn_probs"), probs, pos, internal=True)
    return o


class LinearState:
    """§18: a linear-attention layer's conv state C [conv_dim, K−1] and recurrent state
    S [nv, dk, dv], all +0.0 before position 0, and the position of the next row they expect."""

    def __init__(self, cfg: Config):
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        self.conv = np.zeros((2 * nk * dk + nv * dv, cfg.linear_conv_kernel_dim - 1), dtype=F32)
        self.rec = np.zeros((nv, dk, dv), dtype=F32)
        self.next = 0


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


def gated_deltanet(model, i, G: GatedDeltaNet, xn, pos, cap, cache):
    """§18 the mixer on xn (input_layernorm's output) at positions `pos`, which must continue the
    layer's state in `cache` (a fresh state without one); returns attn_out. Run as
    model.Model._gated_deltanet."""
    cfg = model.cfg
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
