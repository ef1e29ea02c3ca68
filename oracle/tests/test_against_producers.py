"""The oracle against the other producers, through the real differ. Run from the repo root:
    .venv/bin/python -m pytest oracle/tests/test_against_producers.py -q -s

1. engine and contract agree with the oracle's decisions (policy on numbers) on both fixtures;
   1b. the oracle itself at 1 and 4 threads: within the policy, every decision equal (torch
   promises no bits across thread counts, so none are asserted);
2. the differ refuses two oracle traces from different stacks;
3. negative control: one expert's own weights (layer 0, expert 2's down_proj) loaded wrong leave
   layer 0's routing alone and flip a top-k row at the next MoE layer; the differ names that
   decision first and labels the flip a defect, not a near-tie.

The oracle runs in-process (the CLI is the same code, checked in test_oracle.py), once per
fixture and prompt; every trace is reused across tests through the module-scoped `runs`.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from binaries import copy_trace, diff_report, release_binary  # noqa: E402

FIXTURES = {"dense": ROOT / "fixtures" / "tiny-qwen3", "moe": ROOT / "fixtures" / "tiny-qwen3-moe"}
POLICY = ROOT / "fixtures" / "policy" / "oracle-default.json"
PROMPTS = {
    p["id"]: p["tokens"]
    for p in json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
}


ENGINE, _NO_ENGINE = release_binary("engine")

# Negative control (test 3): expert 2 of layer 0, its down_proj scaled by 8. Scaling a bf16 by a
# power of two only bumps the exponent, so the edit is exact. On the `short` prompt the clean
# engine routes layer 0 row 0 (only) to expert 2 (test checks), so the edit changes layer 0's MLP
# output in row 0 and nothing upstream of it: layer 0's router input, hence its decisions, are
# untouched, and the first router that can see the edit is the next MoE layer's (derived from
# config.json below, not assumed). Rows 1..4 of that layer's input (`hidden_in`) stay within
# rounding of the oracle; the edit reaches them only through that layer's attention over row 0.
NC_LAYER, NC_EXPERT, NC_PROJ, NC_SCALE, NC_PROMPT = 0, 2, "down_proj", 8.0, "short"
NC_TENSOR = f"model.layers.{NC_LAYER}.mlp.experts.{NC_EXPERT}.{NC_PROJ}.weight"


def _trace_diff() -> Path:
    # TRACE_DIFF overrides; otherwise the release build where cargo puts it.
    if os.environ.get("TRACE_DIFF"):
        return Path(os.environ["TRACE_DIFF"])
    path, why = release_binary("trace-diff")
    if why:
        pytest.skip(why)
    return Path(path)


def diff(ref, cand, *args, policy=True):
    """Run trace-diff; returns (exit code, parsed JSON report or None, stdout+stderr text)."""
    cmd = [str(_trace_diff()), str(ref), str(cand), *args]
    if policy:
        cmd += ["--policy", str(POLICY)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    report = diff_report(r.stdout) if "--json" in args and r.stdout.strip() else None
    return r.returncode, report, r.stdout + r.stderr


def _run_cli(argv):
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (argv, r.stderr)


class Runs:
    """Traces on demand, each produced once per module: (fixture key, prompt id, producer) -> path."""

    def __init__(self, tmp: Path):
        self.tmp, self.paths, self.models = tmp, {}, {}
        self.rc = cp.RunConfig()  # f32, 1 thread, capture=default: what the gate compares
        self.det = None

    def model(self, fx: str, model_dir: Path | None = None):
        """transformers' model of `model_dir` (default: fixture `fx`), loaded once per module."""
        model_dir = model_dir or FIXTURES[fx]
        if self.det is None:
            self.det = cp.setup_torch(self.rc)
        if model_dir not in self.models:
            self.models[model_dir] = cp.load_model(model_dir, self.rc)
        return self.models[model_dir]

    def get(
        self, fx: str, prompt: str, producer: str, model_dir: Path | None = None, tag: str = ""
    ) -> Path:
        key = (fx, prompt, producer, tag)
        if key in self.paths:
            return self.paths[key]
        model_dir = model_dir or FIXTURES[fx]
        out = self.tmp / f"{fx}-{prompt}-{producer}{tag}.trace"
        toks = PROMPTS[prompt]
        if producer == "oracle":
            cp.write_trace(
                cp.capture_prompt(self.model(fx, model_dir), model_dir, toks, self.rc, self.det),
                out,
            )
        else:
            args = [
                "trace",
                "--model",
                str(model_dir),
                "--tokens",
                ",".join(map(str, toks)),
                "--out",
                str(out),
            ]
            if producer == "engine":
                if _NO_ENGINE:
                    pytest.skip(_NO_ENGINE)
                _run_cli([ENGINE, *args])
            else:
                _run_cli([sys.executable, "-m", "tracegate_contract", *args])
        self.paths[key] = out
        return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("producers"))


