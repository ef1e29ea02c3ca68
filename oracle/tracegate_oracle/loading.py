"""Loading a checkpoint with transformers' own classes, strictly: the checks that need no torch
first (`preflight`: checkpoint.py's, then the family's own), then a clean one-to-one load — a
missing, unexpected or mismatched tensor is an error, and transformers' multi-line load report is
condensed into a one-line refusal. The pieces here are shared by every loader (the causal LMs of
the family table, a GGUF file, diffusion_gemma.py's own)."""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from . import diffusion_config, distributed, gguf_source
from .checkpoint import LoadProgress, check_config, inventory, read_config
from .errors import CheckpointError, OracleError
from .families import FAMILIES, resolve
from .torch_setup import TORCH_DTYPES, RunConfig


def preflight(model_dir) -> dict:
    """All checks that need no torch; returns the checkpoint's tensors by name (checkpoint.Entry)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise OracleError(f"--model {d}: not a directory")
    raw = read_config(d)
    inv = inventory(d)
    # diffusion_gemma: its own refusals (docs/diffusion-gemma.md DG0), before the sizes.
    family = diffusion_config.check_config if diffusion_config.is_family(raw) else None
    check_config(raw, inv, d / "config.json", family)
    return inv


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


@contextlib.contextmanager
def transformers_log():
    """Hold transformers' log records during a load: its load report is a multi-line table, and a
    refusal must be one line. A load that is accepted replays them (`replay`)."""
    import logging

    root = logging.getLogger("transformers")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    saved = root.handlers[:], root.propagate
    root.handlers, root.propagate = [Keep(logging.WARNING)], False
    try:
        yield records
    finally:
        root.handlers, root.propagate = saved


def replay(records) -> None:
    import logging

    for r in records:
        logging.getLogger("transformers").handle(r)


def report_rows(records) -> list[str]:
    """`key: details` of the MISMATCH / CONVERSION rows of transformers' load report."""
    rows = []
    for r in records:
        for line in re.sub(r"\x1b\[[0-9;]*m", "", r.getMessage()).splitlines():
            cells = [c.strip() for c in line.split("|")]
            if len(cells) >= 3 and cells[1] in ("MISMATCH", "CONVERSION"):
                rows.append(f"{cells[0]}: {' '.join(' '.join(cells[2:]).split())}")
    return rows


def check_shapes_on_meta(d: Path, cfg, inv, auto) -> None:
    """Build transformers' own class on the meta device (shapes, no storage; the layer and expert
    counts are already bounded by the checkpoint) and compare every parameter the checkpoint
    names alike. A size from config.json that disagrees is refused here, before anything is
    allocated; names transformers converts on load (fused experts) are left to its loader."""
    import torch

    try:
        with torch.device("meta"):
            skel = auto.from_config(
                cfg, attn_implementation="eager", experts_implementation="eager"
            )
    except Exception as e:  # any failure here comes from config.json's values
        raise OracleError(
            f"{d / 'config.json'}: transformers cannot build {cfg.architectures or cfg.model_type} "
            f"from it: {type(e).__name__}: {one_line(e)}"
        ) from None
    archs = getattr(cfg, "architectures", None)
    if archs and type(skel).__name__ not in archs:
        raise OracleError(
            f"{d / 'config.json'}: architectures = {archs}, but model_type {cfg.model_type!r} "
            f"makes transformers build {type(skel).__name__}"
        )
    for name, t in skel.state_dict().items():
        e = inv.get(name)
        if e is not None and tuple(t.shape) != e.shape:
            raise CheckpointError(
                f"{d / e.file}: tensor {name} has shape {list(e.shape)}, but config.json gives "
                f"{type(skel).__name__} {list(t.shape)}"
            )


