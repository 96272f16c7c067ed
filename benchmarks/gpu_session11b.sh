#!/usr/bin/env bash
# Session 11, second call (1 x H200, ~7 minutes; carry .whl and .device_commit): the fused CE's chunk size alone
# (ce_chunks.py) and in the trainer's step (Moonlight L8 eager at three logits budgets), the host-answered
# packed-rows check's tests on CUDA, then Moonlight L8 seq 4096 x 2 (anchor, engine, engine_cuda_graphs), one launch.
#   OUT=/path bash benchmarks/gpu_session11b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 100 python3 benchmarks/ce_chunks.py > "$OUT/ce.log" 2>&1
echo "ce_chunks exit $? after $((SECONDS - T0)) s"; cat "$OUT/ce.log" | cut -c1-200
for mib in 512 1536 2600; do
  timeout 45 python3 benchmarks/profile_trainer.py --preset moonlight-16b-a3b --layers 8 --precision auto --warmup 3 \
    --steps 12 --no-trace --out "/tmp/ce$mib" --ce-chunk-mib $mib >> "$OUT/ab.log" 2>&1
  echo "ce budget $mib MiB exit $? after $((SECONDS - T0)) s"; grep "^auto" "$OUT/ab.log" | tail -1 | cut -c1-330
done
gpu_tests 120 tests/test_unpacked_rows.py tests/test_trainer_async.py tests/test_kernels.py
bench_row moonlight-L8-s11b $((560 - SECONDS + T0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
