"""The plain-JAX peer of `benchmarks/peers.py`: a Llama train step as a competent JAX user writes it
without featherweight.

Its own short forward (embeddings, RMSNorm, rotary embeddings, grouped-query attention through
`jax.nn.dot_product_attention` on XLA's implementation, SwiGLU MLP, tied LM head), the layers under
`jax.lax.scan` with `jax.checkpoint` around each layer (the standard memory practice: a layer's
activations are recomputed in the backward pass, only its input is kept), full-logits cross-entropy
(`optax.softmax_cross_entropy_with_integer_labels`), `jax.value_and_grad` with respect to the
trainable pytree only (the frozen base is a separate argument), an optax AdamW update, and
`jax.jit` with the trainable parameters and optimizer state donated.

Parameters use the same pytree layout as featherweight's (layers stacked on axis 0, linear weights
in Hugging Face's [out, in], LoRA {"a": [L, r, in], "b": [L, out, r]}), so one set of arrays feeds
both steps. For QLoRA the frozen linears are NF4 (`featherweight.quant.nf4`, standing in for the
quantization library a peer would use too), dequantized inside the layer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from featherweight.models.config import ModelConfig
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x / rms(x) * weight over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope_tables(model: ModelConfig, seq_len: int) -> tuple[jax.Array, jax.Array]:
    """cos, sin [S, h] for positions 0..S-1 (the rotate-half convention)."""
    inverse = 1.0 / model.rope_theta ** (jnp.arange(0, model.head_dim, 2) / model.head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inverse  # [S, h/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [S, h]
    return jnp.cos(angles), jnp.sin(angles)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotary embedding of [B, S, N, h] by the tables [S, h]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def dense(x: jax.Array, weight, adapter: dict | None, scale: float) -> jax.Array:
    """x @ W.T (+ scale * x @ A.T @ B.T); an NF4 weight is dequantized here, one layer at a time."""
    if isinstance(weight, NF4Tensor):
        weight = dequantize_nf4(weight, x.dtype)
    y = x @ weight.T
    if adapter is not None:
        y = y + scale * ((x @ adapter["a"].T) @ adapter["b"].T)
    return y


def block(model: ModelConfig, scale: float, x, layer, adapters, cos, sin) -> jax.Array:
    """One decoder layer: [B, S, D] -> [B, S, D]."""
    batch, seq, _ = x.shape

    def project(name, inputs):
        return dense(inputs, layer[name], adapters.get(name) if adapters else None, scale)

    normed = rms_norm(x, layer["attn_norm"], model.rms_norm_eps)
    q = project("q", normed).reshape(batch, seq, model.num_heads, model.head_dim)
    k = project("k", normed).reshape(batch, seq, model.num_kv_heads, model.head_dim)
    v = project("v", normed).reshape(batch, seq, model.num_kv_heads, model.head_dim)
    attended = jax.nn.dot_product_attention(
        rotate(q, cos, sin), rotate(k, cos, sin), v, is_causal=True, implementation="xla"
    )  # [B, S, H, h]
    x = x + project("o", attended.reshape(batch, seq, -1))
    normed = rms_norm(x, layer["mlp_norm"], model.rms_norm_eps)
    hidden = jax.nn.silu(project("gate", normed)) * project("up", normed)  # [B, S, F]
    return x + project("down", hidden)


def loss_fn(trainable, frozen, input_ids, target_ids, model: ModelConfig, scale: float):
    """Mean next-token cross-entropy over the full [B, S, V] logits."""
    params = {**frozen, **trainable} if "embed" in trainable else frozen
    adapters = trainable["layers"].get("lora") if "embed" not in trainable else None
    layers = {name: value for name, value in params["layers"].items() if name != "lora"}
    cos, sin = rope_tables(model, input_ids.shape[1])

    @jax.checkpoint
    def body(x, layer_and_adapters):
        layer, layer_adapters = layer_and_adapters
        return block(model, scale, x, layer, layer_adapters, cos, sin), None

    x = params["embed"][input_ids]  # [B, S, D]
    x, _ = jax.lax.scan(body, x, (layers, adapters))
    x = rms_norm(x, params["final_norm"], model.rms_norm_eps)
    logits = x @ params["embed"].T  # [B, S, V], tied head
    return optax.softmax_cross_entropy_with_integer_labels(logits, target_ids).mean()


def build_peer_step(model: ModelConfig, optimizer: optax.GradientTransformation, scale: float):
    """`step(trainable, opt_state, frozen, input_ids, target_ids) -> (trainable, opt_state, loss)`,
    jitted with the trainable parameters and optimizer state donated."""

    def step(trainable, opt_state, frozen, input_ids, target_ids):
        loss, grads = jax.value_and_grad(loss_fn)(
            trainable, frozen, input_ids, target_ids, model, scale
        )
        updates, opt_state = optimizer.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
