#!/usr/bin/env bash
# Every GPU check row set in one command, most important first, within one limit: for a lease of
# GPU time too short for each set whole (15 minutes, the machine's start included).
#
#     OUT=/path/for/results benchmarks/gpu_check_all.sh [--tiny]
#
# The order: the speed rows of Llama-3.1-8B QLoRA (featherweight at defaults, the torch + peft +
# bitsandbytes peer, featherweight at its fastest within the device); cuDNN's step against
# blockwise's (Qwen3 packed; Gemma 3, head dim 256, its window taken away) and GRPO's two phases
# at the 8B goal (gpu_check_families.py); the Qwen3-30B-A3B speed row; the other family rows; the QLoRA case at the settings fit_budget picks for 5.5 GiB
# (gpu_check.py). Each phase gets a share of the time left (GPU_CHECK_SECONDS, default 540, from
# the start of this script) and its row set stops starting jobs at its deadline, so a slow job
# costs the phases after it, never the results before it. Results: one folder per phase under
# $OUT (default /tmp/gpu_check_all), its JSON lines, logs and table, and all of it as
# $OUT/gpu_check_all.tgz (the device tool brings back few files). Wheels as gpu_check.sh takes
# them (benchmarks/gpu_fetch_wheels.sh). --tiny: the same phases on CPU at tiny shapes (a
# rehearsal of this script; no measure of a GPU).
set -uo pipefail
started=$SECONDS
out=$(realpath -m "${OUT:-/tmp/gpu_check_all}")
cd "$(dirname "$0")/.."
total=${GPU_CHECK_SECONDS:-540}
python=${PYTHON:-python3}
tiny=()
large=8b-qlora-b2x2048 moe=30b-a3b-qlora-b1x2048
if [ "${1:-}" = --tiny ]; then
  tiny=(--tiny) large=tiny-large-qlora-b2x64 moe=tiny-moe-qlora-b1x64
fi
work=$(mktemp -d)
# shellcheck source=benchmarks/gpu_wheels.sh
source benchmarks/gpu_wheels.sh
gpu_wheels gpu_check_all.sh
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
left() { echo $((total - (SECONDS - started))); }

# phase FOLDER SECONDS-AT-MOST SECONDS-KEPT-FOR-LATER SCRIPT ARGS...: the row set with the
# deadline min(at most, time left - kept), skipped when under 30 s.
phase() {
  local folder=$1 most=$2 kept=$3 script=$4
  shift 4
  local deadline=$(($(left) - kept))
  [ "$deadline" -gt "$most" ] && deadline=$most
  if [ "$deadline" -lt 30 ]; then
    echo "[gpu_check_all] $folder: not run ($deadline s left to it)"
    return
  fi
  echo "[gpu_check_all] $folder: $deadline s (at $((SECONDS - started)) s)"
  timeout -k 5 $((deadline + 15)) "$python" "benchmarks/$script" --out "$work/$folder" \
    --table-dir "$work/$folder" --deadline "$deadline" "${tiny[@]}" "$@"
}

phase 1-speed-8b-qlora 210 240 gpu_check_speed.py \
  --jobs "fw-$large,torch-$large,fw-$large-fastest"
phase 2-families-cudnn-grpo 200 120 gpu_check_families.py \
  --jobs qwen3-0.6b-lora-packed,gemma3-1b-qlora-padded-no-window,grpo-8b-qlora
phase 3-speed-moe 110 90 gpu_check_speed.py --jobs "fw-$moe"
phase 4-families-more 150 45 gpu_check_families.py \
  --jobs qwen3-0.6b-lora-padded,gemma3-1b-qlora-padded,gpt-oss-20b-qlora-padded,phi3.5-mini-qlora-padded
phase 5-qlora-budget 60 0 gpu_check.py --cases qlora-budget
mkdir -p "$out"
tar czf "$out/gpu_check_all.tgz" -C "$work" .
echo "[gpu_check_all] done at $((SECONDS - started)) s: $out/gpu_check_all.tgz"
