"""Bytes of what a train step keeps between steps, read off the real initialisers' abstract output.

`jax.eval_shape` of the functions the trainer itself runs -- `recipe.build.abstract_split` for the
trainable and frozen pytrees (adapters, NF4 tensors with their absmax and scales) and the
configured step's optimizer-state initialiser (`recipe.build.opt_state_initializer`, any optax
transformation, 8-bit AdamW included) -- gives every array's shape and dtype without allocating
one. The bytes are exact by construction: there is no per-optimizer or per-format formula to keep
in step with the code.

The shapes depend only on the model, the method, the dtype, the LoRA settings, the optimizer and
the step kind, so they are cached on those: the budget search plans many candidates that differ
in batch, sequence or memory policy and share them.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax

from featherweight.models.config import ModelConfig
from featherweight.recipe.build import abstract_split, opt_state_initializer
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.schema import DataSettings, MemorySettings, TrainConfig
from featherweight.step.top_update import TOP_ROW_CHUNK, row_chunkable, top_row_chunk


class StateShapes(NamedTuple):
    """Abstract (`jax.ShapeDtypeStruct`) trainable and frozen parameters and optimizer state, as
    the configured step keeps them; `layer_state` is the per-tensor state stacked per layer that
    the streamed step's backward loop slices (the streamed layout, whatever the step kind)."""

    trainable: Any
    frozen: Any
    opt_state: Any
    layer_state: Any


def compute_itemsize(config: TrainConfig) -> int:
    """Bytes per value of the parameter and activation dtype (float32: 4, bfloat16: 2)."""
    return 4 if config.model.dtype == "float32" else 2


def tree_bytes(tree: Any) -> int:
    """Bytes of every array leaf of `tree` (arrays or abstract shapes)."""
    return sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(tree))


def _shape_key(config: TrainConfig) -> TrainConfig:
    """`config` with everything that cannot change a persistent shape set to its default."""
    memory = MemorySettings(
        step=config.memory.step, accumulation_steps=config.memory.accumulation_steps
    )
    return config.model_copy(
        update={"batch_size": 1, "steps": 1, "data": DataSettings(), "memory": memory, "mesh": None}
    )


@functools.lru_cache(maxsize=128)
def _state_shapes(key: TrainConfig, model_config: ModelConfig) -> StateShapes:
    trainable, frozen = abstract_split(key, model_config)
    optimizer = make_optimizer(key.optimizer, key.steps)
    opt_state = jax.eval_shape(opt_state_initializer(key, optimizer), trainable)
    streamed = key.model_copy(update={"memory": MemorySettings()})
    layer_state = jax.eval_shape(opt_state_initializer(streamed, optimizer), trainable).layers
    return StateShapes(trainable, frozen, opt_state, layer_state)


def state_shapes(config: TrainConfig, model_config: ModelConfig) -> StateShapes:
    """The abstract persistent state of the step `config` describes (cached)."""
    return _state_shapes(_shape_key(config), model_config)


def _host_embedding(config: TrainConfig, shapes: StateShapes) -> Any:
    if config.memory.embed != "host":
        return None
    return shapes.trainable.get("embed", shapes.frozen.get("embed"))


def frozen_base_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The frozen pytree: nothing for full fine-tuning, every parameter for LoRA, NF4 linear
    weights (and head, with `quantize_head`) plus the rest in the compute dtype for QLoRA."""
    return tree_bytes(state_shapes(config, model_config).frozen)


def trainable_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The trainable pytree: every parameter (full fine-tuning) or the float32 adapters."""
    return tree_bytes(state_shapes(config, model_config).trainable)


def optimizer_state_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The optimizer state in the configured step's layout (streamed: one state per tensor and
    layer, step counters included; reference: optax's own)."""
    return tree_bytes(state_shapes(config, model_config).opt_state)


def host_embedding_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The token-embedding table kept in host memory (`memory.embed: host`), else 0."""
    table = _host_embedding(config, state_shapes(config, model_config))
    return 0 if table is None else tree_bytes(table)


def host_base_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The frozen layer stack kept in host memory (`memory.base: host`), else 0."""
    return frozen_layer_bytes(config, model_config) if config.memory.base == "host" else 0


def frozen_layer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The frozen layer stack (NF4 codes and scales, or the compute dtype; norms included)."""
    return tree_bytes(state_shapes(config, model_config).frozen.get("layers", {}))


def layer_gradient_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """One layer's slice of the stacked trainable tensors: the gradient the backward loop holds."""
    layers = state_shapes(config, model_config).trainable.get("layers", {})
    return tree_bytes(layers) // model_config.num_layers


def layer_optimizer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """One layer's slice of the stacked per-tensor optimizer state (what one layer's update reads
    and writes)."""
    return tree_bytes(state_shapes(config, model_config).layer_state) // model_config.num_layers


def top_optimizer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The largest optimizer state of a trainable tensor outside the layer stack (head or
    embedding) that is on the device at once for its update when the state lives on the host:
    a row chunk of it when every state leaf is row-shaped or scalar (`top_update.row_chunkable`,
    `top_row_chunk`), all of it otherwise."""
    shapes = state_shapes(config, model_config)
    if config.memory.step != "streamed":
        return 0
    target = config.memory.vocab_chunk or TOP_ROW_CHUNK
    largest = 0
    for name, state in shapes.opt_state.top.items():
        param = shapes.trainable[name]
        chunk = top_row_chunk(param.shape, target)
        if chunk is not None and row_chunkable(state, param):
            rows = sum(tree_bytes(leaf) for leaf in jax.tree.leaves(state) if leaf.ndim)
            scalars = tree_bytes(state) - rows
            largest = max(largest, rows * chunk // param.shape[0] + scalars)
        else:
            largest = max(largest, tree_bytes(state))
    return largest


def output_buffer_count(config: TrainConfig, model_config: ModelConfig) -> int:
    """The step's output buffers: every trainable and optimizer-state leaf, and 5 metrics."""
    shapes = state_shapes(config, model_config)
    return len(jax.tree.leaves(shapes.trainable)) + len(jax.tree.leaves(shapes.opt_state)) + 5
