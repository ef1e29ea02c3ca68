"""`--force-decisions` in the oracle (docs/producers.md, "Forced decisions"), in-process:

1. forced from the engine's trace of tiny-qwen3-moe (prompt `long`, with generation), every
   decision is the engine's, and the forced routing is what transformers' own router returned;
2. the legitimate case: the bf16 run forced from the f32 run takes the f32 run's decisions where
   unforced it flips some (negative control: unforced, it does flip);
3. mixtral and olmoe (tiny seeded checkpoints): an altered router row is what their own router
   modules return and their experts receive, weights = their own probabilities at it;
4. a trace that cannot serve the run is refused, exit 2, one line naming file and decision.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from binaries import release_binary  # noqa: E402
from tracegate_oracle import cli  # noqa: E402
from tracegate_oracle.families import resolve  # noqa: E402
from tracegate_oracle.force import Forcing  # noqa: E402

MOE = ROOT / "fixtures" / "tiny-qwen3-moe"
LONG = next(
    p["tokens"]
    for p in json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
    if p["id"] == "long"
)
ENGINE, _NO_ENGINE = release_binary("engine")


def write(cap: cp.Capture, path: Path) -> tg.Trace:
    cp.write_trace(cap, path)
    return tg.Trace(str(path))


def altered(src: tg.Trace, out: Path, name: str, edit) -> Forcing:
    """A copy of `src` with decision `name`'s values edited in place by `edit`."""
    with tg.TraceWriter(str(out), src.provenance) as w:
        for n in src.names:
            a = src.attributes(n)
            w.tensor(
                n, np.array(src[n]), dtype=src.dtype(n) if src.dtype(n) == "bf16" else None, **a
            )
        for n, v in src.decisions.items():
            v = np.array(v)
            if n == name:
                edit(v)
            w.decision(n, v, margins=src.margins[n])
    return Forcing(str(out))


class RouterSpy:
    """What transformers' own router modules returned (logits, scores, indices) per MoE layer,
    in the first forward (the prefill; decode steps come after)."""

    def __init__(self, model):
        lay = resolve(model)
        self.seen, self.handles = {}, []
        for L in lay.moe_layers:
            self.handles.append(lay.router(L).register_forward_hook(self._hook(L)))

    def _hook(self, L):
        def seen(module, args, out):  # returns None: a hook's return value would replace the output
            self.seen.setdefault(L, out)

        return seen

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


@pytest.fixture(scope="module")
def det():
    return cp.setup_torch(cp.RunConfig())


