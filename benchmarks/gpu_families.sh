#!/usr/bin/env bash
# Device run on 1 x H200: one `workbench bench` launch per family, every row timed through the product's
# step (Trainer.train_step), the engine (generic path) against the Transformers v5 anchor and the v5 +
# Liger anchor from the same initial weights and tokens, variants in alternating rounds (ABC CBA);
# speedups are against each launch's best plain-Transformers anchor row that ran (reference_anchor).
#   qwen3-30b-a3b     L8: anchor, anchor_liger, engine, engine_balanced
#   gpt-oss-20b       L8: anchor (recorded as skipped: GPT-OSS refuses sdpa), anchor_flex, anchor_eager_attn
#                         (115 GiB measured; GPTOSS_EAGER=0 leaves it out), anchor_liger, engine, engine_balanced
#   moonlight-16b-a3b L8: anchor, anchor_liger, engine, engine_balanced
# seq 4096 x batch 2, bf16, 2 rounds of warm-up 2 + 5 timed steps (STEPS=10 in all; ROUNDS, WARMUP), the
# engine with --fused-ce (ENGINE_FLAGS). Results JSON and logs under $1 (default ./bench-out); liger-kernel
# from the carried wheels (.whl/, installed into /tmp/site when present). About 1.5-2 min per family.
# Usage (repository root, on the device):  WORKBENCH_GIT_COMMIT=<sha> bash benchmarks/gpu_families.sh "$OUT"
# The same commands at tiny size (CPU, or a GPU preflight):  TINY=1 bash benchmarks/gpu_families.sh /tmp/fam
# One family only: FAMILIES=gpt_oss (qwen3, gpt_oss, deepseek_v3).
set -uo pipefail

# NVLink multicast stays off on these hosts (KINDS.md); unbuffered so logs survive a timeout.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1

cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then  # carried wheels (liger-kernel): a private site dir
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
OUT="${1:-$PWD/bench-out}"
PY="${PYTHON:-python3}"
# The launches' initial checkpoint (10-15 GB at L8) goes in a folder of this script's own, emptied after each.
export WORKBENCH_BENCH_TMP="${WORKBENCH_BENCH_TMP:-/tmp/workbench-families-$$}"
RESULTS="$OUT/results"
LOGS="$OUT/logs"
mkdir -p "$RESULTS" "$LOGS" "$WORKBENCH_BENCH_TMP"
DAY="$(date +%F)"

if [ "${TINY:-0}" = 1 ]; then  # the tiny twins of the same families, CPU-sized
  QWEN=tiny GPTOSS=tiny-gpt-oss MOON=tiny-deepseek-v3 LAYERS=2 SEQ=64 DEV=cpu TIMEOUT=${TIMEOUT:-300}
else
  QWEN=qwen3-30b-a3b GPTOSS=gpt-oss-20b MOON=moonlight-16b-a3b LAYERS=8 SEQ=4096 DEV=1xh200 TIMEOUT=${TIMEOUT:-240}
fi
GPTOSS_VARIANTS="anchor,anchor_flex"
[ "${GPTOSS_EAGER:-1}" = 1 ] && GPTOSS_VARIANTS="$GPTOSS_VARIANTS,anchor_eager_attn"
GPTOSS_VARIANTS="$GPTOSS_VARIANTS,anchor_liger,engine,engine_balanced"

{
  date -Is
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__,
"cuda", torch.cuda.is_available())'
  df -h "$WORKBENCH_BENCH_TMP"
} >"$LOGS/env.txt" 2>&1
cat "$LOGS/env.txt"

COMMON=(--layers "$LAYERS" --seq "$SEQ" --batch 2 --warmup "${WARMUP:-2}" --steps "${STEPS:-10}" --rounds "${ROUNDS:-2}"
        --out-dir "$RESULTS" --no-html)
[ "${TINY:-0}" = 1 ] || COMMON+=(--dtype bfloat16)
# The engine's product settings: the fused linear cross-entropy on the LM head (ENGINE_FLAGS="" drops it).
read -r -a ENGINE_ARGS <<<"${ENGINE_FLAGS---fused-ce}"
COMMON+=("${ENGINE_ARGS[@]}")
status=0
run_family() {  # preset variants
  local preset=$1 variants=$2 name="$DAY-$DEV-$1-L$LAYERS"
  echo "=== $preset L$LAYERS: $variants ==="
  CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" timeout "$TIMEOUT" "$PY" -m workbench.bench --preset "$preset" \
    --variants "$variants" --name "$name" "${COMMON[@]}" 2>&1 | tee "$LOGS/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$preset exit $rc" | tee -a "$LOGS/families.txt"
  [ "$rc" -eq 0 ] || status=$rc
  rm -rf "$WORKBENCH_BENCH_TMP"/workbench-bench-* 2>/dev/null  # a killed run leaves its checkpoint behind
}
for family in ${FAMILIES:-qwen3 gpt_oss deepseek_v3}; do  # FAMILIES="gpt_oss" runs one
  case "$family" in
    qwen3) run_family "$QWEN" "anchor,anchor_liger,engine,engine_balanced" ;;
    gpt_oss) run_family "$GPTOSS" "$GPTOSS_VARIANTS" ;;
    deepseek_v3) run_family "$MOON" "anchor,anchor_liger,engine,engine_balanced" ;;
    *) echo "unknown family $family (qwen3, gpt_oss, deepseek_v3)"; status=2 ;;
  esac
done
rmdir "$WORKBENCH_BENCH_TMP" 2>/dev/null
ls -la "$RESULTS"
exit $status
