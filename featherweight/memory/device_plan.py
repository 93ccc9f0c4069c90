"""The memory plan: every byte of a train step, named, before anything is compiled or read.

From a model config (an HF `config.json` is enough), a `TrainConfig` (method, batch, sequence,
dtype, optimizer, memory policy) and nothing else, `plan_one_device` returns the device and host
bytes of the layer-streamed step (featherweight/step/streamed.py) per component:

  kept between steps (exact; featherweight/memory/state_bytes.py)
    frozen_base          full: 0; LoRA: every parameter x itemsize; QLoRA: linear weights NF4
    trainable_weights    full: every parameter; LoRA/QLoRA: adapters r x (in + out) x 4 per target
    optimizer_state      per tensor and layer: AdamW 2 n x itemsize, 8-bit AdamW ~2.03 n, ...
    batch                5 int32/float32 arrays [B, S]: 20 B S (+ 8 for the dropout key)
  kept from the forward pass to the backward pass (device, or host with residuals="host")
    residual_stream      L x B x S x D x itemsize: each layer's input
    saved_intermediates  L x B x S x ((H + 2K) h  [qkv] + H h + D  [attention] + 2 F  [mlp_hidden])
                         x itemsize
    dequantized_weights  QLoRA with save "dequantized": L x the layer's linear weights x itemsize,
                         dense from the forward pass (q, k, v, o, gate, up, down: about 4x the
                         NF4 stack in bfloat16)
  the working set of the step's peak phase (featherweight/memory/working_set.py)
    backward: layer_weights, layer_gradient, optimizer_update, layer_activations,
              attention (scores, or the blockwise/cuDNN buffers), dequantized_layer (XLA:GPU,
              QLoRA), saved_layer_from_host (XLA:GPU), embedding_gradient, base_layers_in_flight
    loss: logits_chunk, embedding_gradient, head_gradient, dequantized_head, ...
    head_update (an untied head in full fine-tuning): embedding_gradient, head_update
    embedding (full fine-tuning): embedding_gradient, embedding_update
  step_outputs           the metrics, and XLA's output tuple (8 bytes per output buffer)
  rollout phase (GRPO)   beside the step, not during it: the resident weights and optimizer state
                         and what sampling holds (`rollout_plan.py`: KV cache, logits); the
                         plan's `device_bytes` is the larger phase

`temporaries` (what XLA reports as temp) = the stored activations + the peak phase's working set.

Host bytes: residuals placed on host leave the device, and so do the optimizer state (with the
new state built beside it, `optimizer_state_rebuilt`), the embedding table (trained: rebuilt too)
and the frozen layer stack (`base_layers`: two layers of it are then on the device in the
backward phase on an accelerator, `base_layers_in_flight`); XLA CPU has one memory, so on CPU the
measured total is to be compared with device + host (`MemoryPlan.cpu_comparable_bytes`).

Every component carries its placement: the small-memory settings (embedding table and optimizer
state on host, vocabulary and MLP chunks, the attention implementation) add a component, change a
placement or shrink a working-set term without changing how plans are summed, compared or
budgeted.
"""

from __future__ import annotations

import math
from typing import Any

import jax

from featherweight.errors import ConfigError
from featherweight.memory.components import (
    DEQUANTIZED_WEIGHTS,
    DEVICE,
    HOST,
    HOST_BASE,
    METRIC_BYTES,
    OUTPUTS,
    REBUILT_ON_HOST,
    MemoryPlan,
    PlanComponent,
)
from featherweight.memory.rollout_plan import rollout_components
from featherweight.memory.state_bytes import (
    compute_itemsize,
    frozen_base_bytes,
    host_base_bytes,
    host_embedding_bytes,
    optimizer_state_bytes,
    output_buffer_count,
    state_shapes,
    trainable_bytes,
)
from featherweight.memory.working_set import (
    StepShapes,
    attention_of,
    calibration_key,
    phase_working_sets,
    saved_width,
    working_set_floor,
)
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.recipe.build import attention_note, check_method_settings
from featherweight.recipe.objectives import objective_of, step_objective
from featherweight.recipe.schema import TrainConfig, require_resolved
from featherweight.step.objective import abstract_batch
from featherweight.step.policy import DEQUANTIZED


