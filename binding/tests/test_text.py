"""tracegate.text: the tokenizer digest (against hashlib over bytes written here, and pinned known
answers a Rust twin can copy), tokenizing through AutoTokenizer as the `tokenizers` library
encodes, the chat template, every refusal, the `python -m tracegate.text` command line (--text
and --prompts) and the protocol's --text/--chat grammar."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys

import pytest
from tiny_tokenizer import CHAT_TEMPLATE, ROOT, SPECIAL, model_with_tokenizer, write_tokenizer
from tracegate import protocol, text
from tracegate.text import TOKENIZER_FILES, TextError, tokenize, tokenizer_digest

# Two known answers of the digest (docs/producers.md, "Text prompts"; the module docstring).
KNOWN_ANSWER = "17120e8581415f4473d7a6fe45a9aca632bfe53e6a6a2ef7c2ab81905d25e7f2"
KNOWN_ANSWER_WITH_MERGES = "f0575d0f69217ab81f87d45aebc4e2173b8c6bfb6c86d2af281f4707472b71f7"


def _entry(name: str, data: bytes) -> bytes:
    return name.encode() + b"\x00" + len(data).to_bytes(8, "little") + data


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return model_with_tokenizer(tmp_path_factory.mktemp("tok") / "model")


def _ids(model, s: str, special: bool = True) -> list[int]:
    from tokenizers import Tokenizer

    return (
        Tokenizer.from_file(str(model / "tokenizer.json")).encode(s, add_special_tokens=special).ids
    )


# ----------------------------------------------------------------------------------- digest


def test_files_and_their_order():
    assert TOKENIZER_FILES == (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "tokenizer.model",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
    )


def test_known_answers(tmp_path):
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    want = hashlib.sha256(b"tokenizer.json\x00\x02\x00\x00\x00\x00\x00\x00\x00{}").hexdigest()
    assert want == KNOWN_ANSWER
    assert tokenizer_digest(tmp_path) == KNOWN_ANSWER
    (tmp_path / "merges.txt").write_bytes(b"a b\n")
    assert tokenizer_digest(tmp_path) == KNOWN_ANSWER_WITH_MERGES
    assert text.__doc__.count(KNOWN_ANSWER) == 1
    assert text.__doc__.count(KNOWN_ANSWER_WITH_MERGES) == 1


def test_digest_is_the_defined_hash_of_the_bytes(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    files = {  # written out of order; the digest takes TOKENIZER_FILES' order
        "chat_template.jinja": b"{{ messages[0]['content'] }}\n",
        "tokenizer.json": b'{"model": {"type": "WordLevel"}}',
        "special_tokens_map.json": '{"bos_token": "<s>", "x": "\u00e9"}'.encode(),
        "tokenizer_config.json": b"",  # empty: still a file, length 0
    }
    for name, data in files.items():
        (d / name).write_bytes(data)
    # Not part of it: other files, a directory of a listed name, a broken link.
    (d / "config.json").write_bytes(b'{"vocab_size": 499}')
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    (d / "vocab.json").mkdir()
    os.symlink(tmp_path / "nowhere", d / "added_tokens.json")
    # A link to a regular file counts, with the target's bytes (the HF cache's snapshots).
    (tmp_path / "blob").write_bytes(b"#version: 0.2\nh e\n")
    os.symlink(tmp_path / "blob", d / "merges.txt")

    h = hashlib.sha256()
    h.update(b"tokenizer.json\x00" + (32).to_bytes(8, "little") + files["tokenizer.json"])
    h.update(b"tokenizer_config.json\x00" + bytes(8))
    h.update(_entry("special_tokens_map.json", files["special_tokens_map.json"]))
    h.update(b"merges.txt\x00" + bytes([18, 0, 0, 0, 0, 0, 0, 0]) + b"#version: 0.2\nh e\n")
    h.update(_entry("chat_template.jinja", files["chat_template.jinja"]))
    assert tokenizer_digest(d) == h.hexdigest()
    assert tokenizer_digest(str(d)) == h.hexdigest()


def test_one_byte_of_tokenizer_json_changes_the_digest(model, tmp_path):
    d = model_with_tokenizer(tmp_path / "m")
    before = tokenizer_digest(d)
    raw = bytearray((d / "tokenizer.json").read_bytes())
    i = raw.index(b'"hello"') + 1
    raw[i] = ord("j")  # same length: only the content tells them apart
    (d / "tokenizer.json").write_bytes(bytes(raw))
    after = tokenizer_digest(d)
    assert after != before
    raw[i] = ord("h")
    (d / "tokenizer.json").write_bytes(bytes(raw))
    assert tokenizer_digest(d) == before


def test_no_tokenizer_names_the_directory_and_the_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(TextError) as e:
        tokenizer_digest(tmp_path)
    assert isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg == f"{tmp_path}: no tokenizer (looked for {', '.join(TOKENIZER_FILES)})"
    with pytest.raises(TextError, match="no tokenizer"):
        tokenize(tmp_path, "hello")
    with pytest.raises(TextError, match="not a directory"):
        tokenizer_digest(tmp_path / "absent")


# --------------------------------------------------------------------------------- tokenize


def test_a_gguf_file_is_refused_with_the_way_out(tmp_path):
    """A GGUF's tokenizer lives in its metadata, which --text does not read: the refusal says
    what to give instead, rather than `not a directory`."""
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF")
    with pytest.raises(TextError) as e:
        tokenizer_digest(g)
    msg = str(e.value)
    assert str(g) in msg and "--tokens" in msg and "save_pretrained" in msg, msg


def test_a_gguf_directory_without_tokenizer_files_gets_the_same_way_out(tmp_path):
    """Issue 52: a directory holding a .gguf and no tokenizer files said only `no tokenizer`,
    where the `.gguf` file itself got the fix; both now give it, as the gate's own digest does."""
    plain = tmp_path / "plain"
    plain.mkdir()
    with pytest.raises(TextError) as e:
        tokenizer_digest(plain)
    assert "GGUF" not in str(e.value)  # negative control: no GGUF, no GGUF advice
    d = tmp_path / "gguf"
    d.mkdir()
    (d / "m.gguf").write_bytes(b"GGUF")
    with pytest.raises(TextError) as e:
        tokenizer_digest(d)
    msg = str(e.value)
    assert msg.startswith(f"{d}: no tokenizer (looked for tokenizer.json"), msg
    assert text.GGUF_FIX in msg and "--tokens" in msg and "save_pretrained" in msg, msg
    with pytest.raises(TextError) as e:
        tokenizer_digest(d / "m.gguf")
    assert text.GGUF_FIX in str(e.value)


