"""Engine ≡ contract on config and checkpoint variants of the committed fixtures (numerics.md
§13): what the engine computes, the contract computes to the same digest; what the engine
refuses, the contract refuses too, naming the field.

Each case is a copy of fixtures/tiny-qwen3 or fixtures/tiny-qwen3-moe with config.json edited
and, where needed, model.safetensors rewritten with the `safetensors` package.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
from test_engine_identity import contract_trace, differences, engine_trace, needs_engine, prompts
from test_engine_refusals import engine_refusal
from tracegate_contract import ContractError
from tracegate_contract.model import Model, load_config

from conftest import FIXTURES

_NEEDS = "these cases rewrite checkpoints with safetensors.torch (pip install -r requirements.txt)"
torch = pytest.importorskip("torch", reason=f"torch is not installed: {_NEEDS}")
st_torch = pytest.importorskip(
    "safetensors.torch", reason=f"safetensors is not installed: {_NEEDS}"
)
tracegate = pytest.importorskip(
    "tracegate", reason="the tracegate Python module is not built (scripts/setup.sh)"
)

DROP = object()  # config edit: remove the key


def fuse_experts(keep_per_expert=False, transpose_down=False):
    """transformers 5's fused layout, as the engine splits it: `gate_up_proj` [E, 2I, H] with
    expert e's gate rows then its up rows, `down_proj` [E, H, I]."""

    def edit(t, cfg):
        for layer in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{layer}.mlp.experts"
            if f"{p}.0.gate_proj.weight" not in t:
                continue  # a dense layer
            get = (lambda k: t[k]) if keep_per_expert else t.pop
            ex = [
                {n: get(f"{p}.{e}.{n}_proj.weight") for n in ("gate", "up", "down")}
                for e in range(cfg["num_experts"])
            ]
            t[f"{p}.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in ex])
            down = torch.stack([x["down"] for x in ex])
            t[f"{p}.down_proj"] = down.transpose(1, 2).contiguous() if transpose_down else down

    return edit


def llama_biases(t, cfg):
    """attention_bias and mlp_bias: a seeded bias on q, k, v, o and gate, up, down."""
    g = torch.Generator().manual_seed(5)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        ):
            rows = t[f"{p}.{m}.weight"].shape[0]
            t[f"{p}.{m}.bias"] = 0.1 * torch.randn(rows, generator=g)


def llama_mha(t, cfg):
    """num_key_value_heads absent (one kv head per query head): k_proj and v_proj as wide as q."""
    g = torch.Generator().manual_seed(6)
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.self_attn"
        for m in ("k_proj", "v_proj"):
            shape = t[f"{p}.q_proj.weight"].shape
            t[f"{p}.{m}.weight"] = (torch.randn(shape, generator=g) / 8).to(torch.bfloat16)


def llama_q_norm(t, cfg):
    """A Qwen-style q_norm in a llama checkpoint: llama has none, so nothing claims it."""
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(10, dtype=torch.bfloat16)


def qwen2_o_proj_bias(t, cfg):
    """An o_proj bias in a qwen2 checkpoint: Qwen2Attention has none (q, k, v only)."""
    t["model.layers.0.self_attn.o_proj.bias"] = torch.ones(84, dtype=torch.bfloat16)


def qwen2_q_norm(t, cfg):
    """A Qwen3-style q_norm in a qwen2 checkpoint: qwen2 has none, so nothing claims it."""
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(14, dtype=torch.bfloat16)


def keep_layers(n):
    def edit(t, cfg):
        for k in [k for k in t if k.startswith("model.layers.") and int(k.split(".")[2]) >= n]:
            del t[k]

    return edit


