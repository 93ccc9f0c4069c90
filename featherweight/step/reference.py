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

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import DEFAULT_PACKED_SLOTS
from featherweight.models.llama import (
    LoraSpec,
    Params,
    attention_inputs,
    embed,
    head,
    merge_params,
    run_layers,
    run_layers_with_router,
)
from featherweight.step.common import (
    all_finite,
    head_param_names,
    jit_shardings,
    layer_dropout_keys,
    micro_batches,
    squared_norm,
)
from featherweight.step.loss import head_loss, token_nll
from featherweight.step.objective import Objective, check_objective
from featherweight.step.router_loss import (
    check_router_loss,
    load_balancing_loss_of_layers,
    router_mask,
)
from featherweight.step.validate import check_optimizer


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
    attention: str = "blockwise",
    packed_slots: int = DEFAULT_PACKED_SLOTS,
) -> jax.Array:
    """Mean next-token cross-entropy of the model given by frozen + trainable parameters, with
    the `attention` implementation (cuDNN's packed layout of `packed_slots` documents a row)."""
    return model_loss_terms(
        trainable, frozen, batch, config, lora, key, chunk_size, remat, vocab_chunk, mlp_chunk,
        attention, packed_slots,
    )[0]  # fmt: skip


def model_loss_terms(
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
    attention: str = "blockwise",
    packed_slots: int = DEFAULT_PACKED_SLOTS,
) -> tuple[jax.Array, jax.Array | None]:
    """(`model_loss`, the router's load-balancing loss of every layer's routing over the real
    tokens -- `router_loss.py`; None for a dense model)."""
    params = merge_params(frozen, trainable)
    inputs = attention_inputs(config, batch.positions, batch.segment_ids, attention, packed_slots)
    hidden, logits = run_layers_with_router(
        params["layers"],
        embed(params, batch.input_ids, config),
        inputs,
        config,
        lora,
        remat=remat,
        dropout_keys=layer_dropout_keys(key, lora, config.num_layers),
        mlp_chunk=mlp_chunk,
    )
    head_params = {name: params[name] for name in head_param_names(config) if name in params}
    loss = head_loss(head_params, hidden, batch, config, chunk_size, vocab_chunk)
    if logits is None:
        return loss, None
    aux = load_balancing_loss_of_layers(logits, router_mask(batch), config.experts_per_token)
    return loss, aux


