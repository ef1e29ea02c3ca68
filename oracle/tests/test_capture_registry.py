"""The capture-point registry (`tracegate_trace::names::POINTS`, mirrored as
`tracegate.names.POINTS`) against every place a capture point also lives. A point added in one
place and not in the others fails here, naming what is missing and where:

1. docs/capture-points.md: its point and decision tables name exactly the registered points;
2. the bundled policies: each has a rule for every registered tensor point, decode steps too;
3. the oracle's family table (families.py): the same families with the same features;
4. the producers (engine, contract, oracle): on every fixture, `--capture internals
   --generate 2` writes only registered points, and every point the fixture's family has.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest

tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
from binaries import producer_trace, release_binary  # noqa: E402
from tracegate import names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = [
    "tiny-qwen3",
    "tiny-qwen3-moe",
    "tiny-llama",
    "tiny-qwen2",
    "tiny-gemma3",
    "tiny-qwen3_5",
    "tiny-qwen3_5-moe",
    "tiny-diffusion-gemma",
]
POLICIES = ["f32", "bf16", "f16", "q8"]
ENGINE, _NO_ENGINE = release_binary("engine")


def registered(kind: str | None = None) -> set[tuple[str, str]]:
    return {(p.scope, p.name) for p in names.POINTS if kind is None or p.kind == kind}


def scope_of(name: str) -> tuple[str, str]:
    n = names.parse(name).without_step()
    return ("model" if n.layer is None else "layer" if n.expert is None else "expert", n.point)


# ---------------------------------------------------------------------------------------------
# 1. the documentation


def documented() -> set[tuple[str, str]]:
    """Every point named in the first column of docs/capture-points.md's point tables (header
    `| point | what it is |`) and its decision table (`| decision |`), read the way the
    registry keys them: scope and the name after its prefixes."""
    out, in_table = set(), False
    for line in (ROOT / "docs/capture-points.md").read_text().splitlines():
        if line.startswith("| point | what it is") or line.startswith("| decision |"):
            in_table = True
            continue
        if not line.startswith("|"):
            in_table = False
            continue
        if not in_table or line.startswith("| ---"):
            continue
        first = line.split("|")[1]
        full = None
        for word in re.findall(r"`([^`]+)`", first):
            # `layer.NN.linear.q`, `.k`: a leading dot continues the previous name's prefix.
            if word.startswith(".") and full:
                word = full.rsplit(".", 1)[0] + word
            full = word
            name = (
                word.replace("BBBB", "0000")
                .replace("SSSS", "0001")
                .replace("NN", "00")
                .replace("EEE", "000")
            )
            out.add(scope_of(name))
    return out


def test_docs_tables_name_exactly_the_registered_points():
    docs, reg = documented(), registered()
    assert not reg - docs, f"registered but not in docs/capture-points.md's tables: {reg - docs}"
    assert not docs - reg, f"in docs/capture-points.md's tables but not registered: {docs - reg}"


def test_docs_check_sees_a_missing_row(tmp_path, monkeypatch):
    # Negative control: the same reading of a doc without the attn_gate row misses it.
    doc = (ROOT / "docs/capture-points.md").read_text()
    cut = "\n".join(ln for ln in doc.splitlines() if not ln.startswith("| `layer.NN.attn_gate`"))
    assert cut != doc
    fake = tmp_path / "docs"
    fake.mkdir()
    (fake / "capture-points.md").write_text(cut)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert registered() - documented() == {("layer", "attn_gate")}


# ---------------------------------------------------------------------------------------------
# 2. the policies


def every_point_trace(path: Path) -> Path:
    """A trace holding one small tensor per registered tensor point, each decode-step variant
    (docs/capture-points.md, "Rows and positions on each path") and each diffusion pass it is
    written in ("Diffusion Gemma": the prompt's encoder pass unprefixed, a commit pass
    `encode.BBBB.`, a denoise step `denoise.BBBB.SSSS.`)."""
    full = []
    for p in names.POINTS:
        if p.kind != "tensor":
            continue
        diffusion_only = p.needs == "diffusion"
        if p.in_decode != "only" and (not diffusion_only or p.scope != "model"):
            full.append((p.example(), p))
        if p.in_decode != "never":
            full.append((names.decode(1, p.example()), p))
        if names.family_has("diffusion_gemma", p):
            full.append((names.denoise(0, 1, p.example()), p))
            if p.scope != "model" or p.name == "embed.out":
                full.append((names.encode(0, p.example()), p))
    with tg.TraceWriter(str(path), {"producer": "registry-test", "dtype": "f32"}) as w:
        for name, p in full:
            shape = (1, 1, 2) if p.token_axis == 1 else (1, 2)
            dtype = np.int64 if p.stored == "tokens" else np.float32
            w.tensor(name, np.ones(shape, dtype), path="prefill", mask="causal", positions=[0])
    return path


def uncovered(trace: Path, policy: str) -> set[str]:
    rep = json.loads(tg.compare(str(trace), str(trace), policy=policy).to_json())
    return {f["tensor"] for f in rep["findings"] if f["kind"] == "no_policy_rule"} | {
        r["tensor"] for r in rep["per_tensor"] if not r.get("rule")
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_every_bundled_policy_has_a_rule_for_every_registered_point(tmp_path, policy):
    trace = every_point_trace(tmp_path / "all.trace")
    assert not uncovered(trace, policy), f"policy {policy} has no rule for these points"


def test_policy_check_sees_a_missing_rule(tmp_path):
    # Negative control: bf16 without its shared-expert gate rule leaves exactly that uncovered.
    policy = json.loads((ROOT / "fixtures/policy/bf16.json").read_text())
    policy["rules"] = [r for r in policy["rules"] if r["pattern"] != "layer.*.shared_expert.gate"]
    (tmp_path / "partial.json").write_text(json.dumps(policy))
    trace = every_point_trace(tmp_path / "all.trace")
    assert uncovered(trace, str(tmp_path / "partial.json")) == {"layer.00.shared_expert.gate"}


# ---------------------------------------------------------------------------------------------
# 3. the oracle's family table


def oracle_features(spec) -> set[str]:
    """The registry's features of an oracle family entry (families.py)."""
    # "autoregressive" (a next-token head) or "diffusion" (block diffusion)
    out = {"softmax_attention", spec.generation}
    if spec.linear_attn:
        out.add("linear_attention")
    if spec.attn_gate:
        out.add("output_gate")
    if spec.moe:
        out.add("moe")
    if spec.shared_expert:
        out.add("shared_expert")
    return out


