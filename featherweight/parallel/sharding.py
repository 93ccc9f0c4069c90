"""Meshes and partition rules: data parallelism and FSDP on JAX's own SPMD (`jax.sharding`).

featherweight writes no communication: it names where every array lives, as a `NamedSharding` over
a two-axis mesh, and XLA's SPMD partitioner inserts the all-gathers and reduce-scatters.

    mesh axes  "data": replicas, each with its own slice of the batch
               "fsdp": devices that share every parameter (and the batch)

Rules, each a function `(path, leaf, mesh) -> PartitionSpec`:

- parameters (`parameter_spec`): one axis over "fsdp" -- the largest one that divides, never the
  leading layer axis of a stacked layer tensor (the streamed step slices layer l with a dynamic
  index; a sharded layer axis would move whole layers between devices). An MoE layer's expert
  stack [L, E, out, in] (and its per-expert LoRA adapters [L, E, r, in] / [L, E, out, r]: every
  rank-4 layer tensor) shards E when fsdp divides it, so each device holds whole experts; else
  the largest axis that divides, as for any tensor. The router [L, E, D] and the expert biases
  [L, E, F] follow the general rule. A frozen or fully trained
  weight with no divisible axis is refused (`ShardingError` naming the tensor and a mesh that
  works); LoRA adapters that do not divide stay replicated (they are small).
- NF4 weights: each field is flat per tensor, and its blocks must stay whole on one shard (the
  QLoRA-under-FSDP failure MaxText hits when a quantization block straddles a shard boundary).
  `codes` [.., n/2] is sharded only when each shard holds whole 64-value blocks, `absmax` [.., n/64]
  only when each shard holds whole 256-absmax groups (double quantization), `absmax_scale` when it
  divides; otherwise that field is replicated. Shard k of `codes` then covers exactly the blocks of
  shard k of `absmax`: dequantization needs no communication. An NF4 expert stack (stack axes
  [L, E]: each expert quantized on its own) shards every field on E when fsdp divides it -- each
  device holds whole experts' codes with their absmax, scales and offsets.
- optimizer state (`optimizer_state_spec`) follows its parameter: a state leaf is placed by the
  same shape rule, so a moment of a parameter's shape gets the parameter's spec; what does not
  divide (counts, factored or blockwise statistics) is replicated.
- batch (`place_batch`): rows (axis 0) over ("data", "fsdp") -- every device gets its own rows;
  the global batch must divide (`check_batch_size`). The key and the metrics are replicated.

With one device no sharding is applied at all (`mesh: null`): single-device runs are unchanged.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec, Sharding
from pydantic import BaseModel, ConfigDict, Field, field_validator

from featherweight.errors import ShardingError
from featherweight.quant.nf4 import ABSMAX_BLOCK_SIZE, BLOCK_SIZE

DATA, FSDP = "data", "fsdp"
BATCH_AXES = (DATA, FSDP)
LAYERS_KEY = "layers"
ADAPTER_KEY = "lora"
# NF4 field -> how many of its elements make one indivisible unit (a shard holds whole units)
NF4_FIELD_UNITS = {"codes": BLOCK_SIZE // 2, "absmax_scale": 1, "absmax_offset": 0}

Rule = Callable[[tuple, Any, Mesh | AbstractMesh], PartitionSpec]


# --- the mesh ----------------------------------------------------------------------------------


class MeshSettings(BaseModel):
    """The devices as a (data, fsdp) mesh (featherweight/parallel/sharding.py).

    data: replicas that each see their own slice of the batch. fsdp: devices over which every
    parameter, optimizer state and the batch are sharded (fully sharded data parallel). "auto"
    fills an axis with the devices left over; both "auto": one data replica per process (host), FSDP
    over each host's devices. The product must equal the number of devices.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    data: int | Literal["auto"] = Field("auto", description="data-parallel replicas")
    fsdp: int | Literal["auto"] = Field("auto", description="devices sharing each parameter")

    @field_validator("data", "fsdp")
    @classmethod
    def _positive(cls, size: int | str) -> int | str:
        if size != "auto" and size < 1:
            raise ValueError(f"a mesh axis size must be a positive integer or 'auto', got {size}")
        return size


