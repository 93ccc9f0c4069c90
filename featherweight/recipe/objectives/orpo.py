"""Odds ratio preference optimization (objective: orpo, Hong et al.): TRL's ORPOTrainer.

Its data are preference pairs (`pairs.py`); its step objective is `step/preference.py`'s, with no
reference model. Its metrics are TRL's rewards/* and logps/*, with ORPO's nll_loss,
log_odds_ratio and log_odds_chosen.
"""

from __future__ import annotations

from featherweight.recipe.objectives.base import RunObjective
from featherweight.recipe.objectives.pairs import check_pairs, prepare_pairs
from featherweight.recipe.schema import TrainConfig
from featherweight.step.preference import REPORTED_METRICS, PreferenceObjective


def orpo_objective(config: TrainConfig) -> PreferenceObjective:
    """The step's ORPO loss from the `orpo` settings."""
    return PreferenceObjective("orpo", config.orpo.beta)


ORPO = RunObjective(
    "orpo",
    step=orpo_objective,
    evaluated=orpo_objective,
    check=check_pairs,
    prepare_dataset=prepare_pairs,
    metric_names=REPORTED_METRICS,
)
