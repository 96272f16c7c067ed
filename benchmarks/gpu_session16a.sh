#!/usr/bin/env bash
# Session 16's first call (1 x H200; carry .whl with datasets, dill, multiprocess, and .device_commit): the GPU tests
# (gpu_env.sh's list; the in-backward trainer cases read the demo's JSONL through `datasets`), then where GPT-OSS-20B
# L8's in-backward step goes with 8-bit moments (one profiled step: kernels and aten calls), beside the step time
# with bf16 moments.
#   OUT=/path bash benchmarks/gpu_session16a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 220 "${GPU_TESTS[@]}" -k "cuda or rope"
for states in 8bit full; do
  trace=$([ "$states" = full ] && echo --no-trace)
  timeout 170 python3 benchmarks/profile_trainer.py --preset gpt-oss-20b --layers 8 --precision auto --steps 10 \
    --in-backward --optimizer-states $states $trace --out "$OUT/prof-$states" > "$OUT/prof-$states.log" 2>&1
  echo "profile $states exit $? after $((SECONDS - T0)) s"
  grep -v '^auto {' "$OUT/prof-$states.log" | grep -E "ms|wall|gap" | head -80 | cut -c1-250
  grep '^auto {' "$OUT/prof-$states.log" | python3 -c "import json,sys; r=json.loads(sys.stdin.read()[5:]); \
print('$states', round(r['step_ms_queued'],2), {k: round(v,2) for k,v in r['records_median_ms'].items()}, \
'peak', round(r['peak_gib'],2))"
done
