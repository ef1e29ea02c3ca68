#!/usr/bin/env bash
# Set-up plus every test, Rust and Python. This is what CI runs (.ci/run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
# Style first: it fails in seconds, the tests take minutes (rustfmt.toml, ruff.toml).
echo "== style: cargo fmt --check, cargo clippy -D warnings, ruff check, ruff format --check"
cargo fmt --all --check
cargo clippy --release --quiet --workspace --all-targets -- -D warnings
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
echo "== cargo test (release profile, shares the set-up build)"
cargo test --release --quiet
# With CI set (CI=true), the root conftest.py turns every pytest skip into a failure.
# -n auto: one worker per core (pytest-xdist); each worker builds its own session fixtures.
echo "== pytest, one worker per core${CI:+ (CI=$CI: a skipped test fails the run)}"
.venv/bin/python -m pytest -n auto
