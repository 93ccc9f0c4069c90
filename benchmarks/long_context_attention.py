"""Long context on CPU: blockwise against materialized attention, compiled and planned.

    python benchmarks/long_context_attention.py memory [--seqs 4096 16384 65536] [--out FILE]
    python benchmarks/long_context_attention.py speed [--seqs 2048 8192] [--repeats 3] [--out FILE]

memory: SmolLM2-135M QLoRA (float32, the XLA:CPU calibration's dtype), batch 1, the train step
compiled on abstract shapes (`memory.measure.measure_compiled`: XLA:CPU's buffer assignment, no
weights, nothing run) with each attention implementation, beside the plan
(`memory.device_plan.plan_one_device`). The model's 8192-position limit is lifted for this
measurement only (shapes, no training). Blockwise temp should grow linearly in S (the slope is
printed), materialized quadratically.

speed: the real train step run on this CPU, the two implementations interleaved in one process
(repeats alternate; the first round warms up and is dropped), as ratios. The model has SmolLM2's
layer width (D 576, F 1536, head dim 64) with 3 query heads over 1 KV head, 2 layers and a
1024-token vocabulary, so attention dominates the step and the materialized scores fit the 3 GiB
a process may use on the shared machine. A variant whose compiled footprint exceeds that is
compiled and reported, not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from results_file import emit

from featherweight.memory.defaults import resolve
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.measure import measure_compiled
from featherweight.models.batch import batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.models.registry import builtin_config
from featherweight.peft.lora import LoraConfig, init_lora
from featherweight.recipe.schema import parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.streamed import build_streamed_step

IMPLEMENTATIONS = ("blockwise", "materialized")
MIB, GIB = 2**20, 2**30
RUN_LIMIT = 3 * GIB


def _machine() -> str:
    return (
        f"{platform.machine()} CPU ({jax.devices()[0].device_kind}), jax {jax.__version__}, XLA:CPU"
    )


def memory(seqs: list[int], out: str | None) -> None:
    base = builtin_config("SmolLM2-135M")
    model = dataclasses.replace(base, max_position_embeddings=max(seqs))
    rows, temps = [], {name: [] for name in IMPLEMENTATIONS}
    for seq in seqs:
        for attention in IMPLEMENTATIONS:
            config = parse_config(
                {
                    "method": "qlora",
                    "batch_size": 1,
                    "model": {"dtype": "float32"},
                    "data": {"seq_len": seq},
                    "memory": {"attention": attention, "loss_chunk": 1024},
                },
                source="benchmark",
            )
            # what the trainer runs and `measure_compiled` compiles: "auto" chunks chosen
            config = resolve(config, model)
            plan = plan_one_device(config, model)
            measured = measure_compiled(config, model)
            planned_temp = plan.measured_groups()["temporaries"]
            planned_total = plan.cpu_comparable_bytes
            temps[attention].append(measured.temp_bytes)
            rows.append(
                f"| {seq:,} | {attention} | {measured.temp_bytes / MIB:,.0f} | "
                f"{planned_temp / MIB:,.0f} | {100 * (planned_temp / measured.temp_bytes - 1):+.1f}% "
                f"| {measured.total_bytes / MIB:,.0f} | {planned_total / MIB:,.0f} | "
                f"{100 * (planned_total / measured.total_bytes - 1):+.1f}% | "
                f"{measured.compile_seconds:.0f} |"
            )
            print(rows[-1], flush=True)
    lines = [
        "# Long context on CPU: blockwise vs materialized attention (compiled on abstract shapes)",
        "",
        f"machine: {_machine()}; SmolLM2-135M QLoRA, float32, batch 1, loss chunk 1024, "
        "position limit lifted to the longest S for this measurement",
        "",
        "| S | attention | compiled temp MiB | planned temp MiB | plan vs compiled | "
        "compiled total MiB | planned total MiB | plan vs compiled | compile s |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        *rows,
        "",
    ]
    for attention in IMPLEMENTATIONS:
        t = temps[attention]
        slopes = [(t[i + 1] - t[i]) / (seqs[i + 1] - seqs[i]) for i in range(len(seqs) - 1)]
        lines.append(
            f"- {attention}: temp grows by "
            + ", ".join(
                f"{slope / 1024:,.1f} KiB per token from S={seqs[i]:,} to {seqs[i + 1]:,}"
                for i, slope in enumerate(slopes)
            )
            + (
                f" (last slope / first slope = {slopes[-1] / slopes[0]:.2f}: "
                f"{'linear' if slopes[-1] / slopes[0] < 1.2 else 'super-linear'})"
            )
        )
    emit(lines, out)


SPEED_MODEL = ModelConfig(
    model_type="llama", vocab_size=1024, hidden_size=576, intermediate_size=1536, num_layers=2,
    num_heads=3, num_kv_heads=1, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip


def speed(seqs: list[int], repeats: int, out: str | None, run_limit: int = RUN_LIMIT) -> None:
    config = SPEED_MODEL
    frozen = init_params(jax.random.PRNGKey(0), config, jnp.float32)
    lora = LoraConfig(rank=8, alpha=16)
    adapters = init_lora(jax.random.PRNGKey(1), config, lora)
    optimizer = optax.adamw(1e-4)
    rows = []
    for seq in seqs:
        tokens = jax.random.randint(jax.random.PRNGKey(2), (1, seq + 1), 0, config.vocab_size)
        batch, key = batch_from_tokens(tokens), jax.random.PRNGKey(3)
        compiled, memory = {}, {}
        for attention in IMPLEMENTATIONS:
            policy = MemoryPolicy(attention=attention, loss_chunk=512)
            step = build_streamed_step(
                config, optimizer, adapters, frozen, lora.spec, policy, donate=False
            )
            state = init_streamed_opt_state(optimizer, adapters)
            executable = step.lower(adapters, state, frozen, batch, key).compile()
            stats = executable.memory_analysis()
            memory[attention] = (
                stats.temp_size_in_bytes
                + stats.argument_size_in_bytes
                + stats.output_size_in_bytes
                - stats.alias_size_in_bytes
            )
            if memory[attention] <= run_limit:
                compiled[attention] = (executable, state)
        seconds = {name: [] for name in compiled}
        for _ in range(repeats + 1):
            for name, (executable, state) in compiled.items():
                start = time.perf_counter()
                _, _, metrics = executable(adapters, state, frozen, batch, key)
                jax.block_until_ready(metrics["loss"])
                seconds[name].append(time.perf_counter() - start)
        best = {name: float(np.median(times[1:])) for name, times in seconds.items()}
        ratio = (
            f"{best['blockwise'] / best['materialized']:.2f}"
            if len(best) == 2
            else "materialized not run"
        )
        rows.append(
            f"| {seq:,} | "
            + " | ".join(
                f"{memory[name] / MIB:,.0f}" + (f" / {best[name]:.2f}" if name in best else " / -")
                for name in IMPLEMENTATIONS
            )
            + f" | {ratio} |"
        )
        print(rows[-1], flush=True)
    lines = [
        "# Step time on CPU: blockwise vs materialized attention (measured)",
        "",
        f"machine: {_machine()}, shared with other jobs (ratios from interleaved repeats are "
        f"the result, seconds are indicative); {repeats} timed repeats after a warm-up, median",
        f"model: D {config.hidden_size}, F {config.intermediate_size}, {config.num_heads} heads / "
        f"{config.num_kv_heads} KV head of dim {config.head_dim}, {config.num_layers} layers, vocab "
        f"{config.vocab_size}; LoRA r8, AdamW, batch 1, float32, loss chunk 512; variants over "
        f"{run_limit / GIB:.1f} GiB compiled are not run",
        "",
        "| S | blockwise: compiled MiB / step s | materialized: compiled MiB / step s | "
        "blockwise / materialized time |",
        "| ---: | ---: | ---: | ---: |",
        *rows,
    ]
    emit(lines, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=("memory", "speed"))
    parser.add_argument("--seqs", type=int, nargs="+", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--run-limit-gib", type=float, default=3.0, help="largest compiled step that is run"
    )
    args = parser.parse_args()
    if args.part == "memory":
        memory(args.seqs or [4096, 16384, 65536], args.out)
    else:
        speed(args.seqs or [2048, 8192], args.repeats, args.out, int(args.run_limit_gib * GIB))


if __name__ == "__main__":
    main()
