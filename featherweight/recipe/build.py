"""From a `TrainConfig` to the pieces of a run: optimizer, trainable/frozen split, train step.

Shared by the trainer and the memory planner, so the planner measures exactly the step that
trains. Works on real arrays or on `jax.ShapeDtypeStruct`s (planning without weights).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from featherweight.errors import ConfigError
from featherweight.models.attention_choice import (
    AttentionTarget,
    choose_attention,
    cudnn_refusal,
    score_form,
)
from featherweight.models.config import ModelConfig
from featherweight.models.fused_attention import DEFAULT_PACKED_SLOTS
from featherweight.models.linear import LINEAR_NAMES, LoraSpec, Params
from featherweight.models.shapes import layer_shapes, top_level_shapes
from featherweight.parallel.sharding import mesh_from_settings, step_shardings
from featherweight.peft.lora import (
    LoraConfig,
    abstract_lora,
    init_lora,
    quantize_frozen_base,
)
from featherweight.quant.nf4 import NF4Tensor, abstract_nf4
from featherweight.recipe.objectives import check_objective, objective_of, step_objective
from featherweight.recipe.placement import check_placements, opt_state_placement
from featherweight.recipe.schema import TrainConfig, require_resolved
from featherweight.step.opt_state import init_streamed_opt_state, per_tensor_clipping
from featherweight.step.policy import DEQUANTIZED
from featherweight.step.reference import build_reference_step, model_loss, objective_model_loss
from featherweight.step.streamed import build_streamed_step

ADAPTER_DTYPE = jnp.float32  # adapters train in float32 over a bf16 or NF4 base (as PEFT does)


def lora_config_of(config: TrainConfig) -> LoraConfig | None:
    """The adapters' settings, or None for full fine-tuning."""
    return None if config.method == "full" else config.lora


def split_params(
    params: Params, config: TrainConfig, model_config: ModelConfig, key: jax.Array
) -> tuple[Params, Params]:
    """(trainable, frozen): all parameters for full fine-tuning; fresh adapters over the base
    (NF4-quantized for QLoRA if it is not already) otherwise."""
    lora = lora_config_of(config)
    if lora is None:
        return params, {}
    frozen = params
    if config.method == "qlora" and not isinstance(params["layers"]["q"], NF4Tensor):
        frozen = quantize_frozen_base(params)
    return init_lora(key, model_config, lora, ADAPTER_DTYPE), frozen


def abstract_split(config: TrainConfig, model_config: ModelConfig) -> tuple[Params, Params]:
    """(trainable, frozen) as `jax.ShapeDtypeStruct`s, exactly as `split_params` would build them."""
    dtype = jnp.dtype(config.model.dtype)
    top = {
        name: jax.ShapeDtypeStruct(shape, dtype)
        for name, shape in top_level_shapes(model_config).items()
    }
    layers: dict[str, Any] = {}
    for name, shape in layer_shapes(model_config).items():
        if config.method == "qlora" and name in LINEAR_NAMES:
            # stacked by layer, and an MoE layer's by expert: one NF4 tensor per expert, as
            # `quantize_frozen_base` quantizes them
            layers[name] = abstract_nf4(shape[-2:], (model_config.num_layers, *shape[:-2]))
        else:
            layers[name] = jax.ShapeDtypeStruct((model_config.num_layers, *shape), dtype)
    if config.method == "qlora" and config.model.quantize_head:
        head = "embed" if model_config.tie_word_embeddings else "lm_head"
        top[head] = abstract_nf4(top_level_shapes(model_config)[head])
    params = {**top, "layers": layers}
    lora = lora_config_of(config)
    if lora is None:
        return params, {}
    return abstract_lora(model_config, lora, ADAPTER_DTYPE), params


def step_optimizer(
    config: TrainConfig, optimizer: optax.GradientTransformation
) -> optax.GradientTransformation:
    """The transformation the configured step applies: clipping, when the step does not do it
    itself, is the first link of the chain. The reference step's `clip_by_global_norm` sees the
    whole gradient (global); the streamed step applies the chain per tensor, so there it is
    `per_tensor_clipping`. Global clipping with the streamed step is the step's (`step_clipping`)."""
    clip = config.optimizer.clip_norm
    if clip is None:
        return optimizer
    if config.memory.step == "reference":
        return optax.chain(optax.clip_by_global_norm(clip), optimizer)
    if config.optimizer.clipping == "per_tensor":
        return optax.chain(per_tensor_clipping(clip), optimizer)
    return optimizer


def step_clipping(config: TrainConfig) -> tuple[float | None, bool]:
    """(clip_norm, two_pass) for `build_streamed_step`: global clipping the step does itself."""
    settings = config.optimizer
    if settings.clip_norm is None or settings.clipping == "per_tensor":
        return None, False
    return settings.clip_norm, settings.clipping == "two_pass"


