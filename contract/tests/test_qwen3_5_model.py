"""The Qwen3.5 families in the contract (docs/numerics.md §§13, 15–20): config fields honoured or
refused by name, the capture points of docs/capture-points.md, cached ≡ uncached generation bit
for bit, the `layer` verb on both layer kinds, the text and multimodal layouts giving the same
trace, and the contract against transformers' own classes (an observation of the spec's
correctness, within a stated tolerance). Checkpoints are written here from a seed (numpy only),
so nothing depends on the committed fixtures; those are added when present."""

from __future__ import annotations

import copy
import json
import os
import subprocess

import numpy as np
import pytest
import tracegate
from test_engine_identity import _NO_ENGINE, ENGINE
from test_engine_refusals import both_refuse_trace
from tracegate_contract import Capture, ContractError, mixers, open_model, ops, parse_config
from tracegate_contract.__main__ import main

from conftest import ROOT, to_bf16_bits, write_safetensors

L, F = "linear_attention", "full_attention"
FIXTURES = [os.path.join(ROOT, "fixtures", n) for n in ("tiny-qwen3_5", "tiny-qwen3_5-moe")]


def config(moe: bool = False, **over) -> dict:
    """Odd widths, a non-default layer pattern, partial RoPE, GQA, nv = 2·nk."""
    cfg = {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": 41,
        "hidden_size": 20,
        "intermediate_size": 26,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "layer_types": [L, F, L, L, F],
        "linear_conv_kernel_dim": 3,
        "linear_key_head_dim": 6,
        "linear_value_head_dim": 5,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "attention_bias": True,
        "hidden_act": "silu",
    }
    if moe:
        del cfg["intermediate_size"]
        cfg.update(
            architectures=["Qwen3_5MoeForCausalLM"],
            model_type="qwen3_5_moe_text",
            num_hidden_layers=4,
            layer_types=[L, L, F, L],
            linear_conv_kernel_dim=4,
            attention_bias=False,
            num_experts=5,
            num_experts_per_tok=2,
            moe_intermediate_size=7,
            shared_expert_intermediate_size=9,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 0],
                "mrope_interleaved": True,
            },
        )
    cfg.update(over)
    return cfg


