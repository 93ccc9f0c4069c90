"""Bytes of what a train step keeps between steps: frozen base, trainable weights, optimizer state.

Exact formulas from the model config alone (no arrays, no tracing); `tests/memory` checks each
against the pytrees `train.setup` builds.

Tensors are listed as `Tensor(shape, itemsize, layers, stacked)`: one tensor of `shape` per layer
(`layers` = L for the stacked layer tensors, 1 for embedding, final norm and LM head).
"""

from __future__ import annotations

import math
from typing import NamedTuple

from featherweight.models.config import ModelConfig
from featherweight.models.llama import LINEAR_NAMES
from featherweight.models.shapes import layer_shapes, top_level_shapes
from featherweight.optim.adamw8bit import BLOCK_SIZE, MIN_8BIT_SIZE, adam_8bit_state_bytes
from featherweight.quant.nf4 import nf4_nbytes
from featherweight.recipe.config import TrainConfig
from featherweight.recipe.optimizer import ROW_CHUNKED_OPTIMIZERS
from featherweight.step.streamed import TOP_ROW_CHUNK, top_row_chunk

ADAPTER_ITEMSIZE = 4  # LoRA adapters are float32 (train.setup.ADAPTER_DTYPE)
FACTOR_MIN_DIM = 128  # optax.adafactor's min_dim_size_to_factor


class Tensor(NamedTuple):
    """One parameter tensor per layer: shape, bytes per value, and how many layers hold it
    (`stacked`: part of the layer stack the backward loop walks)."""

    shape: tuple[int, ...]
    itemsize: int
    layers: int
    stacked: bool

    @property
    def values(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.layers * self.values * self.itemsize


def compute_itemsize(config: TrainConfig) -> int:
    """Bytes per value of the parameter and activation dtype (float32: 4, bfloat16: 2)."""
    return 4 if config.model.dtype == "float32" else 2


def trainable_tensors(config: TrainConfig, model_config: ModelConfig) -> list[Tensor]:
    """Every trainable tensor: all parameters for full fine-tuning, else the LoRA adapters
    (A [r, in] and B [out, r] per target and layer, float32)."""
    layers = model_config.num_layers
    if config.method == "full":
        itemsize = compute_itemsize(config)
        top = [
            Tensor(shape, itemsize, 1, False) for shape in top_level_shapes(model_config).values()
        ]
        stack = [
            Tensor(shape, itemsize, layers, True) for shape in layer_shapes(model_config).values()
        ]
        return top + stack
    shapes, rank = layer_shapes(model_config), config.lora.rank
    tensors = []
    for target in config.lora.targets:
        out_features, in_features = shapes[target]
        tensors.append(Tensor((rank, in_features), ADAPTER_ITEMSIZE, layers, True))
        tensors.append(Tensor((out_features, rank), ADAPTER_ITEMSIZE, layers, True))
    return tensors


def frozen_base_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The frozen base: nothing for full fine-tuning; every parameter in the compute dtype for
    LoRA; for QLoRA the layers' linear weights in NF4 (`nf4_nbytes`: 4-bit codes, 8-bit absmax
    per 64 values, a float32 scale per 256 absmax, an offset), the rest in the compute dtype (and
    the LM head, or tied embedding, in NF4 too with `quantize_head`)."""
    if config.method == "full":
        return 0
    itemsize, layers = compute_itemsize(config), model_config.num_layers
    quantized = config.method == "qlora"
    total = 0
    for name, shape in layer_shapes(model_config).items():
        values = math.prod(shape)
        dense = quantized and name in LINEAR_NAMES
        total += layers * (nf4_nbytes(values) if dense else values * itemsize)
    head = "embed" if model_config.tie_word_embeddings else "lm_head"
    for name, shape in top_level_shapes(model_config).items():
        values = math.prod(shape)
        nf4 = quantized and config.model.quantize_head and name == head
        total += nf4_nbytes(values) if nf4 else values * itemsize
    return total


def host_embedding_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """The token-embedding table kept in host memory (`memory.embed: host`; frozen, or trained
    in row chunks with full fine-tuning), else 0."""
    if config.memory.embed != "host":
        return 0
    return math.prod(top_level_shapes(model_config)["embed"]) * compute_itemsize(config)


# optimizers whose every state leaf is a scalar or shaped like its parameter: their update can
# run over row chunks of a [V, D] tensor (featherweight/step/streamed.py)


def top_optimizer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Optimizer state of a trainable tensor outside the layer stack (embedding or LM head) that
    is on the device at once for its update when the state lives on the host: a row chunk of it
    for elementwise optimizers (featherweight/step/streamed.py `top_row_chunk`), all of it else."""
    name, momentum = config.optimizer.name, config.optimizer.b1 > 0
    target = config.memory.vocab_chunk or TOP_ROW_CHUNK
    largest = 0
    for tensor in trainable_tensors(config, model_config):
        if tensor.stacked:
            continue
        state = optimizer_tensor_bytes(name, momentum, tensor)
        chunk = top_row_chunk(tensor.shape, target)
        if chunk is not None and name in ROW_CHUNKED_OPTIMIZERS:
            state = state * chunk // tensor.shape[0]
        largest = max(largest, state)
    return largest


