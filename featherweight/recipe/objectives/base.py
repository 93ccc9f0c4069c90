"""A training objective as one value: the hooks a run asks of it, each a function of the config.

A `RunObjective` is everything that differs between SFT, DPO, ORPO and GRPO outside the layers
that carry them out; the rest of featherweight asks it rather than comparing `config.objective`
to a name:

- `step(config)`: the step's objective (`step/objective.py`: its loss as token weights, its
  reference, its batch layout, its plan settings and plan note), None for next-token
  cross-entropy;
- `evaluated(config)`: the objective an evaluation batch's loss is (None: cross-entropy over the
  loss tokens);
- `check(config)`: a `ConfigError` naming the config keys for settings the run cannot train,
  before anything is read;
- `rows(config)`: what a batch row holds, for the attention: "packed" (several documents) or
  "padded" (one document, then padding);
- `prepare_dataset`: how records become the dataset's rows (`data/records.py`
  `prepare_dataset`'s signature); None for an objective that samples its rows each step;
- `rollouts(config)`: the sampling settings (TRL's GRPOConfig keys) of an objective that samples
  its batch before each step -- the run then reads prompt records, loads the reward functions,
  samples and scores each step's completions (`train/grpo_rollouts.py`), and the plan adds the
  rollout phase (`memory/rollout_plan.py`); None where the batches are read from the data;
- `metric_names`: the step metrics a run reports, TRL's names.

The defaults are next-token cross-entropy's: no step objective, nothing more to check, packed
rows where `data.pack` says so, no rollouts, no metric beyond the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from featherweight.data.records import Dataset
from featherweight.recipe.schema import GrpoSettings, TrainConfig
from featherweight.step.objective import Objective


def cross_entropy(config: TrainConfig) -> None:
    """No objective of the step's own: next-token cross-entropy on the targets."""
    return None


def nothing_to_check(config: TrainConfig) -> None:
    """No setting beyond those every run checks."""


def packed_where_configured(config: TrainConfig) -> str:
    """Several documents a row where `data.pack` packs them, else one and padding."""
    return "packed" if config.data.pack else "padded"


def no_rollouts(config: TrainConfig) -> None:
    """Batches read from the data: nothing sampled before a step."""
    return None


class RunObjective(NamedTuple):
    """A training objective, whole: its `objective:` name and its hooks (module docstring)."""

    name: str
    step: Callable[[TrainConfig], Objective | None] = cross_entropy
    evaluated: Callable[[TrainConfig], Objective | None] = cross_entropy
    check: Callable[[TrainConfig], None] = nothing_to_check
    rows: Callable[[TrainConfig], str] = packed_where_configured
    prepare_dataset: Callable[..., Dataset] | None = None
    rollouts: Callable[[TrainConfig], GrpoSettings | None] = no_rollouts
    metric_names: tuple[str, ...] = ()
