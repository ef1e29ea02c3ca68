#!/usr/bin/env bash
# Set-up plus the main job: the m1 gate on the bundled MoE fixture and the frozen prompts.
# Extra arguments go to the gate (e.g. --report out/m1.json, --only short).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
scripts/setup.sh
exec target/release/gate m1 --prompts frozen "$@"
