"""Qwen3 (dense) and Qwen3-MoE, read top to bottom: config, weights, layer, model, generation.

The two families differ only in the MLP of some layers (§10), so one file covers both. All
arithmetic goes through ops.py; this file only says which op runs on what, in the order of
docs/numerics.md §5–§12.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np

from . import jsonfile, ops
from .errors import ContractError
from .ops import F32
from .weights import Checkpoint, regular_file

ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# model_types of the oracle's family table (oracle/tracegate_oracle/families.py; equality checked by
# oracle/tests/test_families.py): the refusal tells their users where to go.
ORACLE_FAMILIES = (
    "gemma3_text",
    "llama",
    "mistral",
    "mixtral",
    "olmo2",
    "olmoe",
    "phi3",
    "qwen2",
    "qwen3",
    "qwen3_moe",
)


def unsupported_family(mt) -> str:
    """Why a model_type is refused; same text as the engine's (engine/src/qwen3.rs)."""
    if mt in ORACLE_FAMILIES:
        return (
            "not supported by the bit-exact producers (engine, contract: qwen3, qwen3_moe); the oracle supports it: "
            "python -m tracegate_oracle, trace-diff and gate bisect --reference oracle (docs/capture-points.md)"
        )
    return "not supported (engine, contract: qwen3, qwen3_moe; oracle: the families of docs/capture-points.md)"


MAX_POSITIONS = 1 << 24  # positions are below 2^24, where f32 still holds every integer (§7)
_USIZE = 1 << 64  # the engine's sizes are 64-bit: a product at or above this is refused there


# --------------------------------------------------------------------------------------------
# Config (§13)


