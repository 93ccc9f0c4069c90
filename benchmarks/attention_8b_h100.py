"""Llama-3.1-8B QLoRA on an H100, by attention implementation: the plan beside the step compiled
for the H100 by XLA's GPU compiler on a machine without a GPU.

Each row is `featherweight plan Llama-3.1-8B --method qlora --dtype bfloat16 --target h100
--attention A --json` at b1 x 16384 and b2 x 2048 (the defaults' chunks; one process per row):
the plan's device bytes and the compiled step's (`memory_analysis`). cuDNN cannot be compiled
where its library is absent (`jax[cuda12-local]` alone): its rows then record the refusal. Not
run on a GPU: no time is measured here (`benchmarks/gpu_check_attention.py` measures on one).

    python benchmarks/attention_8b_h100.py [--out benchmarks/results/attention_8b_h100.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import jax
from results_file import emit

from featherweight.memory.report import format_bytes, percent_difference

SHAPES = ((1, 16384), (2, 2048))
ATTENTION = ("blockwise", "pallas", "cudnn")


def _plan(attention: str, batch: int, seq: int) -> dict:
    """The plan command's JSON for one row, or {"error": its last line}."""
    command = [sys.executable, "-m", "featherweight.cli", "plan", "Llama-3.1-8B"]
    command += ["--method", "qlora", "--dtype", "bfloat16", "--batch", str(batch)]
    command += ["--seq", str(seq), "--attention", attention, "--target", "h100", "--json"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    if done.returncode:
        lines = (done.stdout + done.stderr).strip().splitlines()
        return {"error": next((line for line in lines if line.startswith("Error")), lines[-1])}
    return json.loads(done.stdout)


def _row(attention: str, batch: int, seq: int) -> str:
    report = _plan(attention, batch, seq)
    if "error" in report:
        return f"| b{batch} x {seq} | {attention} | {report['error']} | | |"
    planned, compiled = report["planned_device_bytes"], report["measured_device_bytes"]
    return (
        f"| b{batch} x {seq} | {report['settings']['attention']} | {format_bytes(planned)} | "
        f"{format_bytes(compiled)} | {percent_difference(planned, compiled):+.1f}% |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="also write the table here")
    args = parser.parse_args()
    lines = [
        "# Llama-3.1-8B QLoRA on an H100, by attention (compiled, not run on a GPU)",
        "",
        f"`python benchmarks/attention_8b_h100.py`, jax {jax.__version__}: each step compiled by "
        "XLA's GPU compiler for an H100 on a machine without a GPU (deviceless; device bytes "
        "from `memory_analysis`, no autotuning, cuBLAS/cuDNN workspaces not counted), bf16, "
        "the defaults' chunks, abstract shapes (no weights).",
        "",
        "| shape | attention | planned device | compiled device | plan vs compiled |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    lines += [_row(a, batch, seq) for batch, seq in SHAPES for a in ATTENTION]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
