"""GRPO's rollout program as compiled: `sample_group` lowered on abstract shapes, as the plan's
rollout phase plans it (`rollout_plan.py`: the rows sampled together, the longest prompt a row
admits), and its `memory_analysis()` read: temp + argument + output - alias. On XLA:CPU
(target "cpu") or for a GPU target by XLA's GPU compiler without the GPU (`targets.py`).

The program's arguments are the frozen base and the adapters (the same arrays the step reads);
the optimizer state, resident too, is not one of them: set the phase less `optimizer_state`
against this measurement.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from featherweight.inference.rollout import sample_group
from featherweight.memory.defaults import resolve
from featherweight.memory.rollout_plan import rollout_positions, rollout_rows
from featherweight.memory.targets import (
    DEVICELESS_COMPILER_OPTIONS,
    get_target,
    require_gpu_compiler,
    target_mesh,
)
from featherweight.models.config import ModelConfig
from featherweight.models.llama import merge_params
from featherweight.parallel.backend import native_stderr_silenced
from featherweight.recipe.build import abstract_split, lora_config_of
from featherweight.recipe.schema import TrainConfig


@dataclasses.dataclass(frozen=True)
class RolloutMeasurement:
    """The compiled rollout program's memory analysis, as reported, and where it was compiled."""

    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    target: str
    compile_seconds: float

    @property
    def total_bytes(self) -> int:
        """temp + argument + output - alias."""
        return self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes

    def as_dict(self) -> dict[str, int | float | str]:
        """Its fields and `total_bytes`, for a JSON report."""
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}


def measure_rollout(
    config: TrainConfig, model_config: ModelConfig, target: str = "cpu"
) -> RolloutMeasurement:
    """Compile GRPO's rollout program for `config` on abstract shapes for `target` ("cpu": this
    machine's XLA:CPU; a GPU name: deviceless) and read its memory analysis."""
    config = resolve(config, model_config)
    resolved = get_target(target)
    sharding = None
    if resolved.platform != "cpu":
        require_gpu_compiler(resolved)
        sharding = NamedSharding(target_mesh(resolved.name), PartitionSpec())

    def shaped(shape, dtype) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    trainable, frozen = abstract_split(config, model_config)
    params = jax.tree.map(lambda x: shaped(x.shape, x.dtype), merge_params(frozen, trainable))
    rows, grpo = rollout_rows(config), config.grpo
    prompt, completion = rollout_positions(config)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.PRNGKey(0), rows))
    lora = lora_config_of(config)
    lowered = sample_group.lower(
        params,
        shaped((prompt,), jnp.int32),
        shaped((), jnp.int32),
        shaped(keys.shape, keys.dtype),
        shaped((), jnp.float32),
        shaped((), jnp.float32),
        shaped((1,), jnp.int32),
        config=model_config,
        lora=None if lora is None else lora.spec,
        generations=rows,
        max_new=completion,
        greedy=False,
        use_top_p=grpo.top_p < 1,
        dtype=jnp.dtype(config.model.dtype),
    )
    start = time.perf_counter()
    if sharding is None:
        compiled = lowered.compile()
    else:
        with native_stderr_silenced():  # deviceless warnings: "compile with a GPU present"
            compiled = lowered.compile(DEVICELESS_COMPILER_OPTIONS)
    analysis = compiled.memory_analysis()
    return RolloutMeasurement(
        analysis.temp_size_in_bytes,
        analysis.argument_size_in_bytes,
        analysis.output_size_in_bytes,
        analysis.alias_size_in_bytes,
        resolved.name,
        time.perf_counter() - start,
    )
