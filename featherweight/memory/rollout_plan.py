"""GRPO's rollout phase: the bytes of sampling a step's completions, beside the train step's.

Before each step the policy samples its completions (`inference/rollout.py` `sample_group`, one
program per prompt length): the frozen base and the adapters it reads are already resident for
the step, and so is the optimizer state, so the phase adds only what sampling holds, counted for
the `memory.rollout_chunk` rows decoded together (null: a prompt's whole group) and the longest
prompt a row admits (prompt + completion = seq_len + 1 positions, what `check_prompt_lengths`
allows):

  kv_cache          keys and values of every layer, [L, rows, P + T, K, h] x 2 x itemsize
                    (a windowed layer's ring holds its window: `jax.eval_shape` of
                    `generate.empty_cache`, exact)
  kv_cache_layer    one layer's keys and values, sliced out of the stack by the layer scan
  prompt_cache      the prompt's one-row cache, prefilled once and repeated for the rows
  sampling_logits   one decode step's logits over the vocabulary for the rows, float32, and the
                    sampler's buffers of the same shape (the draw, the log-softmax, the loop's
                    carried logits; top-p's sort, its indices and its mask)
  rollout_outputs   tokens and their log-probs [rows, T] (int32, float32), lengths and stops

The buffer counts of `sampling_logits` are read off compiled rollout programs: XLA:CPU keeps 6
[rows, V] float32 buffers at its peak and 3 more with top-p (tiny Llama, vocabulary 32768, 8 and
16 rows); XLA's GPU compiler fuses them (Llama-3.1-8B QLoRA compiled for the H100: 0.45 MiB more
for 8 more rows, the cache's growth aside), planned as the one buffer the loop carries. The
prefill of one row is below the decode loop's peak on both (the compiled temp is the same for
prompts of 64 and 256 positions at the same total on XLA:CPU, of 128, 256 and 512 for the 8B on
the H100) and is not planned; what the decode layer itself holds is not planned either
(Llama-3.1-8B QLoRA for the H100: 83.5 MiB of the 971.5 MiB compiled temp, 1.3% of the phase).
`tests/memory/test_rollout_plan.py` compiles the program and checks the phase within 10%.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from featherweight.inference.generate import empty_cache
from featherweight.memory.components import DEVICE, PlanComponent
from featherweight.memory.working_set import calibration_key
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.recipe.objectives import objective_of
from featherweight.recipe.schema import TrainConfig

# [rows, V] float32 buffers of the sampler at the decode loop's peak, by compiler (docstring)
SAMPLING_BUFFERS = {"xla-cpu": (6, 3), "xla-gpu": (1, 0)}  # (plain, more with top-p)


def rollout_rows(config: TrainConfig) -> int:
    """The completions sampled together: `memory.rollout_chunk`, or a prompt's whole group."""
    return config.memory.rollout_chunk or config.grpo.num_generations


def rollout_positions(config: TrainConfig) -> tuple[int, int]:
    """(prompt, completion) positions planned: the longest prompt a batch row admits with the
    longest completion (prompt + completion = seq_len + 1)."""
    completion = config.grpo.max_completion_length
    return max(config.data.seq_len + 1 - completion, 1), completion


def cache_bytes(
    model_config: ModelConfig, rows: int, positions: int, dtype, prompt: int = 0
) -> tuple[int, int]:
    """(the KV cache's bytes, one layer's keys and values) for `rows` rows of `positions`
    positions after a padded prompt of `prompt`: `jax.eval_shape` of the cache the rollout
    allocates (a windowed layer's ring at least the prompt long)."""
    cache = jax.eval_shape(
        lambda: empty_cache(model_config, rows, positions, dtype, ring_at_least=prompt)
    )
    stacks = [stack for stack in (cache.full, cache.local) if stack is not None]
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in jax.tree.leaves(stacks))
    layer = max(2 * math.prod(k.shape[1:]) * k.dtype.itemsize for k, _ in stacks)
    return total, layer


def rollout_components(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> tuple[PlanComponent, ...]:
    """What the rollout phase compiled for `target` holds beyond the resident weights and
    optimizer state (module docstring); nothing for an objective that samples nothing."""
    grpo = objective_of(config).rollouts(config)
    if grpo is None:
        return ()
    rows = rollout_rows(config)
    prompt, completion = rollout_positions(config)
    positions = prompt + completion
    dtype = jnp.dtype(config.model.dtype)
    itemsize = dtype.itemsize
    kv, layer = cache_bytes(model_config, rows, positions, dtype, prompt)
    plain, top_p = SAMPLING_BUFFERS[calibration_key(config, target).split("/")[0]]
    buffers = plain + (top_p if grpo.top_p < 1 else 0)
    vocab = model_config.vocab_size
    shape = f"{rows} rows x {positions} positions ({prompt} prompt + {completion} completion)"
    cache_formula = f"L x rows x (P + T) x K x h x 2 x {itemsize}: {shape}"
    return (
        PlanComponent(
            "kv_cache", kv, DEVICE, cache_formula + " (a window's ring per windowed layer)"
        ),
        PlanComponent("kv_cache_layer", layer, DEVICE, "one layer's keys and values of the rows"),
        PlanComponent("prompt_cache", kv // rows, DEVICE, "the prompt's one-row cache"),
        PlanComponent(
            "sampling_logits",
            buffers * rows * vocab * 4,
            DEVICE,
            f"{buffers} x rows x V x 4 = {buffers} x {rows} x {vocab} x 4 (the sampler's "
            "buffers" + (", top-p's sort" if grpo.top_p < 1 else "") + ")",
        ),
        PlanComponent(
            "rollout_outputs",
            rows * (8 * completion + 5),
            DEVICE,
            f"tokens and log-probs, rows x T x 4 B each, lengths, stops: {rows} x {completion}",
        ),
    )
