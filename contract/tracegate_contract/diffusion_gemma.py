"""Diffusion Gemma (`diffusion_gemma`, block diffusion), the ordered contract of
docs/diffusion-gemma.md (DG0–DG17), read top to bottom: config and generation knobs, weights,
the encoder/decoder forward (one layer for both), self-conditioning, head, temperature, entropy,
the step's decisions, the block loop, and where each recorded tensor sits. It records through
the contract's shared recorder (capture.py) and forcing (force.py); the verbs (run.py) write
its traces.

Every operation is in the spec's order: ops.py's ordered kernels (matmul, rmsnorm, RoPE tables,
softmax, argmax), libm tanh/log/exp in binary64 rounded once (ops.tanh_to_f32, log_to_f32,
exp_to_f32), and splitmix.py's streams for every draw.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from decimal import Decimal

import numpy as np
from tracegate import names

from . import force, jsonfile, ops, splitmix
from .capture import Capture, Place
from .config import MAX_POSITIONS, USIZE
from .errors import ContractError
from .force import Forcing
from .ops import F32
from .weights import Checkpoint

MODEL_TYPE = "diffusion_gemma"
ARCHITECTURE = "DiffusionGemmaForBlockDiffusion"
SLIDING, FULL = "sliding_attention", "full_attention"
RNG = "splitmix64-dg15"
# Present in a checkpoint, run by nothing here (token ids only): listed in provenance.
UNUSED_PREFIXES = ("model.encoder.vision_tower.", "model.encoder.embed_vision.")
P_DEC = "model.decoder."
P_ENC_LAYERS = "model.encoder.language_model.layers."
F32_MIN = F32(-3.4028235e38)


def _refuse(field_name: str, why: str):
    raise ContractError(f"config.json: {field_name}: {why}")


def is_family(model_dir: str) -> bool:
    """Whether `model_dir` holds a diffusion_gemma config.json (read before any other family's
    config reader, which would refuse the model_type)."""
    path = os.path.join(str(model_dir), "config.json")
    if not os.path.isfile(path):
        return False
    raw = jsonfile.loads_unique(jsonfile.read_bytes(path, path), path, parse_float=Decimal)
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


# --------------------------------------------------------------------------------------------
# DG0 config


@dataclass
class DGConfig:
    """The fields of DiffusionGemmaConfig / DiffusionGemmaTextConfig the forward reads."""

    canvas_length: int
    tie_word_embeddings: bool
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    rms_norm_eps: np.float32
    final_logit_softcapping: float
    layer_types: list[str]
    sliding_window: int
    num_attention_heads: int
    head_dim: int  # d, sliding layers
    num_key_value_heads: int  # kv, sliding layers
    global_head_dim: int  # D, full layers (per_layer_config or global_head_dim)
    num_global_key_value_heads: int  # K, full layers
    sliding_rope_theta: float
    full_rope_theta: float
    full_partial_rotary_factor: float
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    max_position_embeddings: int = 0
    use_bidirectional_attention: str | None = None

    def dims(self, layer: int) -> tuple[int, int]:
        """(head dim, kv heads) of layer `layer`'s type."""
        if self.layer_types[layer] == FULL:
            return self.global_head_dim, self.num_global_key_value_heads
        return self.head_dim, self.num_key_value_heads


def _int(d: dict, key: str, where: str, default=None, minimum: int = 1) -> int:
    v = d.get(key)
    if v is None:
        if default is None:
            _refuse(where + key, "missing")
        return default
    if type(v) is not int or not minimum <= v < USIZE:
        _refuse(where + key, f"must be an integer ≥ {minimum}, got {v!r}")
    return v


def _num(d: dict, key: str, where: str, default: float) -> float:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float, Decimal)) or not np.isfinite(float(v)):
        _refuse(where + key, f"must be a finite number, got {v!r}")
    return float(v)


def _bool(d: dict, key: str, where: str, default: bool) -> bool:
    v = d.get(key)
    if v is None:
        return default
    if type(v) is not bool:
        _refuse(where + key, f"must be true or false, got {v!r}")
    return v


