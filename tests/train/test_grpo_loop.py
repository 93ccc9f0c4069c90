"""GRPO in the trainer: prompts in a resumable order, rollouts by the current adapters, TRL's
metric names in metrics.jsonl, sample completions, a stopped-and-resumed run equal to an
uninterrupted one, and bad GRPO input refused in one line before any weight is read."""

import json
import os
import signal

import jax
import numpy as np
import pytest

from featherweight.errors import ConfigError, DataError, RewardFunctionError
from featherweight.recipe.schema import parse_config
from featherweight.train.loop import train
from featherweight.train.metrics import read_metrics
from tests.conftest import run_settings

GENERATIONS = 2


def vowel_share(prompts, completions, **kwargs):
    """A TRL-signature reward: the share of the completion's characters that are vowels."""
    return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    words = ["Say a word:", "Name a colour:", "Count to three:", "Hello"]
    path.write_text(
        "".join(json.dumps({"prompt": w, "topic": i}) + "\n" for i, w in enumerate(words))
    )
    return path


def _settings(model_dir, prompts, output_dir, **overrides):
    settings = run_settings(
        model_dir, prompts, output_dir, objective="grpo", batch_size=2 * GENERATIONS,
        **{"data.seq_len": 32, "data.eval_fraction": 0.0, "optimizer.learning_rate": 5e-2,
           "checkpoint.every_steps": 100, "grpo.rewards": ["tests.train.test_grpo_loop:vowel_share"],
           "grpo.num_generations": GENERATIONS, "grpo.max_completion_length": 8,
           "grpo.log_completions_every": 2, "grpo.beta": 0.04},
    )  # fmt: skip
    for key, value in overrides.items():
        section, _, name = key.rpartition(".")
        (settings.setdefault(section, {}) if section else settings)[name] = value
    return settings


def _stop_after(step_to_stop):
    def observe(step, trainable, opt_state, metrics):
        if step == step_to_stop:
            os.kill(os.getpid(), signal.SIGTERM)  # the loop saves after this step and stops

    return observe


@pytest.mark.slow
def test_a_stopped_and_resumed_grpo_run_equals_an_uninterrupted_one(
    tiny_model_dir, prompt_file, tmp_path
):
    """Stopped after step 2 (a real SIGTERM), resumed to step 4: the same prompts, rollouts,
    rewards and losses every step, and the same adapters bit for bit."""
    straight = train(parse_config(_settings(tiny_model_dir, prompt_file, tmp_path / "straight")))
    config = parse_config(_settings(tiny_model_dir, prompt_file, tmp_path / "stopped"))
    first = train(config, on_step=_stop_after(2))
    assert first.stopped_by_signal == signal.SIGTERM and first.step == 2
    resumed = train(config)
    assert resumed.run.start_step == 2 and resumed.step == 4

    def per_step(run_dir):
        return [
            (r["step"], r["loss"], r["reward"], r["completions/mean_length"])
            for r in read_metrics(run_dir / "metrics.jsonl")
            if "loss" in r
        ]

    assert per_step(tmp_path / "stopped") == per_step(tmp_path / "straight")
    for a, b in zip(
        jax.tree.leaves(straight.trainable), jax.tree.leaves(resumed.trainable), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # the adapters moved: the comparison is not of two untrained states
    changed = [
        float(np.max(np.abs(np.asarray(leaf)))) for leaf in jax.tree.leaves(straight.trainable)
    ]
    assert max(changed) > 0


@pytest.mark.slow
def test_grpo_metrics_and_samples_are_logged(tiny_model_dir, prompt_file, tmp_path):
    """TRL's names in every step's line, with the step's rollout / update time split; a sample
    completion every log_completions_every steps."""
    train(parse_config(_settings(tiny_model_dir, prompt_file, tmp_path / "run")))
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for name in ("reward", "reward_std", "rewards/vowel_share/mean", "frac_reward_zero_std",
                 "completions/mean_length", "completions/clipped_ratio", "kl",
                 "clip_ratio/region_mean"):  # fmt: skip
        assert all(name in r for r in records), name
    assert all(0 <= r["reward"] <= 1 for r in records)
    # the step's time split: sampling and scoring, then the update (waited for)
    assert all(r["time/rollout_seconds"] > 0 and r["time/update_seconds"] > 0 for r in records)
    samples = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").open()]
    assert [s["step"] for s in samples] == [2, 4]
    assert all(isinstance(s["completion"], str) and "reward" in s for s in samples)


@pytest.mark.parametrize(
    ("override", "error", "message"),
    [
        ({"grpo.rewards": []}, ConfigError, "objective: grpo needs grpo.rewards"),
        ({"batch_size": 3}, ConfigError, "groups of grpo.num_generations=2"),
        ({"grpo.loss_type": "ppo"}, ConfigError, "grpo.loss_type"),
        ({"grpo.reward_weights": [1.0, 2.0]}, ConfigError, "2 weights for 1 rewards"),
        ({"grpo.rewards": ["nowhere.py:f"]}, RewardFunctionError, "nowhere.py"),
        ({"grpo.max_completion_length": 40}, ConfigError, "leaves no room for a prompt"),
        ({"batch_size": 10}, DataError, "5 prompts a step, more than the 4 prompt records"),
        ({"memory.rollout_chunk": 3}, ConfigError, "must divide grpo.num_generations=2"),
    ],
)
def test_bad_grpo_input_is_one_line_before_any_weight(
    tiny_model_dir, prompt_file, tmp_path, override, error, message
):
    with pytest.raises(error, match=message) as raised:
        train(parse_config(_settings(tiny_model_dir, prompt_file, tmp_path / "run", **override)))
    assert "\n" not in str(raised.value)
    assert not (tmp_path / "run" / "config.yaml").exists()  # nothing written


def test_a_record_without_a_prompt_is_named(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"question": "no prompt"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: GRPO records need a \"prompt\""):
        train(parse_config(_settings(tiny_model_dir, bad, tmp_path / "run", batch_size=2)))