def mesh_shape(settings: MeshSettings, device_count: int, process_count: int = 1) -> dict:
    """{"data": n, "fsdp": m} with "auto" filled in; n x m must be `device_count`."""
    data, fsdp = settings.data, settings.fsdp
    if data == "auto" and fsdp == "auto":
        data = process_count if device_count % process_count == 0 else 1
    if data == "auto":
        data = device_count // fsdp if device_count % fsdp == 0 else 0
    if fsdp == "auto":
        fsdp = device_count // data if device_count % data == 0 else 0
    if data * fsdp != device_count:
        given = f"data={settings.data}, fsdp={settings.fsdp}"
        raise ShardingError(
            f"mesh {given} does not fill the {device_count} devices present (the product of the "
            f"axis sizes must be {device_count}); use e.g. fsdp={device_count}, or data=1 and "
            f"fsdp=auto, or mesh: auto"
        )
    return {DATA: data, FSDP: fsdp}


def make_mesh(settings: MeshSettings, devices: list | None = None) -> Mesh:
    """The (data, fsdp) mesh over `devices` (default: every device of every process).

    Both axes are `Auto`: the SPMD partitioner propagates shardings through the step from the
    ones given for its arguments and results.
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_shape(settings, len(devices), jax.process_count())
    return jax.make_mesh(
        (shape[DATA], shape[FSDP]),
        (DATA, FSDP),
        axis_types=(AxisType.Auto, AxisType.Auto),
        devices=devices,
    )


def abstract_mesh(shape: dict[str, int]) -> AbstractMesh:
    """A mesh of `{"data": n, "fsdp": m}` without devices: apply the rules and count per-device
    bytes for a mesh this machine does not have (planning)."""
    return AbstractMesh((shape[DATA], shape[FSDP]), (DATA, FSDP), axis_types=(AxisType.Auto,) * 2)


def parse_mesh(text: str) -> MeshSettings:
    """A mesh written on the command line: `auto`, `fsdp=8` or `data=2,fsdp=4`."""
    if text.strip() == "auto":
        return MeshSettings()
    sizes: dict[str, int | str] = {}
    parts = [piece.strip() for piece in text.split(",")]
    for part in parts if any(parts) else [text]:
        axis, _, size = (piece.strip() for piece in part.partition("="))
        digits = size.isascii() and size.isdigit()
        if axis not in (DATA, FSDP) or axis in sizes or not (digits or size == "auto"):
            raise ShardingError(
                f"mesh {text!r} cannot be read at {part!r}; write e.g. fsdp=8, data=2,fsdp=4 or "
                "auto (axes: data, fsdp; sizes: positive integers or auto)"
            )
        sizes[axis] = size if size == "auto" else int(size)
    try:
        return MeshSettings(**sizes)
    except ValueError as error:
        raise ShardingError(f"mesh {text!r}: {error.errors()[0]['msg']}") from None


def requested_devices(settings: MeshSettings) -> int | None:
    """How many devices a mesh names by itself (an "auto" axis counts 1 when the other is given);
    None when both axes are "auto" (then it takes whatever devices there are)."""
    given = [size for size in (settings.data, settings.fsdp) if size != "auto"]
    return math.prod(given) if given else None


def planning_mesh(settings: MeshSettings) -> AbstractMesh:
    """The mesh a plan describes: `settings` resolved against the devices JAX sees, as an
    abstract mesh (the planner needs no device)."""
    return abstract_mesh(mesh_shape(settings, jax.device_count(), jax.process_count()))


def request_cpu_devices(count: int) -> None:
    """Have the CPU backend present `count` devices (virtual ones on one host), so a mesh of that
    size compiles on a CPU-only machine (`featherweight plan --mesh`). Only takes effect before
    JAX starts its backends; afterwards the devices are what they are (and a mesh that does not
    fit them is refused by `mesh_shape`)."""
    with contextlib.suppress(RuntimeError):
        jax.config.update("jax_num_cpu_devices", count)


def mesh_from_settings(settings: MeshSettings | None) -> Mesh | None:
    """The run's mesh: None (one device, no sharding) when no mesh is set and one process runs;
    several processes without a mesh setting get the "auto" mesh."""
    if settings is None:
        if jax.process_count() == 1:
            return None
        settings = MeshSettings()
    return make_mesh(settings)


# --- rules -------------------------------------------------------------------------------------


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


def _names(path: tuple) -> tuple[str, ...]:
    return tuple(_key_name(key) for key in path)


def _axis_spec(axis: int | None) -> PartitionSpec:
    if axis is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis), FSDP)


def _divisible_axis(shape: tuple[int, ...], first: int, shards: int) -> int | None:
    """The largest axis from `first` on that `shards` divides (the earliest among equals)."""
    candidates = [axis for axis in range(first, len(shape)) if shape[axis] % shards == 0]
    return max(candidates, key=lambda axis: (shape[axis], -axis), default=None)


def _expert_axis(shape: tuple[int, ...], stack_axes: int, shards: int) -> int | None:
    """1 -- E -- for a layer tensor stacked over [L, E] (`stack_axes` 2) when `shards` divides
    E, else None."""
    return 1 if stack_axes == 2 and shape[1] % shards == 0 else None


def _weight_axis(shape: tuple[int, ...], first: int, shards: int) -> int | None:
    """The axis a (non-NF4) tensor shards on: E of an expert stack (a rank-4 layer tensor:
    [L, E, out, in], its adapters and their moments) when `shards` divides it, else the largest
    axis from `first` on that divides."""
    expert = _expert_axis(shape, 2 if first and len(shape) == 4 else first, shards)
    return _divisible_axis(shape, first, shards) if expert is None else expert


def _stack_axes(names: tuple[str, ...]) -> int:
    """1 for tensors stacked over layers (and their optimizer states), else 0."""
    return 1 if LAYERS_KEY in names else 0


def _nf4_field_spec(field: str, leaf: Any, stack_axes: int, shards: int) -> PartitionSpec:
    """Shard a flat NF4 field only when every shard holds whole blocks (see module docstring)."""
    if field == "absmax":  # double-quantized (uint8) absmax comes in groups of 256
        unit = ABSMAX_BLOCK_SIZE if jnp.dtype(leaf.dtype) == jnp.uint8 else 1
    else:
        unit = NF4_FIELD_UNITS[field]
    own_axes = 0 if field == "absmax_offset" else 1  # the offset is one scalar per tensor
    if stack_axes and _expert_axis(leaf.shape, leaf.ndim - own_axes, shards) is not None:
        return _axis_spec(1)
    if unit == 0 or leaf.ndim <= stack_axes or leaf.shape[-1] % (unit * shards):
        return PartitionSpec()
    return _axis_spec(leaf.ndim - 1)


def _suggest_fsdp(shape: tuple[int, ...], first: int, device_count: int) -> int:
    """The largest fsdp size that divides the device count and some axis of `shape`."""
    sizes = [d for d in range(device_count, 0, -1) if device_count % d == 0]
    return next(d for d in sizes if _divisible_axis(shape, first, d) is not None)


def parameter_spec(path: tuple, leaf: Any, mesh: Mesh) -> PartitionSpec:
    """Where a parameter (frozen base, adapter, fully trained weight, NF4 field) lives."""
    shards = mesh.shape[FSDP]
    names = _names(path)
    first = _stack_axes(names)
    if shards == 1 or leaf.ndim <= first:
        return PartitionSpec()
    if names[-1] in (*NF4_FIELD_UNITS, "absmax"):
        return _nf4_field_spec(names[-1], leaf, first, shards)
    axis = _weight_axis(leaf.shape, first, shards)
    if axis is None and ADAPTER_KEY not in names:
        fsdp = _suggest_fsdp(leaf.shape, first, mesh.size)
        raise ShardingError(
            f"parameter {'.'.join(names)} of shape {tuple(leaf.shape)} has no axis divisible by "
            f"fsdp={shards}{' (the leading layer axis is never sharded)' if first else ''}; use "
            f"a mesh such as data={mesh.size // fsdp}, fsdp={fsdp}"
        )
    return _axis_spec(axis)


def optimizer_state_spec(path: tuple, leaf: Any, mesh: Mesh) -> PartitionSpec:
    """Optimizer state follows its parameter: the parameter's shape rule, replicated when nothing
    divides (step counts, [L] per-layer scalars, factored statistics)."""
    shards = mesh.shape[FSDP]
    first = _stack_axes(_names(path))
    if shards == 1 or leaf.ndim <= first:
        return PartitionSpec()
    return _axis_spec(_weight_axis(leaf.shape, first, shards))


def check_batch_size(global_batch: int, mesh: Mesh) -> None:
    """Refuse a batch whose rows cannot be split evenly over the data and fsdp axes."""
    shards = mesh.shape[DATA] * mesh.shape[FSDP]
    if global_batch % shards:
        per_process = f" ({jax.process_count()} processes)" if jax.process_count() > 1 else ""
        raise ShardingError(
            f"the global batch of {global_batch} rows{per_process} cannot be split over the mesh's "
            f"data x fsdp = {mesh.shape[DATA]} x {mesh.shape[FSDP]} = {shards} devices; use a "
            f"batch_size whose global batch is a multiple of {shards}, e.g. "
            f"{math.lcm(global_batch, shards) // jax.process_count()} per process"
        )


def check_layout(mesh: Mesh, trainable: Any, frozen: Any, global_batch: int) -> None:
    """Apply every rule to the (abstract) parameters and the batch size: a mesh that cannot hold
    them raises `ShardingError` before any weight is read."""
    tree_specs(trainable, mesh, parameter_spec)
    tree_specs(frozen, mesh, parameter_spec)
    check_batch_size(global_batch, mesh)


def replicated(mesh: Mesh) -> NamedSharding:
    """A whole copy on every device of the mesh (keys, metrics)."""
    return NamedSharding(mesh, PartitionSpec())


# --- trees ---------------------------------------------------------------------------------------


def tree_specs(tree: Any, mesh: Mesh, rule: Rule) -> Any:
    """The `PartitionSpec` of every leaf of `tree` (arrays or `ShapeDtypeStruct`s)."""
    return jax.tree_util.tree_map_with_path(lambda path, leaf: rule(path, leaf, mesh), tree)


def tree_shardings(tree: Any, mesh: Mesh, rule: Rule) -> Any:
    """The `NamedSharding` of every leaf: jit's in/out shardings, or abstract planning."""
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree_specs(tree, mesh, rule))


