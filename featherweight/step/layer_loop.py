"""The streamed step's walk over the layer stack: forward keeping each layer's input, and backward
updating each layer as soon as its gradient exists.

forward: a scan of the block over the stacked layers (a frozen base in pinned host memory comes
  over one layer ahead: `memory_kinds.scan_layers`); each layer's input (and the intermediates
  the policy saves) is kept at the policy's placement -- the device, or pinned host memory, put
  there by the step itself (naming the block's input, not its output: XLA #17541).
backward: a reverse scan from the last layer to the first. Layer l's saved input comes back (the
  next one is fetched while l computes, and so is its frozen base when that is in host memory),
  its VJP is rebuilt (remat) -- with its share of the router's load-balancing loss when one is
  trained (the choices counted in the forward pass: `router_loss.py`) -- and its gradient goes
  to a `LayerSink`: straight into the
  optimizer on layer l's slice of each tensor's state (`update_sink`: parameters and state
  written back in place on the donated stacks, the fused update, and the new slice checked
  finite), into slice l of a gradient buffer (`accumulate_sink`: global clipping of adapters,
  accumulation over micro-batches), or
  nowhere but the squared norm (`norm_sink`: the first pass of two-pass clipping). At most one
  layer's gradient is alive at a time; only the buffer sink keeps a trainable-sized gradient.

Optimizer state in host memory is streamed, not written in place: its stacks are the scan's
per-layer inputs (layer l's slice cut out of host memory and copied over) and the new slices its
per-layer outputs, each copied back to the host as soon as it exists (XLA builds the new stack in
host memory: the pattern of the offloaded residual stream). In-place writes into a host array
would be host compute, which XLA's GPU compiler refuses (`parallel/offload_rules.py`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.llama import AttentionInputs, LoraSpec, Params
from featherweight.parallel.memory_kinds import (
    has_host_leaves,
    host_slice,
    scan_layers,
    to_device,
    to_host,
)
from featherweight.step.common import all_finite, scaled, squared_norm
from featherweight.step.layer_grad import layer_forward, layer_vjp
from featherweight.step.opt_state import guarded_update
from featherweight.step.policy import MemoryPolicy
from featherweight.step.router_loss import ExpertLoad, expert_load, probability_term


class LayerContext(NamedTuple):
    """What every layer of one step reads besides its own weights."""

    config: ModelConfig
    inputs: AttentionInputs
    lora: LoraSpec | None
    keys: jax.Array | None  # [L, 2] dropout keys, or None
    policy: MemoryPolicy
    constrain: Callable[[jax.Array], jax.Array]  # pins activations to the batch layout
    # the load-balancing loss (`router_loss.py`): the real tokens [N] (None: no such loss), and
    # the weights [E] of each layer's expert probabilities in the backward pass (set after the
    # forward pass has counted the choices)
    router_mask: jax.Array | None = None
    router_weights: jax.Array | None = None


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
) -> tuple[jax.Array, Any, ExpertLoad | None]:
    """(last hidden state [B, S, D], stored, load): each layer's input and saved intermediates,
    stacked per layer at the policy's placement; with `context.router_mask`, every layer's
    `ExpertLoad` summed (what the load-balancing loss reads), else None."""
    put, _ = _residual_store(context.policy.residuals)
    policy, config = context.policy, context.config

    def forward_layer(x, per_layer):
        (frozen_l, trainable_l), (key_l, index) = per_layer
        x = context.constrain(x)
        y, saved, logits = layer_forward(
            frozen_l, trainable_l, x, context.inputs.at_layer(index), config,
            context.lora, key_l, policy.save, policy.mlp_chunk,
        )  # fmt: skip
        load = None
        if context.router_mask is not None:
            load = expert_load(logits, context.router_mask, config.experts_per_token)
        with jax.named_scope("layer_store"):
            return y, (jax.tree.map(put, (x, saved)), load)

    layers = (frozen_layers, trainable_layers)
    indices = jnp.arange(config.num_layers, dtype=jnp.int32)
    hidden, (stored, loads) = scan_layers(
        forward_layer, x, layers, (context.keys, indices), config.num_layers
    )
    load = None if loads is None else jax.tree.map(lambda leaf: jnp.sum(leaf, axis=0), loads)
    return hidden, stored, load


class LayerSink(NamedTuple):
    """What the backward loop does with layer l's gradient, and where it reads l's trainable slice.

    `target` is the pytree the loop carries for the sink (updated stacks and states, a gradient
    buffer, or nothing); the layer's parameters are read from it when the sink rewrites them in
    place, so the donated stacks are updated without a copy. `streamed` are stacks read one layer
    at a time as the loop's per-layer inputs (host-resident optimizer state; None: nothing), and
    `absorb` returns each layer's per-layer output beside the new target (the new host slices);
    `finish(target, outputs)` assembles the sink's result from both.
    """

    params: Callable[[Any, jax.Array], Params]  # (target, l) -> layer l's trainable slice
    absorb: Callable[[Any, jax.Array, Params, Any], tuple[Any, Any]]  # -> (target, output_l)
    streamed: Any = None
    finish: Callable[[Any, Any], Any] = lambda target, outputs: target


def update_sink(
    optimizer, ok, treedef, stacks: list, states: tuple, scale: jax.Array | None = None
) -> tuple[LayerSink, Any]:
    """(sink, its first target): update layer l's tensors at once from its gradient (times
    `scale`, the global clip).

    target: (stacks, device states, finite) -- the trainable layer stacks (leaf order) and the
    per-tensor states that live on the device, written back in place at slice l, and whether
    every updated slice so far is finite (read from each slice while it is fresh, not in another
    pass over the stacks). A tensor whose state is in host memory streams it instead: slice l
    comes in as the loop's per-layer input and its update leaves as the per-layer output.
    The sink's result: (stacks, states, finite).
    """
    on_host_state = [has_host_leaves(state) for state in states]
    device_states = tuple(None if host else s for s, host in zip(states, on_host_state))
    host_states = tuple(s if host else None for s, host in zip(states, on_host_state))

    def params(target, index):
        return jax.tree.unflatten(treedef, [stack[index] for stack in target[0]])

    @jax.named_scope("layer_update")
    def absorb(target, index, grads, streamed):
        stacks, states, finite = target
        new_stacks, new_states, outputs = [], [], []
        for stack, state, incoming, grad in zip(
            stacks, states, streamed, jax.tree.leaves(grads), strict=True
        ):
            state_l = to_device(incoming) if state is None else _slice(state, index)
            param, state_l = guarded_update(
                optimizer, ok, scaled(grad, scale).astype(stack.dtype), state_l, stack[index]
            )
            finite = finite & all_finite(param)
            new_stacks.append(jax.lax.dynamic_update_index_in_dim(stack, param, index, 0))
            if state is None:
                new_states.append(None)
                outputs.append(to_host(state_l))
            else:
                new_states.append(_write(state, state_l, index))
                outputs.append(None)
        return (new_stacks, tuple(new_states), finite), tuple(outputs)

    def finish(target, outputs):
        stacks, states, finite = target
        merged = tuple(out if state is None else state for state, out in zip(states, outputs))
        return stacks, merged, finite

    sink = LayerSink(params, absorb, host_states, finish)
    return sink, (list(stacks), device_states, jnp.bool_(True))


def _write(tree, values, index):
    return jax.tree.map(
        lambda leaf, value: jax.lax.dynamic_update_index_in_dim(leaf, value, index, 0), tree, values
    )


def accumulate_sink(trainable_layers: Params) -> LayerSink:
    """Add layer l's gradient into slice l of a gradient buffer (target: the buffer's stacks, in
    leaf order); the parameters are read, unchanged, from `trainable_layers`."""

    def absorb(buffer, index, grads, _):
        return [
            jax.lax.dynamic_update_index_in_dim(
                stack, stack[index] + grad.astype(stack.dtype), index, 0
            )
            for stack, grad in zip(buffer, jax.tree.leaves(grads), strict=True)
        ], None

    return LayerSink(lambda _, index: _slice(trainable_layers, index), absorb)


def norm_sink(trainable_layers: Params) -> LayerSink:
    """Keep nothing: only the squared norm the loop sums (the first pass of two-pass clipping)."""
    return LayerSink(
        lambda _, index: _slice(trainable_layers, index), lambda target, *_: (target, None)
    )


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
    router_term = (  # each layer's share of the load-balancing loss's gradient
        None
        if context.router_weights is None
        else functools.partial(
            probability_term, mask=context.router_mask, weights=context.router_weights
        )
    )
    # a frozen base in host memory rides in the carry, fetched one layer ahead like the inputs
    base_on_host = has_host_leaves(frozen_layers)

    @jax.named_scope("layer_fetch")
    def fetch_layer(index):
        saved = jax.tree.map(fetch, _slice(stored, index))
        return (saved, host_slice(frozen_layers, index)) if base_on_host else (saved, None)

    def backward_layer(carry, per_layer):
        cotangent, target, grad_sq, current = carry
        index, streamed = per_layer
        cotangent = context.constrain(cotangent)
        upcoming = fetch_layer(jnp.maximum(index - 1, 0))
        (x, saved), frozen_l = current
        if not base_on_host:
            with jax.named_scope("layer_fetch"):
                frozen_l = _slice(frozen_layers, index)
        grads, cotangent = layer_vjp(
            frozen_l, sink.params(target, index), x, saved, cotangent,
            context.inputs.at_layer(index), context.config,
            context.lora, None if context.keys is None else context.keys[index],
            context.policy.mlp_chunk, router_term,
        )  # fmt: skip
        target, output = sink.absorb(target, index, grads, streamed)
        return (cotangent, target, grad_sq + squared_norm(grads), upcoming), output

    first = fetch_layer(num_layers - 1)
    (cotangent, target, grad_sq, _), outputs = jax.lax.scan(
        backward_layer,
        (cotangent, target, jnp.float32(0), first),
        (jnp.arange(num_layers, dtype=jnp.int32), sink.streamed),
        reverse=True,
    )
    return cotangent, sink.finish(target, outputs), grad_sq


def update_layers(sink: LayerSink, grad_stacks: list, target, num_layers: int):
    """Every layer's update from a kept gradient buffer (stacks in leaf order), one layer at a
    time through `sink` (an `update_sink`) -> the sink's result."""

    def update_layer(target, per_layer):
        index, streamed = per_layer
        grads = [jax.lax.dynamic_index_in_dim(g, index, keepdims=False) for g in grad_stacks]
        return sink.absorb(target, index, grads, streamed)

    target, outputs = jax.lax.scan(
        update_layer, target, (jnp.arange(num_layers, dtype=jnp.int32), sink.streamed)
    )
    return sink.finish(target, outputs)
