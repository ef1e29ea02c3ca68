"""The oracle reads capture-point names through `tracegate.names`: every digit of a number."""

from tracegate_oracle.measure_policy import pattern


def test_policy_pattern_reads_every_digit_of_layer_and_expert():
    assert pattern("layer.100.mlp_out") == "layer.*.mlp_out"
    assert pattern("layer.03.expert.1000.out") == "layer.*.expert.*.out"
    assert pattern("layer.03.router.topk") == "layer.*.router.topk"


def test_policy_pattern_leaves_other_names_alone():
    assert pattern("logits") == "logits"
    assert pattern("final_norm.out") == "final_norm.out"
    # A decode step's name keeps its numbers (the policies spell decode patterns themselves).
    assert pattern("decode.0001.layer.03.mlp_out") == "decode.0001.layer.03.mlp_out"
    # Not a layer name: a `layer` word without a number.
    assert pattern("layer.x.mlp_out") == "layer.x.mlp_out"
