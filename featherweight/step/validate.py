"""Checks shared by the train-step builders: refuse what cannot work, before compiling."""

from __future__ import annotations

import jax
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


def refuse_multisteps(optimizer, trainable) -> None:
    """An optimizer wrapped in `optax.MultiSteps` keeps a second gradient-sized buffer in its
    state (checkpointed with it) and updates only every k-th call; the steps accumulate over
    micro-batches themselves (`accumulation_steps`), so it is refused."""
    state_shape = jax.eval_shape(
        optimizer.init,
        jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), trainable.get("layers") or {}
        ),
    )
    wraps_multisteps = any(
        isinstance(node, optax.MultiStepsState)
        for node in jax.tree.leaves(
            state_shape, is_leaf=lambda n: isinstance(n, optax.MultiStepsState)
        )
    )
    if wraps_multisteps:
        raise StepConfigError(
            "optax.MultiSteps accumulates in the optimizer state; pass the inner optimizer and "
            "accumulation_steps=k to the step instead (micro-batches summed inside one step)"
        )


def check_uniform_layers(frozen, trainable, num_layers: int) -> None:
    """Every layer tensor must be stacked on a leading axis of length num_layers."""
    for group, tree in (
        ("frozen", frozen.get("layers", {})),
        ("trainable", trainable.get("layers", {})),
    ):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            if leaf.ndim == 0 or leaf.shape[0] != num_layers:
                name = jax.tree_util.keystr(path)
                raise StepConfigError(
                    f"{group} layer tensor {name} has shape {leaf.shape}; the streamed step needs "
                    f"every layer tensor stacked on a leading axis of {num_layers} (uniform layers)"
                )
