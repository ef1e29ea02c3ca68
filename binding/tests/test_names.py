"""tracegate.names: the same rules as the Rust side (trace/src/names.rs), checked on the same cases."""

import pytest
from tracegate import names


def test_builds_with_minimum_widths_and_grows_past_them():
    assert names.layer(3, "mlp_out") == "layer.03.mlp_out"
    assert names.layer(100, "mlp_out") == "layer.100.mlp_out"
    assert names.layer_prefix(7) == "layer.07."
    assert names.expert(1, 7, "out") == "layer.01.expert.007.out"
    assert names.expert(1, 1234, "out") == "layer.01.expert.1234.out"
    assert names.decode(2, "logits") == "decode.0002.logits"
    assert names.decode(12345, names.layer(101, "hidden_in")) == "decode.12345.layer.101.hidden_in"


@pytest.mark.parametrize(
    "name, want",
    [
        ("layer.100.attn_out", (None, 100, None, "attn_out")),
        ("decode.10000.layer.05.mlp_out", (10000, 5, None, "mlp_out")),
        ("layer.02.expert.1000.out", (None, 2, 1000, "out")),
        ("layer.7.router.topk", (None, 7, None, "router.topk")),
        ("expert.001.out", (None, None, None, "expert.001.out")),
    ]
    + [(s, (None, None, None, s)) for s in ["logits", "embed.out", "layer.x.y", "layer.12"]],
)
def test_parses_every_digit(name, want):
    assert names.parse(name) == names.Name(*want)


@pytest.mark.parametrize(
    "name, want",
    [
        (
            "denoise.0001.0003.layer.02.expert.005.out",
            (None, 2, 5, "out", names.Diffusion("denoise", 1, 3)),
        ),
        ("denoise.0002.commit", (None, None, None, "commit", names.Diffusion("block", 2))),
        (
            "encode.0000.layer.01.hidden_out",
            (None, 1, None, "hidden_out", names.Diffusion("encode", 0)),
        ),
        (
            "denoise.10000.20000.logits",
            (None, None, None, "logits", names.Diffusion("denoise", 10000, 20000)),
        ),
        # a decode step is never also a diffusion pass; without a number there is no prefix
        ("decode.0001.denoise.0001.x", (1, None, None, "denoise.0001.x", None)),
        ("denoise.x.y", (None, None, None, "denoise.x.y", None)),
        ("encode.logits", (None, None, None, "encode.logits", None)),
    ],
)
def test_parses_diffusion_prefixes_as_the_rust_side(name, want):
    assert names.parse(name) == names.Name(*want)
    if want[4] is not None:
        assert str(names.parse(name)) == name


def test_diffusion_builders_and_registry():
    assert names.denoise(1, 3, "logits") == "denoise.0001.0003.logits"
    assert names.denoise_block(0, "commit") == "denoise.0000.commit"
    assert names.encode(2, names.layer(1, "k")) == "encode.0002.layer.01.k"
    assert names.point("denoise.0000.0001.layer.03.attn_probs").token_axis == 1
    assert names.point("denoise.0000.0001.canvas").stored == "tokens"
    assert names.point("denoise.0004.commit").block == "sampler"
    assert names.family_has("diffusion_gemma", names.point("layer.00.dense_mlp.branch"))
    assert not names.family_has("qwen3_moe", names.point("layer.00.dense_mlp.branch"))
    assert not names.family_has("diffusion_gemma", names.point("logits.argmax"))


def test_str_rebuilds_the_canonical_name():
    for s in ["decode.0003.layer.101.hidden_out", "layer.00.expert.063.out", "logits"]:
        assert str(names.parse(s)) == s
    assert str(names.parse("decode.0003.final_norm.out").without_step()) == "final_norm.out"
