"""A simulated quantized-activation candidate (issue 37 item 5; the basis of fixtures/policy/q8.json).

llama.cpp's CPU matmul with quantized weights does not multiply f32 activations: it first
quantizes each activation row to the weight type's `vec_dot_type` (ggml's type_traits_cpu) and
takes integer dot products. This tool runs transformers' own model class in f32 on a GGUF file's
dequantized weights — the oracle's model, exactly — with a forward pre-hook on every linear layer
that replaces its input by the round trip ggml's CPU path makes of it for that layer's GGUF weight
type (docs/numerics.md §21 and fixtures/policy/MEASUREMENTS.md, "Quantized activations"):

| weight type | activations become | round trip of a block |
| --- | --- | --- |
| Q8_0, Q4_0 | Q8_0 (32) | `d = amax/127` (f32), `q = roundf(x · (1/d))` (half away from zero), value `q · f16(d)` |
| Q4_1 | Q8_1 (32) | as Q8_0, and the block sum `s = f16(Σq · d)`: the weight block's min m enters as `m · s` |
| Q4_K, Q6_K | Q8_K (256) | `iscale = −127/max` (max: the signed value of largest magnitude, the first), `q = min(127, rne(iscale · x))`, value `q · (1/iscale)` (f32) |
| F16 / BF16 | f16 / bf16 | rounded to nearest even |
| F32 | f32 | unchanged |

(ggml's quantize_row_q8_0, quantize_row_q8_1, quantize_row_q8_K reference functions.) The
Q4_1 sum term is simulated exactly: a forward hook adds `m · (s − f16(d) · Σq)` per block, the
difference between ggml's product and the product with the round-tripped activations, with each
weight block's `m` read from the file. The integer dot products themselves are exact in ggml and
are here f32 products of the same values: what remains is f32 accumulation order (≈1e-7), far
below the 8-bit rounding this simulates. Not simulated: the KV cache's f16 storage and the f16
Q·K and P·V products of llama.cpp's attention, and the SIMD quantizers' own rounding (x86 AVX2
multiplies by 127/amax and rounds half to even: a one-step change where x·(1/d) lies at a
half-integer).

The trace it writes is the oracle's trace (taps.py's hooks) with provenance `producer`
`oracle-q8-activations` and an `activations` record of the scheme per linear: never mistaken for
the oracle. Commands:

    python -m tracegate_oracle.quantized_activations trace --model M.gguf --tokens 1,2,3 \\
        --generate 24 --capture internals --out q8.trace [--plant-down 9:1.05]
    python -m tracegate_oracle.quantized_activations measure --model M.gguf --frozen
    python -m tracegate_oracle.quantized_activations measure --model M.gguf \\
        --text "Write a short poem about the sea." --chat --tokenizer DIR --generate 24
    python -m tracegate_oracle.quantized_activations requantize IN.gguf OUT.gguf --type Q8_0|F16|F32

`measure` runs the oracle (f32) and the simulated candidate on one loaded model, and the engine
(`--engine`, `none` to skip), prefill or decode, capture internals, and prints the worst relative
L2, cosine and max abs per capture-point pattern against each reference, the decisions that flip,
and the verdict of fixtures/policy/q8.json; `--plant-down L:S` (repeatable) adds candidates
whose layer L MLP down projection is scaled by S. `requantize` writes a copy of a GGUF file whose
tensors other than F32 are written again in another type (F32, F16, Q8_0, ...: gguf.quants,
ggml's reference), metadata unchanged: a Q8_0, F16 or F32 model from a Q4_1 one.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import capture as cp
from . import checkpoint, cli, gguf_source
from . import measure_policy as mp
from .errors import OracleError
from .families import resolve
from .force import Forcing
from .records import write_trace
from .torch_setup import RunConfig, setup_torch

PROG = "python -m tracegate_oracle.quantized_activations"
PRODUCER = "oracle-q8-activations"
ROOT = Path(__file__).resolve().parents[2]

# The activation format ggml's CPU backend converts to for a weight of each GGUF type
# (type_traits_cpu[type].vec_dot_type); None: f32 activations, unchanged.
SCHEME = {
    "F32": None,
    "F16": "f16",
    "BF16": "bf16",
    "Q8_0": "q8_0",
    "Q4_0": "q8_0",
    "Q4_1": "q8_1",
    "Q4_K": "q8_K",
    "Q6_K": "q8_K",
}

# A decoder layer's linear modules (transformers' llama/qwen3 names) and their GGUF tensors.
_LINEAR = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# ---------------------------------------------------------------------------------------------
# the round trips (torch, f32 in and out)


def _roundf(v):
    """C's roundf of f32 values: half away from zero (torch.round is half to even). In f64,
    where |v| + 0.5 is exact for every f32 v below 2^52 (in f32, 0.49999997 + 0.5 rounds to 1)."""
    import torch

    w = v.double()
    # + 0: an int8 has no −0 (roundf(−0.3) is stored as 0)
    return (torch.sign(w) * torch.floor(w.abs() + 0.5)).float() + 0


def _blocks(x, n: int, path: str):
    if x.shape[-1] % n:
        raise OracleError(f"{path}: input width {x.shape[-1]} is not whole blocks of {n}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // n, n)


def q8_0_parts(x, path: str = "activation"):
    """ggml's quantize_row_q8_0 of each 32-value block of the last axis: (q, d, f16(d)), q and
    the scales f32, the scales shaped [..., blocks, 1]."""
    import torch

    b = _blocks(x.float(), 32, path)
    d = b.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = _roundf(b * inv)
    return q, d, d.to(torch.float16).float()


def q8_0(x, path: str = "activation"):
    """The Q8_0 round trip: each value q · f16(d), as ggml's dot product sees it."""
    q, _, d16 = q8_0_parts(x, path)
    return (q * d16).reshape(x.shape)


