"""Group relative policy optimization (objective: grpo): TRL's GRPOTrainer, the objective that
samples its own batches.

Its data are prompt records ({prompt, other columns}, `data/prompts.py`); before each step the
run samples `grpo.num_generations` completions of each of the step's prompts with the adapters
being trained, scores them with the reward functions and normalises the rewards per group
(`rollouts`: the `grpo` settings; `train/grpo_rollouts.py` carries them out, and the plan adds the
rollout phase, `memory/rollout_plan.py`). A batch row is one prompt and its completion, padded on
the right. Its step objective is `step/grpo.py`'s (TRL's clipped ratio and k3 KL); its step
metrics are TRL's kl and clip_ratio/* (the rollouts' reward and completions/* join them from the
host).
"""

from __future__ import annotations

from featherweight.errors import ConfigError
from featherweight.recipe.objectives.base import RunObjective
from featherweight.recipe.schema import GrpoSettings, TrainConfig
from featherweight.step.grpo import METRIC_NAMES, GrpoObjective


def grpo_objective(config: TrainConfig) -> GrpoObjective:
    """The step's GRPO loss from the `grpo` settings."""
    return config.grpo.objective


def grpo_rollouts(config: TrainConfig) -> GrpoSettings:
    """The sampling settings of each step's rollouts: the `grpo` section."""
    return config.grpo


def padded_rows(config: TrainConfig) -> str:
    """One prompt and its completion a row, then padding."""
    return "padded"


def check_groups(config: TrainConfig) -> None:
    """GRPO without a reward, or with completions that do not fill whole groups, or rollout
    chunks that do not divide them: refused, naming the config keys."""
    if not config.grpo.rewards:
        raise ConfigError(
            "objective: grpo needs grpo.rewards, e.g. [rewards.py:my_reward] (a function "
            "f(prompts, completions, **columns) -> list of floats)"
        )
    generations = config.grpo.num_generations
    if config.batch_size % generations:
        raise ConfigError(
            f"batch_size={config.batch_size} completions cannot be split into groups of "
            f"grpo.num_generations={generations}; use a multiple of {generations}, e.g. "
            f"{generations * max(1, config.batch_size // generations)}"
        )
    chunk = config.memory.rollout_chunk
    if chunk is not None and generations % chunk:
        raise ConfigError(
            f"memory.rollout_chunk={chunk} must divide grpo.num_generations={generations}; "
            "use a divisor of it, or null for the whole group"
        )


def check_grpo(config: TrainConfig) -> None:
    """Refuse GRPO settings the loop cannot train yet, as one line naming the config keys."""
    check_groups(config)
    memory = config.memory
    if memory.accumulation_steps > 1:
        raise ConfigError(
            "objective: grpo averages over each batch's completions, so "
            "memory.accumulation_steps > 1 is not supported; set it to 1 (a smaller batch_size "
            "fits the memory instead)"
        )
    if config.mesh is not None or "host" in (memory.base, memory.embed):
        raise ConfigError(
            "objective: grpo samples its rollouts with the weights on one device; use mesh: "
            "null, memory.base: device and memory.embed: device"
        )
    if config.grpo.beta > 0 and config.method == "full":
        raise ConfigError(
            "grpo.beta > 0 compares with the frozen base with the adapters off, and method: "
            "full has no frozen copy; use grpo.beta: 0, or method: lora / qlora"
        )
    longest = config.data.seq_len + 1 - config.grpo.max_completion_length
    if longest < 1:
        raise ConfigError(
            f"grpo.max_completion_length={config.grpo.max_completion_length} leaves no room "
            f"for a prompt in rows of data.seq_len + 1 = {config.data.seq_len + 1} tokens; raise "
            "data.seq_len (prompt + completion) or lower max_completion_length"
        )


GRPO = RunObjective(
    "grpo",
    step=grpo_objective,
    check=check_grpo,
    rows=padded_rows,
    rollouts=grpo_rollouts,
    metric_names=METRIC_NAMES,
)
