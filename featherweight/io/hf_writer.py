"""Write Hugging Face model directories: config.json, model.safetensors (sharded when large,
with model.safetensors.index.json) and the tokenizer -- atomically, tensor by tensor.

Tensors stream from an iterator; at most one shard (default 2 GiB) is held in host memory.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from featherweight.io.atomic import atomic_directory
from featherweight.io.interrupts import raise_if_interrupted
from featherweight.io.names import StoredTensor, TensorKey, composition, stored_tensors
from featherweight.io.output_paths import resolved
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.models.shapes import layer_shapes, top_level_shapes
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4

DEFAULT_SHARD_BYTES = 2 * 1024**3

# (name, layer or None, dense tensor) -> tensor to write; e.g. merging LoRA adapters.
TensorTransform = Callable[[str, "int | None", np.ndarray], np.ndarray]


def _dense(value, layer: int | None) -> np.ndarray:
    """One tensor as float32-or-stored numpy, dequantizing NF4 one layer at a time."""
    if isinstance(value, NF4Tensor):
        part = value if layer is None else jax.tree.map(lambda leaf: leaf[layer], value)
        return np.asarray(dequantize_nf4(part, jnp.float32))
    return np.asarray(value if layer is None else value[layer])


def iter_tensors(
    params: Params, config: ModelConfig, transform: TensorTransform | None = None
) -> Iterator[tuple[TensorKey, np.ndarray]]:
    """(key, dense tensor) for every tensor of the model, one at a time, through `transform` (a
    signal that a callback swallowed stops the writing at the next one: `io/interrupts.py`)."""
    for name in top_level_shapes(config):
        raise_if_interrupted()
        tensor = _dense(params[name], None)
        yield (name, None), tensor if transform is None else transform(name, None, tensor)
    for layer in range(config.num_layers):
        for name in layer_shapes(config):
            raise_if_interrupted()
            tensor = _dense(params["layers"][name], layer)
            yield (name, layer), tensor if transform is None else transform(name, layer, tensor)


def join_stored(
    layout: list[StoredTensor],
    tensors: Iterable[tuple[TensorKey, np.ndarray]],
    compose: Callable[[str], Callable | None] = lambda name: None,
) -> Iterator[tuple[str, np.ndarray]]:
    """The keyed tensors under their stored names (`names.stored_tensors`), the parts of a fused
    one concatenated along their rows (or made by `compose(name)` when it gives a function)
    once all have come (only those are held back), an MoE
    layer's expert stack one tensor per expert where the name has "{e}"."""
    stored_as = {parts[-1]: (name, parts) for name, parts in layout}
    pending: dict[TensorKey, np.ndarray] = {}
    for key, tensor in tensors:
        if key not in stored_as:
            pending[key] = tensor
            continue
        name, parts = stored_as[key]
        if "{e}" in name:  # an MoE layer's expert stack, stored one tensor per expert
            for expert, part in enumerate(tensor):
                yield name.format(e=expert), part
            continue
        pending[key] = tensor
        joined = [pending.pop(part) for part in parts]
        function = compose(name)
        if function is not None:
            yield name, function(*joined)
        else:
            yield name, joined[0] if len(joined) == 1 else np.concatenate(joined, axis=0)


def hf_named(
    config: ModelConfig, tensors: Iterable[tuple[TensorKey, np.ndarray]]
) -> Iterator[tuple[str, np.ndarray]]:
    """The keyed tensors under their Hugging Face names, the ones the family stores fused
    (Phi-3's `qkv_proj`) concatenated (`join_stored`)."""
    return join_stored(stored_tensors(config), tensors, lambda name: composition(config, name))


def iter_hf_tensors(
    params: Params, config: ModelConfig, transform: TensorTransform | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, tensor) for every tensor of the model, one at a time (`iter_tensors`
    under `hf_named`)."""
    return hf_named(config, iter_tensors(params, config, transform))


def _cast(tensor: np.ndarray, dtype: np.dtype | None) -> np.ndarray:
    return tensor if dtype is None or tensor.dtype == dtype else tensor.astype(dtype)


def write_safetensors_shards(
    directory: Path,
    tensors: Iterable[tuple[str, np.ndarray]],
    dtype: np.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    prefix: str = "model",
) -> list[str]:
    """Write tensors into `prefix.safetensors`, or numbered shards plus an index when large."""
    shards: list[dict[str, np.ndarray]] = []
    current: dict[str, np.ndarray] = {}
    current_bytes = 0
    written: list[str] = []

    def flush() -> None:
        nonlocal current, current_bytes
        if current:
            path = directory / f"{prefix}-part-{len(written) + 1:05d}.safetensors"
            save_file(current, str(path), metadata={"format": "pt"})
            written.append(path.name)
            shards.append({name: None for name in current})  # remember names only
            current, current_bytes = {}, 0

    for name, tensor in tensors:
        tensor = np.ascontiguousarray(_cast(tensor, dtype))
        if current and current_bytes + tensor.nbytes > max_shard_bytes:
            flush()
        current[name] = tensor
        current_bytes += tensor.nbytes
    flush()
    total = len(written)
    if total == 1:
        final = directory / f"{prefix}.safetensors"
        (directory / written[0]).rename(final)
        return [final.name]
    weight_map = {}
    names = []
    for index, (temporary, members) in enumerate(zip(written, shards), start=1):
        final = f"{prefix}-{index:05d}-of-{total:05d}.safetensors"
        (directory / temporary).rename(directory / final)
        names.append(final)
        weight_map.update({name: final for name in members})
    total_size = sum((directory / name).stat().st_size for name in names)
    index_doc = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index_doc, indent=2))
    return names


def save_hf_checkpoint(
    out: str | Path,
    config: ModelConfig,
    tensors: Iterable[tuple[str, np.ndarray]],
    tokenizer: Tokenizer | None,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a Hugging Face model directory at `out` (atomically: complete or absent)."""
    target = (
        None if dtype is None else np.dtype(ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
    )
    with atomic_directory(Path(out), overwrite=overwrite) as staging:
        hf_config = config.to_hf_dict()
        if target is not None:
            hf_config["torch_dtype"] = "bfloat16" if dtype == "bfloat16" else str(np.dtype(target))
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2))
        write_safetensors_shards(staging, tensors, target, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save(staging)
    return resolved(out)
