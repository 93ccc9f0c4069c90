"""The GPU a run trains on, as the trainer reads it: its memory statistics, and the device's peak
beside the plan after the first steps.

`local_memory_stats` is the first local device's `memory_stats()`: `bytes_limit` (the pool JAX
preallocated, what `capacity.of_device` judges the plan against before any weight is read) and
`peak_bytes_in_use` (the process's high-water mark: weights, optimizer state and the steps),
which `peak_line` puts beside the plan. Devices without these statistics (XLA:CPU) give None.
"""

from __future__ import annotations

from typing import Any

import jax

from featherweight.memory.report import format_bytes, percent_difference


def local_memory_stats() -> dict[str, Any] | None:
    """The first local device's `memory_stats()` (None or empty where the backend keeps none)."""
    return jax.local_devices()[0].memory_stats()


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
