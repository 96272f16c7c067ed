#!/usr/bin/env bash
# The kernel microbenchmarks: each script in benchmarks/ that times a kernel the product runs, alone on one GPU
# (CUDA-event medians), at the Qwen3-30B-A3B, gpt-oss-20b or Moonlight-16B-A3B shapes its docstring names. By family
# (FAMILIES="adamw attention" runs some; ONLY="<step> ..." runs single steps):
#   adamw        adamw_modes (TritonAdamW per precision mode over the L8 model's tensors, torch's fused AdamW beside),
#                adamw_sweep (its launch shape: block x warps, per tensor and over flat buffers),
#                adamw8_kernel (8-bit against bf16 moments per expert tensor, in-backward launches with the squares)
#   attention    attention_sinks (GPT-OSS's sink attention: flash, cuDNN, their Triton glue, Transformers' eager/flex),
#                mla_attention (MLA's q/k 192 / v 128 heads: each SDPA backend, padded flash and cuDNN)
#   ce           ce_rows_kernel (the fused CE's softmax-gradient kernel and its in-place scale),
#                ce_chunks (the fused linear CE's time and memory per chunk count)
#   experts      grouped_wgrad (the experts' weight gradient: CUTLASS + the norm's read against the Triton kernel),
#                grouped_mm_tune (ATen's grouped GEMMs against Inductor's autotuned Triton template; minutes of compile),
#                gpt_oss_gate (GPT-OSS's expert activation: Transformers' ops against the fused Triton gate)
#   moe          combine_kernel (the weighted combine forward and backward), pair_gemm_check (the router's one-GEMM
#                input gradient against float64: where cuBLAS rounds)
#   norms        rms_norm_kernel (the Triton RMSNorm per launch shape)
# Each writes $OUT/kernels/<date>-1x<card>-<script>-<commit>.json (or .jsonl: one JSON object a line). ~7 minutes on
# an H100. adamw_modes holds the Qwen3 L8 model's parameters, gradients and moments for every precision mode at once,
# more than 80 GB: on an 80 GB card set ADAMW_LAYERS=4 (the AdamW scripts' model depth, default 8).
#   OUT=/tmp/kernels bash benchmarks/suites/kernels.sh
source "$(dirname "$0")/common.sh"
mkdir -p "$OUT/kernels"
FAMILIES="${FAMILIES:-adamw attention ce experts moe norms}"

# kernel SCRIPT EXT HOW ARGS...: HOW is "out" (the script takes --out FILE), "arg" (FILE as its first argument) or
# "stdout" (it prints its JSON).
kernel() {
  local script=$1 ext=$2 how=$3 file
  shift 3
  file="$OUT/kernels/$DAY-1x$CARD-${script//_/-}$TAG.$ext"
  case "$how" in
    out) step "$script" "$PY" "benchmarks/$script.py" --out "$file" "$@" ;;
    arg) step "$script" "$PY" "benchmarks/$script.py" "$file" "$@" ;;
    stdout) step "$script" bash -c '"$0" "benchmarks/$1.py" > "$2"' "$PY" "$script" "$file" ;;
  esac
}

for family in $FAMILIES; do
  case "$family" in
    adamw)
      kernel adamw_modes json out --layers "${ADAMW_LAYERS:-8}"
      kernel adamw_sweep json out --layers "${ADAMW_LAYERS:-8}"
      kernel adamw8_kernel jsonl stdout ;;
    attention)
      kernel attention_sinks json arg
      kernel mla_attention json out ;;
    ce)
      kernel ce_rows_kernel json out
      kernel ce_chunks jsonl stdout ;;
    experts)
      kernel grouped_wgrad json out
      kernel grouped_mm_tune json out
      kernel gpt_oss_gate json arg ;;
    moe)
      kernel combine_kernel jsonl stdout
      kernel pair_gemm_check json arg ;;
    norms)
      kernel rms_norm_kernel jsonl stdout ;;
    *)
      echo "unknown family $family (adamw, attention, ce, experts, moe, norms)" >&2
      FAILED+=("$family") ;;
  esac
done
finish