@pytest.mark.parametrize(
    "doc, want",
    [
        ([{"id": "a", "tokens": [1]}], "the file is an array: a prompt set is one JSON object: {"),
        (
            {"schema": 1, "prompts": [{"id": "hi", "text": "Hello", "chat": "yes"}]},
            'prompt 0 (id \'hi\'): field "chat" is the string "yes", expected true or false',
        ),
    ],
)
def test_a_prompt_set_of_the_wrong_shape_says_what_is_expected(tmp_path, doc, want):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(TextError) as e:
        text.tokenize_prompts(tmp_path, p)
    assert want in str(e.value), str(e.value)


def test_plain_text_is_the_tokenizers_own_encoding(model):
    s = "hello world the cat sat on zebra a mat"  # zebra: <unk>
    r = tokenize(model, s)
    assert r["tokens"] == _ids(model, s)
    assert r["tokens"][0] == SPECIAL["<bos>"]  # the tokenizer's own rule adds the BOS
    assert SPECIAL["<unk>"] in r["tokens"]
    assert r["template"] is None
    assert r["tokenizer_digest"] == tokenizer_digest(model)
    assert all(type(t) is int for t in r["tokens"])


def test_chat_adds_the_templates_tokens(model):
    s = "hello cat"
    r = tokenize(model, s, chat=True)
    rendered = "<|user|> hello cat <|assistant|>"  # CHAT_TEMPLATE by hand, generation prompt on
    assert r["tokens"] == _ids(model, rendered, special=False)
    assert r["tokens"] == [SPECIAL["<|user|>"], *_ids(model, s, special=False), 4]
    assert r["template"] == CHAT_TEMPLATE
    assert r["tokens"] != tokenize(model, s)["tokens"]


