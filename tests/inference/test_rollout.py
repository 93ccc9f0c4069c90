"""Rollouts: a group sampled with the KV cache by the model with its adapters. Greedy (and a
vanishing temperature) equals `generate_ids` row for row; the sampling log-probs equal the full
forward pass's at the temperature; a stop token ends a row; a fixed key gives the same
completions; the nucleus is transformers' top-p."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from featherweight.errors import ConfigError
from featherweight.inference.generate import generate_ids
from featherweight.inference.rollout import Sampling, nucleus, sample_rollouts
from featherweight.io.loader import load_model
from featherweight.models.llama import forward, merge_params
from featherweight.models.model import Model
from featherweight.peft.lora import LoraConfig
from tests.peft.lora_helpers import random_adapters
from tests.tiny_checkpoints import hf_config, random_hf_model, save_hf

PROMPTS = [[3, 141, 59, 26, 53], [58, 97, 93, 11, 40]]  # one length: one compile
GENERATIONS, NEW_TOKENS = 4, 10
LORA = LoraConfig(rank=4, alpha=8, targets=("q", "v", "down"))


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """The tiny llama with non-zero adapters: a `Model` as `generate_ids` reads it."""
    directory = save_hf(random_hf_model(hf_config("llama2")), tmp_path_factory.mktemp("llama"))
    model = load_model(directory, dtype="float32")
    adapters = random_adapters(jax.random.PRNGKey(2), model.config, LORA)
    params = merge_params(model.params, adapters)
    return Model(model.config, params, None, Path("."), lora=LORA.spec)


def _rollouts(model, sampling, key=0, stop_ids=()):
    return sample_rollouts(
        model.params, model.config, model.lora, PROMPTS, jax.random.PRNGKey(key), GENERATIONS,
        sampling, stop_ids, model.dtype,
    )  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_rollouts_equal_greedy_generate(policy, temperature):
    rollout = _rollouts(policy, Sampling(temperature, 1.0, NEW_TOKENS))
    for index, prompt in enumerate(PROMPTS):
        expected = generate_ids(policy, prompt, NEW_TOKENS)
        for row in range(index * GENERATIONS, (index + 1) * GENERATIONS):
            assert rollout.tokens[row].tolist() == expected
    assert rollout.truncated.all() and (rollout.lengths == NEW_TOKENS).all()


def test_sampling_log_probs_are_the_models_at_the_temperature(policy):
    temperature = 0.7
    rollout = _rollouts(policy, Sampling(temperature, 1.0, NEW_TOKENS), key=3)
    for row in range(len(rollout.tokens)):
        prompt = PROMPTS[row // GENERATIONS]
        ids = jnp.asarray([prompt + rollout.tokens[row].tolist()])
        logits = forward(policy.params, ids, policy.config, lora=policy.lora)[0] / temperature
        logps = jax.nn.log_softmax(logits[len(prompt) - 1 : -1])
        expected = jnp.take_along_axis(logps, ids[0, len(prompt) :, None], -1)[:, 0]
        np.testing.assert_allclose(rollout.logps[row], expected, rtol=1e-5, atol=1e-5)
    # the group's rows are different samples of the one prompt
    assert len({tuple(row) for row in rollout.tokens[:GENERATIONS]}) > 1


def test_a_fixed_key_gives_the_same_completions(policy):
    sampling = Sampling(1.0, 0.9, NEW_TOKENS)
    first, again = _rollouts(policy, sampling, key=5), _rollouts(policy, sampling, key=5)
    np.testing.assert_array_equal(first.tokens, again.tokens)
    np.testing.assert_array_equal(first.logps, again.logps)
    assert not np.array_equal(first.tokens, _rollouts(policy, sampling, key=6).tokens)


def test_a_stop_token_ends_its_row(policy):
    sampling = Sampling(1.0, 1.0, NEW_TOKENS)
    free = _rollouts(policy, sampling, key=4)
    stop = int(free.tokens[1, 3])  # row 1's fourth token, made a stop token
    # 0 too: the id a stopped row is padded with (SmolLM2's <|endoftext|> is both)
    stopped = _rollouts(policy, sampling, key=4, stop_ids=[stop, 0])
    first = int(np.argmax(free.tokens[1] == stop))  # where row 1 first samples it
    assert stopped.lengths[1] == first + 1 and not stopped.truncated[1]
    np.testing.assert_array_equal(stopped.tokens[1, : first + 1], free.tokens[1, : first + 1])
    assert (stopped.tokens[1, first + 1 :] == 0).all() and (
        stopped.logps[1, first + 1 :] == 0
    ).all()
    for row in range(len(free.tokens)):  # each row ends at its own first stop token, or runs on
        hits = np.flatnonzero(np.isin(free.tokens[row], [stop, 0]))
        assert stopped.lengths[row] == (hits[0] + 1 if len(hits) else NEW_TOKENS)


def test_the_nucleus_is_transformers_top_p():
    logits = jax.random.normal(jax.random.PRNGKey(0), (64, 50)) * 3
    for top_p in (0.3, 0.7, 0.95):
        warper = transformers.TopPLogitsWarper(top_p)
        expected = np.isfinite(warper(None, torch.tensor(np.asarray(logits))).numpy())
        kept = np.isfinite(np.asarray(nucleus(logits, jnp.float32(top_p))))
        np.testing.assert_array_equal(kept, expected)
        assert 1 <= kept.sum(-1).min() < 50  # neither nothing nor everything


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        (Sampling(-1.0), "temperature"),
        (Sampling(top_p=0.0), "top_p"),
        (Sampling(1.0, 1.0, 0), "max_"),
    ],
)
def test_settings_nothing_samples_with_are_refused(policy, sampling, message):
    with pytest.raises(ConfigError, match=message):
        _rollouts(policy, sampling)


def test_rollout_chunks_sample_the_same_completions_as_whole_groups(policy):
    sampling = Sampling(1.0, 0.9, NEW_TOKENS)
    whole = _rollouts(policy, sampling, key=7)
    halves = sample_rollouts(
        policy.params, policy.config, policy.lora, PROMPTS, jax.random.PRNGKey(7), GENERATIONS,
        sampling, (), policy.dtype, chunk=GENERATIONS // 2,
    )  # fmt: skip
    np.testing.assert_array_equal(halves.tokens, whole.tokens)
    np.testing.assert_allclose(halves.logps, whole.logps, rtol=1e-6, atol=1e-6)
    with pytest.raises(ConfigError, match=r"must divide grpo\.num_generations"):
        sample_rollouts(
            policy.params, policy.config, policy.lora, PROMPTS, jax.random.PRNGKey(7),
            GENERATIONS, sampling, (), policy.dtype, chunk=3,
        )  # fmt: skip


def test_prompts_of_one_bucket_share_a_program_and_still_equal_generate(policy):
    # padded after their end to one bucket (32): one compile for both lengths, greedy as before
    from featherweight.inference.rollout import sample_group

    prompts = [[3, 141, 59, 26, 53, 7, 8], [58, 97, 93]]
    sampling = Sampling(0.0, 1.0, NEW_TOKENS)
    sample_rollouts(
        policy.params, policy.config, policy.lora, prompts[:1], jax.random.PRNGKey(0), 2,
        sampling, (), policy.dtype,
    )  # fmt: skip
    compiled = sample_group._cache_size()
    rollout = sample_rollouts(
        policy.params, policy.config, policy.lora, prompts, jax.random.PRNGKey(0), 2, sampling,
        (), policy.dtype,
    )  # fmt: skip
    assert sample_group._cache_size() == compiled  # the second length compiled nothing
    for index, prompt in enumerate(prompts):
        expected = generate_ids(policy, prompt, NEW_TOKENS)
        assert rollout.tokens[2 * index].tolist() == expected


def test_a_padded_prompt_longer_than_the_window_keeps_what_the_window_needs(tmp_path):
    # a window of 4 on every layer: the prompt's 9 tokens padded to 32 outrun the ring, which
    # then holds the padded prompt so that the decode steps still see the last 4 real positions
    hf = random_hf_model(hf_config("mistral", sliding_window=4))
    model = load_model(save_hf(hf, tmp_path / "mistral"), dtype="float32")
    assert model.config.windows == "all"
    prompt = [3, 141, 59, 26, 53, 58, 97, 93, 11]
    rollout = sample_rollouts(
        model.params, model.config, None, [prompt], jax.random.PRNGKey(0), 2,
        Sampling(0.0, 1.0, NEW_TOKENS), (), model.dtype,
    )  # fmt: skip
    expected = generate_ids(model, prompt, NEW_TOKENS)
    assert rollout.tokens[0].tolist() == rollout.tokens[1].tolist() == expected


def test_the_bucket_is_a_power_of_two_within_the_longest_prompt():
    from featherweight.inference.generate import prompt_bucket

    assert [prompt_bucket(n, 257) for n in (1, 32, 33, 100, 200, 257)] == [
        32,
        32,
        64,
        128,
        256,
        257,
    ]
    assert prompt_bucket(20, 24) == 24 and prompt_bucket(40, 40) == 40
