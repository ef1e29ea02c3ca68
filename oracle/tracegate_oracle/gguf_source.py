"""A GGUF checkpoint for the oracle (docs/numerics.md §21): transformers' own model class, with the
tensors transformers' own GGUF loader dequantizes (`load_gguf_checkpoint`, through ggml's
`gguf.quants`; oracle/tests/test_gguf.py holds them bit for bit equal to the engine's and the
contract's) and transformers' own config from the metadata — completed with what the file states
and that loader does not read (§21.5: the head size, the biases the file holds), so the model is
the file's.

Nothing reaches ggml's reader or transformers before the contract's checks of the file (`check`:
§21.1's container, the types, names and config the contract and the engine refuse, one checker
for the three readers): what they refuse is refused here in one line. What no producer honours
(rope scaling from metadata, experts, tensors no module claims) is refused, as a safetensors
checkpoint's would be."""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError, OracleError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
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


@dataclass
class Source:
    """A GGUF file that passed the contract's checks (`check`), its metadata read once: the
    config (transformers' own, completed per §21.5), how many tensors the file holds, and the
    metadata keys transformers' loader is shown (`_reader`)."""

    path: Path
    config: dict
    tensors: int
    shown: dict  # key -> (start, end): the metadata entries transformers' loader reads
    kv_end: int  # where the metadata ends (the tensor infos begin)


def check(path: Path):
    """The contract's checks of the file (tracegate_contract.config.check_gguf: numerics.md
    §21.1's container, the types and names, the config and its sizes against the tensors), the
    same ones the engine applies: a file they refuse is refused here in one line, before
    ggml's GGUFReader or transformers sees it. Returns the contract's parsed file."""
    from tracegate_contract import ContractError
    from tracegate_contract.config import check_gguf

    try:
        return check_gguf(str(path))[1]
    except ContractError as e:
        msg = str(e)
        where = "" if msg.startswith(f"{path}: ") else f"{path}: "
        raise CheckpointError(f"--model {where}{msg}") from None


@contextlib.contextmanager
def _reader(src: Source):
    """While it lasts, the `gguf.GGUFReader` transformers' loader makes (it imports the class
    from `gguf` when called) reads only the metadata entries `src.shown` (the keys transformers
    maps onto the config) and steps over the others, whose byte ranges the contract's parse
    gives: ggml's reader makes two numpy views per string, so a metadata array of 500,000
    strings (a tokenizer's, or junk) would cost it gigabytes and tens of seconds, and
    transformers reads none of them into the model. The tensor infos and data are read by
    ggml's reader itself. transformers' warning that it cannot count the vocabulary (it is not
    shown the tokenizer's tokens) is silenced meanwhile: `read` counts them itself."""
    import logging

    import gguf

    quiet = logging.getLogger("transformers.modeling_gguf_pytorch_utils")
    level = quiet.level

    base = gguf.GGUFReader

    class Reader(base):
        def _build_fields(self, offs: int, count: int) -> int:
            for start, end in src.shown.values():
                got = base._build_fields(self, start, 1)
                if got != end:  # the contract's parse and ggml's disagree: never computed on
                    raise CheckpointError(
                        f"--model {src.path}: ggml's GGUFReader reads the metadata entry at "
                        f"{start} as ending at {got}, the contract at {end}"
                    )
            return src.kv_end

    gguf.GGUFReader = Reader
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        gguf.GGUFReader = base
        quiet.setLevel(level)


def read(path: Path) -> Source:
    """The file's `Source`, after the contract's checks (`check`)."""
    from tracegate_contract.gguf import ARRAY, STRING

    g = check(path)
    arch = g.metadata["general.architecture"]  # one of ARCHITECTURES: the contract's checks hold it
    from transformers.modeling_gguf_pytorch_utils import (
        GGUF_TO_TRANSFORMERS_MAPPING,
        load_gguf_checkpoint,
    )

    keys = {"general.architecture", "general.name"} | {
        f"{arch}.{k}" for k in GGUF_TO_TRANSFORMERS_MAPPING["config"][arch]
    }
    if g.value_types.get("general.name") != STRING:  # a name that is not a string names nothing
        keys.discard("general.name")
    shown = {k: span for k, span in g.spans.items() if k in keys}
    kv_end = max((end for _, end in g.spans.values()), default=24)
    src = Source(path, {}, len(g.tensors), shown, kv_end)
    with _reader(src):
        cfg = dict(load_gguf_checkpoint(str(path))["config"])
    # §21.5 step 3, as transformers does with the tokenizer's tokens it is not shown here.
    if "vocab_size" not in cfg and g.value_types.get("tokenizer.ggml.tokens") == (ARRAY, STRING):
        cfg["vocab_size"] = len(g.metadata["tokenizer.ggml.tokens"])
    # Integers where transformers' config class takes only floats (§21.5: a value as stored).
    for k in ("rms_norm_eps", "rope_theta"):
        if type(cfg.get(k)) is int:
            cfg[k] = float(cfg[k])
    sizes = {
        k: g.metadata.get(f"{arch}.{k}")
        for k in ("rope.dimension_count", "attention.key_length", "attention.value_length")
    }
    given = {k: v for k, v in sizes.items() if v is not None}
    if given and "head_dim" not in cfg:
        cfg["head_dim"] = next(iter(given.values()))
    names = list(g.tensors)
    if any(_ATTN_BIAS.fullmatch(n) for n in names):
        cfg["attention_bias"] = True
    if arch == "llama" and any(_MLP_BIAS.fullmatch(n) for n in names):
        cfg["mlp_bias"] = True
    # transformers' model_type: the architecture's own, "mistral" for a llama file named so,
    # "gemma3_text" for gemma3 (a gemma3 file holds the text model only).
    cfg["architectures"] = [
        "MistralForCausalLM" if cfg["model_type"] == "mistral" else ARCHITECTURES[arch]
    ]
    src.config = cfg
    return src


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
    with contextlib.redirect_stderr(io.StringIO()), _reader(src):
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
