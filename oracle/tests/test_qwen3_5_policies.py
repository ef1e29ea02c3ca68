"""Every capture point of a Qwen3.5 oracle trace (both fixtures, `--capture internals`,
`--generate 2`) is covered by a rule of each bundled policy: `trace-diff --policy` reports no
`no_policy_rule`, with a negative control (a policy without the rules for the new points
reports each of their tensors). The bounds themselves are measured in
fixtures/policy/MEASUREMENTS.md; `float64_throughout` (the reference those measurements need)
is checked to widen transformers' fp32 casts and to restore them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from binaries import diff_report, release_binary

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tracegate_oracle.cli import main  # noqa: E402
from tracegate_oracle.measure_policy import float64_throughout  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ["tiny-qwen3_5", "tiny-qwen3_5-moe"]
POLICIES = ["f32", "bf16", "f16"]
PROMPT = [3, 141, 59, 26, 5, 35, 89, 79, 32, 38, 46, 26, 4, 33, 83, 27, 9]  # < both vocabularies
DIFF, _why = release_binary("trace-diff")
needs_diff = pytest.mark.skipif(bool(_why), reason=f"{_why}")
NEW = ("attn_gate", "linear.", "shared_expert.")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    d = tmp_path_factory.mktemp("q35")
    out = {}
    for fx in FIXTURES:
        out[fx] = d / f"{fx}.trace"
        argv = ["trace", "--model", str(ROOT / "fixtures" / fx), "--out", str(out[fx])]
        argv += ["--tokens", ",".join(map(str, PROMPT)), "--capture", "internals"]
        assert main([*argv, "--generate", "2"]) == 0
    return out


def no_rule(trace: Path, policy: str) -> list[str]:
    """The tensors `trace-diff --policy` finds no rule for, the trace against itself."""
    p = subprocess.run(
        [DIFF, str(trace), str(trace), "--policy", policy, "--json"], capture_output=True, text=True
    )
    assert p.returncode in (0, 1), p.stderr
    rep = diff_report(p.stdout)
    return [f["tensor"] for f in rep["findings"] if f["kind"] == "no_policy_rule"]


@needs_diff
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("fixture", FIXTURES)
def test_every_qwen3_5_point_has_a_rule(traces, fixture, policy):
    assert no_rule(traces[fixture], policy) == []


@needs_diff
def test_negative_control_a_point_no_rule_covers_is_reported(traces, tmp_path):
    import tracegate

    pol = json.loads((ROOT / "fixtures/policy/oracle-default.json").read_text())
    pol["rules"] = [r for r in pol["rules"] if not any(s in r["pattern"] for s in NEW)]
    path = tmp_path / "without-new.json"
    path.write_text(json.dumps(pol))
    for fx in FIXTURES:
        new = [n for n in tracegate.Trace(str(traces[fx])).names if any(s in n for s in NEW)]
        kinds = {n.split(".", 2)[2] for n in new}
        assert {"attn_gate", "linear.core", "linear.state"} <= kinds, kinds
        if fx == "tiny-qwen3_5-moe":
            assert {"shared_expert.gate", "shared_expert.out"} <= kinds, kinds
        assert sorted(no_rule(traces[fx], str(path))) == sorted(new)


def test_float64_throughout_widens_the_fp32_casts_and_restores_them():
    import sys

    from tracegate_oracle import capture as cp

    model = cp.load_model(str(ROOT / "fixtures/tiny-qwen3_5"), cp.RunConfig())
    mod = sys.modules[type(model.model.language_model.layers[0].linear_attn).__module__]
    x = torch.ones(2, dtype=torch.float64)
    with float64_throughout(model):
        assert mod.torch.float32 is torch.float64 and mod.torch.float is torch.float64
        assert x.float().dtype == torch.float64
    assert mod.torch is torch and mod.torch.float32 is torch.float32
    assert x.float().dtype == torch.float32  # control: outside, fp32 as transformers wrote it
    with pytest.raises(RuntimeError), float64_throughout(model):
        raise RuntimeError("restored on error too")
    assert mod.torch is torch and x.float().dtype == torch.float32
