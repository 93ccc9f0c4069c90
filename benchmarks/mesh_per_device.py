"""Per-device memory of the train step on 1, 2, 4 and 8 devices (FSDP): plan next to the sharded
step compiled on abstract shapes, SmolLM2-135M shapes, float32, batch 8 x 256, AdamW.

Runs on a CPU-only machine with 8 virtual devices (XLA_FLAGS is set here when absent).

    python benchmarks/mesh_per_device.py [--out benchmarks/results/mesh_per_device_cpu.md]
"""

from __future__ import annotations

import argparse
import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax
from results_file import emit

from featherweight.memory.measure import measure_compiled
from featherweight.memory.mesh_plan import plan_for_mesh
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes, percent_difference
from featherweight.models.registry import builtin_config
from featherweight.parallel.sharding import abstract_mesh, make_mesh
from featherweight.recipe.schema import MeshSettings, parse_config


def measure(config, model, devices):
    mesh = None
    if devices > 1:
        mesh = make_mesh(MeshSettings(data=1, fsdp=devices), jax.devices()[:devices])
    return measure_compiled(config, model, mesh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = builtin_config("SmolLM2-135M")
    lines = [
        "# Per-device memory on an FSDP mesh: SmolLM2-135M, float32, batch 8 x 256, AdamW",
        "",
        f"machine: CPU, {jax.device_count()} virtual XLA devices; jax {jax.__version__}. "
        "measured = temp + argument + output - alias of the sharded step's memory_analysis()",
        "",
        "| method | devices | planned / device | measured / device | diff | arguments / device "
        "| arguments x devices / one device's |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method in ("full", "lora", "qlora"):
        config = parse_config(
            {
                "method": method,
                "batch_size": 8,
                "model": {"dtype": "float32"},
                "data": {"seq_len": 256},
                "memory": {"loss_chunk": 64},
            }
        )
        single_arguments = None
        for devices in (1, 2, 4, 8):
            if devices == 1:
                plan = plan_for_config(config, model)
            else:
                plan = plan_for_mesh(config, model, abstract_mesh({"data": 1, "fsdp": devices}))
            measured = measure(config, model, devices)
            single_arguments = single_arguments or measured.argument_bytes
            ratio = measured.argument_bytes * devices / single_arguments
            lines.append(
                f"| {method} | {devices} | {format_bytes(plan.device_bytes)} | "
                f"{format_bytes(measured.total_bytes)} | "
                f"{percent_difference(plan.device_bytes, measured.total_bytes):+.1f}% | "
                f"{format_bytes(measured.argument_bytes)} | {ratio:.3f} |"
            )
            print(lines[-1], flush=True)
    emit(lines, args.out)


if __name__ == "__main__":
    main()
