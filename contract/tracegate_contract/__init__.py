"""tracegate_contract: the numeric contract (docs/numerics.md) in ordered numpy.

An independent implementation of the same written arithmetic as the Rust engine, so that
engine ≡ contract bit for bit is evidence that both follow the document.
"""

from .capture import Capture
from .config import Config, load_config, parse_config
from .errors import ContractError
from .model import KVCache, Model, open_model

__all__ = [
    "ContractError",
    "Capture",
    "Config",
    "KVCache",
    "Model",
    "load_config",
    "open_model",
    "parse_config",
]
