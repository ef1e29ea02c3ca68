"""Config handling of docs/numerics.md §13: honoured fields, and refusals that name the field."""

from decimal import Decimal

import numpy as np
import pytest
from tracegate_contract import ContractError, parse_config

from conftest import tiny_config


def cfg(family="dense", drop=(), **over):
    c = tiny_config(family, **over)
    for k in drop:
        c.pop(k)
    return c


def test_honoured_fields():
    c = parse_config(cfg())
    assert (c.hidden_size, c.head_dim, c.num_key_value_heads, c.rope_theta) == (16, 6, 2, 10000.0)
    assert c.rms_norm_eps == np.float32(1e-6) and c.tie_word_embeddings and c.attention_bias
    m = parse_config(cfg("moe"))
    assert [m.is_sparse(i) for i in range(3)] == [True, False, True]  # mlp_only_layers [1]
    m = parse_config(cfg("moe", decoder_sparse_step=2, mlp_only_layers=[]))
    assert [m.is_sparse(i) for i in range(3)] == [False, True, False]  # (l+1) % step == 0


def test_legacy_rope_theta_and_head_dim_default():
    c = parse_config(
        cfg(drop=("rope_parameters", "head_dim"), rope_theta=500000.0, rope_scaling=None)
    )
    assert c.rope_theta == 500000.0 and c.head_dim == 128  # Qwen3Config's own default
    assert parse_config(cfg("moe", drop=("head_dim",))).head_dim == 16 // 4  # MoE: hidden / heads
    assert (
        parse_config(cfg(drop=("rope_parameters",))).rope_theta == 10000.0
    )  # transformers' default
    c = parse_config(
        cfg(rope_parameters={"rope_type": "default", "rope_theta": Decimal("1000000.0")})
    )
    assert c.rope_theta == 1e6


def test_rope_scaling_replaces_rope_parameters_and_absent_fields_default():
    # §13: a non-empty legacy rope_scaling takes rope_parameters' place; its rope_theta wins.
    c = parse_config(
        cfg(
            drop=("rope_parameters",),
            rope_theta=10000,
            rope_scaling={"rope_type": "default", "rope_theta": 5000},
        )
    )
    assert c.rope_theta == 5000.0
    c = parse_config(
        cfg(
            rope_theta=2e4,
            rope_scaling={"rope_type": "default"},
            rope_parameters={"rope_type": "yarn", "factor": 4.0},
        )
    )
    assert c.rope_theta == 2e4
    assert parse_config(cfg(drop=("rms_norm_eps",))).rms_norm_eps == np.float32(1e-6)
    assert (
        parse_config(cfg("moe", drop=("intermediate_size",), mlp_only_layers=[])).intermediate_size
        is None
    )
    a = parse_config(
        cfg(use_sliding_window=None, sliding_window=4096, max_window_layers=0, hidden_act=None)
    )
    assert a == parse_config(cfg())


@pytest.mark.parametrize(
    "over,field",
    [
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "rope_type"),
        (
            {"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}},
            "rope_type",
        ),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        (
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.25,
                }
            },
            "partial_rotary_factor",
        ),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"model_type": "mistral"}, "model_type"),
        ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({"rope_scaling": {"rope_type": "default", "factor": 2.0}}, "rope_scaling.factor"),
        (
            {"rope_scaling": {}, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            "rope_parameters.rope_type",
        ),
        ({"intermediate_size": None}, "intermediate_size"),
    ],
)
def test_dense_refusals_name_the_field(over, field):
    with pytest.raises(ContractError, match=field):
        parse_config(cfg(**over))


@pytest.mark.parametrize("k,e", [(8, 8), (9, 8), (0, 8)])
def test_moe_topk_refusals(k, e):
    with pytest.raises(ContractError, match="num_experts_per_tok"):
        parse_config(cfg("moe", num_experts=e, num_experts_per_tok=k))


def test_zero_experts_means_all_dense():
    c = parse_config(cfg("moe", num_experts=0))
    assert not any(c.is_sparse(i) for i in range(3))


def test_ignored_fields_do_not_matter():
    a = parse_config(cfg())
    b = parse_config(
        cfg(
            initializer_range=0.5,
            attention_dropout=0.1,
            dtype="bfloat16",
            bos_token_id=3,
        )
    )
    assert a == b
    # max_position_embeddings computes nothing but bounds a run (--tokens plus --generate).
    assert parse_config(cfg(max_position_embeddings=7)).max_position_embeddings == 7


def test_deeply_nested_config_is_one_line_naming_the_file(tmp_path):
    from tracegate_contract import load_config

    from conftest import make_model_dir

    d = make_model_dir(tmp_path / "m")
    with open(f"{d}/config.json", "w") as f:
        f.write('{"model_type": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(
        ContractError, match=r"config\.json is not valid JSON: nested deeper than 127"
    ) as e:
        load_config(d)
    assert "\n" not in str(e.value)


def test_absurd_layer_count_of_an_all_sparse_config_parses_at_once():
    """'Is any layer dense?' is decided without visiting 2^62 layers (the count is checked
    against the checkpoint later, by Model)."""
    c = parse_config(
        cfg("moe", drop=("intermediate_size",), mlp_only_layers=[], num_hidden_layers=1 << 62)
    )
    assert c.intermediate_size is None and c.num_hidden_layers == 1 << 62


@pytest.mark.parametrize(
    "field", ["num_hidden_layers", "hidden_size", "decoder_sparse_step", "max_position_embeddings"]
)
def test_sizes_beyond_64_bits_are_refused_as_the_engine_does(field):
    with pytest.raises(ContractError, match=field):
        parse_config(cfg("moe", **{field: 1 << 64}))


@pytest.mark.parametrize(
    "mt,oracle", [("mistral", True), ("olmo2", True), ("mixtral", True), ("gpt2", False)]
)
def test_other_family_refusal_says_whether_the_oracle_supports_it(mt, oracle):
    with pytest.raises(ContractError) as e:
        parse_config(cfg(model_type=mt))
    msg = str(e.value)
    assert f"model_type: {mt!r}" in msg and "\n" not in msg and "docs/capture-points.md" in msg
    assert ("the oracle supports it" in msg) is oracle and (
        "bisect --reference oracle" in msg
    ) is oracle


@pytest.mark.parametrize("theta", [1e-60, 1e-300, 5e-324])
def test_a_rope_theta_whose_frequencies_overflow_f32_is_refused_as_the_engine_does(theta):
    """§7: f32(1/θ^(2i/d)) must be finite for every i; with head_dim 6 the largest is
    1/θ^(4/6). 1e-60 ended in `math domain error` (cos of an infinite angle), where the engine
    refuses it (config/fields.rs finite_rope)."""
    with pytest.raises(ContractError, match=r"rope_theta: .* beyond f32"):
        parse_config(cfg(rope_parameters={"rope_type": "default", "rope_theta": theta}))


def test_a_tiny_rope_theta_with_finite_frequencies_is_computed():
    """The negative control: 1e-50^(4/6) = 1e-33.3, its inverse a finite f32."""
    c = parse_config(cfg(rope_parameters={"rope_type": "default", "rope_theta": 1e-50}))
    assert c.rope_theta == 1e-50
