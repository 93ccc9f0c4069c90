"""One GRPO step's data: prompts -> the policy's rollouts -> rewards -> advantages -> a `Batch`.

Per step, `prompts_per_step` prompt records are turned into token ids (through the chat template
when a prompt is a list of messages, with the generation prompt, as TRL does), `num_generations`
completions of each are sampled by the model being trained (`inference/rollout.py`: the frozen
base and the current adapters, merged as a dict, no copy), decoded, scored by the reward
functions (`rewards.py`) and normalised per group (`step/grpo.group_advantages`). The step's batch
holds one completion per row -- prompt, completion, padding on the right, [N, seq_len] -- its loss
mask on the completion's targets, the sampling log-probs and the advantages (`step/grpo.py`).

Metrics carry TRL's names: reward, reward_std, rewards/<function>/mean and /std,
frac_reward_zero_std, completions/mean_length, completions/min_length, completions/max_length,
completions/clipped_ratio (no stop token within max_completion_length),
completions/mean_terminated_length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np

from featherweight.errors import DataError
from featherweight.inference.rollout import Rollout, Sampling, sample_rollouts
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.llama import LoraSpec, Params
from featherweight.step.grpo import group_advantages
from featherweight.train.rewards import RewardFunction, reward_metrics, score


class GrpoSetup(NamedTuple):
    """What a GRPO step's data needs besides the model: the tokenizer, the reward functions,
    `num_generations`, the sampling settings, `scale_rewards`, the batch's row length and the
    rows sampled together (`memory.rollout_chunk`; None: a whole group)."""

    tokenizer: Tokenizer
    rewards: Sequence[RewardFunction]
    num_generations: int
    sampling: Sampling
    scale_rewards: str
    seq_len: int
    rollout_chunk: int | None = None


class StepData(NamedTuple):
    """A step's batch, its metrics (TRL's names), its prompts and completions as text, and each
    completion's reward [N] (NaN: unscored)."""

    batch: Batch
    metrics: dict[str, float]
    prompts: list
    completions: list
    rewards: np.ndarray


def prompt_ids(tokenizer: Tokenizer, prompt: str | list[dict[str, str]]) -> list[int]:
    """A prompt's token ids: a list of messages through the chat template (generation prompt
    added), a string as text."""
    if isinstance(prompt, list):
        text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def rollout_batch(prompts: Sequence[Sequence[int]], rollout: Rollout, advantages, seq_len: int):
    """The step's `Batch` [N, seq_len] from the prompts' token ids and their rollouts (a prompt's
    `N / len(prompts)` rows adjacent): prompt + completion, right-padded; the loss mask on the
    completion's targets, with the tokens' sampling log-probs beside. Every prompt and its
    longest completion fit the row (`check_prompt_lengths`)."""
    rows = len(rollout.tokens)
    generations = rows // len(prompts)
    tokens = np.zeros((rows, seq_len + 1), np.int32)
    mask = np.zeros((rows, seq_len), np.float32)
    logps = np.zeros((rows, seq_len), np.float32)
    for row in range(rows):
        prompt, length = list(prompts[row // generations]), int(rollout.lengths[row])
        end = len(prompt) + length
        tokens[row, :end] = prompt + rollout.tokens[row, :length].tolist()
        mask[row, len(prompt) - 1 : end - 1] = 1.0
        logps[row, len(prompt) - 1 : end - 1] = rollout.logps[row, :length]
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (rows, seq_len))
    return Batch(
        tokens[:, :-1], tokens[:, 1:], mask, positions, rollout_logps=logps,
        advantages=np.asarray(advantages, np.float32),
    )  # fmt: skip


def check_prompt_lengths(prompts: Sequence[Sequence[int]], max_new: int, seq_len: int) -> None:
    """Refuse, before anything is sampled, a prompt whose longest completion would not fit a row
    of `seq_len` + 1 tokens (`DataError`)."""
    longest = max(len(prompt) for prompt in prompts)
    if longest + max_new > seq_len + 1:
        raise DataError(
            f"a prompt of {longest} tokens and grpo.max_completion_length={max_new} make "
            f"{longest + max_new} tokens, beyond data.seq_len + 1 = {seq_len + 1}; raise "
            f"data.seq_len to {longest + max_new - 1} or shorten the prompts"
        )


def completion_metrics(rollout: Rollout) -> dict[str, float]:
    """TRL's completions/* metrics of the rollouts."""
    lengths = rollout.lengths.astype(np.float64)
    terminated = lengths[~rollout.truncated]
    return {
        "completions/mean_length": float(lengths.mean()),
        "completions/min_length": float(lengths.min()),
        "completions/max_length": float(lengths.max()),
        "completions/clipped_ratio": float(rollout.truncated.mean()),
        "completions/mean_terminated_length": float(terminated.mean()) if terminated.size else 0.0,
    }


def step_data(
    setup: GrpoSetup,
    records: Sequence[dict[str, Any]],
    params: Params,
    config: ModelConfig,
    lora: LoraSpec | None,
    key: jax.Array,
    dtype,
) -> StepData:
    """A GRPO step's batch from its prompt `records` ({"prompt", other columns}) and the model
    being trained (`params`: frozen base and adapters merged), sampled with `key`."""
    tokenizer, generations = setup.tokenizer, setup.num_generations
    ids = [prompt_ids(tokenizer, record["prompt"]) for record in records]
    check_prompt_lengths(ids, setup.sampling.max_new_tokens, setup.seq_len)
    rollout = sample_rollouts(
        params, config, lora, ids, key, generations, setup.sampling, tokenizer.stop_ids(), dtype,
        setup.rollout_chunk, longest_prompt=setup.seq_len + 1 - setup.sampling.max_new_tokens,
    )  # fmt: skip
    texts = [
        tokenizer.decode(tokens[:length].tolist())
        for tokens, length in zip(rollout.tokens, rollout.lengths, strict=True)
    ]
    prompts = [record["prompt"] for record in records for _ in range(generations)]
    conversational = isinstance(records[0]["prompt"], list)
    completions = (
        [[{"role": "assistant", "content": text}] for text in texts] if conversational else texts
    )
    columns = {
        name: [record[name] for record in records for _ in range(generations)]
        for name in records[0]
        if name != "prompt"
    }
    columns["completion_ids"] = [
        tokens[:length].tolist()
        for tokens, length in zip(rollout.tokens, rollout.lengths, strict=True)
    ]
    scores = score(setup.rewards, prompts, completions, columns)
    advantages = group_advantages(scores.total.astype(np.float32), generations, setup.scale_rewards)
    grouped = scores.total.reshape(-1, generations)
    zero_std = np.isclose(np.nanstd(grouped, axis=1, ddof=1), 0.0)
    metrics = {
        **reward_metrics(setup.rewards, scores),
        "frac_reward_zero_std": float(zero_std.mean()),
        **completion_metrics(rollout),
    }
    batch = rollout_batch(ids, rollout, np.asarray(advantages), setup.seq_len)
    return StepData(batch, metrics, prompts, completions, scores.total)
