"""Qwen3.5 and Qwen3.5-MoE (docs/numerics.md §§15–20) run through the family-neutral model
(model.py): Gated DeltaNet and the gated attention are mixers (mixers.py), the shared expert part
of the MoE block (feed_forward.py); what only this family reads of config.json (layer_types, the
linear_* sizes, the multimodal layout, its fixed MoE choices) and its traits (zero-centred norms,
the output gate, the tensors present and not run) are config.py's. This module keeps the names
code outside the package reaches the model by (gate/tests/producers/defective_contract.py plants
its defects on `Model`)."""

from .capture import NO_CAPTURE
from .feed_forward import SharedExpert
from .mixers import GatedDeltaNet, LinearState
from .model import Model, open_model

__all__ = ["NO_CAPTURE", "GatedDeltaNet", "LinearState", "Model", "SharedExpert", "open_model"]
