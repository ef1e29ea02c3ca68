"""The model's `config.json` (docs/numerics.md §13): the fields that change the forward pass, one
`Config` field per JSON field, transformers' defaults, the refusals of §7/§13 (each naming the
field), and the sizes checked against the checkpoint. The engine's mirror is engine/src/config.rs.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from decimal import Decimal

import numpy as np
from tracegate import names

from . import gguf, jsonfile, ops
from .errors import ContractError
from .weights import Checkpoint

# The Qwen3.5 families (§13, "Qwen3.5 and Qwen3.5-MoE"): the text layout's model_types, and the
# multimodal layout's, whose language model is `text_config` of the matching text model_type.
QWEN3_5_TEXT = {"qwen3_5_text": "Qwen3_5ForCausalLM", "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
QWEN3_5_MULTIMODAL = {
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "qwen3_5_text"),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe_text"),
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    **QWEN3_5_TEXT,
    **{mt: arch for mt, (arch, _) in QWEN3_5_MULTIMODAL.items()},
}
FULL, LINEAR, SLIDING = "full_attention", "linear_attention", "sliding_attention"
# Tensors of the multimodal checkpoints that the language model does not use (§20): listed, not
# read, never refused.
UNUSED_PREFIXES = ("model.visual.", "mtp.")


def unsupported_family(mt) -> str:
    """Why a model_type is refused; same text as the engine's (engine/src/config.rs)."""
    # The registry's families are the oracle's (oracle/tests/test_capture_registry.py).
    if mt in names.FAMILIES:
        return (
            "not supported by the bit-exact producers (engine, contract: llama, qwen2, qwen3, qwen3_moe, gemma3_text, the Qwen3.5 families and diffusion_gemma); the oracle supports it: "
            "python -m tracegate_oracle, trace-diff and gate bisect --reference oracle (docs/capture-points.md)"
        )
    return "not supported (engine, contract: llama, qwen2, qwen3, qwen3_moe, gemma3_text, the Qwen3.5 families and diffusion_gemma; oracle: the families of docs/capture-points.md)"


