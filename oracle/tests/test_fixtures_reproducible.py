"""The committed fixtures are exactly what scripts/make_fixtures.py writes: a regenerated copy
is byte-identical (the generator is seeded and deterministic), so nobody can edit a fixture by
hand without the test noticing."""

import filecmp
import os
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


@pytest.mark.parametrize(
    "preset",
    [
        "tiny-qwen3",
        "tiny-qwen3-moe",
        "tiny-qwen3_5",
        "tiny-qwen3_5-moe",
        "tiny-llama",
        "tiny-qwen2",
        "tiny-gemma3",
    ],
)
def test_regenerated_fixture_is_byte_identical(tmp_path, preset):
    out = tmp_path / preset
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "make_fixtures.py"),
            preset,
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    committed = os.path.join(ROOT, "fixtures", preset)
    # tiny-llama and tiny-qwen2 carry their tokenizer too (written by the same script, from code).
    tok = preset in ("tiny-llama", "tiny-qwen2")
    extra = ("tokenizer.json", "tokenizer_config.json") if tok else ()
    for name in ("config.json", "model.safetensors", *extra):
        assert filecmp.cmp(out / name, os.path.join(committed, name), shallow=False), (
            f"{preset}/{name} differs from a fresh regeneration"
        )
