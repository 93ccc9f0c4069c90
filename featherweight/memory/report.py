"""Planned next to measured: a rich table, a JSON object for scripts, a stacked-bar chart.

The plan names more owners than a compiled step can tell apart: XLA reports one temp buffer. So
the table lists every planned component, and compares them with measurement where measurement
has the same owner -- the persistent components, `temporaries` (stored activations + the peak
phase's working set, summed) and the step's outputs -- and in total.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from featherweight.memory.components import HOST, PERSISTENT, MemoryPlan
from featherweight.memory.measure import MemoryMeasurement

GIB = 2**30
MIB = 2**20


def format_bytes(value: int | None) -> str:
    """GiB above 1 GiB, else MiB; "-" for no value."""
    if value is None:
        return "-"
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / MIB:.2f} MiB"


def percent_difference(planned: int, measured: int | None) -> float | None:
    """(planned - measured) / measured in percent; None without a measurement."""
    if measured is None or measured == 0:
        return None
    return 100.0 * (planned - measured) / measured


def comparable_total(plan: MemoryPlan, measurement: MemoryMeasurement | None) -> int:
    """The planned total to set against a measurement: device + host on CPU (one memory there),
    device bytes otherwise."""
    if measurement is not None and measurement.platform == "cpu":
        return plan.cpu_comparable_bytes
    return plan.train_device_bytes  # the step's (GRPO's rollout phase is planned apart)


def comparable_measured(measurement: MemoryMeasurement | None) -> int | None:
    """The measured total set against `comparable_total`: every byte on CPU (one memory), the
    device bytes (host-resident arrays and temporaries left out) on an accelerator."""
    if measurement is None:
        return None
    return measurement.total_bytes if measurement.platform == "cpu" else measurement.device_bytes


def comparison_notes(plan: MemoryPlan, measurement: MemoryMeasurement | None) -> list[str]:
    """What a reader must know to read planned against measured."""
    phases = ", ".join(f"{name} {format_bytes(value)}" for name, value in plan.phases.items())
    notes = [f"peak phase: {plan.peak_phase} (working set per phase: {phases})"]
    if plan.rollout:
        notes.append(
            f"GRPO: train step {format_bytes(plan.train_device_bytes)}, rollout phase "
            f"{format_bytes(plan.rollout_device_bytes)} on the device (planned); the peak is the "
            f"{'rollout phase' if plan.rollout_device_bytes > plan.train_device_bytes else 'train step'}"
            f", {format_bytes(plan.device_bytes)}"
        )
    notes += list(plan.warnings)
    if measurement is None:
        return notes
    if measurement.platform == "cpu" and plan.host_bytes:
        notes.append(
            "XLA CPU has one memory: host-placed residuals count in its temp, so the measured "
            "total is compared with planned device + host bytes"
        )
    if measurement.platform == "cpu" and plan.settings["dtype"] == "bfloat16":
        notes.append(
            "bfloat16 on XLA CPU: no native bf16 matmul or dynamic-slice, so weight stacks and "
            "matmul operands get float32 copies that inflate the measurement; the plan is for "
            "accelerators"
        )
    if measurement.target not in (None, "cpu"):
        notes.append(
            f"measured: the train step compiled by XLA's GPU compiler for the "
            f"{measurement.target} without one (deviceless; compiled.memory_analysis(), "
            f"{measurement.compile_seconds:.1f} s compile); no autotuning, cuBLAS/cuDNN "
            "workspaces not counted"
        )
        if not measurement.compiled:
            how = "(not compiled as run: see below)"
        elif measurement.host_argument_bytes:
            how = (
                f"(compiled as run: {format_bytes(measurement.host_argument_bytes)} of arguments "
                "in host memory, placed and checked by the compiler's host-offload pass)"
            )
        else:
            how = "(compiled)"
        notes.append(
            f"compiled device bytes: {format_bytes(measurement.device_bytes)} {how}; not run "
            "on a GPU"
        )
        notes += [f"not compiled as run: {text}" for text in measurement.derived]
        return notes
    notes.append(
        "diff: (planned - measured) / measured; + means the plan is above what the compiled "
        "step uses, - below it"
    )
    notes.append(
        f"measured: compiled.memory_analysis() on {measurement.platform} "
        f"({measurement.compile_seconds:.1f} s compile)"
    )
    return notes


def plan_table(
    plan: MemoryPlan, measurement: MemoryMeasurement | None = None, formulas: bool = True
) -> Table:
    """Rows: each planned component (with its measured bytes where they are measurable), the
    measured groups, the total, and the lower bound; with `formulas`, each row's formula in a
    last column (what `plan` shows; a training log leaves it out to stay within 100 columns,
    `train --verbose` puts it back)."""
    measured = measurement.components if measurement else {}
    groups = plan.measured_groups()
    table = Table(
        title="memory plan" + (" vs measured" if measurement else ""), title_justify="left"
    )
    for column, justify in (("component", "left"), ("where", "left"), ("planned", "right")):
        table.add_column(column, justify=justify)
    if measurement:
        table.add_column("measured", justify="right")
        table.add_column("diff", justify="right")
    if formulas:
        table.add_column("formula", style="dim")

    def row(name: str, where: str, planned: int, actual: int | None, formula: str) -> None:
        cells = [name, where, format_bytes(planned)]
        if measurement:
            diff = percent_difference(planned, actual)
            cells += [format_bytes(actual), "-" if diff is None else f"{diff:+.1f}%"]
        table.add_row(*cells, *([formula] if formulas else []))

    for component in plan.components:
        if component.name in PERSISTENT or component.name == "step_outputs":
            key = "unaliased_outputs" if component.name == "step_outputs" else component.name
            row(
                component.name,
                component.placement,
                component.bytes,
                measured.get(key),
                component.formula,
            )
        else:
            row(
                f"  {component.name}", component.placement, component.bytes, None, component.formula
            )
    if measurement:
        row(
            "temporaries (sum of the indented)",
            "temp",
            groups["temporaries"],
            measured.get("temporaries"),
            "XLA's temp buffer",
        )
    table.add_section()
    row(
        "train step total" if plan.rollout else "total",
        "device"
        + (" + host" if measurement and measurement.platform == "cpu" and plan.host_bytes else ""),
        comparable_total(plan, measurement),
        comparable_measured(measurement),
        "temp + argument + output - alias"
        + (
            ""
            if comparable_measured(measurement) == getattr(measurement, "total_bytes", None)
            else ", host-resident bytes left out"
        ),
    )
    if plan.rollout:
        _rollout_rows(table, plan, bool(measurement), formulas)
    if plan.host_bytes:
        blank = ["", ""] if measurement else []
        _add_row(table, ["host (offloaded)", HOST, format_bytes(plan.host_bytes), *blank], "",
                 formulas)  # fmt: skip
    blank = ["", ""] if measurement else []
    lower = ["lower bound", "device", format_bytes(plan.lower_bound_bytes), *blank]
    _add_row(table, lower, "every tensor once (plan.py)", formulas)
    return table


def _add_row(table: Table, cells: list[str], formula: str, formulas: bool) -> None:
    """A row of the plan's table, its formula in the last column where the table has one."""
    table.add_row(*cells, *([formula] if formulas else []))


