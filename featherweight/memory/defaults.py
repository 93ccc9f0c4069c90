"""Lean defaults: the LM head's sequence chunk, chosen from the shapes when the config sets none.

Without a chunk the loss materializes B x S x V float32 logits (and their gradient), which at
typical fine-tuning shapes is the step's peak: SmolLM2-135M at b2 x 2048 holds 768 MiB of logits,
more than a layer's whole backward pass. The chunked loss (step/loss.py) computes the loss and
its gradients in the same sweep, so a sequence chunk costs no extra matmul FLOPs; only the
chunk's matmuls get smaller. So when `memory.loss_chunk` is not set, the chunk is the largest
halving of the sequence whose loss phase is no larger than the backward phase (the planner's
working sets), but no smaller than `MIN_AUTO_LOSS_CHUNK` tokens (smaller matmuls run slower).
A vocabulary chunk is never chosen here: it costs one more LM-head forward (the budget search
weighs it when a budget asks for it).

An explicit setting always wins, `loss_chunk: null` (whole sequence) included: only a field the
user did not set is filled in. The filled-in config is what is planned, built and written to the
run's config file, so the choice is recorded.
"""

from __future__ import annotations

from featherweight.memory.working_set import phase_working_sets
from featherweight.models.config import ModelConfig
from featherweight.recipe.schema import TrainConfig

MIN_AUTO_LOSS_CHUNK = 64  # tokens per row: below this the head's matmuls lose speed


def _phase_bytes(config: TrainConfig, model_config: ModelConfig) -> dict[str, int]:
    phases = phase_working_sets(config, model_config)
    return {name: sum(buffer.bytes for buffer in buffers) for name, buffers in phases.items()}


def _with_loss_chunk(config: TrainConfig, chunk: int | None) -> TrainConfig:
    return config.model_copy(
        update={"memory": config.memory.model_copy(update={"loss_chunk": chunk})}
    )


def auto_loss_chunk(config: TrainConfig, model_config: ModelConfig) -> int | None:
    """The sequence chunk of the loss for these shapes (None: the whole sequence is lean)."""
    seq = config.data.seq_len
    chunk, chosen = seq, None
    while True:
        phases = _phase_bytes(_with_loss_chunk(config, chosen), model_config)
        if phases["loss"] <= phases["backward"]:
            return chosen
        chunk //= 2
        if chunk < MIN_AUTO_LOSS_CHUNK or seq % chunk:
            return chosen
        chosen = chunk


def with_lean_defaults(config: TrainConfig, model_config: ModelConfig) -> TrainConfig:
    """`config` with the memory settings it leaves unset chosen from the shapes (`loss_chunk`);
    a config that sets them is returned as it is."""
    if "loss_chunk" in config.memory.model_fields_set:
        return config
    return _with_loss_chunk(config, auto_loss_chunk(config, model_config))
