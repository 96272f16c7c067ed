#!/usr/bin/env bash
# Installs everything the test suite uses into ./.venv, then runs ruff and the whole suite:
# the Python tests, the lab extension's build + server tests + headless-Chromium UI test.
# This is the README's test command; .ci/run calls it on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VENV_PY="$PWD/.venv/bin/python"
"$VENV_PY" -m pip install -q --upgrade pip
# torch pinned to the local CPU build: a range would pull a multi-GB CUDA wheel.
"$VENV_PY" -m pip install -q torch==2.13.0
"$VENV_PY" -m pip install -q -e '.[lab,test,trackers]'
export PATH="$PWD/.venv/bin:$PATH"
# Lint and format first (seconds): a finding fails CI. Settings: pyproject.toml [tool.ruff]; same hooks in
# .pre-commit-config.yaml. Fix locally with `ruff format` and `ruff check --fix` over these paths.
LINT_PATHS=(workbench tests benchmarks extensions/*/moe_workbench_lab)
ruff check "${LINT_PATHS[@]}"
ruff format --check "${LINT_PATHS[@]}"
# The lab extension: Debian chromium, npm build, extension lists, server tests, Galata UI test.
PYTHON="$VENV_PY" bash extensions/ci.sh
"$VENV_PY" -m pytest -q -ra --ignore=tests/lab "$@"
