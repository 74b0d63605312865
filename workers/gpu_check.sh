#!/usr/bin/env bash
# GPU check of the hot/cold expert bank (issue 4, B8): runs the bank tests on the GPU, then
# prints hot and cold expert throughput next to the device-to-device and host-to-device copy
# bandwidth it measures itself. One run, under 5 minutes. On a machine without CUDA it says so
# and exits 0. The checks themselves are workers/gpu_check.py.
#   workers/gpu_check.sh [--skip-tests] [--json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
# kvq from this checkout, also when $PY has it not installed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 290 "$PY" workers/gpu_check.py "$@"
