"""Build the llama.cpp producer and measure it against a reference (README.md).

    .venv/bin/python examples/llamacpp/llamacpp.py build OUT
    .venv/bin/python examples/llamacpp/llamacpp.py measure --model FILE.gguf [--reference oracle]

llama.cpp comes from PyPI: `llama-cpp-python==0.3.36` (requirements-llamacpp.txt) builds it from
source and installs its headers in site-packages/include and its libraries in
site-packages/llama_cpp/lib; nothing of its Python side is imported here.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PIN = "llama-cpp-python==0.3.36"
# SmolLM2's chat template on "What is the capital of France?" (python -m tracegate.text --chat
# on the converted model directory).
CHAT_TOKENS = (
    "1,9690,198,2683,359,253,5356,5646,11173,3365,3511,308,34519,28,7018,411,407,19712,8182,2,"
    "198,1,4093,198,1780,314,260,3575,282,4649,47,2,198,1,520,9531,198"
)


def find() -> tuple[tuple[Path, Path] | None, str | None]:
    """((include dir, lib dir), None) when llama.cpp is installed in this Python's
    site-packages, else (None, the reason)."""
    site = Path(sysconfig.get_paths()["purelib"])
    include, lib = site / "include", site / "llama_cpp" / "lib"
    for need in (include / "llama.h", include / "ggml-backend.h", lib / "libllama.so"):
        if not need.is_file():
            return None, (
                f"llama.cpp is not installed in {site}: {need} is absent; install it with "
                f"`{sys.executable} -m pip install -r requirements-llamacpp.txt` ({PIN}, built "
                "from source: about 5 minutes on 2 cores), as scripts/setup.sh does"
            )
    return (include, lib), None


def capi() -> tuple[Path, str | None]:
    lib = ROOT / "target" / "release" / "libtracegate_capi.so"
    if lib.is_file():
        return lib, None
    return lib, f"{lib} is absent: build it with cargo build --release -p tracegate-capi"


def command(out: Path, include: Path, lib: Path) -> list[str]:
    """The one compiler command line (README.md, "Build")."""
    release = ROOT / "target" / "release"
    return [
        "c++", "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror",
        str(HERE / "producer.cpp"), "-o", str(out),
        "-I", str(include), "-I", str(ROOT / "capi" / "include"),
        "-L", str(lib), "-lllama", "-lggml", "-lggml-base",
        "-L", str(release), "-ltracegate_capi",
        f"-Wl,-rpath,{lib}", f"-Wl,-rpath,{release}",
    ]  # fmt: skip


def build(out: Path) -> Path:
    found, why = find()
    _, why_capi = capi()
    if why or why_capi:
        raise SystemExit(f"llamacpp.py build: {why or why_capi}")
    include, lib = found
    r = subprocess.run(command(out, include, lib), capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"llamacpp.py build: c++ exited {r.returncode}:\n{r.stderr[-4000:]}")
    return out


def kind(name: str) -> str:
    """A capture point's kind: its name with the layer and decode step numbers left out."""
    return re.sub(r"\.\d{2,4}\.", ".*.", re.sub(r"\.\d{2,4}\.", ".*.", name))


def summarize(report: dict) -> list[str]:
    """Worst relative L2 (and lowest cosine) per capture point kind, the first violation, the
    decisions: what `measure` prints."""
    worst: dict[str, tuple[float, float, str]] = {}
    for t in report["per_tensor"]:
        k, rel, cos = kind(t["tensor"]), t["rel_l2"], t["cosine"]
        if rel is None:
            continue
        old = worst.get(k)
        if old is None or rel > old[0]:
            worst[k] = (rel, min(cos, old[1]) if old else cos, t["tensor"])
        else:
            worst[k] = (old[0], min(cos, old[1]), old[2])
    lines = [f"verdict {report['verdict']}"]
    fv = report.get("first_violation")
    if fv:
        v = "; ".join(f"{x['bound']} {x['value']:.4g} > {x['limit']:.4g}" for x in fv["violations"])
        lines.append(f"first violation {fv['tensor']}: {v}")
    lines.append(f"{'kind':34} {'worst rel L2':>13} {'min cosine':>12}  at")
    for k, (rel, cos, at) in worst.items():
        lines.append(f"{k:34} {rel:13.3e} {cos:12.8f}  {at}")
    d = report["decisions"]
    lines.append(f"decisions {d['compared']} compared, {d['differing']} differ")
    steps = [r["name"] for r in d["results"] if r["name"].startswith("decode.") and r.get("flips")]
    if steps:
        lines.append(
            f"  (from {steps[0]} on the two sides generated other tokens: the decode steps after "
            "it compare different inputs)"
        )
    for res in d["results"]:
        for f in res.get("flips") or []:
            lines.append(
                f"  {res['name']} row {f['row']}: {f['reference']} vs {f['candidate']}, margins "
                f"{f['reference_margin']:.4g} vs {f['candidate_margin']:.4g}, source divergence "
                f"{f['source_divergence']:.4g}: {f['label']}"
                + (f" of {f['upstream']}" if f.get("upstream") else "")
            )
    return lines


def run(cmd: list[str]) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"$ {' '.join(cmd)}\nexit {r.returncode}: {r.stderr[-2000:]}")


def measure(a: argparse.Namespace) -> None:
    work = Path(a.work or tempfile.mkdtemp(prefix="llamacpp-measure-"))
    work.mkdir(parents=True, exist_ok=True)
    producer = build(work / "llamacpp-producer")
    args = ["--model", a.model, "--tokens", a.tokens, "--capture", "internals"]
    args += ["--generate", str(a.generate), "--cache", "on"]
    ref, cand = work / f"{a.reference}.trace", work / "llamacpp.trace"
    if a.reference == "engine":
        run([str(ROOT / "target/release/engine"), "trace", *args, "--out", str(ref)])
    else:
        run([sys.executable, "-m", "tracegate_oracle", "trace", *args, "--out", str(ref)])
    run([str(producer), "trace", *args, "--out", str(cand)])
    diff = [str(ROOT / "target/release/trace-diff"), str(ref), str(cand), "--policy", "f32"]
    r = subprocess.run([*diff, "--json"], capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise SystemExit(f"$ {' '.join(diff)} --json\nexit {r.returncode}: {r.stderr}")
    print(f"$ {' '.join(diff)}")
    print("\n".join(summarize(json.loads(r.stdout))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="verb", required=True)
    b = sub.add_parser("build", help="compile producer.cpp to OUT")
    b.add_argument("out", type=Path)
    m = sub.add_parser(
        "measure", help="trace-diff --policy f32 of the producer against a reference"
    )
    m.add_argument("--model", required=True, help="a .gguf file")
    m.add_argument("--tokens", default=CHAT_TOKENS, help="default: SmolLM2's chat prompt")
    m.add_argument("--generate", type=int, default=4)
    m.add_argument("--reference", choices=("oracle", "engine"), default="oracle")
    m.add_argument("--work", help="where the binary and traces go (default: a new temp dir)")
    a = ap.parse_args()
    if a.verb == "build":
        print(build(a.out))
    else:
        measure(a)


if __name__ == "__main__":
    main()
