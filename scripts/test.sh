#!/usr/bin/env bash
# Set-up plus every test, Rust and Python. This is what CI runs (.ci/run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
command -v cargo >/dev/null || { echo "test: cargo not found; install Rust (rustup) first" >&2; exit 1; }
# Style first: it fails in seconds, the tests take minutes (rustfmt.toml, ruff.toml).
echo "== style: cargo fmt --check"
cargo fmt --all --check
# On a fresh machine the Python environment (torch and its CUDA libraries: mostly download and
# unpacking) takes minutes; it installs beside the Rust builds, which need none of it.
scripts/setup.sh --python-env &
python_pid=$!
trap 'pkill -P "$python_pid" 2>/dev/null; kill "$python_pid" 2>/dev/null || true' EXIT
echo "== build (release), style: cargo clippy -D warnings, and the Rust test binaries"
cargo build --release --quiet --bins
cargo clippy --release --quiet --workspace --all-targets -- -D warnings
cargo test --release --quiet --no-run
wait "$python_pid" || { echo "test: setting up the Python environment failed (above)" >&2; exit 1; }
trap - EXIT
# The rest of the set-up (what is already done is skipped).
scripts/setup.sh
echo "== style: ruff check, ruff format --check"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
echo "== cargo test (release profile, shares the set-up build)"
cargo test --release --quiet
# With CI set (CI=true), the root conftest.py turns every pytest skip into a failure.
# -n auto: one worker per core (pytest-xdist); each worker builds its own session fixtures.
echo "== pytest, one worker per core${CI:+ (CI=$CI: a skipped test fails the run)}"
.venv/bin/python -m pytest -n auto
