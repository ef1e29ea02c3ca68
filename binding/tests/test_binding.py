"""The Python binding: every dtype round-trips, errors are TraceError, crashes leave nothing."""

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import spec_writer
import tracegate

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "fixtures" / "format"

DTYPES = [
    np.float64,
    np.float32,
    np.float16,
    np.int64,
    np.int32,
    np.int16,
    np.int8,
    np.uint8,
    np.bool_,
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 0, 4), (1, 2, 1, 3, 2)])
def test_every_dtype_and_shape_round_trips(tmp_path, dtype, shape):
    rng = np.random.default_rng(7)
    array = (rng.standard_normal(shape) * 100).astype(dtype)
    path = tmp_path / "a.trace"
    with tracegate.TraceWriter(path, {"producer": "test"}) as w:
        w.tensor("x", array, path="prefill", positions=list(range(shape[0])) if shape else None)
    t = tracegate.Trace(path)
    t.verify()
    back = t["x"]
    assert back.dtype == np.dtype(dtype) and back.shape == shape
    assert back.tobytes() == array.tobytes()
    assert not back.flags.writeable  # a view into the read-only map


def test_non_contiguous_and_big_endian_inputs_are_stored_as_values(tmp_path):
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    with tracegate.TraceWriter(tmp_path / "a.trace", {}) as w:
        w.tensor("t", base.T)
        w.tensor("s", base[:, ::2])
        w.tensor("be", base.astype(">f4"))
        w.tensor("le", base)
    t = tracegate.Trace(tmp_path / "a.trace")
    np.testing.assert_array_equal(t["t"], base.T)
    np.testing.assert_array_equal(t["s"], base[:, ::2])
    np.testing.assert_array_equal(t["be"], base)
    # Stored as little-endian values: the same bytes, so the same digest, as the native array.
    assert t.tensor_digest("be") == t.tensor_digest("le")


def test_bf16_as_uint16_bits(tmp_path):
    bits = np.array([0x3F80, 0xBF80, 0x7FC0], dtype=np.uint16)
    with tracegate.TraceWriter(tmp_path / "a.trace", {}) as w:
        w.tensor("b", bits, dtype="bf16")
        w.tensor("b_be", bits.astype(">u2"), dtype="bf16")
        with pytest.raises(tracegate.TraceError, match="takes the bits as a uint16 array"):
            w.tensor("c", np.zeros(2, np.float32), dtype="bf16")
        # Right size, wrong numbers: f16 bits are not bf16 bits.
        with pytest.raises(tracegate.TraceError, match="got float16"):
            w.tensor("e", np.ones(2, np.float16), dtype="bf16")
        with pytest.raises(tracegate.TraceError, match="does not match"):
            w.tensor("d", np.zeros(2, np.float32), dtype="f64")
    t = tracegate.Trace(tmp_path / "a.trace")
    assert t.dtype("b") == "bf16"
    np.testing.assert_array_equal(t["b"], bits)
    np.testing.assert_array_equal(t["b_be"], bits)


def test_decisions_margins_attributes_provenance(tmp_path):
    prov = {"producer": "py", "versions": {"numpy": np.__version__}, "prompt_tokens": [3, 17, 5]}
    with tracegate.TraceWriter(tmp_path / "a.trace", prov) as w:
        w.tensor(
            "logits",
            np.ones((3, 4), np.float32),
            path="prefill",
            mask="causal",
            positions=[0, 1, 2],
            step=0,
            note="x",
        )
        w.decision(
            "layer.00.router.topk", np.array([[1, 2], [2, 1], [0, 3]]), margins=[0.5, 0.0, -0.0]
        )
        w.decision("logits.argmax", [3, 3, 3])
    t = tracegate.Trace(tmp_path / "a.trace")
    assert t.attributes("logits") == {
        "mask": "causal",
        "note": "x",
        "path": "prefill",
        "positions": [0, 1, 2],
        "step": 0,
    }
    np.testing.assert_array_equal(t.decisions["layer.00.router.topk"], [[1, 2], [2, 1], [0, 3]])
    assert np.signbit(t.margins["layer.00.router.topk"][2])
    assert t.margins["logits.argmax"] is None
    assert t.provenance == prov
    assert len(t.digest) == 64 and w.digest == t.digest


