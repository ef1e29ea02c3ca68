"""The oracle on Qwen3.5 / Qwen3.5-MoE (docs/capture-points.md, "Qwen3.5"): the committed
fixtures tiny-qwen3_5 (multimodal layout) and tiny-qwen3_5-moe (text layout), and conversions of
each to the other layout (so all four families of the table run).

Expected names and shapes are written out below from the fixtures' config.json and the modeling
files (transformers/models/qwen3_5*/modeling_qwen3_5*.py), not derived from the oracle's table.
Each check that could pass vacuously has a negative control: a perturbed weight changes exactly
the points downstream of it, a planted decode defect breaks the cached-vs-uncached agreement, a
package-bound function is bypassed.
"""

from __future__ import annotations

import functools
import inspect
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from test_decode_capture import bound, rel  # noqa: E402
from tracegate_oracle import linear_attn  # noqa: E402
from tracegate_oracle.errors import CheckpointError, OracleError  # noqa: E402
from tracegate_oracle.families import resolve  # noqa: E402

DENSE = ROOT / "fixtures" / "tiny-qwen3_5"
MOE = ROOT / "fixtures" / "tiny-qwen3_5-moe"
PROMPT = [3, 17, 5, 99, 41, 7, 250, 11, 8, 9, 100]  # both vocabularies hold these
T = len(PROMPT)
N = 5  # decode steps: step 0 (the prompt's last row) and four one-row forwards
INTERNALS = cp.RunConfig(capture="internals")


def text_cfg(d: Path) -> dict:
    c = json.loads((d / "config.json").read_text())
    return c.get("text_config", c)


def expected_layer(L: int, c: dict, rows: int) -> list[tuple[str, tuple]]:
    """Layer L's internals capture, in order, with shapes (Q35 plan; docs/capture-points.md)."""
    H, p = c["hidden_size"], f"layer.{L:02d}."
    out = [(p + "hidden_in", (rows, H))]
    if c["layer_types"][L] == "linear_attention":
        nk, nv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        out += [
            (p + "linear.conv_out", (rows, 2 * nk * dk + nv * dv)),
            (p + "linear.q", (rows, nk, dk)),
            (p + "linear.k", (rows, nk, dk)),
            (p + "linear.g", (rows, nv)),
            (p + "linear.beta", (rows, nv)),
            (p + "linear.core", (rows, nv, dv)),
            (p + "linear.norm_out", (rows, nv, dv)),
            (p + "linear.state", (1, nv, dk, dv)),
        ]
    else:
        nh, nkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        out += [
            (p + "q", (rows, nh, hd)),
            (p + "k", (rows, nkv, hd)),
            (p + "v", (rows, nkv, hd)),
            (p + "attn_gate", (rows, nh, hd)),
            (p + "attn_probs", (nh, rows, rows)),
        ]
    out.append((p + "attn_out", (rows, H)))
    if "num_experts" in c:  # expert outputs: any subset, ascending (checked separately)
        out += [(p + "router.logits", (rows, c["num_experts"])), (p + "expert.*", None)]
        out += [(p + "shared_expert.gate", (rows, 1)), (p + "shared_expert.out", (rows, H))]
    out += [(p + "mlp_out", (rows, H)), (p + "hidden_out", (rows, H))]
    return out


def assert_layout(cap, c: dict, layers, rows: int, positions: list[int]):
    want = [w for L in layers for w in expected_layer(L, c, rows)]
    got = [n for n in cap.names if n.startswith("layer.")]
    i = 0
    for name, shape in want:
        if name.endswith("expert.*"):
            experts = []
            while got[i].startswith(name[:-1]):
                experts.append(got[i])
                i += 1
            assert experts and experts == sorted(experts), experts
            continue
        assert got[i] == name, (i, got[i], name)
        r = cap[name]
        assert r.array.shape == shape, (name, r.array.shape, shape)
        want_pos = positions[-1:] if name.endswith("linear.state") else positions
        assert r.attrs["positions"] == want_pos and r.attrs["mask"] == "causal", name
        i += 1
    assert i == len(got), got[i:]


