#!/usr/bin/env bash
# Creates (or reuses) the virtual environment .venv and installs dcp_datastates into it.
# torch is pinned to the CPU wheel this machine class provides; an unpinned torch would pull a
# multi-GB CUDA build. Set DCPDS_VENV to use another location, DCPDS_EDITABLE=1 for development.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DCPDS_VENV:-.venv}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
python -m pip install -q "torch==${DCPDS_TORCH_VERSION:-2.13.0}"
if [ "${DCPDS_EDITABLE:-0}" = "1" ]; then
  python -m pip install -q scikit-build-core pybind11
  python -m pip install -q --no-build-isolation -e .
else
  python -m pip install -q .
fi