def test_writer_errors_are_trace_errors_with_numbers(tmp_path):
    with tracegate.TraceWriter(tmp_path / "a.trace", {}) as w:
        w.tensor("x", np.zeros(2, np.float32))
        with pytest.raises(tracegate.TraceError, match='duplicate tensor name "x"'):
            w.tensor("x", np.zeros(2, np.float32))
        with pytest.raises(tracegate.TraceError, match="3 margins given but it has 2 rows"):
            w.decision("d", [1, 2], margins=[0.1, 0.2, 0.3])
        with pytest.raises(tracegate.TraceError, match="has no trace dtype"):
            w.tensor("c", np.zeros(2, np.complex64))
        with pytest.raises(tracegate.TraceError, match="must be integers"):
            w.decision("f", [0.5])
        # Out-of-range integers are TraceErrors naming the field, never a bare OverflowError.
        with pytest.raises(
            tracegate.TraceError,
            match="decision 'g': value 9223372036854775808 is outside the i64 range",
        ):
            w.decision("g", np.array([2**63], np.uint64))
        with pytest.raises(tracegate.TraceError, match="tensor 'y': step .* outside the i64 range"):
            w.tensor("y", np.zeros(1, np.float32), step=2**70)
        with pytest.raises(tracegate.TraceError, match="tensor 'z': positions must be an integer"):
            w.tensor("z", np.zeros(1, np.float32), positions=["x"])
        # One position per row: two for three rows says nothing about which row is which token.
        with pytest.raises(tracegate.TraceError, match='tensor "p": 2 positions for 3 rows'):
            w.tensor("p", np.zeros((3, 2), np.float32), positions=[0, 1])
        w.tensor("p", np.zeros((3, 2), np.float32), positions=[0, 1, 2])
    with pytest.raises(tracegate.TraceError, match="not JSON-serialisable"):
        tracegate.TraceWriter(tmp_path / "b.trace", {"x": object()})
    with pytest.raises(tracegate.TraceError, match="must be a JSON object"):
        tracegate.TraceWriter(tmp_path / "b.trace", [1])
    # Recorded verbatim or refused: a 70-bit integer would come back as a rounded float.
    with pytest.raises(
        tracegate.TraceError,
        match=r"provenance.big\[0\] = 1180591620717411303425 does not fit 64 bits",
    ):
        tracegate.TraceWriter(tmp_path / "b.trace", {"big": [2**70 + 1]})
    with pytest.raises(tracegate.TraceError, match="already finished"):
        w.tensor("late", np.zeros(1, np.float32))


def test_exception_inside_with_leaves_no_file(tmp_path):
    with pytest.raises(RuntimeError):
        with tracegate.TraceWriter(tmp_path / "a.trace", {}) as w:
            w.tensor("x", np.zeros(1000, np.float32))
            raise RuntimeError("producer failed")
    assert list(tmp_path.iterdir()) == []