def q8_1_sum_error(x, path: str = "activation"):
    """Per 32-block, `s − f16(d)·Σq`: ggml's stored Q8_1 block sum `s = f16(Σq · d)` (d in f32)
    minus the sum of the round-tripped values, which a Q4_1 weight block's min multiplies."""
    import torch

    q, d, d16 = q8_0_parts(x, path)
    sq = q.sum(-1, keepdim=True)  # integers below 2^12: exact
    s16 = (sq * d).to(torch.float16).double()
    return (s16 - d16.double() * sq.double()).squeeze(-1)


def q8_K(x, path: str = "activation"):
    """ggml's quantize_row_q8_K round trip of each 256-value block: iscale = −127/max (max the
    first value of largest magnitude, signed), q = min(127, nearest_int(iscale·x)) (round half to
    even: the 1.5·2^23 trick), value q · (1/iscale); an all-zero block stays zero."""
    import torch

    b = _blocks(x.float(), 256, path)
    mx = b.gather(-1, b.abs().argmax(-1, keepdim=True))  # argmax: the first of equal maxima
    zero = mx == 0
    iscale = torch.where(zero, torch.ones_like(mx), -127 / torch.where(zero, 1, mx))
    q = torch.round(iscale * b).clamp(max=127) + 0  # + 0: no −0 in an int8
    out = torch.where(zero, torch.zeros_like(b), q * (1 / iscale))
    return out.reshape(x.shape)


def round_trip(scheme: str | None, x, path: str = "activation"):
    import torch

    if scheme is None:
        return x
    if scheme in ("q8_0", "q8_1"):
        return q8_0(x, path)
    if scheme == "q8_K":
        return q8_K(x, path)
    if scheme == "f16":
        return x.to(torch.float16).float()
    if scheme == "bf16":
        return x.to(torch.bfloat16).float()
    raise ValueError(f"unknown activation scheme {scheme!r}")


# ---------------------------------------------------------------------------------------------
# the linears of a model and their GGUF tensors


@dataclass
class Site:
    module: str  # transformers' module name
    tensor: str  # the GGUF tensor whose dequantized values are its weight
    gguf_type: str
    scheme: str | None
    mins: object = None  # Q4_1: each weight block's min m, [out_features, blocks] (torch f32)


def _row_order(w: np.ndarray, g: np.ndarray, module: str, tensor: str, path) -> np.ndarray:
    """Index into the file's rows of each row of `w` (transformers' order: llama's q/k rows are
    un-permuted), found by value; refused unless every row is one of the file's."""
    at = {}
    for i, row in enumerate(g):
        at.setdefault(row.tobytes(), i)
    idx = [at.get(row.tobytes()) for row in w]
    if None in idx or len(w) != len(g):
        raise OracleError(
            f"{path}: {module}.weight is not {tensor}'s dequantized rows "
            f"({sum(i is None for i in idx)} of {len(w)} rows not found)"
        )
    return np.asarray(idx)


