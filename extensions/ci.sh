#!/usr/bin/env bash
# Build, install and test the MoE Workbench JupyterLab extension (called by .ci/run).
#   PYTHON=/path/to/venv/bin/python extensions/ci.sh
# Steps: Debian chromium (apt-get, if missing) -> pip install the extension (npm install + build
# through hatch-jupyter-builder) -> check both extension lists -> server tests -> Galata UI test
# in headless chromium. Screenshots land in artifacts/ (lab-sidebar.png, lab-run-view.png,
# lab-run-view-step-time.png).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-python}"
PY_BIN="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')")"
export PATH="$PY_BIN:$PATH"   # jupyter/npm builds must see this environment's jupyter
ARTIFACTS="$ROOT/artifacts"
mkdir -p "$ARTIFACTS"
step() { echo "== extensions/ci.sh: $* ($(date +%T))"; }

step "chromium"
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" -ne 0 ]; then echo "chromium missing and not root: apt-get install chromium" >&2; exit 1; fi
  apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; }
fi
chromium --version

step "pip install extensions/moe_workbench_lab (npm install + @jupyter/builder build)"
"$PYTHON" -m pip install -q -e extensions/moe_workbench_lab
"$PYTHON" -m pip install -q "pytest-jupyter[server]>=0.10"

step "extension lists"
jupyter labextension list 2>&1 | tee /tmp/mwb-labext.txt
jupyter server extension list 2>&1 | tee /tmp/mwb-serverext.txt
grep -E "moe-workbench-lab v[0-9.]+ .*enabled.*OK" /tmp/mwb-labext.txt >/dev/null \
  || { echo "moe-workbench-lab is not enabled in JupyterLab" >&2; exit 1; }
grep -E "moe_workbench_lab .*enabled" /tmp/mwb-serverext.txt >/dev/null \
  || { echo "moe_workbench_lab is not an enabled server extension" >&2; exit 1; }

step "server tests (pytest-jupyter)"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/lab

step "UI test data: a run directory, a corrupt one, notebooks"
WORK="$(mktemp -d /tmp/mwb-ui.XXXXXX)"
# The runs folder inside the lab's root: the launcher copies notebooks beside it (moe-workbench/notebooks),
# where the lab can open them.
export WORKBENCH_RUNS_DIR="$WORK/root/moe-workbench/runs"
# Real `workbench finetune` runs (2 CPU ranks) for the sidebar to list: a named full run with eval on,
# and a named LoRA run of 20 steps.
MWB_UI_RUN_ID="$("$PYTHON" tests/lab/make_run.py "$WORKBENCH_RUNS_DIR" | tail -n 1)"
MWB_UI_LORA_RUN_ID="$("$PYTHON" tests/lab/make_run.py "$WORKBENCH_RUNS_DIR" --lora | tail -n 1)"
export MWB_UI_RUN_ID MWB_UI_LORA_RUN_ID
# An unnamed run (the full run's copy without its name): the sidebar shows its folder id whole.
export MWB_UI_UNNAMED_RUN_ID="20261206-000000-unnamed-run-with-a-long-folder-id"
cp -r "$WORKBENCH_RUNS_DIR/$MWB_UI_RUN_ID" "$WORKBENCH_RUNS_DIR/$MWB_UI_UNNAMED_RUN_ID"
"$PYTHON" - "$WORKBENCH_RUNS_DIR/$MWB_UI_UNNAMED_RUN_ID/config.json" <<'PY'
import json, sys
config = json.load(open(sys.argv[1]))
config["name"] = None
json.dump(config, open(sys.argv[1], "w"))
PY
mkdir -p "$WORKBENCH_RUNS_DIR/00000000-000000-bad0"
printf '{"model": {"pres' > "$WORKBENCH_RUNS_DIR/00000000-000000-bad0/config.json"
if ! ls notebooks/*.ipynb >/dev/null 2>&1; then
  # The repository has no notebooks yet: give the launcher one to open.
  mkdir -p "$WORK/notebooks"
  "$PYTHON" - "$WORK/notebooks/00_workbench_quickstart.ipynb" <<'PY'
import sys, nbformat
nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Workbench quickstart")])
nbformat.write(nb, sys.argv[1])
PY
  export WORKBENCH_NOTEBOOKS_DIR="$WORK/notebooks"
fi
export JUPYTERLAB_GALATA_ROOT_DIR="$WORK/root"
mkdir -p "$JUPYTERLAB_GALATA_ROOT_DIR"
export MWB_UI_ARTIFACTS="$ARTIFACTS" MWB_UI_RESULTS="$WORK/test-results"

step "Galata UI test in headless chromium"
cd tests/lab/ui
PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --loglevel=error
npx playwright test
ls -l "$ARTIFACTS"/lab-*.png
step "done"
