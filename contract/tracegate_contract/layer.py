"""§11 / §20 the decoder layer: norm → token mixer → residual → norm → feed-forward → residual
(§22.4 Gemma 3: each block's output normed too, before its residual add),
with the layer's capture points (hidden_in in model.Model.layer; attn_out, mlp_out, hidden_out
here; the mixer and the feed-forward block capture their own internals). The mixer and the
feed-forward block are chosen per layer from the config."""

from __future__ import annotations

import copy

import numpy as np
from tracegate import names

from .config import FULL, Config
from .feed_forward import Mlp, Moe
from .mixers import Attention, GatedDeltaNet
from .ops import F32
from .weights import Checkpoint


class Layer:
    """Layer `i`'s weights: its two norms, its mixer (`cfg.layer_kind`: Attention or
    GatedDeltaNet) and its feed-forward block (`cfg.is_sparse`: Moe, else Mlp)."""

    def __init__(self, cfg: Config, ck: Checkpoint, i: int):
        p, H = f"{cfg.prefix}layers.{i}", cfg.hidden_size
        self.kind = cfg.layer_kind(i)
        if self.kind == FULL:
            self.mixer = Attention(cfg, ck, f"{p}.self_attn")
        else:
            self.mixer = GatedDeltaNet(cfg, ck, f"{p}.linear_attn")
        self.input_layernorm = np.array(ck.take(f"{p}.input_layernorm.weight", (H,)), dtype=F32)
        self.post_attention_layernorm = np.array(
            ck.take(f"{p}.post_attention_layernorm.weight", (H,)), dtype=F32
        )
        # §22.4 Gemma 3: the MLP's own input and output norms.
        self.pre_feedforward_layernorm = self.post_feedforward_layernorm = None
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm, self.post_feedforward_layernorm = (
                np.array(ck.take(f"{p}.{n}.weight", (H,)), dtype=F32)
                for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")
            )
        self.moe = cfg.is_sparse(i)
        if self.moe:
            self.feed_forward = Moe(cfg, ck, f"{p}.mlp")
        else:
            self.feed_forward = Mlp.load(
                ck, f"{p}.mlp", H, cfg.intermediate_size, cfg.mlp_bias, cfg.gelu_mlp
            )

    def share(self, place) -> Layer:
        """§23.2 rank `place`'s share (shard.Place): its mixer's and feed-forward block's; the
        norms whole. Only softmax attention is sharded (shard.refuse_unshardable)."""
        s = copy.copy(self)
        s.mixer, s.feed_forward = self.mixer.share(place), self.feed_forward.share(place)
        return s


def forward(model, i: int, L: Layer, x: np.ndarray, pos: list[int], cap, cache):
    """Layer `i` on rows x [T, H] at positions `pos`; `model` (model.Model) supplies the norm and
    runs the blocks (its `_attention`, `_gated_deltanet`, `_moe`)."""
    eps = model.cfg.rms_norm_eps
    xn = model.norm_op(x, L.input_layernorm, eps)
    if L.kind == FULL:
        a = model._attention(i, L.mixer, xn, pos, cap, cache)
    else:
        a = model._gated_deltanet(i, L.mixer, xn, pos, cap, cache)
    cap.tensor(names.layer(i, "attn_out"), a, pos)
    sandwich = L.pre_feedforward_layernorm is not None
    if sandwich:  # §22.4: the mixer's output normed before the residual add
        a = model.norm_op(a, L.post_attention_layernorm, eps)
    h1 = x + a
    pre = L.pre_feedforward_layernorm if sandwich else L.post_attention_layernorm
    hn = model.norm_op(h1, pre, eps)
    m = model._moe(L.feed_forward, hn, pos, i, cap) if L.moe else L.feed_forward(hn)
    cap.tensor(names.layer(i, "mlp_out"), m, pos)
    if sandwich:  # and the MLP's
        m = model.norm_op(m, L.post_feedforward_layernorm, eps)
    out = h1 + m
    cap.tensor(names.layer(i, "hidden_out"), out, pos)
    return out
