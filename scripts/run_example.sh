#!/usr/bin/env bash
# Sets up .venv (scripts/setup_env.sh: torch and the package only, no rebuild when the sources
# are unchanged), then runs the main job, examples/main_job.py: a ~36 M-parameter GPT (431 MB
# checkpoints with AdamW state) trained on CPU in three runs: without checkpoints (the reference,
# with a plain dcp.save timed at every 10th step), with a DataStatesWriter checkpoint every 10
# steps until a simulated crash after step 35, and resumed with stock dcp.load to step 65; the
# reference and the checkpointing runs take turns of 5 steps, so both meet the same load. It
# prints per checkpoint the time training was blocked and the time until durable, then a summary:
# DataStatesWriter against plain dcp.save with the noise of the comparison (or that the machine
# was too noisy to conclude), and whether the resumed run is bit-identical.
#
#   bash scripts/run_example.sh            # the main job, a few minutes on 2 cores
#   bash scripts/run_example.sh --quick    # short form (a tiny model, 12 steps): what CI runs
#
# Other arguments go to examples/main_job.py (--help). CKPT_DIR (default ./checkpoints) is the
# checkpoint root; the job empties it first and refuses to if it holds files it did not write.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
# shellcheck disable=SC1091
. "${DCPDS_VENV:-.venv}/bin/activate"
exec python examples/main_job.py --ckpt-dir "${CKPT_DIR:-./checkpoints}" "$@"
