"""tracegate_contract: the numeric contract (docs/numerics.md) in ordered numpy.

An independent implementation of the same written arithmetic as the Rust engine, so that
engine ≡ contract bit for bit is evidence that both follow the document.
"""

from .errors import ContractError
from .qwen3 import Capture, Config, KVCache, Model, load_config, parse_config

__all__ = ["ContractError", "Capture", "Config", "KVCache", "Model", "load_config", "parse_config"]