def variant(tmp_path, fixture, edits, tensors=None) -> str:
    d = tmp_path / "model"
    shutil.copytree(FIXTURES[fixture], d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in edits.items():
        cfg.pop(k) if v is DROP else cfg.__setitem__(k, v)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    if tensors:
        t = st_torch.load_file(str(d / "model.safetensors"))
        tensors(t, cfg)
        st_torch.save_file(t, str(d / "model.safetensors"))
    return str(d)


# id: (fixture, config edits, tensor rewrite, expected parsed fields)
COMPUTED = {
    # §13: a non-empty legacy rope_scaling replaces rope_parameters and its rope_theta wins.
    "legacy-rope-scaling-theta-wins": (
        "dense",
        {
            "rope_parameters": DROP,
            "rope_theta": 10000,
            "rope_scaling": {"rope_type": "default", "rope_theta": 5000},
        },
        None,
        {"rope_theta": 5000.0},
    ),
    # `rope_scaling or rope_parameters`: the yarn parameters are never read; theta is the top-level one.
    "rope-scaling-default-replaces-yarn-parameters": (
        "dense",
        {
            "rope_theta": 20000.0,
            "rope_scaling": {"rope_type": "default"},
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0},
        },
        None,
        {"rope_theta": 20000.0},
    ),
    "rms-norm-eps-defaults-to-1e-6": (
        "moe",
        {"rms_norm_eps": DROP},
        None,
        {},
    ),  # the fixture's own is 1e-5
    "all-sparse-without-intermediate-size": (
        "moe",
        {"intermediate_size": DROP, "num_hidden_layers": 2},
        keep_layers(2),
        {"intermediate_size": None},
    ),
    "use-sliding-window-null": (
        "dense",
        {
            "use_sliding_window": None,
            "sliding_window": 64,
            "max_window_layers": 0,
            "layer_types": ["full_attention"] * 5,
        },
        None,
        {},
    ),
    "nulls-as-absent-and-num-local-experts": (
        "moe",
        {
            "hidden_act": None,
            "decoder_sparse_step": None,
            "rope_scaling": None,
            "num_experts": DROP,
            "num_local_experts": 8,
        },
        None,
        {"num_experts": 8},
    ),
    "fused-experts": ("moe", {}, fuse_experts(), {}),
    # §7.1: llama's scaled rope types, in transformers 5's and in the legacy spelling.
    "llama-linear-rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}},
        None,
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 10000.0},
    ),
    "llama-legacy-rope-scaling-llama3": (
        "llama",
        {
            "rope_parameters": DROP,
            "rope_theta": 200000.0,
            "rope_scaling": {
                "type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 2.0,
                "original_max_position_embeddings": 64,
            },
        },
        None,
        {"rope_theta": 200000.0},
    ),
    "llama-attention-and-mlp-bias": (
        "llama",
        {"attention_bias": True, "mlp_bias": True},
        llama_biases,
        {"attention_bias": True, "mlp_bias": True, "qk_norm": False},
    ),
    "llama-mha-without-num-key-value-heads": (
        "llama",
        {"num_key_value_heads": DROP},
        llama_mha,
        {"num_key_value_heads": 6, "head_dim": 10},
    ),
    # §13 qwen2: its q/k/v bias is fixed (Qwen2Attention: bias=True), whatever attention_bias says;
    # a producer that read the field would find the bias tensors unclaimed and refuse.
    "qwen2-attention-bias-field-not-read": (
        "qwen2",
        {"attention_bias": False},
        None,
        {"attention_bias": True, "o_proj_bias": False, "qk_norm": False, "head_dim": 14},
    ),
    # §22.1 Gemma 3's rope in transformers 5's spelling: keyed by layer type, the full layers
    # linearly scaled; the legacy top-level thetas are not read beside it.
    "gemma3-rope-parameters-by-layer-type": (
        "gemma3",
        {
            "rope_theta": DROP,
            "rope_local_base_freq": DROP,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 200000.0},
            },
        },
        None,
        {
            "rope_theta": 200000.0,
            "local_rope_theta": 5000.0,
            "rope_scaling": {"rope_type": "linear", "factor": 4.0},
        },
    ),
    # A legacy rope_scaling updates the full layers' entry; the sliding ones keep the default.
    "gemma3-legacy-rope-scaling": (
        "gemma3",
        {"rope_scaling": {"rope_type": "linear", "factor": 8.0}},
        None,
        {"rope_theta": 1000000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    ),
    # Without layer_types, transformers' sliding_window_pattern rule (the saved
    # _sliding_window_pattern is not read); Gemma3TextConfig ties the head by default.
    "gemma3-sliding-window-pattern": (
        "gemma3",
        {"layer_types": DROP, "sliding_window_pattern": 2, "tie_word_embeddings": DROP},
        None,
        {"sliding_layers": None, "sliding_window_pattern": 2, "tie_word_embeddings": True},
    ),
    "gemma3-final-logit-softcapping": (
        "gemma3",
        {"final_logit_softcapping": 3.0, "query_pre_attn_scalar": DROP},
        None,
        {"final_logit_softcapping": 3.0, "query_pre_attn_scalar": 256.0},
    ),
}


