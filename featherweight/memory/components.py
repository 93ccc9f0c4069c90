"""The plan's data: named components with placement and formula, summed into a `MemoryPlan`.

Shared by the one-device planner (`device_plan.py`), the per-device mesh planner (`mesh_plan.py`),
the budget search, the report and the measurement comparison.
"""

from __future__ import annotations

import dataclasses
from typing import Any

DEVICE, HOST = "device", "host"
PERSISTENT = ("frozen_base", "trainable_weights", "optimizer_state", "batch")
RESIDENT = PERSISTENT[:3]  # on the device through GRPO's rollouts too (the batch is the step's)
OUTPUTS = "step_outputs"
HOST_EMBEDDING = "embedding_table"  # the embedding table with memory.embed: host
HOST_BASE = "base_layers"  # the frozen layer stack with memory.base: host
DEQUANTIZED_WEIGHTS = "dequantized_weights"  # QLoRA's layer weights kept dense (save: dequantized)
# host arrays a step writes anew, beside the old ones: the optimizer state, a trained host table
REBUILT_ON_HOST = ("optimizer_state_rebuilt", "embedding_table_rebuilt")
METRIC_BYTES = 14  # loss, tokens, grad_norm (float32), updated and params_finite (bool)


@dataclasses.dataclass(frozen=True)
class PlanComponent:
    """Planned bytes of one named owner, where they live, and its formula with this run's numbers."""

    name: str
    bytes: int
    placement: str
    formula: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The planned bytes of one train step.

    components: persistent, stored, the peak phase's working set and the outputs, in that order.
    phases: {phase: bytes of its working set} for "backward" and "loss" (and, in full
      fine-tuning, "head_update" and "embedding"); `peak_phase` is the largest, and its
      components are the ones listed.
    lower_bound_bytes: what no step of this configuration can go below: persistent + stored on
      device + `working_set_floor` (the largest phase with every tensor counted once).
    settings: the choices the plan describes (method, batch, seq, dtype, optimizer, policy, ...).
    warnings: things the user should know (e.g. sequence beyond the trained context).
    rollout: GRPO's rollout phase beside the step (`rollout_plan.py`): what sampling holds
      beyond the resident weights and optimizer state (empty: no rollout phase).
    """

    components: tuple[PlanComponent, ...]
    phases: dict[str, int]
    peak_phase: str
    lower_bound_bytes: int
    settings: dict[str, Any]
    warnings: tuple[str, ...] = ()
    rollout: tuple[PlanComponent, ...] = ()

    @property
    def train_device_bytes(self) -> int:
        """Planned bytes on the accelerator at the train step's peak."""
        return sum(c.bytes for c in self.components if c.placement == DEVICE)

    @property
    def resident_device_bytes(self) -> int:
        """What stays on the device between steps and through the rollouts: the frozen base,
        the trainable weights and the optimizer state (where they are on the device)."""
        return sum(c.bytes for c in self.components if c.name in RESIDENT and c.placement == DEVICE)

    @property
    def rollout_device_bytes(self) -> int:
        """Planned bytes on the accelerator in the rollout phase (0 without one): the resident
        weights and optimizer state, counted once, and what sampling holds."""
        if not self.rollout:
            return 0
        return self.resident_device_bytes + sum(c.bytes for c in self.rollout)

    @property
    def device_bytes(self) -> int:
        """Planned bytes on the accelerator at the peak: the larger of the train step and the
        rollout phase."""
        return max(self.train_device_bytes, self.rollout_device_bytes)

    @property
    def host_bytes(self) -> int:
        """Planned bytes in (pinned) host memory: offloaded residuals, optimizer state, embedding,
        frozen layer stack."""
        return sum(c.bytes for c in self.components if c.placement == HOST)

    @property
    def cpu_comparable_bytes(self) -> int:
        """The train step's device + host bytes: what XLA CPU, with one memory for both,
        reports for it."""
        return self.train_device_bytes + self.host_bytes

    def bytes_of(self, name: str) -> int:
        """Planned bytes of a component (0 when the plan has none of that name)."""
        return sum(c.bytes for c in self.components if c.name == name)

    def largest_component(self) -> PlanComponent:
        """The largest component on the device (what a budget or a device must hold)."""
        return max((c for c in self.components if c.placement == DEVICE), key=lambda c: c.bytes)

    def measured_groups(self) -> dict[str, int]:
        """The plan summed into the groups a compiled step's memory analysis can tell apart
        (featherweight/memory/measure.py): the persistent components, `temporaries` (stored
        activations, wherever placed, and the working set) and `unaliased_outputs`."""
        groups = {name: self.bytes_of(name) for name in PERSISTENT}
        # an argument like the rest: trainable with full fine-tuning, frozen otherwise
        owner = "trainable_weights" if self.settings["method"] == "full" else "frozen_base"
        groups[owner] += self.bytes_of(HOST_EMBEDDING)
        groups["frozen_base"] += self.bytes_of(HOST_BASE)
        arguments = (*PERSISTENT, OUTPUTS, HOST_EMBEDDING, HOST_BASE)
        groups["temporaries"] = sum(c.bytes for c in self.components if c.name not in arguments)
        groups["unaliased_outputs"] = self.bytes_of(OUTPUTS)
        return groups
