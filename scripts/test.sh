#!/usr/bin/env bash
# Set-up plus every test, Rust and Python. This is what CI runs (.ci/run).
set -euo pipefail
# Each phase line carries the time, so a CI log shows where the minutes went.
phase() { echo "== [$(date +%T)] $*"; }
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
command -v cargo >/dev/null || { echo "test: cargo not found; install Rust (rustup) first" >&2; exit 1; }
# Style first: it fails in seconds, the tests take minutes (rustfmt.toml, ruff.toml).
phase "style: cargo fmt --check"
cargo fmt --all --check
# On a fresh machine the Python environment (torch and its CUDA libraries: mostly download and
# unpacking) takes minutes; it installs beside the Rust builds, which need none of it.
scripts/setup.sh --python-env &
python_pid=$!
trap 'pkill -P "$python_pid" 2>/dev/null; kill "$python_pid" 2>/dev/null || true' EXIT
phase "build (release), style: cargo clippy -D warnings, and the Rust test binaries"
cargo build --release --quiet --bins
# libtracegate_capi.so beside the binaries: the C test files a capsule writes link it.
cargo build --release --quiet -p tracegate-capi
cargo clippy --release --quiet --workspace --all-targets -- -D warnings
cargo test --release --quiet --no-run
wait "$python_pid" || { echo "test: setting up the Python environment failed (above)" >&2; exit 1; }
trap - EXIT
# The rest of the set-up (what is already done is skipped).
phase "set-up: the rest (maturin, the editable packages)"
scripts/setup.sh
phase "style: ruff check, ruff format --check"
.venv/bin/ruff check --quiet .
.venv/bin/ruff format --check --quiet .
phase "cargo test (release profile, shares the set-up build)"
cargo test --release --quiet
# With CI set (CI=true), the root conftest.py turns every pytest skip into a failure.
# -n auto: one worker per core (pytest-xdist); each worker builds its own session fixtures.
phase "pytest, one worker per core${CI:+ (CI=$CI: a skipped test fails the run)}"
.venv/bin/python -m pytest -n auto
phase "done"
