#!/usr/bin/env bash
# The GPU checks, as one prepared run for a machine with a CUDA device (docs/architecture.md,
# "CUDA path"; docs/benchmarks.md, "GPU"). Builds the engine against that machine's python3 and
# torch (no network needed: pybind11, scikit-build-core, cmake and ninja must be installed), then
#   1. the CUDA tests (tests/test_gpu.py against the real driver, tests/test_cuda_sim.py),
#   2. device-to-host capture speed: the engine against pinned copy_(non_blocking) and
#      DefaultStager (benchmarks/d2h.py), for many tensors (2GB:mixed) and few (2GB:large),
#      the owned state copied in cudaMemcpyBatchAsync batches and one call per copy,
#   2b. an FSDP2 training loop on the device, 8.05 GB of state (40 x 4096^2 weights + AdamW),
#      a checkpoint every 3rd step: the plain call against async_save + DefaultStager and
#      dcp.save, each figure a ratio to the same run's peers (benchmarks/fsdp2_train.py),
#   3. the GPT training loop on the GPU, 2.2 GB of state: a checkpoint every iteration with a
#      batch of 128 (`large@b128`, a 1.6 s step on an H200, 21 iterations: the final drain
#      amortised over 21 checkpoints; against DefaultStager, dcp.save was 166% in run N;
#      GPU_CHECK_TRAIN_K1 names the contenders) and every 5th with a batch of 16
#      (`large`, 0.21 s): end-to-end cost per checkpoint of the plain call against dcp.save,
#      async_save + DefaultStager (pinned), plain async_save and (every 5th) torch.save,
#   4. restore into GPU tensors from a cold page cache, our reader against the stock one,
#   4b. restore into GPU tensors from /dev/shm (2GB:mixed and 2GB:large): the device path against
#      the pinned host-to-device peak, the reader's temporaries and the stock reader
#      (benchmarks/h2d_restore.py),
#   5. a synthetic 1 GB save from GPU tensors: blocked and until-durable times.
# Everything goes to $OUT (default ./gpu-out): log.txt and results.tgz. The whole run keeps to
# GPU_CHECK_BUDGET_S seconds (default 540; give the device call a timeout of 590; run N took
# ~400 s on an H200 before steps 2b and 4b were added): each step gets at most what is left, in
# the order tests (1), d2h (2), h2d (4b), gptk1 (3, every iteration), fsdp2 (2b), gpt (3, every
# 5th), restore (4), synthetic (5); the last ones are skipped when the time is spent, and a
# failing step does not stop the next. GPU_CHECK_STEPS="fsdp2 gpt restore synthetic" (words from
# that list) runs only those: two calls cover everything when one cannot. GPU_CHECK_DEVICE=cpu
# GPU_CHECK_QUICK=1 dry-runs the commands here.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
WORK="$(mktemp -d)"
DEV="${GPU_CHECK_DEVICE:-cuda}"
QUICK="${GPU_CHECK_QUICK:-0}"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
DEADLINE=$(($(date +%s) + ${GPU_CHECK_BUDGET_S:-540}))
exec > >(tee -a "$OUT/log.txt") 2>&1

# selected NAME: whether GPU_CHECK_STEPS (words; empty: every step) names the step, exactly or as
# the part before its first "-" (d2h selects d2h-2GB:mixed and d2h-2GB:large)
selected() {
  local w
  [ -z "${GPU_CHECK_STEPS:-}" ] && return 0
  for w in $GPU_CHECK_STEPS; do
    [ "$1" = "$w" ] || [ "${1%%-*}" = "$w" ] && return 0
  done
  return 1
}

# step NAME LIMIT_S CMD...: runs CMD with at most min(LIMIT_S, time left), output in the log
step() {
  local name=$1 limit=$2 left t0 rc
  shift 2
  if [ "$name" != build ] && ! selected "$name"; then
    echo "=== $name: not selected (GPU_CHECK_STEPS=$GPU_CHECK_STEPS)"
    return 0
  fi
  left=$((DEADLINE - $(date +%s) - 10))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -lt 15 ]; then
    echo "=== $name: skipped, no time left"
    return 0
  fi
  echo "=== $name (limit ${limit}s) at $(date +%T)"
  t0=$(date +%s)
  timeout -k 5 "$limit" "$@"
  rc=$?
  echo "=== $name: rc=$rc in $(($(date +%s) - t0))s"
}

echo "=== machine"
nvidia-smi -L 2>&1 | head -4
nproc
free -g | head -2
df -h "$WORK" | tail -1
"$PY" -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda,
torch.cuda.is_available() and torch.cuda.get_device_name(0))'

build() {
  if "$PY" -m pip install -q --no-build-isolation --no-deps -e . 2>&1 | tail -5 \
    && "$PY" -c 'import dcp_datastates._core'; then
    return 0
  fi
  echo "pip editable build failed; building with cmake"
  cmake -S . -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
    -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" -DPython_EXECUTABLE="$(command -v "$PY")" \
    >/dev/null && cmake --build "$WORK/build" -j "$(nproc)" >/dev/null \
    && cp "$WORK"/build/_core*.so dcp_datastates/ && "$PY" -c 'import dcp_datastates._core'
}
export -f build
export PY WORK
step build 150 bash -c build
if ! "$PY" -c 'import dcp_datastates._core' 2>/dev/null; then
  echo "=== the engine did not build: nothing else can run"
  exit 1
fi
"$PY" - <<'PY'
import torch
from dcp_datastates.engine import loaded_cuda_runtime
if torch.cuda.is_available():
    torch.cuda.init()
print("libcudart:", loaded_cuda_runtime() or "(none mapped)")
PY

