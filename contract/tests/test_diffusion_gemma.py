"""diffusion_gemma in the contract (docs/diffusion-gemma.md): the DG15.5 generator vectors, the
DG16 names, order, attributes and decisions of a whole run on fixtures/tiny-diffusion-gemma, the
semantics each planted defect of DG18 hinges on (checked on the trace with numpy written here),
forcing (DG17) and the refusals. Expected values are the spec's own or computed here from the
trace, never by the code under test."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest
import tracegate
from tracegate import names
from tracegate_contract import splitmix
from tracegate_contract.__main__ import main

from conftest import ROOT

FIXTURE = os.path.join(ROOT, "fixtures", "tiny-diffusion-gemma")
QWEN3 = os.path.join(ROOT, "fixtures", "tiny-qwen3")
PROMPT = [3, 17, 5, 9, 100, 200, 300, 400]  # n = 8 > W: the prompt's sliding window matters
F32 = np.float32

with open(os.path.join(FIXTURE, "config.json")) as _f:
    CONFIG = json.load(_f)
with open(os.path.join(FIXTURE, "generation_config.json")) as _f:
    GEN = json.load(_f)
TC = CONFIG["text_config"]
C, V, H, NL = CONFIG["canvas_length"], TC["vocab_size"], TC["hidden_size"], TC["num_hidden_layers"]
W, NH, K = TC["sliding_window"], TC["num_attention_heads"], TC["top_k_experts"]
TYPES = TC["layer_types"]
N_STEPS = GEN["max_denoising_steps"]
EPS = F32(TC["rms_norm_eps"])


def dims(layer: int) -> tuple[int, int]:
    """(head dim, kv heads) of a layer, from the config (DG0 "Heads per layer type")."""
    plc = TC["per_layer_config"].get(str(layer))
    if TYPES[layer] == "full_attention":
        return plc["head_dim"], plc["num_key_value_heads"]
    return TC["head_dim"], TC["num_key_value_heads"]


def cli(*args) -> int:
    return main([str(a) for a in args])


def run(tmp_path, name, *extra, tokens=PROMPT, model=FIXTURE):
    out = tmp_path / name
    rc = cli(
        "trace", "--model", model, "--tokens", ",".join(map(str, tokens)), "--out", out, *extra
    )
    assert rc == 0
    return tracegate.Trace(str(out))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return run(tmp_path_factory.mktemp("dg"), "base.trace", "--generate", 14, "--seed", 3)


@pytest.fixture(scope="module")
def internals(tmp_path_factory):
    d = tmp_path_factory.mktemp("dgi")
    return run(d, "int.trace", "--generate", 14, "--seed", 3, "--capture", "internals")


# --------------------------------------------------------------------------------------------
# DG15.5


def test_splitmix_test_vectors():
    sm = splitmix
    assert sm.outputs(0, 3) == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]
    k = sm.key(0, sm.INIT, 0, 0)
    assert k == 0x7AB40E090F363A7D
    xs = sm.outputs(k, 4)
    assert xs == [0x4181B152FB77616F, 0x169C646D52269D62, 0x4A5DE8D8D53B7280, 0x90F7EFBD6C5ECAF3]
    assert [sm.uniform(x) for x in xs] == [
        0.2558852031320078,
        0.08832385701148338,
        0.29049544614575296,
        0.5662832105120926,
    ]
    assert [sm.token(x, 97) for x in xs] == [24, 8, 28, 54]
    for args, key, x, toks in [
        (
            (42, sm.INIT, 0, 0),
            0x2DA7A738F2B89A82,
            [0xEC8BA47C73582A61, 0xF908D7465CAEDE21, 0xEAA55833E011DC53, 0xF4409B04BEDE3B0A],
            [242222, 255011, 240277, 250114],
        ),
        (
            (42, sm.RENOISE, 1, 3),
            0x452C95CBE62F1B47,
            [0xD5620DEA60F7A276, 0xBFB18F267794A46D, 0xB9C7CA1BCFFAB214, 0x447EFDF3B62BAA79],
            [218504, 196294, 190239, 70139],
        ),
        (
            ((1 << 64) - 1, sm.RENOISE, 2, 47),
            0x089B3D3D7D743456,
            [0x0EF911EBFC55BA78, 0x168A8C418D22758F, 0xC014C6D31B24AB85, 0x6D114766440780F9],
            [15332, 23082, 196691, 111685],
        ),
    ]:
        assert sm.key(*args) == key
        assert sm.outputs(key, 4) == x
        assert [sm.token(v, 262144) for v in x] == toks
    k = sm.key(7, sm.SAMPLE, 0, 1)
    assert k == 0x73A3DA3129D32AA0
    xs = sm.outputs(k, 10)
    assert xs[:3] == [0x6EC7848DD13C79F5, 0x090FA5833006CBE5, 0x091462B03A8ADFDA]
    assert [sm.uniform(x) for x in xs] == [
        0.4327318998559678,
        0.035394997146819596,
        0.035467308067875236,
        0.4543556737589547,
        0.3340769351061771,
        0.05890132588431107,
        0.9030040381379189,
        0.1387302925670567,
        0.7054735822552192,
        0.9808359786388151,
    ]
    p = np.array([0x3E4F82D3, 0x3EAB105D, 0x3E219C18, 0x3D393537, 0x3E853987], np.uint32).view(F32)
    assert [sm.categorical(p, sm.uniform(x)) for x in xs] == [1, 0, 0, 1, 1, 0, 4, 0, 3, 4]


def test_categorical_never_draws_a_zero_probability_token():
    p = np.array([0.0, 0.5, 0.0, 0.5, 0.0], F32)
    draws = {splitmix.categorical(p, u) for u in (0.0, 0.25, 0.5, 0.75, 1.0 - 2**-53)}
    assert draws == {1, 3}


# --------------------------------------------------------------------------------------------
# DG16 names, order, attributes


def steps_of(t, b: int) -> int:
    """Steps block b ran, read from its stop decisions, holding the DG13.5 rule: every step but
    the last has stop 0, the last has stop 1 or is step N−1."""
    s = 0
    while names.denoise(b, s, "stop") in t.decisions:
        s += 1
    stops = [t.decisions[names.denoise(b, i, "stop")] for i in range(s)]
    assert s >= 1
    assert all(int(x[2]) == 0 for x in stops[:-1])
    assert int(stops[-1][2]) == 1 or s == N_STEPS
    return s


def blocks_of(t) -> int:
    b = 0
    while names.denoise_block(b, "init_canvas") in t.decisions:
        b += 1
    return b


def layer_names(i: int, internals: bool, routed: set[int]) -> list[str]:
    if not internals:
        pts = ["hidden_in", "attn_out", "dense_mlp.branch", "moe.branch", "mlp_out", "hidden_out"]
        return [names.layer(i, p) for p in pts]
    head = ["hidden_in", "q", "k", "v", "attn_probs", "attn_out", "attn_residual"]
    head += ["dense_mlp.out", "dense_mlp.branch", "router.logits"]
    tail = ["moe.out", "moe.branch", "mlp_out", "hidden_out"]
    return (
        [names.layer(i, p) for p in head]
        + [names.expert(i, e, "out") for e in sorted(routed)]
        + [names.layer(i, p) for p in tail]
    )


def expected(t, internals: bool):
    """(tensor names, decision names) of DG16 for this trace's blocks and steps; the experts of
    expert.EEE.out are the ones its pass's router.topk chose."""
    tensors, decisions = [], []

    def layers(pre):
        for i in range(NL):
            routed = {int(e) for e in t.decisions[pre(names.layer(i, "router.topk"))].ravel()}
            tensors.extend(pre(n) for n in layer_names(i, internals, routed))
            decisions.append(pre(names.layer(i, "router.topk")))

    tensors.append("embed.out")
    layers(lambda r: r)
    B = blocks_of(t)
    for b in range(B):
        decisions.append(names.denoise_block(b, "init_canvas"))
        for s in range(steps_of(t, b)):

            def pre(r, b=b, s=s):
                return names.denoise(b, s, r)

            tensors += [pre("canvas"), pre("embed.out"), pre("sc.soft")]
            tensors += [pre("sc.mlp_out")] if internals else []
            tensors.append(pre("sc.out"))
            layers(pre)
            tensors.append(pre("final_norm.out"))
            tensors += [pre("logits.uncapped")] if internals else []
            tensors += [pre("logits"), pre("logits.tempered"), pre("entropy")]
            decisions += [pre(d) for d in ("argmax", "sampled", "accept", "renoise", "stop")]
        decisions.append(names.denoise_block(b, "commit"))
        if b + 1 < B:

            def enc(r, b=b):
                return names.encode(b, r)

            tensors.append(enc("embed.out"))
            layers(enc)
    return tensors, decisions