def tensors(cfg: dict, seed: int = 0, dtype: str = "F32", fused: bool = False) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape, scale=0.3, offset=0.0):
        a = (offset + rng.standard_normal(shape) * scale).astype(np.float32)
        return ("BF16", to_bf16_bits(a)) if dtype == "BF16" else ("F32", a)

    H, V, d = cfg["hidden_size"], cfg["vocab_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    t = {"model.embed_tokens.weight": w(V, H, scale=1.0), "model.norm.weight": w(H, scale=0.1)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = w(H, scale=0.1)  # zero-centred: offsets from one
        t[f"{p}.post_attention_layernorm.weight"] = w(H, scale=0.1)
        if kind == F:
            a = f"{p}.self_attn"
            for n, o in (("q", 2 * nh * d), ("k", nkv * d), ("v", nkv * d)):
                t[f"{a}.{n}_proj.weight"] = w(o, H)
                if cfg["attention_bias"]:
                    t[f"{a}.{n}_proj.bias"] = w(o, scale=0.1)
            t[f"{a}.o_proj.weight"] = w(H, nh * d)
            if cfg["attention_bias"]:
                t[f"{a}.o_proj.bias"] = w(H, scale=0.1)
            t[f"{a}.q_norm.weight"] = w(d, scale=0.1)
            t[f"{a}.k_norm.weight"] = w(d, scale=0.1)
        else:
            a = f"{p}.linear_attn"
            nk, dk = cfg["linear_num_key_heads"], cfg["linear_key_head_dim"]
            nv, dv = cfg["linear_num_value_heads"], cfg["linear_value_head_dim"]
            conv = 2 * nk * dk + nv * dv
            t[f"{a}.in_proj_qkv.weight"] = w(conv, H)
            t[f"{a}.in_proj_z.weight"] = w(nv * dv, H)
            t[f"{a}.in_proj_b.weight"] = w(nv, H)
            t[f"{a}.in_proj_a.weight"] = w(nv, H)
            t[f"{a}.conv1d.weight"] = w(conv, 1, cfg["linear_conv_kernel_dim"], scale=0.5)
            t[f"{a}.dt_bias"] = w(nv, scale=0.5)
            t[f"{a}.A_log"] = w(nv, scale=0.5, offset=0.3)
            t[f"{a}.norm.weight"] = w(dv, scale=0.1, offset=1.0)
            t[f"{a}.out_proj.weight"] = w(H, nv * dv)
        if "num_experts" in cfg:
            E, I, SI = (
                cfg["num_experts"],
                cfg["moe_intermediate_size"],
                cfg["shared_expert_intermediate_size"],
            )
            m = f"{p}.mlp"
            t[f"{m}.gate.weight"] = w(E, H)
            if fused:
                t[f"{m}.experts.gate_up_proj"] = w(E, 2 * I, H)
                t[f"{m}.experts.down_proj"] = w(E, H, I)
            else:
                for e in range(E):
                    t[f"{m}.experts.{e}.gate_proj.weight"] = w(I, H)
                    t[f"{m}.experts.{e}.up_proj.weight"] = w(I, H)
                    t[f"{m}.experts.{e}.down_proj.weight"] = w(H, I)
            t[f"{m}.shared_expert.gate_proj.weight"] = w(SI, H)
            t[f"{m}.shared_expert.up_proj.weight"] = w(SI, H)
            t[f"{m}.shared_expert.down_proj.weight"] = w(H, SI)
            t[f"{m}.shared_expert_gate.weight"] = w(1, H)
        else:
            I = cfg["intermediate_size"]
            t[f"{p}.mlp.gate_proj.weight"] = w(I, H)
            t[f"{p}.mlp.up_proj.weight"] = w(I, H)
            t[f"{p}.mlp.down_proj.weight"] = w(H, I)
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = w(V, H)
    return t


def multimodal(cfg: dict, t: dict) -> tuple[dict, dict]:
    """The same language model in the ForConditionalGeneration layout, with vision-tower and
    multi-token-prediction tensors that the language model does not use."""
    moe = "num_experts" in cfg
    mt = "qwen3_5_moe" if moe else "qwen3_5"
    arch = "Qwen3_5MoeForConditionalGeneration" if moe else "Qwen3_5ForConditionalGeneration"
    text = {k: v for k, v in cfg.items() if k != "architectures"}
    out_cfg = {
        "architectures": [arch],
        "model_type": mt,
        "text_config": text,
        "vision_config": {"depth": 1, "hidden_size": 8, "out_hidden_size": cfg["hidden_size"]},
        "tie_word_embeddings": cfg["tie_word_embeddings"],
        "image_token_id": 7,
    }
    out = {
        (k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v
        for k, v in t.items()
    }
    z = ("F32", np.zeros((2, 3), np.float32))
    out.update({"model.visual.patch_embed.proj.weight": z, "model.visual.blocks.0.norm1.weight": z})
    out.update({"mtp.fc.weight": z, "mtp.layers.0.input_layernorm.weight": z, "mtp.norm.weight": z})
    return out_cfg, out


def write(path, cfg: dict, t: dict) -> str:
    path = str(path)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    write_safetensors(os.path.join(path, "model.safetensors"), t)
    return path


@pytest.fixture
def dense(tmp_path):
    c = config()
    return write(tmp_path / "dense", c, tensors(c))


@pytest.fixture
def moe(tmp_path):
    c = config(moe=True)
    return write(tmp_path / "moe", c, tensors(c, seed=1, dtype="BF16"))


# §16's odd rotary dims: 12 × 0.25 = 3 (issue 33's config) and an odd head, 7 × 0.5 = 3.5 → 3;
# both rotate 4 dims. A small theta makes the last frequency's angles large (100^(-2/3) ≈ 0.046
# rad per position), so a wrong rotary width shows well above the tolerance.
ODD_ROTARY = {
    "odd_rotary": dict(head_dim=12, factor=0.25),
    "odd_head": dict(head_dim=7, factor=0.5),
}


def odd_rotary_config(which: str) -> dict:
    o = ODD_ROTARY[which]
    rope = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": o["factor"]}
    return config(head_dim=o["head_dim"], rope_parameters=rope)


@pytest.fixture
def odd_rotary(tmp_path):
    c = odd_rotary_config("odd_rotary")
    return write(tmp_path / "odd_rotary", c, tensors(c, seed=5))


@pytest.fixture
def odd_head(tmp_path):
    c = odd_rotary_config("odd_head")
    return write(tmp_path / "odd_head", c, tensors(c, seed=6))


TOKENS = [3, 17, 5, 9, 17, 30, 2, 2, 11]


def caps(model, tokens=TOKENS, **run):
    cap = Capture(internals=True)
    out = model.run(tokens, cap, **run)
    return cap, out


def as_dict(cap):
    return {n: a for n, a, _ in cap.tensors}


def same(a, b):
    return a.shape == b.shape and np.array_equal(
        np.ascontiguousarray(a).view(np.uint32), np.ascontiguousarray(b).view(np.uint32)
    )


# ---- config (§13) ------------------------------------------------------------------------------


def test_config_defaults_as_transformers():
    c = config()
    for k in ("layer_types", "head_dim", "rope_parameters"):
        del c[k]
    c["rope_theta"] = 10000.0
    cfg = parse_config(c)
    # every 4th layer full (full_attention_interval 4), head_dim 256, factor 0.25 → 64 rotary dims
    assert [cfg.layer_kind(i) for i in range(5)] == [L, L, L, F, L]
    assert cfg.head_dim == 256 and cfg.rotary_dim == 64
    c["full_attention_interval"] = 2
    assert [parse_config(c).layer_kind(i) for i in range(5)] == [L, F, L, F, L]
    m = parse_config(config(moe=True))
    assert m.norm_topk_prob and all(m.is_sparse(i) for i in range(4)) and not m.has_dense_layer()


def _without(c, key):
    c = copy.deepcopy(c)
    del c[key]
    return c


REFUSALS = [
    ("layer_types", lambda c: {**c, "layer_types": [L, F, L, "sliding_attention", F]}),
    ("layer_types", lambda c: {**c, "layer_types": [L, F]}),
    ("linear_key_head_dim", lambda c: _without(c, "linear_key_head_dim")),
    ("linear_num_value_heads", lambda c: {**c, "linear_num_value_heads": 3}),
    (
        "rope_parameters.partial_rotary_factor",
        lambda c: {**c, "rope_parameters": {"partial_rotary_factor": 0}},
    ),
    (
        "rope_parameters.partial_rotary_factor",
        lambda c: {**c, "rope_parameters": {"partial_rotary_factor": 1.5}},
    ),
    # 8 × 0.1 = 0.8 → no rotary dim at all
    ("partial_rotary_factor", lambda c: {**c, "rope_parameters": {"partial_rotary_factor": 0.1}}),
    # an odd head rotated whole: 7 rounds up to 8 rotated dims, more than the head (§16)
    (
        "partial_rotary_factor",
        lambda c: {**c, "head_dim": 7, "rope_parameters": {"partial_rotary_factor": 1.0}},
    ),
    (
        "rope_parameters.mrope_section",
        lambda c: {**c, "rope_parameters": {"mrope_section": [1, 2]}},
    ),
    ("rope_parameters.factor", lambda c: {**c, "rope_parameters": {"factor": 2.0}}),
    ("rope_parameters.rope_type", lambda c: {**c, "rope_parameters": {"rope_type": "yarn"}}),
    ("hidden_act", lambda c: {**c, "hidden_act": "gelu"}),
    ("intermediate_size", lambda c: _without(c, "intermediate_size")),
]
MOE_REFUSALS = [
    ("norm_topk_prob", {"norm_topk_prob": False}),
    ("decoder_sparse_step", {"decoder_sparse_step": 2}),
    ("mlp_only_layers", {"mlp_only_layers": [1]}),
    ("num_experts_per_tok", {"num_experts_per_tok": 5}),
    ("shared_expert_intermediate_size", {"shared_expert_intermediate_size": None}),
]


@pytest.mark.parametrize("field,edit", REFUSALS)
def test_config_refusals_name_the_field(field, edit):
    parse_config(config())  # negative control: the unedited config is accepted
    with pytest.raises(ContractError, match=f"config.json: {field}:"):
        parse_config(edit(config()))


@pytest.mark.parametrize("field,over", MOE_REFUSALS)
def test_moe_config_refusals_name_the_field(field, over):
    parse_config(config(moe=True, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]))
    with pytest.raises(ContractError, match=f"config.json: {field}:"):
        parse_config(config(moe=True, **over))


def test_multimodal_config_reads_text_config_and_names_its_fields():
    c, _ = multimodal(config(), {})
    cfg = parse_config(c)
    assert (cfg.model_type, cfg.layout, cfg.prefix) == (
        "qwen3_5_text",
        "multimodal",
        "model.language_model.",
    )
    bad = copy.deepcopy(c)
    bad["text_config"]["linear_num_value_heads"] = 3
    with pytest.raises(ContractError, match="config.json: text_config.linear_num_value_heads:"):
        parse_config(bad)
    bad = copy.deepcopy(c)
    bad["text_config"]["tie_word_embeddings"] = True
    with pytest.raises(ContractError, match="text_config.tie_word_embeddings: True disagrees"):
        parse_config(bad)
    bad = copy.deepcopy(c)
    bad["text_config"]["model_type"] = "qwen3_5_moe_text"
    with pytest.raises(ContractError, match="text_config.model_type"):
        parse_config(bad)


def test_sizes_checked_against_the_checkpoint(tmp_path):
    c = config()
    d = write(tmp_path / "m", {**c, "linear_num_value_heads": 8}, tensors(c))
    with pytest.raises(
        ContractError, match="linear_num_value_heads: 8 does not match the checkpoint"
    ):
        open_model(d)
    d = write(tmp_path / "k", {**c, "linear_conv_kernel_dim": 4}, tensors(c))
    with pytest.raises(ContractError, match="linear_conv_kernel_dim: 4 does not match"):
        open_model(d)


# ---- capture points --------------------------------------------------------------------------


def test_capture_order_and_shapes(moe):
    m = open_model(moe)
    cap, _ = caps(m, generate=2)
    names = [n for n, _, _ in cap.tensors]
    l0 = [n for n in names if n.startswith("layer.00.")]
    experts = [n for n in l0 if ".expert." in n]
    assert experts and l0 == [
        "layer.00.hidden_in",
        *(
            f"layer.00.linear.{p}"
            for p in ("conv_out", "q", "k", "g", "beta", "core", "norm_out", "state")
        ),
        "layer.00.attn_out",
        "layer.00.router.logits",
        *experts,
        "layer.00.shared_expert.gate",
        "layer.00.shared_expert.out",
        "layer.00.mlp_out",
        "layer.00.hidden_out",
    ]
    l2 = [n.split(".", 2)[2] for n in names if n.startswith("layer.02.")]
    assert l2[:7] == ["hidden_in", "q", "k", "v", "attn_gate", "attn_probs", "attn_out"]
    T = len(TOKENS)
    shapes = {n: a.shape for n, a, _ in cap.tensors}
    assert shapes["layer.00.linear.conv_out"] == (T, 2 * 2 * 6 + 4 * 5)
    assert shapes["layer.00.linear.q"] == shapes["layer.00.linear.k"] == (T, 2, 6)
    assert shapes["layer.00.linear.g"] == shapes["layer.00.linear.beta"] == (T, 4)
    assert shapes["layer.00.linear.core"] == shapes["layer.00.linear.norm_out"] == (T, 4, 5)
    assert shapes["layer.00.linear.state"] == (1, 4, 6, 5)
    assert shapes["layer.02.attn_gate"] == shapes["layer.02.q"] == (T, 4, 8)
    assert shapes["layer.00.shared_expert.gate"] == (T, 1) and shapes[
        "layer.00.shared_expert.out"
    ] == (T, 20)
    pos = {n: p for n, _, p in cap.tensors}
    assert pos["layer.00.linear.state"] == [T - 1]
    t = as_dict(cap)
    assert (t["layer.00.linear.g"] <= 0).all()
    # decode steps hold the default per-layer points only
    step = [n for n in names if n.startswith("decode.0001.")]
    assert "decode.0001.layer.00.hidden_out" in step and not any("linear" in n for n in step)
    assert [d for d, _, _ in cap.decisions][:4] == [f"layer.{i:02d}.router.topk" for i in range(4)]


# ---- cached ≡ uncached (§18.7) ------------------------------------------------------------------


def _generation(d, cached):
    cap, out = caps(open_model(d), generate=8, cached=cached)
    return out, cap


def _model_dir(which, request):
    """A checkpoint written here ("dense", "moe", ODD_ROTARY's) or a committed fixture (skipped
    when absent)."""
    if which in ("dense", "moe", *ODD_ROTARY):
        return request.getfixturevalue(which)
    if not os.path.exists(os.path.join(which, "config.json")):
        pytest.skip(f"NOT CHECKED: fixture {which} not present")
    return which


@pytest.mark.parametrize("which", ["dense", "moe", *FIXTURES])
def test_cached_equals_uncached_for_8_steps(which, request, monkeypatch):
    d = _model_dir(which, request)
    ga, a = _generation(d, True)
    gb, b = _generation(d, False)
    assert ga == gb and len(ga) == 8
    ta, tb = as_dict(a), as_dict(b)
    assert list(ta) == list(tb) and all(same(ta[n], tb[n]) for n in ta)
    assert [(n, v.tolist(), m.view(np.uint32).tolist()) for n, v, m in a.decisions] == [
        (n, v.tolist(), m.view(np.uint32).tolist()) for n, v, m in b.decisions
    ]
    if which != "dense":
        return
    # negative control (once): a decode that forgets the conv state of its predecessors
    real = ops.causal_conv1d
    monkeypatch.setattr(
        ops, "causal_conv1d", lambda x, w, s: real(x, w, np.zeros_like(s) if x.shape[0] == 1 else s)
    )
    _, c = _generation(d, True)
    tc = as_dict(c)
    assert not all(same(ta[n], tc[n]) for n in ta if n.startswith("decode."))


# ---- the layer verb (Q35 isolation: zero state at position 0) -----------------------------------


def _trace(d, out, *extra):
    toks = ",".join(map(str, TOKENS))
    assert (
        main(
            [
                "trace",
                "--model",
                d,
                "--tokens",
                toks,
                "--out",
                out,
                "--capture",
                "internals",
                *extra,
            ]
        )
        == 0
    )
    return tracegate.Trace(out)


def _layer_verb(d, src, i, name, out, *extra):
    """The `layer` verb on layer i of model d, input tensor `name` of trace `src`; exit code."""
    return main(
        ["layer", "--model", d, "--layer", str(i), "--input", src, "--input-name", name]
        + ["--out", out, *extra]
    )


def test_layer_verb_on_both_kinds_and_decode_from(dense, tmp_path, capsys):
    src = str(tmp_path / "whole.trace")
    whole = _trace(dense, src, "--generate", "2")
    for i in (0, 1):  # linear, full
        out = str(tmp_path / f"l{i}.trace")
        assert (
            _layer_verb(dense, src, i, f"layer.{i:02d}.hidden_in", out, "--capture", "internals")
            == 0
        )
        one = tracegate.Trace(out)
        mine = [n for n in one.names if n.startswith(f"layer.{i:02d}.")]
        assert len(mine) == (12 if i == 0 else 9)  # every point of the layer, hidden_in included
        assert all(same(np.asarray(one[n]), np.asarray(whole[n])) for n in mine)
        out = str(tmp_path / f"d{i}.trace")
        assert (
            _layer_verb(dense, src, i, f"layer.{i:02d}.hidden_in", out, "--decode-from", "4") == 0
        )
        h = f"layer.{i:02d}.hidden_out"
        assert same(np.asarray(tracegate.Trace(out)[h]), np.asarray(whole[h])[4:])
    # a decode step's row is at position len(TOKENS): a linear layer cannot start there
    capsys.readouterr()
    rc = _layer_verb(dense, src, 0, "decode.0001.layer.00.hidden_in", str(tmp_path / "x"))
    err = capsys.readouterr().err
    assert rc == 2 and "positions 0..0" in err and f"at position {len(TOKENS)}" in err
    # negative control: the full-attention layer takes the same row at its own position
    assert _layer_verb(dense, src, 1, "decode.0001.layer.01.hidden_in", str(tmp_path / "y")) == 0


# ---- layouts and unused tensors (§20) ----------------------------------------------------------


@pytest.mark.parametrize("moe_family", [False, True])
def test_text_and_multimodal_layouts_give_the_same_trace(moe_family, tmp_path):
    c = config(moe=moe_family)
    t = tensors(c, seed=4)
    text = write(tmp_path / "text", c, t)
    mm = write(tmp_path / "mm", *multimodal(c, t))
    a = _trace(text, str(tmp_path / "a.trace"), "--generate", "2")
    b = _trace(mm, str(tmp_path / "b.trace"), "--generate", "2")
    # the content digest covers every tensor, decision and margin, not the provenance
    assert a.digest == b.digest and "layer.00.linear.state" in a.names
    pa, pb = a.provenance, b.provenance
    assert "unused_tensors" not in pa
    assert pb["unused_tensors"] == {"model.visual.": 2, "mtp.": 3}
    assert pa["weights_digest"] != pb["weights_digest"]
    # negative control: a tensor under no known prefix is refused, not listed
    mc, mt = multimodal(c, t)
    mt["model.audio.weight"] = ("F32", np.zeros(2, np.float32))
    with pytest.raises(ContractError, match="unclaimed tensor model.audio.weight"):
        open_model(write(tmp_path / "bad", mc, mt))


def test_fused_and_per_expert_tensors_compute_the_same(tmp_path):
    c = config(moe=True)
    per = tensors(c, seed=2, fused=True)
    split = dict(per)
    for i in range(c["num_hidden_layers"]):
        m = f"model.layers.{i}.mlp.experts"
        _, gu = split.pop(f"{m}.gate_up_proj")
        _, dn = split.pop(f"{m}.down_proj")
        I = c["moe_intermediate_size"]
        for e in range(c["num_experts"]):
            split[f"{m}.{e}.gate_proj.weight"] = ("F32", gu[e, :I].copy())
            split[f"{m}.{e}.up_proj.weight"] = ("F32", gu[e, I:].copy())
            split[f"{m}.{e}.down_proj.weight"] = ("F32", dn[e].copy())
    a, _ = caps(open_model(write(tmp_path / "f", c, per)))
    b, _ = caps(open_model(write(tmp_path / "s", c, split)))
    ta, tb = as_dict(a), as_dict(b)
    assert all(same(ta[n], tb[n]) for n in ta)


# ---- against transformers (fp32 eager, its torch fallbacks) -------------------------------------

TOL = 1e-4  # max |contract − transformers| on logits and every layer's output (tiny models)


def _transformers_run(d, tokens, generate):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = json.load(open(os.path.join(d, "config.json")))
    cls = (
        transformers.AutoModelForImageTextToText
        if "text_config" in cfg
        else transformers.AutoModelForCausalLM
    )
    m = cls.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    ids = torch.tensor([tokens])
    with torch.no_grad():
        o = m(ids, output_hidden_states=True)
        g = m.generate(ids, max_new_tokens=generate, do_sample=False, pad_token_id=0)
    hidden = [h[0].numpy() for h in o.hidden_states[1:-1]]  # the last one is after the norm
    return o.logits[0].numpy(), hidden, g[0, len(tokens) :].tolist()


def _max_diff(m, logits, hidden):
    t = as_dict(caps(m)[0])
    diffs = [np.abs(t["logits"] - logits).max()]
    diffs += [np.abs(t[f"layer.{i:02d}.hidden_out"] - h).max() for i, h in enumerate(hidden)]
    return max(diffs)


# The random MoE checkpoint is left out here (the MoE fixture covers the family); the random
# dense one adds the attention biases the fixtures do not have.
@pytest.mark.parametrize("which", ["dense", *FIXTURES])
def test_contract_agrees_with_transformers(which, request):
    d = _model_dir(which, request)
    m = open_model(d)
    logits, hidden, tokens = _transformers_run(d, TOKENS, 8)
    assert _max_diff(m, logits, hidden) <= TOL
    # greedy decoding: transformers' recurrent decode path against the cached contract
    assert m.run(TOKENS, Capture(), generate=8) == tokens
    # negative control: the contract without the 1/√dk query scale of §18.3
    for layer in m.layers:
        if isinstance(layer.mixer, mixers.GatedDeltaNet):
            layer.mixer.scale_k = np.float32(1.0)
    assert _max_diff(m, logits, hidden) > 100 * TOL


# ---- §16 odd rotary dims: transformers' rounding up, engine ≡ contract ---------------------------


@pytest.mark.parametrize("which", list(ODD_ROTARY))
def test_odd_rotary_dim_agrees_with_transformers(which, request):
    d = _model_dir(which, request)
    m = open_model(d)
    o = ODD_ROTARY[which]
    assert (m.cfg.head_dim, m.cfg.rotary_dim) == (o["head_dim"], 3)
    logits, hidden, tokens = _transformers_run(d, TOKENS, 8)
    assert _max_diff(m, logits, hidden) <= TOL
    assert m.run(TOKENS, Capture(), generate=8) == tokens
    # negative controls, the rotary width off by one either way: the floor (one frequency, dims
    # 0 and 1 rotate, 3 passes) and the rounded-up width 4 in the exponent's denominator
    theta, hd = m.cfg.rope_theta, m.cfg.head_dim
    for wrong in (2, 4):
        m.rope = ops.Rope(theta, hd, wrong)
        assert _max_diff(m, logits, hidden) > 100 * TOL, f"rotary dim {wrong} not caught"


@pytest.mark.parametrize("which", list(ODD_ROTARY))
def test_odd_rotary_dim_engine_equals_contract(which, request, tmp_path):
    """Bit for bit, prefill with internals and 5 cached decode steps; a contract planted with the
    floor rule (one frequency fewer) diverges first at the first full-attention layer's q."""
    if _NO_ENGINE:
        pytest.skip(f"NOT CHECKED (engine ≡ contract, odd rotary dim): {_NO_ENGINE}")
    from test_engine_identity import contract_trace, differences, engine_trace, planted_copy

    d = _model_dir(which, request)
    e = engine_trace(d, TOKENS, str(tmp_path / "e.trace"), "internals", 5, "on")
    c = contract_trace(d, TOKENS, str(tmp_path / "c.trace"), "internals", 5, "on")
    diff = differences(e, c)
    assert not diff, "\n".join(diff[:3])
    assert "layer.01.q" in tracegate.Trace(e).names  # layer 1 is the first full-attention one
    root = planted_copy(
        tmp_path, "ops.py", "for i in range((d + 1) // 2)]", "for i in range(d // 2)]"
    )
    bad = contract_trace(d, TOKENS, str(tmp_path / "bad.trace"), "internals", 5, "on", root)
    diff = differences(e, bad, "engine", "planted contract")
    assert diff and diff[0].startswith("layer.01.q:"), diff[:1]


# ---- the engine refuses the same configs (when it runs the Qwen3.5 families) --------------------


@pytest.mark.parametrize(
    "field,cfg",
    [(f, e(config())) for f, e in REFUSALS]
    + [(f, config(moe=True, **over)) for f, over in MOE_REFUSALS],
)
def test_engine_refuses_the_same_configs_naming_the_field(field, cfg, tmp_path, capsys):
    if _NO_ENGINE:
        pytest.skip(f"NOT CHECKED (engine refusals): {_NO_ENGINE}")
    base = config(moe="num_experts" in cfg)
    ok = write(tmp_path / "ok", base, tensors(base))
    r = subprocess.run(
        [ENGINE, "trace", "--model", ok, "--tokens", "1,2", "--out", str(tmp_path / "ok.trace")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if r.returncode != 0 and "model_type" in r.stderr:
        pytest.skip(
            f"NOT CHECKED: this engine does not run {base['model_type']}: {r.stderr.strip()}"
        )
    assert r.returncode == 0, r.stderr  # negative control: the unedited config runs
    d = write(tmp_path / "m", cfg, tensors(base))
    both_refuse_trace(capsys, tmp_path, d, field.rpartition(".")[2])
