"""`load_model`: a checkpoint on disk -> a `Model` (config, stacked parameters, tokenizer).

Loading is lean: tensors are read one at a time (from safetensors with plain reads, dequantized one
by one from GGUF), cast, optionally NF4-quantized, and written straight into one stacked host
buffer per tensor kind, which goes to the device before the next kind is read. On CPU the device
adopts that buffer without a copy, so host memory holds the model once plus one tensor in flight;
on an accelerator, the host holds at most one stack. With `layers_on_host` (`memory.base: host`)
the layer stacks go to pinned host memory instead, and the device never holds one.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    InputFileError,
    QuantizationError,
    input_file_problem,
)
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.hub import model_location
from featherweight.io.interrupts import raise_if_interrupted
from featherweight.io.safetensors_reader import PICKLE_SUFFIXES, SafetensorsSource, refuse_pickle
from featherweight.models.config import ModelConfig
from featherweight.models.linear import LINEAR_NAMES, Params
from featherweight.models.model import Model
from featherweight.models.shapes import layer_shapes, top_level_shapes
from featherweight.parallel.memory_kinds import host_sharding
from featherweight.quant.nf4 import BLOCK_SIZE, NF4Tensor, quantize_nf4

QUANTIZATIONS = (None, "nf4")
COMPUTE_DTYPES = ("float32", "bfloat16")
_FINITE_CHUNK = 1 << 20  # values checked for NaN/inf at a time
_HOST_ALIGNMENT = 64  # bytes; what XLA's CPU client needs to alias a host array


def open_checkpoint(path: str | Path) -> SafetensorsSource | GGUFSource:
    """Open a Hugging Face directory, a GGUF file or a Hub name's snapshot (`io/hub.py`);
    validates names and shapes from headers."""
    path = model_location(path)
    problem = input_file_problem(path)
    if problem is not None and problem != "is a directory":
        raise (CheckpointNotFoundError if problem.startswith("does not exist") else InputFileError)(
            f"model path {path} {problem}; give a Hugging Face model directory or a .gguf file "
            "(or a Hub name, org/name)"
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
    """The requested compute dtype, checked before any file is opened (None: decide later)."""
    if dtype is None:
        return None
    try:
        resolved = np.dtype(jnp.dtype(dtype))
    except TypeError:
        raise ConfigError(f"dtype {dtype!r} is not a dtype; use 'float32' or 'bfloat16'") from None
    if resolved.name not in COMPUTE_DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use 'float32' or 'bfloat16'")
    return resolved


def _default_dtype(source) -> np.dtype:
    """One compute dtype for the whole model: the checkpoint's when it is float32 or bfloat16,
    else float32 (float16 checkpoints, and GGUF tensors, which dequantize to float32)."""
    stored = np.dtype(source.stored_dtype(("embed", None)))
    return stored if stored.name in COMPUTE_DTYPES else np.dtype(np.float32)


def check_finite(values: np.ndarray, name: str, path) -> np.ndarray:
    """Refuse a tensor holding NaN or inf: training on it would fail steps later, blaming the
    learning rate. One pass over each tensor as it is read (cheap next to reading it)."""
    flat = values.reshape(-1)
    for start in range(0, flat.size, _FINITE_CHUNK):  # a bounded temporary, not a tensor's worth
        if not np.isfinite(flat[start : start + _FINITE_CHUNK]).all():
            raise CorruptCheckpointError(
                f"tensor {name} of {path} holds NaN or infinite values; the checkpoint is damaged "
                "or was saved after a diverged run: download it again or use another one"
            )
    return values


def _stack_layers(
    source, name: str, shape, config: ModelConfig, dtype, quantize: bool, on_host: bool
):
    """Read layer tensor `name` of every layer into one stacked array (or NF4 stack): on the
    device, or with `on_host` in pinned host memory, where the stack is filled layer by layer
    and never reaches the device (an NF4 layer is quantized on the device, one at a time)."""
    if quantize:
        parts, stack = [], None
        for layer in range(config.num_layers):
            raise_if_interrupted()  # a signal a callback swallowed stops the read here
            values = source.read((name, layer)).astype(np.float32, copy=False)
            check_finite(values, f"layer {layer} {name}", source.path)
            # an MoE layer's experts are quantized one by one (an expert is dequantized alone)
            part = quantize_nf4(values, stack_axes=values.ndim - 2, name=f"layer {layer} {name}")
            if not on_host:
                parts.append(part)
                continue
            if stack is None:
                stack = jax.tree.map(
                    lambda leaf: host_buffer((config.num_layers, *leaf.shape), leaf.dtype), part
                )
            for buffer, leaf in zip(jax.tree.leaves(stack), jax.tree.leaves(part), strict=True):
                buffer[layer] = np.asarray(leaf)
        if on_host:
            return jax.device_put(stack, host_sharding())
        return jax.tree.map(lambda *leaves: jnp.stack(leaves), *parts)
    stack = host_buffer((config.num_layers, *shape), dtype)
    for layer in range(config.num_layers):
        raise_if_interrupted()
        source.read_into((name, layer), stack[layer])
        check_finite(stack[layer], f"layer {layer} {name}", source.path)
    return jax.device_put(stack, host_sharding() if on_host else None)


def host_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized host array aligned to 64 bytes.

    On CPU, `jax.device_put` adopts a buffer with this alignment instead of copying it, so a
    tensor read into one is never held twice; on an accelerator it is copied over and freed.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + _HOST_ALIGNMENT, dtype=np.uint8)
    start = -raw.ctypes.data % _HOST_ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def load_model(
    path: str | Path,
    dtype: str | jnp.dtype | None = None,
    quantize: str | None = None,
    quantize_head: bool = False,
    layers_on_host: bool = False,
) -> Model:
    """Load a Llama-family checkpoint (HF directory or GGUF file) into JAX.

    Args:
      path: a Hugging Face model directory (config.json, *.safetensors, tokenizer.json) or a .gguf.
      dtype: the compute dtype, "float32" or "bfloat16"; every tensor is cast to it on load.
        None keeps the checkpoint's when it is one of these, else float32 (float16
        checkpoints; GGUF tensors dequantize to float32).
      quantize: "nf4" quantizes each linear weight of the blocks as it is read (QLoRA's frozen
        base); a full-precision copy of the blocks never exists on the device.
      quantize_head: with "nf4", also quantize the LM head (or the tied embedding table).
      layers_on_host: put the stacked layer tensors in pinned host memory instead of on the
        device (`memory.base: host`): the device never holds the layer stack, not even while
        loading.
    """
    if quantize not in QUANTIZATIONS:
        raise ConfigError(f"quantize={quantize!r} is not supported; use None or 'nf4'")
    if quantize_head and quantize is None:
        raise ConfigError("quantize_head=True needs quantize='nf4'")
    target_dtype = _resolve_dtype(dtype)
    source = open_checkpoint(path)
    config = source.config
    try:
        if target_dtype is None:
            target_dtype = _default_dtype(source)
        params: Params = {}
        for name, shape in top_level_shapes(config).items():
            head_kind = name == "lm_head" or (name == "embed" and config.tie_word_embeddings)
            if quantize_head and head_kind:
                if name == "embed" and shape[-1] % BLOCK_SIZE:
                    raise QuantizationError(
                        f"cannot NF4-quantize the tied embedding table {shape}: the lookup needs "
                        f"rows of whole {BLOCK_SIZE}-value blocks, and the hidden size is "
                        f"{shape[-1]}; load with quantize_head=False"
                    )
                values = check_finite(
                    source.read((name, None)).astype(np.float32, copy=False), name, source.path
                )
                params[name] = quantize_nf4(values, name=name)
                del values
            else:
                buffer = host_buffer(shape, target_dtype)
                source.read_into((name, None), buffer)
                params[name] = jax.device_put(check_finite(buffer, name, source.path))
        params["layers"] = {
            name: _stack_layers(
                source,
                name,
                shape,
                config,
                target_dtype,
                quantize == "nf4" and name in LINEAR_NAMES,
                layers_on_host,
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