def opt_state_initializer(
    config: TrainConfig, optimizer: optax.GradientTransformation
) -> Callable[[Params], Any]:
    """`trainable -> optimizer state` in the layout the configured step expects."""
    optimizer = step_optimizer(config, optimizer)
    if config.memory.step == "reference":
        return optimizer.init
    placement = opt_state_placement(config)
    return lambda params: init_streamed_opt_state(optimizer, params, placement)


def build_train_step(
    config: TrainConfig,
    model_config: ModelConfig,
    trainable: Params,
    frozen: Params,
    optimizer: optax.GradientTransformation,
    mesh: Mesh | None = None,
    target: AttentionTarget | None = None,
) -> tuple[Callable, Callable[[Params], Any]]:
    """(jitted donated step, init_opt_state) for the configured step kind, memory policy,
    clipping and accumulation, its attention chosen for `target` (default: this process's
    device; `plan --target` compiles for a GPU without one).

    With a device mesh (`mesh`, default: the one `config.mesh` describes, which several
    processes always have) both are compiled for it: the step with the partition rules of
    `featherweight.parallel.sharding`, and init_opt_state creates the state directly in its shards.
    A config still "auto" is refused: `memory.defaults.resolve` chooses its settings first.
    """
    require_resolved(config, "build_train_step")
    lora = lora_config_of(config)
    spec: LoraSpec | None = None if lora is None else lora.spec
    attention = attention_implementation(config, model_config, target)
    slots = packed_slots(config)
    policy = dataclasses.replace(config.memory.policy, attention=attention, packed_slots=slots)
    init_opt_state = opt_state_initializer(config, optimizer)
    accumulation_steps = config.memory.accumulation_steps
    mesh, shardings = mesh or mesh_from_settings(config.mesh), None
    if mesh is not None:
        opt_state = jax.eval_shape(init_opt_state, trainable)
        shardings = step_shardings(mesh, trainable, opt_state, frozen)
        init_opt_state = jax.jit(init_opt_state, out_shardings=shardings.inputs[1])
    if config.memory.step == "reference":
        step = build_reference_step(
            model_config, step_optimizer(config, optimizer), lora=spec,
            chunk_size=policy.loss_chunk, shardings=shardings,
            accumulation_steps=accumulation_steps, attention=attention,
            objective=step_objective(config), packed_slots=slots,
            router_aux_loss_coef=router_aux_loss_coef(config, model_config),
        )  # fmt: skip
        return step, init_opt_state
    clip_norm, two_pass = step_clipping(config)
    step = build_streamed_step(
        model_config,
        step_optimizer(config, optimizer),
        trainable,
        frozen,
        lora=spec,
        policy=policy,
        accumulation_steps=accumulation_steps,
        clip_norm=clip_norm,
        two_pass=two_pass,
        shardings=shardings,
        objective=step_objective(config),
        router_aux_loss_coef=router_aux_loss_coef(config, model_config),
    )
    return step, init_opt_state


