"""The held-out grid on XLA's GPU compiler: planned device bytes vs the step compiled for a GPU.

The grid is the calibration's held-out grid (`featherweight.dev.calibrate.gpu_grid` with the
held-out seed: real models 1B-8B, LoRA/QLoRA/full, AdamW and 8-bit AdamW, b1-4, S 512-4096, with
and without each memory setting; and batch 1 at 32K-131K tokens, `calibrate.gpu_long_context`),
never used by the fit. Each configuration is compiled for the
target without a GPU (`measure_for_target`), and planned with that compiler's calibration (what
`--target` picks). Compiles take minutes on a small machine: `--progress` keeps them (JSON lines)
and a re-run only plans again.

    python benchmarks/gpu_held_out.py [--target h100] [--size 10] [--progress FILE]
        [--out benchmarks/results/gpu_held_out_h100.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
from results_file import emit

from featherweight.dev import calibrate
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes, percent_difference
from featherweight.memory.targets import get_target
from featherweight.recipe.placement import arguments_on_host

CALIBRATIONS = json.loads(calibrate.calibration_path().read_text())["calibrations"]


def _settings(config) -> str:
    memory = config.memory
    parts = [
        f"{config.method}",
        config.optimizer.name,
        f"b{config.batch_size}x{config.data.seq_len}",
    ]
    for name in ("residuals", "optimizer_state", "embed"):
        if getattr(memory, name) == "host":
            parts.append(f"{name}:host")
    for name in ("loss_chunk", "vocab_chunk", "mlp_chunk"):
        if getattr(memory, name):
            parts.append(f"{name}={getattr(memory, name)}")
    if memory.save:
        parts.append("save=" + "+".join(memory.save))
    if config.model.quantize_head:
        parts.append("NF4 head")
    return " ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="h100")
    parser.add_argument("--size", type=int, default=10)
    parser.add_argument("--progress", type=Path, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = get_target(args.target)
    cases = calibrate.gpu_grid(calibrate.HELD_OUT_SEED, args.size, "bfloat16")
    cases += calibrate.gpu_long_context("bfloat16", held_out=True)
    progress = args.progress or calibrate.calibration_path().with_name(
        "calibration-xla-gpu-bfloat16.jsonl"
    )  # the calibration's own measurements: nothing compiled twice
    records = calibrate.measure(cases, 0, target.name, progress)
    lines = [
        f"# Held-out grid: planned vs compiled for the {target.short_name} (jax {jax.__version__})",
        "",
        f"Compiled: XLA's GPU compiler for the {target.description} without a GPU (deviceless, "
        f"jax[cuda12-local] {jax.__version__}), on a shared 2-core CPU machine. Planned: "
        "`featherweight plan --target` (calibration xla-gpu/bfloat16, fitted on another grid). "
        "Device bytes: host-resident arrays and temporaries left out; host placements compiled "
        "as they run (the compiler's host-offload pass places them). Not run on a GPU.",
        "",
        "| model | settings | planned device | compiled device | error | how |",
        "| --- | --- | ---: | ---: | ---: | --- |",
    ]
    errors = []
    for (model, config), record in zip(cases, records):
        plan = plan_for_config(config, model, calibrate.compiler_target(f"xla-{target.platform}"))
        error = percent_difference(plan.device_bytes, record["device_bytes"])
        errors.append(error)
        as_run = bool(arguments_on_host(config))
        lines.append(
            f"| {model.num_layers} layers, D {model.hidden_size} | {_settings(config)} | "
            f"{format_bytes(plan.device_bytes)} | {format_bytes(record['device_bytes'])} | "
            f"{error:+.1f}% | {'compiled as run' if as_run else 'compiled'} |"
        )
    worst = max(errors, key=abs)
    cpu = CALIBRATIONS["xla-cpu/float32"]["held_out_worst_total_error_percent"]
    lines += [
        "",
        f"Worst held-out error on XLA:GPU ({target.name}, bfloat16): {worst:+.1f}% over "
        f"{len(errors)} configurations; XLA:CPU float32 held-out worst (calibration.json): "
        f"{cpu:.1f}%.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
