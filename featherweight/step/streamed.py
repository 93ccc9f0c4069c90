"""The layer-streamed train step: the optimizer runs inside the backward pass, one layer at a time.

No `jax.grad` of the whole model. The step is, in one jitted and donated program:

1. forward: scan the block over the stacked layers, keeping each layer's input (the residual
   stream) -- on device or in pinned host memory -- and any intermediates the policy saves;
2. head: value and VJP of final norm + LM head + chunked cross-entropy; the head's parameters are
   updated at once;
3. backward: a `fori_loop` from the last layer to the first. Layer l's saved input comes back (the
   next one is fetched while l computes), its VJP is rebuilt (remat), and its gradient goes straight
   into the optimizer on layer l's slice of the optimizer state; parameters and state are written
   back in place (dynamic-update-slice on the donated stacks). The gradient is then dropped: the
   full gradient pytree never exists -- at most one layer's gradient is alive;
4. embedding: the input cotangent is scattered into the embedding gradient (tied embeddings add the
   head's contribution first) and the embedding is updated once.

Frozen weights (bf16 or NF4) are closed over in every VJP, so no gradient of them is ever built.

Any optax `GradientTransformation` works, applied per layer (its state is initialised per layer and
stacked). Transformations that need a global view see one layer at a time: `clip_by_global_norm`
becomes per-layer clipping here (see `per_layer_clipping`). Gradient accumulation over micro-batches
needs a full gradient buffer and is refused; use the reference step for it.

Each per-layer update sits in a `lax.cond` on the loss being finite. Besides skipping the update of
a diverged step, the branch boundary keeps XLA from fusing the optimizer arithmetic into the
in-place updates of the stacks (which made it copy every optimizer-state stack, 3x the weights of
temp memory with Adam).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from featherweight.errors import StepConfigError
from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params, attention_inputs, embed, merge_params
from featherweight.parallel.memory_kinds import (
    host_row_slice,
    host_row_write,
    host_slice,
    host_write,
    on_host,
    to_device,
    to_host,
)
from featherweight.step.layer_grad import layer_forward, layer_vjp
from featherweight.step.loss import Batch, head_loss
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import all_finite, jit_shardings, layer_dropout_keys
from featherweight.step.validate import check_optimizer

HEAD_GROUP = ("final_norm", "lm_head")


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


def per_layer_clipping(max_norm: float) -> optax.GradientTransformation:
    """Gradient clipping for the streamed step: each layer's gradient (and the head's, and the
    embedding's) is clipped to `max_norm` on its own. Global-norm clipping would need every
    gradient before any update, which is what the streamed step avoids."""
    return optax.clip_by_global_norm(max_norm)


def init_streamed_opt_state(
    optimizer: optax.GradientTransformation, trainable: Params
) -> StreamedOptState:
    """The optimizer state the streamed step expects for `trainable`."""
    check_optimizer(optimizer)
    layer_leaves = jax.tree.leaves(trainable.get("layers") or {})
    return StreamedOptState(
        layers=tuple(jax.vmap(optimizer.init)(leaf) for leaf in layer_leaves),
        top={name: optimizer.init(value) for name, value in trainable.items() if name != "layers"},
    )


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


def place_opt_state(state: StreamedOptState, placement: str) -> StreamedOptState:
    """The optimizer state in "device" or (pinned) "host" memory.

    On the host, the streamed step brings each layer's slice of each tensor's state to the device
    for that tensor's update and writes it back (the slicing runs on the host); the head's and
    embedding's states come over in row chunks (elementwise optimizers) or whole: the device holds
    one tensor's (or chunk's) state at a time instead of all of it. Works for any optax
    transformation.
    """
    if placement == "device":
        return state
    if placement != "host":
        raise StepConfigError(f"optimizer state placement {placement!r}: use 'device' or 'host'")
    return jax.tree.map(lambda leaf: jax.device_put(leaf, jax.memory.Space.Host), state)


def _refuse_accumulation(optimizer, trainable: Params, accumulation_steps: int) -> None:
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
    if accumulation_steps > 1 or wraps_multisteps:
        raise StepConfigError(
            "gradient accumulation over micro-batches needs a full gradient buffer, which the "
            "streamed (fused-update) step never builds; use micro_batch = batch with the streamed "
            "step, or build_reference_step with optax.MultiSteps"
        )


def _check_uniform_layers(frozen: Params, trainable: Params, num_layers: int) -> None:
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


def _slice(tree, index):
    return jax.tree.map(
        lambda leaf: jax.lax.dynamic_index_in_dim(leaf, index, keepdims=False), tree
    )


def _squared_norm(tree) -> jax.Array:
    return sum(
        (jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)),
        jnp.float32(0),
    )


def _guarded_update(optimizer, ok, grads, state, params):
    """Apply the optimizer when `ok` (the loss is finite), else keep params and state as they are."""

    def apply(grads, state, params):
        updates, new_state = optimizer.update(grads, state, params)
        new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, state)
        return optax.apply_updates(params, updates), new_state

    def keep(grads, state, params):
        return params, state

    return jax.lax.cond(ok, apply, keep, grads, state, params)


def _residual_store(placement: str) -> tuple[Callable, Callable]:
    """(put, fetch) moving a saved activation to its placement and back to the device."""
    if placement == "host":
        return (
            lambda x: jax.device_put(x, jax.memory.Space.Host),
            lambda x: jax.device_put(x, jax.memory.Space.Device),
        )
    return (lambda x: x), (lambda x: x)


def activation_constraint(shardings: Any) -> Callable[[jax.Array], jax.Array]:
    """Pins an activation [B, ...] to the batch layout of `shardings` (identity without a mesh)."""
    if shardings is None:
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, shardings.activations)


def build_streamed_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    trainable: Params,
    frozen: Params,
    lora: LoraSpec | None = None,
    policy: MemoryPolicy | None = None,
    accumulation_steps: int = 1,
    donate: bool = True,
    shardings: Any = None,
) -> Callable[..., tuple[Params, StreamedOptState, dict[str, jax.Array]]]:
    """A jitted `step(trainable, opt_state, frozen, batch, key) -> (trainable, opt_state, metrics)`.

    `trainable` and `frozen` (arrays or abstract shapes) fix the structure; `trainable` and
    `opt_state` are donated, so the caller keeps exactly one copy (the returned one). Works for
    full fine-tuning (trainable = all parameters), LoRA (trainable = adapters) and QLoRA (LoRA
    over an NF4 frozen base). `shardings` (`featherweight.parallel.sharding.StepShardings`) compiles for a
    device mesh: the arguments and results keep their layouts, and the residual stream and its
    cotangent stay split over the batch (so XLA gathers each layer's weights, FSDP-style, rather
    than resharding activations); None compiles for one device.
    """
    policy = policy or MemoryPolicy()
    check_optimizer(optimizer)
    _refuse_accumulation(optimizer, trainable, accumulation_steps)
    _check_uniform_layers(frozen, trainable, config.num_layers)
    put, fetch = _residual_store(policy.residuals)
    num_layers = config.num_layers
    constrain = activation_constraint(shardings)

    def update_tensor(ok, grad, state, param):
        return _guarded_update(optimizer, ok, grad, state, param)

    def row_chunked_update(ok, grad_rows, state, param, chunk):
        """Update `param` [V, D] `chunk` rows at a time; `grad_rows(start)` gives the gradient of
        rows [start, start + chunk). Parameter and row-shaped state leaves may be on the host
        (their rows come over and go back); scalar leaves (step counts) come out the same from
        every chunk, so the last chunk's are kept. Elementwise optimizers only."""
        leaves, treedef = jax.tree.flatten(state)
        row_shaped = [leaf.shape == param.shape for leaf in leaves]

        def rows(leaf, start):
            if on_host(leaf):
                return host_row_slice(leaf, start, chunk)
            return jax.lax.dynamic_slice_in_dim(leaf, start, chunk)

        def write(leaf, value, start):
            if on_host(leaf):
                return host_row_write(leaf, value, start)
            return jax.lax.dynamic_update_slice_in_dim(leaf, value, start, 0)

        def chunk_update(index, carry):
            param, state_leaves, _, grad_sq = carry
            start = index * chunk
            part = [
                rows(leaf, start) if r else to_device(leaf)
                for leaf, r in zip(state_leaves, row_shaped)
            ]
            grad = grad_rows(start)
            new_param, new_state = update_tensor(
                ok, grad, jax.tree.unflatten(treedef, part), rows(param, start)
            )
            new_leaves = jax.tree.leaves(new_state)
            written = [
                write(leaf, new, start) if r else leaf
                for leaf, new, r in zip(state_leaves, new_leaves, row_shaped)
            ]
            scalars = [new for new, r in zip(new_leaves, row_shaped) if not r]
            return write(param, new_param, start), written, scalars, grad_sq + _squared_norm(grad)

        scalars = [to_device(leaf) for leaf, r in zip(leaves, row_shaped) if not r]
        param, leaves_out, scalars, grad_sq = jax.lax.fori_loop(
            0,
            param.shape[0] // chunk,
            chunk_update,
            (param, leaves, scalars, jnp.float32(0)),
        )
        scalars = iter(scalars)
        merged = [
            leaf if r else (to_host(next(scalars)) if on_host(old) else next(scalars))
            for leaf, old, r in zip(leaves_out, leaves, row_shaped)
        ]
        return param, jax.tree.unflatten(treedef, merged), grad_sq

    def row_chunkable(state, param) -> bool:
        return all(leaf.shape == param.shape or leaf.ndim == 0 for leaf in jax.tree.leaves(state))

    def update_top(ok, grad, state, param):
        """A head or embedding update. A host-resident state comes over in row chunks (elementwise
        optimizers: every state leaf has the parameter's shape, or is a scalar), else whole."""
        leaves, treedef = jax.tree.flatten(state)
        if not any(on_host(leaf) for leaf in leaves):
            return update_tensor(ok, grad, state, param)
        chunk = top_row_chunk(param.shape, policy.vocab_chunk or TOP_ROW_CHUNK)
        if chunk is None or not row_chunkable(state, param):
            param, new_state = update_tensor(ok, grad, to_device(state), param)
            new_leaves = jax.tree.leaves(new_state)
            placed = [to_host(n) if on_host(o) else n for n, o in zip(new_leaves, leaves)]
            return param, jax.tree.unflatten(treedef, placed)

        def grad_rows(start):
            return jax.lax.dynamic_slice_in_dim(grad, start, chunk)

        param, new_state, _ = row_chunked_update(ok, grad_rows, state, param, chunk)
        return param, new_state

    def update_host_table(ok, token_ids, cotangent, state, table):
        """Update an embedding table kept in host memory, chunk by chunk: each chunk's gradient
        is the batch's input cotangent rows that fall in it (zero elsewhere), so no [V, D]
        gradient and no whole table or state ever sits on the device. Returns the new table,
        state and the squared gradient norm."""
        if not row_chunkable(state, table):
            raise StepConfigError(
                "an embedding trained in host memory is updated in row chunks, which needs an "
                "elementwise optimizer (adamw, sgd, lion); use one, or memory.embed: device"
            )
        rows, width = table.shape
        chunk = top_row_chunk(table.shape, policy.vocab_chunk or TOP_ROW_CHUNK) or rows
        flat_ids = token_ids.reshape(-1)
        flat_cotangent = cotangent.reshape(-1, width).astype(table.dtype)

        def grad_rows(start):
            local = flat_ids - start
            local = jnp.where((local >= 0) & (local < chunk), local, chunk)  # chunk: dropped
            grad = jnp.zeros((chunk, width), table.dtype)
            return grad.at[local].add(flat_cotangent, mode="drop")

        return row_chunked_update(ok, grad_rows, state, table, chunk)

    def step(trainable, opt_state: StreamedOptState, frozen, batch: Batch, key):
        top = merge_params(frozen, trainable)
        inputs = attention_inputs(config, batch.positions, batch.segment_ids)
        keys = layer_dropout_keys(key, lora, num_layers)
        frozen_layers = frozen.get("layers", {})
        trainable_layers = trainable.get("layers", {})
        layer_stacks, layer_treedef = jax.tree.flatten(trainable_layers)

        # 1. forward: keep each layer's input (and saved intermediates) at the policy's placement
        def forward_layer(x, per_layer):
            frozen_l, trainable_l, key_l = per_layer
            x = constrain(x)
            y, saved = layer_forward(
                frozen_l, trainable_l, x, inputs, config, lora, key_l, policy.save, policy.mlp_chunk
            )
            return y, jax.tree.map(put, (x, saved))

        hidden, stored = jax.lax.scan(
            forward_layer, embed(top, batch.input_ids), (frozen_layers, trainable_layers, keys)
        )

        # 2. head: loss and its VJP; the head's own parameters are updated right away
        tied = ("embed",) if config.tie_word_embeddings else ()  # the table is the head
        head_names = [name for name in (*HEAD_GROUP, *tied) if name in top]
        head_trainable = {name: trainable[name] for name in head_names if name in trainable}
        head_frozen = {name: top[name] for name in head_names if name not in trainable}

        def head_fn(head_params, h):
            return head_loss(
                {**head_frozen, **head_params},
                h,
                batch,
                config,
                policy.loss_chunk,
                policy.vocab_chunk,
            )

        loss, head_vjp = jax.vjp(head_fn, head_trainable, constrain(hidden))
        head_grads, cotangent = head_vjp(jnp.ones((), loss.dtype))
        ok = jnp.isfinite(loss)
        new_trainable, new_top_state = dict(trainable), dict(opt_state.top)
        for name in HEAD_GROUP:
            if name in trainable:
                new_trainable[name], new_top_state[name] = update_top(
                    ok, head_grads[name], opt_state.top[name], trainable[name]
                )

        # 3. backward over the layers, last to first: VJP, then each tensor's update, in place
        def backward_layer(i, carry):
            cotangent, stacks, states, grad_sq, current = carry
            cotangent = constrain(cotangent)
            index = num_layers - 1 - i
            upcoming = jax.tree.map(fetch, _slice(stored, jnp.maximum(index - 1, 0)))
            x, saved = current
            trainable_l = jax.tree.unflatten(layer_treedef, [stack[index] for stack in stacks])
            grads, cotangent = layer_vjp(
                _slice(frozen_layers, index),
                trainable_l,
                x,
                saved,
                cotangent,
                inputs,
                config,
                lora,
                None if keys is None else keys[index],
                policy.mlp_chunk,
            )
            new_stacks, new_states = [], []
            for stack, state, grad in zip(stacks, states, jax.tree.leaves(grads), strict=True):
                param, state_l = update_tensor(ok, grad, host_slice(state, index), stack[index])
                new_stacks.append(jax.lax.dynamic_update_index_in_dim(stack, param, index, 0))
                new_states.append(host_write(state, state_l, index))
            return (
                cotangent,
                new_stacks,
                tuple(new_states),
                grad_sq + _squared_norm(grads),
                upcoming,
            )

        first = jax.tree.map(fetch, _slice(stored, num_layers - 1))
        cotangent, layer_stacks, layer_states, grad_sq, _ = jax.lax.fori_loop(
            0,
            num_layers,
            backward_layer,
            (cotangent, layer_stacks, opt_state.layers, _squared_norm(head_grads), first),
        )
        if trainable_layers:
            new_trainable["layers"] = jax.tree.unflatten(layer_treedef, layer_stacks)

        # 4. embedding: scatter the input cotangent (plus the tied head's gradient), update once
        if "embed" in trainable and on_host(trainable["embed"]) and config.tie_word_embeddings:
            raise StepConfigError(
                "a tied embedding is also the LM head, whose gradient covers every row; train it "
                "on the device (memory.embed: device), or freeze it (LoRA/QLoRA)"
            )
        if "embed" in trainable and on_host(trainable["embed"]):
            new_trainable["embed"], new_top_state["embed"], embed_sq = update_host_table(
                ok, batch.input_ids, cotangent, opt_state.top["embed"], trainable["embed"]
            )
            grad_sq = grad_sq + embed_sq
        elif "embed" in trainable:
            table = trainable["embed"]
            # tied: the head's gradient of the table is the buffer the input cotangent adds into
            embed_grad = head_grads.get("embed", jnp.zeros_like(table))
            embed_grad = embed_grad.at[batch.input_ids].add(cotangent.astype(table.dtype))
            grad_sq = (
                grad_sq - _squared_norm(head_grads.get("embed", {})) + _squared_norm(embed_grad)
            )
            new_trainable["embed"], new_top_state["embed"] = update_top(
                ok, embed_grad, opt_state.top["embed"], table
            )

        metrics = {
            "loss": loss,
            "tokens": jnp.sum(batch.loss_mask),
            "grad_norm": jnp.sqrt(grad_sq),
            "updated": ok,
            "params_finite": all_finite(new_trainable),
        }
        return new_trainable, StreamedOptState(layer_states, new_top_state), metrics

    return jax.jit(step, donate_argnums=(0, 1) if donate else (), **jit_shardings(shardings))
