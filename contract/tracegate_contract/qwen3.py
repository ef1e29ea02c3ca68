"""Qwen3, Qwen3-MoE and llama run through the family-neutral model (model.py: the decoder layer in
layer.py, its blocks in mixers.py and feed_forward.py); what they read of config.json, and so
what differs between them, is config.py's. This module keeps the names code outside the package
reaches the model by (oracle/tests, gate/tests/producers/defective_contract.py, which plants its
defects on `Model` and `_Mlp`)."""

from .capture import NO_CAPTURE, Capture
from .config import MAX_POSITIONS, Config, load_config
from .feed_forward import Mlp as _Mlp
from .model import KVCache, Model

__all__ = [
    "MAX_POSITIONS",
    "NO_CAPTURE",
    "Capture",
    "Config",
    "KVCache",
    "Model",
    "_Mlp",
    "load_config",
]
