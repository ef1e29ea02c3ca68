"""`trace --text TEXT [--chat]`: the contract tokenizes with the model dir's own tokenizer
(tracegate.text) and writes the trace the same ids give as `--tokens` (same digest: provenance is
not part of it), recording `prompt_text` beside `prompt_tokens`; transformers is imported only
for --text; refusals are one line, exit 2."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from tracegate import Trace
from tracegate.text import TOKENIZER_FILES, tokenizer_digest
from tracegate_contract.__main__ import main

from conftest import ROOT

_spec = importlib.util.spec_from_file_location(
    "tiny_tokenizer", os.path.join(ROOT, "binding", "tests", "tiny_tokenizer.py")
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)

TEXT = "hello world the cat sat"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.model_with_tokenizer(tmp_path_factory.mktemp("contract-text") / "model")


def _ids(model, s: str, special: bool = True) -> list[int]:
    """The `tokenizers` library's own encoding: what --text must come to."""
    from tokenizers import Tokenizer

    return (
        Tokenizer.from_file(str(model / "tokenizer.json")).encode(s, add_special_tokens=special).ids
    )


def _run(*args) -> int:
    return main([str(a) for a in args])


def _module(*args) -> tuple[subprocess.CompletedProcess, set[str]]:
    """`python -m tracegate_contract ARGS` in a fresh process, and the modules it imported
    (-X importtime lists each on stderr)."""
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "tracegate_contract", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {
        line.rsplit("|", 1)[1].strip()
        for line in p.stderr.splitlines()
        if line.startswith("import time:") and "|" in line
    }
    return p, imported


def test_text_trace_is_the_tokens_trace(model, tmp_path):
    ids = _ids(model, TEXT)
    assert len(ids) == 6 and ids[0] == 1
    by_text, by_tokens = tmp_path / "text.trace", tmp_path / "tokens.trace"
    common = ["--model", model, "--capture", "internals"]
    t, t_imported = _module("trace", *common, "--text", TEXT, "--out", by_text)
    assert t.returncode == 0, t.stderr
    k, k_imported = _module(
        "trace", *common, "--tokens", ",".join(map(str, ids)), "--out", by_tokens
    )
    assert k.returncode == 0, k.stderr
    # transformers is imported for --text only (the --text run is the probe's control).
    assert "transformers" in t_imported and "tracegate.text" in t_imported
    assert "transformers" not in k_imported and "tracegate.text" not in k_imported
    a, b = Trace(str(by_text)), Trace(str(by_tokens))
    assert t.stdout.split() == [a.digest, str(by_text)]
    assert k.stdout.split() == [b.digest, str(by_tokens)]
    assert a.digest == b.digest
    assert a.names == b.names
    pa, pb = a.provenance, b.provenance
    assert pa["prompt_tokens"] == pb["prompt_tokens"] == ids
    assert pa["prompt_text"] == {
        "text": TEXT,
        "chat": False,
        "template": None,
        "tokenizer_digest": tokenizer_digest(model),
    }
    assert "prompt_text" not in pb
    keys = list(pa)
    assert keys.index("prompt_text") == keys.index("prompt_tokens") + 1


def test_chat_text_trace_is_the_tokens_trace_of_the_template(model, tmp_path):
    ids = [3, *_ids(model, "the dog ran", special=False), 4]  # <|user|> ... <|assistant|>
    a, b = tmp_path / "chat.trace", tmp_path / "ids.trace"
    common = ["--generate", "2", "--cache", "off"]
    assert (
        _run("trace", "--model", model, "--text", "the dog ran", "--chat", "--out", a, *common) == 0
    )
    assert (
        _run("trace", "--model", model, "--tokens", ",".join(map(str, ids)), "--out", b, *common)
        == 0
    )
    ta, tb = Trace(str(a)), Trace(str(b))
    assert ta.digest == tb.digest
    assert ta.provenance["prompt_tokens"] == ids
    assert ta.provenance["prompt_text"]["chat"] is True
    assert ta.provenance["prompt_text"]["template"] == tiny.CHAT_TEMPLATE


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--model", "fixtures/tiny-qwen3", "--text", "hello"],
            "error: fixtures/tiny-qwen3: no tokenizer (looked for "
            + ", ".join(TOKENIZER_FILES)
            + ")",
        ),
        (["--model", "M", "--tokens", "1,20", "--chat"], "error: --chat goes only with --text"),
        (
            ["--model", "M", "--tokens", "1,20", "--text", "hi"],
            "error: argument --text: not allowed with",
        ),
        (["--model", "M"], "error: one of the arguments --tokens --text is required"),
        (["--model", "M", "--text", ""], "error: argument --text: the text is empty"),
    ],
)
def test_refusals_are_one_line(argv, message, model, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    argv = [str(model) if a == "M" else a for a in argv]
    assert _run("trace", *argv, "--out", tmp_path / "x.trace") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(message), err
    assert not (tmp_path / "x.trace").exists()


def test_chat_without_a_template_is_refused(tmp_path, capsys):
    d = tiny.model_with_tokenizer(tmp_path / "m", chat_template=None)
    assert _run("trace", "--model", d, "--text", "hello", "--chat", "--out", tmp_path / "x") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --chat: the tokenizer in {d} has no chat template"), err


def test_the_engine_takes_text_to_the_contracts_trace(model, tmp_path):
    """`engine trace --text` tokenizes through tracegate.text, so its ids are the contract's:
    the two traces of one text are bit-identical, and the engine records the same prompt_text."""
    from test_engine_identity import ENGINE

    engine_out, contract_out = tmp_path / "engine.trace", tmp_path / "contract.trace"
    common = ["--model", str(model), "--text", TEXT, "--chat", "--generate", "2"]
    e = subprocess.run(
        [ENGINE, "trace", *common, "--out", str(engine_out)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "TRACEGATE_PYTHON": sys.executable},
    )
    assert e.returncode == 0, e.stderr
    assert _run("trace", *common, "--out", contract_out) == 0
    a, b = Trace(str(engine_out)), Trace(str(contract_out))
    assert a.digest == b.digest
    assert a.provenance["prompt_text"] == b.provenance["prompt_text"]
    assert a.provenance["prompt_text"]["chat"] is True
    # Negative control: --chat without --text is refused in one line.
    r = subprocess.run(
        [ENGINE, "trace", "--model", str(model), "--tokens", "1", "--chat", "--out", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "--chat: only with --text" in r.stderr, r.stderr
