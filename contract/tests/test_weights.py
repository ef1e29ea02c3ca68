"""safetensors loading: memory-mapped, sharded, every tensor claimed, every expected tensor
present, hostile headers refused, bf16 widened exactly."""

import json
import mmap
import os
import struct

import numpy as np
import pytest
from tracegate_contract import Capture, ContractError, Model
from tracegate_contract.weights import Checkpoint, SafetensorsFile

from conftest import make_model_dir, tiny_config, tiny_tensors, to_bf16_bits, write_safetensors


def run_logits(d, toks=(1, 5, 5, 9)):
    cap = Capture()
    Model(d).run(list(toks), cap)
    return dict((n, a) for n, a, _ in cap.tensors)["logits"]


def _mapping_under(a):
    """Walk `.base` down to the object that owns the memory; the mapping if it is one, else None."""
    b = a
    while isinstance(b, np.ndarray) and b.base is not None and not isinstance(b, np.memmap):
        b = b.base
    if isinstance(b, np.memmap):
        b = b._mmap
    return b if isinstance(b, mmap.mmap) else None


def test_tensors_are_memory_mapped(dense_dir):
    """A view of a file mapping, not of bytes read into memory: the chain of `.base` ends at an
    `mmap.mmap` of the checkpoint (a view of a `bytes` read from the file passes `.base is not
    None` too, so that is not evidence)."""
    path = os.path.join(dense_dir, "model.safetensors")
    sf = SafetensorsFile(path)
    a = sf.stored("model.norm.weight")
    m = _mapping_under(a)
    assert m is not None, (
        f"model.norm.weight is not a view of a file mapping: base chain ends at {type(a.base)}"
    )
    assert len(m) == os.path.getsize(path)
    assert not a.flags.owndata and not a.flags.writeable


def test_mapping_check_refuses_a_read_file(dense_dir):
    """The check above bites: the same view over the file's bytes read into memory is refused."""
    with open(os.path.join(dense_dir, "model.safetensors"), "rb") as f:
        read = np.frombuffer(f.read(), dtype=np.uint8)[8:24].view("<f4")
    assert read.base is not None and not read.flags.owndata and not read.flags.writeable
    assert _mapping_under(read) is None


def test_missing_tensor_is_refused_by_name(tmp_path):
    d = make_model_dir(
        tmp_path / "m", tensors_hook=lambda t: t.pop("model.layers.1.self_attn.k_norm.weight")
    )
    with pytest.raises(
        ContractError, match=r"missing tensor model\.layers\.1\.self_attn\.k_norm\.weight"
    ):
        Model(d)


def test_unclaimed_tensor_is_refused_by_name(tmp_path):
    def add(t):
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = ("F32", np.ones(3, np.float32))

    d = make_model_dir(tmp_path / "m", tensors_hook=add)
    with pytest.raises(
        ContractError, match=r"unclaimed tensor model\.layers\.0\.self_attn\.rotary_emb\.inv_freq"
    ):
        Model(d)


def test_tied_head_with_a_stored_lm_head_is_refused(tmp_path):
    # tie_word_embeddings: true means lm_head.weight is not read, so it must not be present.
    d = make_model_dir(
        tmp_path / "m",
        tensors_hook=lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]),
    )
    with pytest.raises(ContractError, match=r"unclaimed tensor lm_head\.weight"):
        Model(d)


def test_bias_tensors_are_required_iff_attention_bias(tmp_path):
    d = make_model_dir(
        tmp_path / "m",
        attention_bias=False,
        tensors_hook=lambda t: t.update(
            {"model.layers.0.self_attn.q_proj.bias": ("F32", np.zeros(24, np.float32))}
        ),
    )
    with pytest.raises(
        ContractError, match="unclaimed tensor model.layers.0.self_attn.q_proj.bias"
    ):
        Model(d)


def test_wrong_shape_is_refused(tmp_path):
    d = make_model_dir(
        tmp_path / "m",
        tensors_hook=lambda t: t.__setitem__("model.norm.weight", ("F32", np.ones(15, np.float32))),
    )
    with pytest.raises(
        ContractError, match=r"model\.norm\.weight has shape \[15\], expected \[16\]"
    ):
        Model(d)


