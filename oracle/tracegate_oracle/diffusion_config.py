"""diffusion_gemma's configuration (docs/diffusion-gemma.md DG0), read before torch: config.json's
refusals ("a first implementation may refuse"), checked by loading.preflight before transformers
builds anything, and the generation knobs — generation_config.json, transformers' defaults, the
command line's flags — each checked, one line naming the knob. Nothing here computes the model."""

from __future__ import annotations

import math
from pathlib import Path

from .checkpoint import read_config, read_json_file
from .errors import OracleError

FAMILY = "diffusion_gemma"

# The knobs of DG0 a command line sets: argparse dest -> (flag, generation_config key).
KNOB_FLAGS = {
    "max_denoising_steps": ("--denoising-steps", "max_denoising_steps"),
    "t_max": ("--t-max", "t_max"),
    "t_min": ("--t-min", "t_min"),
    "entropy_bound": ("--entropy-bound", "entropy_bound"),
    "stability_threshold": ("--stability-threshold", "stability_threshold"),
    "confidence_threshold": ("--confidence-threshold", "confidence_threshold"),
    "eos_token_id": ("--eos", "eos_token_id"),
    "pad_token_id": ("--pad", "pad_token_id"),
}
# generation_config.json keys, beside the knobs, that change nothing this run computes.
_INERT_KEYS = (
    "max_new_tokens",  # --generate N is max_new_tokens (DG16)
    "bos_token_id",
    "return_dict_in_generate",
    "transformers_version",
    "_from_model_config",
    "_commit_hash",
    "disable_compile",  # compiling needs a static cache, refused below
)


# ----------------------------------------------------------------------------------- config


def is_diffusion(model_dir) -> bool:
    """Whether `model_dir`'s config.json is a diffusion_gemma one (False when it has none)."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        return False
    try:
        return is_family(read_config(d))
    except OracleError:
        return False  # refused, with its own words, by the family-independent checks


def is_family(raw: dict) -> bool:
    """Whether a read config.json is diffusion_gemma's."""
    return raw.get("model_type") == FAMILY


def check_config(raw: dict, path: Path) -> None:
    """DG0's "a first implementation may refuse" list, one line naming the field."""

    def refuse(msg: str):
        raise OracleError(
            f"{path}: {msg} (not supported for {FAMILY}: docs/diffusion-gemma.md DG0)"
        )

    tc = raw.get("text_config")
    if not isinstance(tc, dict):
        refuse("no text_config object")
    vc = raw.get("vision_config")
    if isinstance(vc, dict) and vc.get("use_clipped_linears"):
        refuse("vision_config.use_clipped_linears = true")
    if tc.get("use_bidirectional_attention") == "all":
        refuse('text_config.use_bidirectional_attention = "all"')
    if tc.get("attention_bias") not in (None, False):
        refuse(f"text_config.attention_bias = {tc.get('attention_bias')!r}")
    act = tc.get("hidden_activation")
    if act not in (None, "gelu_pytorch_tanh"):
        refuse(f"text_config.hidden_activation = {act!r} (only gelu_pytorch_tanh)")
    if "final_logit_softcapping" in tc:
        cap = tc["final_logit_softcapping"]
        if cap is None or isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap <= 0:
            refuse(f"text_config.final_logit_softcapping = {cap!r} (a positive number)")
    rope = tc.get("rope_parameters")
    if rope is not None:
        if not isinstance(rope, dict):
            refuse("text_config.rope_parameters is not an object keyed by layer type")
        want = {"sliding_attention": "default", "full_attention": "proportional"}
        for lt, params in rope.items():
            at = f"text_config.rope_parameters.{lt}"
            if lt not in want or not isinstance(params, dict):
                refuse(f"{at}: not a layer type's RoPE object")
            if params.get("rope_type", want[lt]) != want[lt]:
                refuse(f"{at}.rope_type = {params.get('rope_type')!r} (expected {want[lt]!r})")
            allowed = {"rope_type", "rope_theta", "factor"} | (
                {"partial_rotary_factor"} if lt == "full_attention" else set()
            )
            extra = sorted(set(params) - allowed)
            if lt == "sliding_attention" and params.get("partial_rotary_factor", 1.0) == 1.0:
                extra = [k for k in extra if k != "partial_rotary_factor"]
            if extra:
                refuse(f"{at}.{extra[0]} = {params[extra[0]]!r}")
            if params.get("factor", 1.0) != 1.0:
                refuse(f"{at}.factor = {params['factor']!r} (only 1)")
    heads = tc.get("num_attention_heads", 8)
    d = tc.get("head_dim", 256)
    types = tc.get("layer_types") or []
    plc = tc.get("per_layer_config")
    full = set()
    if plc is not None:
        if not isinstance(plc, dict):
            refuse("text_config.per_layer_config is not an object")
        seen = None
        for k, v in plc.items():
            at = f"text_config.per_layer_config[{k}]"
            try:
                i = int(k)
            except (TypeError, ValueError):
                refuse(f"{at}: not a layer index")
            if not isinstance(v, dict):
                refuse(f"{at} is not an object")
            n = tc.get("num_hidden_layers")
            last = isinstance(n, int) and i == n - 1  # transformers forces the last layer full
            if not last and (i >= len(types) or types[i] != "full_attention"):
                refuse(f"{at}: overrides a layer that is not full_attention")
            extra = sorted(set(v) - {"head_dim", "num_key_value_heads"})
            if extra:
                refuse(f"{at}.{extra[0]} (only head_dim and num_key_value_heads)")
            # What an entry omits keeps the config's own value (transformers' per-layer view).
            v = (
                v.get("head_dim", d),
                v.get("num_key_value_heads", tc.get("num_key_value_heads", 4)),
            )
            if seen is not None and v != seen:
                refuse(f"{at} = {v} differs from another full layer's {seen}")
            seen = v
            full.add(v)
    if plc is None:  # full layers: global_head_dim (512 by default) and their own kv heads
        full.add((tc.get("global_head_dim", 512), tc.get("num_global_key_value_heads")))
    for hd, kv in [(d, tc.get("num_key_value_heads", 4)), *full]:
        if isinstance(hd, int) and hd % 2:
            refuse(f"head dim {hd} is odd (RoPE rotates pairs)")
        if isinstance(kv, int) and isinstance(heads, int) and kv >= 1 and heads % kv:
            refuse(f"num_attention_heads {heads} is not a multiple of {kv} key/value heads")
    _checkpoint_knobs(path.parent)  # generation_config.json's refusals, before torch loads
    ne, k = tc.get("num_experts"), tc.get("top_k_experts")
    if not (isinstance(k, int) and isinstance(ne, int) and 1 <= k < ne):
        refuse(f"text_config.top_k_experts = {k!r} with num_experts = {ne!r} (need 1 <= k < E)")


