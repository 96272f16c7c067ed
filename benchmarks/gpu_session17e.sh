#!/usr/bin/env bash
# Session 17's fifth call (1 x H200; carry .whl, .device_commit and .ab with the previous commit's workbench/ in
# .ab/old): same-machine A/B of the one-division AdamW (profile_trainer.py --no-trace, old/new alternating, twice), the GPU's
# clocks and power meanwhile, the AdamW CUDA tests, and the Qwen3 L8 bench row with its anchor.
#   OUT=/path bash benchmarks/gpu_session17e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 250 > "$OUT/smi.csv" 2>&1 &
SMI=$!
BASE_PATH=$PYTHONPATH
for round in 1 2; do
  for side in old new; do
    if [ "$side" = old ]; then export PYTHONPATH=$PWD/.ab/old:$BASE_PATH; else export PYTHONPATH=$BASE_PATH; fi
    log="$OUT/ab-$side-$round.log"
    echo "== $side $round start $(date +%T.%N)" >> "$OUT/ab-marks.log"
    timeout 150 python3 benchmarks/profile_trainer.py --layers 8 --precision auto --no-trace --steps 20 \
      --out "$OUT/ab-$side-$round" > "$log" 2>&1
    echo "== $side $round end $(date +%T.%N)" >> "$OUT/ab-marks.log"
    echo "$side $round: $(grep -oE '"step_ms_queued": [0-9.]+' "$log") $(grep -oE '"records_median_ms": \{[^}]*\}' "$log")"
    grep -E "Error|Traceback" "$log" | head -3
  done
done
export PYTHONPATH=$BASE_PATH
gpu_tests 200 tests/test_precision.py tests/test_optim_triton.py tests/test_adamw_multi.py tests/test_backward_updates.py \
  -k "one_division or bit_for_bit or cuda"
echo "== bench start $(date +%T.%N)" >> "$OUT/ab-marks.log"
bench_row qwen3-L8-4096x2-s17e 240 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
kill $SMI 2>/dev/null
# clocks and power while the GPU drew more than 300 W (the steps), and the throttle reasons seen
awk -F', ' '$4 > 300 {n++; clk += $2; pw += $4; if ($2 < min || min == "") min = $2; r[$6]++}
  END {if (n) {printf "smi busy samples %d: sm clock mean %.0f min %d MHz, power mean %.0f W\n", n, clk / n, min, pw / n;
  for (k in r) printf "  throttle %s: %d samples\n", k, r[k]}}' "$OUT/smi.csv"