def test_the_oracle_families_are_the_registry_families():
    from tracegate_oracle.families import FAMILIES

    assert set(FAMILIES) == set(names.FAMILIES), (
        f"only in the oracle's table: {set(FAMILIES) - set(names.FAMILIES)}; "
        f"only in the registry: {set(names.FAMILIES) - set(FAMILIES)}"
    )
    for family, spec in FAMILIES.items():
        assert oracle_features(spec) == set(names.FAMILIES[family]), family


def test_the_oracle_refuses_a_hook_for_an_unregistered_point():
    from tracegate_oracle.errors import OracleError
    from tracegate_oracle.taps import Tap

    with pytest.raises(OracleError, match=r"'layer.00.my_point' is not in the capture-point"):
        Tap.__new__(Tap).add("layer.00.my_point", None)


# ---------------------------------------------------------------------------------------------
# 4. the producers


def run_producer(producer: str, fixture: str, out: Path, *extra: str) -> Path:
    if producer == "engine" and _NO_ENGINE:
        pytest.skip(_NO_ENGINE)
    if producer == "oracle":
        pytest.importorskip("torch")
    threads = ("--threads", "1") if producer == "engine" else ()
    model = ROOT / "fixtures" / fixture
    return producer_trace(
        producer, model, "1,2,3,4,5", out, generate=2, cache=None, extra=(*extra, *threads)
    )


