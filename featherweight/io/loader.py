"""`load_model`: a checkpoint on disk -> a `Model` (config, stacked parameters, tokenizer).

Loading is lean: tensors are read one at a time (lazily from safetensors, dequantized one by one
from GGUF), cast, optionally NF4-quantized, and gathered into one stacked array per tensor kind,
which goes to the device before the next kind is read. Host memory holds the device copy plus at
most one stack in flight -- never the model twice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import CheckpointNotFoundError, ConfigError
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.names import TensorKey
from featherweight.io.safetensors_reader import PICKLE_SUFFIXES, SafetensorsSource, refuse_pickle
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig
from featherweight.models.llama import LINEAR_NAMES, Params
from featherweight.models.shapes import layer_shapes, top_level_shapes
from featherweight.quant.nf4 import NF4Tensor, quantize_nf4

QUANTIZATIONS = (None, "nf4")


@dataclasses.dataclass
class Model:
    """A loaded model: config, parameter pytree (layers stacked on axis 0) and tokenizer."""

    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    source: Path

    @property
    def dtype(self) -> jnp.dtype:
        """The compute dtype (that of the final norm weight)."""
        return self.params["final_norm"].dtype


def open_checkpoint(path: str | Path) -> SafetensorsSource | GGUFSource:
    """Open a Hugging Face directory or a GGUF file; validates names and shapes from headers."""
    path = Path(path).expanduser()
    if not path.exists():
        raise CheckpointNotFoundError(
            f"model path {path} does not exist; give a Hugging Face model directory or a .gguf file"
        )
    if path.is_file():
        if path.suffix == ".gguf":
            return GGUFSource(path)
        if path.suffix in PICKLE_SUFFIXES:
            refuse_pickle(path)
        if path.name == "config.json":
            return SafetensorsSource(path.parent)
        raise CheckpointNotFoundError(
            f"{path} is neither a .gguf file nor a model directory; point at the directory "
            "holding config.json and *.safetensors"
        )
    return SafetensorsSource(path)


def _resolve_dtype(dtype) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        return np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ConfigError(f"dtype {dtype!r} is not a dtype; use 'float32' or 'bfloat16'") from None


def _cast(values: np.ndarray, dtype: np.dtype | None, source, key: TensorKey) -> np.ndarray:
    target = dtype or source.stored_dtype(key)
    return values if values.dtype == target else values.astype(target)


def _stack_layers(source, name: str, shape, config: ModelConfig, dtype, quantize: bool):
    """Read layer tensor `name` of every layer into one stacked device array (or NF4 stack)."""
    if quantize:
        parts = []
        for layer in range(config.num_layers):
            values = source.read((name, layer)).astype(np.float32)
            parts.append(quantize_nf4(values, name=f"layer {layer} {name}"))
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *parts)
    first_dtype = dtype or source.stored_dtype((name, 0))
    stack = np.empty((config.num_layers, *shape), dtype=first_dtype)
    for layer in range(config.num_layers):
        stack[layer] = _cast(source.read((name, layer)), first_dtype, source, (name, layer))
    placed = jax.device_put(stack)
    del stack
    return placed


def load_model(
    path: str | Path,
    dtype: str | jnp.dtype | None = None,
    quantize: str | None = None,
    quantize_head: bool = False,
) -> Model:
    """Load a Llama-family checkpoint (HF directory or GGUF file) into JAX.

    Args:
      path: a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf.
      dtype: cast every tensor on load (e.g. "bfloat16"); None keeps the stored dtype
        (dequantized GGUF tensors are float32).
      quantize: "nf4" quantizes each linear weight of the blocks as it is read (QLoRA's frozen
        base); a full-precision copy of the blocks never exists on the device.
      quantize_head: with "nf4", also quantize the LM head (or the tied embedding table).
    """
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize={quantize!r} is not supported; use None or 'nf4'")
    if quantize_head and quantize is None:
        raise ConfigError("quantize_head=True needs quantize='nf4'")
    target_dtype = _resolve_dtype(dtype)
    source = open_checkpoint(path)
    config = source.config
    try:
        params: Params = {}
        for name in top_level_shapes(config):
            values = _cast(source.read((name, None)), target_dtype, source, (name, None))
            head_kind = name == "lm_head" or (name == "embed" and config.tie_word_embeddings)
            if quantize_head and head_kind:
                params[name] = quantize_nf4(values.astype(np.float32), name=name)
            else:
                params[name] = jax.device_put(values)
            del values
        params["layers"] = {
            name: _stack_layers(
                source,
                name,
                shape,
                config,
                target_dtype,
                quantize == "nf4" and name in LINEAR_NAMES,
            )
            for name, shape in layer_shapes(config).items()
        }
        tokenizer = source.tokenizer()
    finally:
        source.close()
    return Model(config=config, params=params, tokenizer=tokenizer, source=Path(path))


def params_nbytes(params: Params) -> int:
    """Bytes held by a parameter pytree (NF4 tensors count their packed storage)."""
    total = 0
    for leaf in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, NF4Tensor)):
        total += leaf.nbytes if isinstance(leaf, NF4Tensor) else leaf.size * leaf.dtype.itemsize
    return int(total)