def _output_buffers(config: TrainConfig, model_config: ModelConfig) -> int:
    """Output buffers of the step: every trainable and optimizer-state leaf, and 5 metrics."""
    return output_buffer_count(config, model_config)


def _persistent(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> list[PlanComponent]:
    shapes = StepShapes(config, model_config, target)
    uses_key = config.method != "full" and config.lora.dropout > 0
    batch = jax.tree.leaves(batch_shapes(config))
    batch_bytes = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in batch)
    arrays = sum(leaf.shape == (shapes.batch, shapes.seq) for leaf in batch)
    host_embedding = host_embedding_bytes(config, model_config)
    host_base = host_base_bytes(config, model_config)
    components = [
        PlanComponent(
            "frozen_base",
            frozen_base_bytes(config, model_config)
            - (0 if shapes.full else host_embedding)
            - host_base,
            DEVICE,
            {"full": "none (everything trains)", "lora": f"all weights x {shapes.itemsize} B"}.get(
                config.method, f"linear weights NF4 (~0.52 B/value), the rest x {shapes.itemsize} B"
            ),
        ),
        PlanComponent(
            "trainable_weights",
            trainable_bytes(config, model_config) - (host_embedding if shapes.full else 0),
            DEVICE,
            f"all weights x {shapes.itemsize} B"
            if shapes.full
            else f"LoRA r={config.lora.rank}: L x r x (in + out) x 4 B per target",
        ),
        PlanComponent(
            "optimizer_state",
            optimizer_state_bytes(config, model_config),
            config.memory.optimizer_state,
            f"eval_shape of the {config.optimizer.name} state initialiser "
            f"({config.memory.step} step layout)",
        ),
        PlanComponent(
            "batch",
            batch_bytes + (8 if uses_key else 0),
            DEVICE,
            f"{arrays} x B x S x 4 = {arrays} x {shapes.batch} x {shapes.seq} x 4"
            + (" + B x 4 (advantages)" if len(batch) > arrays else "")
            + (" + dropout key" if uses_key else ""),
        ),
    ]
    if host_base:
        components.append(
            PlanComponent(
                HOST_BASE,
                host_base,
                HOST,
                f"the frozen layer stack, L = {shapes.layers} layers; each comes over one layer "
                "ahead",
            )
        )
    components += _rebuilt_on_host(config, model_config)
    if host_embedding:
        components.append(
            PlanComponent(
                "embedding_table",
                host_embedding,
                HOST,
                f"V x D x {shapes.itemsize} = {shapes.vocab} x {shapes.hidden} x "
                f"{shapes.itemsize}; only a batch's rows come over"
                + (" (updated in row chunks)" if shapes.full else " (frozen)"),
            )
        )
    return components


def batch_shapes(config: TrainConfig):
    """The step's batch as shapes, its objective's layout (`step/objective.py`)."""
    return abstract_batch(step_objective(config), config.batch_size, config.data.seq_len)


def objective_notes(config: TrainConfig) -> tuple[str, ...]:
    """What an objective costs beyond its batch arrays (the plan's notes, `plan_note` on the
    objective seam); nothing for next-token cross-entropy."""
    objective = step_objective(config)
    if objective is None:
        return ()
    return (objective.plan_note(config.batch_size * config.data.seq_len),)


def _rebuilt_on_host(config: TrainConfig, model_config: ModelConfig) -> list[PlanComponent]:
    """The host arrays a step writes anew: XLA cannot update host memory in place, so the new
    optimizer state (and a trained host embedding table) is built in fresh host buffers beside
    the old ones, which are freed after the step (`parallel/memory_kinds.py`). Host temporaries
    on a GPU; on XLA:CPU, one memory, they count in temp."""
    rebuilt = []
    if config.memory.optimizer_state == "host":
        rebuilt.append(
            PlanComponent(
                REBUILT_ON_HOST[0],
                optimizer_state_bytes(config, model_config),
                HOST,
                "the new optimizer state, written slice by slice into fresh host buffers",
            )
        )
    if config.method == "full" and config.memory.embed == "host":
        rebuilt.append(
            PlanComponent(
                REBUILT_ON_HOST[1],
                host_embedding_bytes(config, model_config),
                HOST,
                "the updated embedding table, written chunk by chunk into a fresh host buffer",
            )
        )
    return rebuilt