# ------------------------------------------------------------- 1. decisions agree with the oracle


@pytest.mark.parametrize("producer", ["engine", "contract"])
@pytest.mark.parametrize("prompt", ["short", "long"])
@pytest.mark.parametrize("fx", ["dense", "moe"])
def test_producer_decisions_agree_with_oracle(runs, fx, prompt, producer):
    ref = runs.get(fx, prompt, "oracle")
    cand = runs.get(fx, prompt, producer)
    code, r, text = diff(ref, cand, "--json")
    assert code == 0, text
    assert r["verdict"] in ("within_policy", "identical"), r["findings"]
    n_dec = len(tg.Trace(str(ref)).decisions)
    d = r["decisions"]
    # Every oracle decision compared, exactly, none missing: a producer that dropped a decision
    # (say a router top-k) would otherwise pass on the ones left.
    assert n_dec > 0 and d["reference_count"] == d["compared"] == n_dec, d
    assert d["differing"] == 0 and not d["missing"] and not d["extra"], d
    assert all(x["status"] == "identical" for x in d["results"])
    # The policy judged every tensor (no tensor without a rule, none outside one).
    assert all(p["status"] in ("identical", "within_policy") for p in r["per_tensor"]), r[
        "findings"
    ]

    # Record how close this run came: the smallest oracle margin and the worst relative L2.
    t = tg.Trace(str(ref))
    m_name, m_row, m_val = min(
        (
            (n, int(i), float(v))
            for n, m in t.margins.items()
            if m is not None
            for i, v in enumerate(m)
        ),
        key=lambda x: x[2],
    )
    worst = max(r["per_tensor"], key=lambda p: p["rel_l2"] or 0.0)
    print(
        f"\n[{fx}/{prompt} oracle vs {producer}] {r['verdict']}, {n_dec} decisions; smallest margin "
        f"{m_val:.6g} ({m_name} row {m_row}); worst rel_l2 {worst['rel_l2']:.3g} ({worst['tensor']}), "
        f"min cosine 1-{1 - min(p['cosine'] for p in r['per_tensor']):.3g}"
    )


# ------------------------------------- 1b. the oracle at 1 and 4 threads: within policy, same decisions


@pytest.mark.parametrize("fx", ["dense", "moe"])
def test_oracle_threads_1_vs_4_within_policy_decisions_equal(runs, tmp_path, fx):
    # torch promises no bits across thread counts (another split of a reduction is another
    # rounding); the project promises that such runs stay inside the oracle policy and take
    # every decision alike, judged by the differ as any oracle comparison is.
    import torch

    one = runs.get(fx, "long", "oracle")
    rc4 = cp.RunConfig(threads=4)
    torch.set_num_threads(4)
    four = tmp_path / "four.trace"
    try:
        cp.write_trace(
            cp.capture_prompt(runs.model(fx), FIXTURES[fx], PROMPTS["long"], rc4, runs.det), four
        )
    finally:
        torch.set_num_threads(runs.rc.threads)
    assert (
        tg.Trace(str(four)).provenance["threads"] == 4
        and tg.Trace(str(one)).provenance["threads"] == 1
    )
    code, r, text = diff(one, four, "--json")
    assert code == 0 and r["verdict"] in ("identical", "within_policy"), text
    n_tensors, n_dec = len(tg.Trace(str(one)).names), len(tg.Trace(str(one)).decisions)
    assert len(r["per_tensor"]) == n_tensors and all(
        p["status"] in ("identical", "within_policy") for p in r["per_tensor"]
    ), r["findings"]
    d = r["decisions"]
    assert n_dec > 0 and d["reference_count"] == d["compared"] == n_dec and d["differing"] == 0, d
    assert not d["missing"] and not d["extra"], d


# ----------------------------------------------------------- 2. an oracle stack mismatch is refused