def _rollout_rows(table: Table, plan: MemoryPlan, measured: bool, formulas: bool) -> None:
    """GRPO's rollout phase under the train step: the resident bytes counted once, what sampling
    holds, its total and the peak (the larger phase); planned only (the measurement is the
    train step's)."""
    blank = ["", ""] if measured else []
    table.add_section()
    resident = ["rollout phase: resident", "device", format_bytes(plan.resident_device_bytes)]
    _add_row(table, [*resident, *blank],
             "frozen base + trainable weights + optimizer state (the step's, counted once)",
             formulas)  # fmt: skip
    for component in plan.rollout:
        cells = [f"  {component.name}", component.placement, format_bytes(component.bytes)]
        _add_row(table, [*cells, *blank], component.formula, formulas)
    total = ["rollout phase total", "device", format_bytes(plan.rollout_device_bytes), *blank]
    _add_row(table, total, "", formulas)
    peak = ["peak (the larger phase)", "device", format_bytes(plan.device_bytes), *blank]
    _add_row(table, peak, "", formulas)


def print_report(
    plan: MemoryPlan,
    measurement: MemoryMeasurement | None,
    console: Console,
    changes: list[str] | None = None,
    formulas: bool = True,
) -> None:
    """The table (with its formulas column, or without: `plan_table`), then the settings, any
    budget changes and the notes."""
    console.print(plan_table(plan, measurement, formulas))
    settings = ", ".join(f"{key}={value}" for key, value in plan.settings.items())
    console.print(f"[bold]settings:[/] {settings}", highlight=False)
    for change in changes or []:
        console.print(f"[bold]budget changed[/] {change}", highlight=False)
    for note in comparison_notes(plan, measurement):
        console.print(f"[dim]note: {note}[/]", highlight=False)


