"""Inference: logits of token ids, and text generation with a KV cache.

Generation prefills the prompt in one pass, then decodes one token per step; both run the same
cached block, jitted once per shape. The cache is [L, B, T, K, h] per keys and values. The prefill's
attention is blockwise (`models/attention.py`): a long prompt never builds its P x P scores; each
decoded token attends to the cache with a mask over its T positions (one row of scores).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import ConfigError, TokenIdError
from featherweight.models.attention import blockwise_attention
from featherweight.models.config import ModelConfig
from featherweight.models.llama import (
    Params,
    apply_rotary,
    attention_inputs,
    embed,
    forward,
    head,
    linear,
    mlp,
    rms_norm,
)
from featherweight.models.model import Model


def validate_token_ids(token_ids, vocab_size: int) -> np.ndarray:
    """Token ids as int32 [B, S] (a flat sequence becomes one row), or a `TokenIdError`."""
    try:
        array = np.asarray(token_ids)
    except ValueError:
        raise TokenIdError(
            "token ids must be a rectangular [batch, seq] array of integers"
        ) from None
    if not np.issubdtype(array.dtype, np.integer):
        raise TokenIdError(
            f"token ids must be integers, got dtype {array.dtype}; tokenize text with "
            "model.tokenizer.encode(text)"
        )
    if array.ndim == 1:
        array = array[None, :]
    if array.ndim != 2 or array.shape[1] == 0:
        raise TokenIdError(
            f"token ids must have shape [batch, seq] with seq >= 1, got {array.shape}"
        )
    array = array.astype(np.int64)
    bad = (array < 0) | (array >= vocab_size)
    if bad.any():
        value = int(array[bad][0])
        raise TokenIdError(
            f"token id {value} is outside the vocabulary [0, {vocab_size}); the ids do not "
            "belong to this model's tokenizer"
        )
    return array.astype(np.int32)


@functools.partial(jax.jit, static_argnames=("config", "lora"))
def _forward_jit(params: Params, token_ids: jax.Array, config: ModelConfig, lora=None) -> jax.Array:
    return forward(params, token_ids, config, lora=lora)


def logits(model: Model, token_ids) -> jax.Array:
    """Float32 logits [batch, seq, vocab] of `token_ids` ([batch, seq] integers)."""
    ids = validate_token_ids(token_ids, model.config.vocab_size)
    return _forward_jit(model.params, jnp.asarray(ids), model.config, model.lora)


def _cached_block(
    layer, x, cos, sin, cache_k, cache_v, start, config: ModelConfig, lora=None, prefill=False
):
    """One layer over new tokens x [B, T, D] at positions start.., reading/writing the cache.

    `prefill`: the new tokens are the whole prompt (start = 0), so they attend only to each other,
    blockwise; otherwise they attend to the cache, masked beyond their positions."""
    batch, new, _ = x.shape
    normed = rms_norm(x, layer["attn_norm"], config.rms_norm_eps)
    q = linear(layer, "q", normed, lora).reshape(batch, new, config.num_heads, -1)
    k = linear(layer, "k", normed, lora).reshape(batch, new, config.num_kv_heads, -1)
    v = linear(layer, "v", normed, lora).reshape(batch, new, config.num_kv_heads, -1)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    cache_k = jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, start, 0, 0))
    cache_v = jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, start, 0, 0))
    if prefill:
        attended = blockwise_attention(q, k, v)
    else:
        query_pos = start + jnp.arange(new)
        key_pos = jnp.arange(cache_k.shape[1])
        mask = (key_pos[None, :] <= query_pos[:, None])[None, None]  # [1, 1, T, T_max]
        attended = jax.nn.dot_product_attention(q, cache_k, cache_v, mask=mask)
    x = x + linear(layer, "o", attended.reshape(batch, new, -1), lora)
    x = x + mlp(layer, rms_norm(x, layer["mlp_norm"], config.rms_norm_eps), lora)
    return x, cache_k, cache_v


@functools.partial(
    jax.jit, static_argnames=("config", "lora", "prefill"), donate_argnames=("cache",)
)
def _cached_step(
    params: Params, token_ids, cache, start, config: ModelConfig, lora=None, prefill=False
):
    """Run new tokens [B, T] at `start` through the model; returns last logits and the cache
    (`prefill`: the tokens are the prompt, at start 0)."""
    batch, new = token_ids.shape
    positions = jnp.broadcast_to(start + jnp.arange(new), (batch, new))
    inputs = attention_inputs(config, positions)

    def layer_step(x, per_layer):
        layer, cache_k, cache_v = per_layer
        x, cache_k, cache_v = _cached_block(
            layer, x, inputs.cos, inputs.sin, cache_k, cache_v, start, config, lora, prefill
        )
        return x, (cache_k, cache_v)

    x, cache = jax.lax.scan(layer_step, embed(params, token_ids), (params["layers"], *cache))
    return head(params, x[:, -1:], config)[:, 0], cache


def _choose(
    next_logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool
) -> tuple[jax.Array, jax.Array]:
    """The next token [B] (argmax, or a sample at `temperature`) and the advanced key."""
    key, sample_key = jax.random.split(key)
    if greedy:
        return jnp.argmax(next_logits, axis=-1), key
    return jax.random.categorical(sample_key, next_logits / temperature, axis=-1), key


@functools.partial(
    jax.jit, static_argnames=("config", "greedy", "lora", "prefill"), donate_argnames=("cache",)
)
def _cached_token(
    params, token_ids, cache, start, key, temperature, config, greedy, lora=None, prefill=False
):
    """A cached step and the choice of the next token in one dispatch (no eager op per token)."""
    next_logits, cache = _cached_step(params, token_ids, cache, start, config, lora, prefill)
    token, key = _choose(next_logits, key, temperature, greedy)
    return token, key, cache


@functools.partial(jax.jit, static_argnames=("config", "greedy", "lora"))
def _uncached_token(params, padded_ids, length, key, temperature, config, greedy, lora=None):
    """The next token after `length` ids of a padded buffer, recomputing the whole prefix."""
    all_logits = forward(params, padded_ids, config, lora=lora)
    next_logits = jax.lax.dynamic_index_in_dim(all_logits, length - 1, axis=1, keepdims=False)
    return _choose(next_logits, key, temperature, greedy)


def check_positions(prompt_tokens: int, max_new_tokens: int, limit: int) -> None:
    """Refuse a generation that would run past the model's last position: RoPE beyond
    max_position_embeddings is untrained (plan and train refuse such lengths too)."""
    if prompt_tokens >= limit:
        raise ConfigError(
            f"the prompt is {prompt_tokens} tokens but the model reads at most {limit} "
            "(max_position_embeddings), with room for the reply; shorten the prompt"
        )
    if prompt_tokens + max_new_tokens > limit:
        raise ConfigError(
            f"the prompt ({prompt_tokens} tokens) and max_new_tokens={max_new_tokens} make "
            f"{prompt_tokens + max_new_tokens} positions, beyond the model's {limit} "
            f"(max_position_embeddings); lower max_new_tokens to {limit - prompt_tokens} or "
            "shorten the prompt"
        )


def generate_ids(
    model: Model,
    prompt_ids: Sequence[int] | np.ndarray,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    use_cache: bool = True,
    stop_ids: set[int] | None = None,
) -> list[int]:
    """Continue one prompt; greedy at temperature 0. Returns the new token ids only.

    Without the cache every step recomputes the whole prefix (the reference the cache is tested
    against); both draw the same random keys, so they sample the same tokens.
    """
    if max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if temperature < 0:
        raise ConfigError(f"temperature={temperature} must be >= 0 (0 is greedy)")
    prompt = validate_token_ids(prompt_ids, model.config.vocab_size)[:1]
    config, params = model.config, model.params
    total = prompt.shape[1] + max_new_tokens
    check_positions(prompt.shape[1], max_new_tokens, config.max_position_embeddings)
    choice = dict(
        temperature=jnp.float32(temperature),
        config=config,
        greedy=temperature == 0,
        lora=model.lora,
    )
    key = jax.random.PRNGKey(seed)
    stop_ids = stop_ids or set()
    new_ids: list[int] = []
    if use_cache:
        cache_shape = (config.num_layers, 1, total, config.num_kv_heads, config.head_dim)
        cache = (jnp.zeros(cache_shape, model.dtype), jnp.zeros(cache_shape, model.dtype))
        token, key, cache = _cached_token(params, prompt, cache, 0, key, **choice, prefill=True)
        position = prompt.shape[1]
        while True:
            new_ids.append(int(token[0]))
            if new_ids[-1] in stop_ids or len(new_ids) == max_new_tokens:
                return new_ids
            step_ids = np.asarray([[new_ids[-1]]], dtype=np.int32)
            token, key, cache = _cached_token(params, step_ids, cache, position, key, **choice)
            position += 1
    buffer = np.zeros((1, total), dtype=np.int32)
    buffer[0, : prompt.shape[1]] = prompt[0]
    for length in range(prompt.shape[1], total):
        token, key = _uncached_token(params, buffer, length, key, **choice)
        new_ids.append(int(token[0]))
        if new_ids[-1] in stop_ids:
            break
        buffer[0, length] = new_ids[-1]
    return new_ids


def generate(
    model: Model,
    prompt: str,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    seed: int = 0,
    chat: bool | None = None,
) -> str:
    """Generate a reply to `prompt`, through the chat template when the model has one."""
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ConfigError(f"{model.source} has no tokenizer; generate from token ids instead")
    use_chat = tokenizer.chat_template is not None if chat is None else chat
    if use_chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(prompt)
    new_ids = generate_ids(
        model, prompt_ids, max_new_tokens, temperature, seed, stop_ids=tokenizer.stop_ids()
    )
    return tokenizer.decode(new_ids)
