"""What a step may use, and the one verdict on whether its plan fits.

    fits: 5.31 of 5.50 GiB on the H100 (+1.98 GiB host)
    does not fit: 61.20 GiB planned, 59.21 GiB usable on the H100; short by 1.99 GiB; options: ...

A `Capacity` is the limit a plan's device bytes must fit, with where the number comes from:

- a budget (`--budget`, `memory.budget`): the bytes named;
- a target GPU (`plan --target h100`): memory x JAX's memory fraction, less the library
  allowance (`targets.usable_bytes`);
- this process's device (`train`): on a GPU the pool JAX preallocated (`memory_stats()
  ["bytes_limit"]`, `XLA_PYTHON_CLIENT_MEM_FRACTION` of its memory, read once when JAX starts, so
  a run cannot change it for itself), less the same allowance; on a CPU backend the machine's
  physical memory, which holds the host-placed bytes too.

The allowance (`targets.LIBRARY_ALLOWANCE_BYTES`) is the same everywhere: cuBLAS/cuDNN workspaces
and handles take part of JAX's pool and no memory analysis shows them. `verdict` judges a plan
against any of them; `refuse_unless_fits` is the trainer's use of it, before any weight is read,
naming what makes room (a larger memory fraction when the device has it, or a budget).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Sequence
from typing import NamedTuple

import jax

from featherweight.errors import BudgetError
from featherweight.memory import device_memory
from featherweight.memory.components import MemoryPlan
from featherweight.memory.measure import MemoryMeasurement
from featherweight.memory.targets import (
    LIBRARY_ALLOWANCE_BYTES,
    Target,
    memory_fraction,
    usable_bytes,
)

GIB = 2**30
HIGHEST_FRACTION = 0.95  # above this, the CUDA context and other processes have no room left


def _gib(value: float) -> str:
    return f"{value / GIB:.2f}"


@dataclasses.dataclass(frozen=True)
class Capacity:
    """The bytes a plan must fit (`limit_bytes`), where (`where`: "on the H100"), how that number
    was found (`note`), whether host-placed bytes share it (a CPU backend's device is the host),
    and, for a GPU's pool, the pool and JAX's memory fraction behind it (what a larger fraction
    would give)."""

    limit_bytes: int
    where: str
    note: str
    holds_host: bool = False
    pool_bytes: int | None = None
    fraction: float | None = None

    def needed_bytes(self, plan: MemoryPlan) -> int:
        """What of `plan` counts against this capacity."""
        return plan.device_bytes + (plan.host_bytes if self.holds_host else 0)

    def room(self, needed: int) -> str:
        """How to make room for `needed` bytes: the memory fraction that would hold them (a GPU
        pool, when the device has that much), else a budget the planner fits the step to."""
        limit = _gib(max(self.limit_bytes, GIB))
        budget = f"set memory.budget: {limit}GiB so the planner fits the step"
        if self.pool_bytes is None or self.fraction is None:
            return f"lower batch_size or data.seq_len, or {budget}"
        fraction = (needed + LIBRARY_ALLOWANCE_BYTES) / (self.pool_bytes / self.fraction)
        if fraction > HIGHEST_FRACTION:
            return budget
        at_least = math.ceil(fraction * 100) / 100
        return f"start with XLA_PYTHON_CLIENT_MEM_FRACTION={at_least:.2f}, or {budget}"


def usable_note(target: Target) -> str:
    """How the target's usable bytes are found, with its numbers."""
    return (
        f"usable on the {target.short_name}: {_gib(target.memory_bytes)} GiB x "
        f"{memory_fraction():g} (XLA_PYTHON_CLIENT_MEM_FRACTION) - "
        f"{_gib(LIBRARY_ALLOWANCE_BYTES)} GiB for cuBLAS/cuDNN workspaces and handles = "
        f"{_gib(usable_bytes(target))} GiB"
    )


def of_target(target: Target | None) -> Capacity | None:
    """What a step may use on a target GPU; None for the CPU target (no device limit)."""
    usable = None if target is None else usable_bytes(target)
    if usable is None:
        return None
    return Capacity(usable, f"on the {target.short_name}", usable_note(target))


def of_budget(
    budget_bytes: int, target: Target | None = None, holds_host: bool = False
) -> Capacity:
    """A budget; its note says so when it is more than `target` can hold. `holds_host`: the
    device planned for is a CPU, whose memory is the host's (the budget bounds both)."""
    note = f"limit: the budget, {_gib(budget_bytes)} GiB"
    if holds_host:
        note += " of this machine's memory, host bytes included (a CPU's device is the host)"
    beyond = of_target(target)
    if beyond is not None and budget_bytes > beyond.limit_bytes:
        note += f" -- more than the {beyond.note}"
    return Capacity(budget_bytes, "in the budget", note, holds_host=holds_host)


def of_device() -> Capacity | None:
    """What a step may use on this process's first device: JAX's pool less the allowance on a
    GPU, the physical memory on a CPU backend (host bytes included); None where neither is
    known."""
    stats = device_memory.local_memory_stats() or {}
    if stats.get("bytes_limit"):
        pool, fraction = int(stats["bytes_limit"]), memory_fraction()
        note = (
            f"JAX's pool {_gib(pool)} GiB (XLA_PYTHON_CLIENT_MEM_FRACTION {fraction:g}) less "
            f"{_gib(LIBRARY_ALLOWANCE_BYTES)} GiB for library workspaces"
        )
        usable = pool - LIBRARY_ALLOWANCE_BYTES
        return Capacity(usable, "on this GPU", note, pool_bytes=pool, fraction=fraction)
    if jax.local_devices()[0].platform == "cpu":
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        note = "the physical memory of the CPU backend, host bytes included"
        return Capacity(physical, "in this machine's memory", note, holds_host=True)
    return None


def of_machine(target: Target | None) -> Capacity | None:
    """What a step may use on the device a plan is for: a GPU target's usable memory
    (`of_target`), else this process's device (`of_device`)."""
    if target is not None and target.platform == "gpu":
        return of_target(target)
    return of_device()


class Verdict(NamedTuple):
    """Whether the plan fits `limit_bytes`, the line that says so, and how the limit was found."""

    fits: bool
    limit_bytes: int
    line: str
    limit_note: str


def verdict(
    plan: MemoryPlan,
    capacity: Capacity | None,
    measurement: MemoryMeasurement | None = None,
    options: Sequence[str] = (),
) -> Verdict | None:
    """The plan against `capacity`, with its host bytes and, when the step was compiled for a
    target, the compiled device bytes beside it; None without a capacity (a CPU plan without a
    budget)."""
    if capacity is None:
        return None
    needed, limit, where = capacity.needed_bytes(plan), capacity.limit_bytes, capacity.where
    extras = []
    if plan.host_bytes:
        extras.append(f"+{_gib(plan.host_bytes)} GiB host")
    if measurement is not None and measurement.target not in (None, "cpu"):
        kind = "compiled" if measurement.compiled else "compiled, host bytes derived"
        extras.append(
            f"{kind} for the {measurement.target.upper()}: {_gib(measurement.device_bytes)} GiB"
        )
    tail = f" ({'; '.join(extras)})" if extras else ""
    if needed <= limit:
        line = f"fits: {_gib(needed)} of {_gib(limit)} GiB {where}{tail}"
    else:
        line = (
            f"does not fit: {_gib(needed)} GiB planned, {_gib(limit)} GiB {where}{tail}; short "
            f"by {_gib(needed - limit)} GiB"
        )
        if options:
            line += f"; options: {'; '.join(options)}"
    return Verdict(needed <= limit, limit, line, capacity.note)


def refuse_unless_fits(plan: MemoryPlan | None, capacity: Capacity | None) -> Verdict | None:
    """The verdict of `plan` on `capacity`; `BudgetError` when it does not fit, naming what makes
    room (the step would fail after loading and compiling -- or take the machine's memory first
    -- instead of now)."""
    judged = None if plan is None else verdict(plan, capacity)
    if judged is not None and not judged.fits:
        needed = capacity.needed_bytes(plan)
        raise BudgetError(
            f"the memory plan needs {_gib(needed)} GiB but the device has "
            f"{_gib(capacity.limit_bytes)} GiB usable ({capacity.note}); {capacity.room(needed)}"
        )
    return judged
