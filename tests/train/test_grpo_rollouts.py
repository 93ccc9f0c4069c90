"""A GRPO step's data from prompt records: the policy's rollouts scored by a TRL reward with a
dataset column, group advantages, and the batch the step reads -- each row the prompt and its
completion, the loss mask on the completion's targets beside the sampling log-probs."""

import jax
import numpy as np
import pytest

from featherweight.errors import DataError, RewardFunctionError
from featherweight.inference.rollout import Sampling
from featherweight.io.loader import load_model
from featherweight.train.grpo_rollouts import GrpoSetup, step_data
from featherweight.train.rewards import load_reward
from tests.test_walks import ROOT
from tests.tiny_checkpoints import VOCAB, hf_config, random_hf_model, save_hf

GENERATIONS, NEW, SEQ = 4, 6, 32


class ByteTokenizer:
    """Characters as token ids (code point mod the vocabulary); token 7 ends a completion."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def stop_ids(self):
        return {7}

    def apply_chat_template(self, messages, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _starts_with_a(completions, wanted, **kwargs):
    """A TRL-signature reward reading a dataset column (`wanted`) by name."""
    return [float(c[0]["content"][:1] == w) for c, w in zip(completions, wanted, strict=True)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    directory = save_hf(random_hf_model(hf_config("llama2")), tmp_path_factory.mktemp("llama"))
    return load_model(directory, dtype="float32")


def _setup(reference="tests.train.test_grpo_rollouts:_starts_with_a"):
    return GrpoSetup(
        ByteTokenizer(), [load_reward(reference, ROOT)], GENERATIONS, Sampling(1.0, 1.0, NEW),
        "group", SEQ,
    )  # fmt: skip


RECORDS = [
    {"prompt": [{"role": "user", "content": "hi"}], "wanted": "a"},
    {"prompt": [{"role": "user", "content": "colour?"}], "wanted": "b"},
]


def test_step_data_is_the_rollouts_scored_and_laid_out(model):
    data = step_data(
        _setup(), RECORDS, model.params, model.config, None, jax.random.PRNGKey(0), model.dtype
    )
    batch, rows = data.batch, len(RECORDS) * GENERATIONS
    assert batch.input_ids.shape == (rows, SEQ) and batch.advantages.shape == (rows,)
    tokenizer = ByteTokenizer()
    for row in range(rows):
        prompt = tokenizer.encode(
            tokenizer.apply_chat_template(RECORDS[row // GENERATIONS]["prompt"])
        )
        completion = tokenizer.encode(data.completions[row][0]["content"])
        counted = np.flatnonzero(batch.loss_mask[row])
        # the counted targets are exactly the completion, right after the prompt
        assert counted.tolist() == list(range(len(prompt) - 1, len(prompt) - 1 + len(completion)))
        assert batch.target_ids[row, counted].tolist() == completion
        assert batch.input_ids[row, : len(prompt)].tolist() == prompt
        assert (batch.rollout_logps[row, counted] < 0).all()
        assert (batch.rollout_logps[row][batch.loss_mask[row] == 0] == 0).all()
    for group in batch.advantages.reshape(-1, GENERATIONS):  # normalised within each prompt
        assert abs(float(group.mean())) < 1e-5
    for name in ("reward", "reward_std", "rewards/_starts_with_a/mean", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio"):  # fmt: skip
        assert name in data.metrics
    assert 1 <= data.metrics["completions/mean_length"] <= NEW


def _fails(prompts, completions, **kwargs):
    raise ValueError("no answer field")


def test_a_prompt_too_long_for_the_rows_is_refused_before_sampling(model):
    long = [{"prompt": "x" * (SEQ - NEW + 2), "wanted": "a"}]
    with pytest.raises(DataError, match=r"raise data\.seq_len to 33"):
        step_data(_setup(), long, None, model.config, None, jax.random.PRNGKey(0), model.dtype)


def test_a_failing_reward_stops_with_its_name(model):
    with pytest.raises(RewardFunctionError, match="reward _fails"):
        step_data(
            _setup("tests.train.test_grpo_rollouts:_fails"), RECORDS, model.params, model.config,
            None, jax.random.PRNGKey(0), model.dtype,
        )  # fmt: skip