@pytest.mark.skipif(bool(_NO_ENGINE), reason=_NO_ENGINE or "built")
def test_forced_from_the_engine_every_decision_is_the_engines(det, tmp_path):
    ref = tmp_path / "engine.trace"
    subprocess.run(
        [
            ENGINE,
            "trace",
            "--model",
            str(MOE),
            "--tokens",
            ",".join(map(str, LONG)),
            "--out",
            str(ref),
            "--generate",
            "3",
            "--threads",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    eng = tg.Trace(str(ref))
    rc = cp.RunConfig(generate=3)
    model = cp.load_model(MOE, rc)
    with RouterSpy(model) as spy:
        cap = cp.capture_prompt(model, MOE, LONG, rc, det, forcing=Forcing(str(ref)))
    assert [d.name for d in cap.decisions] == list(eng.decisions)
    for d in cap.decisions:
        np.testing.assert_array_equal(d.values, eng.decisions[d.name], err_msg=d.name)
    # The routing the model computed with (its router's own return) is the forced one.
    for L, (_, _, idx) in spy.seen.items():
        np.testing.assert_array_equal(idx.numpy(), eng.decisions[f"layer.{L:02d}.router.topk"])
    rec = cap.provenance["forced_decisions"]
    assert rec["trace_digest"] == eng.digest and rec["decisions"] == list(eng.decisions), rec
    # The layer verb, forced alike on the whole run's own input, reproduces its layer (same process).
    lay_in = cap["layer.01.hidden_in"]
    one = cp.capture_layer(
        model,
        MOE,
        1,
        lay_in.array,
        lay_in.attrs["positions"],
        cp.RunConfig(),
        det,
        forcing=Forcing(str(ref)),
    )
    np.testing.assert_array_equal(
        one.decision("layer.01.router.topk").values, eng.decisions["layer.01.router.topk"]
    )
    np.testing.assert_array_equal(one["layer.01.mlp_out"].array, cap["layer.01.mlp_out"].array)
    t = write(cap, tmp_path / "oracle.trace")
    first = t.names.index("layer.00.mlp_out")
    assert all("forced" not in t.attributes(n) for n in t.names[:first])
    assert all(t.attributes(n)["forced"] == eng.digest for n in t.names[first:])


def test_bf16_forced_from_f32_takes_its_decisions_past_the_flips(det, tmp_path):
    f32 = cp.load_model(MOE, cp.RunConfig())
    ref = write(cp.capture_prompt(f32, MOE, LONG, cp.RunConfig(), det), tmp_path / "f32.trace")
    del f32
    rc = cp.RunConfig(dtype="bf16")
    bf16 = cp.load_model(MOE, rc)
    free = cp.capture_prompt(bf16, MOE, LONG, rc, det)
    forced = cp.capture_prompt(bf16, MOE, LONG, rc, det, forcing=Forcing(ref.path))
    flips = {
        d.name: int((d.values != ref.decisions[d.name]).reshape(len(d.values), -1).any(-1).sum())
        for d in free.decisions
    }
    # Negative control: unforced, bf16 decides some rows otherwise (near-ties of this fixture).
    assert sum(flips.values()) > 0, flips
    for d in forced.decisions:
        np.testing.assert_array_equal(d.values, ref.decisions[d.name], err_msg=d.name)
    rec = forced.provenance["forced_decisions"]
    # Rows overridden are counted against the forced run's own choices, which follow the forced
    # ones upstream: at least the first flip (same inputs up to it) is overridden.
    first = next(d.name for d in free.decisions if flips[d.name])
    assert rec["overridden"].get(first, 0) >= 1, (rec, flips)
    # A negative margin says the model ranks an unchosen index above a chosen one: such a row
    # is overridden, and listed as one (the converse need not hold: a reordered top-k, or a tie,
    # keeps margin ≥ 0). Each count is its list's length (docs/producers.md, "Recorded.").
    rows = rec["overridden_rows"]
    assert {n: len(r) for n, r in rows.items()} == rec["overridden"], rec
    for d in forced.decisions:
        below = np.flatnonzero(d.margins < 0).tolist()
        assert set(below) <= set(rows.get(d.name, [])), (d.name, d.margins, rec)


def tiny(fam: str, d: Path) -> Path:
    cls, extra = {
        "mixtral": ("MixtralConfig", {"num_local_experts": 4}),
        "olmoe": ("OlmoeConfig", {"num_experts": 4}),
    }[fam]
    cfg = getattr(transformers, cls)(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
        num_experts_per_tok=2,
        initializer_range=0.2,
        **extra,
    )
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").save_pretrained(
        d, safe_serialization=True
    )
    return d


@pytest.mark.parametrize("fam", ["mixtral", "olmoe"])
def test_other_moe_families_route_their_own_experts_to_the_forced_rows(det, tmp_path, fam):
    d = tiny(fam, tmp_path / fam)
    tokens = [5, 9, 33, 17, 2, 60, 41]
    model = cp.load_model(d, cp.RunConfig())
    own = write(cp.capture_prompt(model, d, tokens, cp.RunConfig(), det), tmp_path / "own.trace")
    before = np.array(own.decisions["layer.01.router.topk"])
    swap = [e for e in range(4) if e not in before[2]]  # row 2: the two experts it did not choose

    def edit(v):
        v[2] = swap

    forcing = altered(own, tmp_path / "alt.trace", "layer.01.router.topk", edit)
    with RouterSpy(model) as spy:
        cap = cp.capture_prompt(model, d, tokens, cp.RunConfig(), det, forcing=forcing)
    logits, scores, idx = spy.seen[1]
    np.testing.assert_array_equal(idx.numpy()[2], swap)
    np.testing.assert_array_equal(np.delete(idx.numpy(), 2, 0), np.delete(before, 2, 0))
    # Weights: the router's own probabilities at the forced experts, renormalised as the family
    # does (mixtral always; olmoe's config default norm_topk_prob=False: not).
    p = torch.softmax(logits.float(), -1).numpy()[2, swap]
    want = p / p.sum() if fam == "mixtral" or model.config.norm_topk_prob else p
    np.testing.assert_allclose(scores.float().numpy()[2], want, rtol=1e-6)
    dec = cap.decision("layer.01.router.topk")
    np.testing.assert_array_equal(dec.values[2], swap)
    assert (
        dec.margins[2] < 0
        and cap.provenance["forced_decisions"]["overridden"]["layer.01.router.topk"] == 1
        and cap.provenance["forced_decisions"]["overridden_rows"]["layer.01.router.topk"] == [2]
    )
    # Upstream of the forced row nothing moved; its row of the layer's output did.
    free = {
        r.name: r.array for r in cp.capture_prompt(model, d, tokens, cp.RunConfig(), det).tensors
    }
    forced = {r.name: r.array for r in cap.tensors}
    np.testing.assert_array_equal(free["layer.01.attn_out"], forced["layer.01.attn_out"])
    assert not np.array_equal(free["layer.01.mlp_out"][2], forced["layer.01.mlp_out"][2])
    # Other rows only within rounding: an expert's batch of rows changed shape, and torch's
    # matmul promises no bits across shapes.
    np.testing.assert_allclose(
        np.delete(free["layer.01.mlp_out"], 2, 0),
        np.delete(forced["layer.01.mlp_out"], 2, 0),
        atol=1e-6,
    )


def test_refusals_exit_2_in_one_line(det, tmp_path, capsys):
    model = cp.load_model(MOE, cp.RunConfig())
    tokens = LONG[:6]
    ref = write(cp.capture_prompt(model, MOE, tokens, cp.RunConfig(), det), tmp_path / "ref.trace")
    base = [
        "trace",
        "--model",
        str(MOE),
        "--out",
        str(tmp_path / "x.trace"),
        "--force-decisions",
        ref.path,
    ]
    cases = [
        (
            ["--tokens", ",".join(map(str, tokens)), "--generate", "1"],
            "decision decode.0000.argmax is missing (this run needs it)",
        ),
        (
            ["--tokens", ",".join(map(str, LONG[:5]))],
            f"its prompt_tokens {tokens} are not this run's {LONG[:5]}",
        ),
    ]
    for extra, says in cases:
        capsys.readouterr()
        assert cli.main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--force-decisions {ref.path}: " in err and says in err, (
            err
        )
    assert not (tmp_path / "x.trace").exists()