@pytest.fixture(scope="module")
def runs():
    """fixture -> (dir, model, internals capture with cached decode, uncached decode capture)."""
    cp.setup_torch(INTERNALS)
    out = {}
    for d in (DENSE, MOE):
        model = cp.load_model(d, INTERNALS)
        on, off = (
            cp.capture_prompt(
                model, d, PROMPT, cp.RunConfig(capture="internals", generate=N, cache=c)
            )
            for c in ("on", "off")
        )
        out[d.name] = (d, model, on, off)
    return out


@pytest.mark.parametrize("fx", ["tiny-qwen3_5", "tiny-qwen3_5-moe"])
def test_names_shapes_order(runs, fx):
    d, model, cap, _ = runs[fx]
    c = text_cfg(d)
    n = c["num_hidden_layers"]
    pre = [x for x in cap.names if not x.startswith("decode.")]
    assert pre[0] == "embed.out" and pre[-2:] == ["final_norm.out", "logits"]
    assert_layout(cap, c, range(n), T, list(range(T)))
    assert cap["logits"].array.shape == (T, c["vocab_size"])
    # decode steps: the default points per layer, no internals
    for s in range(1, N):
        want = [
            f"decode.{s:04d}.layer.{L:02d}.{p}"
            for L in range(n)
            for p in ("hidden_in", "attn_out", "mlp_out", "hidden_out")
        ]
        want += [f"decode.{s:04d}.final_norm.out", f"decode.{s:04d}.logits"]
        assert [x for x in cap.names if x.startswith(f"decode.{s:04d}.")] == want
    moe = [L for L in range(n)] if "num_experts" in c else []
    assert [x.name for x in cap.decisions] == [
        *(f"layer.{L:02d}.router.topk" for L in moe),
        "logits.argmax",
        *(f"decode.{s:04d}.argmax" for s in range(N)),
    ]
    fam = cap.provenance["family"]
    assert fam["linear_layers"] == [
        L for L, t in enumerate(c["layer_types"]) if t == "linear_attention"
    ]
    assert fam["layer_types"] == c["layer_types"]


def test_default_capture_is_the_internals_capture_less_internals(runs):
    d, model, full, _ = runs["tiny-qwen3_5-moe"]
    cap = cp.capture_prompt(model, d, PROMPT, cp.RunConfig())
    default = ("hidden_in", "attn_out", "mlp_out", "hidden_out")
    assert cap.names == [
        x
        for x in full.names
        if not x.startswith("decode.")
        and (not x.startswith("layer.") or x.split(".", 2)[2] in default)
    ]
    for r in cap.tensors:
        np.testing.assert_array_equal(full[r.name].array, r.array)


