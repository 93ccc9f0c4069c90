"""The memory plan per device of a train step on a device mesh (data parallel and FSDP).

On a mesh every device runs the same program on its rows of the batch and its shards of the state
(featherweight/parallel/sharding.py). So per device the plan is the one-device plan of the
per-device batch (global batch / (data x fsdp)) -- the stored activations, the layer's activations, the attention
scores and the logits all follow the rows -- except:

- frozen base, trainable weights, optimizer state: this device's shards, exact, from the partition
  rules applied to abstract shapes (what does not divide stays whole: NF4 fields that would split
  a block, step counts, small adapters);
- layer_gradient, optimizer_update, head_gradient, head_update, embedding_gradient,
  embedding_update (and the reference step's full gradient): split over fsdp, since XLA
  reduce-scatters a gradient and updates only the local shard;
- layer_weights and dequantized_head stay whole: FSDP gathers a layer's weights before its
  matmuls, so one layer is whole on every device at a time.

Two buffers appear only on a mesh, in the loss phase of the whole-sequence loss (autodiff of the
plain computation; XLA's SPMD partitioner on a head sharded along the vocabulary, measured on XLA
CPU, jax 0.10.2):

- head_reshard_logits: one more B x S x V float32 logits buffer (the logits are resharded
  between the vocabulary and the batch layout);
- gathered_head: when both axes are larger than 1 (the rows are split over data x fsdp but the
  head only over fsdp), the partitioner gathers the whole V x D head on every device.

The chunked loss (a loss or vocabulary chunk: `step/loss.py`'s own sweep) has neither for a
frozen head: SmolLM2's head over data 2 x fsdp 4, QLoRA, compiles to 57.0 MB where both would
plan 182. A trained head's gradient, summed over the chunks, is planned as gathered_head there:
measured 193.6 MB (data 2 x fsdp 4) and 384.5 MB (data 4 x fsdp 2) against plans of 274.1 and
408.6 MB -- over, where leaving it out would plan 17-23% under.

Measured per-device totals (XLA CPU, float32) are within 8% of this plan for SmolLM2-135M (full,
LoRA, QLoRA; 1, 2, 4, 8 devices) and within 5% for LoRA and QLoRA on every mesh of 2 to 8 devices
tried. Full fine-tuning where the trainable head dominates (a few layers under a 49k vocabulary)
is less predictable -- how XLA partitions the head's gradient varies with the mesh -- and measured
up to ~22% above the plan there: leave a margin.

No device is needed: the mesh may be an `AbstractMesh` of any size. Checked against
`compiled.memory_analysis()` of the sharded step for 2, 4 and 8 devices
(tests/memory/test_mesh_plan.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import AbstractMesh, Mesh

from featherweight.memory.components import DEVICE, OUTPUTS, MemoryPlan, PlanComponent
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.state_bytes import compute_itemsize
from featherweight.memory.working_set import phase_working_sets
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.parallel.sharding import (
    DATA,
    FSDP,
    check_batch_size,
    optimizer_state_spec,
    parameter_spec,
    per_device_bytes,
    tree_shardings,
)
from featherweight.recipe.build import abstract_split, check_method_settings, opt_state_initializer
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.schema import TrainConfig, require_resolved
from featherweight.step.loss import resolve_chunk_size

SPLIT_OVER_FSDP = (
    "layer_gradient",
    "optimizer_update",
    "head_gradient",
    "head_update",
    "embedding_gradient",
    "embedding_update",
    "full_gradient",
)


def sharded_state_bytes(
    config: TrainConfig, model_config: ModelConfig, mesh: Mesh | AbstractMesh
) -> dict[str, int]:
    """Bytes of one device's shards of the frozen base, trainable weights and optimizer state."""
    trainable, frozen = abstract_split(config, model_config)
    optimizer = make_optimizer(config.optimizer, config.steps)
    opt_state = jax.eval_shape(opt_state_initializer(config, optimizer), trainable)
    return {
        "frozen_base": per_device_bytes(frozen, tree_shardings(frozen, mesh, parameter_spec)),
        "trainable_weights": per_device_bytes(
            trainable, tree_shardings(trainable, mesh, parameter_spec)
        ),
        "optimizer_state": per_device_bytes(
            opt_state, tree_shardings(opt_state, mesh, optimizer_state_spec)
        ),
    }


