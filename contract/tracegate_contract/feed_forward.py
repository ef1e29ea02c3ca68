"""The feed-forward blocks of a decoder layer, read top to bottom: the gated SiLU MLP (§9: a dense
layer's block, each routed expert, the shared expert), the sparse MoE block's weights with its
optional shared expert (§10, §19), and the MoE block itself (`moe`, run as model.Model._moe).
All arithmetic goes through ops.py."""

from __future__ import annotations

import copy

import numpy as np
from tracegate import names

from . import ops, shard
from .capture import Capture
from .config import Config
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint


class Mlp:
    """Gated SiLU MLP (§9). gate and up share one ordered matmul: their outputs are computed
    independently column by column, so concatenating them changes no bit."""

    def __init__(self, gate_up: np.ndarray, down: np.ndarray, bias=None, gelu: bool = False):
        """gate_up: [2I, H], the gate rows then the up rows; down: [H, I]; bias (llama's
        mlp_bias): (gate and up biases concatenated, down's); gelu: §22.2 gelu_pytorch_tanh for
        SiLU (Gemma 3)."""
        self.inter = down.shape[1]
        self.act = ops.gelu_tanh if gelu else ops.silu
        self.wgu_t = ops.transpose_weight(gate_up)
        self.wd_t = ops.transpose_weight(down)
        self.bgu, self.bd = bias if bias is not None else (None, None)
        self.place = shard.ONE  # where down's sum is carried (§23.3)

    @classmethod
    def load(
        cls, ck: Checkpoint, prefix: str, hidden: int, inter: int, bias=False, gelu=False
    ) -> Mlp:
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
        return cls(np.concatenate([g, u]), down, b, gelu)

    def share(self, place: shard.Place) -> Mlp:
        """§23.2 rank `place`'s share: gate's and up's rows (and biases) of its block of the
        intermediate size, down's columns of that block (row-parallel, carried by `place`) and
        down's bias on the last rank only."""
        i0, i1 = place.block(self.inter)
        cols = np.r_[i0:i1, self.inter + i0 : self.inter + i1]
        m = copy.copy(self)
        m.wgu_t = np.ascontiguousarray(self.wgu_t[:, cols])
        m.bgu = None if self.bgu is None else np.ascontiguousarray(self.bgu[cols])
        m.wd_t = np.ascontiguousarray(self.wd_t[i0:i1])
        m.bd = self.bd if place.last else None
        m.inter, m.place = i1 - i0, place
        return m

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gu = ops.matmul(x, self.wgu_t, self.bgu)
        h = self.act(gu[:, : self.inter]) * gu[:, self.inter :]
        return self.place.row_parallel(h, self.wd_t, self.bd)


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
        return router_t, [Mlp(gu[e], dn[e]) for e in range(E)]
    return router_t, [Mlp.load(ck, f"{mlp}.experts.{e}", H, I) for e in range(E)]


class Moe:
    """§10's router (Wᵀ) and experts under `mlp`, and §19's shared expert where the config gives
    one (`shared_expert_intermediate_size`)."""

    def __init__(self, cfg: Config, ck: Checkpoint, mlp: str):
        self.router_t, self.experts = load_router_and_experts(ck, mlp, cfg)
        self.shared = SharedExpert(cfg, ck, mlp) if cfg.shared_expert_intermediate_size else None
        # The experts held here (all but under ep) and where their combine is carried (§23.3).
        self.held, self.place = range(len(self.experts)), shard.ONE

    def share(self, place: shard.Place) -> Moe:
        """§23.2 rank `place`'s share. tp: every expert's MLP split by columns (its own carry);
        the combine is then local. ep: the experts of its block of num_experts, whole, the
        others not held; the combine is carried by `place`. Router and shared gate whole."""
        m = copy.copy(self)
        if place.mode == "ep":
            e0, e1 = place.block(len(self.experts))
            m.held, m.place = range(e0, e1), place
            m.experts = [x if e in m.held else None for e, x in enumerate(self.experts)]
        else:
            m.experts = [x.share(place) for x in self.experts]
        m.shared = None if self.shared is None else self.shared.share(place)
        return m


