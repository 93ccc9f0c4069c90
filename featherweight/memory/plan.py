"""The memory plan of a train step: `plan_for_config`, on one device or per device of a mesh.

The one-device plan (every component, its formula and placement) is `device_plan.py`; on a mesh
each device's share is `mesh_plan.py`; the plan's data types are `components.py`.
"""

from __future__ import annotations

from featherweight.memory.components import MemoryPlan, PlanComponent
from featherweight.memory.defaults import resolve
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.mesh_plan import plan_for_mesh
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.config import ModelConfig
from featherweight.parallel.sharding import planning_mesh
from featherweight.recipe.schema import TrainConfig

__all__ = ["MemoryPlan", "PlanComponent", "plan_for_config"]


def plan_for_config(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget | None = None
) -> MemoryPlan:
    """The memory plan of the train step `config` describes for `model_config`, compiled for
    `target` (default: this process's device; its attention and its compiler's calibration):
    no weights read, nothing compiled. Raises `ConfigError` for inputs that cannot be planned.
    With `config.mesh` it is the plan of one device of that mesh. Settings still "auto" are
    chosen from the shapes first (`memory/defaults.py`: `resolve`, as the trainer does); the
    config a caller goes on to build or record is `resolve(config, model_config, target=target)`,
    the one planned here."""
    target = target or AttentionTarget.of_device()
    config = resolve(config, model_config, target=target)
    if config.mesh is not None:
        return plan_for_mesh(config, model_config, planning_mesh(config.mesh), target)
    return plan_one_device(config, model_config, target)