def mesh_loss_buffers(
    local: TrainConfig, model_config: ModelConfig, data: int, fsdp: int
) -> list[PlanComponent]:
    """The loss-phase buffers only a mesh has (module docstring); `local`: per-device batch."""
    if fsdp == 1:
        return []
    vocab, rows = model_config.vocab_size, local.batch_size
    chunk = resolve_chunk_size(local.data.seq_len, local.memory.loss_chunk)
    vocab_chunk = local.memory.vocab_chunk
    chunked = chunk < local.data.seq_len or (vocab_chunk is not None and vocab_chunk < vocab)
    buffers = []
    if not chunked:
        buffers.append(
            PlanComponent(
                "head_reshard_logits",
                4 * rows * chunk * vocab,
                DEVICE,
                f"B x chunk x V x 4 = {rows} x {chunk} x {vocab} x 4 (logits resharded)",
            )
        )
    if data > 1 and (not chunked or local.method == "full"):
        itemsize = compute_itemsize(local)
        buffers.append(
            PlanComponent(
                "gathered_head",
                vocab * model_config.hidden_size * itemsize,
                DEVICE,
                f"V x D x {itemsize} = {vocab} x {model_config.hidden_size} x {itemsize} "
                "(the head gathered whole: rows split over data x fsdp)",
            )
        )
    return buffers


def _split(component: PlanComponent, fsdp: int) -> PlanComponent:
    if component.name not in SPLIT_OVER_FSDP or fsdp == 1:
        return component
    return dataclasses.replace(
        component,
        bytes=math.ceil(component.bytes / fsdp),
        formula=f"({component.formula}) / fsdp {fsdp}",
    )


def plan_for_mesh(
    config: TrainConfig,
    model_config: ModelConfig,
    mesh: Mesh | AbstractMesh,
    target: AttentionTarget | None = None,
) -> MemoryPlan:
    """The plan of one device of `mesh`, compiled for `target` (default: this process's device;
    see the module docstring). `config.batch_size` is per process, as the trainer reads it; the
    global batch must split over data x fsdp."""
    require_resolved(config, "the memory plan")
    target = target or AttentionTarget.of_device()
    check_method_settings(config, model_config, target)  # e.g. host placements refused
    rows = mesh.shape[DATA] * mesh.shape[FSDP]
    fsdp = mesh.shape[FSDP]
    global_batch = config.batch_size * jax.process_count()
    check_batch_size(global_batch, mesh)
    local = config.model_copy(update={"batch_size": global_batch // rows, "mesh": None})
    plan = plan_one_device(local, model_config, target)
    shards = sharded_state_bytes(config, model_config, mesh)

    phases = {
        phase: [_split(PlanComponent(b.name, b.bytes, DEVICE, b.formula), fsdp) for b in buffers]
        for phase, buffers in phase_working_sets(local, model_config, target).items()
    }
    phases["loss"] += mesh_loss_buffers(local, model_config, mesh.shape[DATA], fsdp)
    phase_bytes = {phase: sum(c.bytes for c in parts) for phase, parts in phases.items()}
    peak = max(phase_bytes, key=phase_bytes.get)
    working_names = {c.name for parts in phases.values() for c in parts}
    before, outputs = [], []
    for component in plan.components:
        if component.name in shards:
            formula = f"this device's shards of: {component.formula}"
            component = dataclasses.replace(
                component, bytes=shards[component.name], formula=formula
            )
        if component.name == OUTPUTS:
            outputs.append(component)
        elif component.name not in working_names:
            before.append(_split(component, fsdp))
    unsharded = sum(plan.bytes_of(name) for name in shards)
    return MemoryPlan(
        components=(*before, *phases[peak], *outputs),
        phases=phase_bytes,
        peak_phase=peak,
        lower_bound_bytes=plan.lower_bound_bytes - unsharded + sum(shards.values()),
        settings={
            **plan.settings,
            "batch_size": config.batch_size,
            "per_device_batch": local.batch_size,
            "mesh": {DATA: mesh.shape[DATA], FSDP: fsdp},
        },
        warnings=plan.warnings,
    )