def sites(model, path: Path) -> list[Site]:
    """Every nn.Linear of `model` with its GGUF tensor and activation scheme; refused: a linear
    with no tensor this table knows, a tensor type ggml's scheme is not written here for, and a
    weight that is not the tensor's dequantized values."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if name == "lm_head":
            tensor = "output.weight" if "output.weight" in tensors else "token_embd.weight"
        elif m and m.group(2) in _LINEAR:
            tensor = f"blk.{m.group(1)}.{_LINEAR[m.group(2)]}.weight"
        else:
            raise OracleError(f"{path}: linear {name}: no GGUF tensor known for it")
        t = tensors.get(tensor)
        if t is None:
            raise OracleError(f"{path}: linear {name}: the file has no {tensor}")
        kind = t.tensor_type.name
        if kind not in SCHEME:
            raise OracleError(f"{path}: {tensor} is {kind}: no activation scheme for it here")
        w = mod.weight.detach().float().cpu().numpy()
        g = dequantize(t.data, t.tensor_type).reshape(w.shape)
        order = _row_order(w, g, name, tensor, path)
        site = Site(name, tensor, kind, SCHEME[kind])
        if kind == "Q4_1":  # 20-byte blocks: f16 d, f16 m, 16 bytes of nibbles
            raw = np.asarray(t.data).reshape(len(g), -1, 20)
            mins = raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            site.mins = torch.from_numpy(mins[order]).to(mod.weight.device)
        out.append(site)
    return out


def checked_sites(model, path: Path) -> list[Site]:
    """`sites`, once per loaded model and file (the weight check dequantizes every tensor), taken
    before any plant changes a weight."""
    key = str(Path(path).resolve())
    cache = model.__dict__.setdefault("_tracegate_q8_sites", {})
    if key not in cache:
        cache[key] = sites(model, path)
    return cache[key]


@contextlib.contextmanager
def quantized_activations(model, found: list[Site]):
    """`model` with every linear's input replaced by ggml's CPU round trip for its weight type
    (and the Q4_1 sum term), until exit; yields the sites."""
    import torch

    handles = []
    try:
        for s in found:
            mod = model.get_submodule(s.module)
            if s.scheme is None:
                continue
            held = []

            def pre(m, args, s=s, held=held):
                x = args[0]
                if s.mins is not None:
                    held.append(q8_1_sum_error(x, s.module))
                return (round_trip(s.scheme, x, s.module).to(x.dtype), *args[1:])

            handles.append(mod.register_forward_pre_hook(pre))
            if s.mins is not None:

                def post(m, args, out, s=s, held=held):
                    e = held.pop()  # [..., blocks] f64
                    return out + (e @ s.mins.double().T).to(out.dtype)

                handles.append(mod.register_forward_hook(post))
        with torch.no_grad():
            yield found
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def planted(model, plants: list[tuple[int, float]]):
    """Layer L's MLP down projection times S for each (L, S), until exit (the weight restored)."""
    import torch

    lay = resolve(model)
    saved = []
    try:
        with torch.no_grad():
            for L, scale in plants:
                if not 0 <= L < len(lay.layers):
                    raise OracleError(f"--plant-down {L}:{scale}: no layer {L}")
                w = lay.mlp(L).down_proj.weight
                saved.append((w, w.detach().clone()))
                w.mul_(scale)
        yield
    finally:
        with torch.no_grad():
            for w, old in reversed(saved):
                w.copy_(old)


def describe(found: list[Site], plants) -> dict:
    """Provenance `activations`: the scheme per weight type and the linears under each."""
    by: dict = {}
    for s in found:
        e = by.setdefault(s.gguf_type, {"activations": s.scheme or "f32", "linears": 0})
        e["linears"] += 1
    out = {
        "simulates": "ggml CPU matmul: activations quantized to the weight type's vec_dot_type",
        "by_weight_type": by,
        "q4_1_sum_term": any(s.mins is not None for s in found),
        "not_simulated": "f16 KV cache and f16 attention products; SIMD quantizer rounding",
    }
    if plants:
        out["planted"] = [{"layer": L, "mlp.down_proj scale": s} for L, s in plants]
    return out


