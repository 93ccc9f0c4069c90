"""Targets: the devices a plan is for, and XLA's GPU compiler without the GPU.

`featherweight plan MODEL --target h100` compiles the real train step for an H100 on any machine:
XLA's GPU compiler (the `jax[cuda12-local]` plugin, no NVIDIA libraries needed) compiles against a
`GpuTargetConfig` -- the device's facts as a text proto -- instead of a live device ("deviceless
compilation"), and `compiled.memory_analysis()` reads the buffer assignment the H100 would run.

Each target's facts (SM count, compute capability, memory, bandwidth, L2) are package data
(`targets.json`, with their sources); the text proto is generated from them here. The facts the
compiler needs per SM follow from the compute capability (`_SM_FACTS`).

What a GPU can hold is less than its memory: JAX preallocates `XLA_PYTHON_CLIENT_MEM_FRACTION`
(default 0.75) of it for XLA's buffers, and cuBLAS/cuDNN workspaces and handles, which no memory
analysis shows, take part of that pool (`LIBRARY_ALLOWANCE_BYTES`). `usable_bytes` is what the
plan's device bytes must fit.

Deviceless limits (jax 0.10.2): no autotuning (GEMM tiles and cuBLAS workspace at defaults); sorts
need CUB's deviceless mode off. A topology's devices have no host memory for JAX, so a step with
host-resident arguments is lowered for CUDA against this machine's device (where the arguments
keep their `pinned_host` layouts) and that module is compiled by the target's compile-only client
(`compile_as_run`): XLA's GPU compiler then runs its host-offload pass on the program as it runs
(an illegal host placement fails here with error E1200, as on the GPU) and reports the host
bytes itself.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from featherweight.errors import ConfigError
from featherweight.models.attention_choice import AttentionTarget
from featherweight.parallel.backend import cuda_plugin_installed, native_stderr_silenced

TARGETS_FILE = Path(__file__).with_name("targets.json")
DEFAULT_MEMORY_FRACTION = 0.75  # JAX's default XLA_PYTHON_CLIENT_MEM_FRACTION
LIBRARY_ALLOWANCE_BYTES = 512 * 2**20  # cuBLAS/cuDNN workspaces and handles inside JAX's pool
# per compute capability (major, minor): shared memory per SM, per block (opt-in), threads per SM,
# FP32 units per SM (CUDA C++ Programming Guide, technical specifications per compute capability)
_SM_FACTS = {
    (8, 0): (167936, 166912, 2048, 64),
    (8, 6): (102400, 101376, 1536, 128),
    (8, 9): (102400, 101376, 1536, 128),
    (9, 0): (233472, 232448, 2048, 128),
}
CUDNN_VERSION = (9, 8, 0)  # the cuDNN jax 0.10.2's CUDA 12 wheels are built against
# sorts (top-k, argsort) otherwise ask CUB for its scratch size on a live device
DEVICELESS_COMPILER_OPTIONS = {"xla_gpu_deviceless_cub_mode": "DEVICELESS_CUB_DISABLED"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A device a plan is for: its name, facts and the compiler that measures it."""

    name: str
    description: str
    platform: str  # "gpu" or "cpu"
    facts: dict[str, Any]

    @property
    def memory_bytes(self) -> int | None:
        """The device's memory as the driver reports it (None for the CPU: no device limit)."""
        return self.facts.get("memory_bytes")

    @property
    def short_name(self) -> str:
        """How a person names it: "H100", "RTX 4090"."""
        return self.name.upper().replace("RTX", "RTX ").replace("-", " ")

    @property
    def host_link_bytes_per_second(self) -> float | None:
        """The host link's published one-way rate (PCIe x16), None for the CPU."""
        return self.facts.get("host_link_bytes_per_second")

    @property
    def peak_flops(self) -> float | None:
        """The published dense bf16 tensor-core peak, None for the CPU."""
        return self.facts.get("peak_bf16_flops")

    @property
    def step_target(self) -> AttentionTarget:
        """What a step for this device is compiled for: its platform and compute capability
        (the attention it runs, the calibration its plan uses)."""
        capability = self.facts.get("compute_capability")
        return AttentionTarget(
            self.platform, None if capability is None else ".".join(map(str, capability))
        )

    def calibration_key(self, dtype: str) -> str:
        """The working-set calibration for this target's compiler and `dtype`."""
        return f"xla-{self.platform}/{dtype}"


@functools.lru_cache(maxsize=1)
def targets() -> dict[str, Target]:
    """Every target featherweight ships, by name."""
    data = json.loads(TARGETS_FILE.read_text())["targets"]
    return {
        name: Target(name, facts["description"], facts["platform"], facts)
        for name, facts in data.items()
    }


def get_target(name: str) -> Target:
    """The target called `name` (case-insensitive); `ConfigError` naming the known ones."""
    known = targets()
    key = name.strip().lower()
    if key not in known:
        raise ConfigError(f"--target {name!r} is not a known target; use one of {', '.join(known)}")
    return known[key]


def memory_fraction() -> float:
    """JAX's share of device memory: XLA_PYTHON_CLIENT_MEM_FRACTION, default 0.75."""
    text = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    if text is None:
        return DEFAULT_MEMORY_FRACTION
    try:
        fraction = float(text)
    except ValueError:
        fraction = -1.0
    if not 0 < fraction <= 1:
        raise ConfigError(
            f"XLA_PYTHON_CLIENT_MEM_FRACTION={text!r} must be a number in (0, 1], e.g. 0.9"
        )
    return fraction


