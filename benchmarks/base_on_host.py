"""Models larger than the GPU: the frozen base in host memory (`memory.base: host`), one layer
ahead on the device. Llama-3.1-70B QLoRA b1 x 4096 in 16 GiB and Llama-3.1-8B QLoRA b1 x 2048 in
4 GiB: the settings the budget search picks, their device and host bytes, the transfer and compute
estimates on an RTX 4090 and an H100, and the step-time overhead of the slicing on this CPU.

Every number says what it is:
- planned: `fit_budget` with the XLA:GPU bfloat16 buffer counts (`--target`'s calibration), from
  shapes only; the base's two layers in flight are planned on the device;
- compiled: the same settings in float32 compiled by XLA:CPU on abstract shapes
  (`measure_compiled`, `--compile`) beside the float32 plan with the XLA:CPU counts: device bytes
  leave out the host-resident arguments by their memory kind (the frozen stack, and whatever
  else the search put on the host); XLA:CPU has one memory, so what it places on the host inside
  the step counts as device bytes there. float32 doubles every dense tensor (the embedding and
  LM head: 3.9 GiB for Llama's 128256 x 4096 pair), so these columns check the plan, not the goal;
- estimates: bytes over the host link per step at the target's published PCIe x16 one-way rate,
  matmul FLOPs at its published dense bf16 peak (`memory/targets.json`): lower bounds on both
  times, and whether overlapped transfers can hide behind compute;
- measured: step times on this machine's CPU, a small LoRA model with the base on the device and
  on the host, interleaved repeats (median ratio).

    python benchmarks/base_on_host.py [--compile] [--out benchmarks/results/base_on_host.md]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import optax
from results_file import emit

from featherweight.memory.budget import describe_changes, fit_budget
from featherweight.memory.measure import measure_compiled
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes
from featherweight.memory.step_cost import host_base_estimate
from featherweight.memory.targets import get_target
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.batch import batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.models.registry import builtin_config
from featherweight.parallel.memory_kinds import to_host
from featherweight.peft.lora import LoraConfig, init_lora
from featherweight.recipe.schema import parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.streamed import build_streamed_step

GIB = 2**30
CASES = {  # name: (model, batch, seq, budget in GiB, goal)
    "Llama-3.1-70B QLoRA b1 x 4096": ("Llama-3.1-70B", 1, 4096, 16, "<= 16 GiB"),
    "Llama-3.1-8B QLoRA b1 x 2048": ("Llama-3.1-8B", 1, 2048, 4, "<= 4 GiB"),
}
TARGETS = ("rtx4090", "h100")


def requested(batch: int, seq: int, dtype: str = "bfloat16"):
    return parse_config(
        {
            "method": "qlora",
            "batch_size": batch,
            "model": {"dtype": dtype},
            "data": {"seq_len": seq},
            "lora": {"rank": 8},
            "memory": {"attention": "blockwise"},
        }
    )


def as_float32(config):
    return config.model_copy(update={"model": config.model.model_copy(update={"dtype": "float32"})})


def planned_rows(compile_steps: bool) -> list[str]:
    lines = [
        "| case | goal | settings the search picked | planned device | planned host | "
        "f32: planned device (XLA:CPU counts) | f32: compiled device (XLA:CPU) | f32: compiled "
        "host arguments |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    estimates = []
    for name, (model_name, batch, seq, budget, goal) in CASES.items():
        model = builtin_config(model_name)
        start = requested(batch, seq)
        # XLA's GPU compiler's counts (no GPU generation named: blockwise attention)
        fitted, plan = fit_budget(start, model, budget * GIB, target=AttentionTarget("gpu"))
        planned32 = compiled_device = compiled_host = "-"
        if compile_steps:
            check = as_float32(fitted)
            planned32 = format_bytes(plan_for_config(check, model).device_bytes)
            measured = measure_compiled(check, model)
            compiled_device = format_bytes(measured.device_bytes)
            compiled_host = format_bytes(measured.host_argument_bytes)
        changes = "; ".join(describe_changes(start, fitted)) or "as configured"
        lines.append(
            f"| {name} | {goal} | {changes} | **{format_bytes(plan.device_bytes)}** | "
            f"{format_bytes(plan.host_bytes)} | {planned32} | {compiled_device} | "
            f"{compiled_host} |"
        )
        for target_name in TARGETS:
            target = get_target(target_name)
            estimate = host_base_estimate(
                fitted, model, target.host_link_bytes_per_second, target.peak_flops
            )
            estimates.append(
                f"| {name} | {target.short_name} | {estimate.moved_bytes / GIB:.1f} GiB | "
                f"{target.host_link_bytes_per_second / 1e9:.1f} GB/s | "
                f"{estimate.transfer_seconds:.2f} s | {estimate.flops / 1e12:,.0f} TFLOP | "
                f"{target.peak_flops / 1e12:.0f} TFLOP/s | {estimate.compute_seconds:.2f} s | "
                f"{estimate.hiding_tokens:,} |"
            )
    return [
        *lines,
        "",
        "## Transfer and compute per step (estimates from published peaks)",
        "",
        "| case | target | base over the link | link (PCIe x16, one way) | transfer | matmul "
        "FLOPs | dense bf16 peak | compute at peak | compute hides the transfer from (B x S "
        "tokens) |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *estimates,
    ]


def overhead_rows(repeats: int) -> list[str]:
    """Step time of a small LoRA model, base on the device and on the host, interleaved."""
    config = ModelConfig(
        model_type="llama", vocab_size=2048, hidden_size=256, intermediate_size=768,
        num_layers=8, num_heads=8, num_kv_heads=4, head_dim=32, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    params = init_params(jax.random.PRNGKey(0), config)
    lora = LoraConfig(rank=8, alpha=16)
    optimizer = optax.adamw(1e-3)
    batch = batch_from_tokens(jax.random.randint(jax.random.PRNGKey(1), (2, 257), 0, 2048))
    runs = {}
    for placement in ("device", "host"):
        frozen = (
            params if placement == "device" else {**params, "layers": to_host(params["layers"])}
        )
        trainable = init_lora(jax.random.PRNGKey(2), config, lora)
        step = build_streamed_step(config, optimizer, trainable, frozen, lora.spec, donate=False)
        state = init_streamed_opt_state(optimizer, trainable)
        jax.block_until_ready(step(trainable, state, frozen, batch, jax.random.PRNGKey(0)))
        runs[placement] = (step, trainable, state, frozen)
    times = {placement: [] for placement in runs}
    for _ in range(repeats):
        for placement, (step, trainable, state, frozen) in runs.items():
            begin = time.perf_counter()
            jax.block_until_ready(step(trainable, state, frozen, batch, jax.random.PRNGKey(0)))
            times[placement].append(time.perf_counter() - begin)
    ratios = [host / device for host, device in zip(times["host"], times["device"], strict=True)]
    return [
        "",
        "## Step time, base on the host against on the device (measured, this CPU)",
        "",
        f"LoRA r8 over an 8-layer float32 model (D 256, F 768, V 2048), batch 2 x 256; {repeats} "
        "interleaved repeats after one warm-up step each. On a CPU host and device are one "
        "memory, so this is the cost of slicing the stack on the host side and carrying the next "
        "layer, not of a transfer.",
        "",
        "| base | median step | host / device (median of per-round ratios) |",
        "| --- | ---: | ---: |",
        f"| device | {statistics.median(times['device']) * 1e3:.1f} ms | 1.00 |",
        f"| host | {statistics.median(times['host']) * 1e3:.1f} ms | "
        f"{statistics.median(ratios):.2f} |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--compile", action="store_true", help="compile each case on XLA:CPU")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    lines = [
        "# Models larger than the GPU: the frozen base on the host",
        "",
        f"machine: {platform.machine()} CPU, {jax.device_count()} JAX device(s), no GPU; jax "
        f"{jax.__version__}. bf16 weights, NF4 base, LoRA rank 8 on all 7 targets, blockwise "
        "attention; plans with the XLA:GPU bfloat16 buffer counts. `python "
        "benchmarks/base_on_host.py" + (" --compile" if args.compile else "") + "`",
        "",
        *planned_rows(args.compile),
        *overhead_rows(args.repeats),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