def _token_nll(
    params: Params, hidden: jax.Array, target_ids: jax.Array, config, chunks, temperature: float
) -> jax.Array:
    """Each token's cross-entropy [B, S] of the logits at `temperature`: from the whole logits
    (`chunks` None: the plain form), or over (sequence, vocabulary) chunks, forward only
    (`loss.token_nll`: evaluation)."""
    if chunks is not None:
        names = [name for name in head_param_names(config) if name in params]
        return token_nll(
            {name: params[name] for name in names}, hidden, target_ids, config, *chunks,
            temperature,
        )  # fmt: skip
    logits = head(params, hidden, config) / temperature
    target = jnp.take_along_axis(logits, target_ids[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


def objective_model_loss(
    trainable: Params,
    frozen: Params,
    batch: Batch,
    config: ModelConfig,
    objective: Objective,
    lora: LoraSpec | None = None,
    key: jax.Array | None = None,
    attention: str = "blockwise",
    chunks: tuple[int | None, int | None] | None = None,
    packed_slots: int = DEFAULT_PACKED_SLOTS,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(loss, metrics) of an objective (`step/objective.py`), differentiated by `jax.grad`
    through the whole model: the policy's per-token log-probs; the reference model's are the
    same frozen base with the adapters off (`lora=None`), or the batch's precomputed ones.
    `chunks` (loss chunk, vocabulary chunk) computes the log-probs chunk by chunk (evaluation)."""
    params = merge_params(frozen, trainable)
    inputs = attention_inputs(config, batch.positions, batch.segment_ids, attention, packed_slots)
    keys = layer_dropout_keys(key, lora, config.num_layers)
    hidden = run_layers(
        params["layers"], embed(params, batch.input_ids, config), inputs, config, lora, True, keys
    )
    temperature = objective.temperature
    policy_logps = -_token_nll(params, hidden, batch.target_ids, config, chunks, temperature)
    reference = None
    if objective.needs_reference and objective.reference == "precomputed":
        reference = batch.reference_logps
    elif objective.needs_reference:
        base = run_layers(
            frozen["layers"], embed(params, batch.input_ids, config), inputs, config, None
        )
        reference = -_token_nll(params, base, batch.target_ids, config, chunks, temperature)
    if reference is not None:
        reference = jax.lax.stop_gradient(reference)
    return objective.loss_of(policy_logps, batch, reference)


def _loss_and_grad(
    config: ModelConfig,
    lora: LoraSpec | None,
    chunk_size: int | None,
    remat: bool,
    attention: str,
    objective: Objective | None,
    packed_slots: int = DEFAULT_PACKED_SLOTS,
    router_aux_loss_coef: float = 0.0,
) -> Callable[..., tuple[jax.Array, Params, dict[str, jax.Array]]]:
    """`(trainable, frozen, batch, key, weight) -> (loss, grads, metrics)`: the cross-entropy
    (+ `router_aux_loss_coef` x the load-balancing loss, reported as "aux_loss"), or `objective`
    when one is given (its metrics returned beside), scaled by `weight`, and its gradient with
    respect to `trainable` by `jax.value_and_grad`."""

    def loss_and_grad(trainable, frozen, batch, key, weight):
        def weighted(trainable):
            if objective is not None:
                loss, extra = objective_model_loss(
                    trainable, frozen, batch, config, objective, lora, key, attention,
                    packed_slots=packed_slots,
                )  # fmt: skip
                return loss * weight, extra
            loss, aux = model_loss_terms(
                trainable, frozen, batch, config, lora, key, chunk_size, remat,
                attention=attention, packed_slots=packed_slots,
            )  # fmt: skip
            if not router_aux_loss_coef:
                return loss * weight, {}
            return (loss + router_aux_loss_coef * aux) * weight, {"aux_loss": aux}

        (loss, extra), grads = jax.value_and_grad(weighted, has_aux=True)(trainable)
        return loss, grads, extra

    return loss_and_grad


def build_reference_step(
    config: ModelConfig,
    optimizer: optax.GradientTransformation,
    lora: LoraSpec | None = None,
    chunk_size: int | None = None,
    remat: bool = True,
    donate: bool = True,
    shardings: Any = None,
    accumulation_steps: int = 1,
    attention: str = "blockwise",
    objective: Objective | None = None,
    packed_slots: int = DEFAULT_PACKED_SLOTS,
    router_aux_loss_coef: float = 0.0,
) -> Callable[..., tuple[Params, Any, dict[str, jax.Array]]]:
    """A jitted `step(trainable, opt_state, frozen, batch, key) -> (trainable, opt_state, metrics)`.

    `trainable` and `opt_state` are donated: the caller must use the returned ones. Clipping is
    the optimizer's (`optax.clip_by_global_norm` in its chain sees the whole gradient: global).
    `accumulation_steps` > 1 splits each batch into that many micro-batches, scanned: each one's
    gradient (its loss weighted by its share of the batch's counted tokens) is summed into a
    float32 buffer the size of `trainable`, then one update -- the whole batch's gradient with one
    micro-batch's activations (the metrics beside the loss: the micro-batches' mean). `metrics["grad_norm"]` is the gradient's global norm (before any
    clipping). `shardings` (`featherweight.parallel.sharding.StepShardings`) compiles for a
    device mesh; None for one device. `attention` names the implementation every layer calls
    (`featherweight.models.attention`; "cudnn" with `packed_slots` documents a row). `objective` (an `Objective`) differentiates that
    objective instead of the cross-entropy; its metrics join the step's. `router_aux_loss_coef`
    > 0 adds an MoE router's load-balancing loss to the cross-entropy (`router_loss.py`).
    """
    check_optimizer(optimizer)
    if accumulation_steps < 1:
        raise StepConfigError(f"accumulation_steps={accumulation_steps} must be at least 1")
    check_objective(objective, lora, accumulation_steps)
    check_router_loss(router_aux_loss_coef, config, objective)

    loss_and_grad = _loss_and_grad(
        config, lora, chunk_size, remat, attention, objective, packed_slots, router_aux_loss_coef
    )

    def accumulated(trainable, frozen, batch, key):
        total = jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
        keys = None if key is None else jax.random.split(key, accumulation_steps)

        def micro_step(carry, inputs):
            loss_sum, grad_sum = carry
            micro, micro_key = inputs
            weight = jnp.sum(micro.loss_mask.astype(jnp.float32)) / total
            loss, grads, extra = loss_and_grad(trainable, frozen, micro, micro_key, weight)
            grad_sum = jax.tree.map(lambda s, g: s + g.astype(jnp.float32), grad_sum, grads)
            return (loss_sum + loss, grad_sum), extra

        start = (jnp.float32(0), jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), trainable))
        (loss, grads), extra = jax.lax.scan(
            micro_step, start, (micro_batches(batch, accumulation_steps), keys)
        )
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, trainable)
        return loss, grads, jax.tree.map(lambda values: jnp.mean(values, axis=0), extra)

    def step(trainable, opt_state, frozen, batch, key):
        if accumulation_steps == 1:
            loss, grads, extra = loss_and_grad(trainable, frozen, batch, key, 1.0)
        else:
            loss, grads, extra = accumulated(trainable, frozen, batch, key)
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        metrics = {
            "loss": loss,
            "tokens": jnp.sum(batch.loss_mask),
            "grad_norm": jnp.sqrt(squared_norm(grads)),
            "params_finite": all_finite(trainable),
            **extra,
        }
        return trainable, opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 1) if donate else (), **jit_shardings(shardings))
