# Sourced by the suites beside it. Gives them: the repository root as the working directory and first on PYTHONPATH
# (the checkout's code is what runs), $OUT (required: the one folder a suite writes), a CUDA check before any work,
# the names results are saved under, and `step`, which runs one measurement with its log in $OUT/logs and goes on
# when it fails; `finish` then exits 1 if any step failed. Nothing here depends on a particular machine or scheduler:
# any machine with a CUDA GPU, Python with torch and this repository's requirements will do.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
if [ -z "${OUT:-}" ]; then
  echo "error: set OUT to the folder this suite writes, e.g. OUT=/tmp/bench bash $0" >&2
  exit 2
fi
# The card's short name (h200, h100, a100, ...) and how many there are: results are named <date>-<N>x<card>-...
if ! CARD_INFO="$("$PY" -c 'import torch
assert torch.cuda.is_available(), "torch sees no CUDA GPU"
print(torch.cuda.get_device_name(0).replace("NVIDIA ", "").split()[0].lower(), torch.cuda.device_count())' 2>&1)"; then
  echo "error: this suite needs a CUDA GPU and torch: ${CARD_INFO##*$'\n'}" >&2
  exit 2
fi
read -r CARD GPUS <<<"$CARD_INFO"
mkdir -p "$OUT/logs" || exit 2
OUT="$(cd "$OUT" && pwd)"
DAY="$(date +%F)"
# The commit measured, so that two launches of a day keep both files: $WORKBENCH_GIT_COMMIT where set (the bench
# records the same; a copied tree's .git can be stale), else the checkout's, else none.
COMMIT="${WORKBENCH_GIT_COMMIT:-$(git rev-parse HEAD 2>/dev/null || true)}"
COMMIT="${COMMIT:0:7}"
TAG="${COMMIT:+-$COMMIT}"
FAILED=()
echo "suite $(basename "$0"): $GPUS x $CARD, commit ${COMMIT:-unknown}, writing $OUT"

# selected NAME: whether ONLY (a space-separated list of step names) is unset or names NAME.
selected() {
  [ -z "${ONLY:-}" ] || [[ " $ONLY " == *" $1 "* ]]
}

# step NAME COMMAND...: runs COMMAND (its output in $OUT/logs/NAME.log) unless ONLY names other steps; a failure is
# recorded, its log's last lines printed, and the suite goes on. STEP_LIMIT (seconds, default 3600) bounds each step.
step() {
  local name=$1 t0=$SECONDS rc
  shift
  selected "$name" || return 0
  echo "== $name: $*"
  timeout "${STEP_LIMIT:-3600}" "$@" >"$OUT/logs/$name.log" 2>&1
  rc=$?
  echo "   exit $rc after $((SECONDS - t0)) s, log $OUT/logs/$name.log"
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name")
    tail -5 "$OUT/logs/$name.log"
  fi
}

finish() {
  if [ "${#FAILED[@]}" -gt 0 ]; then
    echo "failed steps: ${FAILED[*]}"
    exit 1
  fi
  echo "every step passed; results under $OUT"
}
