"""Targets: every shipped GPU description loads, becomes a GpuTargetConfig XLA accepts and
compiles a small program for that GPU on this machine; usable memory; the missing-compiler error."""

import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from featherweight.errors import ConfigError
from featherweight.memory import targets
from featherweight.memory.targets import (
    LIBRARY_ALLOWANCE_BYTES,
    get_target,
    gpu_target_config,
    target_mesh,
    usable_bytes,
)
from featherweight.parallel.backend import cuda_plugin_installed

GPU_TARGETS = ("h100", "h200", "a100-80gb", "a100-40gb", "l40s", "l4", "rtx4090", "rtx3090")
needs_gpu_compiler = pytest.mark.skipif(
    not cuda_plugin_installed(),
    reason='XLA\'s GPU compiler is not installed (pip install "jax[cuda12-local]"); CI installs '
    "it with the test extra",
)


def test_every_target_is_shipped_with_its_facts_and_source():
    assert set(targets.targets()) == {*GPU_TARGETS, "cpu"}
    for name in GPU_TARGETS:
        target = get_target(name)
        assert target.platform == "gpu" and target.facts["source"]
        assert 16 * 2**30 < target.memory_bytes < 160 * 2**30
        assert tuple(target.facts["compute_capability"]) in targets._SM_FACTS
    assert get_target("cpu").memory_bytes is None
    assert get_target("H100") is get_target("h100")


def test_gpu_targets_carry_their_host_link_and_peak():
    """The published figures the base-on-host estimates use: PCIe x16 one way (4.0: 31.5 GB/s,
    5.0: 63 GB/s) and the dense bf16 tensor peak."""
    for name in GPU_TARGETS:
        target = get_target(name)
        assert target.host_link_bytes_per_second in (31.5e9, 63e9)
        assert 50e12 < target.peak_flops < 1000e12 and target.facts["link_and_peak_source"]
    assert get_target("h100").host_link_bytes_per_second == 63e9
    assert get_target("rtx4090").host_link_bytes_per_second == 31.5e9
    assert get_target("cpu").peak_flops is None


def test_target_configs_carry_the_facts():
    h100, l40s = gpu_target_config(get_target("h100")), gpu_target_config(get_target("l40s"))
    assert "core_count: 132" in h100 and "major: 9 minor: 0" in h100
    assert "device_memory_size: 84942979072" in h100
    assert "core_count: 142" in l40s and "major: 8 minor: 9" in l40s
    assert "shared_memory_per_core: 102400" in l40s


def test_an_unknown_target_names_the_known_ones():
    with pytest.raises(ConfigError, match="h100, h200, a100-80gb"):
        get_target("h900")


def test_usable_bytes_is_the_memory_fraction_less_the_allowance(monkeypatch):
    h100 = get_target("h100")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    assert usable_bytes(h100) == int(84942979072 * 0.75) - LIBRARY_ALLOWANCE_BYTES
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    assert usable_bytes(h100) == int(84942979072 * 0.9) - LIBRARY_ALLOWANCE_BYTES
    assert usable_bytes(get_target("cpu")) is None
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "1.5")
    with pytest.raises(ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION"):
        usable_bytes(h100)


def test_a_gpu_target_without_the_compiler_names_the_install_command(monkeypatch):
    monkeypatch.setattr(targets, "cuda_plugin_installed", lambda: False)
    with pytest.raises(ConfigError, match=r'pip install "jax\[cuda12-local\]==' + jax.__version__):
        targets.require_gpu_compiler(get_target("h100"))
    targets.require_gpu_compiler(get_target("cpu"))  # XLA:CPU is always there


@needs_gpu_compiler
@pytest.mark.parametrize("name", GPU_TARGETS)
def test_each_gpu_target_compiles_a_small_step_without_a_gpu(name):
    mesh = target_mesh(name)
    (device,) = mesh.devices.flat
    assert device.platform == "gpu" and device.device_kind == get_target(name).description
    replicated = NamedSharding(mesh, PartitionSpec())
    weights = jax.ShapeDtypeStruct((256, 512), jnp.bfloat16, sharding=replicated)
    inputs = jax.ShapeDtypeStruct((8, 256), jnp.bfloat16, sharding=replicated)

    def step(w, x):  # a matmul, a reduction and an update: a train step in miniature
        loss = jnp.sum(jnp.tanh(x @ w).astype(jnp.float32) ** 2)
        return w - 0.1 * jax.grad(lambda w: jnp.sum((x @ w).astype(jnp.float32) ** 2))(w), loss

    compiled = jax.jit(step, donate_argnums=0).lower(weights, inputs).compile()
    analysis = compiled.memory_analysis()
    assert analysis.argument_size_in_bytes == (256 * 512 + 8 * 256) * 2
    assert analysis.alias_size_in_bytes == 256 * 512 * 2  # donated weights updated in place
    # the GPU compiler's program: a Triton GEMM fusion or a cuBLAS call, never XLA:CPU's dot
    assert re.search(r"gemm_fusion|__cublas", compiled.as_text())
