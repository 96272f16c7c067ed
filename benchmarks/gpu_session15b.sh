#!/usr/bin/env bash
# Session 15's second call (1 x H200; carry .device_commit): GPT-OSS's sink attention on torch's cuDNN op for full
# causal layers (models/attention_sinks_kernels._CudnnSdpa). Its CUDA test; benchmarks/attention_sinks.py (every
# option's fwd+bwd time and error per layer type); the gpt-oss-20b L8 in-backward step with full layers on flash and
# on cuDNN, alternating (profile_trainer.py --no-trace); one profiled step of the cuDNN run (kernel table).
#   OUT=/path bash benchmarks/gpu_session15b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 120 tests/test_attention_sinks.py -k cuda
timeout 150 python3 benchmarks/attention_sinks.py "$OUT/attention_sinks.json" 2>&1 | grep -vi warn | tail -16 | cut -c1-200
ab() {  # ab KERNEL [more profile_trainer args]: one in-backward gpt-oss L8 run, its step time and phases in a line
  timeout 120 python3 benchmarks/profile_trainer.py --preset gpt-oss-20b --layers 8 --precision auto --in-backward \
    --warmup 3 --steps 10 --sink-kernel-full "$1" --out "$OUT/prof-$1" "${@:2}" > "$OUT/prof-$1.log" 2>&1
  grep '^auto {' "$OUT/prof-$1.log" | \
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()[5:]); print(r['sink_kernel_full'], \
round(r['step_ms_queued'],2), {k: round(v,2) for k,v in r['records_median_ms'].items()}, 'peak', round(r['peak_gib'],2))"
}
for kernel in flash cudnn flash cudnn; do ab $kernel --no-trace; done
ab cudnn  # with a profiled step: its kernel table
grep "^  " "$OUT/prof-cudnn.log" | head -30 | cut -c1-160
echo "done after $((SECONDS - T0)) s"
