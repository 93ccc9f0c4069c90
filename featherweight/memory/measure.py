"""Memory as measured: the real train step, compiled on abstract shapes, and peaks of real steps.

`measure_compiled` builds exactly the step the trainer runs (`train/run.py` `prepare_run`: the
config resolved, the abstract trainable/frozen split, the optimizer, `build_train_step`,
`jax.eval_shape` of the optimizer state), lowers it on `jax.ShapeDtypeStruct`s -- so an 8B model is measured without allocating a
byte of weights -- and reads XLA's buffer assignment from `compiled.memory_analysis()`:

    total = temp + argument + output - alias

Parameters and optimizer state are donated, so `alias` covers them and the total is what the
step holds at its peak: frozen + trainable + optimizer state + batch + temporaries (+ outputs that
alias nothing: the metrics). The argument side is split into the planner's components by the
pytrees the step takes; XLA's temp buffer is reported as one component (`temporaries`): buffer
assignment knows no owners inside it.

XLA CPU artifacts (why CPU numbers differ from an accelerator's):
- host memory kinds are dropped when lowering for CPU, so residuals placed on "host" count in
  temp there: compare the plan's device + host bytes with a CPU measurement;
- there is no native bf16 matmul or dynamic-slice on CPU: bf16 weight stacks sliced by the layer
  loop and bf16 matmul operands are converted to float32 copies, inflating bf16 temp on CPU.

`measure_device_peak` runs real steps (random weights) on the default device and reads
`device.memory_stats()["peak_bytes_in_use"]`; accelerators report it, XLA CPU does not.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from featherweight.errors import ConfigError
from featherweight.memory.defaults import resolve
from featherweight.memory.state_bytes import (
    host_base_bytes,
    host_embedding_bytes,
    optimizer_state_bytes,
)
from featherweight.memory.targets import (
    DEVICELESS_COMPILER_OPTIONS,
    compile_as_run,
    get_target,
    require_gpu_compiler,
    target_mesh,
)
from featherweight.models.attention_choice import AttentionTarget, cudnn_library_refusal
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.parallel.backend import native_stderr_silenced
from featherweight.parallel.memory_kinds import host_resident_bytes
from featherweight.parallel.offload_rules import lower_for_gpu
from featherweight.parallel.sharding import per_device_bytes
from featherweight.recipe.build import (
    abstract_split,
    attention_implementation,
    build_train_step,
    split_params,
)
from featherweight.recipe.objectives import step_objective
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.placement import arguments_on_host, place_abstract
from featherweight.recipe.schema import TrainConfig
from featherweight.step.objective import abstract_batch as objective_batch

MEASURED_COMPONENTS = (
    "frozen_base",
    "trainable_weights",
    "optimizer_state",
    "batch",
    "temporaries",
    "unaliased_outputs",
)


@dataclasses.dataclass(frozen=True)
class MemoryMeasurement:
    """Bytes of one compiled train step, split by owner where the owner is known.

    components: {name: bytes} over `MEASURED_COMPONENTS`; they sum to `total_bytes`.
    temp/argument/output/alias: XLA's `memory_analysis()` fields, as reported.
    platform: the backend that compiled it ("cpu", "gpu", "tpu").
    """

    components: dict[str, int]
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    platform: str
    compile_seconds: float
    host_argument_bytes: int = 0
    host_temp_bytes: int = 0
    target: str | None = None
    derived: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        """temp + argument + output - alias (+ host temp): the step's bytes at its peak, device
        and host together."""
        device_side = self.temp_bytes + self.argument_bytes + self.output_bytes - self.alias_bytes
        return device_side + self.host_temp_bytes

    @property
    def device_bytes(self) -> int:
        """`total_bytes` less what the compiled program keeps in pinned host memory: arguments
        (optimizer state, embedding table) and, on a GPU, host temporaries (offloaded residuals).
        On CPU, with one memory for both, the analysis counts host-placed temporaries in temp."""
        return self.total_bytes - self.host_argument_bytes - self.host_temp_bytes

    @property
    def compiled(self) -> bool:
        """Whether every number is the compiler's own (no host bytes subtracted by us)."""
        return not self.derived


