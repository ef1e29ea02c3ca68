#!/usr/bin/env bash
# Set-up plus every test, Rust and Python. This is what CI runs (.ci/run).
set -euo pipefail
# Each phase line carries the time and the CPU seconds its finished children used so far, so a
# CI log shows where the minutes went and whether both cores were busy.
# (`times` runs in this shell, not in a command substitution's subshell, which has no children.)
phase() {
  times >"$cpu_file"
  local cpu
  cpu="$(awk 'NR == 2 { split($1, u, "m"); split($2, s, "m"); printf "%.0f", u[1] * 60 + u[2] + s[1] * 60 + s[2] }' "$cpu_file")"
  echo "== [$(date +%T)] (CPU ${cpu} s) $*"
}
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
cpu_file="${CARGO_TARGET_DIR:-target}/.test-phase-times"
mkdir -p "$(dirname "$cpu_file")"
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
# Idle OpenMP threads (torch's, in the oracle and the tests) sleep instead of spinning: with two
# test processes per core pair, a spinning thread burns the core the other one needs. It changes
# how threads wait, never what they compute. Measured here (2 cores, `pytest -n 2` of
# oracle/tests/test_llama.py and test_qwen2.py, twice each way): 58 -> 36 CPU-s, 36 -> 25 s.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
# cargo test and pytest run side by side: each alone leaves a core idle for long stretches (a
# test binary's last slow tests, a worker's last module), and they share nothing but the built
# binaries. cargo's output is kept in a file and shown whole when both have finished.
phase "cargo test (release profile, shares the set-up build), beside pytest"
cargo_log="$(mktemp "${TMPDIR:-/tmp}/tracegate-cargo-test.XXXXXX")"
cargo test --release --quiet >"$cargo_log" 2>&1 &
cargo_pid=$!
trap 'kill "$cargo_pid" 2>/dev/null || true' EXIT
# With CI set (CI=true), the root conftest.py turns every pytest skip into a failure.
# -n auto: one worker per core (pytest-xdist); each worker builds its own session fixtures.
# --dist worksteal: an idle worker takes tests queued on the other, so neither ends alone on
# a long tail of slow modules.
phase "pytest, one worker per core${CI:+ (CI=$CI: a skipped test fails the run)}"
pytest_status=0
.venv/bin/python -m pytest -n auto --dist worksteal || pytest_status=$?
phase "pytest finished (exit $pytest_status); waiting for cargo test"
cargo_status=0
wait "$cargo_pid" || cargo_status=$?
trap - EXIT
echo "== cargo test's output (exit $cargo_status):"
cat "$cargo_log"
rm -f "$cargo_log"
phase "done: cargo test exit $cargo_status, pytest exit $pytest_status"
[ "$cargo_status" = 0 ] && [ "$pytest_status" = 0 ]