def test_moe_expert_missing(tmp_path):
    d = make_model_dir(
        tmp_path / "m",
        "moe",
        tensors_hook=lambda t: t.pop("model.layers.2.mlp.experts.4.down_proj.weight"),
    )
    with pytest.raises(
        ContractError, match=r"missing tensor model\.layers\.2\.mlp\.experts\.4\.down_proj\.weight"
    ):
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
    write_safetensors(
        p,
        {"x": ("F32", np.ones(4, np.float32))},
        {"y": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}},
    )
    with pytest.raises(ContractError, match="tensor y"):
        SafetensorsFile(p)
    write_safetensors(p, {"x": ("I64", np.ones(4, np.int64))})
    with pytest.raises(ContractError, match="unsupported dtype 'I64'"):
        SafetensorsFile(p)
    write_safetensors(
        p,
        {"x": ("F32", np.ones(4, np.float32))},
        {"y": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
    )
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


def _blob(header_text: str, data: bytes) -> bytes:
    h = header_text.encode()
    return struct.pack("<Q", len(h)) + h + data


X = '"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'


@pytest.mark.parametrize(
    "blob,msg",
    [
        # json keeps the last of two equal keys silently; the engine refuses, so does the contract
        (_blob("{" + X + ", " + X + "}", b"\0" * 4), "duplicate tensor name 'x'"),
        (_blob("{" + X + "}", b"\0" * 12), "8 trailing bytes"),
        (
            _blob('{"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}', b"\0" * 8),
            "gap of 4 bytes",
        ),
        (_blob('{"__metadata__": {"a": 1}}', b""), "__metadata__"),
        (_blob('{"a": ' + "[" * 100000 + "]" * 100000 + "}", b""), "nested deeper than 127"),
        (_blob('{"a": ' + "[" * 127 + "]" * 127 + "}", b""), "nested deeper than 127"),
    ],
    ids=["duplicate", "trailing", "gap", "metadata", "nested-100000", "nested-128"],
)
def test_headers_the_engine_refuses_are_refused(tmp_path, blob, msg):
    p = tmp_path / "model.safetensors"
    p.write_bytes(blob)
    with pytest.raises(ContractError, match=msg) as e:
        SafetensorsFile(str(p))
    assert str(e.value).startswith("model.safetensors") and "\n" not in str(e.value)


def test_deeply_nested_index_is_refused_naming_it(tmp_path):
    d = make_model_dir(tmp_path / "m")
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        f.write('{"weight_map": ' + "[" * 50000 + "]" * 50000 + "}")
    with pytest.raises(
        ContractError, match="model.safetensors.index.json is not valid JSON: nested deeper"
    ):
        Checkpoint(d)


@pytest.mark.parametrize(
    "name", ["config.json", "model.safetensors", "model.safetensors.index.json"]
)
def test_a_fifo_in_the_model_directory_is_refused_not_waited_on(tmp_path, name):
    """Opening a FIFO for reading blocks until a writer comes; it is refused before it is opened."""
    d = make_model_dir(tmp_path / "m")
    p = os.path.join(d, name)
    if os.path.exists(p):
        os.remove(p)
    os.mkfifo(p)
    with pytest.raises(ContractError, match=f"{name}: not a regular file"):
        Model(d)


def _trace_renaming(monkeypatch, d, out, replace):
    """The `trace` verb on `d`, with `replace()` run once the model is loaded, as its forward
    starts: mid-run, deterministically."""
    from tracegate_contract import run

    forward, pending = Model.run, [replace]

    def run_after_replacing(self, *args, **kw):
        while pending:
            pending.pop()()
        return forward(self, *args, **kw)

    monkeypatch.setattr(Model, "run", run_after_replacing)
    return run.trace(d, [1, 5, 9], str(out), False, 0, False, ["contract", "trace"])


def test_a_checkpoint_renamed_over_mid_run_is_refused(tmp_path, monkeypatch):
    """The contract computes with the file it mapped; recording the digest of the file a rename
    put at the path since would name weights it never read (the oracle refuses this too)."""
    tracegate = pytest.importorskip("tracegate")
    d = make_model_dir(tmp_path / "m", seed=0)
    other = make_model_dir(tmp_path / "o", seed=1)
    st = os.path.join(d, "model.safetensors")
    new = os.path.join(other, "model.safetensors")
    assert tracegate.weights_digest(d) != tracegate.weights_digest(other)
    with pytest.raises(ContractError) as e:
        _trace_renaming(monkeypatch, d, tmp_path / "x.trace", lambda: os.replace(new, st))
    msg = str(e.value)
    assert msg.startswith(f"{st}: the weights file changed after the contract loaded it: ")
    assert "another file now" in msg and "\n" not in msg
    assert not list(tmp_path.glob("x.trace*"))
    # Control: untouched, the trace records the directory's digest.
    d2 = make_model_dir(tmp_path / "m2", seed=0)
    _trace_renaming(monkeypatch, d2, tmp_path / "ok.trace", lambda: None)
    prov = tracegate.Trace(tmp_path / "ok.trace").provenance
    assert prov["weights_digest"] == tracegate.weights_digest(d2)


def test_a_checkpoint_written_in_place_mid_run_is_refused(tmp_path, monkeypatch):
    pytest.importorskip("tracegate")
    d = make_model_dir(tmp_path / "m")
    st = os.path.join(d, "model.safetensors")
    # Same inode and size; a modification time no earlier write gave it.
    with pytest.raises(ContractError, match=r"model.safetensors: .* written since"):
        _trace_renaming(monkeypatch, d, tmp_path / "x.trace", lambda: os.utime(st, (7, 7)))
