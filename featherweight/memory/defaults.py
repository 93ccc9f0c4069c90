"""Lean defaults: the chunks of the LM head and of the MLP, chosen from the shapes when the config
sets none.

Without a loss chunk the loss materializes B x S x V float32 logits (and their gradient), which at
typical fine-tuning shapes is the step's peak: SmolLM2-135M at b2 x 2048 holds 768 MiB of logits,
more than a layer's whole backward pass. Without an MLP chunk each layer's backward holds B x S x F
hidden activations (gate, up, their product and gradients), 3-4x the D-wide ones. All three
chunks cost no matmul FLOPs (step/loss.py makes each logits chunk once -- with a frozen head even
when the vocabulary is chunked -- and the MLP is recomputed in the backward pass either way); only
the chunks' matmuls get smaller. So, for a setting the config leaves unset:

- mlp_chunk: halve the sequence while each halving lowers the planned step by at least
  `MIN_GAIN` of it and a chunk keeps at least `MIN_AUTO_MLP_TOKENS` rows (B x chunk) per matmul
  (one device; on a mesh the batch is split, so the MLP is left whole);
- loss_chunk: the largest halving of the sequence whose loss phase is no larger than the backward
  phase (the planner's working sets), but no smaller than `MIN_AUTO_LOSS_CHUNK` tokens, nor, for
  a trained head (whose gradient each chunk adds into), than `MIN_TRAINED_HEAD_ROWS` rows;
- vocab_chunk: only for a frozen head (LoRA, QLoRA: one sweep, no extra FLOPs) whose loss phase
  is still the peak -- typically an NF4 head, whose dense copy is then one chunk: 16384 rows,
  halved while each halving lowers the plan by `MIN_GAIN` (down to 2048), on one device. A
  trained head's vocabulary chunks cost one more head forward: only a budget asks for them.

An explicit setting always wins, `null` (whole sequence / whole vocabulary) included: only a field
the user did not set is filled in. The filled-in config is what is planned, built and written to
the run's config file, so the choice is recorded.
"""

from __future__ import annotations

from featherweight.errors import ConfigError
from featherweight.memory.device_plan import micro_batch_config, plan_one_device
from featherweight.memory.working_set import phase_working_sets
from featherweight.models.config import ModelConfig
from featherweight.recipe.schema import TrainConfig

MIN_AUTO_LOSS_CHUNK = 64  # tokens per row: below this the head's matmuls lose speed
MIN_AUTO_MLP_TOKENS = 256  # rows (batch x chunk) of each MLP matmul
MIN_TRAINED_HEAD_ROWS = 512  # rows (batch x chunk) of a loss chunk whose head gradient is summed
MIN_GAIN = 0.02  # a smaller chunk must lower the planned step by this fraction of it
AUTO_VOCAB_CHUNKS = (16384, 8192, 4096, 2048)  # rows of the LM head at a time
LEAN_DEFAULT_FIELDS = ("mlp_chunk", "loss_chunk", "vocab_chunk")  # memory fields chosen here


def _phase_bytes(config: TrainConfig, model_config: ModelConfig) -> dict[str, int]:
    phases = phase_working_sets(config, model_config)
    return {name: sum(buffer.bytes for buffer in buffers) for name, buffers in phases.items()}


def _with_memory(config: TrainConfig, **values) -> TrainConfig:
    return config.model_copy(update={"memory": config.memory.model_copy(update=values)})


def _planned_bytes(config: TrainConfig, model_config: ModelConfig) -> int | None:
    """The one-device plan's device bytes (None when the config cannot be planned: the caller's
    own checks say why, so no chunk is chosen for it here)."""
    try:
        return plan_one_device(config, model_config).device_bytes
    except ConfigError:
        return None