def parse_config(raw: dict) -> DGConfig:
    """DG0, with the refusals its list allows (each naming the field)."""
    if raw.get("model_type") != MODEL_TYPE:
        _refuse("model_type", f"must be {MODEL_TYPE!r}, got {raw.get('model_type')!r}")
    archs = raw.get("architectures")
    if archs is not None and archs != [ARCHITECTURE]:
        _refuse("architectures", f"expected [{ARCHITECTURE!r}], got {archs!r}")
    tc = raw.get("text_config")
    if not isinstance(tc, dict):
        _refuse("text_config", f"must be an object (the language model's fields), got {tc!r}")
    w = "text_config."
    if not _bool(raw, "tie_word_embeddings", "", True):
        # false also unties the encoder from the decoder: weights this contract does not load
        _refuse("tie_word_embeddings", "false is not supported (it unties the encoder too)")
    if tc.get("model_type") is not None and tc["model_type"] != "diffusion_gemma_text":
        _refuse(w + "model_type", f"must be 'diffusion_gemma_text', got {tc['model_type']!r}")
    act = tc.get("hidden_activation")
    if act is not None and act != "gelu_pytorch_tanh":
        _refuse(w + "hidden_activation", f"only gelu_pytorch_tanh is supported, got {act!r}")
    if _bool(tc, "attention_bias", w, False):
        _refuse(w + "attention_bias", "true is not supported (no biases in this family's contract)")
    if tc.get("use_clipped_linears"):
        _refuse(w + "use_clipped_linears", "clipped linears (vision) are not supported")
    uba = tc.get("use_bidirectional_attention")
    if uba == "all":
        _refuse(
            w + "use_bidirectional_attention",
            '"all" (a bidirectional encoder) is not supported; null or "vision" only',
        )
    if uba not in (None, "vision"):
        _refuse(w + "use_bidirectional_attention", f'must be null, "vision" or "all", got {uba!r}')
    if "final_logit_softcapping" in tc and tc["final_logit_softcapping"] is None:
        _refuse(w + "final_logit_softcapping", "null is not supported (the cap divides by it)")
    cap = _num(tc, "final_logit_softcapping", w, 30.0)
    if not cap > 0:
        _refuse(w + "final_logit_softcapping", f"must be positive, got {cap}")
    n = _int(tc, "num_hidden_layers", w, 30)
    lt = tc.get("layer_types")
    if lt is None:  # DiffusionGemmaTextConfig: 5 sliding : 1 full
        lt = [SLIDING if (i + 1) % 6 else FULL for i in range(n)]
    elif not isinstance(lt, list) or any(t not in (SLIDING, FULL) for t in lt):
        _refuse(w + "layer_types", f"entries must be {SLIDING!r} or {FULL!r}, got {lt!r}")
    elif len(lt) != n:
        _refuse(w + "layer_types", f"{len(lt)} entries for num_hidden_layers {n}")
    lt = list(lt)
    lt[-1] = FULL  # transformers forces the last layer to full attention
    heads = _int(tc, "num_attention_heads", w, 8)
    d = _int(tc, "head_dim", w, 256)
    kv = _int(tc, "num_key_value_heads", w, 4)
    D, K = _full_dims(tc, lt, w, d, kv)
    for name, dim in (("head_dim", d), ("per_layer_config.head_dim", D)):
        if dim % 2:
            _refuse(w + name, f"must be even for RoPE, got {dim}")
    for name, k in (("num_key_value_heads", kv), ("per_layer_config.num_key_value_heads", K)):
        if heads % k:
            _refuse(w + name, f"num_attention_heads {heads} is not a multiple of {k}")
    s_theta, f_theta, factor = _rope_parameters(tc.get("rope_parameters"), w)
    e = _int(tc, "num_experts", w)
    k = _int(tc, "top_k_experts", w)
    if not 1 <= k < e:
        _refuse(w + "top_k_experts", f"must satisfy 1 ≤ k < num_experts ({e}), got {k}")
    mpe = _int(tc, "max_position_embeddings", w, 131072)
    if mpe > MAX_POSITIONS:
        _refuse(w + "max_position_embeddings", f"{mpe} exceeds 2^24 = {MAX_POSITIONS}")
    eps = tc.get("rms_norm_eps")
    eps = Decimal("1e-6") if eps is None else eps
    if isinstance(eps, bool) or not isinstance(eps, (int, float, Decimal)):
        _refuse(w + "rms_norm_eps", f"must be a number, got {eps!r}")
    return DGConfig(
        canvas_length=_int(raw, "canvas_length", "", 256),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", "", True),
        vocab_size=_int(tc, "vocab_size", w, 262144, minimum=2),
        hidden_size=_int(tc, "hidden_size", w, 2304),
        intermediate_size=_int(tc, "intermediate_size", w, 9216),
        num_hidden_layers=n,
        rms_norm_eps=ops.f32_of_config_number(eps),
        final_logit_softcapping=cap,
        layer_types=lt,
        sliding_window=_int(tc, "sliding_window", w, 512),
        num_attention_heads=heads,
        head_dim=d,
        num_key_value_heads=kv,
        global_head_dim=D,
        num_global_key_value_heads=K,
        sliding_rope_theta=s_theta,
        full_rope_theta=f_theta,
        full_partial_rotary_factor=factor,
        num_experts=e,
        top_k_experts=k,
        moe_intermediate_size=_int(tc, "moe_intermediate_size", w),
        max_position_embeddings=mpe,
        use_bidirectional_attention=uba,
    )


def _full_dims(tc: dict, lt: list[str], w: str, d: int, kv: int) -> tuple[int, int]:
    """DG0 "Heads per layer type": D and K of the full layers. An entry of `per_layer_config`
    overrides the config's own `head_dim` / `num_key_value_heads` (a key it omits keeps the
    config's value, as transformers' per-layer view does), and a full layer without an entry
    keeps both; every full layer must end with the same pair."""
    plc = tc.get("per_layer_config")
    if plc is None:
        D = _int(tc, "global_head_dim", w, 512)
        K = _int(tc, "num_global_key_value_heads", w, kv)
        return D, K
    where = w + "per_layer_config"
    if not isinstance(plc, dict):
        _refuse(where, f"must be an object keyed by layer index, got {plc!r}")
    full = [i for i, t in enumerate(lt) if t == FULL]
    for key, entry in plc.items():
        if not (key.isascii() and key.isdigit()) or int(key) not in full:
            _refuse(f"{where}.{key}", "only full_attention layers may be overridden")
        if not isinstance(entry, dict) or not set(entry) <= {"head_dim", "num_key_value_heads"}:
            _refuse(
                f"{where}.{key}",
                f"may give only head_dim and num_key_value_heads, got {entry!r}",
            )
    seen = None
    for i in full:
        entry = plc.get(str(i), {})
        at = f"{where}.{i}."
        dk = (_int(entry, "head_dim", at, d), _int(entry, "num_key_value_heads", at, kv))
        if seen is not None and dk != seen:
            _refuse(f"{where}.{i}", f"{dk} differs from another full layer's {seen}")
        seen = dk
    return seen