def _place(leaf: Any, sharding: NamedSharding) -> jax.Array:
    if sharding.is_fully_addressable:
        return jax.device_put(leaf, sharding)
    # multi-host: every process holds the whole value and hands over its own devices' shards
    return jax.make_array_from_callback(leaf.shape, sharding, lambda index: np.asarray(leaf[index]))


def shard_tree(tree: Any, mesh: Mesh, rule: Rule) -> Any:
    """`tree` placed on the mesh by `rule`, one leaf at a time."""
    return jax.tree.map(_place, tree, tree_shardings(tree, mesh, rule))


def place_batch(batch: Any, mesh: Mesh) -> Any:
    """The global batch (a pytree of [rows, ...] arrays, e.g. `step.loss.Batch`) from each
    process's rows (its `DataIterator` shard), split over the mesh."""
    sharding = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    rows = np.shape(batch.input_ids)[0]
    check_batch_size(rows * jax.process_count(), mesh)
    return jax.tree.map(
        lambda local: jax.make_array_from_process_local_data(sharding, np.asarray(local)), batch
    )


class StepShardings(NamedTuple):
    """How a train step `(trainable, opt_state, frozen, batch, key) -> (trainable, opt_state,
    metrics)` is laid out on a mesh. inputs/outputs: jit's in/out shardings (the state keeps its
    layout across steps, so donation aliases every buffer; the key and metrics are replicated).
    activations: the batch layout, pinned on the residual stream inside the step."""

    inputs: tuple
    outputs: tuple
    activations: NamedSharding