def test_unused_tensors_are_listed_and_unknown_ones_refused(runs, tmp_path):
    # counted from the fixtures' READMEs: 21 vision-tower and 15 / 41 mtp tensors
    assert runs["tiny-qwen3_5"][2].provenance["unused_tensors"] == {
        "model.visual.": 21,
        "mtp.": 15,
    }
    assert runs["tiny-qwen3_5-moe"][2].provenance["unused_tensors"] == {"mtp.": 41}
    assert runs["tiny-qwen3_5"][2].provenance["model_class"] == "Qwen3_5ForConditionalGeneration"
    # negative control: a tensor under neither prefix stays an error
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "extra"
    shutil.copytree(MOE, bad)
    w = load_file(bad / "model.safetensors")
    w["model.extra_head.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)
    save_file(w, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="model.extra_head.weight"):
        cp.load_model(bad, INTERNALS)


def _text_layout(d: Path, out: Path) -> Path:
    """tiny-qwen3_5's language model (and mtp.*) as a Qwen3_5ForCausalLM text checkpoint."""
    from safetensors.numpy import load_file, save_file

    cfg = json.loads((d / "config.json").read_text())
    out.mkdir()
    text = dict(cfg["text_config"], architectures=["Qwen3_5ForCausalLM"])
    (out / "config.json").write_text(json.dumps(text))
    w = load_file(d / "model.safetensors")
    save_file(
        {
            k.replace("model.language_model.", "model."): v
            for k, v in w.items()
            if not k.startswith("model.visual.")
        },
        out / "model.safetensors",
        metadata={"format": "pt"},
    )
    return out


def _multimodal_layout(d: Path, out: Path) -> Path:
    """tiny-qwen3_5-moe's weights as a Qwen3_5MoeForConditionalGeneration checkpoint, with a
    tiny vision tower drawn by the fixture generator (scripts/make_fixtures.py)."""
    import importlib.util

    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("mf", ROOT / "scripts" / "make_fixtures.py")
    mf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mf)
    dense = mf.PRESETS["tiny-qwen3_5"]
    text = {
        k: v for k, v in json.loads((d / "config.json").read_text()).items() if k != "architectures"
    }
    V = text["vocab_size"]
    cfg = dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"],
        model_type="qwen3_5_moe",
        tie_word_embeddings=False,
        image_token_id=V - 2,
        video_token_id=V - 1,
        vision_start_token_id=V - 4,
        vision_end_token_id=V - 3,
        text_config=text,
        vision_config=dict(
            dense["config"]["vision_config"],
            model_type="qwen3_5_moe_vision",
            out_hidden_size=text["hidden_size"],
        ),
    )
    out.mkdir()
    (out / "config.json").write_text(json.dumps(cfg))
    w = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in load_file(d / "model.safetensors").items()
    }
    for name, shape, kind, fan_in in mf.qwen3_5_specs(cfg, 0):
        if name.startswith("model.visual."):
            w[name] = torch.from_numpy(mf.draw(1, name, shape, kind, fan_in, dense["scales"]))
    save_file(w, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("fx", ["tiny-qwen3_5", "tiny-qwen3_5-moe"])
def test_text_and_multimodal_layouts_give_identical_traces(runs, tmp_path, fx):
    """tiny-qwen3_5 converted to the text layout, tiny-qwen3_5-moe to the multimodal one: the
    same language-model weights give the same trace: every decision equal, every tensor equal to
    fp32 rounding. Not bit for bit: transformers keeps f32 weights memory-mapped from the file, so
    the same weight sits at another alignment in the other layout's file, and torch's CPU matmul
    does not promise the same bits for it (seen: 1 ulp from decode step 1 on, growing by steps)."""
    d, _, committed, _ = runs[fx]
    if fx == "tiny-qwen3_5":
        other, cls, fam, unused = (
            _text_layout(d, tmp_path / "t"),
            "Qwen3_5ForCausalLM",
            "qwen3_5_text",
            {"mtp.": 15},
        )
    else:
        other, cls, fam, unused = (
            _multimodal_layout(d, tmp_path / "m"),
            "Qwen3_5MoeForConditionalGeneration",
            "qwen3_5_moe",
            {"model.visual.": 21, "mtp.": 41},
        )
    rc = cp.RunConfig(capture="internals", generate=N)
    conv = cp.capture_prompt(cp.load_model(other, rc), other, PROMPT, rc)
    assert conv.provenance["model_class"] == cls
    assert conv.provenance["family"]["family"] == fam
    assert conv.provenance["unused_tensors"] == unused
    assert conv.names == committed.names
    for r in conv.tensors:
        # Relative L2 per tensor, the policy's measure (elements near 0 have no useful relative
        # error); 1e-5 is a tenth of oracle-default's bound.
        a, b = np.asarray(r.array, np.float64), np.asarray(committed[r.name].array, np.float64)
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), r.name
        assert r.attrs == committed[r.name].attrs, r.name
    for a, b in zip(conv.decisions, committed.decisions, strict=True):
        assert a.name == b.name
        np.testing.assert_array_equal(a.values, b.values)
        np.testing.assert_allclose(a.margins, b.margins, rtol=1e-5, atol=1e-6)


