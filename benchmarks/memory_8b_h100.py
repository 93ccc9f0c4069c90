"""Llama-3.1-8B on an H100: the plan next to the step compiled by XLA's GPU compiler for an H100
(deviceless, on any machine; `featherweight.memory.measure.measure_for_target`).

Rows: QLoRA b2 x 2048 at the smallest settings the budget search finds (the batch kept at 2), LoRA
b2 x 2048, full fine-tuning with 8-bit AdamW b2 x 2048. Each row says whether the compiled device
bytes are the compiler's own ("compiled") or have host bytes subtracted by featherweight
("derived": a host-resident argument compiled as a device array, its exact bytes subtracted).
The plan uses the xla-gpu/bfloat16 calibration (what `--target h100` picks).

    python benchmarks/memory_8b_h100.py [--out benchmarks/results/memory_8b_h100.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
from results_file import emit

from featherweight.memory import budget
from featherweight.memory.measure import measure_for_target
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes, percent_difference
from featherweight.memory.working_set import calibration_for
from featherweight.models.registry import builtin_config
from featherweight.recipe.schema import parse_config

TARGET = "h100"


def _config(method: str, optimizer: str = "adamw"):
    return parse_config(
        {
            "method": method,
            "batch_size": 2,
            "model": {"dtype": "bfloat16"},
            "data": {"seq_len": 2048},
            "optimizer": {"name": optimizer},
        }
    )


def cases(model) -> list[tuple[str, object]]:
    """(label, config): the README's rows."""
    with calibration_for("xla-gpu"):
        smallest, _ = budget._search(_config("qlora"), model, 0)  # every change that helps
    # the row is b2 x 2048: the micro-batch the search halves last is set back
    smallest = smallest.model_copy(update={"batch_size": 2})
    return [
        ("QLoRA b2x2048, smallest settings (" + ", ".join(
            budget.describe_changes(_config("qlora"), smallest)) + ")", smallest),
        ("LoRA b2x2048", _config("lora")),
        ("full, 8-bit AdamW, b2x2048", _config("full", "adamw_8bit")),
    ]  # fmt: skip


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
        "resident arrays and temporaries left out.",
        "",
        "| configuration | planned device | H100 compiled device | error | host (planned) | how |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    for label, config in cases(model):
        with calibration_for("xla-gpu"):
            plan = plan_for_config(config, model)
        if label not in done:
            measured = measure_for_target(config, model, TARGET)
            done[label] = {"label": label, "device_bytes": measured.device_bytes,
                           "derived": list(measured.derived)}  # fmt: skip
            if args.compiled:
                with open(args.compiled, "a") as file:
                    file.write(json.dumps(done[label], separators=(",", ":")) + "\n")
        row = done[label]
        how = "derived (" + "; ".join(row["derived"]) + ")" if row["derived"] else "compiled"
        error = percent_difference(plan.device_bytes, row["device_bytes"])
        lines.append(
            f"| {label} | {format_bytes(plan.device_bytes)} | "
            f"{format_bytes(row['device_bytes'])} | {error:+.1f}% | "
            f"{format_bytes(plan.host_bytes)} | {how} |"
        )
        print(json.dumps(row), file=sys.stderr)
    lines += ["", f"calibration: {plan.settings['calibration']}"]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
