"""The streamed step's walk over the layer stack: forward keeping each layer's input, and backward
updating each layer as soon as its gradient exists.

forward: a scan of the block over the stacked layers; each layer's input (and the intermediates
  the policy saves) is kept at the policy's placement -- the device, or pinned host memory, put
  there by the step itself (naming the block's input, not its output: XLA #17541).
backward: a `fori_loop` from the last layer to the first. Layer l's saved input comes back (the
  next one is fetched while l computes), its VJP is rebuilt (remat), and its gradient goes straight
  into the optimizer on layer l's slice of each tensor's state; parameters and state are written
  back in place on the donated stacks. The gradient is then dropped: at most one layer's gradient
  is alive, and the full gradient pytree never exists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from featherweight.models.config import ModelConfig
from featherweight.models.llama import AttentionInputs, LoraSpec, Params
from featherweight.parallel.memory_kinds import host_slice, host_write
from featherweight.step.common import squared_norm
from featherweight.step.layer_grad import layer_forward, layer_vjp
from featherweight.step.opt_state import guarded_update
from featherweight.step.policy import MemoryPolicy


class LayerContext(NamedTuple):
    """What every layer of one step reads besides its own weights."""

    config: ModelConfig
    inputs: AttentionInputs
    lora: LoraSpec | None
    keys: jax.Array | None  # [L, 2] dropout keys, or None
    policy: MemoryPolicy
    constrain: Callable[[jax.Array], jax.Array]  # pins activations to the batch layout


def _residual_store(placement: str) -> tuple[Callable, Callable]:
    """(put, fetch) moving a saved activation to its placement and back to the device."""
    if placement == "host":
        return (
            lambda x: jax.device_put(x, jax.memory.Space.Host),
            lambda x: jax.device_put(x, jax.memory.Space.Device),
        )
    return (lambda x: x), (lambda x: x)


def _slice(tree, index):
    return jax.tree.map(
        lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), tree
    )


def forward_layers(
    frozen_layers: Params, trainable_layers: Params, x: jax.Array, context: LayerContext
) -> tuple[jax.Array, Any]:
    """(last hidden state [B, S, D], stored): each layer's input and saved intermediates, stacked
    per layer at the policy's placement."""
    put, _ = _residual_store(context.policy.residuals)
    policy = context.policy

    def forward_layer(x, per_layer):
        frozen_l, trainable_l, key_l = per_layer
        x = context.constrain(x)
        y, saved = layer_forward(
            frozen_l, trainable_l, x, context.inputs, context.config, context.lora, key_l,
            policy.save, policy.mlp_chunk,
        )  # fmt: skip
        return y, jax.tree.map(put, (x, saved))

    return jax.lax.scan(forward_layer, x, (frozen_layers, trainable_layers, context.keys))


def backward_layers(
    optimizer: optax.GradientTransformation,
    ok: jax.Array,
    cotangent: jax.Array,
    stored,
    frozen_layers: Params,
    trainable_layers: Params,
    layer_states: tuple,
    context: LayerContext,
) -> tuple[jax.Array, Params, tuple, jax.Array]:
    """Last layer to first: each layer's VJP, then each of its tensors' updates, in place.

    Returns (the cotangent of the first layer's input, the updated trainable layers, their
    updated states, the squared norm of every layer gradient).
    """
    _, fetch = _residual_store(context.policy.residuals)
    num_layers = context.config.num_layers
    stacks, treedef = jax.tree.flatten(trainable_layers)

    def backward_layer(i, carry):
        cotangent, stacks, states, grad_sq, current = carry
        cotangent = context.constrain(cotangent)
        index = num_layers - 1 - i
        upcoming = jax.tree.map(fetch, _slice(stored, jnp.maximum(index - 1, 0)))
        x, saved = current
        grads, cotangent = layer_vjp(
            _slice(frozen_layers, index),
            jax.tree.unflatten(treedef, [stack[index] for stack in stacks]),
            x, saved, cotangent, context.inputs, context.config, context.lora,
            None if context.keys is None else context.keys[index], context.policy.mlp_chunk,
        )  # fmt: skip
        new_stacks, new_states = [], []
        for stack, state, grad in zip(stacks, states, jax.tree.leaves(grads), strict=True):
            param, state_l = guarded_update(
                optimizer, ok, grad, host_slice(state, index), stack[index]
            )
            new_stacks.append(jax.lax.dynamic_update_index_in_dim(stack, param, index, 0))
            new_states.append(host_write(state, state_l, index))
        return cotangent, new_stacks, tuple(new_states), grad_sq + squared_norm(grads), upcoming

    first = jax.tree.map(fetch, _slice(stored, num_layers - 1))
    cotangent, stacks, states, grad_sq, _ = jax.lax.fori_loop(
        0, num_layers, backward_layer, (cotangent, stacks, layer_states, jnp.float32(0), first)
    )
    return cotangent, jax.tree.unflatten(treedef, stacks), states, grad_sq
