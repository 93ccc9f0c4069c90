"""An objective is one module: the registry holds every `objective:` name, each objective provides
every hook, and nothing outside `recipe/objectives/` branches on the objective's name."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import pytest

import featherweight
from featherweight.errors import ConfigError
from featherweight.recipe.objectives import OBJECTIVES, RunObjective, check_objective, objective_of
from featherweight.recipe.schema import TrainConfig, parse_config

PACKAGE_ROOT = Path(featherweight.__file__).resolve().parent
OBJECTIVES_DIR = PACKAGE_ROOT / "recipe" / "objectives"
STEP_MEMBERS = (
    "loss_of", "needs_reference", "reference", "temperature", "check", "abstract_batch",
    "plan_settings", "plan_note",
)  # fmt: skip
SETTINGS = {
    "sft": {},
    "dpo": {},
    "orpo": {},
    "grpo": {"grpo": {"rewards": ["rewards.py:f"], "num_generations": 2}, "batch_size": 4},
}


def _config(name: str, **extra) -> TrainConfig:
    return parse_config({"objective": name, **SETTINGS[name], **extra})


def test_the_registry_holds_every_objective_the_config_names():
    names = typing.get_args(TrainConfig.model_fields["objective"].annotation)
    assert tuple(OBJECTIVES) == names
    assert all(objective.name == name for name, objective in OBJECTIVES.items())


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_each_objective_provides_every_hook(name):
    objective, config = OBJECTIVES[name], _config(name)
    assert isinstance(objective, RunObjective) and objective_of(config) is objective
    step = objective.step(config)
    # the step seam's protocol (`step/objective.py`), or None: next-token cross-entropy
    assert step is None or all(hasattr(step, member) for member in STEP_MEMBERS)
    assert objective.evaluated(config) in (None, step)
    objective.check(config)  # a config of defaults trains
    assert objective.rows(config) in ("packed", "padded")
    rollouts = objective.rollouts(config)
    # an objective reads its rows from records, or samples them from prompts: one of the two
    assert (objective.prepare_dataset is None) == (rollouts is not None)
    assert all(isinstance(metric, str) for metric in objective.metric_names)
    if step is not None:  # the step seam: its plan names the objective
        assert step.plan_settings()["objective"] == name


def test_the_objectives_own_what_differs():
    sft, dpo, orpo, grpo = (_config(name) for name in ("sft", "dpo", "orpo", "grpo"))
    assert objective_of(sft).step(sft) is None
    assert objective_of(dpo).step(dpo).needs_reference
    assert not objective_of(orpo).step(orpo).needs_reference
    assert objective_of(grpo).rows(grpo) == "padded"  # a prompt and its completion a row
    assert objective_of(dpo).rows(dpo) == "packed" and objective_of(sft).rows(sft) == "packed"
    unpacked = _config("sft", data={"pack": False})
    assert objective_of(unpacked).rows(unpacked) == "padded"
    assert objective_of(grpo).rollouts(grpo) == grpo.grpo
    assert "nll_loss" in objective_of(orpo).metric_names
    assert "nll_loss" not in objective_of(dpo).metric_names
    assert "clip_ratio/region_mean" in objective_of(grpo).metric_names


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("grpo", {"grpo": {"num_generations": 2}}, "objective: grpo needs grpo.rewards"),
        ("grpo", {"batch_size": 3}, "groups of grpo.num_generations=2"),
        ("sft", {"memory": {"rollout_chunk": 2}}, "memory.rollout_chunk is for objective: grpo"),
        ("dpo", {"memory": {"accumulation_steps": 2}}, "objective: dpo averages"),
        ("orpo", {"data": {"max_documents_per_row": 1}}, "cannot hold a preference pair"),
        ("dpo", {"method": "full", "dpo": {"reference": "same_step"}}, "no frozen copy"),
    ],
)
def test_an_objective_refuses_what_it_cannot_train(name, change, message):
    with pytest.raises(ConfigError, match=message):
        check_objective(_config(name, **change))


def _compares_objective_to_a_name(node: ast.AST) -> bool:
    """`<x>.objective == "grpo"`, `!=`, `in ("dpo", "orpo")` and the like."""
    if not isinstance(node, ast.Compare):
        return False
    sides = [node.left, *node.comparators]

    def names_it(side):
        return isinstance(side, ast.Attribute) and side.attr == "objective"

    def literal(side):
        if isinstance(side, ast.Constant):
            return isinstance(side.value, str)
        return isinstance(side, (ast.Tuple, ast.List, ast.Set)) and all(
            isinstance(item, ast.Constant) and isinstance(item.value, str) for item in side.elts
        )

    return any(names_it(side) for side in sides) and any(literal(side) for side in sides)


def test_no_module_outside_the_objectives_branches_on_the_objective_name():
    """Adding an objective is its module and its registry line: no other module compares
    `config.objective` to a name (what each objective does differently, it provides)."""
    found = [
        f"{path.relative_to(PACKAGE_ROOT)}:{node.lineno}"
        for path in PACKAGE_ROOT.rglob("*.py")
        if OBJECTIVES_DIR not in path.parents
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if _compares_objective_to_a_name(node)
    ]
    assert not found, found


def test_the_name_check_finds_a_comparison():
    """The check above, shown to catch what it forbids (a negative control)."""
    tree = ast.parse('if config.objective != "grpo":\n    pass\nx = run.config.objective in ("a",)')
    assert sum(_compares_objective_to_a_name(node) for node in ast.walk(tree)) == 2
