"""The plan against the GPU a run trains on: JAX's memory pool before any weight is read, and the
device's peak beside the plan after the first steps.

On a GPU, JAX preallocates a pool of `XLA_PYTHON_CLIENT_MEM_FRACTION` (default 0.75) of the
device's memory when it starts; a step whose buffers exceed the pool fails with an out-of-memory
error, after the weights have loaded. The fraction is read once, when JAX starts its backend, so
the trainer cannot change it for itself: `check_pool` compares the plan's device bytes with the
pool the device reports (`memory_stats()["bytes_limit"]`, less `targets.LIBRARY_ALLOWANCE_BYTES`
for cuBLAS/cuDNN workspaces and handles) and, when the plan does not fit, names the fraction to
start with. `peak_line` puts `memory_stats()["peak_bytes_in_use"]` (the process's high-water mark:
weights, optimizer state and the steps) beside the plan. Devices without these statistics
(XLA:CPU) are skipped: both return None.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from featherweight.errors import BudgetError
from featherweight.memory.report import format_bytes, percent_difference
from featherweight.memory.targets import LIBRARY_ALLOWANCE_BYTES, memory_fraction

HIGHEST_FRACTION = 0.95  # above this, the CUDA context and other processes have no room left


def local_memory_stats() -> dict[str, Any] | None:
    """The first local device's `memory_stats()` (None or empty where the backend keeps none)."""
    return jax.local_devices()[0].memory_stats()


def check_pool(planned_device_bytes: int, stats: dict[str, Any] | None) -> str | None:
    """The line that says the plan fits JAX's pool on this GPU; a BudgetError naming the
    XLA_PYTHON_CLIENT_MEM_FRACTION that would hold it when it does not; None without a pool."""
    if not stats or "bytes_limit" not in stats:
        return None
    pool = int(stats["bytes_limit"])
    usable = pool - LIBRARY_ALLOWANCE_BYTES
    fraction = memory_fraction()
    how = (
        f"JAX's pool {format_bytes(pool)} (XLA_PYTHON_CLIENT_MEM_FRACTION {fraction:g}) less "
        f"{format_bytes(LIBRARY_ALLOWANCE_BYTES)} for library workspaces"
    )
    if planned_device_bytes <= usable:
        return f"GPU memory: plan {format_bytes(planned_device_bytes)} of {format_bytes(usable)} usable ({how})"
    needed = (planned_device_bytes + LIBRARY_ALLOWANCE_BYTES) / (pool / fraction)
    fix = (
        f"start with XLA_PYTHON_CLIENT_MEM_FRACTION={math.ceil(needed * 100) / 100:.2f}, or "
        if needed <= HIGHEST_FRACTION
        else ""
    )
    raise BudgetError(
        f"the plan needs {format_bytes(planned_device_bytes)} on the GPU but "
        f"{format_bytes(usable)} is usable ({how}); {fix}set memory.budget: "
        f"{usable / 2**30:.2f}GiB so the planner fits the step"
    )


def peak_line(planned_device_bytes: int, stats: dict[str, Any] | None, step: int) -> str | None:
    """`peak_bytes_in_use` after `step` beside the plan's device bytes; None without statistics."""
    if not stats or "peak_bytes_in_use" not in stats:
        return None
    peak = int(stats["peak_bytes_in_use"])
    error = percent_difference(planned_device_bytes, peak)
    return (
        f"device peak after step {step}: {format_bytes(peak)} peak_bytes_in_use; plan "
        f"{format_bytes(planned_device_bytes)} ({error:+.1f}%)"
    )
