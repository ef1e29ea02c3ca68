"""The oracle on diffusion_gemma (docs/diffusion-gemma.md DG16, DG17, DG19), on the committed
fixture tiny-diffusion-gemma (4 layers sliding/full/sliding/full, W = 5, canvas 7, 6 denoising
steps, V = 509). Run from the repo root: .venv/bin/python -m pytest oracle/tests/test_diffusion_gemma_oracle.py

1. the hooks do not perturb the run: output tokens equal plain transformers' generate;
2. names, order, attributes and decision shapes are DG16's, built here from the spec's tables;
3. forcing (DG17): by its own trace, by an edited trace, refusals;
4. refusals of the command line and of configs the family refuses.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from oracle_runner import run_oracle

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from tracegate_oracle import diffusion_gemma as dg  # noqa: E402
from tracegate_oracle.force import Forcing  # noqa: E402

FIX = ROOT / "fixtures" / "tiny-diffusion-gemma"
PROMPT = [5, 17, 3, 99, 4, 8]  # n = 6 > W - 1: the decoder's sliding layers see a cut prefix
C, N_LAYERS, W, V, STEPS = 7, 4, 5, 509, 6
SLIDING = {0, 2}

LAYER_DEFAULT = ["hidden_in", "attn_out", "dense_mlp.branch", "moe.branch", "mlp_out", "hidden_out"]
LAYER_ALL = [
    "hidden_in", "q", "k", "v", "attn_probs", "attn_out", "attn_residual", "dense_mlp.out",
    "dense_mlp.branch", "router.logits", "EXPERTS", "moe.out", "moe.branch", "mlp_out", "hidden_out",
]  # fmt: skip


@pytest.fixture(scope="module")
def det():
    return cp.setup_torch(cp.RunConfig())


@pytest.fixture(scope="module")
def model(det):
    return cp.load_model(FIX, cp.RunConfig())


def run(model, det, tmp: Path, name="t.trace", forcing=None, given=None, **rc) -> tg.Trace:
    rc = {"generate": 14, **rc}
    cap = dg.capture(model, FIX, PROMPT, cp.RunConfig(**rc), det, given or {}, forcing)
    cp.write_trace(cap, tmp / name)
    return tg.Trace(str(tmp / name))


def plain_generate(model, seed: int, extra_draw: bool = False, **knobs) -> list[int]:
    """transformers' generate with no oracle hook anywhere (the fixture's generation_config)."""
    torch.manual_seed(seed)
    if extra_draw:
        torch.rand(1)
    out = model.generate(torch.tensor([PROMPT]), max_new_tokens=14, **knobs)
    return out.sequences[0, len(PROMPT) :].tolist()


def _untouched(model) -> list[str]:
    """What a capture could have left behind: hooks, shadowed methods, patched functions."""
    from transformers.models.diffusion_gemma import generation_diffusion_gemma as gen
    from transformers.models.diffusion_gemma import modeling_diffusion_gemma as mdg

    left = []
    for n, m in model.named_modules():
        if m._forward_hooks or m._forward_pre_hooks or "forward" in m.__dict__:
            left.append(n or "<model>")
    for attr in ("_denoising_step", "_prepare_sampler", "_finalize_canvas", "forward"):
        if attr in model.__dict__:
            left.append(attr)
    if gen.LinearTemperatureScheduleLogitsProcessor.__call__.__module__ != gen.__name__:
        left.append("LinearTemperatureScheduleLogitsProcessor.__call__")
    if mdg.eager_attention_forward.__module__ != mdg.__name__:
        left.append("eager_attention_forward")
    return left


# ----------------------------------------------------------------------------- 1. no perturbation


def test_hooks_do_not_perturb_the_generation(model, det, tmp_path):
    t = run(model, det, tmp_path, seed=3, capture="internals")
    assert t.provenance["output_tokens"] == plain_generate(model, 3)
    assert t.provenance["blocks"] == 2 and len(t.provenance["output_tokens"]) == 2 * C
    assert _untouched(model) == []
    # Negative controls: a hook left behind is seen; one draw more from the generator (what a hook consuming randomness would
    # do) changes the tokens, so the equality above sees a perturbed generator.
    assert plain_generate(model, 3, extra_draw=True) != plain_generate(model, 3)
    h = model.model.decoder.norm.register_forward_hook(lambda *a: None)
    try:
        assert _untouched(model) == ["model.decoder.norm"]
    finally:
        h.remove()


def test_knob_flags_reach_generate(model, det, tmp_path):
    given = {"max_denoising_steps": 3, "entropy_bound": 1.5, "t_max": 1.5, "t_min": 0.5}
    t = run(model, det, tmp_path, seed=1, given=given)
    plain = plain_generate(
        model,
        1,
        max_denoising_steps=3,
        sampler_config=dg_sampler(1.5),
        t_max=1.5,
        t_min=0.5,
    )
    assert t.provenance["output_tokens"] == plain
    g = t.provenance["generation"]
    assert (g["max_denoising_steps"], g["entropy_bound"], g["t_max"], g["t_min"]) == (
        3,
        1.5,
        1.5,
        0.5,
    )
    assert (g["stability_threshold"], g["confidence_threshold"]) == (1, 0.05)  # the checkpoint's
    assert g["canvas_length"] == C and g["max_new_tokens"] == 14 and g["eos_token_id"] is None
    assert max(int(n.split(".")[2]) for n in t.decisions if n.endswith(".stop")) <= 2
    # negative control: the checkpoint's own knobs give other tokens
    assert plain != plain_generate(model, 1)


def dg_sampler(bound: float):
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import (
        EntropyBoundSamplerConfig,
    )

    return EntropyBoundSamplerConfig(entropy_bound=bound)


def test_eos_ends_the_generation_and_pads(model, det, tmp_path):
    free = run(model, det, tmp_path, "free.trace", seed=0).provenance["output_tokens"]
    eos = free[2]
    t = run(model, det, tmp_path, seed=0, given={"eos_token_id": [eos], "pad_token_id": 0})
    out = t.provenance["output_tokens"]
    first = free.index(eos)
    assert t.provenance["blocks"] == 1 and out[: first + 1] == free[: first + 1]
    assert out[first + 1 :] == [0] * (C - first - 1)
    assert not [n for n in t.names if n.startswith("encode.")]  # no commit pass after the end
    assert t.decisions["denoise.0000.commit"].tolist() == free[:C]  # before padding (DG16)


# ------------------------------------------------------------------------- 2. names and attributes


def expected(t: tg.Trace, internals: bool) -> tuple[list[str], list[str]]:
    """DG16's tensor and decision names in order, for the blocks and steps the trace ran (its
    stop decisions) and the experts its router decisions chose."""
    n = len(PROMPT)
    dec = t.decisions

    def layers(prefix: str) -> list[str]:
        out = []
        for L in range(N_LAYERS):
            for p in LAYER_ALL if internals else LAYER_DEFAULT:
                if p == "EXPERTS":
                    chosen = sorted(
                        {int(e) for e in dec[f"{prefix}layer.{L:02d}.router.topk"].reshape(-1)}
                    )
                    out += [f"{prefix}layer.{L:02d}.expert.{e:03d}.out" for e in chosen]
                else:
                    out.append(f"{prefix}layer.{L:02d}.{p}")
        return out

    def topk(prefix: str) -> list[str]:
        return [f"{prefix}layer.{L:02d}.router.topk" for L in range(N_LAYERS)]

    blocks = t.provenance["blocks"]
    names, decisions = ["embed.out", *layers("")], topk("")
    for b in range(blocks):
        decisions.append(f"denoise.{b:04d}.init_canvas")
        steps = sum(1 for k in dec if k.startswith(f"denoise.{b:04d}.") and k.endswith(".stop"))
        assert 1 <= steps <= STEPS
        for s in range(steps):
            p = f"denoise.{b:04d}.{s:04d}."
            stop = dec[p + "stop"].tolist()
            assert stop[2] == (stop[0] and stop[1])  # AND (DG13.5)
            assert bool(stop[2]) == (s == steps - 1) or (s == STEPS - 1 and not stop[2])
            names += [p + "canvas", p + "embed.out", p + "sc.soft"]
            names += [p + "sc.mlp_out"] if internals else []
            names += [p + "sc.out", *layers(p), p + "final_norm.out"]
            names += [p + "logits.uncapped"] if internals else []
            names += [p + "logits", p + "logits.tempered", p + "entropy"]
            decisions += topk(p) + [
                p + d for d in ("argmax", "sampled", "accept", "renoise", "stop")
            ]
        decisions.append(f"denoise.{b:04d}.commit")
        if b + 1 < blocks:
            names += [f"encode.{b:04d}.embed.out", *layers(f"encode.{b:04d}.")]
            decisions += topk(f"encode.{b:04d}.")
    assert len(PROMPT) == n
    return names, decisions


def _attrs_expected(name: str) -> tuple[str, str, list[int]]:
    n = len(PROMPT)
    parts = name.split(".")
    layer = int(parts[parts.index("layer") + 1]) if "layer" in parts else None
    sliding = layer in SLIDING
    if parts[0] == "denoise":
        L = n + int(parts[1]) * C
        mask = f"bidirectional,sliding:{W}" if sliding else "bidirectional"
        return "denoise", mask, list(range(L, L + C))
    mask = f"sliding:{W}" if sliding else "causal"
    if parts[0] == "encode":
        L = n + int(parts[1]) * C
        return "encode", mask, list(range(L, L + C))
    return "encode", mask, list(range(n))


@pytest.mark.parametrize("capture", ["default", "internals"])
def test_names_order_attributes_and_decision_shapes(model, det, tmp_path, capture):
    t = run(model, det, tmp_path, seed=0, capture=capture)
    want_names, want_decisions = expected(t, capture == "internals")
    assert t.provenance["blocks"] == 2
    assert t.names == want_names
    assert list(t.decisions) == want_decisions
    # negative control: the other capture's names are not these
    assert expected(t, capture != "internals")[0] != t.names
    for name in t.names:
        path, mask, pos = _attrs_expected(name)
        a = t.attributes(name)
        assert (a["path"], a["mask"]) == (path, mask), name
        if ".expert." in name:
            assert set(a["positions"]) <= set(pos) and a["positions"] == sorted(a["positions"])
            assert len(a["positions"]) == t[name].shape[0]
        else:
            assert [int(p) for p in a["positions"]] == pos, name
            axis = 1 if name.endswith("attn_probs") else 0
            assert t[name].shape[axis] == len(pos), name
        want_dtype = "i64" if name.endswith(".canvas") else "f32"
        assert t.dtype(name) == want_dtype, name
    for name, v in t.decisions.items():
        m = t.margins[name]
        last = name.split(".")[-1]
        shape = {"stop": (3,), "topk": (None, 2)}.get(last, (C,))
        if last == "topk":
            assert v.shape[1] == 2 and v.shape[0] == (
                C if name.startswith(("denoise", "encode")) else len(PROMPT)
            )
        else:
            assert v.shape == shape, name
        assert (m is None) == (last in ("init_canvas", "renoise")), name
        if m is not None:
            assert m.shape == (v.shape[0],), name
    # DG6 key sets: the decoder's sliding layer reads the last W-1 cached rows, the full layer all
    if capture == "internals":
        L0 = len(PROMPT)
        assert t["denoise.0000.0000.layer.00.attn_probs"].shape == (4, C, W - 1 + C)
        assert t["denoise.0000.0000.layer.01.attn_probs"].shape == (4, C, L0 + C)
        # an encoder commit pass: every cached position, those outside each row's window +0.0
        p = np.asarray(t["encode.0000.layer.00.attn_probs"])
        assert p.shape == (4, C, L0 + C)
        for r in range(C):
            pos = L0 + r
            keys = np.arange(L0 + C)
            outside = (keys <= pos - W) | (keys > pos)
            assert (p[:, r, outside] == 0).all() and np.allclose(p[:, r].sum(-1), 1, atol=1e-5)


def test_internals_adds_exactly_the_internal_points(model, det, tmp_path):
    d = run(model, det, tmp_path, "d.trace", seed=0)
    i = run(model, det, tmp_path, "i.trace", seed=0, capture="internals")
    extra = [n for n in i.names if n not in set(d.names)]
    assert [n for n in i.names if n in set(d.names)] == d.names
    points = {point(n) for n in extra}
    assert points == {
        "q", "k", "v", "attn_probs", "attn_residual", "dense_mlp.out", "router.logits",
        "expert.out", "moe.out", "sc.mlp_out", "logits.uncapped",
    }  # fmt: skip
    assert d.provenance["output_tokens"] == i.provenance["output_tokens"]
    for n in d.names:
        assert np.array_equal(np.asarray(d[n]), np.asarray(i[n])), n


def point(name: str) -> str:
    """`name` without its pass, layer and expert numbers: `expert.out`, `router.logits`, ..."""
    rest = re.sub(r"^(denoise\.\d{4}\.\d{4}\.|encode\.\d{4}\.)?(layer\.\d{2}\.)?", "", name)
    return re.sub(r"^expert\.\d{3}\.", "expert.", rest)


def test_bf16_stores_bf16(det, tmp_path):
    m16 = cp.load_model(FIX, cp.RunConfig(dtype="bf16"))
    t = run(m16, det, tmp_path, seed=0, dtype="bf16", capture="internals", generate=7)
    f32 = {
        "logits",
        "logits.tempered",
        "entropy",
    }  # transformers computes these in f32 (DG11, DG12)
    for n in t.names:
        want = "i64" if point(n) == "canvas" else ("f32" if point(n) in f32 else "bf16")
        assert t.dtype(n) == want, n
    assert t.provenance["dtype"] == "bf16" and t.provenance["blocks"] == 1
    torch.manual_seed(0)  # the hooks do not perturb a bf16 run either
    plain = m16.generate(torch.tensor([PROMPT]), max_new_tokens=7).sequences[0, len(PROMPT) :]
    assert t.provenance["output_tokens"] == plain.tolist()


def test_generate_zero_is_the_prompt_pass_alone(model, det, tmp_path):
    t = run(model, det, tmp_path, seed=0, generate=0)
    names, decisions = expected(t, False)
    assert t.provenance["blocks"] == 0 and t.provenance["output_tokens"] == []
    assert t.names == names and list(t.decisions) == decisions
    full = run(model, det, tmp_path, "full.trace", seed=0)
    for n in t.names:  # the same prompt pass as generate's
        assert np.array_equal(np.asarray(t[n]), np.asarray(full[n])), n


# --------------------------------------------------------------------------------- 3. forcing


def altered(
    src: tg.Trace, out: Path, edit=None, drop: str | None = None, provenance=None
) -> Forcing:
    """A copy of `src`, decisions edited by `edit(name, values)` (in place) and `drop` left out."""
    with tg.TraceWriter(str(out), provenance or src.provenance) as w:
        for n in src.names:
            w.tensor(
                n,
                np.array(src[n]),
                dtype=src.dtype(n) if src.dtype(n) == "bf16" else None,
                **src.attributes(n),
            )
        for n, v in src.decisions.items():
            if n == drop:
                continue
            v = np.array(v)
            if edit:
                edit(n, v)
            w.decision(n, v, margins=src.margins[n])
    return Forcing(str(out))


def test_forced_by_its_own_trace_reproduces_it(model, det, tmp_path):
    ref = run(model, det, tmp_path, "ref.trace", seed=0)
    # another seed: every draw must come from the trace
    f = run(model, det, tmp_path, "f.trace", seed=11, forcing=Forcing(str(tmp_path / "ref.trace")))
    assert f.provenance["output_tokens"] == ref.provenance["output_tokens"]
    assert list(f.decisions) == list(ref.decisions)
    for n, v in ref.decisions.items():
        assert np.array_equal(f.decisions[n], v), n
        m = ref.margins[n]
        assert (m is None and f.margins[n] is None) or np.array_equal(f.margins[n], m), n
    assert f.names == ref.names
    for n in ref.names:
        assert np.array_equal(np.asarray(f[n]), np.asarray(ref[n])), n
    fd = f.provenance["forced_decisions"]
    assert fd["rows_overridden"] == 0 and fd["trace_digest"] == ref.digest
    assert f.attributes(f.names[-1])["forced"] == ref.digest
    # negative control: unforced, that seed is another run
    other = run(model, det, tmp_path, "o.trace", seed=11)
    assert other.provenance["output_tokens"] != ref.provenance["output_tokens"]


def test_forced_sampled_token_becomes_the_next_canvas(model, det, tmp_path):
    ref = run(model, det, tmp_path, "ref.trace", seed=0)
    acc = ref.decisions["denoise.0000.0000.accept"]
    r = int(np.nonzero(acc == 1)[0][0])
    old = int(ref.decisions["denoise.0000.0000.sampled"][r])
    new = (old + 1) % V

    def edit(n, v):
        if n == "denoise.0000.0000.sampled":
            v[r] = new

    forcing = altered(ref, tmp_path / "edited.trace", edit)
    f = run(model, det, tmp_path, "f.trace", seed=0, forcing=forcing)
    canvas = np.asarray(f["denoise.0000.0001.canvas"])
    assert canvas[r] == new and np.asarray(ref["denoise.0000.0001.canvas"])[r] == old
    assert f.decisions["denoise.0000.0000.sampled"][r] == new
    # its own margin: its own probability of the forced token (DG17), not REF's
    lt = np.asarray(f["denoise.0000.0000.logits.tempered"], dtype=np.float64)[r]
    p = np.exp(lt - lt.max())
    p /= p.sum()
    assert f.margins["denoise.0000.0000.sampled"][r] == pytest.approx(p[new], rel=1e-4)
    assert f.margins["denoise.0000.0000.sampled"][r] != ref.margins["denoise.0000.0000.sampled"][r]
    # later steps follow the new canvas (REF's later decisions still forced)
    assert not np.array_equal(
        np.asarray(f["denoise.0000.0001.embed.out"]), np.asarray(ref["denoise.0000.0001.embed.out"])
    )


def test_forced_init_canvas_is_the_first_canvas(model, det, tmp_path):
    ref = run(model, det, tmp_path, "ref.trace", seed=0)
    init = ref.decisions["denoise.0000.init_canvas"].copy()
    init[0] = (init[0] + 7) % V

    def edit(n, v):
        if n == "denoise.0000.init_canvas":
            v[:] = init

    f = run(
        model, det, tmp_path, "f.trace", seed=0, forcing=altered(ref, tmp_path / "e.trace", edit)
    )
    assert np.asarray(f["denoise.0000.0000.canvas"]).tolist() == init.tolist()
    assert f.decisions["denoise.0000.init_canvas"].tolist() == init.tolist()
    assert not np.array_equal(
        np.asarray(f["denoise.0000.0000.embed.out"]), np.asarray(ref["denoise.0000.0000.embed.out"])
    )


def test_forced_accept_changes_the_next_canvas_and_margins_go_negative(model, det, tmp_path):
    ref = run(model, det, tmp_path, "ref.trace", seed=0)
    acc = ref.decisions["denoise.0000.0000.accept"]
    r = int(np.nonzero(acc == 0)[0][0])  # not accepted: force it accepted, with its sampled token
    sampled = int(ref.decisions["denoise.0000.0000.sampled"][r])

    def edit(n, v):
        if n == "denoise.0000.0000.accept":
            v[r] = 1
        if n == "denoise.0000.0000.renoise":
            v[r] = -1

    f = run(
        model, det, tmp_path, "f.trace", seed=0, forcing=altered(ref, tmp_path / "e.trace", edit)
    )
    assert np.asarray(f["denoise.0000.0001.canvas"])[r] == sampled
    assert (
        f.margins["denoise.0000.0000.accept"][r] == -ref.margins["denoise.0000.0000.accept"][r] < 0
    )
    over = f.provenance["forced_decisions"]["overridden"]
    # later steps see another canvas: their decisions may differ too
    assert over["denoise.0000.0000.accept"] == 1
    assert f.provenance["forced_decisions"]["overridden_rows"]["denoise.0000.0000.accept"] == [r]
    assert not [n for n in over if n.startswith("denoise.0000.0000.") and not n.endswith("accept")]


@pytest.mark.parametrize(
    "what, match",
    [
        ("drop", "decision denoise.0000.0002.accept is missing"),
        ("prompt", "prompt_tokens"),
        ("commit", "decision denoise.0000.commit is"),
        ("renoise", "decision denoise.0000.0000.renoise row"),
    ],
)
def test_forcing_refusals(model, det, tmp_path, what, match):
    ref = run(model, det, tmp_path, "ref.trace", seed=0)
    prov = None
    edit = None
    if what == "prompt":
        prov = {**ref.provenance, "prompt_tokens": [5, 17, 3, 99, 4, 9]}
    if what == "commit":

        def edit(n, v):
            if n == "denoise.0000.commit":
                v[0] = (v[0] + 1) % V

    if what == "renoise":

        def edit(n, v):
            if n == "denoise.0000.0000.renoise":
                v[:] = -1  # renoised rows without a token

    forcing = altered(
        ref,
        tmp_path / "e.trace",
        edit,
        "denoise.0000.0002.accept" if what == "drop" else None,
        prov,
    )
    with pytest.raises(cp.OracleError, match=match):
        run(model, det, tmp_path, "f.trace", seed=0, forcing=forcing)
    assert _untouched(model) == []


# ------------------------------------------------------------------------------- 4. refusals


def _cli(*args, fresh=False):
    return run_oracle(*args, cwd=ROOT, timeout=120, fresh=fresh)


def _copy(tmp: Path, config=None, generation=None) -> Path:
    d = tmp / "model"
    d.mkdir()
    shutil.copy(FIX / "model.safetensors", d)
    cfg = json.loads((FIX / "config.json").read_text())
    gen = json.loads((FIX / "generation_config.json").read_text())
    if config:
        config(cfg)
    if generation:
        generation(gen)
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


def _set(where: str, key: str, value):
    def edit(cfg):
        (cfg["text_config"] if where == "text" else cfg)[key] = value

    return edit


@pytest.mark.parametrize(
    "argv, config, generation, msg",
    [
        (["--cache", "off"], None, None, "--cache off: not supported for diffusion_gemma"),
        (["--temperature", "1"], None, None, "unrecognized arguments: --temperature"),
        (["--t-max", "0.3"], None, None, "t_max = 0.3 (command line): must be > t_min = 0.4"),
        (["--entropy-bound", "0"], None, None, "entropy_bound = 0.0 (command line): must be > 0"),
        (["--denoising-steps", "0"], None, None, "max_denoising_steps = 0 (command line): not an"),
        (["--eos", "509"], None, None, "eos_token_id = [509] (command line): not a token id"),
        ([], _set("text", "use_bidirectional_attention", "all"), None, "use_bidirectional_attention"),
        ([], _set("text", "attention_bias", True), None, "attention_bias = True"),
        ([], _set("text", "hidden_activation", "gelu"), None, "hidden_activation = 'gelu'"),
        ([], _set("text", "top_k_experts", 6), None, "top_k_experts = 6"),
        ([], _set("text", "final_logit_softcapping", None), None, "final_logit_softcapping = None"),
        ([], None, _set("top", "max_length", 40), "max_length = 40"),
        ([], None, _set("top", "temperature", 1.0), "temperature is not a generation knob"),
        ([], None, _set("top", "cache_implementation", "static"), "cache_implementation = 'static'"),
    ],
    ids=[
        "cache-off", "unknown-flag", "t-order", "bound", "steps", "eos-range", "bidirectional",
        "bias", "activation", "top-k", "softcap", "max-length", "unknown-knob", "static-cache",
    ],
)  # fmt: skip
def test_refusals_exit_2_one_line(request, tmp_path, capsys, argv, config, generation, msg):
    model = _copy(tmp_path, config, generation) if config or generation else FIX
    out = tmp_path / "x.trace"
    args = ["trace", "--model", model, "--tokens", "5,17,3", "--generate", "7", "--out", out, *argv]
    if request.node.callspec.id in ("cache-off", "t-order"):
        # A fresh process, as a user runs it: one refused before torch loads, one after.
        r = _cli(*args, fresh=True)
        code, stderr = r.returncode, r.stderr
    else:
        # The same main() in this process (a fresh one costs torch's import each time).
        from tracegate_oracle import cli

        try:
            code = cli.main([str(x) for x in args])
        except SystemExit as e:  # argparse's usage errors
            code = e.code
        stderr = capsys.readouterr().err
    assert code == 2, (code, stderr)
    assert msg in stderr, stderr
    # one line (argparse's usage errors: its usage, then one error line)
    assert "Traceback" not in stderr and msg in stderr.strip().splitlines()[-1]
    assert stderr.startswith("usage:") or len(stderr.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize(
    "tensor",
    [
        "model.encoder.language_model.layers.2.layer_scalar",  # the encoder's own (DG9)
        "model.decoder.self_conditioning.up_proj.weight",
    ],
)
def test_missing_text_tensor_refused(det, tmp_path, tensor):
    from safetensors.torch import load_file, save_file

    d = _copy(tmp_path)
    weights = load_file(FIX / "model.safetensors")
    del weights[tensor]
    save_file(weights, d / "model.safetensors")
    with pytest.raises(cp.CheckpointError, match=f"missing_keys: {re.escape(tensor)}$"):
        cp.load_model(d, cp.RunConfig())


def test_knob_flags_refused_for_other_families_and_layer_verb_for_this_one(tmp_path):
    out = tmp_path / "x.trace"
    r = _cli(
        "trace",
        "--model",
        ROOT / "fixtures/tiny-qwen3",
        "--tokens",
        "5,17",
        "--out",
        out,
        "--entropy-bound",
        "0.5",
    )
    assert r.returncode == 2 and "--entropy-bound: a diffusion_gemma generation knob" in r.stderr, (
        r.stderr
    )
    r = _cli(
        "layer",
        "--model",
        FIX,
        "--layer",
        "0",
        "--input",
        out,
        "--input-name",
        "embed.out",
        "--out",
        out,
    )
    assert r.returncode == 2 and "layer: not supported for diffusion_gemma" in r.stderr, r.stderr
    assert not out.exists()


def test_causal_paths_refuse_the_family(model):
    with pytest.raises(cp.OracleError, match="generates by diffusion, not token by token"):
        cp.resolve(model)


def test_cli_trace_matches_in_process(model, det, tmp_path):
    out = tmp_path / "cli.trace"
    r = _cli(
        "trace",
        "--model",
        FIX,
        "--tokens",
        ",".join(map(str, PROMPT)),
        "--generate",
        "14",
        "--seed",
        "2",
        "--out",
        out,
    )
    assert r.returncode == 0, r.stderr
    t = tg.Trace(str(out))
    mine = run(model, det, tmp_path, seed=2)
    assert (
        t.names == mine.names and t.provenance["output_tokens"] == mine.provenance["output_tokens"]
    )
    for n in t.names:
        assert np.array_equal(np.asarray(t[n]), np.asarray(mine[n])), n
    p = t.provenance
    assert p["rng"] == "torch:cpu" and p["seed"] == 2
    assert (p["attn_implementation"], p["experts_implementation"]) == ("eager", "eager")
