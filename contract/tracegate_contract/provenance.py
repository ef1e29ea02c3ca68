"""A trace's provenance record (docs/trace-format.md): who computed it, on what, with which
command. Every verb of every family writes it through here; the verb adds its own fields."""

from __future__ import annotations

import platform

import numpy as np
import tracegate

from .weights import weights_digest


def provenance(model_dir: str, command: list[str], verb: str, **run) -> dict:
    try:
        from importlib.metadata import version

        tg_version = version("tracegate")
    except Exception:
        tg_version = getattr(tracegate, "__version__", "unknown")
    return {
        "producer": "contract",
        "versions": {
            "numpy": np.__version__,
            "python": platform.python_version(),
            "tracegate": tg_version,
        },
        "dtype": "f32",
        "device": "cpu",
        "threads": 1,
        "seed": None,
        "model_dir": model_dir,
        "weights_digest": weights_digest(model_dir),
        "verb": verb,
        **run,
        "command_line": list(command),
    }


def unused(model) -> dict:
    """Provenance's `unused_tensors` ({prefix: count}, §20) where the checkpoint has any."""
    found = getattr(model, "unused_tensors", None)
    return {"unused_tensors": found} if found else {}
