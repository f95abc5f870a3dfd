#!/usr/bin/env bash
# Sets up .venv, then runs the main job: a small GPT trained on CPU with a DataStatesWriter
# checkpoint every 10 steps into ./checkpoints; the first run stops (as if crashed) after step 35,
# the second resumes from the newest complete checkpoint and finishes 60 steps.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DCPDS_VENV:-.venv}/bin/activate"
CKPT="${CKPT_DIR:-./checkpoints}"
rm -rf "$CKPT"
echo "== run 1: train, checkpoint every 10 steps, stop after step 35"
python examples/train_gpt.py --ckpt-dir "$CKPT" --steps 60 --ckpt-every 10 --stop-after 35 "$@" || true
echo "== run 2: resume from the newest complete checkpoint"
python examples/train_gpt.py --ckpt-dir "$CKPT" --steps 60 --ckpt-every 10 "$@"