def test_chat_without_a_template_is_refused(tmp_path):
    d = model_with_tokenizer(tmp_path / "m", chat_template=None)
    assert tokenize(d, "hello")["tokens"] == [1, 20]  # plain text still works
    with pytest.raises(TextError, match=r"--chat: the tokenizer in .*/m has no chat template"):
        tokenize(d, "hello", chat=True)


def test_empty_text_and_text_without_ids_are_refused(tmp_path):
    d = write_tokenizer(tmp_path, bos=False)
    with pytest.raises(TextError, match="empty"):
        tokenize(d, "")
    with pytest.raises(TextError, match="tokenizes to no ids"):
        tokenize(d, "   ")
    assert tokenize(d, "cat")["tokens"] == [20 + 37 * 3]


def test_without_transformers_the_refusal_says_what_to_install(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(TextError) as e:
        tokenize(model, "hello")
    assert str(e.value) == "--text needs transformers (pip install transformers)"


def test_a_tokenizer_that_does_not_load_is_one_line(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "PreTrainedTokenizerFast"}'
    )
    with pytest.raises(TextError, match="cannot load the tokenizer") as e:
        tokenize(tmp_path, "hello")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- command line


def test_cli_text_prints_one_json_line(model, capsys):
    assert text.main(["--model", str(model), "--text", "the dog ran", "--chat"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1
    got = json.loads(out)
    assert got == {
        "tokens": [3, *_ids(model, "the dog ran", special=False), 4],
        "tokenizer_digest": tokenizer_digest(model),
        "template": CHAT_TEMPLATE,
    }


def test_cli_as_a_module_refuses_with_one_line_and_exit_2(tmp_path):
    p = subprocess.run(
        [sys.executable, "-m", "tracegate.text", "--model", str(tmp_path), "--text", "hi"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""
    assert p.stderr.strip().splitlines() == [
        f"error: {tmp_path}: no tokenizer (looked for {', '.join(TOKENIZER_FILES)})"
    ]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--text", "hi"], "--model"),
        (["--model", "m"], "one of the arguments --text --prompts is required"),
        (["--model", "m", "--text", "hi", "--prompts", "p"], "not allowed with"),
        (["--model", "m", "--prompts", "p", "--chat"], "--chat goes only with --text"),
    ],
)
def test_cli_usage_errors(argv, match, capsys):
    assert text.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and match in err, err


def _prompt_set(path, prompts, schema=1):
    path.write_text(json.dumps({"schema": schema, "about": "test", "prompts": prompts}))
    return str(path)


def test_cli_prompts_tokenizes_the_text_entries(model, tmp_path, capsys):
    f = _prompt_set(
        tmp_path / "p.json",
        [
            {"id": "ids", "tokens": [12, 218, 345]},
            {"id": "plain", "text": "the cat sat"},
            {"id": "chat", "text": "hello world", "chat": True},
            {"id": "nochat", "text": "a mat", "chat": False},
        ],
    )
    assert text.main(["--model", str(model), "--prompts", f]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got == {
        "tokenizer_digest": tokenizer_digest(model),
        "prompts": {
            "plain": {"tokens": _ids(model, "the cat sat"), "template": None},
            "chat": {
                "tokens": [3, *_ids(model, "hello world", False), 4],
                "template": CHAT_TEMPLATE,
            },
            "nochat": {"tokens": _ids(model, "a mat"), "template": None},
        },
    }


@pytest.mark.parametrize(
    "prompts, match",
    [
        (
            [{"id": "a", "text": "cat"}, {"id": "both", "text": "cat", "tokens": [1]}],
            r"prompt 1 \(id 'both'\): has both `text` and `tokens`",
        ),
        (
            [{"id": "a", "tokens": [1]}, {"id": "b", "tokens": [2]}, {"id": "neither"}],
            r"prompt 2 \(id 'neither'\): has neither `text` nor `tokens`",
        ),
        ([{"id": "a", "text": "cat"}, {"id": "a", "text": "dog"}], r"prompt 1 .*given twice"),
        ([{"id": "x", "tokens": [1], "chat": True}], r"prompt 0 .*`chat` goes only with `text`"),
        ([{"id": "x", "text": ""}], r"prompt 0 \(id 'x'\): `text` must be a non-empty string"),
        ([{"id": "x", "text": "   "}], r"prompt 0 \(id 'x'\): --text: .* tokenizes to no ids"),
    ],
)
def test_cli_prompts_refusals_name_index_and_id(prompts, match, tmp_path, capsys):
    d = write_tokenizer(tmp_path, bos=False)
    f = _prompt_set(tmp_path / "p.json", prompts)
    assert text.main(["--model", str(d), "--prompts", f]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"error: --prompts {f}: ")
    assert re.search(match, err), err


def test_cli_prompts_refuses_another_schema(model, tmp_path, capsys):
    f = _prompt_set(tmp_path / "p.json", [{"id": "a", "text": "cat"}], schema=2)
    assert text.main(["--model", str(model), "--prompts", f]) == 2
    assert "schema 2, expected 1" in capsys.readouterr().err


# ------------------------------------------------------------------------ protocol grammar


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)


def _parse(*argv):
    return protocol.parser("p", parser_class=_Parser).parser.parse_args(
        ["trace", "--model", "m", "--out", "o", *argv]
    )


def test_protocol_text_is_the_alternative_to_tokens():
    a = _parse("--text", "hello world", "--chat")
    assert (a.tokens, a.text, a.chat) == (None, "hello world", True)
    a = _parse("--text=-x")
    assert (a.tokens, a.text, a.chat) == (None, "-x", False)
    a = _parse("--tokens", "3,17,5")
    assert (a.tokens, a.text, a.chat) == ([3, 17, 5], None, False)


@pytest.mark.parametrize(
    "argv, match",
    [
        ([], "one of the arguments --tokens --text is required"),
        (["--tokens", "1,2", "--text", "hi"], "not allowed with argument"),
        (["--tokens", "1,2", "--chat"], "--chat goes only with --text"),
        (["--chat"], "one of the arguments --tokens --text is required"),
        (["--text", ""], "argument --text: the text is empty"),
        (["--tokens", "1,x"], "argument --tokens: expected comma-separated integers"),
    ],
)
def test_protocol_refusals(argv, match):
    with pytest.raises(_Refused, match=match):
        _parse(*argv)


def test_protocol_layer_verb_has_no_text():
    with pytest.raises(_Refused, match="unrecognized arguments: --text"):
        protocol.parser("p", parser_class=_Parser).parser.parse_args(
            ["layer", "--model", "m", "--layer", "0", "--input", "i", "--input-name", "x"]
            + ["--out", "o", "--text", "hi"]
        )


# ------------------------------------------------------------- hostile tokenizers (issue 51)

# The child processes import this tracegate (and transformers) as this process does.
PYTHONPATH = os.pathsep.join([os.path.dirname(os.path.dirname(text.__file__)), *sys.path])

# Nested loops of jinja2's sandboxed `range` (at most 100000 each): 10^10 iterations.
ENDLESS_TEMPLATE = (
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
)
# Half a gigabyte held by the template (each string its own, not one folded constant), while
# what it renders stays a few bytes: without the limit, rendering ends, after allocating it all.
GROWING_TEMPLATE = (
    "{% set ns = namespace(held=[]) %}{% for i in range(500) %}"
    '{% set ns.held = ns.held + ["x" * (1000000 + i)] %}{% endfor %}'
    "{{ messages[0]['content'] }} {{ ns.held | length }}"
)
# An alternation that backtracks past Oniguruma's retry limit on a run of `a`s: the tokenizers
# library panics (`Onig: Regex search error: retry-limit-in-match over`).
BACKTRACKING = "(.*a){12}z|(.*a){12}q"


def _cli(model, *args, env=None, timeout=120):
    """`python -m tracegate.text --model MODEL ARGS`, with this checkout's tracegate."""
    e = {**os.environ, "PYTHONPATH": PYTHONPATH, "RUST_BACKTRACE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "tracegate.text", "--model", str(model), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=e,
    )


def _one_line_refusal(p) -> str:
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr[-3000:])
    assert p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-3000:]
    return lines[0]