tests="test_gpu.py test_cuda_sim.py test_device_read.py"
[ "$QUICK" = "1" ] && tests="test_gpu.py"
# shellcheck disable=SC2086
step tests 170 bash -c "cd tests && $PY -m pytest -c ../pyproject.toml --rootdir .. -v -s \
  -p no:cacheprovider --timeout 150 -o timeout_method=thread $tests 2>&1 | grep -v '^$'"

if [ "$QUICK" = "1" ]; then
  d2h=(--rounds 1)
  d2h_states="24MB:mixed"
  gpt=(--gpt tiny --ckpt-every 2 --iters 4 --warmup 1 --repeats 1 --disk-probe 64MiB)
  gpt_k1=(--gpt tiny@b8 --ckpt-every 1 --iters 2 --warmup 1 --repeats 1 --disk-probe 64MiB)
  restore=(--total-mib 64 --tensor-mib 8 --rounds 1)
  h2d=(--rounds 1 --dir "${TMPDIR:-/tmp}")
  h2d_states="24MB:mixed"
  synth=(--synthetic 24MB:mixed --repeats 1 --disk-probe 64MiB)
  fsdp2=(--layers 4 --width 256 --batch 64 --iters 2 --ckpt-every 1)
else
  d2h=(--rounds 3)
  d2h_states="2GB:mixed 2GB:large"
  gpt=(--gpt large --ckpt-every 5 --iters 10 --warmup 2 --repeats 1 --disk-probe 1GiB)
  # a step (1.6 s on an H200) longer than the flush of its 2.2 GB checkpoint (~1.5 s here)
  gpt_k1=(--gpt large@b128 --ckpt-every 1 --iters 21 --warmup 1 --repeats 1 --disk-probe 1GiB)
  restore=(--total-mib 2048 --tensor-mib 64 --rounds 2)
  h2d=(--rounds 3 --dir /dev/shm)
  h2d_states="2GB:mixed 2GB:large"
  synth=(--synthetic 1GB:mixed,512MB:large --repeats 1 --saves 2 --disk-probe 1GiB)
  fsdp2=(--layers 40 --width 4096 --batch 8192 --iters 6 --ckpt-every 3 --budget-s 120)
fi
export BENCH_DIR="$WORK"
mkdir -p "$WORK/results"
for st in $d2h_states; do
  step "d2h-$st" 60 "$PY" -m benchmarks.d2h --device "$DEV" --state "$st" "${d2h[@]}" \
    --out "$WORK/results/d2h-${st//:/-}.json"
done
for st in $h2d_states; do
  step "h2d-$st" 70 "$PY" -m benchmarks.h2d_restore --device "$DEV" --state "$st" "${h2d[@]}" \
    --out "$WORK/results/h2d-${st//:/-}.json"
done
for f in "$WORK"/results/h2d-*.json; do
  [ -f "$f" ] && "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("h2d", d["tensors"], "tensors:", {k: round(v, 3) for k, v in d["x_pinned_h2d"].items()},
      {k: round(v, 2) for k, v in d["gb_per_s"].items()}, "GB/s; data phase",
      {k: round(v, 3) for k, v in d["data_x_pinned_h2d"].items()}, d["errors"],
      d["last_read"].get("datastates"))' "$f"
done
# a checkpoint every iteration, the final drain amortised over 21 checkpoints (goal: <= 1%)
step gptk1 200 "$PY" -m benchmarks.run --device "$DEV" "${gpt_k1[@]}" --scenarios gpt \
  --contenders "${GPU_CHECK_TRAIN_K1:-ds_plain,dcp_async_stager}" --dir "$WORK/ckpt" \
  --out "$WORK/results/train-k1"
step fsdp2 160 "$PY" -m benchmarks.fsdp2_train --device "$DEV" "${fsdp2[@]}" \
  --out "$WORK/results/fsdp2.json"
if [ -f "$WORK/results/fsdp2.json" ]; then
  "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("fsdp2", d["device"], d["state_bytes"] / 1e9, "GB; errors", d["errors"], "verify", d["verify"])
for n, r in d["summary"].items(): print(" ", n, {k: round(v, 3) for k, v in r.items() if v is not None})' \
    "$WORK/results/fsdp2.json"
fi
for f in "$WORK"/results/d2h-*.json; do
  [ -f "$f" ] && "$PY" -c 'import json, sys; d = json.load(open(sys.argv[1]))
print("d2h", d["tensors"], "tensors:", {k: round(v, 3) for k, v in d["x_pinned_copy"].items()},
      "engine", d.get("engine"))' "$f"
done
step gpt 180 "$PY" -m benchmarks.run --device "$DEV" "${gpt[@]}" --scenarios gpt \
  --contenders "${GPU_CHECK_TRAIN:-ds_plain,dcp_fs_tN,dcp_async_stager,dcp_async,torch_save}" --dir "$WORK/ckpt" \
  --out "$WORK/results/train"
step restore 60 "$PY" -m benchmarks.restore --device "$DEV" "${restore[@]}" \
  --out "$WORK/results/restore.json"
step synthetic 120 "$PY" -m benchmarks.run --device "$DEV" "${synth[@]}" --scenarios synthetic \
  --contenders "${GPU_CHECK_SYNTH:-torch_save,dcp_fs_tN,ds_async}" --dir "$WORK/ckpt" \
  --out "$WORK/results/synthetic"

for f in "$WORK"/results/*/*.md; do
  [ -f "$f" ] && { echo "=== $f"; cat "$f"; }
done
tar -C "$WORK" -czf "$OUT/results.tgz" results 2>/dev/null
rm -rf "$WORK"
echo "=== done at $(date +%T)"
