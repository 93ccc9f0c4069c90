"""The streamed step's walk over the layer stack: forward keeping each layer's input, and backward
updating each layer as soon as its gradient exists.

forward: a scan of the block over the stacked layers (a frozen base in pinned host memory comes
  over one layer ahead: `memory_kinds.scan_layers`); each layer's input (and the intermediates
  the policy saves) is kept at the policy's placement -- the device, or pinned host memory, put
  there by the step itself (naming the block's input, not its output: XLA #17541).
backward: a `fori_loop` from the last layer to the first. Layer l's saved input comes back (the
  next one is fetched while l computes, and so is its frozen base when that is in host memory),
  its VJP is rebuilt (remat), and its gradient goes to a `LayerSink`: straight into the
  optimizer on layer l's slice of each tensor's state (`update_sink`: parameters and state
  written back in place on the donated stacks, the fused update, and the new slice checked
  finite), into slice l of a gradient buffer (`accumulate_sink`: global clipping of adapters,
  accumulation over micro-batches), or
  nowhere but the squared norm (`norm_sink`: the first pass of two-pass clipping). At most one
  layer's gradient is alive at a time; only the buffer sink keeps a trainable-sized gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.llama import AttentionInputs, LoraSpec, Params
from featherweight.parallel.memory_kinds import (
    has_host_leaves,
    host_slice,
    host_write,
    scan_layers,
)
from featherweight.step.common import all_finite, scaled, squared_norm
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
        (frozen_l, trainable_l), key_l = per_layer
        x = context.constrain(x)
        y, saved = layer_forward(
            frozen_l, trainable_l, x, context.inputs, context.config, context.lora, key_l,
            policy.save, policy.mlp_chunk,
        )  # fmt: skip
        return y, jax.tree.map(put, (x, saved))

    layers = (frozen_layers, trainable_layers)
    return scan_layers(forward_layer, x, layers, context.keys, context.config.num_layers)


class LayerSink(NamedTuple):
    """What the backward loop does with layer l's gradient, and where it reads l's trainable slice.

    `target` is the pytree the loop carries for the sink (updated stacks and states, a gradient
    buffer, or nothing); the layer's parameters are read from it when the sink rewrites them in
    place, so the donated stacks are updated without a copy.
    """

    params: Callable[[Any, jax.Array], Params]  # (target, l) -> layer l's trainable slice
    absorb: Callable[[Any, jax.Array, Params], Any]  # (target, l, layer gradient) -> target


def update_sink(optimizer, ok, treedef, scale: jax.Array | None = None) -> LayerSink:
    """Update layer l's tensors at once from its gradient (times `scale`, the global clip).

    target: (stacks, states, finite) -- the trainable layer stacks (leaf order) and their
    per-tensor states, written back in place at slice l, and whether every updated slice so far
    is finite (read from each slice while it is fresh, not in another pass over the stacks).
    """

    def params(target, index):
        return jax.tree.unflatten(treedef, [stack[index] for stack in target[0]])

    def absorb(target, index, grads):
        stacks, states, finite = target
        new_stacks, new_states = [], []
        for stack, state, grad in zip(stacks, states, jax.tree.leaves(grads), strict=True):
            param, state_l = guarded_update(
                optimizer,
                ok,
                scaled(grad, scale).astype(stack.dtype),
                host_slice(state, index),
                stack[index],
            )
            finite = finite & all_finite(param)
            new_stacks.append(jax.lax.dynamic_update_index_in_dim(stack, param, index, 0))
            new_states.append(host_write(state, state_l, index))
        return new_stacks, tuple(new_states), finite

    return LayerSink(params, absorb)


def accumulate_sink(trainable_layers: Params) -> LayerSink:
    """Add layer l's gradient into slice l of a gradient buffer (target: the buffer's stacks, in
    leaf order); the parameters are read, unchanged, from `trainable_layers`."""

    def absorb(buffer, index, grads):
        return [
            jax.lax.dynamic_update_index_in_dim(
                stack, stack[index] + grad.astype(stack.dtype), index, 0
            )
            for stack, grad in zip(buffer, jax.tree.leaves(grads), strict=True)
        ]

    return LayerSink(lambda _, index: _slice(trainable_layers, index), absorb)


def norm_sink(trainable_layers: Params) -> LayerSink:
    """Keep nothing: only the squared norm the loop sums (the first pass of two-pass clipping)."""
    return LayerSink(lambda _, index: _slice(trainable_layers, index), lambda target, *_: target)


def backward_layers(
    cotangent: jax.Array,
    stored,
    frozen_layers: Params,
    context: LayerContext,
    sink: LayerSink,
    target,
) -> tuple[jax.Array, Any, jax.Array]:
    """Last layer to first: each layer's VJP, its gradient handed to `sink` at once.

    Returns (the cotangent of the first layer's input, the sink's final target, the squared norm
    of every layer gradient). At most one layer's gradient is alive at a time.
    """
    _, fetch = _residual_store(context.policy.residuals)
    num_layers = context.config.num_layers
    # a frozen base in host memory rides in the carry, fetched one layer ahead like the inputs
    base_on_host = has_host_leaves(frozen_layers)

    def fetch_layer(index):
        saved = jax.tree.map(fetch, _slice(stored, index))
        return (saved, host_slice(frozen_layers, index)) if base_on_host else (saved, None)

    def backward_layer(i, carry):
        cotangent, target, grad_sq, current = carry
        cotangent = context.constrain(cotangent)
        index = num_layers - 1 - i
        upcoming = fetch_layer(jnp.maximum(index - 1, 0))
        (x, saved), frozen_l = current
        grads, cotangent = layer_vjp(
            frozen_l if base_on_host else _slice(frozen_layers, index),
            sink.params(target, index), x, saved, cotangent, context.inputs, context.config,
            context.lora, None if context.keys is None else context.keys[index],
            context.policy.mlp_chunk,
        )  # fmt: skip
        target = sink.absorb(target, index, grads)
        return cotangent, target, grad_sq + squared_norm(grads), upcoming

    first = fetch_layer(num_layers - 1)
    cotangent, target, grad_sq, _ = jax.lax.fori_loop(
        0, num_layers, backward_layer, (cotangent, target, jnp.float32(0), first)
    )
    return cotangent, target, grad_sq


def update_layers(sink: LayerSink, grad_stacks: list, target, num_layers: int):
    """Every layer's update from a kept gradient buffer (stacks in leaf order), one layer at a
    time through `sink` (an `update_sink`) -> the sink's final target."""

    def update_layer(index, target):
        grads = [jax.lax.dynamic_index_in_dim(g, index, keepdims=False) for g in grad_stacks]
        return sink.absorb(target, index, grads)

    return jax.lax.fori_loop(0, num_layers, update_layer, target)