def _rope_parameters(rp, w: str) -> tuple[float, float, float]:
    """DG4: (sliding theta, full theta, full partial_rotary_factor); only `default` (sliding) and
    `proportional` (full), factor 1."""
    where = w + "rope_parameters"
    if rp is None:
        return 10000.0, 1000000.0, 0.25
    if not isinstance(rp, dict):
        _refuse(where, f"must be an object keyed by layer type, got {rp!r}")
    extra = sorted(set(rp) - {SLIDING, FULL})
    if extra:
        _refuse(f"{where}.{extra[0]}", "not a layer type of this family")
    out = []
    for lt, kind, allowed in (
        (SLIDING, "default", {"rope_type", "rope_theta", "partial_rotary_factor"}),
        (FULL, "proportional", {"rope_type", "rope_theta", "partial_rotary_factor", "factor"}),
    ):
        d = rp.get(lt)
        at = f"{where}.{lt}"
        if not isinstance(d, dict):
            _refuse(at, f"must be an object, got {d!r}")
        bad = sorted(set(d) - allowed)
        if bad:
            _refuse(f"{at}.{bad[0]}", "not supported")
        if d.get("rope_type") != kind:
            _refuse(f"{at}.rope_type", f"must be {kind!r}, got {d.get('rope_type')!r}")
        theta = _num(d, "rope_theta", at + ".", 10000.0 if lt == SLIDING else 1000000.0)
        if not theta > 0:
            _refuse(f"{at}.rope_theta", f"must be positive, got {theta}")
        f = _num(d, "partial_rotary_factor", at + ".", 1.0 if lt == SLIDING else 0.25)
        if lt == SLIDING and f != 1.0:
            _refuse(f"{at}.partial_rotary_factor", f"must be 1 on sliding layers, got {f}")
        if not 0.0 < f <= 1.0:
            _refuse(f"{at}.partial_rotary_factor", f"must be in (0, 1], got {f}")
        if _num(d, "factor", at + ".", 1.0) != 1.0:
            _refuse(f"{at}.factor", f"must be 1, got {d['factor']}")
        out.append((theta, f))
    return out[0][0], out[1][0], out[1][1]


def load_config(model_dir: str) -> DGConfig:
    path = os.path.join(model_dir, "config.json")
    raw = jsonfile.loads_unique(jsonfile.read_bytes(path, path), path, parse_float=Decimal)
    if not isinstance(raw, dict):
        raise ContractError(f"{path}: not a JSON object")
    return parse_config(raw)


# --------------------------------------------------------------------------------------------
# DG0 generation knobs


