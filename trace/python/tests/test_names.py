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
    assert tuple(names.parse(name)) == want


def test_str_rebuilds_the_canonical_name():
    for s in ["decode.0003.layer.101.hidden_out", "layer.00.expert.063.out", "logits"]:
        assert str(names.parse(s)) == s
    assert str(names.parse("decode.0003.final_norm.out").without_step()) == "final_norm.out"