def step_shardings(mesh: Mesh, trainable: Any, opt_state: Any, frozen: Any) -> StepShardings:
    """The `StepShardings` of a step over `mesh` for these (real or abstract) pytrees."""
    trainable_s = tree_shardings(trainable, mesh, parameter_spec)
    state_s = tree_shardings(opt_state, mesh, optimizer_state_spec)
    frozen_s = tree_shardings(frozen, mesh, parameter_spec)
    rows = NamedSharding(mesh, PartitionSpec(BATCH_AXES))
    return StepShardings(
        inputs=(trainable_s, state_s, frozen_s, rows, replicated(mesh)),
        outputs=(trainable_s, state_s, replicated(mesh)),
        activations=rows,
    )


def per_device_bytes(tree: Any, shardings: Any) -> int:
    """Bytes one device holds of `tree` (arrays or abstract shapes) under `shardings` (a tree of
    shardings with `tree`'s structure, or a prefix of it such as jit's in_shardings, or a compiled
    step's `input_shardings`, where None marks an argument jit dropped).

    The planner's count of a sharded step's arguments, without compiling anything.
    """

    def subtree_bytes(sharding: Sharding | None, subtree: Any) -> int:
        if sharding is None:  # an argument jit dropped (unused): no bytes on any device
            return 0
        return sum(
            math.prod(sharding.shard_shape(tuple(leaf.shape))) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jax.tree.leaves(subtree)
        )

    sizes = jax.tree.map(subtree_bytes, shardings, tree, is_leaf=lambda node: node is None)
    return sum(jax.tree.leaves(sizes))
