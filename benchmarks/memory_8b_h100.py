"""Llama-3.1-8B on an H100: the plan next to the step compiled by XLA's GPU compiler for an H100
(deviceless, on any machine; `featherweight.memory.measure.measure_for_target`).

Rows: QLoRA b2 x 2048 at the settings `--budget 5.5GiB` finds and at the smallest settings the
budget search finds (the batch kept at 2), LoRA b2 x 2048, full fine-tuning with 8-bit AdamW
b2 x 2048; then the QLoRA maximum context at batch 1 in 24 GB and 80 GB of device memory: the
largest multiple of 1024 tokens whose plan fits, at the smallest settings (the model's 131,072
positions lifted for the search; beyond them it needs rope scaling), compiled at that length and,
if the compiled step exceeds the budget, at shorter lengths until one fits. Each row says how it
was compiled: "compiled" (everything on the device), "compiled as run" (host-resident arguments
in host memory: the compiler's host-offload pass placed them and counted their bytes), or "not
compiled as run" (a jax that cannot compile host arguments for a GPU target: compiled as device
arrays, their exact bytes subtracted). No row ran on a GPU.
The plan uses the xla-gpu/bfloat16 calibration (what `--target h100` picks).

    python benchmarks/memory_8b_h100.py [--out benchmarks/results/memory_8b_h100.md]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import jax
from results_file import emit

from featherweight.memory import budget
from featherweight.memory.measure import measure_for_target
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes, percent_difference
from featherweight.memory.targets import get_target
from featherweight.models.config import ModelConfig
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

TARGET = "h100"
H100 = get_target(TARGET).step_target  # what the plans are for: its attention and calibration
CONTEXT_BUDGETS = ((24 * 10**9, "78,475"), (80 * 10**9, "342,733"))  # Unsloth, published


def _config(method: str, optimizer: str = "adamw"):
    return parse_config(
        {
            "method": method,
            "batch_size": 2,
            "model": {"dtype": "bfloat16"},
            "data": {"seq_len": 2048},
            "optimizer": {"name": optimizer},
            # blockwise, as compiled here: an H100 runs cuDNN for "auto", which a machine
            # without cuDNN's library cannot compile (`measure.cudnn_not_loadable`)
            "memory": {"attention": "blockwise"},
        }
    )


def cases(model) -> list[tuple[str, object]]:
    """(label, config): the rows of docs/long-context.md."""
    # every change that helps, the batch kept at 2
    smallest, _ = budget.smallest_settings(_config("qlora"), model, target=H100)
    in_budget, _ = budget.fit_budget(
        _config("qlora"), model, budget.parse_budget("5.5GiB"), target=H100
    )
    return [
        ("QLoRA b2x2048, --budget 5.5GiB (" + ", ".join(
            budget.describe_changes(_config("qlora"), in_budget)) + ")", in_budget),
        ("QLoRA b2x2048, smallest settings (" + ", ".join(
            budget.describe_changes(_config("qlora"), smallest)) + ")", smallest),
        ("LoRA b2x2048", _config("lora")),
        ("full, 8-bit AdamW, b2x2048", _config("full", "adamw_8bit")),
        ("full, AdamW state on the host, small-memory settings, b2x2048", _config("full").model_copy(
            update={"memory": _config("full").memory.model_copy(update={
                "optimizer_state": "host", "residuals": "host", "loss_chunk": 512,
                "mlp_chunk": 512})})),
    ]  # fmt: skip


def max_context(config, model: ModelConfig, budget_bytes: int) -> int:
    """Largest multiple of 1024 tokens (batch 1, `config`'s settings) whose plan fits."""
    low, high = 0, 1024 * 1024
    while high - low > 1024:
        middle = (low + high) // 2 // 1024 * 1024
        candidate = _at_length(config, middle)
        fits = plan_for_config(candidate, model, H100).device_bytes <= budget_bytes
        low, high = (middle, high) if fits else (low, middle)
    return low


def _at_length(config, seq: int):
    """`config` at batch 1 (one micro-batch: the search's split of the batch of 2 undone) x seq."""
    memory = config.memory.model_copy(update={"accumulation_steps": 1})
    data = config.data.model_copy(update={"seq_len": seq})
    return config.model_copy(update={"batch_size": 1, "data": data, "memory": memory})


def context_rows(model: ModelConfig, compile_row) -> list[tuple[str, object, ModelConfig]]:
    """(label, config, model) rows of the longest context (batch 1, smallest settings) for each
    budget: the plan's maximum, then -- when the compiled step at that length exceeds the budget
    -- shorter lengths, scaled by the compiled per-token bytes, until one compiles within it."""
    unlimited = dataclasses.replace(model, max_position_embeddings=1 << 24)
    smallest = cases(model)[1][1]
    limit = model.max_position_embeddings
    fixed = plan_for_config(_at_length(smallest, 1024), unlimited, H100).device_bytes
    rows = []
    for budget_bytes, peer in CONTEXT_BUDGETS:
        seq, what = max_context(smallest, unlimited, budget_bytes), "the plan's maximum"
        for _ in range(4):
            where = "beyond" if seq > limit else "within"
            label = (
                f"QLoRA context in {budget_bytes // 10**9} GB, {what}: b1x{seq:,} tokens "
                f"(Unsloth: {peer}; {where} the model's {limit:,} positions)"
            )
            config = _at_length(smallest, seq)
            rows.append((label, config, unlimited))
            compiled = compile_row(label, config, unlimited)["device_bytes"]
            if compiled <= budget_bytes:
                break
            seq = int(seq * (budget_bytes - fixed) / (compiled - fixed)) // 1024 * 1024
            what = "shortened until the compiled step fits"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--compiled",
        default=None,
        help="JSON lines of earlier compiles of these rows (written here too): only the plan is "
        "made again, e.g. after a refit of the calibration",
    )
    args = parser.parse_args()
    done = {}
    if args.compiled and Path(args.compiled).is_file():
        done = {
            row["label"]: row
            for row in map(json.loads, Path(args.compiled).read_text().splitlines())
        }
    model = builtin_config("Llama-3.1-8B")
    lines = [
        f"# Llama-3.1-8B on an {TARGET.upper()}: planned vs compiled (jax {jax.__version__})",
        "",
        f"Compiled: XLA's GPU compiler for the {TARGET.upper()} (deviceless, jax[cuda12-local] "
        f"{jax.__version__}) on a shared 2-core CPU machine without a GPU. Device bytes: host-"
        "resident arrays and temporaries left out. Not run on a GPU.",
        "",
        "| configuration | planned device | H100 compiled device | error | host (planned) | "
        "host (compiled) | how |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]

    def compile_row(label, config, row_model):
        if label not in done:
            measured = measure_for_target(config, row_model, TARGET)
            done[label] = {"label": label, "device_bytes": measured.device_bytes,
                           "host_bytes": measured.total_bytes - measured.device_bytes,
                           "host_arguments": measured.host_argument_bytes,
                           "derived": list(measured.derived)}  # fmt: skip
            if args.compiled:
                with open(args.compiled, "a") as file:
                    file.write(json.dumps(done[label], separators=(",", ":")) + "\n")
        return done[label]

    rows = [(label, config, model) for label, config in cases(model)]
    rows += context_rows(model, compile_row)
    for label, config, row_model in rows:
        plan = plan_for_config(config, row_model, H100)
        compile_row(label, config, row_model)
        row = done[label]
        if row["derived"]:
            how = "not compiled as run (" + "; ".join(row["derived"]) + ")"
        else:
            how = "compiled as run" if row.get("host_arguments") else "compiled"
        error = percent_difference(plan.device_bytes, row["device_bytes"])
        host = row.get("host_bytes")
        lines.append(
            f"| {label} | {format_bytes(plan.device_bytes)} | "
            f"{format_bytes(row['device_bytes'])} | {error:+.1f}% | "
            f"{format_bytes(plan.host_bytes)} | {'' if host is None else format_bytes(host)} | "
            f"{how} |"
        )
        print(json.dumps(row), file=sys.stderr)
    lines += ["", f"calibration: {plan.settings['calibration']}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