def tree_nbytes(tree: Any) -> int:
    """Bytes of every array (or `ShapeDtypeStruct`) leaf of a pytree."""
    return sum(
        math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree)
    )


def abstract_batch(batch_size: int, seq_len: int, config: TrainConfig | None = None) -> Batch:
    """The `Batch` of shapes the step of `config` takes: its objective's layout
    (`step/objective.py` `abstract_batch`; packed rows for next-token cross-entropy)."""
    return objective_batch(None if config is None else step_objective(config), batch_size, seq_len)


def abstract_step_arguments(
    config: TrainConfig,
    model_config: ModelConfig,
    mesh=None,
    target: AttentionTarget | None = None,
):
    """(step, (trainable, opt_state, frozen, batch, key)) as abstract shapes, as `prepare_run`
    builds them, for `target` (default: this process's device); on `mesh` (default: the one
    `config.mesh` describes) the step is the sharded one. Settings still "auto" are chosen for
    that mesh and target (`resolve`), as the trainer and the plan choose them (a mesh of one
    device, a target's, is one device)."""
    config = resolve(config, model_config, mesh, target)
    trainable, frozen = abstract_split(config, model_config)
    optimizer = make_optimizer(config.optimizer, config.steps)
    step, init_opt_state = build_train_step(
        config, model_config, trainable, frozen, optimizer, mesh, target
    )
    opt_state = jax.eval_shape(init_opt_state, trainable)
    trainable, opt_state, frozen = place_abstract(config, trainable, opt_state, frozen)
    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    batch = abstract_batch(config.batch_size, config.data.seq_len, config)
    return step, (trainable, opt_state, frozen, batch, key)


def measure_compiled(
    config: TrainConfig, model_config: ModelConfig, mesh=None
) -> MemoryMeasurement:
    """Compile the configured train step on abstract shapes and read its memory analysis (per
    device on `mesh`, e.g. a mesh over some of the devices; default: `config.mesh`).

    Allocates no weights; compiling a large model takes host memory and time (minutes for 8B).
    """
    step, arguments = abstract_step_arguments(config, model_config, mesh)
    trainable, opt_state, frozen, _, _ = arguments
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    return measurement_of(compiled, trainable, opt_state, frozen, time.perf_counter() - start)


def measurement_of(
    compiled,
    trainable,
    opt_state,
    frozen,
    compile_seconds: float,
    platform: str | None = None,
    shardings=None,
) -> MemoryMeasurement:
    """The components of a compiled train step's memory analysis (the trainer's own, one
    compiled on abstract shapes, or a deviceless executable from `targets.compile_as_run`;
    `platform`: the compiler's, default the local backend; `shardings`: the (trainable,
    opt_state, frozen) shardings, default the compiled step's input shardings).

    Host bytes XLA reports apart (arguments in pinned host memory, host temporaries, host
    outputs) are folded back in: arguments count whole in `argument_bytes` with their host part
    in `host_argument_bytes`; unaliased host outputs count as host temporaries."""
    platform = platform or jax.default_backend()
    if hasattr(compiled, "memory_analysis"):
        analysis = compiled.memory_analysis()
    else:
        analysis = compiled.get_compiled_memory_stats()
    if analysis is None:
        raise ConfigError(
            f"the {platform} backend reports no memory analysis; measure on CPU or GPU"
        )

    def reported(field: str) -> int:
        return getattr(analysis, field, 0) or 0

    host_argument = reported("host_argument_size_in_bytes")
    temp = analysis.temp_size_in_bytes
    argument = analysis.argument_size_in_bytes + host_argument
    output = analysis.output_size_in_bytes + reported("host_output_size_in_bytes")
    alias = analysis.alias_size_in_bytes + reported("host_alias_size_in_bytes")
    host_temp = reported("host_temp_size_in_bytes") + max(
        reported("host_output_size_in_bytes") - reported("host_alias_size_in_bytes"), 0
    )
    # per device: on a mesh each argument counts with its shard (parallel/sharding.py)
    trainable_s, state_s, frozen_s = shardings or compiled.input_shardings[0][:3]
    persistent = {
        "frozen_base": per_device_bytes(frozen, frozen_s),
        "trainable_weights": per_device_bytes(trainable, trainable_s),
        "optimizer_state": per_device_bytes(opt_state, state_s),
    }
    components = {
        **persistent,
        # the rest of the arguments: the batch, and the dropout key when used (jit drops unused
        # arguments, such as the key without dropout)
        "batch": argument - sum(persistent.values()),
        "temporaries": temp,
        "unaliased_outputs": output - alias,
    }
    host_arguments = host_argument or host_resident_bytes(
        (trainable, opt_state, frozen), (trainable_s, state_s, frozen_s)
    )
    return MemoryMeasurement(
        components,
        temp,
        argument,
        output,
        alias,
        platform,
        compile_seconds,
        host_arguments,
        host_temp,
    )