def load_causal(d: Path, rc: RunConfig, inv: dict):
    """A causal LM of the family table, `inv` its preflight inventory: transformers' own class,
    refused unless every capture point is found where the table says."""
    import torch
    import transformers
    from transformers import AutoConfig

    progress = LoadProgress(d, inv)
    transformers.utils.logging.disable_progress_bar()
    with transformers_log() as log:
        try:
            cfg = AutoConfig.from_pretrained(d)
        except Exception as e:
            raise OracleError(
                f"--model {d}: config.json not understood by transformers: {one_line(e)}"
            ) from None
        # The class config.json's architectures names (ForConditionalGeneration for a multimodal
        # layout, run on text only); a family outside the table is refused by resolve() below.
        spec = FAMILIES.get(getattr(cfg, "model_type", None))
        auto = getattr(transformers, spec.auto if spec else "AutoModelForCausalLM")
        check_shapes_on_meta(d, cfg, inv, auto)
    progress.config(cfg)
    where = placement(rc)
    if rc.distributed is not None:
        where = {"distributed_config": distributed.config(rc.distributed)}
    progress.weights(rc.dtype)
    try:
        with transformers_log() as load_log:
            model, info = auto.from_pretrained(
                d,
                dtype=getattr(torch, TORCH_DTYPES[rc.dtype]),
                attn_implementation="eager",
                # transformers 5 defaults MoE experts to grouped_mm; eager is the plain per-expert loop.
                experts_implementation="eager",
                # Never torch.load: the weights digest covers the safetensors files only.
                use_safetensors=True,
                output_loading_info=True,
                **where,
            )
    except (OSError, ValueError, RuntimeError) as e:
        if rc.distributed is not None and "_plan`" in str(e):
            # transformers' refusal of a model it has no tensor / expert parallel plan for
            raise OracleError(
                f"--distributed {rc.distributed}: transformers cannot shard "
                f"{(cfg.architectures or [cfg.model_type])[0]} ({cfg.model_type}): {one_line(e)}"
            ) from None
        rows = report_rows(load_log)
        detail = (
            "; ".join(rows[:3]) + (f" (+{len(rows) - 3} more)" if len(rows) > 3 else "")
            if rows
            else one_line(e)
        )
        raise CheckpointError(f"--model {d}: transformers could not load it: {detail}") from None
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        # Random init of a missing tensor, or a silently dropped extra one, would make a trace of
        # a model nobody has: refuse instead (docs/traps.md, trap 14).
        detail = "; ".join(
            f"{k}: {', '.join(v[:8])}{' ...' if len(v) > 8 else ''}" for k, v in problems.items()
        )
        raise CheckpointError(
            f"--model {d}: checkpoint does not match {type(model).__name__}: {detail}"
        )
    # the family table: refused here unless every capture point is found
    lay = resolve(model, f"--model {d}")
    # Present, not computed with: listed in provenance as {prefix: count} (as engine and
    # contract do), never dropped silently (transformers ignores `mtp.*` on load unreported).
    counts = {p: sum(n.startswith(p) for n in inv) for p in lay.spec.unused_prefixes}
    model.tracegate_unused_tensors = {p: n for p, n in counts.items() if n}
    check_tied_head(model, d)
    replay(log + load_log)
    progress.placement(model, rc.device)
    # A dispatched model stays where accelerate put it (transformers refuses .to() on an offloaded one).
    return (model if rc.device_map else model.to(rc.device)).eval()


def load_gguf(path: Path, rc: RunConfig):
    """A GGUF checkpoint (gguf_source): transformers' class on the file's dequantized tensors,
    then the family table's check that every capture point is found."""
    import torch
    import transformers

    if rc.device_map is not None:
        raise OracleError(f"--model {path}: --device-map is not supported for a GGUF checkpoint")
    transformers.utils.logging.disable_progress_bar()
    src = gguf_source.read(path)
    spec = FAMILIES.get(src.config.get("model_type"))
    auto = getattr(transformers, spec.auto if spec else "AutoModelForCausalLM")
    with transformers_log() as log:
        model = gguf_source.load(src, auto, getattr(torch, TORCH_DTYPES[rc.dtype]), rc.device)
    resolve(model, f"--model {path}")
    model.tracegate_unused_tensors = {}
    replay(log)
    return model


def placement(rc: RunConfig) -> dict:
    """from_pretrained's device_map / max_memory for --device-map auto (sizes read by accelerate)."""
    if rc.device_map is None:
        return {}
    try:
        from accelerate.utils import convert_file_size_to_int
    except ImportError:
        raise OracleError(
            "--device-map auto: needs the `accelerate` package (requirements.txt)"
        ) from None
    if rc.max_memory is None:
        return {"device_map": rc.device_map}
    sizes = {}
    for k, v in rc.max_memory.items():
        try:
            sizes[k] = convert_file_size_to_int(int(v) if v.isdigit() else v)
        except ValueError:
            raise OracleError(
                f"--max-memory {k}={v}: not a size accelerate reads (bytes, or e.g. 70GiB, 500MB)"
            ) from None
    return {"device_map": rc.device_map, "max_memory": sizes}


def check_tied_head(model, d: Path) -> None:
    """A checkpoint with tie_word_embeddings=true and its own, different lm_head.weight is not
    reported by transformers as unexpected: 5.23 silently un-ties and uses it (warning only), so
    the model no longer is what config.json declares. Refuse; an equal redundant copy (some real
    checkpoints ship one) is fine."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return
    head, emb = model.lm_head.weight, model.get_input_embeddings().weight
    if head is emb or (head.shape == emb.shape and bool((head == emb).all())):
        return
    raise CheckpointError(
        f"--model {d}: config says tie_word_embeddings=true but the checkpoint's lm_head.weight differs from "
        "model.embed_tokens.weight (transformers would silently use the untied head)"
    )
