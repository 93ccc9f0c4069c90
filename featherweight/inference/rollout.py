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

Prompts are padded after their end to a bucket (`generate.prompt_bucket`, as `generate` pads
them; its module docstring says why the padding changes nothing), and the prompt's length is an
argument of the program, not its shape: one program is compiled per bucket, where one per prompt
length recompiled the sampler for nearly every step of a real dataset (on an H200 the 8B's first
rollout, compiling, took 29.8 s; the next 17.2 s).

Random keys: row r of a group draws its token t with `fold_in(fold_in(key, r), t)`, the
group's key `fold_in(key, prompt index)` (`sample_rollouts`): the same key gives the same
completions, so a resumed run samples what the killed one would have, and a row's draws do not
depend on which rows are decoded beside it.

Memory: the rows decoded together hold the KV cache (`generate.KVCache`: [L, rows, P + T, K, h]
keys and values, a windowed layer's ring its window) and one step's logits over the vocabulary
in float32 (and top-p's sort of them). `chunk` rows at a time (`memory.rollout_chunk`, a
divisor of the group; null: the whole group) bound both: a group is then sampled in pieces of
`chunk` rows, each prefilled from the prompt again, with the same completions as the whole group
at once (the keys are per row). `memory/rollout_plan.py` plans this program.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import ConfigError
from featherweight.inference.generate import (
    _cached_step,
    check_positions,
    empty_cache,
    longest_padded_prompt,
    prompt_bucket,
)
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


def check_chunk(chunk: int | None, generations: int) -> int:
    """The rows decoded together: `chunk`, which must divide the group, or the whole group."""
    if chunk is None:
        return generations
    if chunk < 1 or generations % chunk:
        raise ConfigError(
            f"memory.rollout_chunk={chunk} must divide grpo.num_generations={generations}; "
            "use a divisor of it, or null for the whole group"
        )
    return chunk


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


def _choose(logits, keys, temperature, top_p, greedy: bool, use_top_p: bool):
    """(token [G], its sampling log-prob [G]) from the logits [G, V], row g drawn with keys[g]."""
    if greedy:
        token = jnp.argmax(logits, axis=-1)
        return token, jnp.take_along_axis(jax.nn.log_softmax(logits), token[:, None], -1)[:, 0]
    scaled = logits / temperature
    candidates = nucleus(scaled, top_p) if use_top_p else scaled
    token = jax.vmap(jax.random.categorical)(keys, candidates)
    return token, jnp.take_along_axis(jax.nn.log_softmax(scaled), token[:, None], -1)[:, 0]


@functools.partial(
    jax.jit,
    static_argnames=("config", "lora", "generations", "max_new", "greedy", "use_top_p", "dtype"),
)
def sample_group(
    params: Params,
    prompt: jax.Array,
    length: jax.Array,
    row_keys: jax.Array,
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
    """`generations` rows of one prompt's group: (tokens [G, T], logps [G, T], lengths [G], done
    [G]) for a prompt of `length` tokens (int32 scalar) padded after its end to [P] int32, row g
    sampled with row_keys[g] (module docstring); `stop_ids` [E] int32 end a row (E may be 0).
    The padding is causal attention's future: no real position sees it, and the decode steps
    overwrite its cache slots before any query reaches them."""
    padded = prompt.shape[0]
    total = padded + max_new
    cache = empty_cache(config, 1, total, dtype, ring_at_least=padded)
    logits, cache = _cached_step(
        params, prompt[None], cache, 0, config, total, lora, True, last=length - 1
    )
    cache = jax.tree.map(lambda stack: jnp.repeat(stack, generations, axis=1), cache)
    logits = jnp.repeat(logits, generations, axis=0)

    def running(state):
        index, _, _, _, _, _, done = state
        return (index < max_new) & ~jnp.all(done)

    def decode(state):
        index, logits, cache, tokens, logps, lengths, done = state
        step_keys = jax.vmap(jax.random.fold_in, (0, None))(row_keys, index)
        token, logp = _choose(logits, step_keys, temperature, top_p, greedy, use_top_p)
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
    chunk: int | None = None,
    longest_prompt: int | None = None,
) -> Rollout:
    """`generations` completions of each prompt (token ids), sampled by the model `params`
    (frozen base and adapters merged: the same arrays, no copy) with `lora`, `chunk` rows at a
    time (None: a whole group; module docstring). Each prompt is padded to its bucket
    (`prompt_bucket`, up to `longest_prompt` and `longest_padded_prompt`: the model's positions
    less the completion's, on the prompt's side of LongRoPE's threshold), so a program is
    compiled once per bucket, not once per prompt length."""
    sampling.check()
    if generations < 1:
        raise ConfigError(f"num_generations={generations} must be >= 1")
    rows = check_chunk(chunk, generations)
    stops = jnp.asarray(sorted(set(stop_ids)), jnp.int32).reshape(-1)
    settings = dict(
        temperature=jnp.float32(max(sampling.temperature, 1e-30)),
        top_p=jnp.float32(sampling.top_p),
        stop_ids=stops,
        config=config,
        lora=lora,
        generations=rows,
        max_new=sampling.max_new_tokens,
        greedy=sampling.temperature == 0,
        use_top_p=sampling.top_p < 1,
        dtype=jnp.dtype(dtype),
    )
    parts = []
    for index, prompt in enumerate(prompts):
        check_positions(len(prompt), sampling.max_new_tokens, config.max_position_embeddings)
        longest = longest_padded_prompt(config, len(prompt), sampling.max_new_tokens)
        if longest_prompt is not None:
            longest = max(min(longest, longest_prompt), len(prompt))
        padded = np.zeros(prompt_bucket(len(prompt), longest), np.int32)
        padded[: len(prompt)] = prompt
        length = jnp.int32(len(prompt))
        group_key = jax.random.fold_in(key, index)
        row_keys = jax.vmap(jax.random.fold_in, (None, 0))(group_key, jnp.arange(generations))
        for first in range(0, generations, rows):
            parts.append(
                sample_group(params, padded, length, row_keys[first : first + rows], **settings)
            )
    tokens, logps, lengths, done = (np.concatenate(part) for part in zip(*jax.device_get(parts)))
    return Rollout(tokens, logps, lengths, ~done)
