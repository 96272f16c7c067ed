#!/usr/bin/env bash
# Session 16's fourth call (1 x H200; carry .whl and .device_commit): one step's gradients at the real shapes
# (benchmarks/grad_parity.py, 2 layers, seq 4096 x 1), each model against float32 Transformers from the same bf16
# weights: the bf16 anchor and engine variants (the product, no fused CE, torch ops for every Triton kernel, and the
# engine in float32), for qwen3-30b-a3b and gpt-oss-20b. The first run (engine only) had the engine's bf16
# gradients 3-5x further from float32 than the anchor's on both models, where the CPU runs had them closer.
#   OUT=/path bash benchmarks/gpu_session16d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
run_parity() {  # preset engines limit
  timeout "$3" python3 benchmarks/grad_parity.py --preset "$1" --layers 2 --engines "$2" \
    --out "$OUT/grad-parity-$1.json" > "$OUT/grad-parity-$1.log" 2>&1
  echo "$1 exit $? after $((SECONDS - T0)) s"
  grep -E "^loss|^param|failed|norm.weight|lm_head|embed|layers.1.*(sinks|experts.down|gate.weight|router.weight|q_proj.weight)|Error" \
    "$OUT/grad-parity-$1.log" | cut -c1-220
}
run_parity qwen3-30b-a3b engine,engine_no_fused_ce,engine_torch_kernels,engine_fp32 200
run_parity gpt-oss-20b engine,engine_no_fused_ce,engine_torch_kernels 200