MAX_POSITIONS = 1 << 24  # positions are below 2^24, where f32 still holds every integer (§7)
USIZE = 1 << 64  # the engine's sizes are 64-bit: a product at or above this is refused there


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
    attention_bias: bool  # q, k and v carry a bias: the config's field; always for qwen2
    o_proj_bias: bool = False  # o_proj carries one: attention_bias too, never for qwen2 (§8.1)
    mlp_bias: bool = False  # llama: gate, up and down carry a bias
    qk_norm: bool = True  # §8.2 per-head q/k norms: the Qwen3 families, not llama or qwen2
    rope_scaling: dict | None = None  # §7.1 (llama): rope_type "linear"/"llama3" and its numbers
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # Qwen3.5 (§§15–20). model_type is then the language model's (`qwen3_5_text`,
    # `qwen3_5_moe_text`); `layout` says whether it came from the multimodal config.
    layout: str = "text"
    prefix: str = "model."  # where the language model's tensors are (§20)
    rotary_dim: int = 0  # §16; head_dim for the Qwen3 families
    layer_types: list[str] | None = None  # None: every `full_attention_interval`-th layer is full
    full_attention_interval: int = 1
    linear_conv_kernel_dim: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    shared_expert_intermediate_size: int = 0
    max_position_embeddings: int = 0  # 0: the config sets no bound
    # Gemma 3 (§22): which layers slide (`sliding_layers`, else every layer but each
    # `sliding_window_pattern`-th), the window, the sliding layers' rope base, the scores' scale
    # and the final softcap.
    sliding_window: int = 0
    sliding_layers: list[bool] | None = None
    sliding_window_pattern: int = 1
    local_rope_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0
    final_logit_softcapping: float | None = None

    @property
    def gemma3(self) -> bool:
        return self.model_type == "gemma3_text"

    @property
    def sandwich_norms(self) -> bool:
        """§22.4: each block's output normed before its residual add, the MLP's input by
        pre_feedforward_layernorm (Gemma 3)."""
        return self.gemma3

    @property
    def gelu_mlp(self) -> bool:
        """§22.2: the gated MLP's activation is gelu_pytorch_tanh (Gemma 3)."""
        return self.gemma3

    def window(self, layer: int) -> int | None:
        """§22.3: layer `layer`'s window W (keys at p − W < q ≤ p), None where it is causal."""
        if not self.gemma3:
            return None
        if self.sliding_layers is not None:
            sliding = self.sliding_layers[layer]
        else:  # transformers: sliding unless (layer + 1) % pattern == 0
            sliding = (layer + 1) % self.sliding_window_pattern != 0
        return self.sliding_window if sliding else None

    def mask(self, layer: int | None) -> str:
        """The `mask` attribute of a tensor of layer `layer` (None: a model-wide point)."""
        w = None if layer is None else self.window(layer)
        return "causal" if w is None else f"sliding:{w}"

    @property
    def attn_scale(self) -> np.float32:
        """§8.4 f32(1 / sqrt(head_dim)); §22.3 Gemma 3's f32(query_pre_attn_scalar^−0.5), both
        in binary64 first."""
        if self.gemma3:
            return np.float32(math.pow(self.query_pre_attn_scalar, -0.5))
        return np.float32(1.0 / math.sqrt(float(self.head_dim)))

    @property
    def hybrid(self) -> bool:
        """A Qwen3.5 family: zero-centred norms, gated attention, linear-attention layers."""
        return self.model_type in QWEN3_5_TEXT

    @property
    def zero_centred_norms(self) -> bool:
        """§15.1: every RMSNorm scales by 1 ⊕ w (the Qwen3.5 families, Gemma 3)."""
        return self.hybrid or self.gemma3

    @property
    def gated_attention(self) -> bool:
        """§17: full attention's q_proj holds each head's query then its output gate (Qwen3.5)."""
        return self.hybrid

    @property
    def unused_prefixes(self) -> tuple[str, ...]:
        """Prefixes of the tensors a checkpoint of this family carries and the language model does
        not run (§20: Qwen3.5's vision tower and multi-token-prediction head); listed, not
        refused."""
        return UNUSED_PREFIXES if self.hybrid else ()

    def layer_kind(self, layer: int) -> str:
        """§13 `layer_types`: FULL or LINEAR (Qwen3's layers are all FULL)."""
        if self.layer_types is not None:
            return self.layer_types[layer]
        return FULL if (layer + 1) % self.full_attention_interval == 0 else LINEAR

    def has_linear_layer(self) -> bool:
        """Decided without visiting every layer (the count is not checked yet): with an interval
        > 1, layer 0 is linear."""
        if self.layer_types is not None:
            return LINEAR in self.layer_types
        return self.num_hidden_layers > 0 and self.full_attention_interval > 1

    def has_dense_layer(self) -> bool:
        """Some layer uses the dense MLP, decided without visiting every layer (the count is not
        checked against the checkpoint yet and may be 2^62). Layer 0 is dense when step > 1."""
        n = self.num_hidden_layers
        if self.model_type == "qwen3_5_moe_text":
            return False
        if self.model_type != "qwen3_moe" or self.num_experts == 0 or self.decoder_sparse_step > 1:
            return n > 0
        return any(i < n for i in self.mlp_only_layers)

    def is_sparse(self, layer: int) -> bool:
        """§10: layer `layer` uses the sparse MoE block (§19: every Qwen3.5-MoE layer)."""
        if self.model_type == "qwen3_5_moe_text":
            return True
        return (
            self.model_type == "qwen3_moe"
            and self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def refuse(field_name: str, why: str):
    raise ContractError(f"config.json: {field_name}: {why}")


# As in the engine and transformers, a field set to null counts as absent everywhere below.


def _int(raw: dict, key: str, minimum: int = 1, default=None) -> int:
    v = raw.get(key)
    if v is None:
        if default is None:
            refuse(key, "missing")
        return default
    if type(v) is not int or not minimum <= v < USIZE:  # the engine reads sizes as u64
        refuse(key, f"must be an integer ≥ {minimum} and < 2^64, got {v!r}")
    return v


def _bool(raw: dict, key: str, default: bool) -> bool:
    v = raw.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        refuse(key, f"must be true or false, got {v!r}")
    return v


def _number(v, key: str) -> Decimal:
    # Decimal from load_config's parse; a float only when a caller hands a dict in directly.
    if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)):
        refuse(key, f"must be a number, got {v!r}")
    if not np.isfinite(float(v)):  # the engine reads numbers as finite binary64 only
        refuse(key, f"must be a finite number, got {v}")
    return Decimal(v)


def _float(d: dict, key: str, default: float, where: str | None = None) -> float:
    v = d.get(key)
    return default if v is None else float(_number(v, where or key))


# §7.1: the scaled rope types llama accepts, with the numbers each needs (in this order).
LLAMA_ROPE_TYPES = {
    "linear": ("factor",),
    "llama3": (
        "factor",
        "low_freq_factor",
        "high_freq_factor",
        "original_max_position_embeddings",
    ),
}