def _stored(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> list[PlanComponent]:
    shapes, save = StepShapes(config, model_config, target), config.memory.save
    placement = config.memory.residuals
    width = saved_width(config, shapes)
    stored = [
        PlanComponent(
            "residual_stream",
            shapes.layers * shapes.tokens * shapes.hidden * shapes.itemsize,
            placement,
            f"L x B x S x D x {shapes.itemsize} = {shapes.layers} x {shapes.batch} x "
            f"{shapes.seq} x {shapes.hidden} x {shapes.itemsize}",
        )
    ]
    if width:
        stored.append(
            PlanComponent(
                "saved_intermediates",
                shapes.layers * shapes.tokens * width * shapes.itemsize,
                placement,
                f"L x B x S x {width} x {shapes.itemsize} ({' + '.join(save)})",
            )
        )
    if DEQUANTIZED in save:  # QLoRA's NF4 linear weights, dense in the compute dtype
        stored.append(
            PlanComponent(
                DEQUANTIZED_WEIGHTS,
                shapes.layers * shapes.layer_linear * shapes.itemsize,
                placement,
                f"L x {shapes.layer_linear} linear weights x {shapes.itemsize} (dequantized)",
            )
        )
    return stored


def check_plan_inputs(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> tuple[str, ...]:
    """Refuse what cannot be planned for `target` (default: this process's device); return
    warnings about what can but may surprise.

    Batch and sequence must be positive; the sequence may exceed the model's
    `max_position_embeddings` only when llama3 rope scaling extends the context
    (original x factor), and then with a warning.
    """
    batch, seq = config.batch_size, config.data.seq_len
    if batch <= 0 or seq <= 0:
        raise ConfigError(f"batch={batch} and seq={seq} must both be positive, e.g. --batch 2")
    check_method_settings(config, model_config, target)
    limit, scaling = model_config.max_position_embeddings, model_config.rope_scaling
    if seq <= limit:
        return ()
    extended = (
        0 if scaling is None else int(scaling.original_max_position_embeddings * scaling.factor)
    )
    if seq > extended:
        raise ConfigError(
            f"seq={seq} exceeds the model's max_position_embeddings={limit}"
            + ("" if scaling is None else f" and its rope-scaled context {extended}")
            + f"; use a sequence of at most {max(limit, extended)}"
        )
    return (
        f"seq={seq} exceeds max_position_embeddings={limit}; llama3 rope scaling (factor "
        f"{scaling.factor} over {scaling.original_max_position_embeddings}) reaches {extended}, "
        "but quality past the trained context is not guaranteed",
    )


def plan_settings(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> dict[str, Any]:
    """The choices a plan describes, as plain values (JSON-ready); `attention` is the
    implementation the step calls on `target` (auto resolved for it)."""
    memory = config.memory
    return {
        "method": config.method,
        "dtype": config.model.dtype,
        "batch_size": config.batch_size,
        "accumulation_steps": config.memory.accumulation_steps,
        "seq_len": config.data.seq_len,
        "optimizer": config.optimizer.name,
        "lora_rank": None if config.method == "full" else config.lora.rank,
        "quantize_head": config.model.quantize_head,
        "residuals": memory.residuals,
        "loss_chunk": memory.loss_chunk,
        "vocab_chunk": memory.vocab_chunk,
        "mlp_chunk": memory.mlp_chunk,
        "optimizer_state": memory.optimizer_state,
        "embed": memory.embed,
        "base": memory.base,
        "attention": attention_of(config, model_config, target),
        "save": list(memory.save),
        "step": memory.step,
        "calibration": calibration_key(config, target),
        **_objective_settings(config),
    }


def _objective_settings(config: TrainConfig) -> dict[str, Any]:
    """The objective's own plan settings (`step/objective.py`; nothing for sft: its plans stay
    as were) and, where it samples rollouts (GRPO), the rollout chunk."""
    objective = step_objective(config)
    if objective is None:
        return {}
    samples = objective_of(config).rollouts(config) is not None
    rollouts = {"rollout_chunk": config.memory.rollout_chunk} if samples else {}
    return {**objective.plan_settings(), **rollouts}


def micro_batch_config(config: TrainConfig) -> TrainConfig:
    """`config` with batch_size one micro-batch's rows: what the activations are planned for."""
    steps = config.memory.accumulation_steps
    return config.model_copy(update={"batch_size": max(config.batch_size // steps, 1)})


def gradient_buffers(config: TrainConfig, model_config: ModelConfig) -> list[PlanComponent]:
    """What the step keeps of the gradient beyond one layer's (step/streamed.py, gradient modes):
    a float32 buffer of every trainable tensor when it accumulates micro-batches or clips
    globally in one pass (streamed LoRA/QLoRA: adapter-sized), and the head's gradient kept
    between the two passes of two-pass clipping (untied full fine-tuning; a tied table's
    gradient is already planned as the tied embedding's)."""
    memory, settings = config.memory, config.optimizer
    clip = settings.clip_norm is not None
    streamed_global = memory.step == "streamed" and clip and settings.clipping == "global"
    if memory.accumulation_steps > 1 or streamed_global:
        shapes = state_shapes(config, model_config).trainable
        float32_bytes = sum(math.prod(leaf.shape) * 4 for leaf in jax.tree.leaves(shapes))
        return [
            PlanComponent(
                "gradient_buffer",
                float32_bytes,
                DEVICE,
                "every trainable tensor's gradient in float32 (accumulation / global clipping)",
            )
        ]
    if memory.step == "streamed" and clip and settings.clipping == "two_pass":
        if model_config.tie_word_embeddings:
            return []
        itemsize = compute_itemsize(config)
        return [
            PlanComponent(
                "head_gradient_kept",
                model_config.vocab_size * model_config.hidden_size * itemsize,
                DEVICE,
                f"V x D x {itemsize}: the head's gradient, kept between the two clipping passes",
            )
        ]
    return []


def plan_one_device(
    config: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget | None = None,
    calibration: dict[str, float] | None = None,
) -> MemoryPlan:
    """The memory plan of the train step `config` describes on one device (`config.mesh` is not
    read) compiled for `target` (default: this process's device): no weights read, nothing
    compiled. Raises `ConfigError` for inputs that cannot be planned, a config still "auto"
    included (`memory/defaults.py`: `resolve`)."""
    require_resolved(config, "the memory plan")
    target = target or AttentionTarget.of_device()
    warnings = check_plan_inputs(config, model_config, target) + objective_notes(config)
    note = attention_note(config, model_config, target)
    warnings += () if note is None else (note,)
    micro = micro_batch_config(config)  # activations are one micro-batch's
    phases = phase_working_sets(micro, model_config, target, calibration)
    phase_bytes = {name: sum(b.bytes for b in buffers) for name, buffers in phases.items()}
    peak = max(phase_bytes, key=phase_bytes.get)
    working = [PlanComponent(b.name, b.bytes, DEVICE, b.formula) for b in phases[peak]]
    before = _persistent(config, model_config, target) + _stored(micro, model_config, target)
    outputs = PlanComponent(
        OUTPUTS,
        METRIC_BYTES + 8 * _output_buffers(config, model_config),
        DEVICE,
        "5 metrics + 8 B per output buffer (XLA's output tuple)",
    )
    on_device = sum(c.bytes for c in before if c.placement == DEVICE)
    if config.memory.step == "reference":
        warnings += (
            "memory.step=reference: planned as the streamed step plus a full gradient pytree; "
            "the reference step's activations are not calibrated",
        )
        before.append(
            PlanComponent(
                "full_gradient",
                trainable_bytes(config, model_config),
                DEVICE,
                "every trainable tensor's gradient",
            )
        )
    before.extend(gradient_buffers(config, model_config))
    return MemoryPlan(
        components=(*before, *working, outputs),
        phases=phase_bytes,
        peak_phase=peak,
        lower_bound_bytes=on_device + working_set_floor(micro, model_config, target),
        settings=plan_settings(config, model_config, target),
        warnings=warnings,
        rollout=rollout_components(config, model_config, target),
    )
