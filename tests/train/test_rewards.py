"""GRPO's reward functions: TRL's, imported unchanged by file path or module name, called with
the records' columns by name; several add up by weight, None leaves a completion unscored; a
function that fails, or answers with the wrong length, is one line that names it."""

import math

import numpy as np
import pytest

from featherweight.errors import RewardFunctionError
from featherweight.train.rewards import load_reward, load_rewards, reward_metrics, score
from tests.test_walks import ROOT

HERE = ROOT / "tests" / "train"


def test_trl_reward_functions_load_by_file_and_by_module_and_score():
    by_file = load_reward("trl_rewards.py:reward_func", HERE)
    by_module = load_reward("tests.train.trl_rewards:think_format_reward", ROOT, weight=0.5)
    assert (by_file.name, by_module.name) == ("reward_func", "think_format_reward")
    completions = ["so \\boxed{4}", "\\boxed{5}", "<think>x</think> y"]
    scores = score([by_file], ["2+2?"] * 3, completions, {"ground_truth": ["4", "4", "4"]})
    np.testing.assert_array_equal(scores.total, [1.0, 0.0, 0.0])
    messages = [[{"role": "assistant", "content": text}] for text in completions]
    both = score(
        [load_reward("trl_rewards.py:think_format_reward", HERE), by_module],
        ["?"] * 3, messages, {},
    )  # fmt: skip
    np.testing.assert_array_equal(both.total, [0.0, 0.0, 1.5])  # weights 1 and 0.5 add up


def _none_for_odd(prompts, completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]


def test_none_is_unscored_and_metrics_have_trl_names():
    reward = load_reward("tests.train.test_rewards:_none_for_odd", ROOT)
    scores = score([reward], ["p"] * 4, ["a", "b", "c", "d"], {})
    assert np.isnan(scores.total[1]) and scores.total[0] == 1.0
    metrics = reward_metrics([reward], scores)
    assert metrics["reward"] == 1.0 and metrics["rewards/_none_for_odd/mean"] == 1.0
    assert set(metrics) == {
        "reward", "reward_std", "rewards/_none_for_odd/mean", "rewards/_none_for_odd/std"
    }  # fmt: skip
    assert not math.isnan(metrics["reward_std"])


def _raises(prompts, completions, **kwargs):
    raise KeyError("answer")


def _too_short(prompts, completions, **kwargs):
    return [1.0]


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("tests.train.test_rewards:_raises", "reward _raises .* raised KeyError: 'answer'"),
        ("tests.train.test_rewards:_too_short", "reward _too_short .* returned 1 rewards for 2"),
    ],
)
def test_a_failing_reward_is_one_line_naming_it(reference, message):
    reward = load_reward(reference, ROOT)
    with pytest.raises(RewardFunctionError, match=message) as raised:
        score([reward], ["p", "p"], ["a", "b"], {})
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ("rewards.py", "names no function"),
        ("missing.py:f", "is not a file"),
        ("no_such_module_xyz:f", "cannot be imported"),
        ("trl_rewards.py:nothing", "has no function 'nothing'"),
    ],
)
def test_a_reward_that_cannot_be_loaded_is_named(reference, message):
    with pytest.raises(RewardFunctionError, match=message):
        load_reward(reference, HERE)


def test_one_weight_per_reward():
    with pytest.raises(RewardFunctionError, match="2 weights for 1 rewards"):
        load_rewards(["trl_rewards.py:reward_func"], [1.0, 2.0], HERE)
