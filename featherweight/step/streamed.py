"""The layer-streamed train step: the optimizer runs inside the backward pass, one layer at a time.

No `jax.grad` of the whole model. The step is, in one jitted and donated program:

1. forward (`layer_loop.forward_layers`): scan the block over the stacked layers, keeping each
   layer's input (the residual stream) -- on device or in pinned host memory -- and any
   intermediates the policy saves;
2. head: value and VJP of final norm + LM head + chunked cross-entropy; the head's parameters are
   updated at once (`top_update.top_update`);
3. backward (`layer_loop.backward_layers`): last layer to first, each layer's VJP and then each of
   its tensors' updates, in place; at most one layer's gradient is alive;
4. embedding (`top_update.embedding_update`): the input cotangent is scattered into the
   embedding's gradient (a tied table adds the head's gradient of it) and the table is updated
   once.

Frozen weights (bf16 or NF4) are closed over in every VJP, so no gradient of them is ever built.

Any optax `GradientTransformation` works, applied per tensor (its state is initialised per layer
and stacked: `opt_state.py`). Transformations that need a global view see one tensor at a time:
`clip_by_global_norm` in the chain clips each tensor's gradient on its own (`per_tensor_clipping`).
Gradient accumulation over micro-batches needs a full gradient buffer and is refused; use the
reference step for it. Each update sits in a `lax.cond` on the loss being finite
(`opt_state.guarded_update`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params, attention_inputs, embed, merge_params
from featherweight.step.common import (
    HEAD_PARAMS,
    activation_constraint,
    all_finite,
    head_param_names,
    jit_shardings,
    layer_dropout_keys,
    squared_norm,
)
from featherweight.step.layer_loop import LayerContext, backward_layers, forward_layers
from featherweight.step.loss import Batch, head_loss
from featherweight.step.opt_state import (
    StreamedOptState,
    init_streamed_opt_state,
    per_tensor_clipping,
    place_opt_state,
)
from featherweight.step.policy import MemoryPolicy
from featherweight.step.top_update import TOP_ROW_CHUNK, embedding_update, top_row_chunk, top_update
from featherweight.step.validate import check_optimizer, check_uniform_layers, refuse_accumulation

__all__ = [
    "TOP_ROW_CHUNK",
    "StreamedOptState",
    "build_streamed_step",
    "init_streamed_opt_state",
    "per_tensor_clipping",
    "place_opt_state",
    "top_row_chunk",
]


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
    over an NF4 frozen base). `shardings` (`featherweight.parallel.sharding.StepShardings`)
    compiles for a device mesh: the arguments and results keep their layouts, and the residual
    stream and its cotangent stay split over the batch (so XLA gathers each layer's weights,
    FSDP-style, rather than resharding activations); None compiles for one device.
    """
    policy = policy or MemoryPolicy()
    check_optimizer(optimizer)
    refuse_accumulation(optimizer, trainable, accumulation_steps)
    check_uniform_layers(frozen, trainable, config.num_layers)
    constrain = activation_constraint(shardings)

    def step(trainable, opt_state: StreamedOptState, frozen, batch: Batch, key):
        top = merge_params(frozen, trainable)
        context = LayerContext(
            config, attention_inputs(config, batch.positions, batch.segment_ids, policy.attention),
            lora, layer_dropout_keys(key, lora, config.num_layers), policy, constrain,
        )  # fmt: skip
        frozen_layers, trainable_layers = frozen.get("layers", {}), trainable.get("layers", {})

        # 1. forward, keeping each layer's input at the policy's placement
        hidden, stored = forward_layers(
            frozen_layers, trainable_layers, embed(top, batch.input_ids), context
        )

        # 2. head: loss, its VJP, and the head's own updates right away
        head_names = [name for name in head_param_names(config) if name in top]
        head_trainable = {name: trainable[name] for name in head_names if name in trainable}
        head_frozen = {name: top[name] for name in head_names if name not in trainable}

        def head_fn(head_params, h):
            params = {**head_frozen, **head_params}
            return head_loss(params, h, batch, config, policy.loss_chunk, policy.vocab_chunk)

        loss, head_vjp = jax.vjp(head_fn, head_trainable, constrain(hidden))
        head_grads, cotangent = head_vjp(jnp.ones((), loss.dtype))
        ok = jnp.isfinite(loss)
        new_trainable, new_top_state = dict(trainable), dict(opt_state.top)
        grad_sq = squared_norm({k: v for k, v in head_grads.items() if k != "embed"})
        for name in HEAD_PARAMS:
            if name in trainable:
                new_trainable[name], new_top_state[name] = top_update(
                    optimizer, ok, head_grads[name], opt_state.top[name], trainable[name],
                    policy.vocab_chunk,
                )  # fmt: skip

        # 3. backward over the layers, each updated as soon as its gradient exists
        cotangent, new_layers, layer_states, layers_sq = backward_layers(
            optimizer, ok, cotangent, stored, frozen_layers, trainable_layers, opt_state.layers,
            context,
        )  # fmt: skip
        if trainable_layers:
            new_trainable["layers"] = new_layers

        # 4. embedding: the input cotangent (plus a tied head's gradient), one update
        embed_sq = jnp.float32(0)
        if "embed" in trainable:
            new_trainable["embed"], new_top_state["embed"], embed_sq = embedding_update(
                optimizer, ok, batch.input_ids, cotangent, head_grads, opt_state.top["embed"],
                trainable["embed"], policy.vocab_chunk,
            )  # fmt: skip

        metrics = {
            "loss": loss,
            "tokens": jnp.sum(batch.loss_mask),
            "grad_norm": jnp.sqrt(grad_sq + layers_sq + embed_sq),
            "updated": ok,
            "params_finite": all_finite(new_trainable),
        }
        return new_trainable, StreamedOptState(layer_states, new_top_state), metrics

    return jax.jit(step, donate_argnums=(0, 1) if donate else (), **jit_shardings(shardings))