def test_names_and_order_are_dg16(base):
    assert blocks_of(base) == math.ceil(14 / C)
    tensors, decisions = expected(base, internals=False)
    assert base.names == tensors
    assert list(base.decisions) == decisions


def test_internals_add_exactly_the_internal_points(base, internals):
    tensors, decisions = expected(internals, internals=True)
    assert internals.names == tensors
    assert list(internals.decisions) == decisions
    # The same run: every default tensor has the same bits in both.
    for n in base.names:
        assert base.tensor_digest(n) == internals.tensor_digest(n), n


def where(name: str, n: int):
    """(path, mask, positions, keys of attn_probs) of a tensor, from its name (DG6, DG16)."""
    parts = name.split(".")
    layer = int(parts[parts.index("layer") + 1]) if "layer" in parts else None
    sliding = layer is not None and TYPES[layer] == "sliding_attention"
    if parts[0] == "denoise":
        b = int(parts[1])
        L = n + b * C
        pos = list(range(L, L + C))
        mask = f"bidirectional,sliding:{W}" if sliding else "bidirectional"
        keys = (min(L, W - 1) if sliding else L) + C
        return "denoise", mask, pos, keys
    if parts[0] == "encode":
        L = n + int(parts[1]) * C
        pos, keys = list(range(L, L + C)), L + C
    else:
        pos, keys = list(range(n)), n
    return "encode", (f"sliding:{W}" if sliding else "causal"), pos, keys