def _rope(raw: dict, hybrid: bool, llama: bool = False) -> tuple[float, float, dict | None]:
    """§7/§13 resolved as transformers does (`rope_scaling or rope_parameters`): a non-empty
    legacy `rope_scaling` replaces `rope_parameters` entirely; theta comes from that dict, else
    the top-level `rope_theta`, else 10000. Returns (theta, partial_rotary_factor): the Qwen3
    families refuse a factor other than 1; the Qwen3.5 ones (`hybrid`) take the dict's, else the
    top-level one, else 0.25 (§16), and allow the mrope keys, which change nothing for text.
    llama (§7.1) also takes the `linear` and `llama3` rope types: the third value is then the
    scaling (None for the default type)."""
    rs = raw.get("rope_scaling")
    if rs is not None and not isinstance(rs, dict):
        refuse("rope_scaling", f"must be an object or null, got {rs!r}")
    name, d = ("rope_scaling", rs) if rs else ("rope_parameters", raw.get("rope_parameters"))
    top = _float(
        raw, "rope_theta", 10000.0
    )  # checked even where the dict's theta wins, as the engine does
    factor = _float(raw, "partial_rotary_factor", 0.25 if hybrid else 1.0)
    if not hybrid and factor != 1.0:
        refuse("partial_rotary_factor", f"must be 1, got {raw['partial_rotary_factor']}")
    factor_name = "partial_rotary_factor"
    allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    scaling = None
    if d is None:
        theta = top
    else:
        if not isinstance(d, dict):
            refuse(name, f"must be an object, got {d!r}")
        rope_type = "default"
        for key in ("rope_type", "type"):
            t = d.get(key)
            if llama and t in LLAMA_ROPE_TYPES:
                rope_type = t
            elif t is not None and t != "default":
                only = "default, linear and llama3" if llama else "default"
                refuse(f"{name}.{key}", f"rope type {t!r} is not supported (only {only})")
        allowed |= set(LLAMA_ROPE_TYPES.get(rope_type, ()))
        if hybrid:
            if d.get("partial_rotary_factor") is not None:
                factor_name = f"{name}.partial_rotary_factor"
                factor = _float(d, "partial_rotary_factor", factor, factor_name)
            _mrope_keys(d, name)
            allowed |= {"mrope_section", "mrope_interleaved"}
        elif _float(d, "partial_rotary_factor", 1.0, f"{name}.partial_rotary_factor") != 1.0:
            refuse(f"{name}.partial_rotary_factor", f"must be 1, got {d['partial_rotary_factor']}")
        # Any other key (factor, ...) belongs to a scaled rope: refused, as the engine does.
        extra = sorted(set(d) - allowed)
        if extra:
            refuse(f"{name}.{extra[0]}", f"not supported with the {rope_type} rope type")
        if rope_type in LLAMA_ROPE_TYPES:
            scaling = {"rope_type": rope_type}
            for key in LLAMA_ROPE_TYPES[rope_type]:
                if d.get(key) is None:
                    refuse(f"{name}.{key}", f"missing for the {rope_type} rope type")
                v = _float(d, key, 0.0, f"{name}.{key}")
                if not v > 0:  # a zero factor divides by zero
                    refuse(f"{name}.{key}", f"must be a positive number, got {d[key]}")
                scaling[key] = v
            if (
                rope_type == "llama3"
                and not scaling["high_freq_factor"] > scaling["low_freq_factor"]
            ):
                refuse(
                    f"{name}.high_freq_factor",
                    f"{d['high_freq_factor']} must exceed low_freq_factor {d['low_freq_factor']} "
                    "(the blend divides by their difference)",
                )
        theta = _float(d, "rope_theta", top, f"{name}.rope_theta")
    if not theta > 0:  # pow of a base ≤ 0 gives no usable table (the engine's logits turn NaN)
        refuse("rope_theta", f"must be positive, got {theta}")
    if not 0.0 < factor <= 1.0:
        refuse(factor_name, f"must be in (0, 1], got {factor}")
    return theta, factor, scaling