def auto_loss_chunk(config: TrainConfig, model_config: ModelConfig) -> int | None:
    """The sequence chunk of the loss for these shapes (None: the whole sequence is lean).

    A trained head (full fine-tuning) adds each chunk's head gradient, a [D, V] float32 product,
    into an accumulator: each chunk reads and writes a head-sized buffer, 12 x V x D bytes for
    the chunk's 2 x rows x V x D FLOPs of that gradient. Below `MIN_TRAINED_HEAD_ROWS` rows
    (batch x chunk) that traffic is a visible share of the step (SmolLM2-135M, b2 x 256, on a
    CPU: 4 chunks of 128 rows cost 2.5-3%), so a trained head's chunk keeps at least that many.
    """
    seq = config.data.seq_len
    rows = micro_batch_config(config).batch_size
    least = MIN_TRAINED_HEAD_ROWS if config.method == "full" else 0
    chunk, chosen = seq, None
    while True:
        phases = _phase_bytes(_with_memory(config, loss_chunk=chosen), model_config)
        if phases["loss"] <= phases["backward"]:
            return chosen
        chunk //= 2
        if chunk < MIN_AUTO_LOSS_CHUNK or seq % chunk or rows * chunk < least:
            return chosen
        chosen = chunk


def _with_auto_loss_chunk(config: TrainConfig, model_config: ModelConfig) -> TrainConfig:
    if "loss_chunk" in config.memory.model_fields_set:
        return config
    return _with_memory(config, loss_chunk=auto_loss_chunk(config, model_config))


def auto_mlp_chunk(
    config: TrainConfig, model_config: ModelConfig, sharded: bool = False
) -> int | None:
    """The MLP's sequence chunk for these shapes (None: the whole sequence), the loss chunk
    chosen with each candidate (a smaller backward phase may call for a smaller loss chunk).
    `sharded`: the step runs on a mesh, which splits the batch: the MLP is left whole."""
    if sharded:
        return None
    seq, batch = config.data.seq_len, micro_batch_config(config).batch_size
    chosen = None
    best = _planned_bytes(_with_auto_loss_chunk(config, model_config), model_config)
    chunk = seq // 2
    while best is not None and batch * chunk >= MIN_AUTO_MLP_TOKENS and not seq % chunk:
        planned = _planned_bytes(
            _with_auto_loss_chunk(_with_memory(config, mlp_chunk=chunk), model_config),
            model_config,
        )
        if planned is None or planned > (1 - MIN_GAIN) * best:
            break
        chosen, best, chunk = chunk, planned, chunk // 2
    return chosen


def auto_vocab_chunk(
    config: TrainConfig, model_config: ModelConfig, sharded: bool = False
) -> int | None:
    """The LM head's vocabulary chunk for a frozen head whose loss phase is the peak (None: the
    whole vocabulary); `config` has its other chunks chosen. None for a trained head (one more
    head forward) and on a mesh (`sharded`: it may gather the head, memory/mesh_plan.py)."""
    if config.method == "full" or sharded:
        return None
    phases = _phase_bytes(config, model_config)
    if phases["loss"] <= phases["backward"]:
        return None
    chosen, best = None, _planned_bytes(config, model_config)
    for chunk in AUTO_VOCAB_CHUNKS:
        if best is None or chunk >= model_config.vocab_size:
            continue
        planned = _planned_bytes(_with_memory(config, vocab_chunk=chunk), model_config)
        if planned is None or planned > (1 - MIN_GAIN) * best:
            break
        chosen, best = chunk, planned
    return chosen


def with_lean_defaults(
    config: TrainConfig, model_config: ModelConfig, mesh: object | None = None
) -> TrainConfig:
    """`config` with the memory settings it leaves unset chosen from the shapes (`mlp_chunk`,
    `loss_chunk`, `vocab_chunk`); a config that sets them is returned as it is. `mesh`: the
    mesh the step is built for when not `config.mesh` (one device: None)."""
    chosen, sharded = config.memory.model_fields_set, (mesh or config.mesh) is not None
    if "mlp_chunk" not in chosen:
        config = _with_memory(config, mlp_chunk=auto_mlp_chunk(config, model_config, sharded))
    config = _with_auto_loss_chunk(config, model_config)
    if "vocab_chunk" not in chosen:
        vocab_chunk = auto_vocab_chunk(config, model_config, sharded)
        config = _with_memory(config, vocab_chunk=vocab_chunk)
    return config
