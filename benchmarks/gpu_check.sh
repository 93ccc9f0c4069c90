#!/usr/bin/env bash
# The GPU check (benchmarks/gpu_check.py) on a GPU machine without network, within 9 minutes in all.
#
# Before, on a machine with network: benchmarks/gpu_fetch_wheels.sh (writes .whl/ and .whl-extra/
# at the project root: what the GPU image lacks; git ignores both, so name them among what travels
# with the working tree). Carry both, then run there, from anywhere:
#     OUT=/path/for/results benchmarks/gpu_check.sh [gpu_check.py options, e.g. --cases qlora,lora]
# It installs the carried wheels into a temporary site (skipped when there are none: the installed
# packages are used), runs the check with the time left of GPU_CHECK_SECONDS (540) as its
# deadline, and leaves results.jsonl, one log per case and the table under $OUT (default
# /tmp/gpu_check). PYTHON picks the interpreter (default python3, the image's);
# GPU_CHECK_WHEELS the wheel folder (default .whl).
set -euo pipefail
started=$SECONDS
out=$(realpath -m "${OUT:-/tmp/gpu_check}")  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/.."
total=${GPU_CHECK_SECONDS:-540}
python=${PYTHON:-python3}
mkdir -p "$out"
# shellcheck source=benchmarks/gpu_wheels.sh
source benchmarks/gpu_wheels.sh
gpu_wheels gpu_check.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the check sets it for each case; never the 75% grab
left=$((total - (SECONDS - started)))
# the check stops starting cases at its deadline and writes the table; timeout is the backstop
exec timeout -k 10 "$left" "$python" benchmarks/gpu_check.py --out "$out" \
  --deadline $((left - 20)) "$@"
