"""Inference: logits of token ids, and text generation with a KV cache.

Generation prefills the prompt in one pass, then decodes one token per step; both run the layer's
own stages (`models/llama.py`: nothing of the layer is written again here), jitted once per
shape. The cache (`KVCache`) is [L, B, T, K, h] per keys and values for layers of full attention
and a ring of the window's length for sliding-window layers. The prefill's attention is the
training path's (blockwise by default: a long prompt never builds its P x P scores); each decoded
token attends to its layer's cache with a mask over the slots' positions (one row of scores).

A prompt is padded after its end to a bucket (`prompt_bucket`: powers of two from `MIN_BUCKET`,
up to `longest_padded_prompt`), and its length is an argument of the prefill, not its shape: one
prefill and one decode program are compiled per bucket and reply length, not per prompt length.
The padding is the prompt's future: causal attention keeps it from every real position, the
first token is read at the prompt's last real position, and the decode steps overwrite the
padding's cache slots before any query can see them (a windowed layer's ring is at least the
padded prompt long, so the prefill drops none of the positions its window needs).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import ConfigError, TokenIdError
from featherweight.models.attention import ScoreForm, materialized_attention
from featherweight.models.config import ModelConfig
from featherweight.models.llama import (
    Params,
    attention_core,
    attention_in,
    attention_inputs,
    attention_out,
    embed,
    forward,
    head,
    mlp_residual,
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


class KVCache(NamedTuple):
    """Keys and values of the tokens so far, one stack per kind of layer: `full` [Lf, B, T, K, h]
    for the layers that attend to every earlier position (T: the prompt and the reply), `local`
    [Ls, B, C, K, h] for the sliding-window layers, a ring of C = min(window, T) slots (position
    p in slot p mod C): a windowed layer's cache holds the window, not the sequence. A stack of
    no layers is None."""

    full: tuple[jax.Array, jax.Array] | None
    local: tuple[jax.Array, jax.Array] | None


MIN_BUCKET = 32  # the shortest padded prompt: short prompts share one program


def prompt_bucket(length: int, longest: int) -> int:
    """The padded length a prompt of `length` tokens runs at: the next power of two from
    `MIN_BUCKET`, at most `longest` (`length` <= it). One program is compiled per bucket, not per
    prompt length."""
    bucket = max(MIN_BUCKET, 1 << max(length - 1, 0).bit_length())
    return max(length, min(bucket, longest))


def longest_padded_prompt(config: ModelConfig, length: int, max_new_tokens: int) -> int:
    """The longest a prompt of `length` tokens may be padded to before `max_new_tokens` are
    generated: within the model's positions, and on the same side of LongRoPE's original context
    as the unpadded sequence (Phi-3 picks its rotary factors by the sequence's length, so padding
    must not switch them)."""
    longest = config.max_position_embeddings - max_new_tokens
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "longrope":
        original = scaling.original_max_position_embeddings
        if length + max_new_tokens <= original:
            longest = min(longest, original - max_new_tokens)
    return max(longest, length)


def _cache_slots(config: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    """(whether each layer slides [L] bool, each layer's index in its kind's stack [L] int)."""
    sliding = np.asarray(config.sliding_layers or (False,) * config.num_layers, bool)
    if config.windows == "none":
        sliding = np.zeros(config.num_layers, bool)
    slots = np.where(sliding, np.cumsum(sliding) - 1, np.cumsum(~sliding) - 1)
    return sliding, slots.astype(np.int32)


def empty_cache(
    config: ModelConfig, batch: int, total: int, dtype, ring_at_least: int = 0
) -> KVCache:
    """A zeroed cache for `total` positions (`KVCache`); a windowed layer's ring holds its window,
    or `ring_at_least` positions where that is longer (a prefill of that many positions, the
    last of them padding, then keeps every real position its window needs)."""
    sliding, _ = _cache_slots(config)
    window = min(max(config.sliding_window or total, ring_at_least), total)

    def stack(layers: int, length: int):
        if not layers:
            return None
        shape = (layers, batch, length, config.num_kv_heads, config.head_dim)
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

    return KVCache(stack(int((~sliding).sum()), total), stack(int(sliding.sum()), window))


def _write(cache_k, cache_v, k, v, start, prefill: bool):
    """The ring [B, C, K, h] with the new keys/values [B, T, K, h] at positions start.. written in
    slots position mod C (a prefill writes only its last C positions: each slot once)."""
    size, new = cache_k.shape[1], k.shape[1]
    if prefill:
        kept = min(new, size)
        slots = (new - kept + jnp.arange(kept)) % size
        return (
            cache_k.at[:, slots].set(k[:, new - kept :].astype(cache_k.dtype)),
            cache_v.at[:, slots].set(v[:, new - kept :].astype(cache_v.dtype)),
        )
    slot = start % size
    return (
        jax.lax.dynamic_update_slice(cache_k, k.astype(cache_k.dtype), (0, slot, 0, 0)),
        jax.lax.dynamic_update_slice(cache_v, v.astype(cache_v.dtype), (0, slot, 0, 0)),
    )


def _ring_mask(size: int, start, new: int, window: int | None) -> jax.Array:
    """[1, 1, T, C]: which slots each new token (positions start..) may read. Slot s holds the
    last position written there, end - ((end - s) mod C); a slot never written holds a negative
    one."""
    end = start + new - 1
    slot = jnp.arange(size)
    key_pos = end - jnp.mod(end - slot, size)
    query_pos = start + jnp.arange(new)
    visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos[:, None])
    if window is not None:
        visible = visible & (query_pos[:, None] - key_pos[None, :] < window)
    return visible[None, None]


def _cached_layer(
    layer, x, inputs, cache, start, config: ModelConfig, lora, prefill: bool, window: int | None
):
    """One layer over new tokens x [B, T, D] at positions start.. (`models/llama.py`'s stages),
    reading and writing its cache [B, C, K, h] x 2 -> (x, cache); `window`: the layer's.

    A prefill (the whole prompt, start 0) attends among its own tokens as training does
    (blockwise, with the layer's window); a decode step attends to the cache, masked by
    position (and window)."""
    q, k, v = attention_in(layer, x, inputs, config, lora)
    cache_k, cache_v = _write(*cache, k, v, start, prefill)
    if prefill:
        attended = attention_core(q, k, v, inputs, config, layer.get("sinks"))
    else:
        mask = _ring_mask(cache_k.shape[1], start, x.shape[1], window)
        form = ScoreForm(config.attention_scale, config.attn_softcap, window)
        attended = materialized_attention(q, cache_k, cache_v, mask, form, layer.get("sinks"))
        attended = attended.reshape(*x.shape[:2], -1)
    a = attention_out(layer, x, attended, config, lora)
    return mlp_residual(layer, a, config, lora), (cache_k, cache_v)


@functools.partial(
    jax.jit, static_argnames=("config", "lora", "prefill", "total"), donate_argnames=("cache",)
)
def _cached_step(
    params: Params,
    token_ids,
    cache: KVCache,
    start,
    config: ModelConfig,
    total: int,
    lora=None,
    prefill=False,
    last=None,
):
    """Run new tokens [B, T] at `start` through the model (of a sequence of `total` positions);
    returns the logits at index `last` of the new tokens (None: the last one; a traced index for a
    prompt padded after its end) and the cache (`prefill`: the tokens are the prompt, at start
    0)."""
    batch, new = token_ids.shape
    positions = jnp.broadcast_to(start + jnp.arange(new), (batch, new))
    inputs = attention_inputs(config, positions, seq_len=total)
    sliding, slots = _cache_slots(config)

    def kind_step(kind: str, per_layer):
        """The layer run against its slot of one kind's stack."""

        def run(x, caches):
            layer, index, slot = per_layer
            stack = getattr(caches, kind)
            own = (stack[0][slot], stack[1][slot])
            x, (cache_k, cache_v) = _cached_layer(
                layer,
                x,
                inputs.at_layer(index),
                own,
                start,
                config,
                lora,
                prefill,
                config.sliding_window if kind == "local" else None,
            )
            updated = (stack[0].at[slot].set(cache_k), stack[1].at[slot].set(cache_v))
            return x, caches._replace(**{kind: updated})

        return run

    def layer_step(carry, per_layer):
        x, caches = carry
        layer_sliding = per_layer[1] if config.windows == "some" else None
        per_layer = (per_layer[0], per_layer[2], per_layer[3])
        if config.windows == "some":
            x, caches = jax.lax.cond(
                layer_sliding,
                kind_step("local", per_layer),
                kind_step("full", per_layer),
                x,
                caches,
            )
        else:
            x, caches = kind_step("local" if config.windows == "all" else "full", per_layer)(
                x, caches
            )
        return (x, caches), None

    xs = (
        params["layers"],
        jnp.asarray(sliding),
        jnp.arange(config.num_layers, dtype=jnp.int32),
        jnp.asarray(slots),
    )
    (x, cache), _ = jax.lax.scan(layer_step, (embed(params, token_ids, config), cache), xs)
    final = x[:, -1:] if last is None else jax.lax.dynamic_slice_in_dim(x, last, 1, axis=1)
    return head(params, final, config)[:, 0], cache


def _choose(
    next_logits: jax.Array, key: jax.Array, temperature: jax.Array, greedy: bool
) -> tuple[jax.Array, jax.Array]:
    """The next token [B] (argmax, or a sample at `temperature`) and the advanced key."""
    key, sample_key = jax.random.split(key)
    if greedy:
        return jnp.argmax(next_logits, axis=-1), key
    return jax.random.categorical(sample_key, next_logits / temperature, axis=-1), key


@functools.partial(
    jax.jit,
    static_argnames=("config", "greedy", "lora", "prefill", "total"),
    donate_argnames=("cache",),
)
def _cached_token(
    params, token_ids, cache, start, key, temperature, config, greedy, total, lora=None,
    prefill=False, last=None,
):  # fmt: skip
    """A cached step and the choice of the next token in one dispatch (no eager op per token);
    `last`: as `_cached_step`'s."""
    next_logits, cache = _cached_step(
        params, token_ids, cache, start, config, total, lora, prefill, last
    )
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
    length = prompt.shape[1]
    check_positions(length, max_new_tokens, config.max_position_embeddings)
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
        bucket = prompt_bucket(length, longest_padded_prompt(config, length, max_new_tokens))
        padded = np.zeros((1, bucket), np.int32)
        padded[:, :length] = prompt
        choice["total"] = bucket + max_new_tokens
        cache = empty_cache(config, 1, choice["total"], model.dtype, ring_at_least=bucket)
        last = jnp.int32(length - 1)
        token, key, cache = _cached_token(
            params, padded, cache, 0, key, **choice, prefill=True, last=last
        )
        position = length
        while True:
            new_ids.append(int(token[0]))
            if new_ids[-1] in stop_ids or len(new_ids) == max_new_tokens:
                return new_ids
            step_ids = np.asarray([[new_ids[-1]]], dtype=np.int32)
            token, key, cache = _cached_token(params, step_ids, cache, position, key, **choice)
            position += 1
    total = length + max_new_tokens
    buffer = np.zeros((1, total), dtype=np.int32)
    buffer[0, :length] = prompt[0]
    for end in range(length, total):
        token, key = _uncached_token(params, buffer, end, key, **choice)
        new_ids.append(int(token[0]))
        if new_ids[-1] in stop_ids:
            break
        buffer[0, end] = new_ids[-1]
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
