"""Direct preference optimization (objective: dpo; IPO with `dpo.loss: ipo`): TRL's DPOTrainer.

Its data are preference pairs (`pairs.py`); its step objective is `step/preference.py`'s, with a
reference model that is either the frozen base with the adapters off in the same step or
log-probs computed once before training and carried by each batch (`dpo.reference`: the run
computes them, `train/reference_logps.py`, where the step objective's `reference` says
"precomputed"). Its metrics are TRL's rewards/* and logps/*.
"""

from __future__ import annotations

from featherweight.errors import ConfigError
from featherweight.recipe.objectives.base import RunObjective
from featherweight.recipe.objectives.pairs import check_pairs, prepare_pairs
from featherweight.recipe.schema import TrainConfig
from featherweight.step.preference import METRIC_NAMES, PreferenceObjective


def dpo_objective(config: TrainConfig) -> PreferenceObjective:
    """The step's DPO (or IPO) loss from the `dpo` settings."""
    settings = config.dpo
    return PreferenceObjective("dpo", settings.beta, settings.loss, settings.reference)


def check_dpo(config: TrainConfig) -> None:
    """Refuse DPO settings the run cannot train, as one line naming the config keys."""
    check_pairs(config)
    if config.method == "full" and config.dpo.reference == "same_step":
        raise ConfigError(
            "dpo.reference: same_step runs the frozen base with the adapters off, and method: "
            "full has no frozen copy; use dpo.reference: precomputed (or auto), or method: lora"
        )


DPO = RunObjective(
    "dpo",
    step=dpo_objective,
    evaluated=dpo_objective,
    check=check_dpo,
    prepare_dataset=prepare_pairs,
    metric_names=METRIC_NAMES,
)