def test_attributes_and_shapes_of_every_tensor(internals):
    t, n = internals, len(PROMPT)
    for name in t.names:
        path, mask, pos, keys = where(name, n)
        a = t.attributes(name)
        assert (a["path"], a["mask"]) == (path, mask), name
        if ".expert." in name:  # the rows routed to it: a subset, ascending
            assert set(a["positions"]) <= set(pos) and a["positions"] == sorted(a["positions"])
            assert t[name].shape == (len(a["positions"]), H)
            continue
        assert a["positions"] == pos, name
        shape = t[name].shape
        point = names.parse(name.split(".", 3)[-1] if name.startswith("denoise") else name).point
        if name.endswith(".canvas"):
            assert (t.dtype(name), shape) == ("i64", (C,))
            continue
        assert t.dtype(name) == "f32", name
        rows = len(pos)
        if point == "attn_probs":
            assert shape == (NH, rows, keys), name
        elif point in ("q", "k", "v"):
            layer = int(name.split("layer.")[1][:2])
            d, kv = dims(layer)
            assert shape == (rows, NH if point == "q" else kv, d), name
        elif point == "router.logits":
            assert shape == (rows, TC["num_experts"])
        elif point in ("logits", "logits.tempered", "logits.uncapped"):
            assert shape == (rows, V)
        elif point == "entropy":
            assert shape == (rows,)
        else:
            assert shape == (rows, H), name


def test_attn_probs_masks_are_dg6(internals):
    """Masked keys are exactly +0.0 and the visible ones sum to ~1: causal/windowed in the
    encoder passes, everything in the denoise steps."""
    t, n = internals, len(PROMPT)
    for name in t.names:
        if not name.endswith("attn_probs"):
            continue
        p = t[name]
        path, _, pos, keys = where(name, n)
        layer = int(name.split("layer.")[1][:2])
        sliding = TYPES[layer] == "sliding_attention"
        own = np.array(pos)
        cached = np.arange(keys - len(pos))
        if path == "denoise" and sliding:
            cached = np.arange(pos[0] - len(cached), pos[0])
        kpos = np.concatenate([cached, own])
        if path == "encode":
            vis = kpos[None, :] <= own[:, None]
            if sliding:
                vis &= kpos[None, :] > own[:, None] - W
        else:
            vis = np.ones((len(pos), keys), bool)
        assert np.all(p[:, ~vis] == 0) and not np.any(np.signbit(p[:, ~vis])), name
        assert np.all(p[:, vis] > 0), name
        assert np.allclose(p.astype(np.float64).sum(-1), 1.0, atol=1e-5), name


def test_decision_shapes_and_provenance(base):
    t = base
    for name, v in t.decisions.items():
        m = t.margins[name]
        if name.endswith("router.topk"):
            assert v.shape[1] == K and m.shape == (v.shape[0],), name
        elif name.endswith(".stop"):
            assert v.shape == (3,) and m.shape == (3,) and set(v.tolist()) <= {0, 1}
        elif name.endswith("init_canvas") or name.endswith(".renoise"):
            assert v.shape == (C,) and m is None, name
        else:
            assert v.shape == (C,) and m.shape == (C,), name
    p = t.provenance
    assert p["producer"] == "contract" and p["rng"] == "splitmix64-dg15" and p["seed"] == 3
    assert p["blocks"] == 2 and p["generate"] == 14
    assert p["generation"] == {
        "max_new_tokens": 14,
        "canvas_length": C,
        "max_denoising_steps": N_STEPS,
        "entropy_bound": GEN["sampler_config"]["entropy_bound"],
        "t_max": GEN["t_max"],
        "t_min": GEN["t_min"],
        "stability_threshold": GEN["stability_threshold"],
        "confidence_threshold": GEN["confidence_threshold"],
        "eos_token_id": None,
        "pad_token_id": None,
    }
    commits = [t.decisions[names.denoise_block(b, "commit")].tolist() for b in range(2)]
    assert p["output_tokens"] == commits[0] + commits[1]
    assert p["prompt_tokens"] == PROMPT


