#!/usr/bin/env bash
# Set-up plus every test, Rust and Python. This is what CI runs (.ci/run).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
echo "== cargo test (release profile, shares the set-up build)"
cargo test --release --quiet
# With CI set (CI=true), the root conftest.py turns every pytest skip into a failure.
echo "== pytest${CI:+ (CI=$CI: a skipped test fails the run)}"
.venv/bin/python -m pytest
