"""Lean defaults: the chunks of the LM head and of the MLP, chosen from the shapes when the config
sets none.

Without a chunk the loss materializes B x S x V float32 logits (and their gradient), which at
typical fine-tuning shapes is the step's peak: SmolLM2-135M at b2 x 2048 holds 768 MiB of logits,
more than a layer's whole backward pass. Without an MLP chunk each layer's backward holds B x S x F
hidden activations (gate, up, their product and gradients), 3-4x the D-wide ones. No chunk chosen
here costs matmul FLOPs (step/loss.py makes each logits chunk once -- a frozen head's vocabulary
chunks in one sweep -- and the MLP is recomputed in the backward pass either way), but each
sequence chunk of the loss streams the whole LM head through its matmuls again
(`memory/step_cost.py`, `head_matmul_bytes`): SmolLM2-135M LoRA at b2 x 256 on this CPU took
2-5% longer in 64-token chunks (128 rows each) than with 4096-row vocabulary chunks of about the
same planned bytes (benchmarks/results/memory_settings_lora_cpu.md: 1.053, its A/A row 1.024),
while a frozen head's vocabulary chunks read the head no more often than the whole head does.
So, for a setting the config leaves "auto" (the default):

- mlp_chunk: halve the sequence while each halving lowers the planned step by at least
  `MIN_GAIN` of it and a chunk keeps at least `MIN_AUTO_MLP_TOKENS` rows (B x chunk) per matmul
  (one device; on a mesh the batch is split, so the MLP is left whole);
- the head's chunks, until the loss phase is no larger than the backward phase (the planner's
  working sets): first the sequence, the largest halving that is enough, but no chunk below
  `MIN_AUTO_LOSS_CHUNK` tokens nor `MIN_HEAD_ROWS` rows (B x chunk: the head streams through
  once per chunk; for a trained head each chunk also adds a head-sized gradient); then, for a
  frozen head (LoRA, QLoRA) on one device whose loss phase is still the peak, the vocabulary:
  `AUTO_VOCAB_CHUNKS` rows (16384, halved down to 2048), the largest that is enough. A trained
  head's vocabulary chunks cost one more head forward, and on a mesh a vocabulary chunk may
  gather the head (memory/mesh_plan.py): only a budget asks for them there.

Each of these settings is "auto" by default; an explicit setting always wins, `null` (whole
sequence / whole vocabulary) included. `resolve` is the one place "auto" becomes a value: the step
builder and the planner refuse a config that still holds one (`recipe.schema.require_resolved`),
and the resolved config is what is planned, built and written to the run's config file, so the
choice is recorded and a resumed run takes it from there (`recipe.schema.take_saved_choices`).
"""

from __future__ import annotations

from featherweight.errors import ConfigError
from featherweight.memory.device_plan import micro_batch_config, plan_one_device
from featherweight.memory.working_set import phase_working_sets
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.parallel.sharding import planning_mesh
from featherweight.recipe.placement import placement_allowed
from featherweight.recipe.schema import TrainConfig

MIN_AUTO_LOSS_CHUNK = 64  # tokens per row: below this the head's matmuls lose speed
MIN_AUTO_MLP_TOKENS = 256  # rows (batch x chunk) of each MLP matmul
MIN_HEAD_ROWS = 512  # rows (batch x chunk) of a loss chunk: the head streams through once per chunk
MIN_GAIN = 0.02  # a smaller chunk must lower the planned step by this fraction of it
AUTO_VOCAB_CHUNKS = (16384, 8192, 4096, 2048)  # rows of the LM head at a time