def test_stack_mismatch_refused_and_downgradable(runs, tmp_path):
    orig = runs.get("moe", "short", "oracle")

    def edit(prov):
        prov["versions"]["transformers"] += "+edited"
        return prov

    edited = copy_trace(orig, tmp_path / "edited.trace", edit)
    same = copy_trace(orig, tmp_path / "same.trace")
    # Control: the copy itself is faithful, so the refusal below is due to the edit alone.
    code, r, text = diff(orig, same, "--json", policy=False)
    assert code == 0 and r["verdict"] == "identical", text

    code, r, text = diff(orig, edited, "--json", policy=False)
    assert code == 3 and r["verdict"] == "incomparable", text
    kinds = {f["kind"] for f in r["findings"]}
    assert "stack_mismatch" in kinds, r["findings"]
    assert any(
        "versions.transformers" in (f["detail"] or "")
        for f in r["findings"]
        if f["kind"] == "stack_mismatch"
    )
    code, _, text = diff(orig, edited, policy=False)  # the human output names the key too
    assert code == 3 and "versions.transformers" in text, text

    code, r, text = diff(orig, edited, "--json", "--allow-stack-mismatch", policy=False)
    assert code == 0 and r["verdict"] == "identical", text
    assert "stack_mismatch_allowed" in {f["kind"] for f in r["findings"]}, r["findings"]
    assert "stack_mismatch" not in {f["kind"] for f in r["findings"]}


# ------------------------------------ 3. negative control: one expert's weights loaded wrong


def _moe_layers(config: dict) -> list[int]:
    """Layers with a sparse MoE block, by transformers' own rule for Qwen3-MoE (Qwen3MoeDecoderLayer):
    not in mlp_only_layers, num_experts > 0, and (index + 1) divisible by decoder_sparse_step."""
    return [
        i
        for i in range(config["num_hidden_layers"])
        if i not in config["mlp_only_layers"]
        and config["num_experts"] > 0
        and (i + 1) % config["decoder_sparse_step"] == 0
    ]