def capture(model, model_path, tokens, rc, det, plants=(), forcing=None):
    """The simulated candidate's capture of `tokens` (capture_prompt under the hooks; with
    `forcing`, the greedy tokens of the forcing trace, so its decode steps stay comparable)."""
    gguf = gguf_source.locate(model_path)
    if gguf is None:
        raise OracleError(
            f"--model {model_path}: not a GGUF file (the weight types set the scheme)"
        )
    found = checked_sites(model, gguf)
    with planted(model, list(plants)), quantized_activations(model, found):
        cap = cp.capture_prompt(model, model_path, tokens, rc, det, forcing=forcing)
    prov = dict(cap.provenance)
    prov["producer"] = PRODUCER
    prov["activations"] = describe(found, list(plants))
    cap.provenance = prov
    return cap


# ---------------------------------------------------------------------------------------------
# measurement


def _plant(text: str) -> tuple[int, float]:
    layer, colon, scale = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return int(layer), float(scale)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LAYER:SCALE, e.g. 9:1.05") from None


def _step(name: str) -> int | None:
    from tracegate.names import parse

    return parse(name).decode_step


def decode_divergence(ref, cand) -> tuple[int, float] | None:
    """(the first decode step whose greedy token differs, its |margin| / d: the reference margin
    over the largest logit difference of that step), or None."""
    steps = sorted(_step(n) for n in ref.decisions if _step(n) is not None)
    for s in steps:
        name = f"decode.{s:04d}.argmax"
        if name in cand.decisions and not np.array_equal(
            ref.decisions[name][0], cand.decisions[name][0]
        ):
            m = ref.decisions[name][1]
            lg = f"decode.{s:04d}.logits"
            d = float(np.abs(mp_real(ref.tensors[lg]) - mp_real(cand.tensors[lg])).max())
            return s, (abs(float(m[0])) / d if m is not None and d else float("nan"))
    return None


def mp_real(t) -> np.ndarray:
    return mp.real(t[0], t[1])