def _argument_shardings(tree):
    """Each leaf's sharding, the default device's for a leaf without one."""
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda leaf: getattr(leaf, "sharding", None) or device, tree)


def measure_for_target(
    config: TrainConfig, model_config: ModelConfig, target: str
) -> MemoryMeasurement:
    """The configured step compiled for `target` ("h100", "rtx4090", ..., "cpu": this machine's
    XLA:CPU) on abstract shapes, on any machine: a GPU target is compiled by XLA's GPU compiler
    against the target's description (`memory.targets`), with no GPU present.

    Host placements compile as they run: a step with its optimizer state, embedding table or
    frozen base in pinned host memory is lowered for CUDA with those arguments in host memory
    and compiled for the target (`targets.compile_as_run`), whose host-offload pass checks the
    placement and reports the host bytes itself. Only where this jax cannot do that are the host
    arguments compiled as device arrays and their exact bytes (`jax.eval_shape` of the real
    initialisers) counted as host bytes: then `MemoryMeasurement.derived` says "not compiled as
    run". Residuals offloaded inside the step always compile as they run (host temporaries).
    """
    resolved = get_target(target)
    if resolved.platform == "cpu":
        return dataclasses.replace(measure_compiled(config, model_config), target=resolved.name)
    require_gpu_compiler(resolved)
    refusal = cudnn_not_loadable(config, model_config, resolved.step_target)
    if refusal:
        raise ConfigError(
            f"the step for the {resolved.short_name} cannot be compiled here: {refusal}; plan it "
            "without compiling (--no-measure), or name memory.attention: blockwise"
        )
    placed = arguments_on_host(config)
    if placed:
        try:
            return _measure_as_run(config, model_config, resolved.name)
        except NotCompiledAsRun as reason:
            derived_reason = str(reason)
    else:
        derived_reason = ""
    as_device = config.model_copy(
        update={"memory": config.memory.model_copy(update=dict.fromkeys(placed, "device"))}
    )
    step, arguments = abstract_step_arguments(
        as_device, model_config, target_mesh(resolved.name), resolved.step_target
    )
    trainable, opt_state, frozen, _, _ = arguments
    start = time.perf_counter()
    lowered = step.lower(*arguments)
    with native_stderr_silenced():  # deviceless warnings: "compile with a GPU present"
        compiled = lowered.compile(DEVICELESS_COMPILER_OPTIONS)
    measured = measurement_of(
        compiled, trainable, opt_state, frozen, time.perf_counter() - start, "gpu"
    )
    if not placed:
        return dataclasses.replace(measured, target=resolved.name)
    host_bytes = {
        "optimizer_state": optimizer_state_bytes(config, model_config),
        "embed": host_embedding_bytes(config, model_config),
        "base": host_base_bytes(config, model_config),
    }
    derived = tuple(
        f"memory.{name}: host not compiled as run ({derived_reason}): compiled as a device array, "
        f"its {host_bytes[name]:,} B (exact, from eval_shape) counted as host bytes"
        for name in placed
    )
    return dataclasses.replace(
        measured,
        host_argument_bytes=sum(host_bytes[name] for name in placed),
        target=resolved.name,
        derived=derived,
    )


