"""Where each array of a run lives: the one owner of host placement.

Four memory settings may put something in pinned host memory (`HOST_SETTINGS`): the residual
stream (`memory.residuals`, placed by the step itself: it exists only inside it), and three step
arguments (`ARGUMENT_SETTINGS`): the optimizer state, the embedding table and the frozen layer
stack. This module decides, for all callers, which arrays those are:

- `check_placements(config, model_config)`: the legality rules, the one function config checks
  and the budget search call;
- `place(config, trainable, opt_state, frozen, move)`: moves the arguments each host setting
  names with `move` -- real arrays into pinned host memory (`to_host_memory`), or abstract shapes
  (`abstract_on_host`) -- for the trainer, measurement, planning and benchmarks alike;
- `opt_state_placement(config)`: where the optimizer-state initialiser creates the state (tensor
  by tensor, so the device never holds all of it).

The step follows the arrays: it reads each argument's memory space (`jax.typeof(x).memory_space`)
and moves host-resident arrays the only ways XLA's GPU compiler accepts
(`parallel/memory_kinds.py`, checked by `parallel/offload_rules.py`). Checkpoint restore keeps
each leaf's memory kind (`train/checkpoint.py`), so a resumed run is placed as it was saved.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from featherweight.errors import ConfigError
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.parallel.memory_kinds import abstract_on_host, host_sharding
from featherweight.recipe.optimizer import ROW_CHUNKED_OPTIMIZERS
from featherweight.recipe.schema import TrainConfig
from featherweight.step.policy import DEQUANTIZED

HOST_SETTINGS = ("residuals", "optimizer_state", "embed", "base")  # memory.<name>: host
ARGUMENT_SETTINGS = ("optimizer_state", "embed", "base")  # those that place step arguments


def on_host(config: TrainConfig) -> tuple[str, ...]:
    """The memory settings of `config` set to host, in `HOST_SETTINGS` order."""
    return tuple(name for name in HOST_SETTINGS if getattr(config.memory, name) == "host")


def arguments_on_host(config: TrainConfig) -> tuple[str, ...]:
    """The settings that place step arguments in host memory (not the residual stream)."""
    return tuple(name for name in on_host(config) if name in ARGUMENT_SETTINGS)


def opt_state_placement(config: TrainConfig) -> str:
    """ "host" or "device": where the optimizer-state initialiser puts the state."""
    return config.memory.optimizer_state


def to_host_memory(tree):
    """Real arrays moved into pinned host memory (already there: unchanged, no copy)."""
    sharding = host_sharding()
    return jax.tree.map(lambda leaf: jax.device_put(leaf, sharding), tree)


def place(
    config: TrainConfig,
    trainable: Params,
    opt_state: Any,
    frozen: Params,
    move: Callable[[Any], Any] = to_host_memory,
) -> tuple[Params, Any, Params]:
    """(trainable, opt_state, frozen) with every argument a host setting names moved by `move`.

    memory.optimizer_state: host -- the whole state; memory.embed: host -- the embedding table
    (trained with full fine-tuning, frozen otherwise); memory.base: host -- the frozen layer stack.
    `move` is `to_host_memory` for arrays, `abstract_on_host` for `jax.ShapeDtypeStruct`s.
    """
    placed = arguments_on_host(config)
    if "optimizer_state" in placed:
        opt_state = move(opt_state)
    if "embed" in placed:
        if "embed" in trainable:
            trainable = {**trainable, "embed": move(trainable["embed"])}
        else:
            frozen = {**frozen, "embed": move(frozen["embed"])}
    if "base" in placed:
        frozen = {**frozen, "layers": move(frozen["layers"])}
    return trainable, opt_state, frozen


def place_abstract(
    config: TrainConfig, trainable: Params, opt_state: Any, frozen: Params
) -> tuple[Params, Any, Params]:
    """`place` for abstract shapes: the arguments a step is compiled or lowered on."""
    return place(config, trainable, opt_state, frozen, abstract_on_host)


def check_placements(config: TrainConfig, model_config: ModelConfig) -> None:
    """Refuse host placements that cannot run, naming what to change.

    Host placements of step arguments need the streamed step on one device (on a mesh they are
    refused, not sharded: FSDP already divides that memory over the devices). The base on the
    host needs a frozen base (LoRA/QLoRA). A host embedding trained (full fine-tuning) must be
    untied and use an elementwise optimizer (it is updated in row chunks); a frozen one that is
    also the (tied) LM head must be read in vocabulary chunks.
    """
    memory = config.memory
    placed = [f"memory.{name}: host" for name in arguments_on_host(config)]
    if not placed:
        return
    if memory.base == "host" and config.method == "full":
        raise ConfigError(
            "memory.base: host keeps the frozen base in host memory, and method: full has none "
            "(every weight trains); use method lora or qlora, or memory.base: device"
        )
    if memory.base == "host" and DEQUANTIZED in memory.save:
        raise ConfigError(
            f"memory.save: {DEQUANTIZED} keeps every layer's weights dense from the forward pass "
            "to the backward pass, which memory.base: host exists to avoid; drop one of them"
        )
    if memory.step == "reference":
        raise ConfigError(
            f"{', '.join(placed)} needs the streamed step (it moves one layer at a time); "
            "set memory.step: streamed"
        )
    if config.mesh is not None:
        raise ConfigError(
            f"{', '.join(placed)} is supported on one device only; on a mesh FSDP divides that "
            "memory instead: drop the host placement, or set mesh: null"
        )
    if memory.embed != "host":
        return
    if config.method == "full":
        if model_config.tie_word_embeddings:
            raise ConfigError(
                "memory.embed: host with method: full needs untied embeddings: a tied table is "
                "also the LM head, whose gradient covers every row; use memory.embed: device, "
                "or method lora/qlora (the table is frozen there)"
            )
        if config.optimizer.name not in ROW_CHUNKED_OPTIMIZERS:
            raise ConfigError(
                f"memory.embed: host with method: full updates the table in row chunks, which "
                f"optimizer {config.optimizer.name!r} cannot (its state is not elementwise); use "
                "optimizer adamw, sgd or lion, or memory.embed: device"
            )
        if memory.accumulation_steps > 1:
            raise ConfigError(
                "memory.accumulation_steps > 1 with method: full keeps a gradient buffer on the "
                "device, which an embedding trained in host memory has not; use memory.embed: "
                "device, or memory.accumulation_steps: 1"
            )
    elif model_config.tie_word_embeddings:
        if config.model.quantize_head:
            raise ConfigError(
                "memory.embed: host and model.quantize_head: true both claim the tied embedding "
                "table; choose one"
            )
        if memory.vocab_chunk is None:
            raise ConfigError(
                "memory.embed: host with tied embeddings: the LM head reads the table from the "
                "host chunk by chunk; set memory.vocab_chunk (e.g. 8192)"
            )


def placement_allowed(config: TrainConfig, model_config: ModelConfig) -> bool:
    """Whether `check_placements` accepts `config` (for searches that only need yes or no)."""
    try:
        check_placements(config, model_config)
    except ConfigError:
        return False
    return True
