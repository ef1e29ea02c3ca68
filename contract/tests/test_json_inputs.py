"""The contract's JSON inputs as an adversary hands them over (issue 33 items 8, 12): config.json
and the shard index are one regular file of at most 64 MiB, and no object in them repeats a key
(json keeps the last silently, so on main a second `num_hidden_layers` replaced the first)."""

import json
import os

import pytest
from tracegate_contract import ContractError, load_config
from tracegate_contract.jsonfile import MAX_JSON_LEN
from tracegate_contract.weights import Checkpoint

from conftest import make_model_dir


def _config_text(d) -> str:
    with open(os.path.join(d, "config.json")) as f:
        return f.read()


def test_a_repeated_key_in_config_json_is_refused_at_any_depth(tmp_path):
    d = make_model_dir(tmp_path / "m")
    assert load_config(d).num_hidden_layers > 1  # the negative control: the file as written
    text = _config_text(d)
    assert text.startswith("{")
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write('{"num_hidden_layers": 1, ' + text[1:])
    with pytest.raises(ContractError, match="config.json: duplicate key 'num_hidden_layers'"):
        load_config(d)
    # Nested: a repeated key inside an object-valued field.
    cfg = json.loads(text)
    cfg["rope_scaling"] = None
    with open(os.path.join(d, "config.json"), "w") as f:
        f.write(json.dumps(cfg)[:-1] + ', "x": {"a": 1, "a": 2}}')
    with pytest.raises(ContractError, match="config.json: duplicate key 'a'"):
        load_config(d)


def test_config_json_past_the_size_bound_or_not_regular_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "m")
    p = os.path.join(d, "config.json")
    os.remove(p)
    with open(p, "wb") as f:
        f.truncate(MAX_JSON_LEN + 1)  # sparse: refused from fstat, nothing read
    with pytest.raises(ContractError, match="config.json: .* more than the limit"):
        load_config(d)
    os.remove(p)
    os.symlink("/dev/zero", p)
    with pytest.raises(ContractError, match=r"config.json: not a regular file \(a device\)"):
        load_config(d)
    os.remove(p)
    os.mkdir(p)
    with pytest.raises(ContractError, match=r"config.json: not a regular file \(a directory\)"):
        load_config(d)


def test_a_repeated_tensor_in_the_index_weight_map_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "m")
    names = ["model.embed_tokens.weight", "lm_head.weight"]
    wm = ", ".join(f'"{n}": "model.safetensors"' for n in names)
    idx = os.path.join(d, "model.safetensors.index.json")
    with open(idx, "w") as f:
        f.write('{"weight_map": {' + wm + ', "lm_head.weight": "other.safetensors"}}')
    with pytest.raises(
        ContractError, match="model.safetensors.index.json: duplicate key 'lm_head.weight'"
    ):
        Checkpoint(d)
