"""A tiny tokenizer for the text-prompt tests (tiny-qwen3 has none; tiny-llama carries its own): a WordLevel `tokenizers`
tokenizer whose ids fit inside fixtures/tiny-qwen3's vocab (499), saved as tokenizer.json, and a
tokenizer_config.json that makes `AutoTokenizer` load it as a fast tokenizer, with a chat
template or without. Imported by binding/tests/test_text.py by name and by the contract's
and the oracle's text tests by path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "fixtures" / "tiny-qwen3"

SPECIAL = {"<unk>": 0, "<bos>": 1, "<eos>": 2, "<|user|>": 3, "<|assistant|>": 4}
WORDS = ["hello", "world", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
# Ids spread over the model's vocab (< 499), not 0..n: a tokenizer's ids are its own.
VOCAB = {**SPECIAL, **{w: 20 + 37 * i for i, w in enumerate(WORDS)}}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocab_size() -> int:
    return json.loads((MODEL / "config.json").read_text())["vocab_size"]


def write_tokenizer(d, chat_template: str | None = CHAT_TEMPLATE, bos: bool = True) -> Path:
    """tokenizer.json (WordLevel over VOCAB, whitespace pre-tokenizer, a BOS prepended when
    `bos`) and tokenizer_config.json (with `chat_template` when given) in `d`."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    assert max(VOCAB.values()) < vocab_size()
    tok = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(list(SPECIAL))
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", SPECIAL["<bos>"])]
        )
    d = Path(d)
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def model_with_tokenizer(d, **kwargs) -> Path:
    """fixtures/tiny-qwen3 (config.json + model.safetensors) copied to `d`, with the tokenizer."""
    d = Path(d)
    os.makedirs(d, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(MODEL / name, d / name)
    return write_tokenizer(d, **kwargs)
