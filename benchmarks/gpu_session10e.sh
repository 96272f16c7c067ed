#!/usr/bin/env bash
# Session 10, A/B (1 x H200, ~2 minutes; carry .whl and .device_commit): what Transformers' per-forward packed-rows
# check costs (`(packed_sequence_mask[:, -1] == 0).all()`, a host sync at the start of every training forward; 10d's
# Moonlight profile: 15 ms of cudaStreamSynchronize per step). profile_trainer --no-packed-check answers it without a
# read; eager engine steps, alternating, Moonlight L8 and Qwen3 L8 at seq 4096 x 2.
# (Session 11: the trainer now answers the check from the host position ids, models/host_packing.py, and the flag is gone.)
#   OUT=/path bash benchmarks/gpu_session10e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
run() {  # name, preset, extra flags
  echo "== $1" >> "$OUT/ab.log"
  timeout 45 python3 benchmarks/profile_trainer.py --preset "$2" --layers 8 --precision auto --warmup 3 --steps 12 \
    --no-trace --out "/tmp/$1" "${@:3}" >> "$OUT/ab.log" 2>&1
  echo "$1 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/ab.log" | tail -1 | cut -c1-330
}
run moonlight-check moonlight-16b-a3b
run moonlight-nocheck moonlight-16b-a3b --no-packed-check
run qwen3-nocheck qwen3-30b-a3b --no-packed-check
run qwen3-check qwen3-30b-a3b