def trainable_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Sum of `trainable_tensors`."""
    return sum(tensor.nbytes for tensor in trainable_tensors(config, model_config))


def _adafactor_bytes(shape: tuple[int, ...], itemsize: int) -> int:
    """optax.adafactor's second-moment estimate: a row and a column vector when the two largest
    dimensions are both >= 128 (factored), else a full copy; plus two 1-value placeholders."""
    ordered = sorted(shape)
    if len(shape) >= 2 and ordered[-2] >= FACTOR_MIN_DIM:
        values = math.prod(shape)
        return itemsize * (values // ordered[-1] + values // ordered[-2] + 1)
    return itemsize * (math.prod(shape) + 2)


def optimizer_tensor_bytes(name: str, momentum: bool, tensor: Tensor) -> int:
    """Optimizer state of one tensor of one layer (the streamed step keeps one state per tensor
    and layer, so step counters repeat per layer):

    - adamw: two moments in the parameter dtype, 2 x n x itemsize, + 2 int32 counters;
    - adamw_8bit: `adam_8bit_state_bytes(n)` (2 n + 8 per block of 256; float32 moments below
      4096 values) + 2 counters;
    - sgd: a momentum trace n x itemsize when b1 > 0, + 1 counter;
    - lion: one moment n x itemsize + 2 counters;
    - adafactor: factored second moment (see `_adafactor_bytes`) + 2 counters.
    """
    values, itemsize = tensor.values, tensor.itemsize
    if name == "adamw":
        return 2 * values * itemsize + 8
    if name == "adamw_8bit":
        return adam_8bit_state_bytes(values, BLOCK_SIZE, MIN_8BIT_SIZE) + 8
    if name == "sgd":
        return (values * itemsize if momentum else 0) + 4
    if name == "lion":
        return values * itemsize + 8
    return _adafactor_bytes(tensor.shape, itemsize) + 8


def optimizer_state_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Optimizer state of every trainable tensor and layer (`optimizer_tensor_bytes`)."""
    name, momentum = config.optimizer.name, config.optimizer.b1 > 0
    return sum(
        tensor.layers * optimizer_tensor_bytes(name, momentum, tensor)
        for tensor in trainable_tensors(config, model_config)
    )


def layer_optimizer_bytes(config: TrainConfig, model_config: ModelConfig) -> int:
    """Optimizer state of one layer's trainable tensors (the slice the backward loop updates)."""
    name, momentum = config.optimizer.name, config.optimizer.b1 > 0
    return sum(
        optimizer_tensor_bytes(name, momentum, tensor)
        for tensor in trainable_tensors(config, model_config)
        if tensor.stacked
    )
