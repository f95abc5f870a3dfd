#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs dcp_datastates into it.
# torch is pinned to the CPU wheel this machine class provides; an unpinned torch would pull a
# multi-GB CUDA build. Set DCPDS_VENV to use another location, DCPDS_EDITABLE=1 for development.
#
# Reruns are cheap: torch is installed only when the pinned version is missing, and the package
# is rebuilt only when its sources changed. A stamp in the venv records a hash of csrc/,
# CMakeLists.txt, pyproject.toml and dcp_datastates/ (plus the install mode, torch version and
# checkout path) at the last successful install; when it matches and the installed distribution
# still has its compiled engine, the build is skipped. DCPDS_FORCE_INSTALL=1 reinstalls regardless.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DCPDS_VENV:-.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION="${DCPDS_TORCH_VERSION:-2.13.0}"
MODE=$([ "${DCPDS_EDITABLE:-0}" = "1" ] && echo editable || echo wheel)
STAMP="$VENV/.dcp_datastates-install-stamp"

# A hash over the names and contents of every file the build reads (bytecode and built
# extensions excluded). Needs GNU find/sort/sha256sum.
source_hash() {
  find csrc dcp_datastates CMakeLists.txt pyproject.toml -type f \
    ! -path '*/__pycache__/*' ! -name '*.pyc' ! -name '*.so' -print0 \
    | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

created=0
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
  created=1
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
if [ "$created" = "1" ]; then
  python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
fi

installed_torch=$(python -c 'import importlib.metadata as m; print(m.version("torch"))' \
  2>/dev/null || true)
if [ "${installed_torch%%+*}" != "$TORCH_VERSION" ]; then
  python -m pip install -q "torch==$TORCH_VERSION"
fi

want="sources=$(source_hash) mode=$MODE torch=$TORCH_VERSION checkout=$(pwd -P)"
if [ "${DCPDS_FORCE_INSTALL:-0}" != "1" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
  && python - <<'PY' >/dev/null 2>&1; then
# the installed distribution still has its compiled engine (without importing torch)
import importlib.metadata as m
import sys
files = m.files("dcp_datastates") or []
sys.exit(not any(f.name.startswith("_core.") and f.locate().exists() for f in files))
PY
  echo "setup_env: dcp_datastates in $VENV is up to date with the sources; not rebuilding"
  exit 0
fi
rm -f "$STAMP"
if [ "$MODE" = "editable" ]; then
  python -m pip install -q scikit-build-core pybind11
  python -m pip install -q --no-build-isolation -e .
else
  python -m pip install -q .
fi
# the hash taken before the build: an edit made during the build triggers the next rebuild
echo "$want" >"$STAMP"