def test_a_chat_template_that_does_not_end_is_refused_at_the_limit(tmp_path, model, monkeypatch):
    """10^10 loop iterations: refused once TRACEGATE_TEXT_TIMEOUT has passed, in one line naming
    the model directory and the limit (it ran unbounded before: the 120 s guard would fire)."""
    d = write_tokenizer(tmp_path, chat_template=ENDLESS_TEMPLATE)
    line = _one_line_refusal(
        _cli(d, "--text", "hello", "--chat", env={"TRACEGATE_TEXT_TIMEOUT": "3"})
    )
    assert line == (
        f"error: {d}: the chat template ran past the time limit of 3 s "
        "(TRACEGATE_TEXT_TIMEOUT) on the text: refused"
    )
    # Negative control: the same limit lets an ordinary template through.
    monkeypatch.setenv("TRACEGATE_TEXT_TIMEOUT", "3")
    assert tokenize(model, "hello", chat=True)["tokens"] == [3, 20, 4]


def test_a_chat_template_that_grows_memory_is_refused_at_the_limit(tmp_path, monkeypatch):
    """Half a gigabyte held by the template: refused once the process grew by TRACEGATE_TEXT_MAX_MB.
    In a library call (the contract's and the oracle's --text) the refusal leaves the caller's
    SIGALRM handler in place and no timer armed."""
    d = write_tokenizer(tmp_path, chat_template=GROWING_TEMPLATE)
    monkeypatch.setenv("TRACEGATE_TEXT_MAX_MB", "64")

    def mine(*_):
        pass

    previous = signal.signal(signal.SIGALRM, mine)
    try:
        with pytest.raises(TextError) as e:
            tokenize(d, "hello", chat=True)
        assert signal.getsignal(signal.SIGALRM) is mine
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert re.fullmatch(
        rf"{re.escape(str(d))}: the chat template grew this process by \d+ MiB, over the "
        r"limit of 64 MiB \(TRACEGATE_TEXT_MAX_MB\) on the text: refused",
        str(e.value),
    ), str(e.value)


