"""`trace --text TEXT [--chat]` in the oracle: tokenized by the model dir's own tokenizer
(tracegate.text), the trace is the one the same ids give as `--tokens` (same digest), with
provenance `prompt_text` beside `prompt_tokens`; the contract and the oracle refuse the same
--tokens/--text/--chat command lines."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from oracle_runner import run_oracle
from tracegate import Trace
from tracegate.text import TOKENIZER_FILES, tokenizer_digest
from tracegate_contract import ContractError
from tracegate_contract.__main__ import parser as contract_parser
from tracegate_oracle.cli import main
from tracegate_oracle.cli import parser as oracle_parser

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "tiny_tokenizer", ROOT / "binding" / "tests" / "tiny_tokenizer.py"
)
tiny = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tiny)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny.model_with_tokenizer(tmp_path_factory.mktemp("oracle-text") / "model")


def _ids(model, s: str, special: bool = True) -> list[int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    return tok.encode(s, add_special_tokens=special).ids


def _run(*args) -> int:
    return main([str(a) for a in args])


def test_chat_text_as_a_module_is_the_tokens_trace(model, tmp_path):
    ids = [3, *_ids(model, "hello world the cat", special=False), 4]
    by_text, by_tokens = tmp_path / "text.trace", tmp_path / "tokens.trace"
    p = run_oracle(
        *["trace", "--model", model, "--text", "hello world the cat", "--chat"],
        *["--out", by_text, "--generate", "2"],
        cwd=ROOT,
        timeout=120,
    )
    assert p.returncode == 0, p.stderr
    tokens = ",".join(map(str, ids))
    assert (
        _run("trace", "--model", model, "--tokens", tokens, "--out", by_tokens, "--generate", "2")
        == 0
    )
    a, b = Trace(str(by_text)), Trace(str(by_tokens))
    assert p.stdout.split() == [a.digest, str(by_text)]
    assert a.digest == b.digest
    pa, pb = a.provenance, b.provenance
    assert pa["prompt_tokens"] == pb["prompt_tokens"] == ids
    assert pa["prompt_text"] == {
        "text": "hello world the cat",
        "chat": True,
        "template": tiny.CHAT_TEMPLATE,
        "tokenizer_digest": tokenizer_digest(model),
    }
    assert "prompt_text" not in pb
    keys = list(pa)
    assert keys.index("prompt_text") == keys.index("prompt_tokens") + 1


def test_plain_text_is_the_tokens_trace(model, tmp_path):
    ids = _ids(model, "the cat sat on a mat")
    assert ids[0] == 1  # the tokenizer's BOS
    a, b = tmp_path / "a.trace", tmp_path / "b.trace"
    assert _run("trace", "--model", model, "--text", "the cat sat on a mat", "--out", a) == 0
    assert _run("trace", "--model", model, "--tokens", ",".join(map(str, ids)), "--out", b) == 0
    ta, tb = Trace(str(a)), Trace(str(b))
    assert ta.digest == tb.digest
    assert ta.provenance["prompt_tokens"] == ids
    assert ta.provenance["prompt_text"]["chat"] is False
    assert ta.provenance["prompt_text"]["template"] is None


def test_text_without_a_tokenizer_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "x.trace"
    assert _run("trace", "--model", "fixtures/tiny-qwen3", "--text", "hello", "--out", out) == 2
    err = capsys.readouterr().err
    want = "fixtures/tiny-qwen3: no tokenizer (looked for " + ", ".join(TOKENIZER_FILES) + ")"
    assert err == f"python -m tracegate_oracle trace: error: {want}\n"
    assert not out.exists()


TRACE = ["trace", "--model", "m", "--out", "o.trace"]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # neither --tokens nor --text
        ["--tokens", "1,2", "--text", "hi"],
        ["--text", "hi", "--tokens", "1,2"],
        ["--tokens", "1,2", "--chat"],
        ["--chat"],
        ["--text", ""],
    ],
    ids=["neither", "both", "both-reversed", "chat-with-tokens", "chat-alone", "empty-text"],
)
def test_both_producers_refuse_the_same_prompt_flags(extra, capsys):
    with pytest.raises(ContractError) as c:
        contract_parser().parse_args(TRACE + extra)
    with pytest.raises(SystemExit) as o:
        oracle_parser().parse_args(TRACE + extra)
    assert o.value.code == 2
    assert str(c.value) in capsys.readouterr().err


def test_both_producers_parse_text_alike():
    argv = TRACE + ["--text", "hello world", "--chat"]
    c, o = contract_parser().parse_args(argv), oracle_parser().parse_args(argv)
    assert (c.tokens, c.text, c.chat) == (o.tokens, o.text, o.chat) == (None, "hello world", True)
