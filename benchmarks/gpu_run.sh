#!/usr/bin/env bash
# Issue 6 device run on 2 x H200: the Transformers v5 anchor and the engine in the same launch.
#   phase 2gpu: 2 GPUs, 16 layers, seq 4096, local batch 2, 3 warm-up + 17 timed steps (20-step loss curves)
#   phase 1gpu: 1 GPU,   8 layers, same shapes
# Writes $OUT/results/*.json and $OUT/logs/*.log. Usage (from the repository root, on the device):
#   WORKBENCH_GIT_COMMIT=<sha> bash benchmarks/gpu_run.sh            # both phases (~5-7 minutes)
#   PHASES=2gpu ENGINE_FLAGS="--fused-ce" bash benchmarks/gpu_run.sh  # one phase, extra engine flags
set -uo pipefail

# NVLink multicast must stay off on these hosts (KINDS.md); unbuffered so logs survive a timeout.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
OUT="${OUT:-$PWD/bench-out}"
PY="${PYTHON:-python3}"
PHASES="${PHASES:-2gpu 1gpu}"
VARIANTS="${VARIANTS:-anchor,engine,engine_balanced,anchor_cudnn}"
ENGINE_FLAGS="${ENGINE_FLAGS:-}"
PRESET="${PRESET:-qwen3-30b-a3b}"   # PRESET=tiny SEQ=64 checks this script on a CPU machine
SEQ="${SEQ:-4096}"
BATCH="${BATCH:-2}"
STEPS="${STEPS:-17}"
WARMUP="${WARMUP:-3}"
export WORKBENCH_BENCH_TMP="${WORKBENCH_BENCH_TMP:-/tmp}"  # the shared initial checkpoint (~21 GB), deleted after
RESULTS="$OUT/results"
LOGS="$OUT/logs"
mkdir -p "$RESULTS" "$LOGS"

{
  date -Is
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m
  "$PY" -c 'import torch, transformers, triton; print("torch", torch.__version__, "transformers", transformers.__version__,
"triton", triton.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count())'
  df -h "$WORKBENCH_BENCH_TMP"
} >"$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

COMMON=(--preset "$PRESET" --seq "$SEQ" --batch "$BATCH" --warmup "$WARMUP" --steps "$STEPS" --variants "$VARIANTS"
        --out-dir "$RESULTS" --no-html)
status=0
for phase in $PHASES; do
  case "$phase" in
    2gpu)
      echo "=== 2 x H200, 16 layers ==="
      timeout "${TIMEOUT_2GPU:-330}" "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m workbench.bench "${COMMON[@]}" --layers "${LAYERS_2GPU:-16}" \
        $ENGINE_FLAGS 2>&1 | tee "$LOGS/2xh200-L16.log"
      rc=${PIPESTATUS[0]} ;;
    1gpu)
      echo "=== 1 x H200, 8 layers ==="
      CUDA_VISIBLE_DEVICES=0 timeout "${TIMEOUT_1GPU:-220}" "$PY" -m workbench.bench "${COMMON[@]}" --layers "${LAYERS_1GPU:-8}" \
        $ENGINE_FLAGS 2>&1 | tee "$LOGS/1xh200-L8.log"
      rc=${PIPESTATUS[0]} ;;
    *) echo "unknown phase $phase (use 2gpu, 1gpu)"; rc=2 ;;
  esac
  echo "phase $phase exit $rc" | tee -a "$LOGS/phases.txt"
  [ "$rc" -eq 0 ] || status=$rc
  rm -rf "$WORKBENCH_BENCH_TMP"/workbench-bench-* 2>/dev/null  # a killed run leaves its checkpoint behind
done
ls -la "$RESULTS"
exit $status