@pytest.mark.parametrize("name", ["TRACEGATE_TEXT_TIMEOUT", "TRACEGATE_TEXT_MAX_MB"])
@pytest.mark.parametrize("bad", ["", "0", "-1", "1.5", "2s", " 3", "abc", "٣"])
def test_the_limits_are_read_strictly(name, bad, model, monkeypatch):
    monkeypatch.setenv(name, bad)
    unit = "seconds" if name == "TRACEGATE_TEXT_TIMEOUT" else "MiB"
    with pytest.raises(TextError) as e:
        tokenize(model, "hello")
    assert str(e.value).startswith(
        f"{name}={bad!r} is not accepted: {name} takes a whole number of {unit}, at least 1"
    )
    assert "\n" not in str(e.value)


def test_the_limits_defaults_and_values(monkeypatch):
    monkeypatch.delenv("TRACEGATE_TEXT_TIMEOUT", raising=False)
    monkeypatch.delenv("TRACEGATE_TEXT_MAX_MB", raising=False)
    assert text.limits() == (60, 1024)
    monkeypatch.setenv("TRACEGATE_TEXT_TIMEOUT", "7")
    monkeypatch.setenv("TRACEGATE_TEXT_MAX_MB", "300")
    assert text.limits() == (7, 300)


def _backtracking_tokenizer(d):
    d = write_tokenizer(d, bos=False)
    j = json.loads((d / "tokenizer.json").read_text())
    j["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": BACKTRACKING},
        "behavior": "Isolated",
        "invert": False,
    }
    (d / "tokenizer.json").write_text(json.dumps(j))
    return d


def test_a_tokenizers_panic_is_a_one_line_refusal(tmp_path):
    """pyo3's PanicException is a BaseException: it went through every `except Exception` and
    ended the run in a traceback (with RUST_BACKTRACE, 122 lines)."""
    d = _backtracking_tokenizer(tmp_path)
    want = (
        f"{d / 'tokenizer.json'}: the tokenizers library panicked on the text: PanicException: "
        "Onig: Regex search error: retry-limit-in-match over"
    )
    with pytest.raises(TextError) as e:
        tokenize(d, "a" * 300)
    assert str(e.value) == want
    # The command line: that line alone on stderr (the panic hook's message and backtrace are
    # held back), exit 2.
    assert _one_line_refusal(_cli(d, "--text", "a" * 300)) == f"error: {want}"
    # Negative control: the same tokenizer encodes a text it does not backtrack on.
    assert tokenize(d, "cat a mat")["tokens"] == [0]  # one split, unknown to the vocab


