"""Llama-3.1-8B on small memory: the planner's figures against the goals (QLoRA b2 x 2048 <= 5.5
GiB, full fine-tuning b2 x 2048 <= 18 GiB, QLoRA context >= 128K tokens in 24 GB) and the peers'
published numbers, each next to the step compiled on abstract shapes on this machine.

Plans are made from config values only (no weights), with the attention the step calls:
blockwise (`featherweight/models/attention.py`, no S x S scores on any backend; a training step's
rows carry segment ids, so cuDNN's kernel does not apply). The bf16 plans use the XLA:CPU float32
buffer counts (the only calibration so far): they are plans, not GPU measurements. XLA CPU makes
float32 copies of bf16 operands, so each configuration is also planned in float32, and that plan is
compared with `compiled.memory_analysis()` of the real float32 step compiled on abstract shapes.
XLA CPU has one memory, so that comparison is of device + host bytes (plan) against temp +
argument + output - alias (measured); the placement itself is tested in
tests/step/test_memory_settings.py.

Maximum context: the largest sequence (batch 1, a multiple of 1024) whose plan fits the memory,
searched on the planner alone; the model's context limit (131072) is lifted for the search, since
memory does not depend on it.

    python benchmarks/small_memory_8b.py [--out benchmarks/results/small_memory_8b_cpu.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import platform

import jax
from results_file import emit

from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

GIB = 2**30
SMALL = {
    "residuals": "host",
    "loss_chunk": 512,
    "vocab_chunk": 16384,
    "mlp_chunk": 512,
}
CASES = {
    "QLoRA, defaults (everything on device)": ("qlora", {}, {}),
    "QLoRA, small-memory settings, embedding on host": (
        "qlora",
        {**SMALL, "embed": "host"},
        {},
    ),
    "QLoRA, small-memory settings, embedding on host, NF4 head": (
        "qlora",
        {**SMALL, "embed": "host"},
        {"model": {"quantize_head": True}},
    ),
    "full FT, AdamW, defaults": ("full", {}, {}),
    "full FT, AdamW, state on host + small-memory settings": (
        "full",
        {**SMALL, "optimizer_state": "host"},
        {},
    ),
    "full FT, 8-bit AdamW, state on host + small-memory settings": (
        "full",
        {**SMALL, "optimizer_state": "host"},
        {"optimizer": {"name": "adamw_8bit"}},
    ),
}
GOALS = {"QLoRA": "<= 5.5 GiB (torchtune: 7.4 GiB)", "full": "<= 18 GiB (torchtune: 18.9 GiB)"}


def config_for(method, memory, extra, batch=2, seq=2048, attention="blockwise", dtype="bfloat16"):
    settings = {
        "method": method,
        "batch_size": batch,
        "model": {"dtype": dtype},
        "data": {"seq_len": seq},
        "lora": {"rank": 8},
        "memory": {**memory, "attention": attention},
    }
    for section, values in extra.items():
        settings[section] = {**settings.get(section, {}), **values}
    return parse_config(settings)


def max_context(model, memory, extra, budget_bytes):
    """Largest multiple of 1024 tokens (batch 1) whose plan fits `budget_bytes`."""
    low, high = 0, 1024 * 1024
    while high - low > 1024:
        middle = (low + high) // 2 // 1024 * 1024
        plan = plan_for_config(config_for("qlora", memory, extra, 1, middle), model)
        low, high = (middle, high) if plan.device_bytes <= budget_bytes else (low, middle)
    return low


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-measure", action="store_true", help="plans only")
    args = parser.parse_args()
    model = builtin_config("Llama-3.1-8B")
    lines = [
        "# Llama-3.1-8B on small memory: plan against goals and peers",
        "",
        f"machine: {platform.machine()} CPU, {jax.device_count()} JAX device(s), no GPU; "
        f"jax {jax.__version__}; bf16 weights, LoRA rank 8 on all 7 targets, batch 2 x 2048",
        "",
        "| configuration | bf16 plan (blockwise) | host memory | goal | float32 plan, device + "
        "host | compiled, XLA:CPU float32 | diff |",
        "| --- | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for name, (method, memory, extra) in CASES.items():
        planned = plan_for_config(config_for(method, memory, extra), model)
        check_config = config_for(method, memory, extra, dtype="float32")
        check_plan = plan_for_config(check_config, model)
        measured, diff = "-", ""
        if not args.no_measure:
            total = measure_compiled(check_config, model).total_bytes
            measured = format_bytes(total)
            diff = f"{(check_plan.cpu_comparable_bytes - total) / total * 100:+.1f}%"
        goal = GOALS["QLoRA" if method == "qlora" else "full"]
        lines.append(
            f"| {name} | **{format_bytes(planned.device_bytes)}** | {format_bytes(planned.host_bytes)} "
            f"| {goal} | {format_bytes(check_plan.cpu_comparable_bytes)} | {measured} | {diff} |"
        )
    unlimited = dataclasses.replace(model, max_position_embeddings=1 << 24, rope_scaling=None)
    memory, extra = {**SMALL, "embed": "host"}, {"model": {"quantize_head": True}}
    lines += [
        "",
        "## QLoRA maximum context (batch 1, blockwise attention, small-memory settings, embedding "
        "on host, NF4 head; bf16 plan)",
        "",
        "| device memory | featherweight | Unsloth (published) |",
        "| --- | ---: | ---: |",
    ]
    for budget, peer in ((24 * 10**9, "78,475"), (80 * 10**9, "342,733")):
        tokens = max_context(unlimited, memory, extra, budget)
        lines.append(f"| {budget // 10**9} GB | {tokens:,} tokens | {peer} tokens |")
    lines += [
        "",
        "Host memory at the maximum context holds the residual stream (L x S x D x 2 bytes: "
        "8 GiB per 32K tokens) and the embedding table.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
