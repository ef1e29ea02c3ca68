"""A GGUF checkpoint for the oracle (docs/numerics.md §21): transformers' own model class, with the
tensors transformers' own GGUF loader dequantizes (`load_gguf_checkpoint`, through ggml's
`gguf.quants`; oracle/tests/test_gguf.py holds them bit for bit equal to the engine's and the
contract's) and transformers' own config from the metadata — completed with what the file states
and that loader does not read (§21.5: the head size, the biases the file holds), so the model is
the file's. What no producer honours (rope scaling from metadata, experts, tensors no module
claims) is refused, as a safetensors checkpoint's would be.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, OracleError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_ATTN_BIAS = re.compile(r"blk\.\d+\.attn_(q|k|v|output)\.bias")
_MLP_BIAS = re.compile(r"blk\.\d+\.ffn_(gate|up|down)\.bias")


def locate(model: str | os.PathLike) -> Path | None:
    """The GGUF file `--model` names: a `.gguf` file, or the one `.gguf` of a directory holding
    no safetensors; None for a safetensors checkpoint. Both kinds, or two .gguf files, are
    refused (which weights a trace records would be a guess)."""
    p = Path(model)
    if p.is_file():
        return p if p.suffix == ".gguf" else None
    if not p.is_dir():
        return None
    ggufs = sorted(x.name for x in p.iterdir() if x.name.endswith(".gguf"))
    if not ggufs:
        return None
    if any(x.name.endswith(".safetensors") for x in p.iterdir()):
        raise OracleError(f"--model {p}: holds both *.safetensors and .gguf files: keep one kind")
    if len(ggufs) > 1:
        raise OracleError(f"--model {p}: {len(ggufs)} .gguf files ({', '.join(ggufs)}): name one")
    return p / ggufs[0]


def _field(reader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


@dataclass
class Source:
    """A GGUF file, its metadata read once: the config (transformers' own, completed per
    §21.5) and how many tensors the file holds."""

    path: Path
    config: dict
    tensors: int


def read(path: Path) -> Source:
    """The file's `Source`; refuses what no producer honours."""
    from gguf import GGUFReader
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise OracleError(
            f"--model {path}: GGUF architecture {arch!r} is not supported ({', '.join(ARCHITECTURES)})"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise OracleError(
            f"--model {path}: metadata {arch}.rope.scaling.type = {scaling!r}: rope scaling from "
            "GGUF metadata is not supported (transformers' GGUF loader ignores it)"
        )
    if _field(reader, f"{arch}.expert_count"):
        raise OracleError(f"--model {path}: experts are not supported in a GGUF checkpoint")
    cfg = dict(load_gguf_checkpoint(str(path))["config"])
    sizes = {
        k: _field(reader, f"{arch}.{k}")
        for k in ("rope.dimension_count", "attention.key_length", "attention.value_length")
    }
    given = {k: v for k, v in sizes.items() if v is not None}
    if len(set(given.values())) > 1:
        raise OracleError(f"--model {path}: head sizes disagree: {given}")
    if given and "head_dim" not in cfg:
        cfg["head_dim"] = next(iter(given.values()))
    names = [t.name for t in reader.tensors]
    if any(_ATTN_BIAS.fullmatch(n) for n in names):
        cfg["attention_bias"] = True
    if arch == "llama" and any(_MLP_BIAS.fullmatch(n) for n in names):
        cfg["mlp_bias"] = True
    cfg["architectures"] = [
        ARCHITECTURES[arch] if cfg["model_type"] == arch else "MistralForCausalLM"
    ]
    return Source(path, cfg, len(reader.tensors))


def load(src: Source, auto, dtype, device: str):
    """transformers' class `auto` built from the file's config, holding its dequantized tensors:
    every parameter from the file, every tensor of the file a parameter (a tied head is the
    embedding). Returns the model in `dtype` on `device`."""
    import torch
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = src.path
    hf_config = AutoConfig.for_model(**src.config)
    with torch.device("meta"):
        skel = auto.from_config(hf_config, attn_implementation="eager")
    # Its tqdm bar ignores transformers' disable_progress_bar: kept off the oracle's stderr.
    with contextlib.redirect_stderr(io.StringIO()):
        loaded = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skel)
    tensors = loaded["tensors"]
    if len(tensors) != src.tensors:
        raise CheckpointError(
            f"--model {path}: transformers' GGUF loader mapped {len(tensors)} of the file's "
            f"{src.tensors} tensors (a tensor no module claims, e.g. rope_freqs.weight, is refused)"
        )
    model = auto.from_config(hf_config, attn_implementation="eager", dtype=torch.float32)
    want = set(model.state_dict())
    if hf_config.tie_word_embeddings:
        want.discard("lm_head.weight")
    got = set(tensors)
    if got != want:
        missing, extra = sorted(want - got), sorted(got - want)
        raise CheckpointError(
            f"--model {path}: the file's tensors do not match {type(model).__name__}: "
            f"missing {missing[:6]}, unexpected {extra[:6]}"
        )
    for name, value in tensors.items():
        shape = tuple(model.state_dict()[name].shape)
        if tuple(value.shape) != shape:
            raise CheckpointError(
                f"--model {path}: tensor {name} has shape {list(value.shape)}, the model {list(shape)}"
            )
    model.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=False)
    if hf_config.tie_word_embeddings:
        model.tie_weights()
    return model.to(dtype=dtype, device=device).eval()