def attention_implementation(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> str:
    """The attention implementation the configured step calls on `target` (default: this
    process's device), from `memory.attention` and the rows the run's batches hold:
    several documents each (`data.pack: true`) or one document and padding
    (`models.attention_choice.choose_attention`: "auto" is cuDNN where it masks those rows
    exactly and forms the model's scores, blockwise otherwise; cuDNN's library is looked for
    only on a local target, `AttentionTarget.local`)."""
    target = target or AttentionTarget.of_device()
    return choose_attention(
        config.memory.attention,
        target,
        config.model.dtype,
        model_config.head_dim,
        rows=batch_rows(config),
        check_library=target.local,
        form=score_form(model_config),
    )


def batch_rows(config: TrainConfig) -> str:
    """What a batch row holds, as the objective lays out its data: several documents
    ("packed", `data.pack`) or one and padding ("padded"; GRPO's rows are one prompt and its
    completion each)."""
    return objective_of(config).rows(config)


def packed_slots(config: TrainConfig) -> int:
    """The documents a row cuDNN's packed attention holds: `data.max_documents_per_row`, which
    the packer holds every row to, else `DEFAULT_PACKED_SLOTS` (a batch with a row of more runs
    blockwise: `models.fused_attention.packed_or_fallback`)."""
    return config.data.max_documents_per_row or DEFAULT_PACKED_SLOTS


def attention_note(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> str | None:
    """Why "auto" runs blockwise rather than cuDNN on the GPU a step is built for (`target`,
    default this process's device; None where it runs cuDNN, is not "auto", or the target is no
    GPU): the plan says so, nothing silently."""
    target = target or AttentionTarget.of_device()
    if config.memory.attention != "auto" or target.platform != "gpu":
        return None
    rows = batch_rows(config)
    refusal = cudnn_refusal(
        target,
        config.model.dtype,
        model_config.head_dim,
        rows,
        check_library=target.local,
        form=score_form(model_config),
    )
    return (
        None if refusal is None else f"memory.attention: auto is blockwise on {target}: {refusal}"
    )


def router_aux_loss_coef(config: TrainConfig, model_config: ModelConfig) -> float:
    """The load-balancing loss's weight the step trains (0: off): `moe.router_aux_loss_coef`,
    or when that is null the model's own when its config.json turns the loss on
    (`output_router_logits`, as transformers does). A dense model with the setting is refused."""
    coef = config.moe.router_aux_loss_coef
    if coef is not None and not model_config.num_experts:
        raise ConfigError(
            f"moe.router_aux_loss_coef={coef}: {model_config.model_type} is a dense model with "
            "no router; drop the setting"
        )
    if coef is None:
        enabled = model_config.output_router_logits and model_config.router_aux_loss_coef
        return float(model_config.router_aux_loss_coef) if enabled else 0.0
    return float(coef)


def check_method_settings(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> None:
    """Refuse combinations that cannot work on `target` (default: this process's device),
    before any weights are read."""
    attention_implementation(config, model_config, target)
    lora = lora_config_of(config)
    if lora is not None:
        lora.check_model(model_config)
    if config.model.quantize_head and config.method != "qlora":
        raise ConfigError("model.quantize_head=true needs method: qlora (the head is frozen there)")
    if DEQUANTIZED in config.memory.save and config.method != "qlora":
        raise ConfigError(
            f"memory.save: {DEQUANTIZED} keeps NF4 weights dense between the passes, and method: "
            f"{config.method} has no NF4 weights; drop it from memory.save, or use method: qlora"
        )
    check_placements(config, model_config)
    mlp_chunk, seq = config.memory.mlp_chunk, config.data.seq_len  # "auto": chosen to divide it
    if isinstance(mlp_chunk, int) and mlp_chunk < seq and seq % mlp_chunk:
        raise ConfigError(
            f"memory.mlp_chunk={mlp_chunk} must divide data.seq_len={seq}; use a divisor, e.g. "
            f"{next(c for c in range(mlp_chunk, 0, -1) if seq % c == 0)}"
        )
    check_clipping_and_accumulation(config)
    check_objective(config)
    if router_aux_loss_coef(config, model_config) and step_objective(config) is not None:
        raise ConfigError(
            f"moe.router_aux_loss_coef trains with objective: sft only; set it to 0 for "
            f"objective: {config.objective}"
        )


def check_clipping_and_accumulation(config: TrainConfig) -> None:
    """Refuse clipping the configured step cannot do exactly as named, and accumulation that
    cannot split the batch; each message lists the settings that do work."""
    memory, settings = config.memory, config.optimizer
    steps = memory.accumulation_steps
    if config.batch_size % steps:
        raise ConfigError(
            f"batch_size={config.batch_size} cannot be split into memory.accumulation_steps="
            f"{steps} equal micro-batches; use a batch_size that is a multiple of {steps}"
        )
    if settings.clip_norm is None:
        return
    clipping = settings.clipping
    if memory.step == "reference" and clipping != "global":
        raise ConfigError(
            f"optimizer.clipping: {clipping} with memory.step: reference, whose clipping sees "
            "the whole gradient; use optimizer.clipping: global (or memory.step: streamed)"
        )
    if memory.step == "reference":
        return
    kept = config.method != "full" or steps > 1  # the streamed step keeps the gradient
    if clipping == "two_pass" and kept:
        raise ConfigError(
            "optimizer.clipping: two_pass is for full fine-tuning without accumulation; here "
            "the gradient is kept (adapters, or an accumulation buffer), so use "
            "optimizer.clipping: global (exact in one pass) or per_tensor"
        )
    if clipping == "global" and not kept:
        raise ConfigError(
            "optimizer.clipping: global with method: full and the streamed step needs every "
            "gradient before the first update; choose optimizer.clipping: two_pass (exact, a "
            "second backward pass), per_tensor (each tensor clipped on its own), "
            "memory.accumulation_steps >= 2 (a gradient buffer), or memory.step: reference"
        )


@functools.lru_cache(maxsize=4)
def evaluation_fn(config: TrainConfig, model_config: ModelConfig) -> Callable:
    """Jitted `(trainable, frozen, batch) -> (mean loss, counted tokens)`, without dropout, with
    the chunks of the resolved `config`; for an objective evaluated on its own loss (DPO, ORPO:
    `RunObjective.evaluated`), (that loss, counted pairs)."""
    require_resolved(config, "the evaluation")
    lora = lora_config_of(config)
    spec = None if lora is None else lora.spec
    objective = objective_of(config).evaluated(config)

    def evaluate(trainable, frozen, batch):
        if objective is not None:
            loss, metrics = objective_model_loss(
                trainable, frozen, batch, model_config, objective, spec,
                chunks=(config.memory.loss_chunk, config.memory.vocab_chunk),
            )  # fmt: skip
            return loss, metrics["pairs"]
        loss = model_loss(
            trainable,
            frozen,
            batch,
            model_config,
            spec,
            None,
            config.memory.loss_chunk,
            vocab_chunk=config.memory.vocab_chunk,
            mlp_chunk=config.memory.mlp_chunk,
        )
        return loss, jnp.sum(batch.loss_mask)

    return jax.jit(evaluate)
