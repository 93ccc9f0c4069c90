"""Updates of the tensors outside the layer stack: the head (final norm, LM head) and the embedding.

Each is updated once per step, right after its gradient exists. A tensor whose optimizer state
lives in host memory is updated in row chunks (elementwise optimizers: every state leaf has the
parameter's shape, or is a scalar), so the device holds one chunk of its state at a time; an
embedding table trained in host memory builds each chunk's gradient from the batch's cotangent
rows that fall in it, so no [V, D] gradient, table or state is ever on the device.

Host-resident leaves obey XLA's host-offload rules (`parallel/offload_rules.py`): each chunk is
cut out of the old host array and copied over, and the updated chunk leaves the chunk loop as its
per-chunk output, copied back to the host, where XLA builds the new leaf -- never an add or an
in-place write computed on host memory, and never a whole-leaf buffer on the device. Host memory
therefore holds the old and the new leaf during the step (the old one is donated and freed after
it); device-resident leaves are updated in place.

The tied-embedding rule lives here (`embedding_update`): a tied table is also the LM head, so its
gradient is the head's gradient of it plus the scattered input cotangent, and it is updated once.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from featherweight.errors import StepConfigError
from featherweight.parallel.memory_kinds import (
    host_row_slice,
    on_host,
    to_device,
    to_host,
)
from featherweight.step.common import all_finite, scaled, squared_norm
from featherweight.step.opt_state import guarded_update

TOP_ROW_CHUNK = 8192  # rows of a host-state head/embedding updated at a time (vocab_chunk if set)


def top_row_chunk(shape: tuple[int, ...], target: int) -> int | None:
    """Rows per chunk for a row-chunked update of a [V, D] tensor: the size of the fewest equal
    chunks of at most `target` rows (None when the tensor is 1-D or fits in one chunk)."""
    if len(shape) < 2 or shape[0] <= target:
        return None
    count = -(-shape[0] // target)
    while shape[0] % count:
        count += 1
    return shape[0] // count


def row_chunkable(state, param) -> bool:
    """Whether `state` can be updated in row chunks of `param`: every leaf row-shaped or scalar."""
    return all(leaf.shape == param.shape or leaf.ndim == 0 for leaf in jax.tree.leaves(state))


def _rows(leaf, start, chunk: int):
    if on_host(leaf):
        return host_row_slice(leaf, start, chunk)
    return jax.lax.dynamic_slice_in_dim(leaf, start, chunk)


def row_chunked_update(
    optimizer: optax.GradientTransformation,
    ok: jax.Array,
    grad_rows: Callable[[jax.Array], jax.Array],
    state,
    param: jax.Array,
    chunk: int,
):
    """Update `param` [V, D] `chunk` rows at a time -> (param, state, squared gradient norm,
    whether every new row is finite: read from each chunk while it is on the device).

    `grad_rows(start)` gives the gradient of rows [start, start + chunk); `chunk` divides V.
    Parameter and row-shaped state leaves may be on the host: their rows are read from the old
    leaf and the new rows leave the scan as its per-chunk outputs, copied to the host (XLA builds
    the new leaf in host memory; the device holds a chunk of it at a time). Device leaves are
    read and written in place. Scalar leaves (step counts) come out the same from every chunk,
    so the last chunk's are kept.
    """
    leaves, treedef = jax.tree.flatten(state)
    row_shaped = [leaf.shape == param.shape for leaf in leaves]
    targets = [param, *(leaf for leaf, r in zip(leaves, row_shaped) if r)]
    hosts = [on_host(leaf) for leaf in targets]

    def chunk_update(carry, index):
        in_place, scalars, grad_sq, finite = carry
        start = index * chunk
        # a host leaf is read from its old array, a device leaf from the one updated in place
        current = [old if host else new for old, new, host in zip(targets, in_place, hosts)]
        row_states = iter(current[1:])
        part = [
            _rows(next(row_states), start, chunk) if r else to_device(leaf)
            for leaf, r in zip(leaves, row_shaped)
        ]
        grad = grad_rows(start)
        new_param, new_state = guarded_update(
            optimizer, ok, grad, jax.tree.unflatten(treedef, part), _rows(current[0], start, chunk)
        )
        new_leaves = jax.tree.leaves(new_state)
        new_rows = [new_param, *(new for new, r in zip(new_leaves, row_shaped) if r)]
        in_place = [
            buffer if host else jax.lax.dynamic_update_slice_in_dim(buffer, rows, start, 0)
            for buffer, rows, host in zip(in_place, new_rows, hosts)
        ]
        outputs = [to_host(rows) if host else None for rows, host in zip(new_rows, hosts)]
        scalars = [new for new, r in zip(new_leaves, row_shaped) if not r]
        finite = finite & all_finite(new_param)
        return (in_place, scalars, grad_sq + squared_norm(grad), finite), outputs

    start = [None if host else leaf for leaf, host in zip(targets, hosts)]
    scalars = [to_device(leaf) for leaf, r in zip(leaves, row_shaped) if not r]
    (in_place, scalars, grad_sq, finite), outputs = jax.lax.scan(
        chunk_update,
        (start, scalars, jnp.float32(0), jnp.bool_(True)),
        jnp.arange(param.shape[0] // chunk),
    )
    written = [
        out.reshape(leaf.shape) if host else new
        for leaf, new, out, host in zip(targets, in_place, outputs, hosts)
    ]
    row_leaves, scalars = iter(written[1:]), iter(scalars)
    merged = [
        next(row_leaves) if r else (to_host(next(scalars)) if on_host(old) else next(scalars))
        for old, r in zip(leaves, row_shaped)
    ]
    return written[0], jax.tree.unflatten(treedef, merged), grad_sq, finite


def top_update(optimizer, ok, grad, state, param, vocab_chunk: int | None):
    """A head or embedding update -> (param, state): whole, or in row chunks when its state is on
    the host and the optimizer is elementwise (else the state comes over whole)."""
    leaves, treedef = jax.tree.flatten(state)
    if not any(on_host(leaf) for leaf in leaves):
        return guarded_update(optimizer, ok, grad, state, param)
    chunk = top_row_chunk(param.shape, vocab_chunk or TOP_ROW_CHUNK)
    if chunk is None or not row_chunkable(state, param):
        param, new_state = guarded_update(optimizer, ok, grad, to_device(state), param)
        placed = [
            to_host(n) if on_host(o) else n for n, o in zip(jax.tree.leaves(new_state), leaves)
        ]
        return param, jax.tree.unflatten(treedef, placed)
    param, new_state, _, _ = row_chunked_update(
        optimizer,
        ok,
        lambda start: jax.lax.dynamic_slice_in_dim(grad, start, chunk),
        state,
        param,
        chunk,
    )
    return param, new_state


def host_table_update(optimizer, ok, token_ids, cotangent, state, table, vocab_chunk: int | None):
    """Update an embedding table kept in host memory, chunk by chunk -> (table, state, grad²,
    finite).

    Each chunk's gradient is the batch's input cotangent rows that fall in it (zero elsewhere).
    """
    if not row_chunkable(state, table):
        raise StepConfigError(
            "an embedding trained in host memory is updated in row chunks, which needs an "
            "elementwise optimizer (adamw, sgd, lion); use one, or memory.embed: device"
        )
    rows, width = table.shape
    chunk = top_row_chunk(table.shape, vocab_chunk or TOP_ROW_CHUNK) or rows
    flat_ids = token_ids.reshape(-1)
    flat_cotangent = cotangent.reshape(-1, width).astype(table.dtype)

    def grad_rows(start):
        local = flat_ids - start
        local = jnp.where((local >= 0) & (local < chunk), local, chunk)  # chunk: dropped
        grad = jnp.zeros((chunk, width), table.dtype)
        return grad.at[local].add(flat_cotangent, mode="drop")

    return row_chunked_update(optimizer, ok, grad_rows, state, table, chunk)


def embedding_gradient(token_ids, cotangent, head_grads, table) -> jax.Array:
    """The embedding's dense gradient [V, D]: the input cotangent [B, S, D] scattered into the
    rows the batch used, plus -- when the table is tied -- the head's gradient of it
    (`head_grads["embed"]`, the buffer the scatter adds into)."""
    embed_grad = head_grads["embed"] if "embed" in head_grads else jnp.zeros_like(table)
    return embed_grad.at[token_ids].add(cotangent.astype(table.dtype))


def embedding_squared_norm(token_ids, cotangent, head_grads, table) -> jax.Array:
    """The squared norm of `embedding_gradient`, without a [V, D] buffer when the table is untied:
    the cotangent rows are summed per distinct token id ([B x S, D] at most), which is the
    gradient's non-zero rows. (Tied: the head's gradient covers every row, so it is dense.)"""
    if "embed" in head_grads:
        return squared_norm(embedding_gradient(token_ids, cotangent, head_grads, table))
    flat_ids = token_ids.reshape(-1)
    _, inverse = jnp.unique(flat_ids, return_inverse=True, size=flat_ids.size)
    rows = jax.ops.segment_sum(
        cotangent.reshape(flat_ids.size, -1).astype(table.dtype),
        inverse.reshape(-1),
        num_segments=flat_ids.size,
    )
    return squared_norm(rows)


def embedding_update(
    optimizer, ok, token_ids, cotangent, head_grads, state, table, vocab_chunk, scale=None
):
    """The embedding's one update -> (table, state, squared norm of its whole gradient, whether
    the new table is finite).

    Its gradient is `embedding_gradient` (times `scale`, the global clip, when given). A table in
    host memory is updated chunk by chunk (and checked finite chunk by chunk: nothing may compute
    on it in host memory); a tied one cannot be (the head's gradient covers every row).
    """
    tied = "embed" in head_grads
    if on_host(table):
        if tied:
            raise StepConfigError(
                "a tied embedding is also the LM head, whose gradient covers every row; train it "
                "on the device (memory.embed: device), or freeze it (LoRA/QLoRA)"
            )
        return host_table_update(
            optimizer, ok, token_ids, scaled(cotangent, scale), state, table, vocab_chunk
        )
    embed_grad = embedding_gradient(token_ids, cotangent, head_grads, table)
    new_table, new_state = top_update(
        optimizer, ok, scaled(embed_grad, scale), state, table, vocab_chunk
    )
    return new_table, new_state, squared_norm(embed_grad), all_finite(new_table)
