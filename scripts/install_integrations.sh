#!/usr/bin/env bash
# Installs the training frameworks the integration tests use into the active environment,
# pinned, without letting any of them replace the installed torch (see
# requirements-integrations.txt). Run after scripts/setup_env.sh, inside its venv.
set -euo pipefail
cd "$(dirname "$0")/.."
torch_before=$(python -c 'import importlib.metadata as m; print(m.version("torch"))')
python -m pip install -q -r requirements-integrations.txt
if ! python -c 'import deepspeed' >/dev/null 2>&1; then
  # An sdist: build it against the installed torch (no isolated build env with another torch),
  # without compiling any op ahead of time.
  python -m pip install -q setuptools wheel
  DS_BUILD_OPS=0 python -m pip install -q --no-build-isolation "deepspeed==0.19.8"
fi
if ! python -c 'import torchtitan' >/dev/null 2>&1; then
  # torchtitan's declared dependencies (datasets, wandb, tensorboard, torch_checkpointing, ...)
  # would downgrade huggingface_hub under transformers; its checkpoint manager needs none of
  # them. Install it without dependencies, plus the few its import chain needs (pinned).
  python -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3"
  python -m pip install -q "tyro==1.0.17"
fi
torch_after=$(python -c 'import importlib.metadata as m; print(m.version("torch"))')
if [ "$torch_before" != "$torch_after" ]; then
  echo "install_integrations: torch changed from $torch_before to $torch_after" >&2
  exit 1
fi