def _changed(a, b) -> list[str]:
    return [n for n in a.names if not np.array_equal(a[n].array, b[n].array)]


def _perturbed(model, name: str, rows=slice(None), by: float = 0.25):
    """Context: parameter `name` (rows `rows`) shifted by `by`, restored after."""
    p = dict(model.named_parameters())[name]
    keep = p.detach().clone()

    class Ctx:
        def __enter__(self):
            with torch.no_grad():
                p[rows] += by

        def __exit__(self, *exc):
            with torch.no_grad():
                p.copy_(keep)

    return Ctx()


def test_negative_control_perturbed_weights_change_exactly_what_is_downstream(runs):
    d, model, base, _ = runs["tiny-qwen3_5"]
    rc = INTERNALS
    names = [n for n in base.names if not n.startswith("decode.")]

    def after(first: str) -> list[str]:
        return names[names.index(first) :]

    lm = "model.language_model.layers."
    # dt_bias of linear layer 2: g changes (beta, q, k, conv do not), then all that follows g
    with _perturbed(model, lm + "2.linear_attn.dt_bias"):
        got = cp.capture_prompt(model, d, PROMPT, rc)
    assert _changed(got, base) == [
        x for x in after("layer.02.linear.g") if x != "layer.02.linear.beta"
    ]
    # the gate half of head 0 of full layer 1's q_proj: attn_gate changes, q/k/v/probs do not
    hd = text_cfg(d)["head_dim"]
    with _perturbed(model, lm + "1.self_attn.q_proj.weight", slice(hd, 2 * hd)):
        got = cp.capture_prompt(model, d, PROMPT, rc)
    assert _changed(got, base) == [
        x for x in after("layer.01.attn_gate") if x != "layer.01.attn_probs"
    ]
    assert not np.array_equal(
        got["layer.01.attn_gate"].array[:, 0], base["layer.01.attn_gate"].array[:, 0]
    )
    np.testing.assert_array_equal(
        got["layer.01.attn_gate"].array[:, 1:], base["layer.01.attn_gate"].array[:, 1:]
    )
    # key head 1's query channels of linear layer 0: linear.q head 1 changes, head 0 and k do not
    # (each key head is captured once: the first of its repeated copies)
    dk = text_cfg(d)["linear_key_head_dim"]
    with _perturbed(model, lm + "0.linear_attn.in_proj_qkv.weight", slice(dk, 2 * dk)):
        got = cp.capture_prompt(model, d, PROMPT, rc)
    q0, q1 = got["layer.00.linear.q"].array, base["layer.00.linear.q"].array
    np.testing.assert_array_equal(q0[:, 0], q1[:, 0])
    assert not np.array_equal(q0[:, 1], q1[:, 1])
    np.testing.assert_array_equal(got["layer.00.linear.k"].array, base["layer.00.linear.k"].array)
    # MoE: the shared expert's gate of layer 2 changes its gate logit, not the shared MLP's output
    d, model, base, _ = runs["tiny-qwen3_5-moe"]
    names = [n for n in base.names if not n.startswith("decode.")]
    with _perturbed(model, "model.layers.2.mlp.shared_expert_gate.weight"):
        got = cp.capture_prompt(model, d, PROMPT, rc)
    ch = _changed(got, base)
    assert ch[:2] == ["layer.02.shared_expert.gate", "layer.02.mlp_out"]
    assert (
        set(ch) <= set(after("layer.02.shared_expert.gate"))
        and "layer.02.shared_expert.out" not in ch
    )