@dataclass
class Knobs:
    max_new_tokens: int
    canvas_length: int
    max_denoising_steps: int
    entropy_bound: float
    t_max: float
    t_min: float
    stability_threshold: int
    confidence_threshold: float
    eos_token_id: list[int] | None
    pad_token_id: int | None
    seed: int = 0

    def provenance(self) -> dict:
        return {
            "max_new_tokens": self.max_new_tokens,
            "canvas_length": self.canvas_length,
            "max_denoising_steps": self.max_denoising_steps,
            "entropy_bound": self.entropy_bound,
            "t_max": self.t_max,
            "t_min": self.t_min,
            "stability_threshold": self.stability_threshold,
            "confidence_threshold": self.confidence_threshold,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


# transformers' _get_default_generation_params, for the knobs the checkpoint leaves unset.
GLOBAL_DEFAULTS = {
    "max_denoising_steps": 48,
    "entropy_bound": 0.1,
    "t_min": 0.4,
    "t_max": 0.8,
    "stability_threshold": 1,
    "confidence_threshold": 0.005,
}
# The command line's flag of each knob (refusals name the flag that set a bad value).
FLAGS = {
    "max_denoising_steps": "--denoising-steps",
    "entropy_bound": "--entropy-bound",
    "t_max": "--t-max",
    "t_min": "--t-min",
    "stability_threshold": "--stability-threshold",
    "confidence_threshold": "--confidence-threshold",
    "eos_token_id": "--eos",
    "pad_token_id": "--pad",
    "seed": "--seed",
}


def _generation_json(model_dir: str) -> dict:
    """generation_config.json's knobs (DG0), null as absent; {} when there is none."""
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    g = jsonfile.loads_unique(jsonfile.read_bytes(path, path), path, parse_float=Decimal)
    if not isinstance(g, dict):
        raise ContractError(f"{path}: not a JSON object")
    where = "generation_config.json"
    if g.get("max_length") is not None:
        raise ContractError(f"{where}: max_length: not supported (give --generate instead)")
    out = {}
    for k in ("max_denoising_steps", "t_min", "t_max", "stability_threshold"):
        if g.get(k) is not None:
            out[k] = g[k]
    if g.get("confidence_threshold") is not None:
        out["confidence_threshold"] = g["confidence_threshold"]
    sc = g.get("sampler_config")
    if sc is not None:
        if not isinstance(sc, dict):
            raise ContractError(f"{where}: sampler_config: must be an object, got {sc!r}")
        if sc.get("entropy_bound") is not None:
            out["entropy_bound"] = sc["entropy_bound"]
    if g.get("eos_token_id") is not None:
        e = g["eos_token_id"]
        out["eos_token_id"] = e if isinstance(e, list) else [e]
    if g.get("pad_token_id") is not None:
        out["pad_token_id"] = g["pad_token_id"]
    return {k: (float(v) if isinstance(v, Decimal) else v) for k, v in out.items()}


def resolve_knobs(model_dir: str, cfg: DGConfig, generate: int, given: dict) -> Knobs:
    """Checkpoint's generation_config.json, then the global defaults, then the command line
    (`given`: flag knobs that were set); every value checked, naming where it came from."""
    from_json = _generation_json(model_dir)
    vals, src = {}, {}
    for k in FLAGS:
        if given.get(k) is not None:
            vals[k], src[k] = given[k], FLAGS[k]
        elif k in from_json:
            vals[k], src[k] = from_json[k], f"generation_config.json: {k}"
        else:
            vals[k], src[k] = GLOBAL_DEFAULTS.get(k), k

    def bad(k, why):
        raise ContractError(f"{src[k]}: {why}, got {vals[k]!r}")

    def is_int(v):
        return type(v) is int

    def is_num(v):
        return not isinstance(v, bool) and isinstance(v, (int, float)) and np.isfinite(float(v))

    if not is_int(vals["max_denoising_steps"]) or vals["max_denoising_steps"] < 1:
        bad("max_denoising_steps", "must be an integer ≥ 1")
    if not is_int(vals["stability_threshold"]) or vals["stability_threshold"] < 0:
        bad("stability_threshold", "must be an integer ≥ 0")
    for k in ("entropy_bound", "confidence_threshold"):
        if not is_num(vals[k]) or not vals[k] > 0:
            bad(k, "must be a number > 0")
    for k in ("t_min", "t_max"):
        if not is_num(vals[k]) or vals[k] < 0:
            bad(k, "must be a number ≥ 0")
    if not vals["t_max"] > vals["t_min"]:
        raise ContractError(
            f"{src['t_max']} ({vals['t_max']}) must exceed {src['t_min']} ({vals['t_min']})"
        )
    eos = vals["eos_token_id"]
    if eos is not None and (not eos or not all(is_int(t) and t >= 0 for t in eos)):
        bad("eos_token_id", "must be token ids ≥ 0")
    pad = vals["pad_token_id"]
    if pad is not None and not (is_int(pad) and pad >= 0):
        bad("pad_token_id", "must be a token id ≥ 0")
    seed = 0 if vals["seed"] is None else vals["seed"]
    if not is_int(seed) or not 0 <= seed <= splitmix.MASK:
        raise ContractError(f"--seed: must be an integer in [0, 2^64), got {seed!r}")
    return Knobs(
        max_new_tokens=generate,
        canvas_length=cfg.canvas_length,
        max_denoising_steps=vals["max_denoising_steps"],
        entropy_bound=float(vals["entropy_bound"]),
        t_max=float(vals["t_max"]),
        t_min=float(vals["t_min"]),
        stability_threshold=vals["stability_threshold"],
        confidence_threshold=float(vals["confidence_threshold"]),
        eos_token_id=None if eos is None else [int(t) for t in eos],
        pad_token_id=pad,
        seed=seed,
    )


# --------------------------------------------------------------------------------------------
# Weights (DG0 "Weights")


def _vec(ck: Checkpoint, name: str, n: int) -> np.ndarray:
    return np.array(ck.take(name, (n,)), dtype=F32)


class LayerWeights:
    """Decoder layer `i`'s tensors (shared by the encoder) and both sides' layer_scalar."""

    def __init__(self, cfg: DGConfig, ck: Checkpoint, i: int):
        p, H = f"{P_DEC}layers.{i}.", cfg.hidden_size
        self.sliding = cfg.layer_types[i] == SLIDING
        dt, kt = cfg.dims(i)
        nh, E, I, F = (
            cfg.num_attention_heads,
            cfg.num_experts,
            cfg.moe_intermediate_size,
            cfg.intermediate_size,
        )
        a = p + "self_attn."
        self.wq_t = ops.transpose_weight(ck.take(a + "q_proj.weight", (nh * dt, H)))
        self.wk_t = ops.transpose_weight(ck.take(a + "k_proj.weight", (kt * dt, H)))
        # Full layers have no v_proj: v is the raw k projection (DG5 step 3).
        self.wv_t = (
            ops.transpose_weight(ck.take(a + "v_proj.weight", (kt * dt, H)))
            if self.sliding
            else None
        )
        self.wo_t = ops.transpose_weight(ck.take(a + "o_proj.weight", (H, nh * dt)))
        self.q_norm = _vec(ck, a + "q_norm.weight", dt)
        self.k_norm = _vec(ck, a + "k_norm.weight", dt)
        for n in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            setattr(self, n, _vec(ck, p + n + ".weight", H))
        self.wg_t = ops.transpose_weight(ck.take(p + "mlp.gate_proj.weight", (F, H)))
        self.wu_t = ops.transpose_weight(ck.take(p + "mlp.up_proj.weight", (F, H)))
        self.wd_t = ops.transpose_weight(ck.take(p + "mlp.down_proj.weight", (H, F)))
        self.router_t = ops.transpose_weight(ck.take(p + "router.proj.weight", (E, H)))
        self.router_scale = _vec(ck, p + "router.scale", H)
        self.per_expert_scale = _vec(ck, p + "router.per_expert_scale", E)
        gu = ck.take(p + "experts.gate_up_proj", (E, 2 * I, H))
        dn = ck.take(p + "experts.down_proj", (E, H, I))
        self.expert_gu_t = [ops.transpose_weight(gu[e]) for e in range(E)]
        self.expert_dn_t = [ops.transpose_weight(dn[e]) for e in range(E)]
        # DG9: λ of each side (separate buffers; only weights are tied).
        self.scalar = {
            "denoise": _vec(ck, p + "layer_scalar", 1)[0],
            "encode": _vec(ck, f"{P_ENC_LAYERS}{i}.layer_scalar", 1)[0],
        }


# --------------------------------------------------------------------------------------------
# Passes: what each forward's tensors are called and where they sit


class Pass:
    """One forward's naming and attributes: the prompt pass (names unprefixed), a commit pass
    (`encode.BBBB.`) or denoise step s of block b (`denoise.BBBB.SSSS.`)."""

    def __init__(self, kind: str, block: int | None, step: int | None, W: int):
        self.kind, self.block, self.step, self.W = kind, block, step, W
        self.path = "encode" if kind != "denoise" else "denoise"

    def name(self, rest: str) -> str:
        if self.kind == "prompt":
            return rest
        if self.kind == "commit":
            return names.encode(self.block, rest)
        return names.denoise(self.block, self.step, rest)

    def mask(self, sliding: bool | None) -> str:
        """DG16: None outside the layers."""
        if self.path == "encode":
            return f"sliding:{self.W}" if sliding else "causal"
        return f"bidirectional,sliding:{self.W}" if sliding else "bidirectional"


def pass_of(name: str, W: int) -> Pass | None:
    """The pass a tensor's name belongs to, by its prefix (DG16); None for a name of no pass (a
    decode step's, a block's)."""
    n = names.parse(name)
    d = n.diffusion
    if n.decode_step is not None:
        return None
    if d is None:
        return Pass("prompt", None, None, W)
    if d.kind == "encode":
        return Pass("commit", d.block, None, W)
    if d.kind == "denoise":
        return Pass("denoise", d.block, d.step, W)
    return None


def place(cfg: DGConfig) -> Place:
    """Where a recorded tensor sits (DG16): its pass's path, and its layer's mask in that pass
    (the pass's own outside the layers)."""

    def at(name: str) -> tuple[str, str]:
        ps, layer = pass_of(name, cfg.sliding_window), names.parse(name).layer
        return ps.path, ps.mask(None if layer is None else cfg.layer_types[layer] == SLIDING)

    return at


class Cache:
    """Per layer, every encoder row's k and v (after step 4 of DG5) with its position."""

    def __init__(self, n: int):
        self.k: list[np.ndarray | None] = [None] * n
        self.v: list[np.ndarray | None] = [None] * n
        self.pos: list[list[int]] = [[] for _ in range(n)]

    def rows(self, i: int, start: int = 0):
        if self.k[i] is None:
            return None, None, []
        return self.k[i][start:], self.v[i][start:], self.pos[i][start:]

    def extend(self, i, k, v, pos):
        self.k[i] = k if self.k[i] is None else np.concatenate([self.k[i], k])
        self.v[i] = v if self.v[i] is None else np.concatenate([self.v[i], v])
        self.pos[i].extend(pos)


def _ieee():
    return np.errstate(all="ignore")


# --------------------------------------------------------------------------------------------
# The model


class DiffusionGemma:
    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        cfg = self.cfg = load_config(model_dir)
        ck = Checkpoint(model_dir)
        V, H = cfg.vocab_size, cfg.hidden_size
        self.embed_table = ck.take(P_DEC + "embed_tokens.weight", (V, H))  # widened, f32
        self.layers = [LayerWeights(cfg, ck, i) for i in range(cfg.num_hidden_layers)]
        self.norm = _vec(ck, P_DEC + "norm.weight", H)
        sc = P_DEC + "self_conditioning."
        F = cfg.intermediate_size
        self.sc_pre_norm = _vec(ck, sc + "pre_norm.weight", H)
        self.sc_wg_t = ops.transpose_weight(ck.take(sc + "gate_proj.weight", (F, H)))
        self.sc_wu_t = ops.transpose_weight(ck.take(sc + "up_proj.weight", (F, H)))
        self.sc_wd_t = ops.transpose_weight(ck.take(sc + "down_proj.weight", (H, F)))
        head = self.embed_table if cfg.tie_word_embeddings else ck.take("lm_head.weight", (V, H))
        self.head_t = ops.transpose_weight(head)
        self.unused_tensors = ck.finish(UNUSED_PREFIXES)
        # DG2, DG8: libm pow in binary64, rounded once.
        self.s_e = F32(math.pow(float(H), 0.5))
        self.rho = F32(math.pow(float(H), -0.5))
        self.rope = {
            SLIDING: ops.Rope(cfg.sliding_rope_theta, cfg.head_dim),
            FULL: _proportional_rope(
                cfg.full_rope_theta, cfg.global_head_dim, cfg.full_partial_rotary_factor
            ),
        }
        self.forcing: Forcing | None = None

    # DG2
    def embed(self, tokens) -> np.ndarray:
        V = self.cfg.vocab_size
        for t in tokens:
            if not 0 <= int(t) < V:
                raise ContractError(f"token id {int(t)} is outside the vocabulary [0, {V})")
        return self.embed_table[np.asarray(tokens, dtype=np.int64)] * self.s_e

    def _norm(self, x, w):
        return ops.rmsnorm(x, w, self.cfg.rms_norm_eps)

    def _plain(self, x):
        """DG3 rmsnorm_plain: x ⊗ inv (with_scale=False)."""
        return ops.rmsnorm_plain(x, self.cfg.rms_norm_eps)

    # DG5, DG6
    def attention(self, i, L: LayerWeights, xn, pos, ps: Pass, cap, cache: Cache):
        cfg = self.cfg
        nh = cfg.num_attention_heads
        dt, kt = cfg.dims(i)
        t = xn.shape[0]
        rope = self.rope[cfg.layer_types[i]]
        cos, sin = rope.tables(pos)
        q = ops.matmul(xn, L.wq_t).reshape(t, nh, dt)
        q = ops.Rope.apply(self._norm(q, L.q_norm), cos, sin)
        kr = ops.matmul(xn, L.wk_t).reshape(t, kt, dt)
        vr = ops.matmul(xn, L.wv_t).reshape(t, kt, dt) if L.sliding else kr
        k = ops.Rope.apply(self._norm(kr, L.k_norm), cos, sin)
        v = self._plain(vr)
        cap.tensor(ps.name(names.layer(i, "q")), q, pos, internal=True)
        cap.tensor(ps.name(names.layer(i, "k")), k, pos, internal=True)
        cap.tensor(ps.name(names.layer(i, "v")), v, pos, internal=True)
        if ps.path == "encode":
            ck, cv, cpos = cache.rows(i)  # every cached position; the mask does the rest
        else:
            L_len = len(cache.pos[i])
            start = max(0, L_len - cfg.sliding_window + 1) if L.sliding else 0
            ck, cv, cpos = cache.rows(i, start)
        keys = k if ck is None else np.concatenate([ck, k])
        vals = v if cv is None else np.concatenate([cv, v])
        kpos = np.asarray(list(cpos) + list(pos))
        qpos = np.asarray(pos)
        if ps.path == "encode":
            visible = kpos[None, :] <= qpos[:, None]
            if L.sliding:
                visible &= kpos[None, :] > qpos[:, None] - cfg.sliding_window
        else:
            visible = np.ones((t, len(kpos)), dtype=bool)
        o, probs = ops.attention_visible(q, keys, vals, visible, F32(1.0))
        cap.tensor(ps.name(names.layer(i, "attn_probs")), probs, pos, internal=True)
        if ps.path == "encode":
            cache.extend(i, k, v, pos)
        return ops.matmul(o.reshape(t, nh * dt), L.wo_t)

    def mlp(self, x, wg_t, wu_t, wd_t):
        """DG7: (gelu(x·Wgᵀ) ⊗ (x·Wuᵀ))·Wdᵀ."""
        return ops.matmul(ops.gelu_tanh(ops.matmul(x, wg_t)) * ops.matmul(x, wu_t), wd_t)

    # DG8
    def moe(self, i, L: LayerWeights, h1, pos, ps: Pass, cap):
        cfg = self.cfg
        k, E, I = cfg.top_k_experts, cfg.num_experts, cfg.moe_intermediate_size
        xr = (self._plain(h1) * L.router_scale) * self.rho
        g = ops.matmul(xr, L.router_t)
        cap.tensor(ps.name(names.layer(i, "router.logits")), g, pos, internal=True)
        p = ops.softmax(g)
        if np.isnan(p).any():
            row = int(np.nonzero(np.isnan(p).any(axis=-1))[0][0])
            raise ContractError(
                f"{ps.name(names.layer(i, 'router'))}: NaN router probability in row {row}"
            )
        chosen, margin = ops.topk(p, k)
        name = ps.name(names.layer(i, "router.topk"))
        forced = self._forced(name, (len(pos), k), E, distinct=True)
        if forced is not None:
            overridden = force.rows_differing(forced, chosen)
            margin = np.array([ops.margin_of(p[r], forced[r]) for r in range(len(pos))], dtype=F32)
            chosen = forced
        cap.decided(name, chosen, margin, overridden if forced is not None else None)
        rows = np.arange(len(pos))
        den = np.zeros(len(pos), dtype=F32)
        for j in range(k):  # rank order (§10.4)
            den = den + p[rows, chosen[:, j]]
        wts = np.empty((len(pos), k), dtype=F32)
        for j in range(k):
            wts[:, j] = (p[rows, chosen[:, j]] / den) * L.per_expert_scale[chosen[:, j]]
        x3 = self._norm(h1, L.pre_feedforward_layernorm_2)
        out = np.zeros_like(h1)
        for e in range(E):
            r, j = np.nonzero(chosen == e)
            if r.size == 0:
                continue
            gu = ops.matmul(x3[r], L.expert_gu_t[e])
            y = ops.matmul(ops.gelu_tanh(gu[:, :I]) * gu[:, I:], L.expert_dn_t[e])
            cap.tensor(ps.name(names.expert(i, e, "out")), y, [pos[x] for x in r], internal=True)
            out[r] = out[r] + y * wts[r, j][:, None]
        return out

    # DG9
    def layer_alone(self, i, x, pos, ps: Pass, cap, cache):
        """Layer `i` by itself (the `layer` verb): the call a whole run makes for it."""
        with _ieee():
            return self.layer(i, x, pos, ps, cap, cache)

    def layer(self, i, x, pos, ps: Pass, cap, cache):
        L = self.layers[i]

        def c(point, arr, internal=False):
            cap.tensor(ps.name(names.layer(i, point)), arr, pos, internal=internal)

        c("hidden_in", x)
        a = self.attention(i, L, self._norm(x, L.input_layernorm), pos, ps, cap, cache)
        c("attn_out", a)
        h1 = x + self._norm(a, L.post_attention_layernorm)
        c("attn_residual", h1, True)
        dense = self.mlp(self._norm(h1, L.pre_feedforward_layernorm), L.wg_t, L.wu_t, L.wd_t)
        c("dense_mlp.out", dense, True)
        d1 = self._norm(dense, L.post_feedforward_layernorm_1)
        c("dense_mlp.branch", d1)
        moe = self.moe(i, L, h1, pos, ps, cap)
        c("moe.out", moe, True)
        d2 = self._norm(moe, L.post_feedforward_layernorm_2)
        c("moe.branch", d2)
        m = self._norm(d1 + d2, L.post_feedforward_layernorm)
        c("mlp_out", m)
        out = (h1 + m) * L.scalar[ps.path]
        c("hidden_out", out)
        return out

    def encode(self, tokens, pos, ps: Pass, cap, cache):
        """An encoder pass (the prompt, or a committed canvas): appends its rows to the cache."""
        with _ieee():
            h = self.embed(tokens)
            cap.tensor(ps.name("embed.out"), h, pos)
            for i in range(self.cfg.num_hidden_layers):
                h = self.layer(i, h, pos, ps, cap, cache)

    # DG10, DG11
    def denoise_forward(self, canvas, pos, ps: Pass, cap, cache, prev_tempered):
        """Decoder forward of one step; returns the (capped) logits [C, V]."""
        with _ieee():
            cap.tensor(ps.name("canvas"), np.asarray(canvas, dtype=np.int64), pos)
            e = self.embed(canvas)
            cap.tensor(ps.name("embed.out"), e, pos)
            if prev_tempered is None:
                soft = np.zeros_like(e)
            else:
                qs = ops.softmax(prev_tempered)
                soft = ops.matmul(qs, self.embed_table) * self.s_e
            cap.tensor(ps.name("sc.soft"), soft, pos)
            sc_in = self._norm(soft, self.sc_pre_norm)
            sc_mlp = self.mlp(sc_in, self.sc_wg_t, self.sc_wu_t, self.sc_wd_t)
            cap.tensor(ps.name("sc.mlp_out"), sc_mlp, pos, internal=True)
            h = self._plain(e + sc_mlp)
            cap.tensor(ps.name("sc.out"), h, pos)
            for i in range(self.cfg.num_hidden_layers):
                h = self.layer(i, h, pos, ps, cap, cache)
            f = self._norm(h, self.norm)
            cap.tensor(ps.name("final_norm.out"), f, pos)
            z = ops.matmul(f, self.head_t)
            cap.tensor(ps.name("logits.uncapped"), z, pos, internal=True)
            c = F32(self.cfg.final_logit_softcapping)
            logits = ops.tanh_to_f32(z / c) * c
            cap.tensor(ps.name("logits"), logits, pos)
            return logits

    # --- forcing -----------------------------------------------------------------------------

    def _forced(self, name, shape, vrange, distinct=False, allow_minus_one=False):
        """REF's values for decision `name` under --force-decisions (None without it), checked
        against the shape and range this run needs (force.Forcing.take)."""
        if self.forcing is None:
            return None
        return self.forcing.take(name, shape, vrange, distinct, allow_minus_one)

    # --- DG12, DG13: one step's decisions ----------------------------------------------------

    def decide(self, b, s, logits, canvas, history, knobs: Knobs, cap, ps: Pass, pos):
        """Temperature, probabilities, entropy, and argmax/sampled/accept/renoise/stop. Returns
        (tempered, argmax, argmax margins, next canvas, stop)."""
        C, V, N = self.cfg.canvas_length, self.cfg.vocab_size, knobs.max_denoising_steps
        with _ieee():
            # DG12.1
            k = N - s
            T = F32(knobs.t_min) + (F32(knobs.t_max - knobs.t_min) * (F32(k) / F32(N)))
            ell = logits / T
            cap.tensor(ps.name("logits.tempered"), ell, pos)
            # DG12.2 (§8.6 spelled out: m and z feed the entropy)
            m = np.max(ell, axis=-1, keepdims=True)
            ex = ops.exp_to_f32(ell - m)
            z = ops.ordered_sum(ex, axis=-1)
            P = ex / z[:, None]
            # DG12.3
            lse = m[:, 0] + ops.log_to_f32(z)
            lp = np.maximum(ell - lse[:, None], F32_MIN)
            acc = np.zeros(C, dtype=F32)
            for v in range(V):
                acc = acc + lp[:, v] * P[:, v]
            hent = -acc
        bad = np.nonzero(np.isnan(hent))[0]
        if bad.size:
            raise ContractError(
                f"{ps.name('entropy')}: NaN entropy in block {b}, step {s}, row {int(bad[0])}"
            )
        cap.tensor(ps.name("entropy"), hent, pos)

        # DG13.1
        name = ps.name("argmax")
        top, margin = ops.argmax_margin(ell, what=f"{name} (tempered logits)")
        forced = self._forced(name, (C,), V)
        if forced is not None:
            over = force.rows_differing(forced, top)
            margin = np.array([ops.margin_of(ell[r], [forced[r]]) for r in range(C)], dtype=F32)
            top = forced
        self._record(cap, name, top, margin, forced, over if forced is not None else [])

        # DG13.2
        name = ps.name("sampled")
        key = splitmix.key(knobs.seed, splitmix.SAMPLE, b, s)
        forced = self._forced(name, (C,), V)
        if forced is None:
            sampled = np.array(
                [
                    splitmix.categorical(P[r], splitmix.uniform(splitmix.output(key, r)))
                    for r in range(C)
                ],
                dtype=np.int64,
            )
            over = []
        else:  # the RNG is not consulted for forced draws
            own = np.array(
                [
                    splitmix.categorical(P[r], splitmix.uniform(splitmix.output(key, r)))
                    for r in range(C)
                ],
                dtype=np.int64,
            )
            over, sampled = force.rows_differing(forced, own), forced
        self._record(cap, name, sampled, P[np.arange(C), sampled], forced, over)

        # DG13.3
        name = ps.name("accept")
        beta = F32(knobs.entropy_bound)
        order = np.argsort(hent + F32(0.0), kind="stable")
        x = np.empty(C, dtype=F32)
        S_acc = F32(0.0)
        with _ieee():
            for j in range(C):
                r = order[j]
                S_acc = F32(S_acc + hent[r])
                x[r] = F32(S_acc - hent[r])
        accept = (x <= beta).astype(np.int64)
        forced = self._forced(name, (C,), 2)
        over = []
        if forced is not None:
            over, accept = force.rows_differing(forced, accept), forced
        acc_margin = np.where(accept == 1, beta - x, x - beta).astype(F32)
        self._record(cap, name, accept, acc_margin, forced, over)

        # DG13.4
        name = ps.name("renoise")
        rkey = splitmix.key(knobs.seed, splitmix.RENOISE, b, s)
        forced = self._forced(name, (C,), V, allow_minus_one=True)
        drawn = np.array(
            [splitmix.token(splitmix.output(rkey, r), V) for r in range(C)], dtype=np.int64
        )
        renoise = np.where(accept == 1, -1, drawn).astype(np.int64)
        over = []
        if forced is not None:
            wrong = np.nonzero((forced == -1) != (accept == 1))[0]
            if wrong.size:
                raise ContractError(
                    f"--force-decisions {self.forcing.path}: decision {name} row {int(wrong[0])} "
                    f"is {int(forced[wrong[0]])} where accept is {int(accept[wrong[0]])} (−1 exactly where accepted)"
                )
            over, renoise = force.rows_differing(forced, renoise), forced
        self._record(cap, name, renoise, None, forced, over)
        nxt = np.where(accept == 1, sampled, renoise).astype(np.int64)

        # DG13.5
        name = ps.name("stop")
        S = knobs.stability_threshold
        run = 0
        for prev in reversed(history):
            if not np.array_equal(prev, top):
                break
            run += 1
        stable = int(run >= S)
        with _ieee():
            mu = ops.ordered_sum(hent) / F32(C)
            thr = F32(knobs.confidence_threshold)
            confident = int(mu < thr)
        own = np.array([stable, confident, stable & confident], dtype=np.int64)
        forced = self._forced(name, (3,), 2)
        over = []
        vals = own
        if forced is not None:
            over, vals = force.rows_differing(forced, own), forced
        st, cf = int(vals[0]), int(vals[1])
        m_st = F32(run - S) if st else F32(S - run)
        m_cf = F32(thr - mu) if cf else F32(mu - thr)
        m_stop = m_cf if st else m_st
        self._record(cap, name, vals, np.array([m_st, m_cf, m_stop], dtype=F32), forced, over)
        return ell, top, margin, nxt, bool(vals[2])

    def _record(self, cap, name, values, margins, forced, overridden):
        cap.decided(name, values, margins, overridden if forced is not None else None)

    # --- DG14 --------------------------------------------------------------------------------

    def generate(self, tokens, knobs: Knobs, cap: Capture) -> tuple[list[int], int]:
        """The prompt's encoder pass, then the blocks. Returns (output tokens, blocks run)."""
        cfg = self.cfg
        n, C, V, W = len(tokens), cfg.canvas_length, cfg.vocab_size, cfg.sliding_window
        if n == 0:
            raise ContractError("the prompt is empty")
        cache = Cache(cfg.num_hidden_layers)
        self.encode(tokens, list(range(n)), Pass("prompt", None, None, W), cap, cache)
        B = -(-knobs.max_new_tokens // C)
        out: list[int] = []
        L = n
        blocks = 0
        for b in range(B):
            blocks += 1
            pos = list(range(L, L + C))
            name = names.denoise_block(b, "init_canvas")
            ikey = splitmix.key(knobs.seed, splitmix.INIT, b, 0)
            forced = self._forced(name, (C,), V)
            own = np.array(
                [splitmix.token(splitmix.output(ikey, r), V) for r in range(C)], dtype=np.int64
            )
            if forced is None:
                canvas = own
                cap.decision(name, canvas, None)
            else:
                canvas = forced
                cap.decided(name, canvas, None, force.rows_differing(forced, own))
            prev = None
            history: list[np.ndarray] = []
            last = None
            for s in range(knobs.max_denoising_steps):
                ps = Pass("denoise", b, s, W)
                logits = self.denoise_forward(canvas, pos, ps, cap, cache, prev)
                prev, top, margin, canvas, stop = self.decide(
                    b, s, logits, canvas, history, knobs, cap, ps, pos
                )
                history.append(top)
                last = (top, margin)
                if stop:
                    break
            commit, cmargin = last
            name = names.denoise_block(b, "commit")
            if self.forcing is not None:
                ref = self.forcing.values(name)
                if ref is not None and not np.array_equal(ref, commit):
                    raise ContractError(
                        f"--force-decisions {self.forcing.path}: {name} {ref.tolist()} differs from "
                        f"this run's {commit.tolist()} (the forced argmax of the block's last step)"
                    )
            cap.decision(name, commit, cmargin)
            block_out = [int(t) for t in commit]
            eos = knobs.eos_token_id
            hit = eos is not None and any(t in eos for t in block_out)
            if hit and knobs.pad_token_id is not None:
                first = next(j for j, t in enumerate(block_out) if t in eos)
                block_out = block_out[: first + 1] + [knobs.pad_token_id] * (C - first - 1)
            out.extend(block_out)
            if hit:
                break
            if b < B - 1:
                self.encode(commit, pos, Pass("commit", b, None, W), cap, cache)
            L += C
        return out, blocks


def _proportional_rope(base: float, D: int, f: float) -> ops.Rope:
    """DG4.2: inv_freq[i] = f32(1 / pow(base, 2i/D)) for i < a = int(f·D // 2), +0.0 for
    a ≤ i < D/2 (cos 1, sin 0: those pairs keep their values)."""
    r = ops.Rope(base, D)
    a = int(f * D // 2)
    r.inv_freq = np.array(r.inv_freq, dtype=F32)
    r.inv_freq[a:] = F32(0.0)
    return r


# --------------------------------------------------------------------------------------------
# One layer alone (the `layer` verb, docs/producers.md "Block diffusion")


def layer_input_pass(name: str, index: int, W: int) -> Pass:
    """The pass whose layer `index` input `name` is (`P` + `layer.LL.hidden_in`, P one of DG16's
    three prefixes); refused, naming it, for another layer, pass or point."""
    ps = pass_of(name, W)
    point = names.layer(index, "hidden_in")
    if ps is None or ps.name(point) != name:
        raise ContractError(
            f"--input-name {name}: not layer {index}'s input of a pass "
            f"({point}, encode.BBBB.{point} or denoise.BBBB.SSSS.{point})"
        )
    return ps


def cache_from_trace(src, input_path, ps: Pass, index: int, n_layers: int, row: int) -> Cache:
    """DG6's cache of layer `index` for pass `ps`, read back from the input trace: every earlier
    encoder pass's `layer.LL.k`/`v` (the prompt's, then `encode.0000.` … up to the block before
    this one), in the order the whole run appended them. The decoder's sliding window over it is
    `DiffusionGemma.attention`'s, as in the whole run."""
    cache = Cache(n_layers)
    if ps.kind == "prompt":
        return cache
    earlier = [Pass("prompt", None, None, ps.W)]
    earlier += [Pass("commit", b, None, ps.W) for b in range(ps.block)]
    for p in earlier:
        kn, vn = p.name(names.layer(index, "k")), p.name(names.layer(index, "v"))
        got = []
        for name in (kn, vn):
            if name not in src.names:
                raise ContractError(
                    f"{input_path}: no tensor {name} (the keys of {ps.name(names.layer(index, 'hidden_in'))}): "
                    "the input trace must be captured with --capture internals"
                )
            if src.dtype(name) != "f32":
                raise ContractError(f"{input_path}: tensor {name} is {src.dtype(name)}, not f32")
            a = np.ascontiguousarray(src[name])
            pos = [int(q) for q in (src.attributes(name).get("positions") or [])]
            if not pos or a.size != len(pos) * row:
                raise ContractError(
                    f"{input_path}: tensor {name} has shape {list(a.shape)} and {len(pos)} positions, expected {row} elements per position"
                )
            got.append((a, pos))
        (k, kpos), (v, vpos) = got
        if kpos != vpos:
            raise ContractError(f"{input_path}: tensors {kn} and {vn} are at different positions")
        cache.extend(index, k, v, kpos)
    return cache