class SharedExpert:
    """§19: a gated MLP beside the routed experts, scaled by the sigmoid of its own one-output
    gate (`mlp.shared_expert_gate.weight` [1, H])."""

    def __init__(self, cfg: Config, ck: Checkpoint, mlp: str):
        H, SI = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.mlp = Mlp.load(ck, f"{mlp}.shared_expert", H, SI)
        self.gate_t = ops.transpose_weight(ck.take(f"{mlp}.shared_expert_gate.weight", (1, H)))

    def share(self, place: shard.Place) -> SharedExpert:
        """§23.2: the MLP split by columns (tp and ep alike), its one-output gate whole."""
        s = copy.copy(self)
        s.mlp = self.mlp.share(place)
        return s

    def add_to(self, i: int, routed: np.ndarray, x: np.ndarray, pos, cap: Capture) -> np.ndarray:
        """§19 steps 3–4: routed ⊕ (sigmoid(sg) ⊗ sh), the routed sum complete first."""
        sg = ops.matmul(x, self.gate_t)
        cap.tensor(names.layer(i, "shared_expert.gate"), sg, pos, internal=True)
        sh = self.mlp(x)
        cap.tensor(names.layer(i, "shared_expert.out"), sh, pos, internal=True)
        return routed + ops.sigmoid(sg) * sh


def moe(model, M: Moe, x: np.ndarray, pos: list[int], i: int, cap: Capture) -> np.ndarray:
    """§10: router softmax, top-k (ties to the lowest id), optional renormalisation in rank
    order, experts accumulated in ascending id with each weight ⊗ out rounded first; §19 then the
    shared expert's share added to the complete routed sum. Run as model.Model._moe (`model`
    supplies the config and the forcing)."""
    cfg = model.cfg
    g = ops.matmul(x, M.router_t)
    cap.tensor(names.layer(i, "router.logits"), g, pos, internal=True)
    p = ops.softmax(g)
    bad = np.nonzero(np.isnan(p).any(axis=-1))[0]
    if bad.size:
        raise ContractError(
            f"{names.layer(i, 'router')}: NaN router probability in row {int(bad[0])}"
        )
    chosen, margin = ops.topk(p, cfg.num_experts_per_tok)
    name = names.layer(i, "router.topk")
    forced = model.forcing.values(name) if model.forcing is not None else None
    if forced is not None:
        # Row i of the forcing decision is position i's; later positions route themselves.
        overridden = []
        for r, P in enumerate(pos):
            if P < forced.shape[0]:
                if not np.array_equal(forced[P], chosen[r]):
                    overridden.append(r)
                margin[r] = ops.margin_of(p[r], forced[P])
                chosen[r] = forced[P]
    cap.decision(name, chosen, margin)
    if forced is not None:
        cap.mark_forced(name, overridden)
    rows = np.arange(x.shape[0])[:, None]
    w = p[rows, chosen]  # [T, k] in rank (or forced) order
    if cfg.norm_topk_prob:
        w = w / ops.ordered_sum(w, axis=-1)[:, None]

    def combine(out: np.ndarray) -> np.ndarray:  # the experts held here, ascending id
        for e in M.held:
            r, j = np.nonzero(chosen == e)  # r ascending; a row picks an expert at most once
            if r.size == 0:
                continue
            y = M.experts[e](x[r])
            cap.tensor(names.expert(i, e, "out"), y, [pos[row] for row in r], internal=True)
            out[r] = out[r] + w[r, j][:, None] * y
        return out

    # Under ep the experts are spread over the ranks, and so is this sum: the carry (§23.3).
    out = M.place.carry(np.zeros_like(x), combine)
    if M.shared is not None:
        out = M.shared.add_to(i, out, x, pos, cap)
    return out