def cudnn_not_loadable(
    config: TrainConfig, model_config: ModelConfig, target: AttentionTarget
) -> str | None:
    """Why the step planned for `target` cannot be compiled in this process (None when it can):
    it calls cuDNN's fused attention, as it runs on that GPU, and jax lowers a cuDNN call only
    where cuDNN's library loads."""
    attention = attention_implementation(config, model_config, target)
    refusal = cudnn_library_refusal() if attention.startswith("cudnn") else None
    if refusal is None:
        return None
    return f"its attention is cuDNN's fused kernel ({attention}), and {refusal}"


class NotCompiledAsRun(Exception):
    """This jax cannot compile host-resident arguments for a GPU target without the GPU."""


def _measure_as_run(config: TrainConfig, model_config: ModelConfig, target: str):
    """The step with its host-resident arguments, lowered for CUDA here and compiled for
    `target` by XLA's GPU compiler: the program a GPU runs, host-offload pass included."""
    step, arguments = abstract_step_arguments(
        config, model_config, target=get_target(target).step_target
    )
    trainable, opt_state, frozen, _, _ = arguments
    start = time.perf_counter()
    try:
        compiled = compile_as_run(lower_for_gpu(step, *arguments), target)
    except ConfigError as error:
        raise NotCompiledAsRun(str(error)) from None
    shardings = _argument_shardings((trainable, opt_state, frozen))
    measured = measurement_of(
        compiled, trainable, opt_state, frozen, time.perf_counter() - start, "gpu", shardings
    )
    return dataclasses.replace(measured, target=target)


class DevicePeak(NamedTuple):
    """`peak_bytes_in_use` after setting up (weights, optimizer state) and after the steps.

    The device's peak is a high-water mark of the whole process: the steps' own peak shows only
    when `after_steps` exceeds `after_setup` (`step_peak_seen`).
    """

    after_setup: int
    after_steps: int

    @property
    def step_peak_seen(self) -> bool:
        return self.after_steps > self.after_setup


def measure_device_peak(
    config: TrainConfig, model_config: ModelConfig, steps: int = 2
) -> DevicePeak:
    """Run `steps` real train steps on random weights on the default device and read its
    `memory_stats()["peak_bytes_in_use"]` (GPU/TPU; XLA CPU keeps no such statistics).

    Run it in a fresh process: the peak is never reset, so anything allocated before counts.
    """
    device = jax.devices()[0]
    if "peak_bytes_in_use" not in (device.memory_stats() or {}):
        raise ConfigError(
            f"device {device.platform} reports no peak_bytes_in_use (XLA CPU does not); run on a "
            "GPU or TPU, or use measure_compiled for the compiled step's memory analysis"
        )
    key = jax.random.PRNGKey(config.seed)
    params = init_params(key, model_config, jnp.dtype(config.model.dtype))
    trainable, frozen = split_params(params, config, model_config, key)
    del params
    optimizer = make_optimizer(config.optimizer, config.steps)
    step, init_opt_state = build_train_step(config, model_config, trainable, frozen, optimizer)
    opt_state = init_opt_state(trainable)
    shape = (config.batch_size, config.data.seq_len)
    ids = jax.random.randint(key, shape, 0, model_config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(shape[1]), shape)
    batch = Batch(ids, ids, jnp.ones(shape, jnp.float32), positions, jnp.ones(shape, jnp.int32))
    abstract = abstract_batch(*shape, config)
    if abstract.sequence_ids is not None:  # preference pairs padded: row 2p chosen, 2p + 1 rejected
        rows = jnp.broadcast_to(jnp.arange(shape[0], dtype=jnp.int32)[:, None], shape)
        zeros = None if abstract.reference_logps is None else jnp.zeros(shape, jnp.float32)
        batch = batch._replace(sequence_ids=rows, reference_logps=zeros)
    jax.block_until_ready((trainable, opt_state, frozen, batch))
    after_setup = device.memory_stats()["peak_bytes_in_use"]
    for index in range(steps):
        trainable, opt_state, metrics = step(
            trainable, opt_state, frozen, batch, jax.random.fold_in(key, index)
        )
    jax.block_until_ready(metrics)
    return DevicePeak(after_setup, device.memory_stats()["peak_bytes_in_use"])