def test_killed_writer_leaves_nothing_at_final_path(tmp_path):
    final = tmp_path / "killed.trace"
    code = f"""
import numpy as np, os, signal, tracegate
w = tracegate.TraceWriter({str(final)!r}, {{}})
w.tensor("x", np.zeros(1 << 16, np.float32))
os.kill(os.getpid(), signal.SIGKILL)
"""
    proc = subprocess.run([sys.executable, "-c", code])
    assert proc.returncode == -signal.SIGKILL
    assert not final.exists()
    leftovers = list(tmp_path.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tracegate-tmp")
    with pytest.raises(tracegate.TraceError, match="malformed trace"):
        tracegate.Trace(leftovers[0])


def test_tampered_and_malformed_files_raise(tmp_path):
    path = tmp_path / "a.trace"
    with tracegate.TraceWriter(path, {}) as w:
        w.tensor("x", np.arange(16, dtype=np.float32))
    data = bytearray(path.read_bytes())
    data[64] ^= 1
    path.write_bytes(bytes(data))
    t = tracegate.Trace(path)
    with pytest.raises(tracegate.TraceError, match='edited after capture: tensor "x"'):
        t.verify()
    path.write_bytes(bytes(data[:100]))
    with pytest.raises(tracegate.TraceError, match="shorter than header"):
        tracegate.Trace(path)
    with pytest.raises(tracegate.TraceError):
        tracegate.Trace(tmp_path / "missing.trace")


def test_binding_writes_the_conformance_vectors_byte_for_byte(tmp_path):
    for v in spec_writer.load_vectors(VECTORS):
        tensors, decisions = spec_writer.decode(v)
        out = tmp_path / v["file"]
        with tracegate.TraceWriter(out, v["provenance"]) as w:
            for t in tensors:
                np_dtype = {"bf16": np.uint16}.get(t["dtype"], tracegate._TO_NUMPY.get(t["dtype"]))
                array = np.frombuffer(t["data"], dtype=np_dtype).reshape(t["shape"])
                w.tensor(t["name"], array, dtype=t["dtype"], **t["attributes"])
            for d in decisions:
                margins = (
                    None if d["margins"] is None else np.frombuffer(b"".join(d["margins"]), "<f4")
                )
                w.decision(
                    d["name"],
                    np.array(d["values"], dtype=np.int64).reshape(d["shape"]),
                    margins=margins,
                )
        assert w.digest == v["digest"], v["file"]
        assert out.read_bytes() == (VECTORS / v["file"]).read_bytes(), v["file"]


def test_spec_writer_regenerates_the_committed_vectors(tmp_path):
    spec_writer.regenerate(tmp_path)
    for v in spec_writer.load_vectors(VECTORS):
        assert (tmp_path / v["file"]).read_bytes() == (VECTORS / v["file"]).read_bytes(), v["file"]
    assert (tmp_path / "vectors.json").read_text() == (VECTORS / "vectors.json").read_text()


def test_weights_digest_is_streamed_xxh3_of_sorted_files(tmp_path):
    import xxhash

    (tmp_path / "b.safetensors").write_bytes(b"second")
    (tmp_path / "a.safetensors").write_bytes(b"first")
    (tmp_path / "config.json").write_text("{}")
    assert tracegate.weights_digest(tmp_path) == xxhash.xxh3_128_hexdigest(b"firstsecond")
    with pytest.raises(tracegate.TraceError, match="nowhere"):
        tracegate.weights_digest(tmp_path / "nowhere")


def test_weights_digest_of_a_gguf_model_is_xxh3_of_the_file(tmp_path):
    """A .gguf file, or a directory whose weights are one .gguf: the file's bytes. Both kinds
    in one directory, or two .gguf files, are refused: which weights a producer read would be a
    guess."""
    import xxhash

    blob = b"GGUF" + bytes(range(256)) * 3
    (tmp_path / "m.gguf").write_bytes(blob)
    (tmp_path / "config.json").write_text("{}")
    want = xxhash.xxh3_128_hexdigest(blob)
    assert tracegate.weights_digest(tmp_path / "m.gguf") == want
    assert tracegate.weights_digest(tmp_path) == want
    (tmp_path / "n.gguf").write_bytes(blob)
    with pytest.raises(tracegate.TraceError, match="2 .gguf files"):
        tracegate.weights_digest(tmp_path)
    (tmp_path / "n.gguf").unlink()
    (tmp_path / "a.safetensors").write_bytes(b"x")
    with pytest.raises(tracegate.TraceError, match="both"):
        tracegate.weights_digest(tmp_path)
    with pytest.raises(tracegate.TraceError, match="config.json"):
        tracegate.weights_digest(tmp_path / "config.json")


def _run(code: str, *args, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter, so a signal or a hang is seen, not suffered."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_weights_digest_refuses_a_fifo_or_a_device_without_blocking(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes, /dev/zero never ends: the digest
    looks at what a weights file is (symlinks followed) before it opens it."""
    (tmp_path / "st").mkdir()
    os.mkfifo(tmp_path / "st" / "model.safetensors")
    os.mkfifo(tmp_path / "pipe.gguf")
    (tmp_path / "zero.gguf").symlink_to("/dev/zero")
    code = (
        "import sys, tracegate\n"
        "for p in sys.argv[1:]:\n"
        "    try:\n"
        "        tracegate.weights_digest(p)\n"
        "    except tracegate.TraceError as e:\n"
        "        print(e)\n"
    )
    models = [tmp_path / "st", tmp_path / "pipe.gguf", tmp_path / "zero.gguf"]
    r = _run(code, *models, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [
        f"{tmp_path / 'st' / 'model.safetensors'}: a FIFO, not a regular file: a weights file must be one",
        f"{tmp_path / 'pipe.gguf'}: a FIFO, not a regular file: a weights file must be one",
        f"{tmp_path / 'zero.gguf'}: a device, not a regular file: a weights file must be one",
    ]


def test_a_valid_trace_numpy_cannot_hold_raises_trace_error(tmp_path):
    from tracegate._native import NativeWriter

    path = tmp_path / "wide.trace"
    w = NativeWriter(str(path), "{}")
    w.tensor("empty", "f32", [0, 1 << 62], b"")  # zero elements: a valid tensor
    w.decision("d", [0, 1 << 62], [])
    w.finish()
    t = tracegate.Trace(path)
    t.verify()
    with pytest.raises(
        tracegate.TraceError,
        match=r"tensor 'empty' of shape \[0, 4611686018427387904\] cannot be a numpy array",
    ):
        t["empty"]
    with pytest.raises(
        tracegate.TraceError, match=r"decision 'd' of shape \[0, 4611686018427387904\]"
    ):
        _ = t.decisions


def test_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "pipe.trace"
    os.mkfifo(fifo)
    code = "import sys, tracegate\ntry:\n    tracegate.Trace(sys.argv[1])\nexcept tracegate.TraceError as e:\n    print(e)\n"
    try:
        proc = _run(code, fifo, timeout=20)
    except subprocess.TimeoutExpired:
        pytest.fail("Trace() on a FIFO blocked: a reader must look before it opens")
    assert proc.returncode == 0, proc.stderr
    assert "a FIFO, not a regular file" in proc.stdout and str(fifo) in proc.stdout


TRUNCATE_WHILE_MAPPED = """
import os, sys, numpy as np, tracegate
path = sys.argv[1]
with tracegate.TraceWriter(path, {}) as w:
    w.tensor("a", np.arange(1 << 18, dtype=np.float32))
    w.tensor("b", np.arange(1 << 18, dtype=np.float32))
    w.decision("d", np.arange(4))
t = tracegate.Trace(path)
os.truncate(path, 4096)  # the pages of "b" and the index are gone from under the map
for what, touch in [("verify", t.verify), ("read", lambda: t["b"]), ("decisions", lambda: t.decisions)]:
    try:
        touch()
    except tracegate.TraceError as e:
        assert "truncated or rewritten while in use" in str(e), e
        print(what, "refused")
    else:
        print(what, "ACCEPTED")
"""


def test_a_trace_truncated_while_mapped_is_refused_not_a_sigbus(tmp_path):
    proc = _run(TRUNCATE_WHILE_MAPPED, tmp_path / "t.trace")
    assert proc.returncode == 0, (
        f"exit {proc.returncode} (negative: killed by signal {-proc.returncode})\n{proc.stderr}"
    )
    assert proc.stdout.split("\n")[:3] == ["verify refused", "read refused", "decisions refused"], (
        proc.stdout
    )


def test_names_and_lookups_come_from_the_native_index(tmp_path):
    path = tmp_path / "a.trace"
    with tracegate.TraceWriter(path, {}) as w:
        for name in ["z", "a", "m"]:
            w.tensor(name, np.zeros(2, np.int8))
    t = tracegate.Trace(path)
    assert (len(t), "a" in t, "q" in t, t.dtype("m")) == (3, True, False, "i8")
    assert t.names == ["z", "a", "m"]  # capture order
    with pytest.raises(KeyError):
        t["q"]


def _mappings_of(path) -> list:
    """(start, end) of every mapping of the file at `path` in this process (/proc/self/maps)."""
    real = os.path.realpath(path)
    spans = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip("\n") == real:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                spans.append((start, end))
    return spans


def _inside(array: np.ndarray, spans: list) -> bool:
    at = array.__array_interface__["data"][0]
    return any(start <= at and at + array.nbytes <= end for start, end in spans)


def test_an_array_views_the_mapping_and_keeps_it_alive_after_the_trace_is_gone(tmp_path):
    path = tmp_path / "a.trace"
    values = np.arange(3000, dtype=np.float32).reshape(30, 100) - 7.5
    with tracegate.TraceWriter(path, {}) as w:
        w.tensor("x", values)
    t = tracegate.Trace(path)
    a = t["x"]
    del t
    gc.collect()
    # No copy: the array's memory lies inside this file's mapping, which is still there.
    spans = _mappings_of(path)
    assert spans and _inside(a, spans)
    assert not _inside(a.copy(), spans)  # the check tells a copy apart
    np.testing.assert_array_equal(a, values)  # still readable: the base holds the mapping
    assert not a.flags.writeable and not a.flags.owndata
    with pytest.raises(ValueError):
        a.flags.writeable = True  # nothing under it can be written: traces are evidence
    row = a[3]  # a view of the view keeps it too
    del a
    gc.collect()
    assert _mappings_of(path), "unmapped while a view of it was alive"
    np.testing.assert_array_equal(row, values[3])
    del row
    gc.collect()
    assert _mappings_of(path) == [], "the last array was gone but the file was still mapped"


def test_a_shape_the_native_view_cannot_index_raises_the_same_trace_error(tmp_path):
    """Past numpy's limit (above) is the view's own: an empty [0, 2**63] exceeds isize in the
    Rust view before numpy sees it, and is worded the same way."""
    from tracegate._native import NativeWriter

    path = tmp_path / "huge.trace"
    w = NativeWriter(str(path), "{}")
    w.tensor("huge", "u8", [0, 1 << 63], b"")
    w.tensor("fine", "u8", [0, 4], b"")
    w.finish()
    t = tracegate.Trace(path)
    t.verify()
    assert t["fine"].shape == (0, 4)
    with pytest.raises(
        tracegate.TraceError,
        match=r"tensor 'huge' of shape \[0, 9223372036854775808\] cannot be a numpy array: shape",
    ):
        t["huge"]


def test_a_torch_bfloat16_tensor_is_written_as_bf16_with_its_values(tmp_path):
    # np.asarray fails on it ("Got unsupported ScalarType BFloat16"): a port's bf16 activations
    # were refused with torch's words, not ours.
    torch = pytest.importorskip("torch")
    values = torch.tensor([[1.0, -2.5, 3.140625], [0.0, 1e-3, -7.0]], dtype=torch.bfloat16)
    path = tmp_path / "bf16.trace"
    with tracegate.TraceWriter(path, {"producer": "mine"}) as w:
        w.tensor("layer.00.attn_out", values, positions=[0, 1])
        with pytest.raises(tracegate.TraceError, match="torch.bfloat16"):
            w.tensor("layer.00.mlp_out", values, dtype="f32", positions=[0, 1])
    t = tracegate.Trace(path)
    bits = np.asarray(t["layer.00.attn_out"])
    assert t.dtype("layer.00.attn_out") == "bf16"
    assert "layer.00.mlp_out" not in t.names
    # The bits read back are the tensor's own bits: widened to f32, the same numbers.
    widened = (bits.astype(np.uint32) << 16).view(np.float32)
    assert widened.tolist() == values.float().tolist()
