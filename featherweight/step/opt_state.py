"""The streamed step's optimizer state: one state per trainable tensor, stacked per layer.

Each tensor is updated on its own inside the backward pass, so each has its own optax state; a
layer tensor's state is initialised for one layer's slice and stacked on a leading layer axis, so
the backward loop reads and writes layer l's slice. The state may live in pinned host memory
(`init_streamed_opt_state(..., "host")`): then only the slice being updated comes to the device.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import optax

from featherweight.errors import StepConfigError
from featherweight.models.llama import Params
from featherweight.parallel.memory_kinds import to_host
from featherweight.step.validate import check_optimizer


class StreamedOptState(NamedTuple):
    """Optimizer state kept per parameter tensor, so each tensor is updated on its own.

    layers: one state per trainable layer tensor (in `jax.tree.leaves` order of the trainable
      layers), each initialised for a single layer's tensor and stacked on a leading layer axis.
    top: {name: state} for the trainable tensors outside the layer stack (final_norm, lm_head,
      embed).

    Per-tensor states equal one state over the whole pytree for element-wise optimizers (SGD,
    Adam(W), Lion, ...); they keep the update's temporaries to one tensor at a time.
    """

    layers: tuple
    top: dict


def per_tensor_clipping(max_norm: float) -> optax.GradientTransformation:
    """Gradient clipping as the streamed step applies an optax chain: each tensor's gradient (one
    layer's slice of a stacked tensor, the head's, the embedding's) is clipped to `max_norm` on
    its own, so a layer's update can reach (tensors per layer) x max_norm. It is not global-norm
    clipping, which needs every gradient's norm before any update: `build_streamed_step`'s
    `clip_norm` (kept gradient, or `two_pass`) does that."""
    return optax.clip_by_global_norm(max_norm)


def init_streamed_opt_state(
    optimizer: optax.GradientTransformation, trainable: Params, placement: str = "device"
) -> StreamedOptState:
    """The optimizer state the streamed step expects for `trainable`, in `placement` ("device"
    or pinned "host" memory).

    On the host, each tensor's state is moved there as soon as it is made, so the device holds
    one tensor's state at a time, never all of it. The streamed step then brings each layer's
    slice of each tensor's state to the device for that tensor's update and sends the new slice
    back; the head's and embedding's states come over in row chunks (elementwise optimizers) or
    whole. Works for any optax transformation.
    """
    check_optimizer(optimizer)
    put = _placer(placement)
    layer_leaves = jax.tree.leaves(trainable.get("layers") or {})
    return StreamedOptState(
        layers=tuple(put(jax.vmap(optimizer.init)(leaf)) for leaf in layer_leaves),
        top={
            name: put(optimizer.init(value))
            for name, value in trainable.items()
            if name != "layers"
        },
    )


def _placer(placement: str):
    if placement == "device":
        return lambda state: state
    if placement != "host":
        raise StepConfigError(f"optimizer state placement {placement!r}: use 'device' or 'host'")
    return to_host


def guarded_update(optimizer, ok, grads, state, params):
    """Apply the optimizer when `ok` (the loss is finite), else keep params and state as they are.

    Besides skipping the update of a diverged step, the `lax.cond` boundary keeps XLA from fusing
    the optimizer arithmetic into the in-place updates of the stacks (which made it copy every
    optimizer-state stack: 3x the weights of temp memory with Adam).
    """

    def apply(grads, state, params):
        updates, new_state = optimizer.update(grads, state, params)
        new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)
        return optax.apply_updates(params, updates), new_state

    def keep(grads, state, params):
        return params, state

    return jax.lax.cond(ok, apply, keep, grads, state, params)
