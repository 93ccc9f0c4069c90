"""The training objectives by their `objective:` name, each one module building its
`RunObjective` (`base.py`): its data layout, its step objective, its checks, what a run samples
before each step, its metric names.

Adding an objective: a module building its `RunObjective`, its line in `OBJECTIVES`, and its name
in `TrainConfig.objective` (with its settings section, TRL's keys, in `recipe/schema.py` where it
has settings).
"""

from __future__ import annotations

from featherweight.errors import ConfigError
from featherweight.recipe.objectives.base import RunObjective
from featherweight.recipe.objectives.dpo import DPO
from featherweight.recipe.objectives.grpo import GRPO
from featherweight.recipe.objectives.orpo import ORPO
from featherweight.recipe.objectives.sft import SFT
from featherweight.recipe.schema import TrainConfig
from featherweight.step.objective import Objective

OBJECTIVES: dict[str, RunObjective] = {
    objective.name: objective for objective in (SFT, DPO, ORPO, GRPO)
}


def objective_of(config: TrainConfig) -> RunObjective:
    """The objective `config.objective` names."""
    return OBJECTIVES[config.objective]


def step_objective(config: TrainConfig) -> Objective | None:
    """The objective the step trains (None: next-token cross-entropy)."""
    return objective_of(config).step(config)


def check_objective(config: TrainConfig) -> None:
    """Refuse settings the configured objective cannot train (`ConfigError`), and rollout
    settings where it samples nothing."""
    objective = objective_of(config)
    if config.memory.rollout_chunk is not None and objective.rollouts(config) is None:
        raise ConfigError("memory.rollout_chunk is for objective: grpo (its rollouts); remove it")
    objective.check(config)


__all__ = ["OBJECTIVES", "RunObjective", "check_objective", "objective_of", "step_objective"]