def test_generate_zero_is_the_prompt_pass_only(tmp_path):
    t = run(tmp_path, "g0.trace")
    assert t.names[0] == "embed.out" and not any(
        n.startswith(("denoise", "encode")) for n in t.names
    )
    assert list(t.decisions) == [names.layer(i, "router.topk") for i in range(NL)]
    assert t.provenance["blocks"] == 0 and t.provenance["output_tokens"] == []


def test_seed_changes_the_draws_only(tmp_path, base):
    other = run(tmp_path, "s4.trace", "--generate", 14, "--seed", 4)
    for n in base.names[: base.names.index(names.denoise(0, 0, "canvas"))]:
        assert base.tensor_digest(n) == other.tensor_digest(n)
    init = names.denoise_block(0, "init_canvas")
    assert base.decisions[init].tolist() != other.decisions[init].tolist()
    # init_canvas is stream INIT(b, 0), row r = output r (DG15.2, DG15.3)
    key = splitmix.key(3, splitmix.INIT, 0, 0)
    assert base.decisions[init].tolist() == [
        splitmix.token(splitmix.output(key, r), V) for r in range(C)
    ]


# --------------------------------------------------------------------------------------------
# The semantics the DG18 incident classes hinge on, recomputed here with numpy


def rmsnorm_plain(x):
    """§6 without weight, in f32, written out: ordered sum of squares, mean, + eps, sqrt, 1/s."""
    x = np.asarray(x, F32)
    ss = np.zeros(x.shape[0], F32)
    for i in range(x.shape[1]):
        ss = ss + x[:, i] * x[:, i]
    inv = F32(1.0) / np.sqrt(ss / F32(x.shape[1]) + EPS)
    return x * inv[:, None]


def test_self_conditioning_at_step_zero(base):
    for b in range(blocks_of(base)):
        soft = base[names.denoise(b, 0, "sc.soft")]
        assert np.all(soft.view(np.uint32) == 0)  # +0.0 exactly, no −0.0
        e = base[names.denoise(b, 0, "embed.out")]
        out = base[names.denoise(b, 0, "sc.out")]
        assert np.array_equal(out.view(np.uint32), rmsnorm_plain(e).view(np.uint32))
        assert not np.array_equal(out, e)  # normalised: skipping the module would differ
        assert np.array_equal(out, base[names.denoise(b, 0, names.layer(0, "hidden_in"))])
        if steps_of(base, b) > 1:  # from step 1 the signal is not zero
            assert np.any(base[names.denoise(b, 1, "sc.soft")] != 0)


def test_temperature_schedule(base):
    t_min, t_max = GEN["t_min"], GEN["t_max"]
    for b in range(blocks_of(base)):
        for s in range(steps_of(base, b)):
            k = N_STEPS - s
            T = F32(t_min) + (F32(t_max - t_min) * (F32(k) / F32(N_STEPS)))
            lg = base[names.denoise(b, s, "logits")]
            tempered = base[names.denoise(b, s, "logits.tempered")]
            assert np.array_equal(tempered.view(np.uint32), (lg / T).view(np.uint32)), (b, s)