def given_flags(a) -> dict:
    """{flag: value} of the knob flags given on the command line."""
    return {
        f: getattr(a, dest)
        for dest, (f, _) in KNOB_FLAGS.items()
        if getattr(a, dest, None) is not None
    }


def cli_knobs(a) -> dict:
    """{generation key: value} of the knob flags given on the command line."""
    return {
        key: getattr(a, dest)
        for dest, (_, key) in KNOB_FLAGS.items()
        if getattr(a, dest, None) is not None
    }


def _checkpoint_knobs(model_dir: Path) -> dict:
    """generation_config.json's knobs ({} without one); JSON null is absent (DG0)."""
    path = model_dir / "generation_config.json"
    if not path.exists():
        return {}
    raw = read_json_file(path, f"{path}: not a regular file")
    if not isinstance(raw, dict):
        raise OracleError(f"{path}: not a JSON object")
    out = {}
    for k, v in raw.items():
        if v is None or k in _INERT_KEYS:
            continue
        if k == "sampler_config":
            if (
                not isinstance(v, dict)
                or v.get("_cls_name", "EntropyBoundSamplerConfig") != "EntropyBoundSamplerConfig"
            ):
                raise OracleError(f"{path}: sampler_config is not an EntropyBoundSamplerConfig")
            extra = sorted(set(v) - {"_cls_name", "entropy_bound"})
            if extra:
                raise OracleError(
                    f"{path}: sampler_config.{extra[0]} is not a knob of the entropy-bound sampler"
                )
            if v.get("entropy_bound") is not None:
                out["entropy_bound"] = v["entropy_bound"]
        elif k == "max_length":
            raise OracleError(
                f"{path}: max_length = {v!r} not supported for {FAMILY} (DG0: refused)"
            )
        elif k == "cache_implementation":
            if v != "dynamic":
                raise OracleError(
                    f"{path}: cache_implementation = {v!r}: only the dynamic cache (DG19)"
                )
        elif k in {key for _, key in KNOB_FLAGS.values()}:
            out[k] = v
        else:
            raise OracleError(f"{path}: {k} is not a generation knob of {FAMILY} (DG0)")
    return out


def resolve_knobs(model_dir, given: dict, vocab: int, max_new_tokens: int) -> dict:
    """DG0: the checkpoint's generation_config.json, then transformers' global defaults for the
    knobs it leaves unset, then the command line; each checked, one line naming the knob."""
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        DiffusionGemmaGenerationConfig,
    )

    defaults = DiffusionGemmaGenerationConfig._get_default_generation_params()
    k = {
        "max_denoising_steps": defaults["max_denoising_steps"],
        "entropy_bound": defaults["sampler_config"].entropy_bound,
        "t_max": defaults["t_max"],
        "t_min": defaults["t_min"],
        "stability_threshold": defaults["stability_threshold"],
        "confidence_threshold": defaults["confidence_threshold"],
        "eos_token_id": None,
        "pad_token_id": None,
    }
    src = {key: "transformers' default" for key in k}
    for key, v in _checkpoint_knobs(Path(model_dir)).items():
        k[key], src[key] = v, "generation_config.json"
    for key, v in given.items():
        k[key], src[key] = v, "command line"

    def bad(key, why):
        raise OracleError(f"{key} = {k[key]!r} ({src[key]}): {why}")

    def number(key):
        v = k[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            bad(key, "not a finite number")
        k[key] = float(v)

    def integer(key, low):
        v = k[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            bad(key, f"not an integer >= {low}")

    integer("max_denoising_steps", 1)
    integer("stability_threshold", 0)
    for key in ("entropy_bound", "t_max", "t_min", "confidence_threshold"):
        number(key)
    if k["entropy_bound"] <= 0:
        bad("entropy_bound", "must be > 0")
    if k["confidence_threshold"] <= 0:
        bad("confidence_threshold", "must be > 0")
    if k["t_min"] < 0:
        bad("t_min", "must be >= 0")
    if not k["t_max"] > k["t_min"]:
        bad("t_max", f"must be > t_min = {k['t_min']!r}")
    eos = k["eos_token_id"]
    if eos is not None:
        ids = eos if isinstance(eos, list) else [eos]
        if not ids or any(
            isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids
        ):
            bad("eos_token_id", f"not a token id (or list of them) in [0, {vocab})")
        k["eos_token_id"] = [int(t) for t in ids]
    pad = k["pad_token_id"]
    if pad is not None and (
        isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad < vocab
    ):
        bad("pad_token_id", f"not a token id in [0, {vocab})")
    k["max_new_tokens"] = max_new_tokens
    return k