def test_keyboard_interrupt_is_not_a_refusal(model, monkeypatch):
    from transformers import PreTrainedTokenizerFast

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(PreTrainedTokenizerFast, "__call__", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tokenize(model, "hello")


def test_a_tokenizer_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path):
    """A sparse vocab.json of 256 MiB + 1 byte: refused from its size alone (tokenizers and
    transformers read a file whole); exactly 256 MiB is not over the limit."""
    d = write_tokenizer(tmp_path)
    vocab = d / "vocab.json"
    with open(vocab, "wb") as f:
        f.truncate(text.MAX_TOKENIZER_FILE_BYTES)
    text._check_sizes(str(d))  # at the limit: not refused
    with open(vocab, "wb") as f:
        f.truncate(text.MAX_TOKENIZER_FILE_BYTES + 1)
    want = (
        f"{vocab}: 268435457 bytes, over the 256 MiB a tokenizer file may have for a text prompt "
        "(the tokenizer library reads it whole): refused"
    )
    with pytest.raises(TextError) as e:
        tokenize(d, "hello")
    assert str(e.value) == want
    assert _one_line_refusal(_cli(d, "--text", "hello")) == f"error: {want}"


def test_the_digest_reads_a_huge_file_in_bounded_memory(tmp_path):
    """A 512 MiB sparse vocab.json: the digest streams it (peak resident memory of the child
    that digests it, VmHWM, under 128 MiB; reading it whole peaks above 512 MiB) and is the defined hash
    of its bytes."""
    (tmp_path / "tokenizer.json").write_bytes(b"{}")
    size = 512 << 20
    with open(tmp_path / "vocab.json", "wb") as f:
        f.truncate(size)
    # VmHWM: the peak of this process's own memory since its exec (ru_maxrss would carry the
    # pytest parent's peak over the fork).
    script = (
        "import sys\n"
        "from tracegate.text import tokenizer_digest\n"
        "d = tokenizer_digest(sys.argv[1])\n"
        "hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0]\n"
        "print(d, hwm.split()[1])\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert p.returncode == 0, p.stderr
    digest, peak_kib = p.stdout.split()
    assert int(peak_kib) < 128 << 10, f"peak {peak_kib} KiB digesting a 512 MiB file"
    h = hashlib.sha256(_entry("tokenizer.json", b"{}"))
    h.update(b"vocab.json\x00" + size.to_bytes(8, "little"))
    zeros = bytes(1 << 20)
    for _ in range(size >> 20):
        h.update(zeros)
    assert digest == h.hexdigest()


def _engine() -> str | None:
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(ROOT, "target")
    path = os.path.join(ROOT, target, "release", "engine")  # a relative target: from the root
    return path if os.access(path, os.X_OK) else None


def test_the_engine_passes_the_template_refusal_on_in_one_line(tmp_path):
    """`engine trace --text --chat` ran the endless template unbounded too: now the helper's own
    limit ends it, and the engine says so in one line (its own deadline, the limit plus the
    start's grace, is tested in engine/src/main.rs)."""
    engine = _engine()
    if engine is None:
        pytest.skip("engine binary not built (cargo build --release --bins)")
    d = model_with_tokenizer(tmp_path / "m", chat_template=ENDLESS_TEMPLATE)
    p = subprocess.run(
        [
            engine,
            "trace",
            "--model",
            str(d),
            "--text",
            "hello",
            "--chat",
            "--out",
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": PYTHONPATH,
            "TRACEGATE_PYTHON": sys.executable,
            "TRACEGATE_TEXT_TIMEOUT": "3",
        },
    )
    assert p.returncode == 2, p.stderr
    assert p.stderr.strip().splitlines() == [
        f"engine: error: --text: {d}: the chat template ran past the time limit of 3 s "
        "(TRACEGATE_TEXT_TIMEOUT) on the text: refused"
    ]
    assert not (tmp_path / "t").exists()
