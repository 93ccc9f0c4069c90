"""Parameter shapes implied by a model config: what a checkpoint must hold, and what the planner
counts, without reading any weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from featherweight.models.config import ModelConfig


def layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of one transformer layer's tensors (linear weights in [out, in])."""
    d, f = config.hidden_size, config.intermediate_size
    shapes = {
        "attn_norm": (d,),
        "q": (config.q_size, d),
        "k": (config.kv_size, d),
        "v": (config.kv_size, d),
        "o": (d, config.q_size),
        "mlp_norm": (d,),
        "gate": (f, d),
        "up": (f, d),
        "down": (d, f),
    }
    if config.attention_bias:
        shapes.update(q_bias=(config.q_size,), k_bias=(config.kv_size,), v_bias=(config.kv_size,))
    if config.num_experts:  # the experts' weights stacked, and the router
        experts = config.num_experts
        shapes.update(
            router=(experts, d), gate=(experts, f, d), up=(experts, f, d), down=(experts, d, f)
        )
    if config.output_bias:
        shapes.update(o_bias=(d,))
    if config.attention_sinks:
        shapes.update(sinks=(config.num_heads,))
    if config.expert_bias:
        experts = config.num_experts
        shapes.update(
            router_bias=(experts,), gate_bias=(experts, f), up_bias=(experts, f),
            down_bias=(experts, d),
        )  # fmt: skip
    if config.qk_norm:
        shapes.update(q_norm=(config.head_dim,), k_norm=(config.head_dim,))
    if config.sandwich_norms:
        shapes.update(post_attn_norm=(d,), post_mlp_norm=(d,))
    return shapes


def top_level_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the tensors outside the layer stack."""
    shapes = {
        "embed": (config.vocab_size, config.hidden_size),
        "final_norm": (config.hidden_size,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head"] = (config.vocab_size, config.hidden_size)
    return shapes


def abstract_params(config: ModelConfig, dtype: jnp.dtype = jnp.bfloat16) -> dict:
    """The parameter pytree as `jax.ShapeDtypeStruct`s (layers stacked): plan without allocating."""
    params = {
        name: jax.ShapeDtypeStruct(shape, dtype) for name, shape in top_level_shapes(config).items()
    }
    params["layers"] = {
        name: jax.ShapeDtypeStruct((config.num_layers, *shape), dtype)
        for name, shape in layer_shapes(config).items()
    }
    return params


def parameter_count(config: ModelConfig) -> int:
    """Number of weights in the model (tied embeddings counted once)."""
    total = sum(_prod(shape) for shape in top_level_shapes(config).values())
    return total + config.num_layers * sum(_prod(shape) for shape in layer_shapes(config).values())


def _prod(shape: tuple[int, ...]) -> int:
    result = 1
    for size in shape:
        result *= size
    return result
