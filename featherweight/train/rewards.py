"""GRPO's reward functions: written for TRL, named in the config, called on each step's rollouts.

A reward is TRL's signature unchanged: `f(prompts, completions, **columns) -> list[float | None]`
-- `prompts` and `completions` as strings, or as chat messages when the dataset's prompts are
(a completion is then `[{"role": "assistant", "content": text}]`), every other column of the
records passed by name, plus `completion_ids` (token ids) as TRL passes them; None marks a
completion the function does not score. It is named `"file.py:function"` (a path from the
config's folder) or `"module:function"` (importable). Several rewards add up, each times its
weight (`reward_weights`, default 1): a completion no function scored is unscored (NaN: its
advantage is 0), as TRL's `sum_then_normalize`.

A function that cannot be loaded, raises, or returns the wrong number of rewards stops the run
with one line naming it (`RewardFunctionError`); rewards are computed before the step, so no
state or checkpoint is touched by the failure.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from featherweight.errors import RewardFunctionError


class RewardFunction(NamedTuple):
    """A loaded reward: its `name` (TRL's: the function's `__name__`, in `rewards/<name>/mean`),
    the function, where it came from, and its weight."""

    name: str
    function: Callable[..., Sequence[float | None]]
    source: str
    weight: float = 1.0


def load_reward(reference: str, base: Path, weight: float = 1.0) -> RewardFunction:
    """The reward function `reference` names: "path/to/file.py:function" (a relative path from
    `base`, the config's folder) or "package.module:function"."""
    location, _, attribute = reference.rpartition(":")
    if not location or not attribute:
        raise RewardFunctionError(
            f"reward {reference!r} names no function; write it as 'rewards.py:my_reward' or "
            "'my_package.rewards:my_reward'"
        )
    if location.endswith(".py"):
        path = Path(location).expanduser()
        path = path if path.is_absolute() else base / path
        if not path.is_file():
            raise RewardFunctionError(
                f"reward {reference!r}: {path} is not a file; give the path from the config's "
                "folder"
            )
        spec = importlib.util.spec_from_file_location(f"featherweight_reward_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as error:  # the user's file: any error it raises is named
            raise RewardFunctionError(
                f"reward {reference!r}: importing {path} raised {type(error).__name__}: {error}"
            ) from error
    else:
        try:
            module = importlib.import_module(location)
        except ImportError as error:
            raise RewardFunctionError(
                f"reward {reference!r}: module {location!r} cannot be imported ({error}); use "
                "'file.py:function' for a file beside the config"
            ) from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardFunctionError(f"reward {reference!r}: {location} has no function {attribute!r}")
    return RewardFunction(getattr(function, "__name__", attribute), function, reference, weight)


def load_rewards(
    references: Sequence[str], weights: Sequence[float] | None, base: Path
) -> list[RewardFunction]:
    """Every reward the config names, with its weight (1 each when `weights` is None)."""
    if weights is not None and len(weights) != len(references):
        raise RewardFunctionError(
            f"grpo.reward_weights has {len(weights)} weights for {len(references)} rewards; "
            "give one weight per reward"
        )
    weights = [1.0] * len(references) if weights is None else weights
    return [load_reward(ref, base, float(w)) for ref, w in zip(references, weights, strict=True)]


def _call(reward: RewardFunction, prompts, completions, columns: dict[str, Any]) -> np.ndarray:
    """One function's rewards [N] float64 (NaN where it returned None), or one line naming it."""
    try:
        values = reward.function(prompts=prompts, completions=completions, **columns)
    except Exception as error:  # the user's function: any error it raises is named
        where = inspect.getsourcefile(reward.function) or reward.source
        raise RewardFunctionError(
            f"reward {reward.name} ({where}) raised {type(error).__name__}: {error}; the run "
            "stopped before this step, its last checkpoint is kept"
        ) from error
    values = list(values) if values is not None else []
    if len(values) != len(completions):
        raise RewardFunctionError(
            f"reward {reward.name} ({reward.source}) returned {len(values)} rewards for "
            f"{len(completions)} completions; return one float (or None) per completion"
        )
    try:
        return np.asarray([np.nan if v is None else float(v) for v in values], np.float64)
    except (TypeError, ValueError) as error:
        raise RewardFunctionError(
            f"reward {reward.name} ({reward.source}) returned a value that is not a number or "
            f"None ({error}); return one float (or None) per completion"
        ) from error


class Scores(NamedTuple):
    """Rewards of N completions: `per_function` [N, F] (NaN: not scored) and `total` [N], the
    weighted sum (NaN where no function scored)."""

    per_function: np.ndarray
    total: np.ndarray


def score(
    rewards: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    columns: dict[str, list],
) -> Scores:
    """Every reward function on the completions (module docstring); `columns` are the records'
    other columns, one value per completion."""
    per_function = np.stack([_call(r, prompts, completions, columns) for r in rewards], axis=1)
    weights = np.asarray([r.weight for r in rewards])
    total = np.nansum(per_function * weights, axis=1)
    total[np.isnan(per_function).all(axis=1)] = np.nan
    return Scores(per_function, total)


def _nanstd(values: np.ndarray) -> float:
    count = np.sum(~np.isnan(values))
    return float(np.nanstd(values, ddof=1)) if count > 1 else float("nan")


def reward_metrics(rewards: Sequence[RewardFunction], scores: Scores) -> dict[str, float]:
    """TRL's names: reward, reward_std, rewards/<function>/mean and /std."""
    metrics = {}
    for index, reward in enumerate(rewards):
        column = scores.per_function[:, index]
        metrics[f"rewards/{reward.name}/mean"] = float(np.nanmean(column))
        metrics[f"rewards/{reward.name}/std"] = _nanstd(column)
    metrics["reward"] = float(np.nanmean(scores.total))
    metrics["reward_std"] = _nanstd(scores.total)
    return metrics
