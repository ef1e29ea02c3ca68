"""The oracle's JSON inputs as an adversary hands them over (issue 33 items 8, 12): one regular
file of at most 64 MiB, no object repeating a key, refused with the file and the key."""

import os
from pathlib import Path

import pytest
from tracegate.jsonfile import MAX_JSON_LEN
from tracegate_oracle import checkpoint
from tracegate_oracle.errors import CheckpointError
from tracegate_oracle.measure_policy import text_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "fixtures" / "tiny-qwen3" / "config.json"


def _model(tmp_path, text: str) -> Path:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(text)
    return d


def test_measure_policy_reads_config_json_refusing_a_repeated_key(tmp_path):
    text = TINY.read_text()
    assert text_config(str(_model(tmp_path, text)))["vocab_size"] > 0  # negative control
    attack = text.replace("{", '{"vocab_size": 7, ', 1)
    d = tmp_path / "attack"
    d.mkdir()
    (d / "config.json").write_text(attack)
    # On main json.loads kept the last vocab_size silently.
    with pytest.raises(CheckpointError, match="config.json: duplicate key 'vocab_size'"):
        text_config(str(d))


def test_json_inputs_past_the_bound_or_not_regular_are_refused(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    p = d / "config.json"
    with open(p, "wb") as f:
        f.truncate(MAX_JSON_LEN + 1)  # sparse: refused from fstat, nothing read
    with pytest.raises(CheckpointError, match="config.json: .* more than the limit"):
        checkpoint.read_config(d)
    p.unlink()
    os.mkfifo(p)  # opened without a writer: a blocking open would hang here
    with pytest.raises(CheckpointError, match=r"config.json: not a regular file \(a FIFO\)"):
        checkpoint.read_config(d)
    p.unlink()
    p.symlink_to("/dev/zero")
    with pytest.raises(CheckpointError, match=r"config.json: not a regular file \(a device\)"):
        checkpoint.read_config(d)
    pol = tmp_path / "policy.json"
    pol.write_text('{"format": "tracegate-policy/1", "rules": [], "rules": []}')
    with pytest.raises(CheckpointError, match="policy.json: duplicate key 'rules'"):
        checkpoint.read_json_file(pol)