def _phase_bytes(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> dict[str, int]:
    phases = phase_working_sets(config, model_config, target)
    return {name: sum(buffer.bytes for buffer in buffers) for name, buffers in phases.items()}


def _with_memory(config: TrainConfig, **values) -> TrainConfig:
    return config.model_copy(update={"memory": config.memory.model_copy(update=values)})


def _planned_bytes(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> int | None:
    """The one-device plan's device bytes (None when the config cannot be planned: the caller's
    own checks say why, so no chunk is chosen for it here)."""
    try:
        return plan_one_device(config, model_config, target).device_bytes
    except ConfigError:
        return None


def _loss_is_lean(config: TrainConfig, model_config: ModelConfig, target: AttentionTarget) -> bool:
    phases = _phase_bytes(config, model_config, target)
    return phases["loss"] <= phases["backward"]


def auto_loss_chunk(
    config: TrainConfig,
    model_config: ModelConfig,
    sharded: bool = False,
    target: AttentionTarget | None = None,
) -> int | None:
    """The sequence chunk of the loss for these shapes and `config`'s vocabulary chunk on
    `target` (default: this process's device; None: the whole sequence is lean, or no chunk
    keeps enough rows). `sharded`: on a mesh, where no
    vocabulary chunk follows, a frozen head's chunk keeps only `MIN_AUTO_LOSS_CHUNK` tokens.

    Each chunk streams the whole head through its matmuls (logits and d_hidden) and, for a
    trained head, adds its [D, V] float32 gradient into an accumulator: 12 x V x D bytes for
    the chunk's 2 x rows x V x D FLOPs of that gradient. Below `MIN_HEAD_ROWS` rows (batch x
    chunk) that traffic is a visible share of the step (SmolLM2-135M, b2 x 256, on a CPU: 4
    chunks of 128 rows cost 2.5-3% with a trained head, 2-5% with a frozen one).
    """
    target = target or AttentionTarget.of_device()
    seq = config.data.seq_len
    rows = micro_batch_config(config).batch_size
    least = MIN_HEAD_ROWS if config.method == "full" or not sharded else 0
    chunk, chosen = seq, None
    while not _loss_is_lean(_with_memory(config, loss_chunk=chosen), model_config, target):
        chunk //= 2
        if chunk < MIN_AUTO_LOSS_CHUNK or seq % chunk or rows * chunk < least:
            break
        chosen = chunk
    return chosen


def auto_vocab_chunk(
    config: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget,
    sharded: bool = False,
) -> int | None:
    """The LM head's vocabulary chunk (None: the whole vocabulary) of a frozen head on one device,
    at `config`'s loss chunk: the largest of `AUTO_VOCAB_CHUNKS` whose loss phase is no larger
    than the backward phase, else the smallest. None for a trained head (one more head forward)
    and on a mesh (`sharded`: it may gather the head)."""
    if config.method == "full" or sharded:
        return None
    if _loss_is_lean(_with_memory(config, vocab_chunk=None), model_config, target):
        return None
    chunks = [chunk for chunk in AUTO_VOCAB_CHUNKS if chunk < model_config.vocab_size]
    for chunk in chunks:
        if _loss_is_lean(_with_memory(config, vocab_chunk=chunk), model_config, target):
            return chunk
    return chunks[-1] if chunks else None


def _with_head_chunks(
    config: TrainConfig,
    model_config: ModelConfig,
    auto: frozenset[str],
    target: AttentionTarget,
    sharded: bool = False,
) -> TrainConfig:
    """`config` with the head's chunks named in `auto` chosen (`config` holds None for them):
    the sequence first (down to `MIN_HEAD_ROWS` rows), then a frozen head's vocabulary on one
    device."""
    if "loss_chunk" in auto:
        chunk = auto_loss_chunk(config, model_config, sharded, target)
        config = _with_memory(config, loss_chunk=chunk)
    if "vocab_chunk" in auto:
        chunk = auto_vocab_chunk(config, model_config, target, sharded)
        config = _with_memory(config, vocab_chunk=chunk or config.memory.vocab_chunk)
    return config


def needed_vocab_chunk(config: TrainConfig, model_config: ModelConfig) -> int | None:
    """The vocabulary chunk `config` cannot do without (None: the whole vocabulary is allowed): a
    tied table on the host is read by the head in chunks (`recipe.placement.check_placements`),
    at least the largest of `AUTO_VOCAB_CHUNKS` below the vocabulary."""
    if placement_allowed(_with_memory(config, vocab_chunk=None), model_config):
        return None
    chunk = next((c for c in AUTO_VOCAB_CHUNKS if c < model_config.vocab_size), None)
    if chunk is None or not placement_allowed(
        _with_memory(config, vocab_chunk=chunk), model_config
    ):
        return None  # refused either way: the config checks say why
    return chunk


def auto_mlp_chunk(
    config: TrainConfig,
    model_config: ModelConfig,
    target: AttentionTarget,
    sharded: bool = False,
    auto_head: frozenset[str] = frozenset(),
) -> int | None:
    """The MLP's sequence chunk for these shapes on `target` (None: the whole sequence), the
    head's chunks
    named in `auto_head` (None in `config`) chosen with each candidate (a smaller backward phase
    may call for smaller head chunks). `sharded`: the step runs on a mesh, which splits the
    batch: the MLP is left whole."""
    if sharded:
        return None
    seq, batch = config.data.seq_len, micro_batch_config(config).batch_size
    chosen = None
    best = _planned_bytes(
        _with_head_chunks(config, model_config, auto_head, target), model_config, target
    )
    chunk = seq // 2
    while best is not None and batch * chunk >= MIN_AUTO_MLP_TOKENS and not seq % chunk:
        chunked = _with_memory(config, mlp_chunk=chunk)
        planned = _planned_bytes(
            _with_head_chunks(chunked, model_config, auto_head, target), model_config, target
        )
        if planned is None or planned > (1 - MIN_GAIN) * best:
            break
        chosen, best, chunk = chunk, planned, chunk // 2
    return chosen


def is_sharded(config: TrainConfig, mesh: object | None = None) -> bool:
    """Whether the step runs on more than one device: on `mesh` when given (a `Mesh` or
    `AbstractMesh`), else on the mesh `config.mesh` describes. A mesh of one device (the
    one-device mesh a `--target` compiles on) is one device."""
    if mesh is None and config.mesh is not None:
        mesh = planning_mesh(config.mesh)
    return mesh is not None and mesh.size > 1


def resolve(
    config: TrainConfig,
    model_config: ModelConfig,
    mesh: object | None = None,
    target: AttentionTarget | None = None,
) -> TrainConfig:
    """`config` with every setting still "auto" chosen from the shapes (`mlp_chunk`,
    `loss_chunk`, `vocab_chunk`) of the step compiled for `target` (default: this process's
    device): the config that is planned, built and recorded. `mesh`: the mesh the step is built
    for when not the one `config.mesh` describes (None: that one, or one device). A resolved
    config is returned as it is."""
    auto = frozenset(config.memory.unresolved)
    if not auto:
        return config
    target = target or AttentionTarget.of_device()
    sharded = is_sharded(config, mesh)
    # what each "auto" is measured from: no chunk, or the vocabulary chunk the config needs
    config = _with_memory(config, **dict.fromkeys(auto, None))
    if "vocab_chunk" in auto:
        config = _with_memory(config, vocab_chunk=needed_vocab_chunk(config, model_config))
    auto_head = auto - {"mlp_chunk"}
    if "mlp_chunk" in auto:
        chunk = auto_mlp_chunk(config, model_config, target, sharded, auto_head)
        config = _with_memory(config, mlp_chunk=chunk)
    return _with_head_chunks(config, model_config, auto_head, target, sharded)


with_lean_defaults = resolve  # the name benchmarks/gpu_check.py still imports
