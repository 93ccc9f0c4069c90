"""A linear layer as every family's layer calls it: `x @ W.T (+ bias) (+ scale * B A x)`, the
weight dense or NF4 (dequantized here, one layer's copy at a time), with its LoRA adapter.

The LoRA spec (`LoraSpec`) is the adapters' static runtime form; `lora_update` is their product,
shared by the dense layers and the experts of an MoE layer (`models/moe.py`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4

Params = dict[str, Any]

LINEAR_NAMES = ("q", "k", "v", "o", "gate", "up", "down")


class LoraSpec(NamedTuple):
    """Static LoRA settings the block needs: the scale applied to `B @ A` and the dropout rate."""

    scale: float
    dropout: float = 0.0


def linear(
    layer: Params,
    name: str,
    x: jax.Array,
    lora: LoraSpec | None = None,
    dropout_key: jax.Array | None = None,
) -> jax.Array:
    """`x @ W.T (+ bias) (+ scale * B A dropout(x))` for the weight `layer[name]` in [out, in].

    An NF4 weight is dequantized here, in the compute dtype, so only this layer's copy exists.
    """
    weight = layer[name]
    if isinstance(weight, NF4Tensor):
        weight = dequantize_nf4(weight, x.dtype)
    y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))
    bias = layer.get(f"{name}_bias")
    if bias is not None:
        y = y + bias.astype(y.dtype)
    adapter = layer.get("lora", {}).get(name)
    if adapter is not None and lora is not None:
        with jax.named_scope("lora"):
            y = y + lora_update(x, adapter, lora, name, dropout_key)
    return y


def lora_update(
    x: jax.Array, adapter: Params, lora: LoraSpec, name: str, dropout_key: jax.Array | None
) -> jax.Array:
    """`scale * B A dropout(x)` of the adapter on the linear `name`: [..., in] -> [..., out]."""
    x_in = x
    if lora.dropout > 0.0 and dropout_key is not None:
        keep = jax.random.bernoulli(
            jax.random.fold_in(dropout_key, LINEAR_NAMES.index(name)),
            1.0 - lora.dropout,
            x.shape,
        )
        x_in = jnp.where(keep, x / (1.0 - lora.dropout), 0).astype(x.dtype)
    down = jnp.einsum("...i,ri->...r", x_in, adapter["a"].astype(x.dtype))
    return lora.scale * jnp.einsum("...r,or->...o", down, adapter["b"].astype(x.dtype))
