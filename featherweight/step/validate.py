"""Checks shared by the train-step builders: refuse what cannot work, before compiling."""

from __future__ import annotations

import optax

from featherweight.errors import StepConfigError


def check_optimizer(optimizer) -> None:
    """The optimizer must be an optax `GradientTransformation` (an `init`/`update` pair)."""
    if not isinstance(optimizer, optax.GradientTransformation) and not (
        callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None))
    ):
        raise StepConfigError(
            f"optimizer {optimizer!r} is not an optax GradientTransformation; pass e.g. "
            "optax.adamw(1e-4) (an object with init and update)"
        )
