"""An exact tie in a router (docs/capture-points.md, `layer.NN.router.topk`): the oracle records
the experts the model's own `torch.topk` chose, in the order it returned them, so the routing
recorded is the one its expert outputs were computed with — not a top-k recomputed by the
lowest-index rule, which at an exact tie may name another expert than the one the model ran.

tiny-qwen3-moe (f32) with layer 0's router row b set to a copy of row a: experts a and b get the
same logit on every token. Which of the two torch.topk keeps where they tie for the last place
is not promised by torch: the test reads it from the router's own call (its returned indices)
and picks a pair (a, b) and a row where torch kept b, the higher index, checked on the model's
own router before anything is asserted.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from tracegate_oracle.families import resolve  # noqa: E402

MOE = ROOT / "fixtures" / "tiny-qwen3-moe"
RC = cp.RunConfig(capture="internals")
MID = next(
    p["tokens"]
    for p in json.loads((ROOT / "fixtures/prompts/frozen.json").read_text())["prompts"]
    if p["id"] == "mid"
)
TOPK = "layer.00.router.topk"


@contextlib.contextmanager
def tied(router, a: int, b: int):
    """Router row b a copy of row a until exit (the row restored)."""
    w = router.weight
    saved = w[b].detach().clone()
    with torch.no_grad():
        w[b] = w[a]
    try:
        yield
    finally:
        with torch.no_grad():
            w[b] = saved


class Spy:
    """What layer 0's router returned in the first forward: (logits, scores, indices)."""

    def __init__(self, router):
        self.seen = None
        self.handle = router.register_forward_hook(self._hook)

    def _hook(self, module, args, out):  # returns None: a hook's return would replace the output
        if self.seen is None:
            self.seen = tuple(t.detach().clone() for t in out)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def torch_kept_the_higher(logits, idx, a: int, b: int) -> np.ndarray:
    """Rows where a and b tie exactly for the last place and torch.topk kept b."""
    tie = logits[:, a] == logits[:, b]
    has_a, has_b = (idx == a).any(-1), (idx == b).any(-1)
    return np.nonzero(tie & has_b & ~has_a)[0]


@pytest.fixture(scope="module")
def model():
    cp.setup_torch(RC)
    return cp.load_model(MOE, RC)


@pytest.fixture(scope="module")
def tie(model):
    """(a, b, row): with router row b a copy of row a, torch.topk in layer 0's router keeps b, not
    a, at that row of prompt `mid` (read from the router's own call on its own input)."""
    router = resolve(model).router(0)
    seen = []
    h = router.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            model(torch.tensor([MID]), use_cache=False)
    finally:
        h.remove()
    x = seen[0]  # the router's input, upstream of its weights
    E = router.weight.shape[0]
    for a in range(E):
        for b in range(a + 1, E):
            with tied(router, a, b), torch.no_grad():
                logits, _, idx = router(x)
            rows = torch_kept_the_higher(logits.numpy(), idx.numpy(), a, b)
            if len(rows):
                return a, b, int(rows[0])
    pytest.fail(
        "torch.topk kept the lower index at every exact tie tried: this torch cannot show the "
        "difference this test is about"
    )


def test_an_exact_tie_records_torchs_choice_and_its_experts_outputs(model, tie):
    a, b, r = tie
    router = resolve(model).router(0)
    with tied(router, a, b), Spy(router) as spy:
        c = cp.capture_prompt(model, MOE, MID, RC)
    logits, _, idx = (t.numpy() for t in spy.seen)
    assert r in torch_kept_the_higher(logits, idx, a, b), "the tie did not recur in the capture"
    probs = torch.softmax(torch.from_numpy(logits), -1, dtype=torch.float32).numpy()
    rule = cp.topk_decision(TOPK, probs, idx.shape[1])
    assert a in rule.values[r] and b not in rule.values[r]  # where the old recording went wrong

    d = c.decision(TOPK)
    # The routing the model computed with, in torch's order, row for row.
    np.testing.assert_array_equal(d.values, idx)
    assert b in d.values[r] and a not in d.values[r]
    # Margins: the model's own for its choice, 0 at the tie; elsewhere the lowest-index rule's
    # (the same value wherever torch's choice is a top-k).
    assert d.margins[r] == 0 and np.all(d.margins >= 0)
    assert d.margins.tobytes() == rule.margins.tobytes()
    # The expert outputs captured are those of the recorded experts: row r went to b, not a.
    for e in range(router.weight.shape[0]):
        rows = np.nonzero((d.values == e).any(-1))[0].tolist()
        name = f"layer.00.expert.{e:03d}.out"
        assert (c[name].attrs["positions"] if name in c.names else []) == rows, name
    assert r in c[f"layer.00.expert.{b:03d}.out"].attrs["positions"]
    assert r not in c[f"layer.00.expert.{a:03d}.out"].attrs["positions"]
    assert "notes" not in c.provenance, c.provenance.get("notes")

    # The layer verb on the same input records the same routing.
    h = c["layer.00.hidden_in"]
    with tied(router, a, b):
        one = cp.capture_layer(model, MOE, 0, h.array, h.attrs["positions"], RC)
    np.testing.assert_array_equal(one.decision(TOPK).values, idx)
    assert "notes" not in one.provenance


def test_forcing_the_lowest_index_at_an_exact_tie_overrides_torchs_choice(model, tie, tmp_path):
    """Forced to the lowest-index rule's row at the tie, the router computes with it, the margin
    is the model's own for it (0: a tie), and the row counts as overridden: the model's own
    choice there was torch's."""
    tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")
    from tracegate_oracle.force import Forcing

    a, b, r = tie
    router = resolve(model).router(0)
    with tied(router, a, b):
        own = cp.capture_prompt(model, MOE, MID, RC)
    values = own.decision(TOPK).values.copy()
    values[r] = np.where(values[r] == b, a, values[r])  # b replaced by a, in place in the order
    edited = [
        cp.Decision(d.name, values, d.margins) if d.name == TOPK else d for d in own.decisions
    ]
    path = tmp_path / "forcing.trace"
    cp.write_trace(cp.Capture(own.tensors, edited, own.provenance), path)
    assert tg.Trace(str(path)).decisions[TOPK][r].tolist() == values[r].tolist()

    with tied(router, a, b), Spy(router) as spy:
        cap = cp.capture_prompt(model, MOE, MID, RC, forcing=Forcing(str(path)))
    np.testing.assert_array_equal(spy.seen[2].numpy(), values)  # what the router answered
    d = cap.decision(TOPK)
    np.testing.assert_array_equal(d.values, values)
    assert d.margins[r] == 0
    assert cap.provenance["forced_decisions"]["overridden"][TOPK] == 1
    assert cap.provenance["forced_decisions"]["overridden_rows"][TOPK] == [r]
    assert r in cap[f"layer.00.expert.{a:03d}.out"].attrs["positions"]
    assert r not in cap[f"layer.00.expert.{b:03d}.out"].attrs["positions"]