@pytest.mark.parametrize("fx", ["tiny-qwen3_5", "tiny-qwen3_5-moe"])
def test_cached_and_uncached_decode_agree_within_policy(runs, fx):
    """transformers' cached decode runs the recurrent delta rule and conv update one row at a
    time; uncached recomputes with the chunked rule: not the same arithmetic, so held to the
    oracle-default policy's relative-L2 bound, with every decision equal. Worst printed (-s)."""
    _, _, on, off = runs[fx]
    assert [x.name for x in on.decisions] == [x.name for x in off.decisions]
    for a, b in zip(on.decisions, off.decisions, strict=True):
        np.testing.assert_array_equal(a.values, b.values, err_msg=a.name)
    worst = (0.0, "")
    for n in (x for x in on.names if x.startswith("decode.")):
        e = rel(on[n].array, off[n].array)
        assert e <= bound(n), (n, e)
        worst = max(worst, (e, n))
    print(f"{fx}: cached vs uncached worst rel L2 {worst[0]:.2e} ({worst[1]})")
    assert worst[0] > 0  # not the same arithmetic: the check compares two computations


def test_negative_control_decode_forgetting_the_recurrent_state_is_caught(runs):
    """A planted defect: the recurrent decode starts every step from a zero state."""
    d, model, _, off = runs["tiny-qwen3_5"]
    mod = inspect.getmodule(type(resolve(model).attn(0)))
    orig = mod.torch_recurrent_gated_delta_rule

    def forgetful(*args, initial_state=None, **kw):
        return inspect.unwrap(orig)(*args, initial_state=torch.zeros_like(initial_state), **kw)

    mod.torch_recurrent_gated_delta_rule = forgetful
    try:
        on = cp.capture_prompt(model, d, PROMPT, cp.RunConfig(capture="internals", generate=N))
    finally:
        mod.torch_recurrent_gated_delta_rule = orig
    n = "decode.0001.layer.00.attn_out"
    assert rel(on[n].array, off[n].array) > bound(n)


@pytest.mark.parametrize("fx", ["tiny-qwen3_5", "tiny-qwen3_5-moe"])
def test_layer_verb_on_both_layer_kinds(runs, fx):
    """A layer alone reproduces the whole run's layer bit for bit (a linear layer from a zero
    state at position 0); --decode-from runs its later rows as cached decode steps."""
    d, model, cap, _ = runs[fx]
    c = text_cfg(d)
    lin = c["layer_types"].index("linear_attention")
    full = c["layer_types"].index("full_attention")
    for L in (lin, full):
        x = cap[f"layer.{L:02d}.hidden_in"].array
        one = cp.capture_layer(model, d, L, x, list(range(T)), INTERNALS)
        assert_layout(one, c, [L], T, list(range(T)))
        for r in one.tensors:
            np.testing.assert_array_equal(r.array, cap[r.name].array, err_msg=r.name)
        P = T - 3
        dec = cp.capture_layer(model, d, L, x, list(range(T)), cp.RunConfig(), decode_from=P)
        y = dec[f"layer.{L:02d}.hidden_out"]
        assert y.attrs["positions"] == list(range(P, T)) and y.attrs["decode_from"] == str(P)
        ref = cap[f"layer.{L:02d}.hidden_out"].array[P:]
        assert rel(y.array, ref) <= bound(f"layer.{L:02d}.hidden_out")


def test_linear_layer_alone_needs_positions_from_zero(runs):
    d, model, cap, _ = runs["tiny-qwen3_5"]
    x = cap["layer.00.hidden_in"].array
    with pytest.raises(OracleError, match=r"linear-attention layer.*not \[2, 3, 4"):
        cp.capture_layer(model, d, 0, x[2:], list(range(2, T)), INTERNALS)
    # a full-attention layer takes any increasing positions
    cp.capture_layer(model, d, 1, x[2:], list(range(2, T)), cp.RunConfig())


