"""Llama-3.1-8B QLoRA b2 x 2048: the plan (config values only) next to the compiled step.

The plan is made from the built-in config (no weights); the measurement compiles the real step on
abstract shapes (`jax.ShapeDtypeStruct`) and reads `compiled.memory_analysis()`. bfloat16 is the
configuration for a GPU; on XLA CPU its measurement is inflated by float32 copies of bf16 operands,
so the same step in float32 is recorded too, where CPU and plan describe the same buffers.

    python benchmarks/plan_8b.py [--out benchmarks/results/plan_8b_cpu.md]
"""

from __future__ import annotations

import argparse
import time

import jax
from results_file import emit

from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import comparison_notes, format_bytes, percent_difference
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

MACHINE = "2-core CPU, no GPU"


def _config(dtype: str):
    return parse_config(
        {"method": "qlora", "batch_size": 2, "model": {"dtype": dtype}, "data": {"seq_len": 2048}}
    )


def _diff(planned: int, measured: int) -> str:
    return f"{percent_difference(planned, measured):+.1f}%"


def _section(dtype: str) -> list[str]:
    model = builtin_config("Llama-3.1-8B")
    config = _config(dtype)
    start = time.perf_counter()
    plan = plan_for_config(config, model)
    plan_seconds = time.perf_counter() - start
    measured = measure_compiled(config, model)
    groups = plan.measured_groups()
    lines = [
        f"## {dtype}",
        "",
        f"plan: {plan_seconds * 1000:.1f} ms; compile on abstract shapes: "
        f"{measured.compile_seconds:.0f} s",
        "",
        "| component | planned | measured (XLA CPU) | diff |",
        "| --- | ---: | ---: | ---: |",
    ]
    for component in plan.components:
        name = component.name
        if name in measured.components:
            actual = measured.components[name]
            lines.append(
                f"| {name} | {format_bytes(component.bytes)} | {format_bytes(actual)} | "
                f"{_diff(component.bytes, actual)} |"
            )
        elif name == "step_outputs":
            actual = measured.components["unaliased_outputs"]
            lines.append(f"| {name} | {component.bytes} B | {actual} B | |")
        else:
            lines.append(f"| &nbsp;&nbsp;{name} | {format_bytes(component.bytes)} | | |")
    temp = measured.components["temporaries"]
    lines += [
        f"| **temporaries** (indented rows) | {format_bytes(groups['temporaries'])} | "
        f"{format_bytes(temp)} | {_diff(groups['temporaries'], temp)} |",
        f"| **total** | {format_bytes(plan.device_bytes)} | "
        f"{format_bytes(measured.total_bytes)} | {_diff(plan.device_bytes, measured.total_bytes)} |",
        f"| lower bound | {format_bytes(plan.lower_bound_bytes)} | | |",
        "",
        *(f"- {note}" for note in comparison_notes(plan, measured)),
        "",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [
        "# Memory plan vs compiled step: Llama-3.1-8B QLoRA, batch 2 x 2048",
        "",
        f"machine: {MACHINE}; jax {jax.__version__}; rank-8 LoRA on all 7 linear targets, "
        "AdamW, residuals on device, whole-sequence loss (no chunk)",
        "",
        "measured = temp + argument + output - alias of `compiled.memory_analysis()`; "
        "parameters and optimizer state are donated (aliased).",
        "",
        *_section("bfloat16"),
        *_section("float32"),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
