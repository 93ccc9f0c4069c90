"""The optax transformation a config names: optimizer and learning-rate schedule.

Clipping is the train step's to apply (`recipe.build.step_optimizer`): global clipping with the
streamed step is done by the step itself, not by a link of this chain.
"""

from __future__ import annotations

import optax

from featherweight.recipe.schema import OptimizerSettings

# optimizers whose state is elementwise, so a [V, D] table's state can be updated in row chunks
ROW_CHUNKED_OPTIMIZERS = ("adamw", "sgd", "lion")


def learning_rate_schedule(settings: OptimizerSettings, total_steps: int) -> optax.Schedule:
    """Constant, cosine or linear decay to zero, after `warmup_steps` of linear warmup."""
    peak, warmup = settings.learning_rate, min(settings.warmup_steps, max(total_steps - 1, 0))
    decay_steps = max(total_steps - warmup, 1)
    if settings.schedule == "constant":
        decay = optax.constant_schedule(peak)
    elif settings.schedule == "cosine":
        decay = optax.cosine_decay_schedule(peak, decay_steps)
    else:
        decay = optax.linear_schedule(peak, 0.0, decay_steps)
    if warmup == 0:
        return decay
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), decay], [warmup])


def make_optimizer(settings: OptimizerSettings, total_steps: int) -> optax.GradientTransformation:
    """The optax transformation a config names (without clipping: `recipe.build.step_optimizer`)."""
    schedule = learning_rate_schedule(settings, total_steps)
    if settings.name == "adamw":
        optimizer = optax.adamw(
            schedule, settings.b1, settings.b2, settings.eps, weight_decay=settings.weight_decay
        )
    elif settings.name == "adamw_8bit":
        from featherweight.optim.adamw8bit import adamw_8bit

        optimizer = adamw_8bit(
            schedule, settings.b1, settings.b2, settings.eps, weight_decay=settings.weight_decay
        )
    elif settings.name == "sgd":
        optimizer = optax.sgd(schedule, momentum=settings.b1 or None)
    elif settings.name == "lion":
        optimizer = optax.lion(
            schedule, settings.b1, settings.b2, weight_decay=settings.weight_decay
        )
    else:
        optimizer = optax.adafactor(schedule, weight_decay_rate=settings.weight_decay or None)
    return optimizer
