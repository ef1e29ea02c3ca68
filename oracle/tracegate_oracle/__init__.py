"""tracegate oracle: the real Hugging Face `transformers` classes, observed through hooks.

The oracle never re-implements the model: it loads the checkpoint with transformers' own
classes (eager attention, eager experts), runs them, and records what they computed at the
shared capture points (docs/capture-points.md), plus the decisions (router top-k, argmax).

    python -m tracegate_oracle trace --model DIR --tokens 3,17,5 --out run.trace
    python -m tracegate_oracle layer --model DIR --layer 2 --input run.trace \
        --input-name layer.02.hidden_in --out layer2.trace

The modules, by concept: torch_setup (the run's pinning), checkpoint and loading (refusals
before torch, then the strict load), records (records, decisions, provenance, writing), taps
(the hooks), capture (the verbs), diffusion_config and diffusion_gemma (block diffusion's own).
"""

from .capture import capture_layer, capture_prompt, check_decode_from, layer_mask, load_model
from .errors import CheckpointError, OracleError
from .families import resolve
from .loading import placement
from .records import (
    Capture,
    Decision,
    Record,
    argmax_decision,
    device_map_provenance,
    topk_decision,
    weights_digest,
    write_trace,
)
from .torch_setup import RunConfig, check_device_map, execution_device, setup_torch

__all__ = [
    "Capture",
    "CheckpointError",
    "Decision",
    "OracleError",
    "Record",
    "RunConfig",
    "argmax_decision",
    "capture_layer",
    "capture_prompt",
    "check_decode_from",
    "check_device_map",
    "device_map_provenance",
    "execution_device",
    "layer_mask",
    "load_model",
    "placement",
    "resolve",
    "setup_torch",
    "topk_decision",
    "weights_digest",
    "write_trace",
]