def test_step_decisions_follow_dg13(base):
    t = base
    bound, S = F32(GEN["sampler_config"]["entropy_bound"]), GEN["stability_threshold"]
    thr = F32(GEN["confidence_threshold"])
    for b in range(blocks_of(t)):
        steps = steps_of(t, b)
        history = []
        canvas = t.decisions[names.denoise_block(b, "init_canvas")]
        for s in range(steps):

            def d(r, b=b, s=s):
                return t.decisions[names.denoise(b, s, r)]

            assert np.array_equal(t[names.denoise(b, s, "canvas")], canvas)
            ell = t[names.denoise(b, s, "logits.tempered")]
            # argmax of the tempered logits, lowest index at ties
            assert d("argmax").tolist() == [int(np.argmax(r)) for r in ell]
            # accept: cumulative entropy in ascending (entropy, row) order minus its own
            hent = t[names.denoise(b, s, "entropy")]
            acc, run_sum = np.zeros(C, np.int64), F32(0.0)
            for r in sorted(range(C), key=lambda r: (hent[r], r)):
                run_sum = F32(run_sum + hent[r])
                acc[r] = F32(run_sum - hent[r]) <= bound
            assert d("accept").tolist() == acc.tolist()
            # renoise: −1 exactly where accepted; the next canvas takes sampled or renoise
            ren, samp = d("renoise"), d("sampled")
            assert np.array_equal(ren == -1, acc == 1)
            canvas = np.where(acc == 1, samp, ren)
            # stop = stable AND confident
            stop = d("stop")
            same = 0
            for prev in reversed(history):
                if prev != d("argmax").tolist():
                    break
                same += 1
            mu = F32(0.0)
            for r in range(C):
                mu = F32(mu + hent[r])
            mu = F32(mu / F32(C))
            assert stop.tolist() == [int(same >= S), int(mu < thr), int(same >= S and mu < thr)]
            history.append(d("argmax").tolist())
            if s + 1 < steps:
                assert np.array_equal(t[names.denoise(b, s + 1, "canvas")], canvas)
        last = names.denoise(b, steps - 1, "argmax")
        commit = names.denoise_block(b, "commit")
        assert np.array_equal(t.decisions[commit], t.decisions[last])
        assert np.array_equal(t.margins[commit], t.margins[last])


# --------------------------------------------------------------------------------------------
# Forcing (DG17)


def rewrite(src, out, decisions=None, drop=(), margin=None):
    """A copy of trace `src` through tracegate.TraceWriter: `decisions` {name: values} replaced,
    `drop` left out, every margin set to `margin` when given."""
    decisions = decisions or {}
    with tracegate.TraceWriter(str(out), src.provenance) as w:
        for n in src.names:
            a = src.attributes(n)
            extra = {k: v for k, v in a.items() if k not in ("path", "mask", "positions")}
            w.tensor(n, src[n], path=a["path"], mask=a["mask"], positions=a["positions"], **extra)
        for n, v in src.decisions.items():
            if n in drop:
                continue
            m = src.margins[n]
            if m is not None and margin is not None:
                m = np.full_like(m, margin)
            w.decision(n, decisions.get(n, v), margins=m)
    return tracegate.Trace(str(out))


def force(tmp_path, name, ref):
    return run(tmp_path, name, "--generate", 14, "--seed", 3, "--force-decisions", ref)


def test_forced_by_its_own_trace_is_the_same_run(tmp_path, base):
    ref = tmp_path / "ref.trace"
    shutil.copy(base.path, ref)
    t = force(tmp_path, "f.trace", ref)
    assert t.names == base.names
    for n in base.names:
        assert t.tensor_digest(n) == base.tensor_digest(n), n
    assert list(t.decisions) == list(base.decisions)
    for n, v in base.decisions.items():
        assert np.array_equal(t.decisions[n], v)
        m = base.margins[n]
        assert (m is None and t.margins[n] is None) or np.array_equal(t.margins[n], m), n
    fd = t.provenance["forced_decisions"]
    assert fd["rows_overridden"] == 0 and fd["overridden"] == {} and fd["overridden_rows"] == {}
    commit = names.denoise_block(0, "commit")
    assert commit not in fd["decisions"]  # commit is checked, not forced
    assert names.denoise(0, 0, "sampled") in fd["decisions"]


def test_forced_sampled_changes_the_next_canvas_with_own_margins(tmp_path, base):
    s0 = names.denoise(0, 0, "sampled")
    acc = base.decisions[names.denoise(0, 0, "accept")]
    r = int(np.nonzero(acc == 1)[0][0])  # an accepted row: its next token is the sampled one
    sampled = base.decisions[s0].copy()
    new = (int(sampled[r]) + 1) % V
    sampled[r] = new
    ref = rewrite(base, tmp_path / "ref.trace", {s0: sampled}, margin=123.0)
    t = force(tmp_path, "f.trace", tmp_path / "ref.trace")
    nxt = t[names.denoise(0, 1, "canvas")]
    want = base[names.denoise(0, 1, "canvas")].copy()
    want[r] = new
    assert np.array_equal(nxt, want)
    # Every margin is the producer's own, never REF's (123): before the change they are the
    # unforced run's; the changed row's is this run's probability of the forced token.
    for n, m in t.margins.items():
        assert m is None or not np.any(m == F32(123.0)), n
    first = list(base.decisions).index(s0)
    for n in list(base.decisions)[:first]:
        m = base.margins[n]
        assert m is None or np.array_equal(t.margins[n], m), n
    ell = base[names.denoise(0, 0, "logits.tempered")].astype(np.float64)
    p = np.exp(ell[r] - ell[r].max())
    p /= p.sum()
    assert t.margins[s0][r] == pytest.approx(p[new], rel=1e-5)
    others = np.arange(C) != r
    assert np.array_equal(t.margins[s0][others], base.margins[s0][others])
    fd = t.provenance["forced_decisions"]
    assert fd["trace_digest"] == ref.digest and fd["overridden"][s0] == 1
    # A forced draw other than its own generator's, listed by row (docs/producers.md, "Recorded.").
    assert fd["overridden_rows"][s0] == [r]
    after = t.names.index(names.denoise(0, 1, "canvas"))
    assert all(t.attributes(n).get("forced") == ref.digest for n in t.names[after:])


