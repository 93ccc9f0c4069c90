#!/usr/bin/env bash
# Issue 32, item 3 on a GPU machine without network, within 9 minutes in all: the profile of the
# 8B QLoRA step (benchmarks/gpu_profile.py), then the XLA flag sets (benchmarks/gpu_flags.py).
#
# Carry the wheels as for benchmarks/gpu_check.sh (.whl/ and .whl-extra/, from
# benchmarks/gpu_fetch_wheels.sh), then run there, from anywhere:
#     OUT=/path/for/results benchmarks/gpu_profile.sh [--settings fastest] [--case NAME]
# (the options go to the profile). It installs the carried wheels into a temporary site (none:
# the installed packages are used), profiles within PROFILE_SECONDS (200) and gives the flag sets
# what is left of GPU_PROFILE_SECONDS (540), and leaves under $OUT: profile.md and flags.md to
# read, results.tar.gz (both scripts' JSON, logs and tables) and trace.tar.gz (the .xplane.pb and
# the compiled step's HLO, for `gpu_profile.py --analyze` here). Two archives, not one: a file
# over the 16 MiB that comes back is lost, and the trace may be. FLAGS_ARGS adds options to
# gpu_flags.py (e.g. "--sets baseline,latency-hiding --rounds 3"). PYTHON picks the interpreter
# (default python3, the image's). Not run on a GPU yet.
set -uo pipefail
started=$SECONDS
out=$(realpath -m "${OUT:-/tmp/gpu_profile}")  # before the cd: a relative OUT is the caller's
cd "$(dirname "$0")/.."
total=${GPU_PROFILE_SECONDS:-540}
python=${PYTHON:-python3}
work=$(mktemp -d)
mkdir -p "$out" "$work/profile" "$work/flags"
# shellcheck source=benchmarks/gpu_wheels.sh
source benchmarks/gpu_wheels.sh
gpu_wheels gpu_profile.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
timeout -k 10 "${PROFILE_SECONDS:-200}" "$python" benchmarks/gpu_profile.py \
  --out "$work/profile" "$@" 2>&1 | tee "$work/profile/profile.log"
echo "[gpu_profile.sh] profile exit ${PIPESTATUS[0]} after $((SECONDS - started)) s"
left=$((total - (SECONDS - started) - 30))  # 30 s to pack up
# gpu_flags stops starting processes at its deadline; timeout is the backstop
# shellcheck disable=SC2086
timeout -k 10 "$left" "$python" benchmarks/gpu_flags.py --out "$work/flags" \
  --deadline $((left - 15)) ${FLAGS_ARGS:-} 2>&1 | tee "$work/flags/run.log"
echo "[gpu_profile.sh] flags exit ${PIPESTATUS[0]} after $((SECONDS - started)) s"
cp "$work/profile/profile.md" "$work/flags/flags.md" "$out"/ 2>/dev/null
tar -czf "$out/results.tar.gz" -C "$work" --exclude=profile/trace --exclude=profile/step_hlo.txt \
  profile flags
tar -czf "$out/trace.tar.gz" -C "$work" profile/trace profile/step_hlo.txt profile/run.json
ls -la "$out"
