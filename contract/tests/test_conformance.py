"""The op-level conformance vectors (fixtures/conformance/vectors.json, derived independently by
fixtures/conformance/derive.py) through the contract's ops and its DG15 random numbers
(tracegate_contract/splitmix.py), bit for bit. The engine checks the same file in
engine/tests/conformance.rs."""

import json
import pathlib
import runpy
import struct

import numpy as np
import pytest
from tracegate_contract import ops, splitmix
from tracegate_contract.weights import widen

HERE = pathlib.Path(__file__).resolve().parents[2] / "fixtures" / "conformance"
VECTORS = json.loads((HERE / "vectors.json").read_text())["ops"]
F32 = np.float32


def f(h: str) -> np.float32:
    return np.array([int(h, 16)], dtype=np.uint32).view(F32)[0]


def fs(hs) -> np.ndarray:
    return np.array([int(h, 16) for h in hs], dtype=np.uint32).view(F32)


def mismatch(what: str, got, want) -> str | None:
    """Bits equal; where the expected value is a NaN produced by arithmetic, any NaN (IEEE leaves
    a generated NaN's sign and payload to the platform)."""
    got = np.ascontiguousarray(got, dtype=F32).ravel()
    want = np.ascontiguousarray(want, dtype=F32).ravel()
    if got.shape != want.shape:
        return f"{what}: {got.size} values, expected {want.size}"
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(want) & np.isnan(got))
    if same.all():
        return None
    i = int(np.argmin(same))
    return f"{what}[{i}]: got {got.view(np.uint32)[i]:08x}, expected {want.view(np.uint32)[i]:08x}"


def _widen(c):
    h = np.array([int(b, 16) for b in c["bits16"]], dtype=np.uint16)
    stored = h if c["dtype"] == "bf16" else h.view(np.float16)
    got = widen("BF16" if c["dtype"] == "bf16" else "F16", stored)
    # Exact bits, NaN payloads included: widening is a conversion, not arithmetic.
    want = [int(b, 16) for b in c["out"]]
    return None if got.view(np.uint32).tolist() == want else f"got {got.view(np.uint32)}"


def _matmul(c):
    x = np.stack([fs(r) for r in c["x"]])
    if c["w_dtype"] == "bf16":
        w = widen("BF16", np.array([[int(h, 16) for h in r] for r in c["w_bits16"]], np.uint16))
    else:
        w = np.stack([fs(r) for r in c["w"]])
    b = None if c["bias"] is None else fs(c["bias"])
    got = ops.matmul(x, ops.transpose_weight(w), b)
    return mismatch("out", got, np.stack([fs(r) for r in c["out"]]))


def _rope_tables(c):
    rope = ops.Rope(c["base"], c["d"])
    cos, sin = rope.tables(c["positions"])
    return mismatch("cos", cos, [fs(r) for r in c["cos"]]) or mismatch(
        "sin", sin, [fs(r) for r in c["sin"]]
    )


def _rope_apply(c):
    x = fs(c["x"])[None, None, :]
    got = ops.Rope.apply(x, fs(c["cos"])[None], fs(c["sin"])[None])
    return mismatch("out", got, fs(c["out"]))


def _softmax(c):
    got = ops.softmax(fs(c["s"])[None], np.array(c["visible"])[None])
    return mismatch("out", got, fs(c["out"]))


def _topk(c):
    p = fs(c["p"])
    chosen, margin = ops.topk(p[None], c["k"])
    if chosen[0].tolist() != c["chosen"]:
        return f"chosen {chosen[0].tolist()}, expected {c['chosen']}"
    return mismatch("margin", margin, [f(c["margin"])])


def _argmax_margin(c):
    i, m = ops.argmax_margin(fs(c["v"])[None])
    if int(i[0]) != c["index"]:
        return f"index {int(i[0])}, expected {c['index']}"
    return mismatch("margin", m, [f(c["margin"])])


def f64(h: str) -> float:
    return struct.unpack("<d", struct.pack("<Q", int(h, 16)))[0]


def f64_bits(x: float) -> str:
    return f"{struct.unpack('<Q', struct.pack('<d', x))[0]:016x}"


def differs(got, want) -> str | None:
    """Integers (and binary64 bit patterns) are equal or not."""
    return None if got == want else f"got {got}, expected {want}"


