"""Rollouts: a prompt's group of sampled completions, by the policy itself, with a KV cache.

GRPO samples `generations` completions of each prompt from the model it trains: the frozen base
(NF4 for QLoRA) with the current adapters -- the same arrays the step reads, no second copy and no
server. A group runs `generate.py`'s cached step (the layer's own stages): the prompt is prefilled
once, for one row, and its cache repeated for the group's rows (the rows share the prompt, so
they share its keys and values), then all rows decode together in one `lax.while_loop` (one
dispatch per group, not per token) until every row has stopped at a stop token or the length
limit. Sampling divides the logits by the temperature and keeps the nucleus (`top_p`: the most
probable tokens whose probabilities sum to at least top_p, as transformers' `TopPLogitsWarper`);
temperature 0 is greedy. The log-prob each token was sampled with is kept: the log-softmax of the
logits at the temperature, before the nucleus (TRL's `old_per_token_logps`), the ratio's base in
`step/grpo.py`.

Random keys: row r of a group draws its token t from `fold_in(key, t)` (one categorical draw
over the group's rows), the group's key `fold_in(key, prompt index)` (`sample_rollouts`): the
same key gives the same completions, so a resumed run samples what the killed one would have.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import ConfigError
from featherweight.inference.generate import _cached_step, check_positions, empty_cache
from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params


class Sampling(NamedTuple):
    """How completions are sampled: `temperature` (0: greedy), `top_p` (1: the whole
    vocabulary), at most `max_new_tokens` each."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64

    def check(self) -> None:
        """Refuse settings nothing can be sampled with (`ConfigError`)."""
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1]; 1 keeps every token")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_completion_length={self.max_new_tokens} must be >= 1")


class Rollout(NamedTuple):
    """Completions of prompts, a prompt's `generations` rows adjacent, all numpy: `tokens`
    [N, T] int32 (0 after a row's end), `logps` [N, T] float32 (each token's sampling log-prob,
    0 after the end), `lengths` [N] (tokens up to and including the stop token) and
    `truncated` [N] bool (no stop token within T)."""

    tokens: np.ndarray
    logps: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray


def nucleus(scaled_logits: jax.Array, top_p: jax.Array) -> jax.Array:
    """Logits [..., V] with every token outside the nucleus at -inf: the most probable tokens
    whose probabilities, summed from the most probable down, first reach `top_p` (the most
    probable one always kept)."""
    order = jnp.argsort(-scaled_logits, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled_logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more probable tokens
    keep_sorted = before < top_p
    keep = (
        jnp.zeros_like(keep_sorted).at[jnp.arange(order.shape[0])[:, None], order].set(keep_sorted)
    )
    return jnp.where(keep, scaled_logits, -jnp.inf)


def _choose(logits, key, temperature, top_p, greedy: bool, use_top_p: bool):
    """(token [G], its sampling log-prob [G]) from the logits [G, V]."""
    if greedy:
        token = jnp.argmax(logits, axis=-1)
        return token, jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
    scaled = logits / temperature
    token = jax.random.categorical(key, nucleus(scaled, top_p) if use_top_p else scaled, axis=-1)
    return token, jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], -1)[:, 0]


@functools.partial(
    jax.jit,
    static_argnames=("config", "lora", "generations", "max_new", "greedy", "use_top_p", "dtype"),
)
def sample_group(
    params: Params,
    prompt: jax.Array,
    key: jax.Array,
    temperature: jax.Array,
    top_p: jax.Array,
    stop_ids: jax.Array,
    config: ModelConfig,
    lora: LoraSpec | None,
    generations: int,
    max_new: int,
    greedy: bool,
    use_top_p: bool,
    dtype,
):
    """One prompt's group: (tokens [G, T], logps [G, T], lengths [G]) for a prompt [P] int32
    (module docstring); `stop_ids` [E] int32 end a row (E may be 0)."""
    length = prompt.shape[0]
    total = length + max_new
    cache = empty_cache(config, 1, total, dtype)
    logits, cache = _cached_step(params, prompt[None], cache, 0, config, total, lora, True)
    cache = jax.tree.map(lambda stack: jnp.repeat(stack, generations, axis=1), cache)
    logits = jnp.repeat(logits, generations, axis=0)

    def running(state):
        index, _, _, _, _, _, done = state
        return (index < max_new) & ~jnp.all(done)

    def decode(state):
        index, logits, cache, tokens, logps, lengths, done = state
        token, logp = _choose(
            logits, jax.random.fold_in(key, index), temperature, top_p, greedy, use_top_p
        )
        token = jnp.where(done, 0, token).astype(jnp.int32)
        tokens = tokens.at[:, index].set(token)
        logps = logps.at[:, index].set(jnp.where(done, 0.0, logp))
        stopped = ~done & jnp.any(token[:, None] == stop_ids[None, :], axis=-1)
        lengths = jnp.where(stopped, index + 1, lengths)
        logits, cache = _cached_step(
            params, token[:, None], cache, length + index, config, total, lora
        )
        return index + 1, logits, cache, tokens, logps, lengths, done | stopped

    state = (
        jnp.int32(0),
        logits,
        cache,
        jnp.zeros((generations, max_new), jnp.int32),
        jnp.zeros((generations, max_new), jnp.float32),
        jnp.full((generations,), max_new, jnp.int32),
        jnp.zeros((generations,), bool),
    )
    _, _, _, tokens, logps, lengths, done = jax.lax.while_loop(running, decode, state)
    return tokens, logps, lengths, done


def sample_rollouts(
    params: Params,
    config: ModelConfig,
    lora: LoraSpec | None,
    prompts: Sequence[Sequence[int]],
    key: jax.Array,
    generations: int,
    sampling: Sampling,
    stop_ids: Sequence[int],
    dtype,
) -> Rollout:
    """`generations` completions of each prompt (token ids), sampled by the model `params`
    (frozen base and adapters merged: the same arrays, no copy) with `lora` (module docstring).
    Compiled once per prompt length."""
    sampling.check()
    if generations < 1:
        raise ConfigError(f"num_generations={generations} must be >= 1")
    stops = jnp.asarray(sorted(set(stop_ids)), jnp.int32).reshape(-1)
    settings = dict(
        temperature=jnp.float32(max(sampling.temperature, 1e-30)),
        top_p=jnp.float32(sampling.top_p),
        stop_ids=stops,
        config=config,
        lora=lora,
        generations=generations,
        max_new=sampling.max_new_tokens,
        greedy=sampling.temperature == 0,
        use_top_p=sampling.top_p < 1,
        dtype=jnp.dtype(dtype),
    )
    parts = []
    for index, prompt in enumerate(prompts):
        check_positions(len(prompt), sampling.max_new_tokens, config.max_position_embeddings)
        prompt_ids = jnp.asarray(prompt, jnp.int32)
        parts.append(sample_group(params, prompt_ids, jax.random.fold_in(key, index), **settings))
    tokens, logps, lengths, done = (np.concatenate(part) for part in zip(*jax.device_get(parts)))
    return Rollout(tokens, logps, lengths, ~done)
