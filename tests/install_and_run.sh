#!/usr/bin/env bash
# Installs everything the test suite uses into ./.venv, then runs the whole suite.
# This is the README's test command; .ci/run calls it on a clean clone.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch pinned to the local CPU build: a range would pull a multi-GB CUDA wheel.
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[lab,test]'
if [ -f extensions/ci.sh ]; then
  bash extensions/ci.sh install
fi
python -m pytest -q -ra "$@"
if [ -f extensions/ci.sh ]; then
  bash extensions/ci.sh ui-test
fi