def test_forcing_refuses_a_missing_decision_naming_it(tmp_path, base, capsys):
    gone = names.denoise(0, 1, "accept")
    rewrite(base, tmp_path / "ref.trace", drop=(gone,))
    rc = cli(
        "trace", "--model", FIXTURE, "--tokens", ",".join(map(str, PROMPT)), "--out",
        tmp_path / "f.trace", "--generate", 14, "--seed", 3, "--force-decisions",
        tmp_path / "ref.trace",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and gone in err and "missing" in err and len(err.splitlines()) == 1


def test_forcing_refuses_a_commit_that_is_not_the_last_argmax(tmp_path, base, capsys):
    c = names.denoise_block(0, "commit")
    bad = base.decisions[c].copy()
    bad[0] = (bad[0] + 1) % V
    rewrite(base, tmp_path / "ref.trace", {c: bad})
    rc = cli(
        "trace", "--model", FIXTURE, "--tokens", ",".join(map(str, PROMPT)), "--out",
        tmp_path / "f.trace", "--generate", 14, "--seed", 3, "--force-decisions",
        tmp_path / "ref.trace",
    )  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and c in err


# --------------------------------------------------------------------------------------------
# Refusals


@pytest.mark.parametrize(
    "extra, msg",
    [
        (["--t-max", "0.3"], "--t-max"),
        (["--t-min", "0.9"], "--t-min"),
        (["--t-min", "-0.1", "--t-max", "0.5"], "--t-min"),
        (["--denoising-steps", "0"], "--denoising-steps"),
        (["--seed", "-1"], "--seed"),
        (["--seed", str(1 << 64)], "--seed"),
        (["--seed", "x"], "--seed"),
        (["--entropy-bound", "0"], "--entropy-bound"),
        (["--confidence-threshold", "-1"], "--confidence-threshold"),
        (["--stability-threshold", "-1"], "--stability-threshold"),
        (["--pad", "-2"], "--pad"),
        (["--cache", "off"], "--cache off"),
    ],
)
def test_knob_refusals(tmp_path, capsys, extra, msg):
    out = tmp_path / "x.trace"
    rc = cli("trace", "--model", FIXTURE, "--tokens", "3,4", "--out", out, "--generate", 7, *extra)
    err = capsys.readouterr().err
    assert rc == 2 and msg in err and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize(
    "flag, value", [("--seed", "1"), ("--denoising-steps", "3"), ("--eos", "1,2")]
)
def test_diffusion_flags_refused_for_other_families(tmp_path, capsys, flag, value):
    rc = cli("trace", "--model", QWEN3, "--tokens", "3,4", "--out", tmp_path / "x", flag, value)
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and "diffusion_gemma" in err


def test_other_families_unchanged_without_the_flags(tmp_path):
    assert cli("trace", "--model", QWEN3, "--tokens", "3,4", "--out", tmp_path / "x") == 0


@pytest.mark.parametrize(
    "edit, field",
    [
        ({"use_bidirectional_attention": "all"}, "text_config.use_bidirectional_attention"),
        ({"attention_bias": True}, "text_config.attention_bias"),
        ({"hidden_activation": "gelu"}, "text_config.hidden_activation"),
        ({"top_k_experts": 6}, "text_config.top_k_experts"),
        ({"final_logit_softcapping": None}, "text_config.final_logit_softcapping"),
    ],
)
def test_config_refusals_name_the_field(tmp_path, capsys, edit, field):
    d = tmp_path / "m"
    shutil.copytree(FIXTURE, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"].update(edit)
    (d / "config.json").write_text(json.dumps(cfg))
    rc = cli("trace", "--model", d, "--tokens", "3,4", "--out", tmp_path / "x")
    err = capsys.readouterr().err
    assert rc == 2 and field in err and len(err.splitlines()) == 1, err


def test_eos_pads_after_the_first_eos_and_ends_generation(tmp_path, base):
    commit = base.decisions[names.denoise_block(0, "commit")].tolist()
    eos = commit[2]  # a token of block 0's commit: generation ends after block 0
    first = commit.index(eos)
    t = run(tmp_path, "eos.trace", "--generate", 14, "--seed", 3, "--eos", eos, "--pad", 508)
    p = t.provenance
    assert p["blocks"] == 1 and p["generation"]["eos_token_id"] == [eos]
    assert p["output_tokens"] == commit[: first + 1] + [508] * (C - first - 1)
    assert t.decisions[names.denoise_block(0, "commit")].tolist() == commit  # before padding
    assert not any(n.startswith("encode.") for n in t.names)
    # without --pad the EOS still ends generation, nothing is replaced
    t = run(tmp_path, "eos2.trace", "--generate", 14, "--seed", 3, "--eos", eos)
    assert t.provenance["output_tokens"] == commit and t.provenance["blocks"] == 1


def test_tie_word_embeddings_false_is_refused(tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(FIXTURE, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (d / "config.json").write_text(json.dumps(cfg))
    assert cli("trace", "--model", d, "--tokens", "3,4", "--out", tmp_path / "x") == 2
    assert "tie_word_embeddings" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------
# The layer verb (docs/producers.md, "Block diffusion")


def layer_verb(tmp_path, out, index, src, name, *extra):
    rc = cli(
        "layer", "--model", FIXTURE, "--layer", index, "--input", src, "--input-name", name,
        "--out", tmp_path / out, "--capture", "internals", *extra,
    )  # fmt: skip
    return rc, tmp_path / out


def test_layer_verb_repeats_the_whole_run(tmp_path, internals):
    # The prompt pass, block 0's commit pass and two denoise steps of block 1 (its cache: the
    # prompt and the commit pass, 15 rows, past W), a sliding (0) and a full (1) layer: every
    # tensor of that layer and pass, bit for bit with its attributes, and nothing else; the
    # router decision and its margins; forced by the same trace, the same.
    last = steps_of(internals, 1) - 1
    passes = [lambda r: r, lambda r: names.encode(0, r)]
    passes += [lambda r: names.denoise(1, 0, r), lambda r: names.denoise(1, last, r)]
    for i, ps in enumerate(passes):
        for lay in (0, 1):
            prefix, name = ps(names.layer_prefix(lay)), ps(names.layer(lay, "hidden_in"))
            for j, extra in enumerate([(), ("--force-decisions", internals.path)]):
                rc, out = layer_verb(
                    tmp_path, f"l{i}{lay}{j}.trace", lay, internals.path, name, *extra
                )
                assert rc == 0, name
                t = tracegate.Trace(str(out))
                assert t.names == [n for n in internals.names if n.startswith(prefix)], name
                for n in t.names:
                    assert t.tensor_digest(n) == internals.tensor_digest(n), n
                    a = {k: v for k, v in t.attributes(n).items() if k != "forced"}
                    assert a == internals.attributes(n), n
                topk = prefix + "router.topk"
                assert list(t.decisions) == [topk]
                assert np.array_equal(t.decisions[topk], internals.decisions[topk])
                assert np.array_equal(t.margins[topk], internals.margins[topk])
                p = t.provenance
                assert p["verb"] == "layer" and p["layer"] == lay and p["input_name"] == name
                assert ("forced_decisions" in p) == bool(extra)


def test_layer_verb_refusals_and_a_planted_change(tmp_path, base, internals, capsys):
    name = names.denoise(1, 0, names.layer(0, "hidden_in"))
    # A default capture has no k/v: the first one needed is named.
    rc, out = layer_verb(tmp_path, "x.trace", 0, base.path, name)
    err = capsys.readouterr().err
    assert rc == 2 and "no tensor layer.00.k " in err and "--capture internals" in err, err
    assert not out.exists()
    # The prompt pass needs no cache: a default capture is enough.
    assert layer_verb(tmp_path, "p.trace", 0, base.path, "layer.00.hidden_in")[0] == 0
    for lay, bad in [
        (1, name),
        (0, names.denoise(1, 0, names.layer(0, "attn_out"))),
        (0, names.denoise_block(1, names.layer(0, "hidden_in"))),
        (0, names.decode(1, names.layer(0, "hidden_in"))),
        (0, "layer.0.hidden_in"),
    ]:
        rc, _ = layer_verb(tmp_path, "x.trace", lay, internals.path, bad)
        err = capsys.readouterr().err
        assert rc == 2 and f"--input-name {bad}: not layer {lay}'s input" in err, err
    rc, _ = layer_verb(tmp_path, "x.trace", 0, internals.path, name, "--decode-from", 0)
    assert rc == 2 and "--decode-from" in capsys.readouterr().err
    # Negative control: row 0 of the input one ULP up changes the output.
    planted = tmp_path / "planted.trace"
    with tracegate.TraceWriter(str(planted), internals.provenance) as w:
        for n in internals.names:
            a = internals.attributes(n)
            x = np.array(internals[n])
            if n == name:
                x.reshape(-1).view(np.uint32)[0] += 1
            w.tensor(n, x, path=a["path"], mask=a["mask"], positions=a["positions"])
        for n, v in internals.decisions.items():
            w.decision(n, v, margins=internals.margins[n])
    rc, out = layer_verb(tmp_path, "n.trace", 0, planted, name)
    assert rc == 0
    ho = names.denoise(1, 0, names.layer(0, "hidden_out"))
    assert not np.array_equal(tracegate.Trace(str(out))[ho], internals[ho])


# --------------------------------------------------------------------------------------------
# per_layer_config as transformers saves it


def _tensor_digests(path) -> dict[str, str]:
    t = tracegate.Trace(str(path))
    return {n: t.tensor_digest(n) for n in t.names}


@pytest.mark.parametrize(
    "saved, explicit",
    [
        # What transformers saves when the full layers' kv heads are the config's own: no
        # num_key_value_heads in the entries (a held-out checkpoint's config was refused for it).
        ({"head_dim": 16}, {"head_dim": 16, "num_key_value_heads": 2}),
        # An entry without head_dim keeps the config's head_dim (10), not global_head_dim's 512.
        ({"num_key_value_heads": 2}, {"head_dim": 10, "num_key_value_heads": 2}),
    ],
)
def test_a_per_layer_entry_keeps_the_configs_own_values_for_what_it_omits(
    tmp_path, saved, explicit
):
    """Weights drawn for the layout transformers' own per-layer view gives the saved config; the
    engine and the contract run the saved config as the explicit one, bit for bit."""
    import importlib.util

    from test_engine_identity import ENGINE, engine_trace
    from transformers.models.diffusion_gemma.configuration_diffusion_gemma import (
        DiffusionGemmaTextConfig,
    )

    if not os.access(ENGINE, os.X_OK):
        pytest.skip(f"NOT CHECKED (the engine's side): {ENGINE} is not built")
    spec = importlib.util.spec_from_file_location(
        "make_fixtures", os.path.join(ROOT, "scripts", "make_fixtures.py")
    )
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    preset = json.loads(json.dumps(mf.PRESETS["tiny-diffusion-gemma"]))
    tc = preset["config"]["text_config"]
    tc["per_layer_config"] = {"1": saved, "3": saved}
    view = DiffusionGemmaTextConfig(**{k: v for k, v in tc.items() if k != "model_type"})
    full = {
        (view.per_layer_config[i].head_dim, view.per_layer_config[i].num_key_value_heads)
        for i in (1, 3)
    }
    assert full == {(explicit["head_dim"], explicit["num_key_value_heads"])}, full
    mf.PRESETS["saved"] = dict(preset, out=str(tmp_path / "saved"))
    saved_dir = mf.make("saved", tmp_path / "saved")
    explicit_dir = tmp_path / "explicit"
    shutil.copytree(saved_dir, explicit_dir)
    cfg = json.loads((explicit_dir / "config.json").read_text())
    cfg["text_config"]["per_layer_config"] = {"1": explicit, "3": explicit}
    (explicit_dir / "config.json").write_text(json.dumps(cfg))
    for who, run_it in (
        ("contract", lambda m, o: run(tmp_path, o, model=m)),
        ("engine", lambda m, o: engine_trace(str(m), PROMPT, str(tmp_path / o))),
    ):
        run_it(saved_dir, f"{who}-saved")
        run_it(explicit_dir, f"{who}-explicit")
        digests = _tensor_digests(tmp_path / f"{who}-saved")
        assert digests and digests == _tensor_digests(tmp_path / f"{who}-explicit"), who


def test_full_layers_that_resolve_differently_are_refused(tmp_path, capsys):
    """A full layer without an entry keeps the config's head_dim (10) while layer 1's says 16:
    two full layers of different sizes, refused in one line naming per_layer_config."""
    d = tmp_path / "m"
    shutil.copytree(FIXTURE, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["text_config"]["per_layer_config"]["3"]
    (d / "config.json").write_text(json.dumps(cfg))
    rc = cli("trace", "--model", d, "--tokens", "3,4", "--out", tmp_path / "x")
    err = capsys.readouterr().err
    assert rc == 2 and "per_layer_config" in err and len(err.splitlines()) == 1, err
