"""tracegate oracle: the real Hugging Face `transformers` classes, observed through hooks.

The oracle never re-implements the model: it loads the checkpoint with transformers' own
classes (eager attention, eager experts), runs them, and records what they computed at the
shared capture points (docs/capture-points.md), plus the decisions (router top-k, argmax).

    python -m tracegate_oracle trace --model DIR --tokens 3,17,5 --out run.trace
    python -m tracegate_oracle layer --model DIR --layer 2 --input run.trace \
        --input-name layer.02.hidden_in --out layer2.trace
"""

from .capture import (  # noqa: F401
    Capture,
    CheckpointError,
    Decision,
    OracleError,
    Record,
    RunConfig,
    capture_layer,
    capture_prompt,
    load_model,
    write_trace,
)

__all__ = [
    "Capture",
    "CheckpointError",
    "Decision",
    "OracleError",
    "Record",
    "RunConfig",
    "capture_layer",
    "capture_prompt",
    "load_model",
    "write_trace",
]
