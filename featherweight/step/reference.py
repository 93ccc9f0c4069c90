"""The reference train step: `jax.value_and_grad` of the whole model, then any optax update.

Plain and obviously right; every streamed variant is tested against it. Only the trainable pytree
is differentiated: the frozen base is a separate argument, closed over as a constant, so no zero
gradient is ever built for it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from featherweight.models.config import ModelConfig
from featherweight.models.llama import (
    LoraSpec,
    Params,
    attention_inputs,
    embed,
    merge_params,
    run_layers,
)
from featherweight.step.loss import Batch, head_loss
from featherweight.step.validate import check_optimizer

HEAD_KEYS = ("final_norm", "lm_head", "embed")


def layer_dropout_keys(key: jax.Array | None, lora: LoraSpec | None, num_layers: int):
    """One dropout key per layer when LoRA dropout is on, else None."""
    if key is None or lora is None or lora.dropout <= 0.0:
        return None
    return jax.random.split(key, num_layers)


def model_loss(
    trainable: Params,
    frozen: Params,
    batch: Batch,
    config: ModelConfig,
    lora: LoraSpec | None = None,
    key: jax.Array | None = None,
    chunk_size: int | None = None,
    remat: bool = True,
    vocab_chunk: int | None = None,
    mlp_chunk: int | None = None,
) -> jax.Array:
    """Mean next-token cross-entropy of the model given by frozen + trainable parameters."""
    params = merge_params(frozen, trainable)
    inputs = attention_inputs(config, batch.positions, batch.segment_ids)
    hidden = run_layers(
        params["layers"],
        embed(params, batch.input_ids),
        inputs,
        config,
        lora,
        remat=remat,
        dropout_keys=layer_dropout_keys(key, lora, config.num_layers),
        mlp_chunk=mlp_chunk,
    )
    head_params = {name: params[name] for name in HEAD_KEYS if name in params}
    return head_loss(head_params, hidden, batch, config, chunk_size, vocab_chunk)


def build_reference_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    lora: LoraSpec | None = None,
    chunk_size: int | None = None,
    remat: bool = True,
    donate: bool = True,
    shardings: Any = None,
) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """A jitted `step(trainable, opt_state, frozen, batch, key) -> (trainable, opt_state, metrics)`.

    `trainable` and `opt_state` are donated: the caller must use the returned ones. `shardings`
    (`featherweight.parallel.sharding.StepShardings`) compiles for a device mesh; None for one device.
    """
    check_optimizer(optimizer)

    def step(trainable, opt_state, frozen, batch, key):
        loss, grads = jax.value_and_grad(model_loss)(
            trainable, frozen, batch, config, lora, key, chunk_size, remat
        )
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics = {
            "loss": loss,
            "tokens": jnp.sum(batch.loss_mask),
            "params_finite": all_finite(trainable),
        }
        return trainable, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1) if donate else (), **jit_shardings(shardings))


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


def jit_shardings(shardings: Any) -> dict[str, Any]:
    """`jax.jit`'s in/out shardings of a step on a mesh (`StepShardings`); none for one device."""
    if shardings is None:
        return {}
    return {"in_shardings": shardings.inputs, "out_shardings": shardings.outputs}
