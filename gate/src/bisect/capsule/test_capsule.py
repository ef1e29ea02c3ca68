"""A tracegate repro capsule as a test of your port's own suite (docs/bisect.md, "Capsules").

`gate bisect --capsule DIR` writes this file beside the capsule's manifest.json; run it with
pytest (`pytest DIR/test_capsule.py`). It checks the capsule (every file's sha256), rebuilds the
replay model from it (config.json and the layer's weights; every other tensor zero), runs the
candidate's `layer` verb on the reference's input rows and checks the candidate's outputs against
the reference's under the capsule's rule: policy.json, or bit for bit. A decode-step capsule
(manifest.json `decode`) runs `layer --decode-from P` on input.trace (the layer's input rows at
positions 0..P) as the bisection's decode isolation did, and checks its row at P. A noise run,
when the capsule has one (noise.trace), is read by `gate capsule run`, not here.

The candidate is the bisection's (manifest.json bisection.candidate_words), run in the project
root it ran in; TRACEGATE_CAPSULE_CANDIDATE (a command template: {verb} and {args} filled in, as
the gate's) and TRACEGATE_CAPSULE_ROOT replace them.
"""

import hashlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import numpy as np
import tracegate

CAPSULE = Path(__file__).resolve().parent


def manifest() -> dict:
    raw = (CAPSULE / "manifest.json").read_bytes()
    want = (CAPSULE / "manifest.sha256").read_text().split()[0]
    got = hashlib.sha256(raw).hexdigest()
    assert got == want, (
        f"manifest.json was changed: its sha256 is {got}, manifest.sha256 records {want}"
    )
    m = json.loads(raw)
    for name, want in m["files"].items():
        got = hashlib.sha256((CAPSULE / name).read_bytes()).hexdigest()
        assert got == want, f"{name} was changed: its sha256 is {got}, manifest.json records {want}"
    return m


def materialise(m: dict, out: Path) -> None:
    """The replay model: the header recorded in the manifest, the layer's tensors at their
    offsets, zeros (a hole) elsewhere; the same bytes `gate capsule run` writes."""
    if m["weights"].get("format") == "gguf":
        return materialise_gguf(m, out)
    header = m["weights"]["replay_header"].encode()
    layout = json.loads(header)
    layer = (CAPSULE / "layer.safetensors").read_bytes()
    n = int.from_bytes(layer[:8], "little")
    own = json.loads(layer[8 : 8 + n])
    start = 8 + len(header)
    total = max(v["data_offsets"][1] for k, v in layout.items() if k != "__metadata__")
    out.mkdir()
    (out / "config.json").write_bytes((CAPSULE / "config.json").read_bytes())
    with open(out / "model.safetensors", "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for name, v in own.items():
            if name == "__metadata__":
                continue
            b, e = v["data_offsets"]
            f.seek(start + layout[name]["data_offsets"][0])
            f.write(layer[8 + n + b : 8 + n + e])
        f.truncate(start + total)
    digest = tracegate.weights_digest(out)
    want = m["weights"]["replay_weights_digest"]
    assert digest == want, f"replay model's weights digest {digest}, manifest.json records {want}"


def materialise_gguf(m: dict, out: Path) -> None:
    """A GGUF capsule's replay model, `model.gguf`: the manifest's header, each of the layer's
    blocks at its `replay_offsets`, zeros (a hole) to `replay_length`."""
    w = m["weights"]
    layer = (CAPSULE / "layer.safetensors").read_bytes()
    n = int.from_bytes(layer[:8], "little")
    own = json.loads(layer[8 : 8 + n])
    out.mkdir()
    with open(out / "model.gguf", "wb") as f:
        f.write(bytes.fromhex(w["replay_header_hex"]))
        for name, v in own.items():
            if name == "__metadata__":
                continue
            b, e = v["data_offsets"]
            f.seek(w["replay_offsets"][name][0])
            f.write(layer[8 + n + b : 8 + n + e])
        f.truncate(w["replay_length"])
    digest = tracegate.weights_digest(out)
    want = w["replay_weights_digest"]
    assert digest == want, f"replay model's weights digest {digest}, manifest.json records {want}"


def argv(m: dict, args: list) -> list:
    template = os.environ.get("TRACEGATE_CAPSULE_CANDIDATE")
    words = shlex.split(template) if template else m["bisection"]["candidate_words"]
    out, placed = [], False
    for w in words:
        if w == "{args}":
            out += args
            placed = True
        elif w == "{verb|serve}":
            out.append("layer")
        else:
            out.append(w.replace("{verb}", "layer"))
    return out if placed else out + args


def cut_to_heads(m, path, out):
    """A head-reduced capsule (manifest units.heads.judged.slices) holds the kept heads' slices
    of its per-head points: the candidate's layer input and those points, cut to the same heads
    along each point's head axis, as gate capsule run cuts them; nothing else of the trace."""
    slices = m["units"]["heads"]["judged"]["slices"]
    t = tracegate.Trace(path)
    keep = [f"layer.{m['layer']:02d}.hidden_in", *slices]
    with tracegate.TraceWriter(out, t.provenance) as w:
        for name in [n for n in t.names if n in keep]:
            a = t[name]
            if name in slices:
                s = slices[name]
                assert a.ndim > s["axis"] and max(s["heads"]) < a.shape[s["axis"]], (
                    f"{name}: the candidate's shape {list(a.shape)} has no head "
                    f"{max(s['heads'])} on axis {s['axis']}"
                )
                a = np.ascontiguousarray(np.take(a, s["heads"], axis=s["axis"]))
            attrs = t.attributes(name)
            fixed = {k: attrs.pop(k, None) for k in ("path", "mask", "positions", "step")}
            w.tensor(name, a, dtype=t.dtype(name), **fixed, **attrs)
    return out


def test_the_candidates_layer_agrees_with_the_capsule(tmp_path):
    m = manifest()
    model = tmp_path / "model"
    materialise(m, model)
    out = tmp_path / "candidate.trace"
    layer = m["layer"]
    args = ["--model", str(model), "--layer", str(layer)]
    decode = m.get("decode")
    rows = decode["input"] if decode else "reference.trace"
    args += ["--input", str(CAPSULE / rows)]
    args += ["--input-name", f"layer.{layer:02d}.hidden_in", "--out", str(out)]
    args += ["--capture", m["capture"]]
    if decode:
        args += ["--decode-from", str(decode["position"])]
    root = os.environ.get("TRACEGATE_CAPSULE_ROOT", m["bisection"]["root"])
    run = subprocess.run(argv(m, args), cwd=root, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (
        f"the layer verb failed (exit {run.returncode}): {run.stderr[-2000:]}"
    )
    heads = (m.get("units") or {}).get("heads") or {}
    if heads.get("reduced"):
        out = cut_to_heads(m, out, tmp_path / "candidate.heads.trace")
    candidate = tracegate.Trace(out)
    # Judged as the bisection judged: the candidate's capture points only.
    only = list(candidate.names) + list(candidate.decisions)
    policy = CAPSULE / "policy.json" if m["judge"]["by"] == "policy" else None
    report = tracegate.compare(CAPSULE / "reference.trace", out, policy=policy, only=only)
    assert report.ok, (
        f"layer {layer:02d} disagrees with the capsule ({report.verdict}): "
        f"first violation {json.dumps(report.first_violation)}; "
        f"first bit difference {json.dumps(report.first_bit_difference)}"
    )