def _perturbed_fixture(dst: Path) -> Path:
    """Copy tiny-qwen3-moe with one expert's weight tensor scaled (safetensors edited in place, bf16
    kept; every other byte unchanged)."""
    src = FIXTURES["moe"]
    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    raw = bytearray((src / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    info = json.loads(raw[8 : 8 + n])[NC_TENSOR]
    assert info["dtype"] == "BF16", info
    lo, hi = (8 + n + o for o in info["data_offsets"])  # offsets are relative to the data start
    w = np.frombuffer(bytes(raw[lo:hi]), "<u2")
    f32 = (w.astype(np.uint32) << 16).view(np.float32)
    new = ((f32 * np.float32(NC_SCALE)).view(np.uint32) >> 16).astype("<u2")
    # Exact: the new bf16 bits widen back to exactly NC_SCALE x the old values (no rounding, no overflow).
    assert np.array_equal(
        (new.astype(np.uint32) << 16).view(np.float32), f32 * np.float32(NC_SCALE)
    )
    assert np.isfinite(f32).all() and (f32 != 0).any()
    raw[lo:hi] = new.tobytes()
    (dst / "model.safetensors").write_bytes(bytes(raw))
    return dst


def test_expert_weights_flip_next_moe_router_labelled_consequence_of_that_mlp(runs, tmp_path):
    config = json.loads((FIXTURES["moe"] / "config.json").read_text())
    moe = _moe_layers(config)
    assert NC_LAYER in moe, (NC_LAYER, moe)
    nxt = min(i for i in moe if i > NC_LAYER)  # the first router downstream of the edited experts
    router = lambda i: f"layer.{i:02d}.router.topk"  # noqa: E731

    ref = runs.get("moe", NC_PROMPT, "oracle")
    clean = runs.get("moe", NC_PROMPT, "engine")
    R, E = tg.Trace(str(ref)), tg.Trace(str(clean))
    # The traces route exactly where the config says there are experts.
    assert {n for n in R.decisions if n.endswith(".router.topk")} == {router(i) for i in moe}

    # Control: the unperturbed engine takes every decision the oracle takes.
    code, r, text = diff(ref, clean, "--json")
    assert code == 0 and r["verdict"] in ("within_policy", "identical"), text
    assert r["decisions"]["differing"] == 0 and r["first_decision_divergence"] is None, r[
        "decisions"
    ]

    # The chosen expert is one this prompt actually uses at NC_LAYER (else the edit is invisible).
    routed = np.flatnonzero((E.decisions[router(NC_LAYER)] == NC_EXPERT).any(1))
    assert routed.size >= 1, (
        f"prompt {NC_PROMPT!r} routes no row to expert {NC_EXPERT} at layer {NC_LAYER}"
    )

    bad_dir = _perturbed_fixture(tmp_path / "tiny-qwen3-moe-bad-expert")
    raw = runs.get("moe", NC_PROMPT, "engine", model_dir=bad_dir, tag="-bad-expert")

    # The engine records the digest of what it loaded, so the differ refuses outright: different
    # weights are not a numerical question.
    code, r, text = diff(ref, raw, "--json")
    assert code == 3 and r["verdict"] == "incomparable", text
    assert "weights_mismatch" in {f["kind"] for f in r["findings"]}, r["findings"]

    # A user's port that loaded one expert wrong would not record our digest: drop it.
    def drop(prov):
        del prov["weights_digest"]
        return prov

    cand = copy_trace(raw, tmp_path / "bad-expert-no-digest.trace", drop)

    # Ground truth from the traces themselves, independent of the differ: everything before the
    # edited MLP bit-identical to the clean engine run, so NC_LAYER's routing is unchanged; the MLP
    # output changes in the routed rows only; some row of the next router flips.
    C = tg.Trace(str(cand))
    L = f"layer.{NC_LAYER:02d}"
    for t in ("embed.out", f"{L}.hidden_in", f"{L}.attn_out"):
        assert C.tensor_digest(t) == E.tensor_digest(t), t
    for i in moe:
        if i <= NC_LAYER:
            assert np.array_equal(C.decisions[router(i)], R.decisions[router(i)]), router(i)
    changed = np.flatnonzero(
        (np.asarray(C[f"{L}.mlp_out"]) != np.asarray(E[f"{L}.mlp_out"])).any(1)
    )
    assert changed.tolist() == routed.tolist(), (changed, routed)
    flipped = np.flatnonzero((C.decisions[router(nxt)] != R.decisions[router(nxt)]).any(1))
    assert flipped.size >= 1, f"the edit no longer flips a top-k row of layer {nxt} on this prompt"

    code, r, text = diff(ref, cand, "--json")
    assert code == 1 and r["verdict"] == "different", text
    first = r["first_decision_divergence"]
    assert first["name"] == router(nxt) and first["row"] == int(flipped[0]), first
    res = {x["name"]: x for x in r["decisions"]["results"]}
    for i in moe:
        if i <= NC_LAYER:
            assert res[router(i)]["status"] == "identical", res[router(i)]
    dn = res[router(nxt)]
    assert dn["status"] == "different" and dn["differing_rows"] == flipped.size
    assert [f["row"] for f in dn["flips"]] == flipped.tolist()
    # The edited layer's MLP is outside the policy and captured before the next router reads
    # its input: every flip there is a consequence of it, named as such (a flip a user could
    # dismiss as a near-tie would hide the defect). Default capture has no router.logits, so
    # the differ falls back to the layer's input for its divergence.
    assert dn["source"] == f"layer.{nxt:02d}.hidden_in", dn
    assert int(flipped[0]) not in routed, (flipped, routed)
    for f in dn["flips"]:
        assert f["label"] == "consequence" and f["upstream"] == f"{L}.mlp_out", f
    # Numbers: everything up to the edited layer's attention within policy; its MLP is where it breaks.
    status = {p["tensor"]: p["status"] for p in r["per_tensor"]}
    upstream = ["embed.out", f"{L}.hidden_in", f"{L}.attn_out"]
    assert all(status[n] in ("identical", "within_policy") for n in upstream), status
    assert (
        next(n for n, s in status.items() if s not in ("identical", "within_policy"))
        == f"{L}.mlp_out"
    )
    f = dn["flips"][0]
    print(
        f"\n[expert {NC_EXPERT} of layer {NC_LAYER} x{NC_SCALE:g}] {first['name']} row {f['row']}: "
        f"{f['reference']} vs {f['candidate']}, margin {f['reference_margin']:.6g}, source {dn['source']} "
        f"divergence {f['source_divergence']:.3g} -> {f['label']}"
    )
