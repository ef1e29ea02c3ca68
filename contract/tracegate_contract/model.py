"""The model, family-neutral, read top to bottom: the cache, the model (embedding, decoder layers,
head), generation and decisions (docs/numerics.md §5–§12, §§15–20, §22).

A decoder layer (layer.py) is a token mixer (mixers.py: softmax attention, Gated DeltaNet) and a
feed-forward block (feed_forward.py: the gated MLP, the sparse MoE with its optional shared
expert), each chosen per layer from the config. What a family changes is read from the config
(config.py): the layer kinds, the sizes and the family's traits (zero-centred norms, the
attention's output gate, the tensors present and not run). All arithmetic goes through ops.py;
the capture is capture.py.
"""

from __future__ import annotations

import copy
import math

import numpy as np
from tracegate import names

from . import feed_forward, force, layer, mixers, ops, shard
from .capture import NO_CAPTURE, Capture, StepCapture
from .config import MAX_POSITIONS, Config, check_sizes, load_config
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint, widen

__all__ = [
    "MAX_POSITIONS",
    "NO_CAPTURE",
    "Capture",
    "Config",
    "KVCache",
    "Model",
    "load_config",
    "open_model",
]


class KVCache:
    """Per layer, the k (normed and rotated) and v rows seen so far, with their positions; for a
    linear-attention layer its state (mixers.LinearState, §18.7)."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.pos: list[list[int]] = [[] for _ in range(n_layers)]
        self.linear: list[mixers.LinearState | None] = [None] * n_layers

    def extend(self, layer: int, k: np.ndarray, v: np.ndarray, positions):
        if self.k[layer] is None:
            self.k[layer], self.v[layer] = k, v
        else:
            self.k[layer] = np.concatenate([self.k[layer], k])
            self.v[layer] = np.concatenate([self.v[layer], v])
        self.pos[layer].extend(int(p) for p in positions)
        return self.k[layer], self.v[layer], self.pos[layer]


def _ieee():
    """Overflow, underflow and NaN are IEEE results the contract keeps (§1), not warnings."""
    return np.errstate(all="ignore")


class Model:
    """The model of `model_dir`, any family the config reader accepts. `unused_tensors`:
    {prefix: count} of the tensors present and not read (Qwen3.5's vision tower and
    multi-token-prediction head, §20); empty for the other families."""

    # The blocks a decoder layer runs, defined beside their weights (layer.py, mixers.py,
    # feed_forward.py) and run as methods of the model, whose config, rope, scale and forcing
    # they read. gate/tests/producers/defective_contract.py plants its defects by these names.
    _layer = layer.forward
    _attention = mixers.attention
    _gated_deltanet = mixers.gated_deltanet
    _moe = feed_forward.moe

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        cfg = self.cfg = load_config(model_dir)
        ck = Checkpoint(model_dir)
        check_sizes(cfg, ck)
        V, H, P = cfg.vocab_size, cfg.hidden_size, cfg.prefix
        self._embed, self._embed_dtype = ck.take_stored(f"{P}embed_tokens.weight", (V, H))
        self.layers = [layer.Layer(cfg, ck, i) for i in range(cfg.num_hidden_layers)]
        self.norm = np.array(ck.take(f"{P}norm.weight", (H,)), dtype=F32)
        head = f"{P}embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        self.head_t = ops.transpose_weight(ck.take(head, (V, H)))
        self.unused_tensors = ck.finish(cfg.unused_prefixes)
        # --force-decisions (force.Forcing): router rows at the positions it holds are taken from it.
        self.forcing = None
        self.rope = ops.Rope(cfg.rope_theta, cfg.head_dim, cfg.rotary_dim, cfg.rope_scaling)
        # §22.3 Gemma 3's sliding layers rotate by their own base (the default rope type).
        self.rope_sliding = ops.Rope(cfg.local_rope_theta, cfg.head_dim) if cfg.gemma3 else None
        # §8.4 (§22.3 for Gemma 3): binary64, rounded once.
        self.scale = cfg.attn_scale
        # §22.2 Gemma 3's embedding scale: transformers' hidden_size**0.5 as an f32 tensor.
        self.embed_scale = F32(math.pow(float(H), 0.5)) if cfg.gemma3 else None
        # Where the head's vocabulary blocks are gathered (§23.3; one process: all of it here).
        self.place = shard.ONE

    def share(self, place: shard.Place) -> Model:
        """Rank `place` of a sharded run (§23.2): each layer's share, the head's rows of its
        vocabulary block; embedding and final norm whole. The caller refuses first what cannot
        be split (shard.refuse_unshardable)."""
        m = copy.copy(self)
        m.layers = [L.share(place) for L in self.layers]
        v0, v1 = place.block(self.cfg.vocab_size)
        m.head_t = np.ascontiguousarray(self.head_t[:, v0:v1])
        m.place = place
        return m

    # §5
    def embed(self, tokens) -> np.ndarray:
        V = self.cfg.vocab_size
        for t in tokens:
            if not (0 <= int(t) < V):
                raise ContractError(f"token id {int(t)} is outside the vocabulary [0, {V})")
        rows = widen(self._embed_dtype, self._embed[np.asarray(tokens, dtype=np.int64)])
        return rows if self.embed_scale is None else rows * self.embed_scale

    def rope_of(self, i: int) -> ops.Rope:
        """The RoPE tables layer `i` rotates by (§22.3: a Gemma 3 sliding layer's own)."""
        return self.rope_sliding if self.cfg.window(i) is not None else self.rope

    # §11, §20
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

    def norm_op(self, x, w, eps):
        """The model's RMSNorm: §6, or §15.1 where the family's norms are zero-centred (the layer
        norms, q_norm/k_norm, the final norm). Looked up in ops at each call, so a patched
        ops.rmsnorm (gate's planted defects) reaches every norm."""
        if self.cfg.zero_centred_norms:
            return ops.rmsnorm_zero_centred(x, w, eps)
        return ops.rmsnorm(x, w, eps)

    # §11 head (a rank of a sharded run: its vocabulary block's columns of the logits)
    def head(self, h: np.ndarray, pos, cap: Capture = NO_CAPTURE) -> np.ndarray:
        with _ieee():
            f = self.norm_op(h, self.norm, self.cfg.rms_norm_eps)
            logits = ops.matmul(f, self.head_t)
            c = self.cfg.final_logit_softcapping
            if c is not None:  # §22.5
                logits = ops.tanh_to_f32(logits / F32(c)) * F32(c)
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
        values, each with this model's margin for it (ops.margin_of). A rank of a sharded run
        decides over the whole row, its vocabulary blocks gathered (§23.3)."""
        logits = self.place.gather(logits)
        top, margin = ops.argmax_margin(logits, what=what)
        forced = self.forcing.values(name) if self.forcing is not None else None
        if forced is not None:
            overridden = force.rows_differing(forced, top)
            margin = np.array(
                [ops.margin_of(row, [tok]) for row, tok in zip(logits, forced, strict=False)],
                dtype=F32,
            )
            top = forced
        cap.decision(name, top, margin)
        if forced is not None:
            cap.mark_forced(name, overridden)
        return top


def open_model(model_dir: str) -> Model:
    """The model of `model_dir` (any family: the config says what its layers are)."""
    return Model(model_dir)
