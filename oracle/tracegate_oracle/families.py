"""Which transformers families the oracle captures, and where their capture points are.

One declarative table (`FAMILIES`): every family shares the common decoder structure (`COMMON`:
embedding, a list of decoder layers each with self-attention and an MLP or MoE block, a final
norm, a head); a family's entry lists only what it does differently, as data. `resolve` checks a
loaded model against its entry and refuses, in one line, a family the table does not cover or a
model whose modules are not where the entry says. No family has its own code path: taps.py and
capture.py read the resolved `Layout`. docs/capture-points.md is the prose of this table.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import OracleError

# Mask rules, read from transformers' modeling files (how each model's forward picks the mask):
#   causal       every layer causal (create_causal_mask only)
#   config       every layer sliding when config.sliding_window is set, else causal
#   layer_types  layer i sliding iff config.layer_types[i] == "sliding_attention"
MASK_RULES = ("causal", "config", "layer_types")


@dataclass(frozen=True)
class Family:
    embed: str = "model.embed_tokens"
    layers: str = "model.layers"
    final_norm: str = "model.norm"
    head: str = "lm_head"
    rotary: str = "model.rotary_emb"
    attn: str = "self_attn"  # within a layer
    # Hybrid families: a layer has either `attn` or this linear-attention token mixer (Gated
    # DeltaNet); config.layer_types says which ("linear_attention" / "full_attention").
    linear_attn: str | None = None
    # q_proj's output holds, per head, the query and then a gate applied as sigmoid(gate) to the
    # attention output before o_proj (Qwen3.5): captured as `attn_gate` under internals.
    attn_gate: bool = False
    mlp: str = "mlp"  # within a layer; the MoE block in MoE families
    # Norms each layer must have (checked, documented: their place differs per family).
    norms: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
    # MoE: router and experts within `mlp`; "all" = every layer, "some" = dense layers allowed.
    moe: str | None = None
    router: str = "gate"
    experts: str = "experts"
    # A shared expert beside the routed ones, and its gate (a Linear to one logit), within `mlp`.
    shared_expert: str | None = None
    shared_expert_gate: str | None = None
    mask: str = "causal"
    # The rotary module takes the layer's type as a third argument (one table per layer type).
    rope_by_layer_type: bool = False
    # Config fields recorded in provenance when set (what the family computes differently).
    provenance_fields: tuple[str, ...] = ()
    # Config values the oracle does not capture faithfully: (field, refused value, why).
    refuse: tuple[tuple[str, object, str], ...] = ()
    # The transformers auto class that builds the class config.json's `architectures` names.
    auto: str = "AutoModelForCausalLM"
    # Checkpoint tensors a text-only forward does not use (a vision tower, multi-token
    # prediction): transformers ignores or loads them; the oracle lists them in provenance.
    unused_prefixes: tuple[str, ...] = ()
    # How the family generates: "autoregressive" (a causal LM, captured through the Layout
    # below) or "diffusion" (block diffusion through its own generate, captured by
    # diffusion_gemma.py; resolve() refuses it for the causal paths).
    generation: str = "autoregressive"


COMMON = Family()

FAMILIES: dict[str, Family] = {
    "llama": COMMON,
    "mistral": replace(COMMON, mask="config", provenance_fields=("sliding_window",)),
    "qwen2": replace(
        COMMON, mask="layer_types", provenance_fields=("sliding_window", "layer_types")
    ),
    "qwen3": replace(
        COMMON, mask="layer_types", provenance_fields=("sliding_window", "layer_types")
    ),
    "qwen3_moe": replace(COMMON, moe="some", mask="config", provenance_fields=("sliding_window",)),
    "gemma3_text": replace(
        COMMON,
        norms=(
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ),
        mask="layer_types",
        rope_by_layer_type=True,
        provenance_fields=(
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
            "attn_logit_softcapping",
            "query_pre_attn_scalar",
        ),
        refuse=(
            (
                "use_bidirectional_attention",
                True,
                "bidirectional attention is not a causal decoder",
            ),
        ),
    ),
    "olmo2": replace(COMMON, norms=("post_attention_layernorm", "post_feedforward_layernorm")),
    "phi3": replace(COMMON, mask="config", provenance_fields=("sliding_window",)),
    "mixtral": replace(COMMON, moe="all", mask="config", provenance_fields=("sliding_window",)),
    "olmoe": replace(COMMON, moe="all"),
}
# Qwen3.5: hybrid Gated DeltaNet / gated full attention, partial RoPE; transformers'
# Qwen3_5ForCausalLM ignores `mtp.*` and `model.visual.*` on load (its
# _keys_to_ignore_on_load_unexpected). The multimodal layout (`qwen3_5`, `qwen3_5_moe`) is
# loaded as the ForConditionalGeneration class it names and run on text only.
_Q35 = replace(
    COMMON,
    linear_attn="linear_attn",
    attn_gate=True,
    mask="layer_types",
    provenance_fields=("layer_types", "rope_parameters"),
    unused_prefixes=("model.visual.", "mtp."),
)
_Q35_MM = dict(
    embed="model.language_model.embed_tokens",
    layers="model.language_model.layers",
    final_norm="model.language_model.norm",
    rotary="model.language_model.rotary_emb",
    auto="AutoModelForImageTextToText",
)
_Q35_MOE = dict(moe="all", shared_expert="shared_expert", shared_expert_gate="shared_expert_gate")
FAMILIES |= {
    "qwen3_5_text": _Q35,
    "qwen3_5": replace(_Q35, **_Q35_MM),
    "qwen3_5_moe_text": replace(_Q35, **_Q35_MOE),
    "qwen3_5_moe": replace(_Q35, **_Q35_MOE, **_Q35_MM),
}

# diffusion_gemma (docs/diffusion-gemma.md): an encoder and a diffusion decoder sharing their
# layers, each layer a dense MLP beside routed experts (its router at the layer, not in the MLP).
# The paths are the decoder's; diffusion_gemma.py hooks both sides itself.
FAMILIES["diffusion_gemma"] = replace(
    COMMON,
    embed="model.decoder.embed_tokens",
    layers="model.decoder.layers",
    final_norm="model.decoder.norm",
    rotary="model.decoder.rotary_emb",
    norms=(
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "post_feedforward_layernorm_1",
        "pre_feedforward_layernorm_2",
        "post_feedforward_layernorm_2",
    ),
    moe="all",
    mask="layer_types",
    auto="DiffusionGemmaForBlockDiffusion",
    # checkpoint tensors a token-ids-only run does not compute with (DG0, "Weights")
    unused_prefixes=("model.encoder.vision_tower.", "model.encoder.embed_vision."),
    generation="diffusion",
)


def _get(root, path: str):
    obj = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


@dataclass
class Layout:
    """A loaded model's capture points, found by its family's entry."""

    family: str
    spec: Family
    model: object
    embed: object
    layers: list
    final_norm: object
    head: object
    rotary: object
    moe_layers: list[int] = field(default_factory=list)
    linear_layers: list[int] = field(default_factory=list)

    @property
    def config(self):
        """The language model's config (`text_config` of a multimodal one)."""
        return self.model.config.get_text_config()

    def attn(self, L: int):
        """Layer L's token mixer: self-attention, or linear attention in a hybrid family."""
        if L in self.linear_layers:
            return _get(self.layers[L], self.spec.linear_attn)
        return _get(self.layers[L], self.spec.attn)

    def mlp(self, L: int):
        return _get(self.layers[L], self.spec.mlp)

    def router(self, L: int):
        return _get(self.mlp(L), self.spec.router) if L in self.moe_layers else None

    def experts(self, L: int):
        return _get(self.mlp(L), self.spec.experts) if L in self.moe_layers else None

    def shared_expert(self, L: int):
        """(shared expert MLP, its gate) of MoE layer L, or None in a family without one."""
        spec = self.spec
        if L not in self.moe_layers or not spec.shared_expert:
            return None
        mlp = self.mlp(L)
        return _get(mlp, spec.shared_expert), _get(mlp, spec.shared_expert_gate)

    def window(self, L: int) -> int | None:
        """The attention window of layer L as the model's forward chooses it (None: causal)."""
        cfg, rule = self.config, self.spec.mask
        if rule == "causal":
            return None
        if rule == "layer_types" and cfg.layer_types[L] != "sliding_attention":
            return None
        return getattr(cfg, "sliding_window", None)

    def mask(self, L: int | None) -> str:
        w = None if L is None else self.window(L)
        return "causal" if w is None else f"sliding:{w}"

    def rope(self, x, pos, L: int):
        if self.spec.rope_by_layer_type:
            return self.rotary(x, pos, self.config.layer_types[L])
        return self.rotary(x, pos)

    def provenance(self) -> dict:
        cfg = self.config
        out = {
            "family": self.family,
            "mask_rule": self.spec.mask,
            "masks": [self.mask(L) for L in range(len(self.layers))],
            "tied_head": self.head.weight is self.embed.weight,
        }
        for f in self.spec.provenance_fields:
            v = getattr(cfg, f, None)
            if v is not None:
                out[f] = list(v) if isinstance(v, (list, tuple)) else v
        scale = getattr(self.embed, "scalar_embed_scale", None)  # Gemma's scaled embedding
        if scale is not None:
            out["embed_scale"] = float(scale)
        if self.moe_layers:
            out["moe_layers"] = list(self.moe_layers)
        if self.linear_layers:
            out["linear_layers"] = list(self.linear_layers)
        return out


