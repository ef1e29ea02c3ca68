"""safetensors loading: memory-mapped, sharded, every tensor claimed, every expected tensor
present, hostile headers refused, bf16 widened exactly."""

import json
import os
import struct

import numpy as np
import pytest
from conftest import make_model_dir, tiny_config, tiny_tensors, to_bf16_bits, write_safetensors

from tracegate_contract import Capture, ContractError, Model
from tracegate_contract.weights import Checkpoint, SafetensorsFile


def run_logits(d, toks=(1, 5, 5, 9)):
    cap = Capture()
    Model(d).run(list(toks), cap)
    return dict((n, a) for n, a, _ in cap.tensors)["logits"]


def test_tensors_are_memory_mapped(dense_dir):
    sf = SafetensorsFile(os.path.join(dense_dir, "model.safetensors"))
    a = sf.stored("model.norm.weight")
    assert isinstance(a.base, np.memmap) or isinstance(a, np.memmap) or a.base is not None
    assert not a.flags.owndata and not a.flags.writeable


def test_missing_tensor_is_refused_by_name(tmp_path):
    d = make_model_dir(tmp_path / "m", tensors_hook=lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ContractError, match=r"missing tensor model\.layers\.1\.self_attn\.k_norm\.weight"):
        Model(d)


def test_unclaimed_tensor_is_refused_by_name(tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", np.ones(3, np.float32))

    d = make_model_dir(tmp_path / "m", tensors_hook=add)
    with pytest.raises(ContractError, match=r"unclaimed tensor model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"):
        Model(d)


def test_tied_head_with_a_stored_lm_head_is_refused(tmp_path):
    # tie_word_embeddings: true means lm_head.weight is not read, so it must not be present.
    d = make_model_dir(tmp_path / "m", tensors_hook=lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    with pytest.raises(ContractError, match=r"unclaimed tensor lm_head\.weight"):
        Model(d)


def test_bias_tensors_are_required_iff_attention_bias(tmp_path):
    d = make_model_dir(tmp_path / "m", attention_bias=False, tensors_hook=lambda t: t.update(
        {"model.layers.0.self_attn.q_proj.bias": ("F32", np.zeros(24, np.float32))}))
    with pytest.raises(ContractError, match="unclaimed tensor model.layers.0.self_attn.q_proj.bias"):
        Model(d)


def test_wrong_shape_is_refused(tmp_path):
    d = make_model_dir(tmp_path / "m", tensors_hook=lambda t: t.__setitem__("model.norm.weight", ("F32", np.ones(15, np.float32))))
    with pytest.raises(ContractError, match=r"model\.norm\.weight has shape \[15\], expected \[16\]"):
        Model(d)


def test_moe_expert_missing(tmp_path):
    d = make_model_dir(tmp_path / "m", "moe", tensors_hook=lambda t: t.pop("model.layers.2.mlp.experts.4.down_proj.weight"))
    with pytest.raises(ContractError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.4\.down_proj\.weight"):
        Model(d)


@pytest.mark.parametrize(
    "blob,msg",
    [
        (struct.pack("<Q", 1 << 40) + b"{}", "header length"),
        (b"\x01\x00", "too short"),
        (struct.pack("<Q", 2) + b"[]", "not a JSON object"),
        (struct.pack("<Q", 3) + b"{x}", "not valid JSON"),
    ],
)
def test_hostile_headers_are_refused(tmp_path, blob, msg):
    p = tmp_path / "model.safetensors"
    p.write_bytes(blob)
    with pytest.raises(ContractError, match=msg):
        SafetensorsFile(str(p))


def test_offsets_outside_data_and_bad_dtype_are_refused(tmp_path):
    p = str(tmp_path / "a.safetensors")
    write_safetensors(p, {"x": ("F32", np.ones(4, np.float32))}, {"y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}})
    with pytest.raises(ContractError, match="tensor y"):
        SafetensorsFile(p)
    write_safetensors(p, {"x": ("I64", np.ones(4, np.int64))})
    with pytest.raises(ContractError, match="unsupported dtype 'I64'"):
        SafetensorsFile(p)
    write_safetensors(p, {"x": ("F32", np.ones(4, np.float32))}, {"y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    with pytest.raises(ContractError, match="overlap"):
        SafetensorsFile(p)


def test_no_checkpoint_file(tmp_path):
    with pytest.raises(ContractError, match="no model.safetensors"):
        Checkpoint(str(tmp_path))


def _shard(d, tensors, n=3):
    names = sorted(tensors)
    wm = {}
    for s in range(n):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        part = {k: tensors[k] for k in names[s::n]}
        write_safetensors(os.path.join(d, fname), part)
        wm.update({k: fname for k in part})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": wm}, f)
    return wm


def test_sharded_checkpoint_gives_the_same_bits(tmp_path):
    single = make_model_dir(tmp_path / "single", "moe", dtype="BF16", seed=5)
    sharded = str(tmp_path / "sharded")
    os.makedirs(sharded)
    cfg = tiny_config("moe")
    with open(os.path.join(sharded, "config.json"), "w") as f:
        json.dump(cfg, f)
    _shard(sharded, tiny_tensors(cfg, 5, "BF16"))
    a, b = run_logits(single), run_logits(sharded)
    assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_sharded_index_naming_a_tensor_its_shard_lacks(tmp_path):
    d = str(tmp_path)
    cfg = tiny_config()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    wm = _shard(d, tiny_tensors(cfg))
    wm["model.extra.weight"] = "model-00001-of-00003.safetensors"
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"weight_map": wm}, f)
    with pytest.raises(ContractError, match="missing tensor model.extra.weight"):
        Model(d)


def test_bf16_checkpoint_widens_exactly(tmp_path):
    d = make_model_dir(tmp_path / "m", dtype="BF16")
    ck = Checkpoint(d)
    raw = ck.take_stored("model.norm.weight", (16,))[0]
    w = ck.take("model.norm.weight", (16,))
    assert w.dtype == np.float32
    assert np.array_equal(w.view(np.uint32), raw.astype(np.uint32) << 16)
    assert np.array_equal(to_bf16_bits(w), raw)  # widening then rounding back is the identity