def _finite_rope(theta: float, d: int) -> None:
    """§7: the largest rope frequency must be a finite f32, as the engine requires. With `d`
    rotated dims the frequencies are f32(1/θ^(2i/d)) for i < ⌈d/2⌉ (ops.inv_freq), monotone in
    i: the largest is i = 0 (1) for θ ≥ 1, else the last. A θ so small that it overflows (1e-60;
    an f32 subnormal with a wide head) would give infinite angles and NaN logits."""
    if d == 0:
        return
    last = 2 * ((d + 1) // 2 - 1)
    f = 1.0 / math.pow(theta, last / d)
    with np.errstate(over="ignore"):
        finite = bool(np.isfinite(np.float32(f)))
    if not finite:
        refuse(
            "rope_theta",
            f"{theta:e} gives the rope frequency 1/θ^({last}/{d}) = {f:e}, beyond f32 (its "
            "angles would be infinite, the logits NaN)",
        )


def _mrope_keys(d: dict, name: str) -> None:
    """§16: mrope's sections and interleaving pick which position stream each frequency reads;
    text-only input gives every stream the same position, so they are checked, not used."""
    sec = d.get("mrope_section")
    if sec is not None and (
        not isinstance(sec, list)
        or len(sec) != 3
        or any(type(v) is not int or not 0 <= v < USIZE for v in sec)
    ):
        refuse(
            f"{name}.mrope_section", f"must be a list of three non-negative integers, got {sec!r}"
        )
    il = d.get("mrope_interleaved")
    if il is not None and type(il) is not bool:
        refuse(f"{name}.mrope_interleaved", f"must be true or false, got {il!r}")


def parse_config(raw: dict) -> Config:
    """Honour the fields of §13, refuse (naming the field) what this contract cannot compute."""
    mt = raw.get("model_type")
    if mt == "gemma3":  # a vision tower beside a language model stored under other names
        refuse(
            "model_type",
            "'gemma3' (Gemma3ForConditionalGeneration) is not supported by the bit-exact "
            "producers; its language model is: a Gemma3ForCausalLM checkpoint, model_type 'gemma3_text'",
        )
    if mt not in ARCHITECTURES:
        refuse("model_type", f"{mt!r} {unsupported_family(mt)}")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURES[mt]]:
        refuse(
            "architectures",
            f"unsupported architecture {archs!r} for {mt} (expected [{ARCHITECTURES[mt]!r}])",
        )
    if mt not in QWEN3_5_MULTIMODAL:
        return _parse_fields(raw, mt)
    # The multimodal layout (§13): the language model's fields are `text_config`; transformers
    # ties the head by the top-level `tie_word_embeddings`.
    text_mt = QWEN3_5_MULTIMODAL[mt][1]
    tc = raw.get("text_config")
    if not isinstance(tc, dict):
        refuse("text_config", f"must be an object (the language model's fields), got {tc!r}")
    if tc.get("model_type") is not None and tc["model_type"] != text_mt:
        refuse("text_config.model_type", f"must be {text_mt!r} for {mt}, got {tc['model_type']!r}")
    tie = _bool(raw, "tie_word_embeddings", False)
    if tc.get("tie_word_embeddings") is not None and tc["tie_word_embeddings"] != tie:
        refuse(
            "text_config.tie_word_embeddings",
            f"{tc['tie_word_embeddings']!r} disagrees with the top-level tie_word_embeddings {tie} (which transformers reads)",
        )
    try:
        cfg = _parse_fields({**tc, "tie_word_embeddings": tie}, text_mt)
    except ContractError as e:  # a refusal inside text_config names the field under it
        raise ContractError(
            str(e).replace("config.json: ", "config.json: text_config.", 1)
        ) from None
    cfg.layout, cfg.prefix = "multimodal", "model.language_model."
    return cfg