def supported() -> str:
    return ", ".join(sorted(FAMILIES))


def resolve(model, where: str = "--model") -> Layout:
    """The model's Layout, or one line naming what its family's entry did not find."""
    mt = getattr(model.config, "model_type", None)
    cfg = model.config.get_text_config()
    spec = FAMILIES.get(mt)
    cls = type(model).__name__
    if spec is None:
        raise OracleError(
            f"{where}: model_type {mt!r} ({cls}) is not in the oracle's family table ({supported()})"
        )
    if spec.generation != "autoregressive":
        raise OracleError(
            f"{where}: {mt} ({cls}) generates by {spec.generation}, not token by token: only the "
            "trace verb captures it (diffusion_gemma.py), not the causal-LM paths"
        )
    for fld, bad, why in spec.refuse:
        if getattr(cfg, fld, None) == bad:
            raise OracleError(f"{where}: config {fld} = {bad!r} not supported for {mt}: {why}")

    def need(root, path: str, what: str):
        m = _get(root, path)
        if m is None:
            raise OracleError(
                f"{where}: {cls} ({mt}) has no {what} module `{path}` (oracle family table)"
            )
        return m

    embed = need(model, spec.embed, "embedding")
    layers = need(model, spec.layers, "decoder layer list")
    try:
        layers = list(layers)
    except TypeError:
        raise OracleError(
            f"{where}: {cls} ({mt}): `{spec.layers}` is not a list of layers (oracle family table)"
        ) from None
    if not layers:
        raise OracleError(f"{where}: {cls} ({mt}) has no decoder layers in `{spec.layers}`")
    lay = Layout(
        mt,
        spec,
        model,
        embed,
        layers,
        need(model, spec.final_norm, "final norm"),
        need(model, spec.head, "head"),
        need(model, spec.rotary, "rotary embedding"),
    )
    if spec.mask == "layer_types" and len(getattr(cfg, "layer_types", None) or []) < len(layers):
        raise OracleError(
            f"{where}: {cls} ({mt}): config layer_types does not name every layer's attention type"
        )
    for L, layer in enumerate(layers):
        at = f"{spec.layers}.{L}"
        if spec.linear_attn and cfg.layer_types[L] == "linear_attention":
            need(layer, spec.linear_attn, f"linear attention ({at})")
            lay.linear_layers.append(L)
        else:
            need(layer, spec.attn, f"attention ({at})")
        mlp = need(layer, spec.mlp, f"MLP ({at})")
        for n in spec.norms:
            need(layer, n, f"norm ({at})")
        has_router = _get(mlp, spec.router) is not None and _get(mlp, spec.experts) is not None
        if spec.moe == "all" and not has_router:
            raise OracleError(
                f"{where}: {cls} ({mt}) has no router `{at}.{spec.mlp}.{spec.router}` with "
                f"`{spec.experts}` (oracle family table: every layer is MoE)"
            )
        if spec.moe and has_router:
            if not isinstance(getattr(_get(mlp, spec.router), "top_k", None), int):
                raise OracleError(
                    f"{where}: {cls} ({mt}): router `{at}.{spec.mlp}.{spec.router}` has no top_k"
                )
            lay.moe_layers.append(L)
            for part in (spec.shared_expert, spec.shared_expert_gate):
                if part:
                    need(mlp, part, f"shared expert ({at}.{spec.mlp})")
    return lay
