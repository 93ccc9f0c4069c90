"""What both train steps share: the head's parameter names, finiteness, dropout keys, layouts.

The reference step (`reference.py`) and the layer-streamed step (`streamed.py`) import these, so
the two agree on which parameters form the head, what "finite" means and how a mesh is compiled.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec

HEAD_PARAMS = ("final_norm", "lm_head")  # what the LM head reads besides the hidden state


def head_param_names(config: ModelConfig) -> tuple[str, ...]:
    """The parameters the head and loss read: with tied embeddings the table is the LM head.

    This is the one place the tied-embedding rule starts from: a tied table gets a gradient from
    the head here and another from the input side (`top_update.embedding_update` adds them).
    """
    return (*HEAD_PARAMS, "embed") if config.tie_word_embeddings else HEAD_PARAMS


def layer_dropout_keys(key: jax.Array | None, lora: LoraSpec | None, num_layers: int):
    """One dropout key per layer when LoRA dropout is on, else None."""
    if key is None or lora is None or lora.dropout <= 0.0:
        return None
    return jax.random.split(key, num_layers)


def all_finite(tree) -> jax.Array:
    """Whether every value of every floating-point leaf is finite (one reduction per tensor).

    A finite loss does not make a finite update: an absurd learning rate can overflow the
    parameters themselves, and a checkpoint of them would not be a good one.
    """
    flags = [
        jnp.all(jnp.isfinite(leaf))
        for leaf in jax.tree.leaves(tree)
        if jnp.issubdtype(leaf.dtype, jnp.floating)
    ]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def squared_norm(tree) -> jax.Array:
    """The squared L2 norm of every leaf of `tree` together, in float32."""
    return sum(
        (jnp.sum(jnp.square(leaf.astype(jnp.float32))) for leaf in jax.tree.leaves(tree)),
        jnp.float32(0),
    )


def micro_batches(batch, count: int):
    """`batch` [B, ...] as `count` micro-batches [count, B / count, ...] (row order kept), for a
    scan that accumulates their gradients."""
    rows = batch.input_ids.shape[0]
    if rows % count:
        raise StepConfigError(
            f"batch of {rows} rows cannot be split into {count} equal micro-batches; use a "
            f"batch_size that is a multiple of accumulation_steps={count}"
        )
    return jax.tree.map(lambda x: x.reshape(count, rows // count, *x.shape[1:]), batch)


def clip_scale(grad_sq: jax.Array, max_norm: float) -> jax.Array:
    """The factor global-norm clipping multiplies every gradient by: 1 when the global norm
    sqrt(grad_sq) is below `max_norm`, else max_norm / norm (`optax.clip_by_global_norm`'s rule)."""
    norm = jnp.sqrt(grad_sq)
    return jnp.where(norm < max_norm, jnp.float32(1), max_norm / norm)


def scaled(grad: jax.Array, scale: jax.Array | None) -> jax.Array:
    """`grad` times a clipping scale (in float32, back in the gradient's dtype); None: as is."""
    if scale is None:
        return grad
    return (grad.astype(jnp.float32) * scale).astype(grad.dtype)


def jit_shardings(shardings: Any) -> dict[str, Any]:
    """`jax.jit`'s in/out shardings of a step on a mesh (`StepShardings`); none for one device."""
    if shardings is None:
        return {}
    return {"in_shardings": shardings.inputs, "out_shardings": shardings.outputs}


def activation_constraint(shardings: Any) -> Callable[[jax.Array], jax.Array]:
    """Pins an activation [B, ...] to the batch layout of `shardings` (identity without a mesh)."""
    if shardings is None:
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, shardings.activations)