def test_torch_references_run_and_are_restored(runs):
    """The oracle runs transformers' torch reference of each Gated DeltaNet function, also when
    transformers had bound a package's implementation (simulated here: one that raises); the
    bypass is in provenance and every function is restored afterwards."""
    d, model, base, _ = runs["tiny-qwen3_5"]
    mod = inspect.getmodule(type(resolve(model).attn(0)))
    orig = mod.causal_conv1d_fn
    torch_fn = inspect.unwrap(orig)

    def package_impl(*a, **k):
        raise AssertionError("the package implementation ran")

    def bind(implementation):  # the shape of transformers' fallback wrapper (hub_kernels.py)
        @functools.wraps(torch_fn)
        def wrapped(*args, **kwargs):
            return implementation(*args, **kwargs)

        return wrapped

    mod.causal_conv1d_fn = bind(package_impl)
    try:
        cap = cp.capture_prompt(model, d, PROMPT, INTERNALS)
    finally:
        mod.causal_conv1d_fn = orig
    np.testing.assert_array_equal(cap["logits"].array, base["logits"].array)
    la = cap.provenance["linear_attention"][mod.__name__]
    assert la["bypassed"] == {"causal_conv1d_fn": f"{__name__}.{package_impl.__qualname__}"}
    assert base.provenance["linear_attention"][mod.__name__]["bypassed"] == {}
    assert all(not isinstance(getattr(mod, f), linear_attn.Wrapped) for f in linear_attn.FUNCS)
    assert linear_attn.active_paths() is None


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_odd_rotary_dim_is_rounded_up_as_numerics_md_says(family):
    """docs/numerics.md §16: d_r = int(head_dim × factor) odd → ceil(d_r/2) frequencies over d_r,
    2·ceil(d_r/2) dims rotate, the rest pass; an odd head rotated whole is refused."""
    import importlib
    import math

    import transformers

    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    Cfg = getattr(
        transformers, "Qwen3_5TextConfig" if family == "qwen3_5" else "Qwen3_5MoeTextConfig"
    )
    Rot = getattr(
        mod,
        "Qwen3_5TextRotaryEmbedding" if family == "qwen3_5" else "Qwen3_5MoeTextRotaryEmbedding",
    )

    def cfg(head_dim, factor):
        rope = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": factor}
        return Cfg(
            vocab_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=1,
            num_key_value_heads=1, head_dim=head_dim, layer_types=["full_attention"],
            rope_parameters=rope,
        )  # fmt: skip

    rot = Rot(cfg(12, 0.25))  # d_r = 3
    f1 = 1.0 / math.pow(100.0, 2 / 3)
    assert rot.inv_freq.tolist() == pytest.approx([1.0, f1], rel=1e-6)
    x = torch.arange(1, 13, dtype=torch.float32).reshape(1, 1, 1, 12)
    cos, sin = rot(x, torch.tensor([[2]]))
    assert tuple(cos.shape) == (1, 1, 4)
    q, _ = mod.apply_rotary_pos_emb(x, x, cos, sin)
    q = q[0, 0, 0].tolist()
    a = [2.0, 2.0 * f1]
    want = [
        1 * math.cos(a[0]) - 3 * math.sin(a[0]),
        2 * math.cos(a[1]) - 4 * math.sin(a[1]),
        3 * math.cos(a[0]) + 1 * math.sin(a[0]),
        4 * math.cos(a[1]) + 2 * math.sin(a[1]),
    ]
    assert q[:4] == pytest.approx(want, abs=1e-5) and q[4:] == list(range(5, 13))
    # negative control: the floor rule (dims 0 and 1 rotate, 3 passes) is not what it does
    floor = [1 * math.cos(2) - 2 * math.sin(2), 2 * math.cos(2) + 1 * math.sin(2), 3.0, 4.0]
    assert q[:4] != pytest.approx(floor, abs=1e-3)
    # the one odd case that does not fit: refused by the config (head_dim > 4) ...
    with pytest.raises(Exception, match="even rotary dimension"):
        cfg(7, 1.0)
    # ... while an odd head whose rounded-up width fits runs (7 × 0.5 → 3: 4 of 7 dims rotate)
    assert tuple(Rot(cfg(7, 0.5))(x[..., :7], torch.tensor([[2]]))[0].shape) == (1, 1, 4)
