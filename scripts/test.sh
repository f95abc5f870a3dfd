#!/usr/bin/env bash
# Sets up .venv (scripts/setup_env.sh), then lints the package and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DCPDS_VENV:-.venv}/bin/activate"
python -m pip install -q -r requirements-dev.txt
python -m pip install -q -r benchmarks/requirements.txt
bash scripts/install_integrations.sh
echo "== ruff"; ruff check dcp_datastates tests examples benchmarks
echo "== mypy"; mypy dcp_datastates
echo "== pytest"
# Run from tests/ so that the installed package (with its compiled engine) is the one imported.
cd tests && python -m pytest -c ../pyproject.toml --rootdir .. "$@" .
