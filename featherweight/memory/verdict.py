"""The verdict a person reads first: does the step fit the device, and by how much.

    fits: 5.31 of 5.50 GiB on the H100 (+1.98 GiB host)
    does not fit: 61.20 GiB planned, 59.21 GiB usable on the H100; short by 1.99 GiB; options: ...

The limit is the budget when one is given, else what the target GPU can hold
(`targets.usable_bytes`: memory x JAX's memory fraction, less the library allowance). The planned
device bytes decide; the compiled device bytes, when the step was compiled for the target, are
shown beside them.
"""

from __future__ import annotations

from typing import NamedTuple

from featherweight.memory.components import MemoryPlan
from featherweight.memory.measure import MemoryMeasurement
from featherweight.memory.targets import (
    LIBRARY_ALLOWANCE_BYTES,
    Target,
    memory_fraction,
    usable_bytes,
)

GIB = 2**30


class Verdict(NamedTuple):
    """Whether the plan fits `limit_bytes`, the line that says so, and how the limit was found."""

    fits: bool
    limit_bytes: int
    line: str
    limit_note: str


def _gib(value: int) -> str:
    return f"{value / GIB:.2f}"


def usable_note(target: Target) -> str:
    """How the target's usable bytes are found, with its numbers."""
    return (
        f"usable on the {target.short_name}: {_gib(target.memory_bytes)} GiB x "
        f"{memory_fraction():g} (XLA_PYTHON_CLIENT_MEM_FRACTION) - "
        f"{LIBRARY_ALLOWANCE_BYTES / GIB:.2f} GiB for cuBLAS/cuDNN workspaces and handles = "
        f"{_gib(usable_bytes(target))} GiB"
    )


def verdict(
    plan: MemoryPlan,
    target: Target | None,
    budget_bytes: int | None = None,
    measurement: MemoryMeasurement | None = None,
    options: list[str] | None = None,
) -> Verdict | None:
    """The verdict against the budget, else the target GPU's usable bytes; None when neither
    gives a limit (a CPU plan without a budget)."""
    usable = None if target is None else usable_bytes(target)
    limit = budget_bytes if budget_bytes is not None else usable
    if limit is None:
        return None
    where = (
        f"on the {target.short_name}"
        if budget_bytes is None and target is not None
        else "in the budget"
    )
    extras = []
    if plan.host_bytes:
        extras.append(f"+{_gib(plan.host_bytes)} GiB host")
    if measurement is not None and measurement.target not in (None, "cpu"):
        kind = "compiled" if measurement.compiled else "compiled, host bytes derived"
        extras.append(
            f"{kind} for the {measurement.target.upper()}: {_gib(measurement.device_bytes)} GiB"
        )
    tail = f" ({'; '.join(extras)})" if extras else ""
    if plan.device_bytes <= limit:
        line = f"fits: {_gib(plan.device_bytes)} of {_gib(limit)} GiB {where}{tail}"
    else:
        short = plan.device_bytes - limit
        line = (
            f"does not fit: {_gib(plan.device_bytes)} GiB planned, {_gib(limit)} GiB {where}"
            f"{tail}; short by {_gib(short)} GiB"
        )
        if options:
            line += f"; options: {'; '.join(options)}"
    if budget_bytes is not None:
        note = f"limit: the budget, {_gib(budget_bytes)} GiB"
        if usable is not None and budget_bytes > usable:
            note += f" -- more than the {usable_note(target)}"
    else:
        note = usable_note(target)
    return Verdict(plan.device_bytes <= limit, limit, line, note)
