#!/usr/bin/env bash
# Fetches what the GPU machine's image lacks, for carrying there: that machine has no network.
# The image (Python 3.12) holds jax 0.11.x with the CUDA 13 plugin, torch 2.11 cu130, transformers,
# peft, optax, orbax, typer, rich, pyyaml, safetensors, tokenizers, matplotlib, jinja2, pandas,
# pyarrow, hypothesis and pytest; this adds pydantic, gguf, datasets and tensorboardX, and
# bitsandbytes for the torch QLoRA peer (trimmed to its CUDA 13 and CPU libraries): about 8 MB.
#
# Run it on a machine with network, from anywhere:   benchmarks/gpu_fetch_wheels.sh
# It writes the wheels to .whl/ and the trimmed bitsandbytes to .whl-extra/site/ at the project
# root (both ignored by git; GPU_CHECK_WHEELS names another folder than .whl, with -extra beside
# it). Carry both with the working tree to the GPU machine; benchmarks/gpu_check.sh and
# benchmarks/gpu_profile.sh install them there (benchmarks/gpu_wheels.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
wheels=${GPU_CHECK_WHEELS:-.whl}
extra=$wheels-extra/site
platforms="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp $platforms "$@"
}
mkdir -p "$wheels" "$extra"
# pydantic and pydantic-core pinned as a pair (pydantic requires exactly one core version)
download -d "$wheels" pydantic==2.12.5 pydantic-core==2.41.5 annotated-types typing-inspection \
  gguf datasets tensorboardX dill multiprocess
# bitsandbytes is 43 MB as a wheel: unpacked, with only the CUDA 13.0 and CPU libraries kept
tmp=$(mktemp -d)
download -d "$tmp" bitsandbytes
(cd "$extra" && unzip -q -o "$tmp"/bitsandbytes-*.whl && cd bitsandbytes \
  && find . -maxdepth 1 -name '*.so' ! -name '*cuda130*' ! -name '*cpu*' -delete)
rm -rf "$tmp"
du -sh "$wheels" "$wheels-extra"
