"""Host memory inside a jitted step: what stays in pinned host memory, and how slices of it move.

Three things may live on the host (the device holds only what the current layer needs):
- the residual stream (saved layer inputs), fetched back one layer ahead in the backward pass;
- the optimizer state: each layer's slice comes in, is updated, and goes back;
- the token-embedding table (when frozen): only the rows a batch uses, or the vocabulary chunk the
  LM head is at, come to the device.

Slicing and gathering host arrays run on the host (`compute_on("device_host")`), so the device
never holds a whole host-resident stack. On a GPU XLA turns the `device_put`s into asynchronous
copies; on CPU host and device are the same RAM, and the placement shows only in the program
(memory kinds in the jaxpr), which is what CPU tests check.
"""

from __future__ import annotations

import jax
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


def abstract_on_host(tree):
    """Abstract shapes (`jax.ShapeDtypeStruct`) of `tree` placed in pinned host memory, for
    compiling a step on abstract arguments as it will run with host-resident state."""
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_resident_bytes(tree, shardings) -> int:
    """Bytes of the leaves of `tree` whose sharding (a matching tree) places them on the host."""
    leaves, layouts = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf, layout in zip(leaves, layouts, strict=True)
        if getattr(layout, "memory_kind", None) == "pinned_host"
    )