def report_json(
    plan: MemoryPlan,
    measurement: MemoryMeasurement | None,
    changes: list[str] | None = None,
    verdict: Any = None,
) -> dict[str, Any]:
    """One object scripts can rely on: planned and measured component maps, totals, settings.

    planned_total_bytes = planned_device_bytes + planned_host_bytes; measured_total_bytes is the
    compiled step's device and host bytes, measured_device_bytes leaves host-resident bytes out
    (measured_derived names any host bytes counted by featherweight rather than the compiler).
    `verdict` (a `memory.capacity.Verdict`) adds the verdict line and its limit.
    """
    return {
        "verdict": verdict.line if verdict else None,
        "fits": verdict.fits if verdict else None,
        "limit_bytes": verdict.limit_bytes if verdict else None,
        "limit": verdict.limit_note if verdict else None,
        "planned": {c.name: c.bytes for c in plan.components},
        "placement": {c.name: c.placement for c in plan.components},
        "formulas": {c.name: c.formula for c in plan.components},
        "planned_groups": plan.measured_groups(),
        "planned_total_bytes": plan.device_bytes + plan.host_bytes,
        "planned_device_bytes": plan.device_bytes,
        "planned_train_device_bytes": plan.train_device_bytes,
        "planned_rollout_device_bytes": plan.rollout_device_bytes,
        "planned_rollout": {c.name: c.bytes for c in plan.rollout},
        "planned_host_bytes": plan.host_bytes,
        "planned_comparable_total_bytes": comparable_total(plan, measurement),
        "lower_bound_bytes": plan.lower_bound_bytes,
        "phases": plan.phases,
        "peak_phase": plan.peak_phase,
        "measured": measurement.components if measurement else None,
        "measured_total_bytes": measurement.total_bytes if measurement else None,
        "measured_device_bytes": measurement.device_bytes if measurement else None,
        "measured_platform": measurement.platform if measurement else None,
        "measured_target": measurement.target if measurement else None,
        "measured_derived": list(measurement.derived) if measurement else None,
        "settings": plan.settings,
        "changes": changes or [],
        "notes": comparison_notes(plan, measurement),
    }


def plot_plan(
    plan: MemoryPlan,
    measurement: MemoryMeasurement | None,
    path: str | Path,
    budget_bytes: int | None = None,
) -> Path:
    """A stacked bar per column (planned device, planned host, measured) of the components, in
    GiB, with the budget as a line; written to `path` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = {
        "planned (device)": [(c.name, c.bytes) for c in plan.components if c.placement != HOST]
    }
    if plan.host_bytes:
        columns["planned (host)"] = [
            (c.name, c.bytes) for c in plan.components if c.placement == HOST
        ]
    if measurement:
        columns[f"measured ({measurement.platform})"] = list(measurement.components.items())
    names = list(dict.fromkeys(name for parts in columns.values() for name, _ in parts))
    colors = {name: plt.cm.tab20(index % 20) for index, name in enumerate(names)}
    figure, axis = plt.subplots(figsize=(2.2 * len(columns) + 4, 6))
    for x, parts in enumerate(columns.values()):
        bottom = 0.0
        for name, value in parts:
            axis.bar(x, value / GIB, bottom=bottom, color=colors[name], label=name, width=0.6)
            bottom += value / GIB
    if budget_bytes:
        axis.axhline(budget_bytes / GIB, color="red", linestyle="--", label="budget")
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(
        unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8
    )
    axis.set_xticks(range(len(columns)), list(columns))
    axis.set_ylabel("GiB")
    axis.set_title("{method} b{batch_size} x {seq_len} {dtype}".format(**plan.settings))
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path)
    plt.close(figure)
    return path
