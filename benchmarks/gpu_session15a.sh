#!/usr/bin/env bash
# Session 15's first measuring call (1 x H200; carry .device_commit): the clipping norm's squares summed during the
# backward (train/grad_squares.py) and the unrolled sum-of-squares kernel. Their CUDA tests; the kernel against the
# loop it replaced (benchmarks/sum_squares_kernel.py); the trainer's step with the norm in the backward and after it,
# alternating (profile_trainer.py --no-trace); then Qwen3-30B-A3B L8 seq 4096 x 2, anchor and engine in one launch.
#   OUT=/path bash benchmarks/gpu_session15a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 200 tests/test_grad_squares.py tests/test_sum_squares.py -k cuda
timeout 90 python3 benchmarks/sum_squares_kernel.py 2>&1 | tail -2 | cut -c1-300
for flag in "" --norm-after-backward "" --norm-after-backward; do
  timeout 100 python3 benchmarks/profile_trainer.py --layers 8 --precision auto --steps 20 --no-trace $flag \
    --out "$OUT/prof" 2>&1 | grep '^auto' | python3 -c "import json,sys; r=json.loads(sys.stdin.read()[5:]); \
print('norm_after' if r['norm_after_backward'] else 'norm_in_bwd', round(r['step_ms_queued'],2), \
{k: round(v,2) for k,v in r['records_median_ms'].items()}, 'groups', r['norm_groups_from_backward'], \
'peak', round(r['peak_gib'],2))"
done
bench_row qwen3-L8-4096x2-s15a $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