@needs_engine
@pytest.mark.parametrize("case", list(COMPUTED))
def test_variant_computed_identically(tmp_path, case):
    fixture, edits, tensors, expect = COMPUTED[case]
    model = variant(tmp_path, fixture, edits, tensors)
    cfg = load_config(model)
    assert {k: getattr(cfg, k) for k in expect} == expect
    toks = prompts(cfg.vocab_size)[17]
    e = engine_trace(model, toks, str(tmp_path / "e.trace"), "internals", 3, "on")
    c = contract_trace(model, toks, str(tmp_path / "c.trace"), "internals", 3, "off")
    d = differences(e, c)
    assert not d, f"[{case}] " + "\n".join(d[:3])
    assert tracegate.Trace(e).digest == tracegate.Trace(c).digest


# id: (fixture, config edits, tensor rewrite, text the contract's refusal must contain)
REFUSED = {
    "rope-scaling-extra-key": (
        "dense",
        {"rope_scaling": {"rope_type": "default", "factor": 2.0}},
        None,
        "rope_scaling.factor",
    ),
    "rope-scaling-type-linear": (
        "dense",
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        None,
        "rope_scaling.type",
    ),
    "empty-rope-scaling-leaves-yarn-parameters": (
        "dense",
        {
            "rope_scaling": {},
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
        },
        None,
        "rope_parameters.rope_type",
    ),
    "top-level-rope-theta-not-a-number": ("dense", {"rope_theta": "big"}, None, "rope_theta"),
    # §7.1: llama takes linear and llama3 only, each with all of its numbers; the Qwen families
    # take neither.
    "llama-rope-yarn": (
        "llama",
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
        None,
        "rope_parameters.rope_type",
    ),
    "llama-rope-dynamic": (
        "llama",
        {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}},
        None,
        "rope_parameters.rope_type",
    ),
    "llama3-rope-without-low-freq-factor": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
        None,
        "rope_parameters.low_freq_factor",
    ),
    "llama3-rope-high-not-above-low": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 4.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
        None,
        "rope_parameters.high_freq_factor",
    ),
    "llama-linear-rope-factor-zero": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 0}},
        None,
        "rope_parameters.factor",
    ),
    "llama-linear-rope-extra-key": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "low_freq_factor": 1.0}},
        None,
        "rope_parameters.low_freq_factor",
    ),
    "qwen3-with-llama3-rope": (
        "dense",
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 256,
            }
        },
        None,
        "rope_parameters.rope_type",
    ),
    "llama-with-a-q-norm": ("llama", {}, llama_q_norm, "q_norm"),
    # §13 qwen2: what it does not have is refused, never guessed.
    "qwen2-with-an-o-proj-bias": ("qwen2", {}, qwen2_o_proj_bias, "o_proj.bias"),
    "qwen2-with-a-q-norm": ("qwen2", {}, qwen2_q_norm, "q_norm"),
    "qwen2-use-sliding-window-true": (
        "qwen2",
        {"use_sliding_window": True},
        None,
        "use_sliding_window",
    ),
    "qwen2-rope-yarn": (
        "qwen2",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        None,
        "rope_scaling.rope_type",
    ),
    # Qwen2Config's default is 32 kv heads, not one per query head: refused rather than guessed.
    "qwen2-without-num-key-value-heads": (
        "qwen2",
        {"num_key_value_heads": DROP},
        None,
        "num_key_value_heads",
    ),
    # The engine computes a NaN table and then refuses the NaN logits; the contract refuses up front.
    "rope-theta-zero": (
        "dense",
        {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
        None,
        "rope_theta",
    ),
    "dense-without-intermediate-size": (
        "dense",
        {"intermediate_size": DROP},
        None,
        "intermediate_size",
    ),
    "moe-dense-layer-without-intermediate-size": (
        "moe",
        {"intermediate_size": DROP},
        None,
        "intermediate_size",
    ),
    "use-sliding-window-true": ("dense", {"use_sliding_window": True}, None, "use_sliding_window"),
    "use-sliding-window-not-a-bool": (
        "dense",
        {"use_sliding_window": "no"},
        None,
        "use_sliding_window",
    ),
    "sliding-layer-type": (
        "dense",
        {"layer_types": ["full_attention"] * 4 + ["sliding_attention"]},
        None,
        "layer_types",
    ),
    "architectures-empty": ("dense", {"architectures": []}, None, "architectures"),
    # §22.1 what Gemma 3's bit-exact producers do not compute, refused by name.
    "gemma3-attn-logit-softcapping": (
        "gemma3",
        {"attn_logit_softcapping": 50.0},
        None,
        "attn_logit_softcapping",
    ),
    "gemma3-bidirectional": (
        "gemma3",
        {"use_bidirectional_attention": True},
        None,
        "use_bidirectional_attention",
    ),
    "gemma3-hidden-activation": (
        "gemma3",
        {"hidden_activation": "gelu"},
        None,
        "hidden_activation",
    ),
    "gemma3-flat-rope-parameters": (
        "gemma3",
        {"rope_parameters": {"rope_theta": 10000.0}},
        None,
        "rope_parameters.rope_theta",
    ),
    "gemma3-sliding-rope-linear": (
        "gemma3",
        {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
        None,
        "rope_parameters.sliding_attention.rope_type",
    ),
    "gemma3-layer-types-count": (
        "gemma3",
        {"layer_types": ["sliding_attention", "full_attention"]},
        None,
        "layer_types",
    ),
    "gemma3-multimodal-layout": ("gemma3", {"model_type": "gemma3"}, None, "model_type"),
    "mlp-only-layers-negative": ("moe", {"mlp_only_layers": [-1]}, None, "mlp_only_layers"),
    "expert-counts-disagree": ("moe", {"num_local_experts": 4}, None, "num_experts"),
    "fused-down-proj-transposed": (
        "moe",
        {},
        fuse_experts(transpose_down=True),
        "experts.down_proj",
    ),
    "fused-beside-per-expert-tensors": (
        "moe",
        {},
        fuse_experts(keep_per_expert=True),
        "unclaimed tensor model.layers.0.mlp.experts.0.",
    ),
}


@needs_engine
@pytest.mark.parametrize("case", list(REFUSED))
def test_variant_refused_by_both(tmp_path, case):
    fixture, edits, tensors, named = REFUSED[case]
    both_refuse(tmp_path, variant(tmp_path, fixture, edits, tensors), named)


@needs_engine
def test_stray_safetensors_file_refused_by_both(tmp_path):
    model = variant(tmp_path, "dense", {})
    shutil.copy(f"{model}/model.safetensors", f"{model}/extra.safetensors")
    both_refuse(tmp_path, model, "extra.safetensors")


def both_refuse(tmp_path, model, named):
    # A clean refusal (exit 2, one line), not merely a non-zero exit: an abort is non-zero too.
    engine_refusal(
        "trace", "--model", model, "--tokens", "1,2,3", "--out", str(tmp_path / "e.trace")
    )
    with pytest.raises(ContractError, match=re.escape(named)):
        Model(model)