def _splitmix64(c):
    k = int(c["key"], 16)
    return differs([f"{splitmix.output(k, i):016x}" for i in range(len(c["out"]))], c["out"])


def _dg_key(c):
    k = splitmix.key(int(c["seed"], 16), c["purpose"], c["block"], c["step"])
    return differs(f"{k:016x}", c["key"])


def _dg_categorical(c):
    p = fs(c["p"])
    return differs([splitmix.categorical(p, f64(u)) for u in c["u"]], c["out"])


# Every op of the file, each checked here: a new op in the file that no test reads fails.
CHECKS = {
    "widen": _widen,
    "dot": lambda c: mismatch(
        "out", ops.matmul(fs(c["x"])[None], fs(c["w"])[:, None]), [f(c["out"])]
    ),
    "ordered_sum": lambda c: mismatch("out", ops.ordered_sum(fs(c["v"])), [f(c["out"])]),
    "matmul": _matmul,
    "rmsnorm": lambda c: mismatch(
        "out", ops.rmsnorm(fs(c["x"]), fs(c["w"]), f(c["eps"])), fs(c["out"])
    ),
    "inv_freq": lambda c: mismatch("out", ops.inv_freq(c["base"], c["d"]), fs(c["out"])),
    "rope_tables": _rope_tables,
    "rope_apply": _rope_apply,
    "exp_to_f32": lambda c: mismatch("out", ops.exp_to_f32(fs(c["x"])), fs(c["out"])),
    "softmax": _softmax,
    "sigmoid": lambda c: mismatch("out", ops.sigmoid(fs(c["g"])), fs(c["out"])),
    "silu": lambda c: mismatch("out", ops.silu(fs(c["g"])), fs(c["out"])),
    "topk": _topk,
    "argmax_margin": _argmax_margin,
    "margin_of": lambda c: mismatch(
        "margin", [ops.margin_of(fs(c["v"]), c["chosen"])], [f(c["margin"])]
    ),
    "splitmix64": _splitmix64,
    "dg_key": _dg_key,
    "dg_uniform": lambda c: differs(
        [f64_bits(splitmix.uniform(int(x, 16))) for x in c["x"]], c["u"]
    ),
    "dg_token": lambda c: differs(
        [splitmix.token(int(x, 16), c["vocab"]) for x in c["x"]], c["out"]
    ),
    "dg_categorical": _dg_categorical,
}


def test_every_op_of_the_vectors_is_checked():
    assert set(VECTORS) == set(CHECKS)


@pytest.mark.parametrize(
    "op,case", [(op, c) for op in VECTORS for c in VECTORS[op]], ids=lambda x: str(x)[:40]
)
def test_vector(op, case):
    with np.errstate(all="ignore"):  # IEEE results are the point
        err = CHECKS[op](case)
    assert err is None, f"{op} {case['name']!r}: {err}"


def test_vectors_are_what_derive_py_derives():
    """The file is the documented derivation's output, not edited by hand."""
    derive = runpy.run_path(str(HERE / "derive.py"))
    assert derive["render"]() == (HERE / "vectors.json").read_text()


def test_the_comparison_rejects_one_ulp_a_sign_of_zero_and_a_nan_for_a_number():
    one = [F32(1.0)]
    assert mismatch("x", [np.nextafter(F32(1.0), F32(2.0))], one)
    assert mismatch("x", [F32(-0.0)], [F32(0.0)])
    assert mismatch("x", [F32(np.nan)], one)
    assert mismatch("x", one, [F32(np.nan)])
    assert mismatch("x", [F32(1.0), F32(2.0)], one)
    assert mismatch("x", fs(["ffc00000"]), fs(["7fc00000"])) is None  # generated NaN: any NaN
    assert mismatch("x", one, one) is None


def test_a_kernel_that_sums_right_to_left_fails_the_vectors():
    """Negative control for the vectors: the dot cases tell the §2 order from the reverse."""
    caught = False
    for c in VECTORS["dot"]:
        x, w = fs(c["x"]), fs(c["w"])
        acc = F32(0.0)
        with np.errstate(all="ignore"):
            for k in reversed(range(len(x))):
                acc = F32(acc + F32(x[k] * w[k]))
        caught |= mismatch("dot reversed", [acc], [f(c["out"])]) is not None
    assert caught
