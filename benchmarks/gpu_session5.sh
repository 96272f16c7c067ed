#!/usr/bin/env bash
# Session 5 (issue 15) device run on 1 x H200, under 9 minutes: `workbench bench` timing the product's
# step (Trainer.train_step) for every row, variants in alternating rounds (ABC CBA), median with p10-p90.
#   A  qwen3-30b-a3b L8,  seq 4096 x 2:  anchor, anchor_liger, engine, engine_balanced, engine_adamw_torch,
#                                         engine_bf16, engine_fp32_master; 2 warm-up + 30 timed steps (1 round)
#   B  qwen3-30b-a3b L8,  seq 16384 x 1: anchor, engine; 2 warm-up + 10 timed steps (2 rounds)
#   C  qwen3-30b-a3b L16, seq 4096 x 2:  anchor, engine; 2 warm-up + 10 timed steps (2 rounds)
# A runs first and always; B and C only while the time budget (BUDGET_S, default 540 s) lasts, each under
# its own timeout. Results JSON (one per launch) under $OUT/results, logs under $OUT/logs.
# Usage (repository root, on the device):  OUT=/path bash benchmarks/gpu_session5.sh
# The same launches at tiny size (a CPU check of this script):  TINY=1 OUT=/tmp/s5 bash benchmarks/gpu_session5.sh
# Measured 2026-12-01: each variant build + 22 steps ~40 s at L8, so A ~5 min (7 builds), B ~1.5 min, C ~2 min.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
# carried wheels (liger-kernel among them) into a private site dir
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export PYTHONPATH="${PYTHONPATH:-$PWD}" PYTHONUNBUFFERED=1
export WORKBENCH_GIT_COMMIT="${WORKBENCH_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
OUT="${OUT:-$PWD/bench-out}"
RESULTS="$OUT/results"
LOGS="$OUT/logs"
mkdir -p "$RESULTS" "$LOGS"
export WORKBENCH_BENCH_TMP="${WORKBENCH_BENCH_TMP:-/tmp/workbench-s5-$$}"  # the launches' initial checkpoints
mkdir -p "$WORKBENCH_BENCH_TMP"
BUDGET_S="${BUDGET_S:-540}"
DAY="$(date +%F)"
PY="${PYTHON:-python3}"
if [ "${TINY:-0}" = 1 ]; then  # tiny model and shapes, 4 timed steps: the script's plumbing on a CPU
  PRESET=tiny L8=2 L16=3 S4K=64 S16K=128 STEPS_A=4 STEPS_BC=2 DEV=cpu
else
  PRESET=qwen3-30b-a3b L8=8 L16=16 S4K=4096 S16K=16384 STEPS_A=30 STEPS_BC=10 DEV=1xh200
fi

{
  date -Is
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__,
"triton", triton.__version__, "cuda", torch.cuda.is_available())'
  "$PY" -c 'import liger_kernel, importlib.metadata as m; print("liger-kernel", m.version("liger-kernel"))' 2>&1 | tail -1
  echo "git $WORKBENCH_GIT_COMMIT"
  df -h "$WORKBENCH_BENCH_TMP"
} >"$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

status=0
launch() {  # name limit_s args...: one bench launch, bounded by its limit and what is left of the budget
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - ($(date +%s) - START)))
  if [ "$left" -lt 60 ]; then
    echo "=== $name: skipped, ${left}s of the ${BUDGET_S}s budget left ===" | tee -a "$LOGS/launches.txt"
    return
  fi
  [ "$left" -lt "$limit" ] && limit=$left
  echo "=== $name (limit ${limit}s) ===" | tee -a "$LOGS/launches.txt"
  local t0=$(date +%s)
  CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" timeout "$limit" "$PY" -m workbench.bench --preset "$PRESET" \
    --fused-ce --out-dir "$RESULTS" --no-html --name "$DAY-$DEV-$name" "$@" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$name exit $rc after $(($(date +%s) - t0))s" | tee -a "$LOGS/launches.txt"
  [ "$rc" -eq 0 ] || status=$rc
  rm -rf "$WORKBENCH_BENCH_TMP"/workbench-bench-* 2>/dev/null  # a killed launch leaves its checkpoint behind
}

# One round: each round rebuilds every variant (~40 s each at L8 on the H200), so 7 variants x 2 rounds ran
# past 330 s (2026-12-01); alternating rounds stay for the two-variant launches below.
launch qwen3-L8-4096x2 400 --layers "$L8" --seq "$S4K" --batch 2 --warmup 2 --steps "$STEPS_A" --rounds 1 \
  --variants anchor,anchor_liger,engine,engine_balanced,engine_adamw_torch,engine_bf16,engine_fp32_master
launch qwen3-L8-16384x1 120 --layers "$L8" --seq "$S16K" --batch 1 --warmup 2 --steps "$STEPS_BC" --rounds 2 \
  --variants anchor,engine
launch qwen3-L16-4096x2 150 --layers "$L16" --seq "$S4K" --batch 2 --warmup 2 --steps "$STEPS_BC" --rounds 2 \
  --variants anchor,engine

rmdir "$WORKBENCH_BENCH_TMP" 2>/dev/null
echo "total $(($(date +%s) - START))s" | tee -a "$LOGS/launches.txt"
ls -la "$RESULTS"
exit $status