def model_type(fixture: str) -> str:
    cfg = json.loads((ROOT / "fixtures" / fixture / "config.json").read_text())
    return cfg["model_type"]


def expected(fixture: str) -> tuple[set, set]:
    """(prompt points, decode-step points) the fixture's family has under internals."""
    family = model_type(fixture)
    has = [p for p in names.POINTS if names.family_has(family, p)]
    assert has, f"{family} is not in the registry's families"
    if "diffusion" in names.FAMILIES[family]:
        # Block diffusion has no decode steps: every point in its passes (encode, denoise).
        return {(p.scope, p.name) for p in has}, set()
    prompt = {(p.scope, p.name) for p in has if p.in_decode != "only"}
    steps = {(p.scope, p.name) for p in has if p.in_decode != "never"}
    return prompt, steps


def mismatch(t, fixture: str) -> list[str]:
    """What trace `t` writes that the registry lacks, and how its points differ from those
    its fixture's family has (prompt and decode steps apart)."""
    written = list(t.names) + list(t.decisions)
    out = [f"not registered: {n}" for n in sorted(written) if names.point(n) is None]
    prompt = {scope_of(n) for n in written if names.parse(n).decode_step is None}
    steps = {scope_of(n) for n in written if names.parse(n).decode_step is not None}
    want_prompt, want_steps = expected(fixture)
    for where, got, want in (("prompt", prompt, want_prompt), ("steps", steps, want_steps)):
        out += [f"{where}: missing {p}" for p in sorted(want - got)]
        out += [f"{where}: not its family's {p}" for p in sorted(got - want)]
    return out


@pytest.mark.parametrize("producer", ["engine", "contract", "oracle"])
@pytest.mark.parametrize("fixture", FIXTURES)
def test_producers_write_exactly_the_registered_points_of_their_family(tmp_path, producer, fixture):
    t = tg.Trace(str(run_producer(producer, fixture, tmp_path / "t.trace")))
    assert not mismatch(t, fixture), (producer, fixture, mismatch(t, fixture))


def stored_wrong(t, computed: str, rule=lambda n: names.point(n).stored) -> list[str]:
    """The tensors of `t` not stored in the dtype the registry's rule gives (`rule`): f32 for a
    point stored f32, else `computed`."""
    want = {n: "f32" if rule(n) == "f32" else computed for n in t.names}
    return sorted(n for n in t.names if t.dtype(n) != want[n])


def test_the_oracle_stores_each_point_in_the_registered_dtype(tmp_path):
    # bf16 on the hybrid MoE fixture: linear.q, .k, .g and .state f32, every other point bf16.
    out = tmp_path / "b.trace"
    t = tg.Trace(str(run_producer("oracle", "tiny-qwen3_5-moe", out, "--dtype", "bf16")))
    assert not stored_wrong(t, "bf16")
    # Negative control: a rule that has every point stored as computed finds exactly the f32
    # ones wrong.
    wrong = stored_wrong(t, "bf16", rule=lambda n: "computed")
    f32 = {"linear.q", "linear.k", "linear.g", "linear.state"}
    assert wrong and {names.parse(n).point for n in wrong} == f32


def test_producer_check_sees_a_missing_point(tmp_path):
    # Negative control: the engine's trace of the hybrid fixture without its attn_gate tensors.
    src = tg.Trace(str(run_producer("engine", "tiny-qwen3_5", tmp_path / "t.trace")))
    with tg.TraceWriter(str(tmp_path / "cut.trace"), src.provenance) as w:
        for n in src.names:
            if not n.endswith(".attn_gate"):
                attrs = src.attributes(n)
                keep = {k: v for k, v in attrs.items() if k in ("path", "mask", "positions")}
                w.tensor(n, np.array(src[n]), **keep)
        for n, v in src.decisions.items():
            w.decision(n, v, margins=src.margins.get(n))
    assert mismatch(tg.Trace(str(tmp_path / "cut.trace")), "tiny-qwen3_5") == [
        "prompt: missing ('layer', 'attn_gate')"
    ]