def measure(a) -> None:
    if a.text is not None:
        from tracegate import text

        tokens = {"text": text.prompt(a.tokenizer or a.model, a.text, a.chat)[0]}
    else:
        frozen = checkpoint.read_json_file(mp.FROZEN)["prompts"]
        tokens = {p["id"]: p["tokens"] for p in frozen}
    rc = RunConfig(capture="internals", generate=a.generate)
    det = setup_torch(rc)
    model = cp.load_model(a.model, rc)
    cands = {"q8": ()} | {f"q8 + down x{s:g} @ {L}": ((L, s),) for L, s in a.plant_down}
    runs: dict = {"oracle f32": {}} | {c: {} for c in cands}
    engine = None if a.engine == "none" else a.engine
    if engine:
        runs["engine f32"] = {}
    for pid, t in tokens.items():
        runs["oracle f32"][pid] = mp.from_plain(
            mp.plain(cp.capture_prompt(model, a.model, t, rc, det))
        )
        for c, plants in cands.items():
            runs[c][pid] = mp.from_plain(mp.plain(capture(model, a.model, t, rc, det, plants)))
    if engine:
        runs["engine f32"] = mp.engine_runs(a.model, engine, tokens, a.generate)
    f32_policy = checkpoint.read_json_file(mp.POLICIES / "oracle-default.json")
    q8_path = mp.POLICIES / "q8.json"
    policy = checkpoint.read_json_file(q8_path) if q8_path.exists() else None
    pattern_of = lambda n: (mp.rule_for(f32_policy, n) or {}).get("pattern", "(no rule)")  # noqa: E731
    refs = [r for r in ("oracle f32", "engine f32") if r in runs]
    saved: dict = {}
    what = (
        f"text prompt ({len(tokens.get('text', []))} tokens)" if a.text else "every frozen prompt"
    )
    print(f"\n### {Path(a.model).name}: {what}, generate {a.generate}, capture internals\n")
    for c in cands:
        res, cut = {}, {}
        for r in refs:
            res[r] = mp.Result()
            for pid in tokens:
                mp.measure_pair(runs[r][pid], runs[c][pid], pid, pattern_of, res[r])
                cut[(r, pid)] = decode_divergence(runs[r][pid], runs[c][pid])
            # A decode step after the first flipped token runs on another sequence: not compared
            # (trace-diff puts it after a near-tie, or fails the flip).
            res[r].per_tensor = [
                x
                for x in res[r].per_tensor
                if cut[(r, x[0])] is None or _step(x[1]) is None or _step(x[1]) <= cut[(r, x[0])][0]
            ]
        agg = {r: mp.aggregate(res[r].per_tensor) for r in refs}
        print(f"\n#### {c} against {' and '.join(refs)}\n")
        print(
            "| pattern | tensors | "
            + " | ".join(f"max rel L2 vs {r}" for r in refs)
            + " | min cosine (1 − cos) | max abs | worst rel L2 at |"
        )
        print("| --- | ---: | " + " | ".join("---:" for _ in refs) + " | ---: | ---: | --- |")
        for p in agg[refs[0]]:
            w = [agg[r][p] for r in refs]
            worst = max(w, key=lambda x: x["rel_l2"])
            print(
                f"| `{p}` | {w[0]['n']} | "
                + " | ".join(mp.fmt3(x["rel_l2"]) for x in w)
                + f" | {mp.fmt3(1 - min(x['cosine'] for x in w))} | "
                f"{mp.fmt3(max(x['max_abs'] for x in w))} | {worst['where']} |"
            )
        for (r, pid), d in cut.items():
            if d is not None:
                print(
                    f"\nvs {r}, {pid}: greedy tokens differ from decode step {d[0]} "
                    f"(|m|/d {d[1]:.3g}; later steps left out)"
                )
        for r in refs:
            x = res[r]
            flips = "; ".join(
                f"{f['prompt']} {f['name']} row {f['row']} {f['reference']}->{f['candidate']}"
                f" |m|/d {abs(f['margin']) / f['d']:.3g}"
                if f["margin"] is not None and f["d"]
                else f"{f['prompt']} {f['name']} row {f['row']}"
                for f in x.flips
            )
            print(f"\nvs {r}: {len(x.flips)} of {x.decision_rows} decision rows differ. {flips}")
        se = lambda pts: [(x[3]["scale_error"], x[0], x[1]) for x in pts]  # noqa: E731
        for L, s in cands[c]:
            at = re.compile(rf"(decode\.\d+\.)?layer\.{L:02d}\.mlp_out")
            for kind in ("prefill", "decode"):
                st = se(
                    p
                    for p in res["oracle f32"].per_tensor
                    if at.fullmatch(p[1]) and p[1].startswith("decode.") == (kind == "decode")
                )
                if st:
                    print(
                        f"\nplanted layer {L} x{s:g}, {kind} layer.{L:02d}.mlp_out vs oracle f32: "
                        f"scale error {min(st)[0]:+.4g} to {max(st)[0]:+.4g} ({len(st)} tensors)"
                    )
        if c == "q8":  # the honest candidate's mlp_out scale error: what a plant must exceed
            for kind in ("prefill", "decode"):
                st = se(
                    p
                    for p in res["oracle f32"].per_tensor
                    if p[1].endswith(".mlp_out")
                    and p[1].startswith("decode.") == (kind == "decode")
                )
                if st:
                    top = sorted(st, key=lambda x: -abs(x[0]))[:3]
                    print(
                        f"\nhonest {kind} mlp_out vs oracle f32: scale error {min(st)[0]:+.4g} to "
                        f"{max(st)[0]:+.4g} over {len(st)} tensors; largest "
                        + ", ".join(f"{v:+.4g} {n} ({pr})" for v, pr, n in top)
                    )
        if a.save:
            saved[c] = {r: res[r].per_tensor for r in refs}
        if policy is not None:
            for r in refs:
                n, bad = mp.judge(policy, res[r].per_tensor, kept=True)
                first = {}
                for pr, nm, v in bad:
                    first.setdefault(pr, (nm, v))
                print(
                    f"\nunder {q8_path.relative_to(ROOT)} vs {r} (no near-tie rows): "
                    f"{n - len(bad)} of {n} within"
                    + (
                        ""
                        if not bad
                        else "; first outside per prompt: "
                        + "; ".join(f"{pr}: {nm} ({', '.join(v)})" for pr, (nm, v) in first.items())
                    )
                )
    if a.save:  # every tensor's quantities, to judge another policy without the runs
        import pickle

        with open(a.save, "wb") as f:
            pickle.dump(saved, f)


# ---------------------------------------------------------------------------------------------
# a Q8_0 (or other) copy of a GGUF file