def _parse_fields(raw: dict, mt: str) -> Config:
    hybrid = mt in QWEN3_5_TEXT
    gemma3 = mt == "gemma3_text"
    # Sliding windows: only `use_sliding_window` and `layer_types` can ask for one (transformers
    # drops `sliding_window`/`max_window_layers` unless use_sliding_window is true). Gemma 3
    # reads neither use_sliding_window nor hidden_act: its own are in _parse_gemma3 (§22.1).
    if not gemma3 and _bool(raw, "use_sliding_window", False):
        refuse("use_sliding_window", "sliding-window attention is not supported")
    lt = raw.get("layer_types")
    if (
        not hybrid
        and not gemma3
        and lt is not None
        and (not isinstance(lt, list) or any(t != "full_attention" for t in lt))
    ):
        refuse("layer_types", f"only full_attention layers are supported, got {lt!r}")
    act = raw.get("hidden_act")
    if not gemma3 and act is not None and act != "silu":
        refuse("hidden_act", f"only silu is supported, got {act!r}")
    llama = mt == "llama"
    g3 = _parse_gemma3(raw) if gemma3 else None
    theta, factor, scaling = (g3["theta"], 1.0, g3["scaling"]) if g3 else _rope(raw, hybrid, llama)

    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    # LlamaConfig: an absent num_key_value_heads means one kv head per query head (MHA).
    kv = _int(raw, "num_key_value_heads", default=heads if llama else None)
    if heads % kv != 0:
        refuse("num_key_value_heads", f"num_attention_heads {heads} is not a multiple of {kv}")
    # §13: Qwen3Config declares head_dim = 128 and the Qwen3.5 configs 256; Qwen3MoeConfig has
    # no such field, and the attention falls back to hidden_size // num_attention_heads (floor,
    # as transformers).
    # LlamaConfig and Qwen2Config: hidden_size // num_attention_heads too; Gemma3TextConfig 256.
    default_head_dim = {
        "qwen3": 128,
        "qwen3_moe": hidden // heads,
        "llama": hidden // heads,
        "qwen2": hidden // heads,
    }.get(mt, 256)
    head_dim = _int(raw, "head_dim", default=default_head_dim)
    if not hybrid and (head_dim % 2 != 0 or head_dim == 0):  # Qwen3.5: the rotary dim's check
        src = (
            ""
            if raw.get("head_dim") is not None
            else f" (hidden_size {hidden} // num_attention_heads {heads})"
        )
        refuse("head_dim", f"must be even and positive for RoPE, got {head_dim}{src}")
    # Not read by the forward, but a size all the same (as the engine checks it).
    mpe = _int(raw, "max_position_embeddings", default=0)
    if mpe > MAX_POSITIONS:
        refuse(
            "max_position_embeddings", f"{mpe} exceeds the position limit 2^24 = {MAX_POSITIONS}"
        )
    eps = raw.get("rms_norm_eps")
    eps = Decimal("1e-6") if eps is None else _number(eps, "rms_norm_eps")  # transformers' default
    # §8.1: qwen2's q/k/v bias is fixed (Qwen2Config has no attention_bias; one stated is not
    # read) and its o_proj has none; the other families put attention_bias on all four.
    qwen2 = mt == "qwen2"
    attention_bias = True if qwen2 else _bool(raw, "attention_bias", False)

    cfg = Config(
        max_position_embeddings=mpe,
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
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", gemma3),  # Gemma 3 ties by default
        attention_bias=attention_bias,
        o_proj_bias=attention_bias and not qwen2,
        mlp_bias=llama and _bool(raw, "mlp_bias", False),
        qk_norm=mt not in ("llama", "qwen2"),
        rope_scaling=scaling,
    )
    # §16: int(head_dim × factor), the binary64 product truncated as transformers does. An odd
    # rotary dim rounds up to 2·ceil(d_r/2) rotated dims, which fit in the head unless the whole
    # (odd) head would rotate: transformers refuses that (head_dim > 4) or fails to broadcast.
    cfg.rotary_dim = int(head_dim * factor) if hybrid else head_dim
    width = 2 * ((cfg.rotary_dim + 1) // 2)
    if cfg.rotary_dim == 0:
        refuse(
            "partial_rotary_factor",
            f"{factor} × head_dim {head_dim} gives rotary dim 0, which must be positive",
        )
    if width > head_dim:
        refuse(
            "partial_rotary_factor",
            f"{factor} × head_dim {head_dim} gives the odd rotary dim {cfg.rotary_dim}, which "
            f"rotates {width} dims, more than the head's {head_dim} (docs/numerics.md §16)",
        )
    _finite_rope(theta, cfg.rotary_dim)
    if hybrid:
        _parse_qwen3_5(raw, cfg)
    if g3:
        n = cfg.num_hidden_layers
        if g3["layer_types"] is not None and len(g3["layer_types"]) != n:
            refuse("layer_types", f"{len(g3['layer_types'])} entries for num_hidden_layers {n}")
        if g3["layer_types"] is not None:
            cfg.sliding_layers = [t == SLIDING for t in g3["layer_types"]]
            any_sliding = any(cfg.sliding_layers)
        else:
            cfg.sliding_window_pattern = g3["pattern"]
            any_sliding = g3["pattern"] > 1  # layer 0 slides unless every layer is full
        if any_sliding:
            cfg.sliding_window = _int(raw, "sliding_window", default=4096)  # the class default
        cfg.local_rope_theta = g3["local_theta"]
        _finite_rope(cfg.local_rope_theta, head_dim)
        cfg.query_pre_attn_scalar = g3["query_pre_attn_scalar"]
        cfg.final_logit_softcapping = g3["final_logit_softcapping"]
    if mt in ("qwen3_moe", "qwen3_5_moe_text"):
        # transformers maps num_local_experts onto num_experts; both given must agree.
        ne_given, nle_given = (
            raw.get("num_experts") is not None,
            raw.get("num_local_experts") is not None,
        )
        if ne_given and nle_given and _int(raw, "num_experts") != _int(raw, "num_local_experts"):
            refuse("num_experts", "num_experts and num_local_experts disagree")
        cfg.num_experts = _int(
            raw, "num_local_experts" if nle_given and not ne_given else "num_experts", minimum=0
        )
        cfg.num_experts_per_tok = _int(raw, "num_experts_per_tok", minimum=0)
    if mt == "qwen3_5_moe_text":
        _parse_qwen3_5_moe(raw, cfg)
    elif mt == "qwen3_moe":
        cfg.norm_topk_prob = _bool(raw, "norm_topk_prob", False)
        cfg.decoder_sparse_step = _int(raw, "decoder_sparse_step", default=1)
        mol = raw.get("mlp_only_layers")
        mol = [] if mol is None else mol
        if not isinstance(mol, list) or any(type(i) is not int or not 0 <= i < USIZE for i in mol):
            refuse("mlp_only_layers", f"must be a list of layer indices, got {mol!r}")
        cfg.mlp_only_layers = list(mol)
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        if e > 0:  # num_experts = 0: every layer dense (§10), no expert fields needed
            if not 1 <= k < e:
                refuse("num_experts_per_tok", f"must satisfy 1 ≤ k < num_experts ({e}), got {k}")
            cfg.moe_intermediate_size = _int(raw, "moe_intermediate_size")
    # §13: intermediate_size is required only where a dense MLP layer exists.
    if cfg.intermediate_size is None and cfg.has_dense_layer():
        refuse("intermediate_size", "missing (a layer uses the dense MLP)")
    return cfg


def _parse_gemma3(raw: dict) -> dict:
    """§22.1 what only Gemma3TextConfig reads, as transformers reads it: the activation, the
    causal flag, the softcaps, query_pre_attn_scalar, which layers slide (`layer_types`, else
    transformers' `sliding_window_pattern` rule, default 6; the saved `_sliding_window_pattern` is
    not read), and the two rope tables: `rope_parameters` keyed by layer type, a legacy
    `rope_scaling` merged into the full layers' entry; their theta that entry's, else
    `rope_theta`, else 1e6; the sliding layers', theirs, else `rope_local_base_freq`, else 1e4.
    Refused, naming the field, what transformers would compute otherwise than this contract."""
    act = raw.get("hidden_activation")
    if act is not None and act != "gelu_pytorch_tanh":
        refuse("hidden_activation", f"only gelu_pytorch_tanh is supported, got {act!r}")
    if raw.get("use_bidirectional_attention") is not None and _bool(
        raw, "use_bidirectional_attention", False
    ):
        refuse("use_bidirectional_attention", "only false (a causal decoder) is supported")
    if raw.get("attn_logit_softcapping") is not None:
        refuse(
            "attn_logit_softcapping",
            f"only null is supported (as Gemma 3 checkpoints ship it), got {raw['attn_logit_softcapping']}",
        )
    cap = raw.get("final_logit_softcapping")
    if cap is not None:
        cap = float(_number(cap, "final_logit_softcapping"))
        if not cap > 0:
            refuse("final_logit_softcapping", f"must be a positive number, got {cap}")
    qpas = _float(raw, "query_pre_attn_scalar", 256.0)
    if not qpas > 0:
        refuse("query_pre_attn_scalar", f"must be positive, got {qpas}")
    lt = raw.get("layer_types")
    pattern = 6
    if lt is None:
        pattern = _int(raw, "sliding_window_pattern", default=6)
    elif not isinstance(lt, list) or any(t not in (SLIDING, FULL) for t in lt):
        refuse("layer_types", f"entries must be {SLIDING!r} or {FULL!r}, got {lt!r}")
    params = raw.get("rope_parameters")
    params = {} if params is None else params
    if not isinstance(params, dict):
        refuse("rope_parameters", f"must be an object or null, got {params!r}")
    for k in params:
        if k not in (SLIDING, FULL):
            refuse(
                f"rope_parameters.{k}",
                "not supported (Gemma 3's rope_parameters are keyed by layer type: "
                "sliding_attention, full_attention)",
            )

    def entry(key: str) -> dict:
        e = params.get(key)
        if e is None:
            return {}
        if not isinstance(e, dict):
            refuse(f"rope_parameters.{key}", f"must be an object, got {e!r}")
        return dict(e)

    full, sliding = entry(FULL), entry(SLIDING)
    rs = raw.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            refuse("rope_scaling", f"must be an object or null, got {rs!r}")
        full.update(rs)
    full_theta = _float(raw, "rope_theta", 1_000_000.0)
    local_theta = _float(raw, "rope_local_base_freq", 10_000.0)
    theta, scaling = _gemma3_rope_entry(full, FULL, full_theta, linear_ok=True)
    local, _ = _gemma3_rope_entry(sliding, SLIDING, local_theta, linear_ok=False)
    return dict(
        theta=theta,
        scaling=scaling,
        local_theta=local,
        layer_types=None if lt is None else list(lt),
        pattern=pattern,
        query_pre_attn_scalar=qpas,
        final_logit_softcapping=cap,
    )


def _gemma3_rope_entry(e: dict, key: str, theta: float, linear_ok: bool):
    """One layer type's rope: (theta, scaling) — the default type, or `linear` (`factor`, §7.1)
    for the full layers."""
    at = f"rope_parameters.{key}"
    rope_type = "default"
    for k in ("rope_type", "type"):
        t = e.get(k)
        if t is None or t == "default":
            continue
        if t == "linear" and linear_ok:
            rope_type = "linear"
        else:
            only = "default and linear" if linear_ok else "default"
            refuse(f"{at}.{k}", f"rope type {t!r} is not supported (only {only})")
    allowed = {"rope_type", "type", "rope_theta"} | ({"factor"} if rope_type == "linear" else set())
    extra = sorted(set(e) - allowed)
    if extra:
        refuse(f"{at}.{extra[0]}", f"not supported with the {rope_type} rope type")
    theta = _float(e, "rope_theta", theta, f"{at}.rope_theta")
    if not theta > 0:
        refuse("rope_theta", f"must be positive, got {theta}")
    scaling = None
    if rope_type == "linear":
        if e.get("factor") is None:
            refuse(f"{at}.factor", "missing for the linear rope type")
        f = _float(e, "factor", 0.0, f"{at}.factor")
        if not f > 0:
            refuse(f"{at}.factor", f"must be a positive number, got {e['factor']}")
        scaling = {"rope_type": "linear", "factor": f}
    return theta, scaling


def _parse_qwen3_5(raw: dict, cfg: Config) -> None:
    """§13's Qwen3.5 fields: the layer kinds and the linear-attention sizes (§18)."""
    n = cfg.num_hidden_layers
    lt = raw.get("layer_types")
    if lt is None:  # transformers: every interval-th layer is full, the others linear
        cfg.full_attention_interval = _int(raw, "full_attention_interval", default=4)
    elif not isinstance(lt, list) or any(t not in (FULL, LINEAR) for t in lt):
        refuse("layer_types", f"entries must be {FULL!r} or {LINEAR!r}, got {lt!r}")
    elif len(lt) != n:
        refuse("layer_types", f"{len(lt)} entries for num_hidden_layers {n}")
    else:
        cfg.layer_types = list(lt)
    if cfg.has_linear_layer():
        cfg.linear_conv_kernel_dim = _int(raw, "linear_conv_kernel_dim")
        cfg.linear_key_head_dim = _int(raw, "linear_key_head_dim")
        cfg.linear_value_head_dim = _int(raw, "linear_value_head_dim")
        cfg.linear_num_key_heads = nk = _int(raw, "linear_num_key_heads")
        cfg.linear_num_value_heads = nv = _int(raw, "linear_num_value_heads")
        if nv % nk != 0:
            refuse("linear_num_value_heads", f"{nv} is not a multiple of linear_num_key_heads {nk}")


def _parse_qwen3_5_moe(raw: dict, cfg: Config) -> None:
    """§13/§19: every layer sparse, top-k always renormalised — what transformers' class does
    whatever the config says, so the fields that would say otherwise are refused, not ignored."""
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if not 1 <= k < e:
        refuse("num_experts_per_tok", f"must satisfy 1 ≤ k < num_experts ({e}), got {k}")
    cfg.moe_intermediate_size = _int(raw, "moe_intermediate_size")
    cfg.shared_expert_intermediate_size = _int(raw, "shared_expert_intermediate_size")
    why = "transformers' Qwen3.5-MoE makes every layer sparse and always renormalises the top-k weights"
    if not _bool(raw, "norm_topk_prob", True):
        refuse("norm_topk_prob", f"false is not supported ({why})")
    if _int(raw, "decoder_sparse_step", default=1) != 1:
        refuse("decoder_sparse_step", f"must be 1, got {raw['decoder_sparse_step']} ({why})")
    mol = raw.get("mlp_only_layers")
    if mol is not None and mol != []:
        refuse("mlp_only_layers", f"must be empty, got {mol!r} ({why})")
    cfg.norm_topk_prob = True


def load_config(model_dir: str) -> Config:
    # A GGUF checkpoint (a .gguf file, or a directory holding one and no safetensors): the config
    # its metadata makes (numerics.md §21.5).
    found = gguf.locate(model_dir)
    if found is not None:
        return gguf_config(found)
    path = os.path.join(model_dir, "config.json")
    try:  # one bounded regular file (a FIFO would block, /dev/zero never end)
        text = jsonfile.read_bytes(path, path)
    except FileNotFoundError:
        raise ContractError(f"{model_dir}: no config.json") from None
    # Decimals keep the written text; numbers reach the model through binary64 (§6, §13). A
    # repeated key is refused: json keeps the last of two `num_hidden_layers` silently.
    raw = jsonfile.loads_unique(text, path, parse_float=Decimal)
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: not a JSON object")
    return parse_config(raw)


def gguf_config(path: str, g: gguf.GgufFile | None = None) -> Config:
    """The Config of GGUF file `path`: its metadata's config.json dict (gguf.config_dict) parsed
    as config.json's would be; a refusal names the file and the GGUF key the field came from."""
    raw, src = gguf.config_dict(g if g is not None else gguf.GgufFile(path))
    try:
        return parse_config(raw)
    except ContractError as e:
        msg, head = str(e), "config.json: "
        if not msg.startswith(head):
            raise
        field, _, rest = msg[len(head) :].partition(":")
        key = src.get(field.split(".")[0])
        shown = f"{field} (from {key})" if key else field
        raise ContractError(f"{path}: the GGUF metadata as config.json: {shown}:{rest}") from None


def check_gguf(path: str) -> tuple[Config, gguf.GgufFile]:
    """Every check the contract makes of GGUF file `path` before it computes, short of
    dequantizing a tensor: the container (numerics.md §21.1), the types and names (§21.2–3),
    the config its metadata makes (§21.5, then §13 as any config.json) and its sizes against
    the file's tensors. The oracle runs this before it hands the file to transformers' loader:
    one checker, so every file the contract (and the engine) refuses, the oracle refuses too.
    Returns the config and the parsed file."""
    g = gguf.GgufWeights(path).file
    cfg = gguf_config(path, g)
    check_sizes(cfg, Checkpoint(path))
    return cfg, g


def check_sizes(cfg: Config, ck: Checkpoint) -> None:
    """§13: every size against the checkpoint's own tensors, naming the field, before anything is
    built or looped over by it. A representative tensor that is absent is left to `take`, which
    refuses it by name."""

    def dim(name: str, axis: int, want: int, field: str, what: str):
        s = ck.shape(name)
        if s is not None and len(s) > axis and s[axis] != want:
            refuse(field, f"{what} does not match the checkpoint: {name} has shape {list(s)}")

    def product(field: str, x: int, by: str, y: int) -> int:
        if x * y >= USIZE:  # where the engine's 64-bit product overflows
            refuse(field, f"{x} overflows when multiplied by {by} ({y})")
        return x * y

    H, V, d, P = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.prefix
    dim(f"{P}embed_tokens.weight", 0, V, "vocab_size", f"{V}")
    dim(f"{P}embed_tokens.weight", 1, H, "hidden_size", f"{H}")
    have = ck.layer_count(P)
    if cfg.num_hidden_layers > have:
        refuse(
            "num_hidden_layers",
            f"{cfg.num_hidden_layers} but the checkpoint holds {have} layers ({P}layers.N tensors for N < {have})",
        )
    layers = range(cfg.num_hidden_layers)  # bounded by the checkpoint now
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    full = next((i for i in layers if cfg.layer_kind(i) == FULL), None)
    if full is not None:
        a = f"{P}layers.{full}.self_attn"
        dim(f"{a}.q_norm.weight", 0, d, "head_dim", f"{d}")
        q_rows = product("num_attention_heads", nh, "head_dim", d)
        kv_rows = product("num_key_value_heads", nkv, "head_dim", d)
        q_what = f"{nh} (× head_dim {d} = {q_rows} rows)"
        if cfg.gated_attention:  # §17: each head's query, then its gate
            q_rows = product("num_attention_heads", q_rows, "2 (query and gate)", 2)
            q_what = f"{nh} (× head_dim {d} × 2 for query and gate = {q_rows} rows)"
        dim(f"{a}.q_proj.weight", 0, q_rows, "num_attention_heads", q_what)
        dim(
            f"{a}.k_proj.weight",
            0,
            kv_rows,
            "num_key_value_heads",
            f"{nkv} (× head_dim {d} = {kv_rows} rows)",
        )
    linear = next((i for i in layers if cfg.layer_kind(i) == LINEAR), None)
    if linear is not None:
        a = f"{P}layers.{linear}.linear_attn"
        nk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        nv, dv, K = (
            cfg.linear_num_value_heads,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        )
        dim(f"{a}.in_proj_a.weight", 0, nv, "linear_num_value_heads", f"{nv}")
        dim(f"{a}.norm.weight", 0, dv, "linear_value_head_dim", f"{dv}")
        dim(f"{a}.conv1d.weight", 2, K, "linear_conv_kernel_dim", f"{K}")
        key = product("linear_num_key_heads", nk, "linear_key_head_dim", dk)
        value = product("linear_num_value_heads", nv, "linear_value_head_dim", dv)
        conv = product("linear_num_key_heads", key, "2 (q and k)", 2) + value
        if conv >= USIZE:
            refuse("linear_num_key_heads", f"the conv width 2·{key} + {value} overflows")
        dim(
            f"{a}.in_proj_qkv.weight",
            0,
            conv,
            "linear_num_key_heads",
            f"{nk} × linear_key_head_dim {dk} (conv width 2 × {key} + {value} = {conv} rows)",
        )
    dense = next((i for i in layers if not cfg.is_sparse(i)), None)
    if cfg.intermediate_size is not None and dense is not None:
        I = cfg.intermediate_size
        dim(f"{P}layers.{dense}.mlp.gate_proj.weight", 0, I, "intermediate_size", f"{I}")
    sparse = next((i for i in layers if cfg.is_sparse(i)), None)
    if sparse is not None:
        E, I = cfg.num_experts, cfg.moe_intermediate_size
        p = f"{P}layers.{sparse}.mlp"
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
        if cfg.shared_expert_intermediate_size:
            SI = cfg.shared_expert_intermediate_size
            dim(
                f"{p}.shared_expert.gate_proj.weight",
                0,
                SI,
                "shared_expert_intermediate_size",
                f"{SI}",
            )
