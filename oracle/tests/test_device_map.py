"""`--device-map auto` (oracle/README.md, "--device-map auto"): what can be checked without a GPU.

1. Refusals, exit 2 with one line: --device-map without --device cuda, --max-memory without
   --device-map, --device cuda --device-map auto where no GPU is visible, a size accelerate does
   not read; argument parsing of --max-memory (each refusal beside the accepted form).
2. The taps under accelerate's own dispatch: `accelerate.dispatch_model`, the function
   from_pretrained(device_map=...) calls when the map names more than one device, here on CPU with
   two layers and the head offloaded to disk. An offloaded module's weights are on the meta device
   between forwards and put in place by accelerate's hook inside its forward: the same hook a
   module placed on "cpu" gets under --device-map auto on a GPU (the case that broke the experts
   tap on the H200). The capture (internals, decode steps, forced decisions) equals the plain
   run's bit for bit, accelerate's hooks survive the capture, and the provenance's map is
   transformers' hf_device_map. The GPU run itself is recorded in oracle/README.md.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate", reason="accelerate not installed (requirements.txt)")
tg = pytest.importorskip("tracegate", reason="tracegate binding not built (scripts/setup.sh)")

ROOT = Path(__file__).resolve().parents[2]
import tracegate_oracle as cp  # noqa: E402
from tracegate_oracle import cli  # noqa: E402
from tracegate_oracle.families import resolve  # noqa: E402
from tracegate_oracle.force import Forcing  # noqa: E402

MOE = ROOT / "fixtures" / "tiny-qwen3-moe"
PROMPT = [3, 17, 5, 99, 41, 7]


def refusal(capsys, args: list[str]) -> str:
    rc = cli.main(["trace", "--model", str(MOE), "--tokens", "1,2,3", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_refusals(capsys, tmp_path):
    out = ["--out", str(tmp_path / "x.trace")]
    assert "--device-map auto: needs --device cuda" in refusal(
        capsys, [*out, "--device-map", "auto"]
    )
    assert "--max-memory: only with --device-map auto" in refusal(
        capsys, [*out, "--max-memory", "0=1GiB"]
    )
    # Accepted forms of the same options pass these checks (negative control).
    cp.check_device_map(cp.RunConfig(device="cuda", device_map="auto", max_memory={0: "1GiB"}))
    if torch.cuda.is_available():
        pytest.skip("NOT CHECKED here: the no-GPU refusal needs a machine without CUDA")
    err = refusal(capsys, [*out, "--device", "cuda", "--device-map", "auto"])
    assert "CUDA is not available" in err and "--device-map auto needs visible GPUs" in err


def test_max_memory_parsing():
    assert cli.parse_max_memory("0=70GiB,cpu=200GiB") == {0: "70GiB", "cpu": "200GiB"}
    assert cli.parse_max_memory("1=500000") == {1: "500000"}
    for bad in ("gpu0=1GiB", "0=", "0:1GiB", "0=1GiB,0=2GiB"):
        with pytest.raises(Exception, match="DEVICE=SIZE|given twice"):
            cli.parse_max_memory(bad)
    # Sizes are accelerate's to read: bytes and units, or a one-line refusal naming the entry.
    rc = cp.RunConfig(device="cuda", device_map="auto", max_memory={0: "1GiB", "cpu": "1500"})
    assert cp.placement(rc) == {"device_map": "auto", "max_memory": {0: 2**30, "cpu": 1500}}
    with pytest.raises(cp.OracleError, match=r"--max-memory 0=12XB: not a size"):
        cp.placement(cp.RunConfig(device="cuda", device_map="auto", max_memory={0: "12XB"}))


def test_taps_under_accelerates_dispatch_equal_the_plain_run(tmp_path):
    rc = cp.RunConfig(capture="internals", generate=2)
    det = cp.setup_torch(rc)
    model = cp.load_model(MOE, rc)
    plain = cp.capture_prompt(model, MOE, PROMPT, rc, det)
    cp.write_trace(plain, tmp_path / "plain.trace")

    lay = resolve(model)
    moe = lay.moe_layers[0]
    dmap = {
        "model.embed_tokens": "cpu",
        "lm_head": "disk",
        "model.norm": "cpu",
        "model.rotary_emb": "cpu",
        **{
            f"model.layers.{L}": "disk" if L in (moe, len(lay.layers) - 1) else "cpu"
            for L in range(len(lay.layers))
        },
    }
    accelerate.dispatch_model(model, device_map=dmap, offload_dir=str(tmp_path / "offload"))
    experts, router = lay.experts(moe), lay.router(moe)
    # The condition under test: weights not in place between forwards, accelerate's forward on the modules.
    assert experts.down_proj.device.type == "meta"
    hooked = experts.__dict__["forward"], router.__dict__["forward"]

    off = cp.capture_prompt(model, MOE, PROMPT, rc, det)
    forced = cp.capture_prompt(
        model, MOE, PROMPT, rc, det, forcing=Forcing(str(tmp_path / "plain.trace"))
    )
    assert (experts.__dict__["forward"], router.__dict__["forward"]) == hooked
    assert any(n.startswith(f"layer.{moe:02d}.expert.") for n in off.names)
    for cap in (off, forced):
        assert cap.names == plain.names
        for a, b in zip(plain.tensors, cap.tensors, strict=False):
            assert a.array.dtype == b.array.dtype and np.array_equal(a.array, b.array), a.name
        assert [d.name for d in cap.decisions] == [d.name for d in plain.decisions]
        for a, b in zip(plain.decisions, cap.decisions, strict=False):
            assert np.array_equal(a.values, b.values) and np.array_equal(a.margins, b.margins), (
                a.name
            )

    prov = cp.device_map_provenance(model, cp.RunConfig(device="cpu", device_map="auto"))
    assert prov["modules"] == dmap and prov["reported_by"] == "model.hf_device_map"
    assert prov["computed_on"] == {k: "cpu" for k in dmap}
    assert set(prov["devices"]) == {"cpu", "disk"}


def test_inputs_go_to_the_modules_execution_device():
    """The oracle sends token ids to the embedding's execution device and a `layer` input to the
    layer's, not to plain --device: a model accelerate puts wholly on GPU 1 gets no hook and
    failed with ids on GPU 0 (oracle/README.md). Constructing a device needs no GPU."""
    from types import SimpleNamespace

    rc = cp.RunConfig(device="cuda", device_map="auto")
    on_cpu = torch.nn.Linear(2, 2)
    assert cp.execution_device(on_cpu, rc) == torch.device("cpu")  # its weights, not rc.device
    hooked = torch.nn.Linear(2, 2)
    hooked._hf_hook = SimpleNamespace(execution_device=1)  # accelerate's AlignDevicesHook
    assert cp.execution_device(hooked, rc) == torch.device("cuda", 1)
    hooked._hf_hook = SimpleNamespace(execution_device="cpu")
    assert cp.execution_device(hooked, rc) == torch.device("cpu")
    with torch.device("meta"):
        offloaded = torch.nn.Linear(2, 2)  # weights put in place by a hook at forward time
    assert cp.execution_device(offloaded, rc) == torch.device("cuda")
    assert cp.execution_device(torch.nn.ReLU(), rc) == torch.device("cuda")
