# Sourced by the device scripts (benchmarks/gpu_session6*.sh): the NVLS-off settings, the carried wheels in a private
# site dir (.whl, see the device README) and $OUT. Run from the repository root.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
# .whl-ui (ipyparallel, ipywidgets, plotly, anywidget and their Jupyter packages, ~29 MB) only where carried
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
  $(ls .whl-ui/*.whl 2>/dev/null)
export PYTHONPATH=/tmp/site:$PWD
# The device copy's .git can be stale (results JSON of session 7 said cc4a5af for a de87b59 tree): before a call
# write `git rev-parse HEAD > .device_commit` here (git-excluded) and carry it; the bench records that commit.
if [ -f .device_commit ]; then export WORKBENCH_GIT_COMMIT="$(cat .device_commit)"; fi
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
# The GPU kernel, parity, packing and compiled-AdamW tests the device scripts run (one list for all of them).
GPU_TESTS=(tests/test_adamw_multi.py tests/test_kernels.py tests/test_optim_triton.py tests/test_adamw_kernel_choice.py
  tests/test_precision.py tests/test_gpt_oss_gate.py tests/test_te_selection.py tests/test_backend_resolution.py
  tests/test_trainer_async.py tests/test_packing.py tests/test_mm_fp32.py
  "tests/test_generic_families.py::test_bf16_on_cuda_matches_transformers_grouped_mm" tests/test_parity.py
  tests/test_stack_graphs.py tests/test_mla_attention.py tests/test_sum_squares.py tests/test_attention_sinks.py
  tests/test_gpt_oss_gate.py tests/test_backward_updates.py)
T0=$SECONDS
# gpu_tests LIMIT FILES...: pytest into $OUT/pytest.log, its summary and first errors printed, Triton's stray
# subprocesses of a cut run killed.
gpu_tests() {
  timeout "$1" python3 -m pytest -q -rs -p no:cacheprovider "${@:2}" > "$OUT/pytest.log" 2>&1
  echo "tests exit $? after $((SECONDS - T0)) s"; tail -1 "$OUT/pytest.log" | cut -c1-300
  grep -E "^E |^FAILED" "$OUT/pytest.log" | head -6 | cut -c1-300
  pkill -9 -f "python[0-9.]* -c " 2>/dev/null
}
# bench_row NAME LIMIT ARGS...: one `workbench bench` launch (2 warm-up + 30 timed steps, one round) into
# $OUT/bench/<date>-1xh200-NAME.json, its log appended to $OUT/bench.log and its rows printed.
bench_row() {
  mkdir -p "$OUT/bench"
  echo "== $1" >> "$OUT/bench.log"
  timeout "$2" python3 -m workbench.bench --fused-ce --out-dir "$OUT/bench" --no-html --name "$(date +%F)-1xh200-$1" \
    --warmup 2 --steps 30 --rounds 1 "${@:3}" >> "$OUT/bench.log" 2>&1
  echo "bench $1 exit $? after $((SECONDS - T0)) s"
  sed -n "/== $1/,\$p" "$OUT/bench.log" | grep -E "^bench: [a-z_]+:|x tokens/s|failed|Error" | cut -c1-260
}
# ab_sides ROUNDS SPEC... -- ARGS...: a same-machine A/B of profile_trainer.py ARGS over several sides, in the given
# order ROUNDS times; a SPEC is LABEL=TREE or LABEL=TREE,EXTRA ARGS, TREE new (this tree's) or a name X (an earlier
# commit's workbench/, carried in .ab/X, first on PYTHONPATH; "old" by convention the previous commit's). Each side's
# queued step, peak memory and phase medians printed, its log in $OUT/ab-LABEL-ROUND.log.
ab_sides() {
  local rounds=$1 base=$PYTHONPATH specs=() round spec label rest tree extra log
  shift
  while [ "$1" != "--" ]; do specs+=("$1"); shift; done
  shift
  for round in $(seq 1 "$rounds"); do
    for spec in "${specs[@]}"; do
      label=${spec%%=*}; rest=${spec#*=}; tree=${rest%%,*}; extra=""
      if [ "$rest" != "$tree" ]; then extra=${rest#*,}; fi
      if [ "$tree" = new ]; then export PYTHONPATH=$base; else export PYTHONPATH=$PWD/.ab/$tree:$base; fi
      log="$OUT/ab-$label-$round.log"
      # shellcheck disable=SC2086  # EXTRA is a list of arguments
      timeout 150 python3 benchmarks/profile_trainer.py "$@" $extra --out "$OUT/ab-$label-$round" > "$log" 2>&1
      echo "$label $round: $(grep -oE '"step_ms_queued": [0-9.]+' "$log") $(grep -oE '"peak_gib": [0-9.]+' "$log")" \
        "$(grep -oE '"records_median_ms": \{[^}]*\}' "$log")"
      grep -E "Error|Traceback" "$log" | head -3
    done
  done
  export PYTHONPATH=$base
}
# ab_rounds ROUNDS ARGS...: ab_sides with the two trees, old first.
ab_rounds() {
  ab_sides "$1" old=old new=new -- "${@:2}"
}