def requantize(src: str, dst: str, qtype: str) -> None:
    """`dst`: `src` with every tensor that is not F32 dequantized and written again as `qtype`
    (F32, F16, or a type gguf.quants quantizes, e.g. Q8_0: ggml's reference quantizer); F32
    tensors (the norms) and every metadata field copied, `general.file_type` set to what the
    file now mostly holds. From a Q4_1 file the values are the Q4_1 ones re-rounded: every
    producer then runs the new file, so what is compared is the same weights."""
    import gguf
    from gguf.quants import dequantize, quantize

    try:
        target = gguf.GGMLQuantizationType[qtype.upper()]
    except KeyError:
        raise OracleError(f"--type {qtype}: not a GGML type (F32, F16, Q8_0, ...)") from None
    file_type = {"F32": "ALL_F32"}.get(target.name, f"MOSTLY_{target.name}")
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        vt = f.types[0]
        if f.name == "general.file_type":
            w.add_key_value(f.name, int(gguf.LlamaFileType[file_type]), vt)
            continue
        sub = f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), vt, sub_type=sub)
    for t in r.tensors:
        kind = t.tensor_type
        if kind == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        x = dequantize(t.data, kind).reshape(shape).astype(np.float32)
        if target == gguf.GGMLQuantizationType.F32:
            w.add_tensor(t.name, x)
        elif target == gguf.GGMLQuantizationType.F16:
            w.add_tensor(t.name, x.astype(np.float16))
        else:
            w.add_tensor(t.name, quantize(x, target), raw_dtype=target)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---------------------------------------------------------------------------------------------
# command line


def _trace(a) -> int:
    rc = RunConfig(
        capture=a.capture,
        generate=a.generate,
        cache=a.cache,
        threads=a.threads,
        seed=a.seed if a.seed is not None else 0,
    )
    tokens, prompt_text = cli.prompt_of(a)
    out = cli.check_out(a.out)
    # A greedy token that flips at a near-tie puts the later decode steps on another sequence;
    # forced to the reference's tokens they stay comparable (docs/producers.md, forced decisions).
    forcing = Forcing(a.force_decisions) if a.force_decisions is not None else None
    det = setup_torch(rc)
    model = cp.load_model(a.model, rc)
    cap = capture(model, a.model, tokens, rc, det, a.plant_down, forcing)
    if prompt_text is not None:
        cap.provenance = cli.insert_after(
            cap.provenance, "prompt_tokens", "prompt_text", prompt_text
        )
    print(f"{write_trace(cap, out)} {out}")
    return 0


def parser() -> argparse.ArgumentParser:
    from tracegate import protocol

    g = protocol.parser(PROG, __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    t = g.trace
    t.add_argument("--threads", type=protocol.at_least(1), default=1)
    # --seed is the protocol's (here torch's seed; absent: 0)
    t.add_argument(
        "--plant-down",
        type=_plant,
        action="append",
        default=[],
        metavar="L:S",
        help="a planted defect: layer L's MLP down projection times S (repeatable)",
    )
    return g.parser


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        if args[:1] == ["measure"]:
            m = argparse.ArgumentParser(prog=f"{PROG} measure")
            m.add_argument("--model", required=True, help="a .gguf file")
            m.add_argument("--frozen", action="store_true", help="every frozen prompt (default)")
            m.add_argument("--text")
            m.add_argument("--chat", action="store_true")
            m.add_argument("--tokenizer", help="--text: the directory holding the tokenizer")
            m.add_argument("--generate", type=int, default=0)
            m.add_argument("--engine", default=str(ROOT / "target" / "release" / "engine"))
            m.add_argument("--plant-down", type=_plant, action="append", default=[])
            m.add_argument("--save", metavar="FILE", help="pickle of every tensor's quantities")
            measure(m.parse_args(args[1:]))
            return 0
        if args[:1] == ["requantize"]:
            m = argparse.ArgumentParser(prog=f"{PROG} requantize")
            m.add_argument("src")
            m.add_argument("dst")
            m.add_argument("--type", default="Q8_0")
            a = m.parse_args(args[1:])
            try:
                requantize(a.src, a.dst, a.type)
            except (OSError, ValueError) as e:
                raise OracleError(f"requantize {a.src} -> {a.dst}: {e}") from None
            print(a.dst)
            return 0
        a = parser().parse_args(args)
        if a.verb != "trace":
            print(f"{PROG}: error: only the trace verb is simulated", file=sys.stderr)
            return 2
        return _trace(a)
    except OracleError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