@dataclass
class Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | None  # None: every layer is sparse and the config omits it
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: np.float32  # the config's number as binary64, then rounded to f32 (§6)
    rope_theta: float  # binary64, as pow receives it (§7)
    tie_word_embeddings: bool
    attention_bias: bool
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def has_dense_layer(self) -> bool:
        """Some layer uses the dense MLP, decided without visiting every layer (the count is not
        checked against the checkpoint yet and may be 2^62). Layer 0 is dense when step > 1."""
        n = self.num_hidden_layers
        if self.model_type != "qwen3_moe" or self.num_experts == 0 or self.decoder_sparse_step > 1:
            return n > 0
        return any(i < n for i in self.mlp_only_layers)

    def is_moe_layer(self, layer: int) -> bool:
        return (
            self.model_type == "qwen3_moe"
            and self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def _refuse(field_name: str, why: str):
    raise ContractError(f"config.json: {field_name}: {why}")


# As in the engine and transformers, a field set to null counts as absent everywhere below.


def _int(raw: dict, key: str, minimum: int = 1, default=None) -> int:
    v = raw.get(key)
    if v is None:
        if default is None:
            _refuse(key, "missing")
        return default
    if type(v) is not int or not minimum <= v < _USIZE:  # the engine reads sizes as u64
        _refuse(key, f"must be an integer ≥ {minimum} and < 2^64, got {v!r}")
    return v


def _bool(raw: dict, key: str, default: bool) -> bool:
    v = raw.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        _refuse(key, f"must be true or false, got {v!r}")
    return v


def _number(v, key: str) -> Decimal:
    # Decimal from load_config's parse; a float only when a caller hands a dict in directly.
    if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
        _refuse(key, f"must be a number, got {v!r}")
    if not np.isfinite(float(v)):  # the engine reads numbers as finite binary64 only
        _refuse(key, f"must be a finite number, got {v}")
    return Decimal(v)


def _float(d: dict, key: str, default: float, where: str | None = None) -> float:
    v = d.get(key)
    return default if v is None else float(_number(v, where or key))


def _rope_theta(raw: dict) -> float:
    """§7/§13 resolved as transformers does (`rope_scaling or rope_parameters`): a non-empty
    legacy `rope_scaling` replaces `rope_parameters` entirely; theta comes from that dict, else
    the top-level `rope_theta`, else 10000."""
    rs = raw.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        _refuse("rope_scaling", f"must be an object or null, got {rs!r}")
    name, d = ("rope_scaling", rs) if rs else ("rope_parameters", raw.get("rope_parameters"))
    top = _float(
        raw, "rope_theta", 10000.0
    )  # checked even where the dict's theta wins, as the engine does
    if _float(raw, "partial_rotary_factor", 1.0) != 1.0:
        _refuse("partial_rotary_factor", f"must be 1, got {raw['partial_rotary_factor']}")
    if d is None:
        theta = top
    else:
        if not isinstance(d, dict):
            _refuse(name, f"must be an object, got {d!r}")
        for key in ("rope_type", "type"):
            t = d.get(key)
            if t is not None and t != "default":
                _refuse(f"{name}.{key}", f"rope type {t!r} is not supported (only default)")
        if _float(d, "partial_rotary_factor", 1.0, f"{name}.partial_rotary_factor") != 1.0:
            _refuse(f"{name}.partial_rotary_factor", f"must be 1, got {d['partial_rotary_factor']}")
        # Any other key (factor, ...) belongs to a scaled rope: refused, as the engine does.
        extra = sorted(set(d) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"})
        if extra:
            _refuse(f"{name}.{extra[0]}", "not supported with the default rope type")
        theta = _float(d, "rope_theta", top, f"{name}.rope_theta")
    if not theta > 0:  # pow of a base ≤ 0 gives no usable table (the engine's logits turn NaN)
        _refuse("rope_theta", f"must be positive, got {theta}")
    return theta


def parse_config(raw: dict) -> Config:
    """Honour the fields of §13, refuse (naming the field) what this contract cannot compute."""
    mt = raw.get("model_type")
    if mt not in ARCHITECTURES:
        _refuse("model_type", f"{mt!r} {unsupported_family(mt)}")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[mt]]:
        _refuse(
            "architectures",
            f"unsupported architecture {archs!r} for {mt} (expected [{ARCHITECTURES[mt]!r}])",
        )

    # Sliding windows: only `use_sliding_window` and `layer_types` can ask for one (transformers
    # drops `sliding_window`/`max_window_layers` unless use_sliding_window is true).
    if _bool(raw, "use_sliding_window", False):
        _refuse("use_sliding_window", "sliding-window attention is not supported")
    lt = raw.get("layer_types")
    if lt is not None and (not isinstance(lt, list) or any(t != "full_attention" for t in lt)):
        _refuse("layer_types", f"only full_attention layers are supported, got {lt!r}")
    act = raw.get("hidden_act")
    if act is not None and act != "silu":
        _refuse("hidden_act", f"only silu is supported, got {act!r}")
    theta = _rope_theta(raw)

    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv = _int(raw, "num_key_value_heads")
    if heads % kv != 0:
        _refuse("num_key_value_heads", f"num_attention_heads {heads} is not a multiple of {kv}")
    # §13: Qwen3Config declares head_dim = 128; Qwen3MoeConfig has no such field, and the
    # attention falls back to hidden_size // num_attention_heads (floor, as transformers).
    head_dim = _int(raw, "head_dim", default=128 if mt == "qwen3" else hidden // heads)
    if head_dim % 2 != 0 or head_dim == 0:
        src = (
            ""
            if raw.get("head_dim") is not None
            else f" (hidden_size {hidden} // num_attention_heads {heads})"
        )
        _refuse("head_dim", f"must be even and positive for RoPE, got {head_dim}{src}")
    # Not read by the forward, but a size all the same (as the engine checks it).
    mpe = _int(raw, "max_position_embeddings", default=0)
    if mpe > MAX_POSITIONS:
        _refuse(
            "max_position_embeddings", f"{mpe} exceeds the position limit 2^24 = {MAX_POSITIONS}"
        )
    eps = raw.get("rms_norm_eps")
    eps = Decimal("1e-6") if eps is None else _number(eps, "rms_norm_eps")  # transformers' default

    cfg = Config(
        model_type=mt,
        vocab_size=_int(raw, "vocab_size", minimum=2),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", default=0) or None,  # checked below
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        rms_norm_eps=ops.f32_of_config_number(eps),
        rope_theta=theta,
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", False),
        attention_bias=_bool(raw, "attention_bias", False),
    )
    if mt == "qwen3_moe":
        # transformers maps num_local_experts onto num_experts; both given must agree.
        ne_given, nle_given = (
            raw.get("num_experts") is not None,
            raw.get("num_local_experts") is not None,
        )
        if ne_given and nle_given and _int(raw, "num_experts") != _int(raw, "num_local_experts"):
            _refuse("num_experts", "num_experts and num_local_experts disagree")
        cfg.num_experts = _int(
            raw, "num_local_experts" if nle_given and not ne_given else "num_experts", minimum=0
        )
        cfg.num_experts_per_tok = _int(raw, "num_experts_per_tok", minimum=0)
        cfg.norm_topk_prob = _bool(raw, "norm_topk_prob", False)
        cfg.decoder_sparse_step = _int(raw, "decoder_sparse_step", default=1)
        mol = raw.get("mlp_only_layers")
        mol = [] if mol is None else mol
        if not isinstance(mol, list) or any(type(i) is not int or not 0 <= i < _USIZE for i in mol):
            _refuse("mlp_only_layers", f"must be a list of layer indices, got {mol!r}")
        cfg.mlp_only_layers = list(mol)
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        if e > 0:  # num_experts = 0: every layer dense (§10), no expert fields needed
            if not 1 <= k < e:
                _refuse("num_experts_per_tok", f"must satisfy 1 ≤ k < num_experts ({e}), got {k}")
            cfg.moe_intermediate_size = _int(raw, "moe_intermediate_size")
    # §13: intermediate_size is required only where a dense MLP layer exists.
    if cfg.intermediate_size is None and cfg.has_dense_layer():
        _refuse("intermediate_size", "missing (a layer uses the dense MLP)")
    return cfg


def load_config(model_dir: str) -> Config:
    path = os.path.join(model_dir, "config.json")
    regular_file(path, path)
    try:
        with open(path, "rb") as f:
            text = f.read()
    except FileNotFoundError:
        raise ContractError(f"{model_dir}: no config.json") from None
    except OSError as e:
        raise ContractError(f"{path}: unreadable: {e}") from None
    # Decimals keep the written text; numbers reach the model through binary64 (§6, §13).
    raw, _ = jsonfile.loads(text, path, parse_float=Decimal)
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: not a JSON object")
    return parse_config(raw)


# --------------------------------------------------------------------------------------------
# Capture: what a run records, in the order it happens


class Capture:
    """Collects tensors (with the rows' absolute positions) and decisions in recording order.
    `internals` adds q/k/v/attn_probs/router logits/expert outputs (§ capture convention)."""

    def __init__(self, internals: bool = False):
        self.internals = internals
        self.tensors: list[tuple[str, np.ndarray, list[int]]] = []
        self.decisions: list[tuple[str, np.ndarray, np.ndarray]] = []
        # --force-decisions: (name, rows overridden) per forced decision, and how many tensors
        # were captured before the first (those after it carry the `forced` attribute).
        self.forced: list[tuple[str, int]] = []
        self.first_forced: int | None = None

    def tensor(self, name: str, array: np.ndarray, positions, internal: bool = False) -> None:
        if internal and not self.internals:
            return
        self.tensors.append(
            (name, np.ascontiguousarray(array, dtype=F32), [int(p) for p in positions])
        )

    def decision(self, name: str, values: np.ndarray, margins: np.ndarray) -> None:
        self.decisions.append(
            (name, np.asarray(values, dtype=np.int64), np.asarray(margins, dtype=F32))
        )

    def mark_forced(self, name: str, overridden: int) -> None:
        """The decision just recorded was forced; `overridden`: rows this producer would have
        decided otherwise."""
        if self.first_forced is None:
            self.first_forced = len(self.tensors)
        self.forced.append((name, int(overridden)))

    def join_rows(self) -> None:
        """Rows recorded one at a time (`layer --decode-from`: one decode row per call), joined
        into one tensor per name in first-seen order; decisions dropped. A joined tensor counts
        as captured after the first forced decision when any of its rows was."""
        joined: dict[str, tuple[list, list, bool]] = {}
        for i, (name, array, positions) in enumerate(self.tensors):
            forced = self.first_forced is not None and i >= self.first_forced
            arrays, pos, was = joined.setdefault(name, ([], [], False))
            arrays.append(array)
            pos.extend(positions)
            joined[name] = (arrays, pos, was or forced)
        if self.first_forced is not None:
            flags = [f for _, _, f in joined.values()]
            self.first_forced = flags.index(True) if True in flags else len(flags)
        self.tensors = [(name, np.concatenate(a), p) for name, (a, p, _) in joined.items()]
        self.decisions = []


class _StepCapture(Capture):
    """Decode step `s`'s forward, cached (one row) or uncached (the whole sequence): records into
    `parent` `decode.SSSS.logits` and, under internals, the layers' hidden_in, attn_out, mlp_out,
    hidden_out and final_norm.out, each of the last row only — so a cached and an uncached step
    record the same tensors (docs/producers.md). No internal points, no decisions."""

    _BODY = (".hidden_in", ".attn_out", ".mlp_out", ".hidden_out")

    def __init__(self, parent: Capture, step: int):
        super().__init__(parent.internals)
        self.parent, self.prefix = parent, f"decode.{step:04d}."

    def tensor(self, name: str, array: np.ndarray, positions, internal: bool = False) -> None:
        keep = name == "logits" or (
            self.internals
            and (
                name == "final_norm.out"
                or (name.startswith("layer.") and name.endswith(self._BODY))
            )
        )
        if keep and not internal:
            self.parent.tensor(self.prefix + name, np.asarray(array)[-1:], [int(positions[-1])])

    def decision(self, *a, **k):
        pass

    def mark_forced(self, *a, **k):
        pass


class _NoCapture(Capture):
    def tensor(self, *a, **k):
        pass

    def decision(self, *a, **k):
        pass

    def mark_forced(self, *a, **k):
        pass


NO_CAPTURE = _NoCapture()


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
    """Gated SiLU MLP (§9). gate and up share one ordered linear: their outputs are computed
    independently column by column, so concatenating them changes no bit."""

    def __init__(self, gate_up: np.ndarray, down: np.ndarray):
        """gate_up: [2I, H], the gate rows then the up rows; down: [H, I]."""
        self.inter = down.shape[1]
        self.wgu_t = ops.transpose_weight(gate_up)
        self.wd_t = ops.transpose_weight(down)

    @classmethod
    def load(cls, ck: Checkpoint, prefix: str, hidden: int, inter: int) -> _Mlp:
        g = ck.take(f"{prefix}.gate_proj.weight", (inter, hidden))
        u = ck.take(f"{prefix}.up_proj.weight", (inter, hidden))
        return cls(np.concatenate([g, u]), ck.take(f"{prefix}.down_proj.weight", (hidden, inter)))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gu = ops.linear(x, self.wgu_t)
        h = ops.silu(gu[:, : self.inter]) * gu[:, self.inter :]
        return ops.linear(h, self.wd_t)


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
        self.wqkv_t = ops.transpose_weight(np.concatenate([wq, wk, wv]))  # one linear, see _Mlp
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
        self.q_norm = np.array(ck.take(f"{a}.q_norm.weight", (d,)), dtype=F32)
        self.k_norm = np.array(ck.take(f"{a}.k_norm.weight", (d,)), dtype=F32)
        self.ln1 = np.array(ck.take(f"{p}.input_layernorm.weight", (H,)), dtype=F32)
        self.ln2 = np.array(ck.take(f"{p}.post_attention_layernorm.weight", (H,)), dtype=F32)
        self.moe = cfg.is_moe_layer(i)
        if self.moe:
            E, I = cfg.num_experts, cfg.moe_intermediate_size
            self.router_t = ops.transpose_weight(ck.take(f"{p}.mlp.gate.weight", (E, H)))
            # Experts on disk: per-expert modules (what save_pretrained writes), or transformers 5's
            # fused `gate_up_proj` [E, 2I, H] (expert e: gate rows, then up rows) and `down_proj`
            # [E, H, I] — the two layouts the engine accepts; the fused pair wins when present.
            fused = f"{p}.mlp.experts.gate_up_proj"
            if ck.has(fused):
                gu = ck.take(fused, (E, 2 * I, H))
                dn = ck.take(f"{p}.mlp.experts.down_proj", (E, H, I))
                self.experts = [_Mlp(gu[e], dn[e]) for e in range(E)]
            else:
                self.experts = [_Mlp.load(ck, f"{p}.mlp.experts.{e}", H, I) for e in range(E)]
        else:
            self.mlp = _Mlp.load(ck, f"{p}.mlp", H, cfg.intermediate_size)


def check_sizes(cfg: Config, ck: Checkpoint) -> None:
    """§13: every size against the checkpoint's own tensors, naming the field, before anything is
    built or looped over by it. A representative tensor that is absent is left to `take`, which
    refuses it by name."""

    def dim(name: str, axis: int, want: int, field: str, what: str):
        s = ck.shape(name)
        if s is not None and len(s) > axis and s[axis] != want:
            _refuse(field, f"{what} does not match the checkpoint: {name} has shape {list(s)}")

    def product(field: str, x: int, by: str, y: int) -> int:
        if x * y >= _USIZE:  # where the engine's 64-bit product overflows
            _refuse(field, f"{x} overflows when multiplied by {by} ({y})")
        return x * y

    H, V, d = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    dim("model.embed_tokens.weight", 0, V, "vocab_size", f"{V}")
    dim("model.embed_tokens.weight", 1, H, "hidden_size", f"{H}")
    have = ck.layer_count()
    if cfg.num_hidden_layers > have:
        _refuse(
            "num_hidden_layers",
            f"{cfg.num_hidden_layers} but the checkpoint holds {have} layers (model.layers.N tensors for N < {have})",
        )
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    a = "model.layers.0.self_attn"
    dim(f"{a}.q_norm.weight", 0, d, "head_dim", f"{d}")
    q_rows = product("num_attention_heads", nh, "head_dim", d)
    kv_rows = product("num_key_value_heads", nkv, "head_dim", d)
    dim(
        f"{a}.q_proj.weight",
        0,
        q_rows,
        "num_attention_heads",
        f"{nh} (× head_dim {d} = {q_rows} rows)",
    )
    dim(
        f"{a}.k_proj.weight",
        0,
        kv_rows,
        "num_key_value_heads",
        f"{nkv} (× head_dim {d} = {kv_rows} rows)",
    )
    layers = range(cfg.num_hidden_layers)  # bounded by the checkpoint now
    dense = next((i for i in layers if not cfg.is_moe_layer(i)), None)
    if cfg.intermediate_size is not None and dense is not None:
        I = cfg.intermediate_size
        dim(f"model.layers.{dense}.mlp.gate_proj.weight", 0, I, "intermediate_size", f"{I}")
    sparse = next((i for i in layers if cfg.is_moe_layer(i)), None)
    if sparse is not None:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        p = f"model.layers.{sparse}.mlp"
        dim(f"{p}.gate.weight", 0, E, "num_experts", f"{E}")
        gu_rows = product("moe_intermediate_size", I, "2 (gate and up rows)", 2)
        dim(f"{p}.experts.gate_up_proj", 0, E, "num_experts", f"{E}")
        dim(
            f"{p}.experts.gate_up_proj",
            1,
            gu_rows,
            "moe_intermediate_size",
            f"{I} (× 2 = {gu_rows} rows)",
        )
        dim(f"{p}.experts.0.gate_proj.weight", 0, I, "moe_intermediate_size", f"{I}")


class Model:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        cfg = self.cfg = load_config(model_dir)
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
        self.rope = ops.RopeTable(cfg.rope_theta, cfg.head_dim)
        # §8.4: binary64 sqrt and division, rounded once.
        self.scale = F32(1.0 / math.sqrt(float(cfg.head_dim)))

    # §5
    def embed(self, tokens) -> np.ndarray:
        V = self.cfg.vocab_size
        for t in tokens:
            if not (0 <= int(t) < V):
                raise ContractError(f"token id {int(t)} is outside the vocabulary [0, {V})")
        rows = self._embed[np.asarray(tokens, dtype=np.int64)]
        if self._embed_dtype == "BF16":
            return ops.widen_bf16(rows)
        return rows.astype(F32)

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
        pfx = f"layer.{i:02d}"
        pos = [int(p) for p in positions]
        cap.tensor(f"{pfx}.hidden_in", x, pos)
        with _ieee():
            return self._layer(i, L, x, pos, pfx, cap, cache)

    def _layer(self, i, L, x, pos, pfx, cap, cache):
        cfg = self.cfg
        nh, nkv, d, eps = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.rms_norm_eps,
        )
        t = x.shape[0]

        xn = ops.rmsnorm(x, L.ln1, eps)
        qkv = ops.linear(xn, L.wqkv_t, L.bqkv)
        q = qkv[:, : nh * d].reshape(t, nh, d)
        k = qkv[:, nh * d : (nh + nkv) * d].reshape(t, nkv, d)
        v = np.ascontiguousarray(qkv[:, (nh + nkv) * d :].reshape(t, nkv, d))
        cos, sin = self.rope.tables(pos)
        q = ops.apply_rope(ops.rmsnorm(q, L.q_norm, eps), cos, sin)
        k = ops.apply_rope(ops.rmsnorm(k, L.k_norm, eps), cos, sin)
        cap.tensor(f"{pfx}.q", q, pos, internal=True)
        cap.tensor(f"{pfx}.k", k, pos, internal=True)
        cap.tensor(f"{pfx}.v", v, pos, internal=True)
        if cache is not None:
            keys, vals, kpos = cache.extend(i, k, v, pos)
        else:
            keys, vals, kpos = k, v, pos
        o, probs = ops.attention(q, keys, vals, pos, kpos, self.scale)
        cap.tensor(f"{pfx}.attn_probs", probs, pos, internal=True)
        a = ops.linear(o.reshape(t, nh * d), L.wo_t, L.bo)
        cap.tensor(f"{pfx}.attn_out", a, pos)

        h1 = x + a
        hn = ops.rmsnorm(h1, L.ln2, eps)
        m = self._moe(L, hn, pos, pfx, cap) if L.moe else L.mlp(hn)
        cap.tensor(f"{pfx}.mlp_out", m, pos)
        out = h1 + m
        cap.tensor(f"{pfx}.hidden_out", out, pos)
        return out

    def _moe(self, L: _Layer, x: np.ndarray, pos: list[int], pfx: str, cap: Capture) -> np.ndarray:
        """§10: router softmax, top-k (ties to the lowest id), optional renormalisation in rank
        order, experts accumulated in ascending id with each weight ⊗ out rounded first."""
        cfg = self.cfg
        g = ops.linear(x, L.router_t)
        cap.tensor(f"{pfx}.router.logits", g, pos, internal=True)
        p = ops.softmax(g)
        bad = np.nonzero(np.isnan(p).any(axis=-1))[0]
        if bad.size:
            raise ContractError(f"{pfx}.router: NaN router probability in row {int(bad[0])}")
        chosen, margin = ops.topk(p, cfg.num_experts_per_tok)
        name = f"{pfx}.router.topk"
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
            cap.tensor(f"{pfx}.expert.{e:03d}.out", y, [pos[i] for i in r], internal=True)
            out[r] = out[r] + w[r, j][:, None] * y
        return out

    # §11 head
    def head(self, h: np.ndarray, pos, cap: Capture = NO_CAPTURE) -> np.ndarray:
        with _ieee():
            f = ops.rmsnorm(h, self.norm, self.cfg.rms_norm_eps)
            logits = ops.linear(f, self.head_t)
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

    # §12
    def run(self, tokens, cap: Capture, generate: int = 0, cached: bool = True) -> list[int]:
        """Prefill of the prompt with capture, `logits.argmax`, then `generate` greedy steps, each
        recorded as its decision and its tensors (`_StepCapture`). Returns the generated tokens."""
        n = len(tokens)
        if n == 0:
            raise ContractError("the prompt is empty")
        cache = KVCache(self.cfg.num_hidden_layers) if (generate > 0 and cached) else None
        logits = self.forward(tokens, range(n), cap, cache)
        self._decide(cap, "logits.argmax", logits)
        out: list[int] = []
        lg = logits
        for s in range(generate):
            step = _StepCapture(cap, s)
            if s > 0:
                if cached:
                    lg = self.forward([out[-1]], [n + s - 1], step, cache)
                else:
                    seq = list(tokens) + out
                    lg = self.forward(seq, range(len(seq)), step)
            else:  # step 0 runs no forward: its logits are the prompt's last row
                step.tensor("logits", lg, [n - 1])
            top = self._decide(
                cap, f"decode.{s:04d}.argmax", lg[-1:], what=f"decode.{s:04d} logits"
            )
            out.append(int(top[0]))
        return out

    def _decide(
        self, cap: Capture, name: str, logits: np.ndarray, what: str = "logits"
    ) -> np.ndarray:
        """§12 argmax of each row, recorded as decision `name`; under --force-decisions the forced
        values, each with this model's margin for it (ops.margin_of)."""
        top, margin = ops.argmax_with_margin(logits, what=what)
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
