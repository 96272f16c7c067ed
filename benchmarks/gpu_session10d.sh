#!/usr/bin/env bash
# Session 10, last call (1 x H200, ~8 minutes; carry .whl and .device_commit): the session's kernels compiled
# (fused MLA q/k/v, the clipping norm's sum of squares, equal CE chunks, DeepSeek's tensor-core router logits) in
# their tests and the bf16 family parity on CUDA, then Qwen3 L8 and Moonlight L8 at seq 4096 x 2 (anchor, engine,
# engine_cuda_graphs), one launch each.
#   OUT=/path bash benchmarks/gpu_session10d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_mla_attention.py tests/test_sum_squares.py \
  tests/test_stack_graphs.py tests/test_router.py \
  "tests/test_generic_families.py::test_bf16_on_cuda_matches_transformers_grouped_mm" > "$OUT/pytest.log" 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -1 "$OUT/pytest.log" | cut -c1-300
grep -E "^E |^FAILED" "$OUT/pytest.log" | head -6 | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
mkdir -p "$OUT/bench"
bench() {  # name, limit, args...
  echo "== $1" >> "$OUT/bench.log"
  timeout "$2" python3 -m workbench.bench --fused-ce --out-dir "$OUT/bench" --no-html --name "$(date +%F)-1xh200-$1" \
    --warmup 2 --steps 30 --rounds 1 "${@:3}" >> "$OUT/bench.log" 2>&1
  echo "bench $1 exit $? after $((SECONDS - t0)) s"
  sed -n "/== $1/,\$p" "$OUT/bench.log" | grep -E "^bench: [a-z_]+:|x tokens/s|failed|Error" | cut -c1-260
}
bench qwen3-L8-4096x2-s10d 170 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
bench moonlight-L8-s10d $((500 - SECONDS + t0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
find "$OUT" -name "*.html" -delete