def usable_bytes(target: Target, fraction: float | None = None) -> int | None:
    """What a train step may use on `target`: memory x JAX's memory fraction, less
    `LIBRARY_ALLOWANCE_BYTES` for library workspaces and handles (None on the CPU)."""
    if target.memory_bytes is None:
        return None
    share = memory_fraction() if fraction is None else fraction
    return int(target.memory_bytes * share) - LIBRARY_ALLOWANCE_BYTES


def gpu_target_config(target: Target) -> str:
    """The `GpuTargetConfig` text proto XLA's GPU compiler takes for `target`, from its facts."""
    facts = target.facts
    major, minor = facts["compute_capability"]
    shared, shared_optin, threads, fpus = _SM_FACTS[(major, minor)]
    cudnn = dict(zip(("major", "minor", "patch"), CUDNN_VERSION))
    fields = {
        "threads_per_block_limit": 1024,
        "threads_per_warp": 32,
        "shared_memory_per_block": 49152,
        "shared_memory_per_core": shared,
        "threads_per_core_limit": threads,
        "core_count": facts["sm_count"],
        "fpus_per_core": fpus,
        "block_dim_limit_x": 2**31 - 1,
        "block_dim_limit_y": 65535,
        "block_dim_limit_z": 65535,
        "memory_bandwidth": facts["memory_bandwidth"],
        "l2_cache_size": facts["l2_cache_bytes"],
        "clock_rate_ghz": facts["clock_ghz"],
        "device_memory_size": facts["memory_bytes"],
        "shared_memory_per_block_optin": shared_optin,
        "registers_per_core_limit": 65536,
        "registers_per_block_limit": 65536,
        "thread_dim_limit_x": 1024,
        "thread_dim_limit_y": 1024,
        "thread_dim_limit_z": 64,
    }
    lines = [f"  {key}: {value}" for key, value in fields.items()]
    lines.append(f"  cuda_compute_capability {{ major: {major} minor: {minor} }}")
    return "\n".join(
        [
            "gpu_device_info {",
            *lines,
            "}",
            'platform_name: "CUDA"',
            "dnn_version_info { " + " ".join(f"{k}: {v}" for k, v in cudnn.items()) + " }",
            f'device_description_str: "{target.description}"',
        ]
    )


def install_command() -> str:
    """The pip command that adds XLA's GPU compiler for the jax in use."""
    import jax

    return f'pip install "jax[cuda12-local]=={jax.__version__}"'


def require_gpu_compiler(target: Target) -> None:
    """Raise `ConfigError` (with the install command) when `target` is a GPU and the
    GPU compiler is not installed: checked before any model is read or step built."""
    if target.platform == "gpu" and not cuda_plugin_installed():
        raise ConfigError(
            f"--target {target.name} compiles the step with XLA's GPU compiler, which is not "
            f'installed; run: {install_command()} (or pip install "featherweight[gpu-plan]"), '
            "or plan without compiling: --no-measure"
        )


@functools.lru_cache(maxsize=16)
def target_devices(name: str) -> tuple:
    """One device of `name`'s topology, for compiling without it (a GPU target) or the local CPU."""
    import jax

    target = get_target(name)
    if target.platform == "cpu":
        return (jax.devices("cpu")[0],)
    require_gpu_compiler(target)
    from jax.experimental import topologies

    with native_stderr_silenced():  # "Could not find cuda drivers": expected here
        topology = topologies.get_topology_desc(
            platform="cuda", topology="1x1x1", target_config=gpu_target_config(target)
        )
    return tuple(topology.devices)


def target_mesh(name: str):
    """A (data, fsdp) mesh of one device of target `name`: the step compiles for that device."""
    import jax
    from jax.sharding import AxisType

    from featherweight.parallel.sharding import BATCH_AXES

    devices = target_devices(name)
    return jax.sharding.Mesh(
        np.array(devices).reshape(1, 1),
        BATCH_AXES,
        axis_types=(AxisType.Auto, AxisType.Auto),
    )


def compile_as_run(lowered, name: str):
    """Compile a step lowered for CUDA on this machine (`offload_rules.lower_for_gpu`: host
    arguments and results keep their `pinned_host` layouts) with XLA's GPU compiler for target
    `name`, deviceless -> an executable with `get_compiled_memory_stats()` (host bytes apart).

    Raises `ConfigError` naming the reason when this jax cannot compile a lowered module for a
    topology (it goes through jax's compile options, which are not public API)."""
    try:
        from jax._src import compiler
        from jax._src.lib import xla_client
    except ImportError as error:  # pragma: no cover - depends on the jax release
        raise ConfigError(
            f"this jax cannot compile host-resident arguments for a GPU target ({error}); "
            "the plan marks them as not compiled as run"
        ) from None
    device = target_devices(name)[0]
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=1, device_assignment=[device]
    )
    options.env_option_overrides = [
        *options.env_option_overrides,
        *DEVICELESS_COMPILER_OPTIONS.items(),
    ]
    with native_stderr_silenced():  # deviceless warnings: "compile with a GPU present"
        return device.client.compile(
            lowered.compiler_ir("stablehlo"),
            executable_devices=xla_client.DeviceList((device,)),
            compile_options=options,
        )
