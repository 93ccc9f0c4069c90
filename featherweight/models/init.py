"""Random parameters for a config: tiny models in tests and benchmarks (normal(0, 0.02) weights,
unit norm scales, small biases), with the same pytree layout as a loaded checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.models.shapes import layer_shapes, top_level_shapes


def _init(key: jax.Array, name: str, shape: tuple[int, ...], dtype, offset: float) -> jax.Array:
    if name.endswith("norm"):  # a unit scale: (offset + w) = 1 where the family offsets w
        return jnp.full(shape, 1.0 - offset, dtype)
    if name.endswith("bias"):
        return (0.02 * jax.random.normal(key, shape)).astype(dtype)
    return (0.02 * jax.random.normal(key, shape)).astype(dtype)


def init_params(key: jax.Array, config: ModelConfig, dtype=jnp.float32) -> Params:
    """A full parameter pytree for `config`, layers stacked on axis 0."""
    top = top_level_shapes(config)
    per_layer = layer_shapes(config)
    keys = iter(jax.random.split(key, len(top) + len(per_layer)))
    params: Params = {
        name: _init(next(keys), name, shape, dtype, config.norm_offset)
        for name, shape in top.items()
    }
    params["layers"] = {
        name: _init(next(keys), name, (config.num_layers, *shape), dtype, config.norm_offset)
        for name, shape in per_layer.items()
    }
    return params
