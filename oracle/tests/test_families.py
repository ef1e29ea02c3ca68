"""The oracle on every family of its table (docs/capture-points.md), on tiny seeded checkpoints
generated here from transformers' own config classes (no network, nothing committed).

Expected names, masks and shapes are written out below from the modeling files, not derived from
the oracle's table; decisions are checked against what transformers' own modules returned.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
from oracle_runner import run_oracle

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from tracegate_oracle.errors import OracleError  # noqa: E402
from tracegate_oracle.families import FAMILIES, resolve  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

H, V, T, W = 32, 128, 9, 4  # hidden, vocab, prompt length, sliding window (< T, so it matters)
BASE = dict(
    vocab_size=V,
    hidden_size=H,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.2,
)
MOE = dict(num_experts_per_tok=2)

# family: (config class, extra config, expected mask per layer, MoE layers, tied head)
CASES = {
    "llama": ("LlamaConfig", {}, ["causal"] * 3, [], False),
    "mistral": ("MistralConfig", {"sliding_window": W}, [f"sliding:{W}"] * 3, [], False),
    "qwen2": (
        "Qwen2Config",
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
        ["causal", f"sliding:{W}", f"sliding:{W}"],
        [],
        False,
    ),
    "qwen3": (
        "Qwen3Config",
        {"use_sliding_window": True, "sliding_window": W, "max_window_layers": 1},
        ["causal", f"sliding:{W}", f"sliding:{W}"],
        [],
        False,
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {**MOE, "num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": [0]},
        ["causal"] * 3,
        [1, 2],
        False,
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "sliding_window": W,
            "query_pre_attn_scalar": 8,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
            "final_logit_softcapping": 3.0,
            "attn_logit_softcapping": 5.0,
        },
        [f"sliding:{W}", f"sliding:{W}", "causal"],
        [],
        True,
    ),
    "olmo2": ("Olmo2Config", {}, ["causal"] * 3, [], False),
    "phi3": ("Phi3Config", {}, ["causal"] * 3, [], False),
    "mixtral": ("MixtralConfig", {**MOE, "num_local_experts": 4}, ["causal"] * 3, [0, 1, 2], False),
    "olmoe": ("OlmoeConfig", {**MOE, "num_experts": 4}, ["causal"] * 3, [0, 1, 2], False),
}
FAMS = sorted(CASES)
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, V, T)]
RC = cp.RunConfig()


def make_checkpoint(fam: str, d: Path) -> Path:
    cls, extra, *_ = CASES[fam]
    cfg = getattr(transformers, cls)(**{**BASE, **extra})
    torch.manual_seed(1234)  # the checkpoint is a function of the family and this seed
    m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    m.save_pretrained(d, safe_serialization=True)
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    cp.setup_torch(RC)
    base = tmp_path_factory.mktemp("families")
    return {f: make_checkpoint(f, base / f) for f in FAMS}


@pytest.fixture(scope="module")
def runs(ckpts):
    """(model, capture, router outputs seen by the test's own hooks) per family."""
    out = {}
    for f in FAMS:
        model = cp.load_model(ckpts[f], RC)
        lay = resolve(model)
        seen, hs = {}, []
        for L in lay.moe_layers:
            hs.append(
                lay.router(L).register_forward_hook(
                    lambda mod, a, o, L=L, seen=seen: seen.__setitem__(L, o)
                )
            )
        try:
            cap = cp.capture_prompt(model, ckpts[f], TOKENS, RC)
        finally:
            for h in hs:
                h.remove()
        with torch.no_grad():
            logits = model(torch.tensor([TOKENS])).logits[0].numpy()
        out[f] = (model, cap, seen, logits)
    return out


# The hybrid Qwen3.5 families (linear-attention layers, no q/k/v there) are tested on the
# committed fixtures and conversions of them in test_qwen3_5.py.
QWEN3_5 = ["qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_5_text"]


def test_table_lists_the_supported_families():
    # diffusion_gemma: its own capture (test_diffusion_gemma_oracle.py)
    assert sorted(FAMILIES) == sorted(FAMS + QWEN3_5 + ["diffusion_gemma"])


@pytest.mark.parametrize("fam", FAMS)
def test_trace_names_shapes_masks(runs, fam):
    _, cap, _, _ = runs[fam]
    masks = CASES[fam][2]
    want = ["embed.out"]
    for L in range(3):
        want += [f"layer.{L:02d}.{p}" for p in ("hidden_in", "attn_out", "mlp_out", "hidden_out")]
    want += ["final_norm.out", "logits"]
    assert cap.names == want
    for r in cap.tensors:
        assert r.array.shape == ((T, V) if r.name == "logits" else (T, H)), r.name
        assert r.attrs["positions"] == list(range(T)) and r.attrs["path"] == "prefill"
        L = int(r.name.split(".")[1]) if r.name.startswith("layer.") else None
        assert r.attrs["mask"] == ("causal" if L is None else masks[L]), r.name
    assert cap.provenance["family"]["masks"] == masks


@pytest.mark.parametrize("fam", FAMS)
def test_decisions_are_the_models_own(runs, fam):
    """logits.argmax from the model's returned logits (after any softcap); router top-k equal to
    the indices the family's own router module returned, with margins from its own logits."""
    model, cap, seen, logits = runs[fam]
    np.testing.assert_array_equal(cap["logits"].array, logits)
    d = cap.decision("logits.argmax")
    np.testing.assert_array_equal(d.values, logits.argmax(-1))
    top2 = np.sort(logits, -1)[:, ::-1]
    np.testing.assert_allclose(d.margins, top2[:, 0] - top2[:, 1], rtol=0, atol=0)
    moe = CASES[fam][3]
    assert sorted(seen) == moe
    assert sorted(n for n in (x.name for x in cap.decisions) if "router" in n) == [
        f"layer.{L:02d}.router.topk" for L in moe
    ]
    for L in moe:
        rl, _, idx = seen[L]
        dec = cap.decision(f"layer.{L:02d}.router.topk")
        assert dec.values.shape == (T, 2) and dec.margins.shape == (T,)
        np.testing.assert_array_equal(np.sort(dec.values, -1), np.sort(idx.numpy(), -1))
        p = np.sort(torch.softmax(rl.float(), -1).numpy(), -1)[:, ::-1]
        np.testing.assert_allclose(dec.margins, p[:, 1] - p[:, 2], rtol=0, atol=1e-7)


@pytest.mark.parametrize("fam", FAMS)
def test_internals_capture_every_family(ckpts, runs, fam):
    """--capture internals: q/k/v/attn_probs per layer, router logits and per-expert outputs in
    MoE layers; the default points unchanged by the extra hooks."""
    model, cap, _, _ = runs[fam]
    rc = cp.RunConfig(capture="internals")
    full = cp.capture_prompt(model, ckpts[fam], TOKENS, rc)
    for L in range(3):
        p = f"layer.{L:02d}"
        assert full[f"{p}.q"].array.shape == (T, 4, 8) and full[f"{p}.k"].array.shape == (T, 2, 8)
        assert full[f"{p}.attn_probs"].array.shape == (4, T, T)
        probs = full[f"{p}.attn_probs"].array
        np.testing.assert_allclose(probs.sum(-1), 1, rtol=1e-5)
        if CASES[fam][2][L].startswith("sliding"):  # no weight beyond the window
            assert probs[:, T - 1, : T - W].max() == 0
        if L in CASES[fam][3]:
            assert full[f"{p}.router.logits"].array.shape == (T, 4)
            assert any(n.startswith(f"{p}.expert.") for n in full.names)
    for r in cap.tensors:
        np.testing.assert_array_equal(full[r.name].array, r.array)


@pytest.mark.parametrize("fam", FAMS)
def test_residual_sum_holds_except_where_documented(runs, fam):
    """docs/capture-points.md: hidden_out = (hidden_in + attn_out) + mlp_out (IEEE f32 adds, as the
    layer does them), except in gemma3 and olmo2, whose post-norms come after attn_out/mlp_out."""
    cap = runs[fam][1]
    for L in range(3):
        p = f"layer.{L:02d}"
        s = (cap[f"{p}.hidden_in"].array + cap[f"{p}.attn_out"].array) + cap[f"{p}.mlp_out"].array
        assert np.array_equal(s, cap[f"{p}.hidden_out"].array) is (
            fam not in ("gemma3_text", "olmo2")
        ), (fam, L)


def test_family_differences_are_in_provenance(runs):
    g = runs["gemma3_text"][1].provenance["family"]
    assert g["final_logit_softcapping"] == 3.0 and g["attn_logit_softcapping"] == 5.0
    assert g["embed_scale"] == pytest.approx(H**0.5) and g["tied_head"] is True
    assert g["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    for f in FAMS:
        fam = runs[f][1].provenance["family"]
        assert fam["family"] == f and fam["tied_head"] is CASES[f][4], f
        assert ("embed_scale" in fam) is (f == "gemma3_text"), f
    assert runs["mistral"][1].provenance["family"]["sliding_window"] == W
    assert runs["olmoe"][1].provenance["family"]["moe_layers"] == [0, 1, 2]


@pytest.mark.parametrize("fam", FAMS)
def test_layer_reproduces_the_whole_run_bit_for_bit(ckpts, runs, fam):
    model, cap, _, _ = runs[fam]
    x = cap["layer.01.hidden_in"].array
    one = cp.capture_layer(model, ckpts[fam], 1, x, list(range(T)), RC)
    assert one.names == [
        f"layer.01.{p}" for p in ("hidden_in", "attn_out", "mlp_out", "hidden_out")
    ]
    assert one["layer.01.hidden_out"].attrs["mask"] == CASES[fam][2][1]
    np.testing.assert_array_equal(
        one["layer.01.hidden_out"].array, cap["layer.01.hidden_out"].array
    )


@pytest.mark.parametrize("fam", ["gemma3_text", "qwen3", "mistral"])
def test_negative_control_wrong_mask_or_rope_changes_the_layer(runs, fam):
    """The bit-for-bit check above can fail: layer 1 run with a causal mask (instead of its
    window), or for Gemma with the global RoPE table (instead of the local one), differs."""
    from transformers import masking_utils as mu

    model, cap, _, _ = runs[fam]
    lay = resolve(model)
    x = torch.from_numpy(cap["layer.01.hidden_in"].array.copy())[None]
    pos = torch.arange(T)[None]
    good = cap["layer.01.hidden_out"].array
    causal = mu.create_causal_mask(
        config=model.config,
        inputs_embeds=x,
        attention_mask=None,
        past_key_values=None,
        position_ids=pos,
    )
    with torch.no_grad():
        out = lay.layers[1](
            x, attention_mask=causal, position_ids=pos, position_embeddings=lay.rope(x, pos, 1)
        )
        assert not np.array_equal((out[0] if isinstance(out, tuple) else out)[0].numpy(), good)
        if fam == "gemma3_text":
            sliding = cp.layer_mask(model, 1, x, pos)
            pe = lay.rotary(x, pos, "full_attention")
            out = lay.layers[1](x, attention_mask=sliding, position_ids=pos, position_embeddings=pe)
            assert not np.array_equal(out[0].numpy(), good)


# bf16 against f32 of the same model. No bf16 policy exists yet; oracle-default's 1e-4 relative L2
# is an fp32-vs-fp32 bound. Allowance: bf16 keeps 8 mantissa bits (unit roundoff 2^-9 ~ 2e-3) and
# each capture point rounds a few dozen times through 3 layers: 5e-2 relative L2 per tensor
# (~25 roundoffs; measured worst ~2.6e-2, printed). A decision may flip only where its f32 margin is
# within that allowance of the row's scale; from the first flip on, rows route to other experts
# (or decode differs) and tensors are no longer comparable, so comparison stops there (counted).
BF16_MAX_REL_L2 = 5e-2


def _first_flip(c32, c16):
    """(name of the first tensor a flipped decision feeds, or None); asserts every flip is a near tie."""
    first = None
    for d32 in c32.decisions:
        d16 = c16.decision(d32.name)
        v32, v16 = d32.values.reshape(len(d32.values), -1), d16.values.reshape(len(d16.values), -1)
        rows = np.nonzero((np.sort(v32, -1) != np.sort(v16, -1)).any(-1))[0]
        if not len(rows):
            continue
        scale = 1.0 if "router" in d32.name else np.abs(c32["logits"].array[rows]).max(-1)
        assert (d32.margins[rows] < BF16_MAX_REL_L2 * scale).all(), (
            d32.name,
            rows,
            d32.margins[rows],
        )
        fed = d32.name.replace("router.topk", "mlp_out") if "router" in d32.name else "logits"
        first = first or fed
    return first


def test_bf16_within_allowance_of_f32(ckpts, runs):
    rc16 = cp.RunConfig(dtype="bf16")
    worst, compared = {}, {}
    for f in FAMS:
        c16 = cp.capture_prompt(cp.load_model(ckpts[f], rc16), ckpts[f], TOKENS, rc16)
        c32 = runs[f][1]
        assert c16.names == c32.names
        stop = _first_flip(c32, c16)
        n = 0
        for r in c16.tensors:
            assert r.dtype == "bf16"
            if r.name == stop:
                break
            x16 = (r.array.astype(np.uint32) << 16).view(np.float32)
            x32 = c32[r.name].array
            e = float(np.linalg.norm(x16 - x32) / np.linalg.norm(x32))
            n += 1
            if e > worst.get(f, (0, ""))[0]:
                worst[f] = (e, r.name)
        compared[f] = f"{n}/{len(c16.tensors)}" + (f" (stopped at {stop})" if stop else "")
    print("bf16 vs f32 worst rel L2:", {f: f"{e:.2e} {n}" for f, (e, n) in worst.items()})
    print("tensors compared:", compared)
    assert all(0 < e < BF16_MAX_REL_L2 for e, _ in worst.values()), worst
    assert all(int(c.split("/")[0]) >= 5 for c in compared.values()), compared


def test_bf16_check_catches_a_planted_error(ckpts, runs):
    """Negative control: a bf16 run of a checkpoint with one layer's weight scaled by 1.1 is
    outside the allowance."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = ckpts["llama"].parent / "llama-planted"
    shutil.copytree(ckpts["llama"], d)
    w = load_file(d / "model.safetensors")
    w["model.layers.1.mlp.down_proj.weight"] *= 1.1
    save_file(w, d / "model.safetensors", metadata={"format": "pt"})
    rc16 = cp.RunConfig(dtype="bf16")
    c16 = cp.capture_prompt(cp.load_model(d, rc16), d, TOKENS, rc16)
    r = c16["layer.01.mlp_out"]
    x16 = (r.array.astype(np.uint32) << 16).view(np.float32)
    x32 = runs["llama"][1]["layer.01.mlp_out"].array
    assert np.linalg.norm(x16 - x32) / np.linalg.norm(x32) > BF16_MAX_REL_L2


# ----------------------------------------------------------------------------------- refusals


def test_family_not_in_table_refused_one_line(runs):
    model = runs["llama"][0]
    model.config.model_type = "gpt_neox"
    try:
        with pytest.raises(OracleError) as e:
            resolve(model)
    finally:
        model.config.model_type = "llama"
    assert "model_type 'gpt_neox'" in str(e.value) and "\n" not in str(e.value)


def test_load_refuses_a_family_not_in_the_table(tmp_path):
    """Through load_model (what both verbs call): a real GPT-2 checkpoint loads in transformers
    but is not in the table, so it is refused in one line naming its model_type."""
    cfg = transformers.GPT2Config(vocab_size=V, n_embd=H, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(
        tmp_path, safe_serialization=True
    )
    with pytest.raises(OracleError) as e:
        cp.load_model(tmp_path, RC)
    msg = str(e.value)
    assert (
        "model_type 'gpt2' (GPT2LMHeadModel) is not in the oracle's family table" in msg
        and "\n" not in msg
    )


def test_structure_mismatch_refused_naming_the_module(runs):
    model = runs["olmo2"][0]
    layer = model.model.layers[2]
    norm = layer.post_feedforward_layernorm
    del layer.post_feedforward_layernorm
    try:
        with pytest.raises(
            OracleError, match=r"no norm \(model\.layers\.2\) module `post_feedforward_layernorm`"
        ):
            resolve(model)
    finally:
        layer.post_feedforward_layernorm = norm
    model = runs["mixtral"][0]
    moe = model.model.layers[1].mlp
    gate = moe.gate
    del moe.gate
    try:
        with pytest.raises(OracleError, match=r"no router `model\.layers\.1\.mlp\.gate`"):
            resolve(model)
    finally:
        moe.gate = gate
    assert resolve(model).moe_layers == [0, 1, 2]


def test_cli_layer_on_gemma3(ckpts, runs, tmp_path):
    """The reported failure: `layer` on Gemma 3 (its rotary module wants the layer type), through
    the CLI, on a whole-run trace written by the oracle's writer."""
    pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    import tracegate

    d = ckpts["gemma3_text"]
    whole, one = tmp_path / "w.trace", tmp_path / "l.trace"
    cp.write_trace(runs["gemma3_text"][1], whole)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    r = run_oracle(
        *["layer", "--model", d, "--out", one, "--layer", "1", "--input", whole],
        *["--input-name", "layer.01.hidden_in"],
        env=env,
    )
    assert r.returncode == 0, r.stderr
    a, b = tracegate.Trace(str(whole)), tracegate.Trace(str(one))
    assert b.attributes("layer.01.hidden_out")["mask"] == f"sliding:{W}"
    np.testing.assert_array_equal(
        np.asarray(a["layer.01.hidden_out"]), np.asarray(b["layer.01.hidden_out"])
    )


def test_engine_and_contract_point_exactly_the_table_to_the_oracle(tmp_path):
    """The bit-exact producers' refusal says "the oracle supports it" for exactly the families of
    the table (they read the capture-point registry's families, held equal to it by
    test_capture_registry.py), and not for one outside it."""
    import json

    from binaries import release_binary
    from tracegate_contract.config import parse_config
    from tracegate_contract.errors import ContractError
    from tracegate_oracle.families import FAMILIES

    engine, why = release_binary("engine")
    if why:
        pytest.skip(f"NOT CHECKED (engine refusal): {why}")
    base = json.loads((ROOT / "fixtures/tiny-qwen3/config.json").read_text())
    bit_exact = (
        "llama",
        "qwen2",
        "gemma3_text",
        "qwen3",
        "qwen3_moe",
        "qwen3_5",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_text",
    )
    for mt in [f for f in FAMS if f not in bit_exact] + ["gpt2"]:
        d = tmp_path / mt
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**base, "model_type": mt}))
        r = subprocess.run(
            [
                engine,
                "trace",
                "--model",
                str(d),
                "--tokens",
                "1,2",
                "--out",
                str(d / "x.trace"),
                "--capture",
                "default",
            ],
            capture_output=True,
            text=True,
        )
        with pytest.raises(ContractError) as e:
            parse_config({**base, "model_type": mt})
        for msg in (r.stderr.strip(), str(e.value)):
            assert f"{mt!r}" in msg.replace('"', "'") and "\n" not in msg, msg
            assert ("the oracle supports it" in msg) is (mt in FAMILIES), msg
        assert r.returncode == 2
