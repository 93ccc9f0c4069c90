"""Host memory inside a jitted step: what stays in pinned host memory, and how slices of it move.

Four things may live on the host (the device holds only what the current layer needs):
- the residual stream (saved layer inputs), fetched back one layer ahead in the backward pass;
- the optimizer state: each layer's slice comes in, is updated, and goes back;
- the frozen layer stack (`memory.base: host`): layer l+1's slice is brought over while layer l
  computes (`scan_layers`, and the backward loop's own prefetch), so the device holds two layers
  of the base and never the stack;
- the token-embedding table (when frozen): only the rows a batch uses, or the vocabulary chunk the
  LM head is at, come to the device.

Slicing and gathering host arrays run on the host (`compute_on("device_host")`), so the device
never holds a whole host-resident stack. On a GPU XLA turns the `device_put`s into asynchronous
copies; on CPU host and device are the same RAM, and the placement shows only in the program
(memory kinds in the jaxpr), which is what CPU tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device


def on_host(x) -> bool:
    """Whether an array (or tracer) is in host memory."""
    return jax.typeof(x).memory_space == HOST


def to_host(tree):
    """Move every leaf of a pytree to pinned host memory (inside jit: a device-to-host copy)."""
    return jax.tree.map(lambda leaf: jax.device_put(leaf, HOST), tree)


def to_device(tree):
    """Move every leaf of a pytree to device memory (inside jit: a host-to-device copy)."""
    return jax.tree.map(lambda leaf: jax.device_put(leaf, DEVICE), tree)


def host_slice(tree, index):
    """Slice `index` of every host-resident stack, taken on the host, brought to the device."""

    def one(leaf):
        if not on_host(leaf):
            return jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)
        with compute_on("device_host"):
            part = jax.lax.dynamic_index_in_dim(leaf, jax.device_put(index, HOST), keepdims=False)
        return jax.device_put(part, DEVICE)

    return jax.tree.map(one, tree)


def has_host_leaves(tree) -> bool:
    """Whether any leaf of a pytree is in host memory."""
    return any(on_host(leaf) for leaf in jax.tree.leaves(tree))


def scan_layers(body, init, layers, xs, length: int):
    """`jax.lax.scan(body, init, (layers, xs))` over `length` stacked layers, where the leaves of
    `layers` that live in pinned host memory are brought to the device one layer ahead.

    Layer l+1's slice of every host-resident stack is taken on the host and copied over while
    layer l computes (it rides in the scan's carry: double buffering), so the device holds two
    layers of those stacks, never a stack. Without host leaves this is exactly the plain scan.
    `body(carry, (layer, x)) -> (carry, y)` sees each layer's slices on the device either way.
    """
    if not has_host_leaves(layers):
        return jax.lax.scan(body, init, (layers, xs))
    leaves, treedef = jax.tree.flatten(layers)
    resident = [on_host(leaf) for leaf in leaves]
    host_stacks = [leaf for leaf, host in zip(leaves, resident, strict=True) if host]
    device_stacks = [leaf for leaf, host in zip(leaves, resident, strict=True) if not host]

    def layer_of(device_slices, host_slices):
        device_slices, host_slices = iter(device_slices), iter(host_slices)
        return jax.tree.unflatten(
            treedef, [next(host_slices) if host else next(device_slices) for host in resident]
        )

    def step(carry, per_layer):
        inner, current = carry
        device_slices, x, index = per_layer
        upcoming = host_slice(host_stacks, jnp.minimum(index + 1, length - 1))
        inner, y = body(inner, (layer_of(device_slices, current), x))
        return (inner, upcoming), y

    first = host_slice(host_stacks, jnp.int32(0))
    (carry, _), ys = jax.lax.scan(
        step, (init, first), (device_stacks, xs, jnp.arange(length, dtype=jnp.int32))
    )
    return carry, ys


def host_write(tree, values, index):
    """Write `values` (on the device) into slice `index` of every stack, in its own memory."""

    def one(leaf, value):
        if not on_host(leaf):
            return jax.lax.dynamic_update_index_in_dim(leaf, value, index, 0)
        value = jax.device_put(value, HOST)
        with compute_on("device_host"):
            return jax.lax.dynamic_update_index_in_dim(leaf, value, jax.device_put(index, HOST), 0)

    return jax.tree.map(one, tree, values)


def host_rows(table: jax.Array, row_ids: jax.Array) -> jax.Array:
    """Rows `row_ids` of a host-resident [V, D] table, gathered on the host, on the device.

    The ids must be in range (token ids are validated before the step; vocabulary chunks clamp).
    """
    ids = jax.device_put(row_ids, HOST)
    with compute_on("device_host"):
        rows = table.at[ids].get(mode="promise_in_bounds")
    return jax.device_put(rows, DEVICE)


def host_row_slice(leaf, start, size: int):
    """Rows [start, start + size) of a host-resident array, taken on the host, on the device."""
    with compute_on("device_host"):
        part = jax.lax.dynamic_slice_in_dim(leaf, jax.device_put(start, HOST), size, 0)
    return jax.device_put(part, DEVICE)


def host_row_write(leaf, value, start):
    """`value` (on the device) written into a host-resident array from row `start`, on the host."""
    value = jax.device_put(value, HOST)
    with compute_on("device_host"):
        return jax.lax.dynamic_update_slice_in_dim(leaf, value, jax.device_put(start, HOST), 0)


def host_sharding() -> jax.sharding.SingleDeviceSharding:
    """Pinned host memory of the default device: where host-resident arrays are put."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def abstract_on_host(tree):
    """Abstract shapes (`jax.ShapeDtypeStruct`) of `tree` placed in pinned host memory, for
    compiling a step on abstract arguments as it will run with host-resident state."""
    sharding = host_sharding()
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_resident_bytes(tree, shardings) -> int:
    """Bytes of the leaves of `tree` whose sharding (a matching tree) places them on the host."""
    leaves, layouts = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf, layout in zip(leaves, layouts, strict=True)
        if getattr(layout, "memory_kind", None) == "pinned_host"
    )
