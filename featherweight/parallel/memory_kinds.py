"""Host memory inside a jitted step: what stays in pinned host memory, and how slices of it move.

Four things may live on the host (the device holds only what the current layer needs):
- the residual stream (saved layer inputs), fetched back one layer ahead in the backward pass;
- the optimizer state: each layer's slice comes in, is updated, and its new slice goes back;
- the frozen layer stack (`memory.base: host`): layer l+1's slice is brought over while layer l
  computes (`scan_layers`, and the backward loop's own prefetch), so the device holds two layers
  of the base and never the stack;
- the token-embedding table: it streams over in row chunks (`host_table_rows`), and a tied
  table's LM head reads it one vocabulary chunk at a time.

Every function here keeps to the host-offload rules of XLA's GPU compiler
(`parallel/offload_rules.py` checks them): a host value is only ever sliced and then moved to the
device, and a new host array is only ever built from slices moved to the host as the per-step
outputs of a loop (XLA then allocates it in host memory); nothing computes on it in host memory. (Gathers, adds and compares on host arrays, even inside
`compute_on("device_host")`, fail to compile on a GPU: XLA error E1200.) On a GPU XLA turns the
moves into asynchronous copies; on CPU host and device are the same RAM, and the placement shows
only in the program (memory kinds in the jaxpr and the StableHLO), which is what CPU tests check.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

HOST = jax.memory.Space.Host
DEVICE = jax.memory.Space.Device
HOST_TABLE_CHUNK = 8192  # rows of a host-resident [V, D] table brought over at a time


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
    """Slice `index` (of the leading axis) of every stack, on the device: a host-resident stack's
    slice is cut out of host memory and copied over, the only way XLA reads a host array."""

    def one(leaf):
        part = jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False)
        return jax.device_put(part, DEVICE) if on_host(leaf) else part

    return jax.tree.map(one, tree)


def placed_like(tree, reference):
    """`tree` with each leaf in the memory of the matching leaf of `reference` (a step's new
    parameters and state where the old ones were): a host leaf's output must be declared in
    host memory, or XLA refuses the program (error E1200)."""
    return jax.tree.map(
        lambda leaf, old: (
            jax.device_put(leaf, HOST) if on_host(old) and not on_host(leaf) else leaf
        ),
        tree,
        reference,
    )


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
        with jax.named_scope("layer_fetch"):
            upcoming = host_slice(host_stacks, jnp.minimum(index + 1, length - 1))
        inner, y = body(inner, (layer_of(device_slices, current), x))
        return (inner, upcoming), y

    first = host_slice(host_stacks, jnp.int32(0))
    (carry, _), ys = jax.lax.scan(
        step, (init, first), (device_stacks, xs, jnp.arange(length, dtype=jnp.int32))
    )
    return carry, ys


def host_row_slice(leaf, start, size: int):
    """Rows [start, start + size) of a host-resident array, cut out on the host, on the device."""
    return jax.device_put(jax.lax.dynamic_slice_in_dim(leaf, start, size, 0), DEVICE)


def table_chunk(vocab: int, target: int = HOST_TABLE_CHUNK) -> int:
    """Rows per chunk when a [V, D] host table streams over: the size of the fewest equal chunks
    of at most `target` rows when V divides evenly, else `target` (the last chunk then starts at
    V - chunk and re-reads a few rows, which `host_table_rows` counts once)."""
    if vocab <= target:
        return vocab
    count = -(-vocab // target)
    for tries in range(count, 2 * count + 1):
        if vocab % tries == 0:
            return vocab // tries
    return target


def host_table_rows(table: jax.Array, row_ids: jax.Array, chunk: int | None = None) -> jax.Array:
    """Rows `row_ids` [...] of a host-resident [V, D] table, on the device: [..., D].

    XLA cannot gather from host memory, so the table streams over `chunk` rows at a time (the
    next chunk copied while the current one is read) and each chunk gives the rows whose ids fall
    in it: the device holds two chunks and the result (a table of one chunk: that chunk), and
    the whole table crosses the host link once. Ids must be in range (token ids are validated
    before the step).
    """
    vocab = table.shape[0]
    chunk = min(chunk or table_chunk(vocab), vocab)
    count = -(-vocab // chunk)
    if count == 1:  # a table of one chunk comes over whole, once
        return jnp.take(jax.device_put(table, DEVICE), row_ids, axis=0)

    def rows_of(index):
        return host_row_slice(table, jnp.minimum(index * chunk, vocab - chunk), chunk)

    def step(carry, index):
        rows, current = carry
        upcoming = rows_of(jnp.minimum(index + 1, count - 1))
        first = index * chunk
        start = jnp.minimum(first, vocab - chunk)
        local = row_ids - start
        mine = (row_ids >= first) & (row_ids < first + chunk)
        picked = jnp.take(current, jnp.clip(local, 0, chunk - 1), axis=0)
        rows = jnp.where(mine[..., None], picked, rows)
        return (rows, upcoming), None

    start = jnp.zeros((*row_ids.shape, table.shape[1]), table.dtype)
    (rows, _), _ = jax.lax.scan(step, (start, rows_of(0)), jnp.arange(count))
    return rows


def host_sharding() -> jax.sharding.SingleDeviceSharding:
    """Pinned host memory of the default device: where host-resident arrays are put."""
    return jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def abstract_on_host(tree):
    """Abstract shapes (`jax.ShapeDtypeStruct`) of `tree` placed in pinned host memory, for
    compiling a step on abstract arguments as it will run with host-resident state.

    The sharding is a `NamedSharding` over the default device: only a named sharding carries its
    memory kind into the traced type (`jax.typeof(x).memory_space`), so the step is traced with
    the host code paths it runs with real host arrays."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("host",))
    sharding = jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec(), memory_kind="pinned_host"
    )
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def host_resident_bytes(tree, shardings) -> int:
    """Bytes of the leaves of `tree` whose sharding (a matching tree) places them on the host."""
    leaves, layouts = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(
        leaf.size * leaf.dtype.itemsize
        for leaf, layout in zip(leaves, layouts, strict=True)
        if getattr(layout, "memory_kind", None) == "pinned_host"
    )
