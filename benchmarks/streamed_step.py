"""Streamed vs reference train step on SmolLM2-135M shapes: memory, compile time, step time.

Memory comes from `compiled.memory_analysis()` (temp, and temp + argument + output - alias); step
times are ratios measured in one run, the variants interleaved. Random weights: only shapes matter.

    python benchmarks/streamed_step.py [--batch 1] [--seq 256] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import time

import jax
import jax.numpy as jnp
import optax
from results_file import emit

from featherweight.models.batch import batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step
from featherweight.step.streamed import build_streamed_step

SMOLLM2_135M = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
    tie_word_embeddings=True,
)  # fmt: skip

MIB = 2**20


def _variants(config, params, optimizer, chunk):
    yield (
        "reference (jax.grad)",
        build_reference_step(config, optimizer, chunk_size=chunk),
        optimizer.init,
    )
    for name, residuals in (
        ("streamed, residuals on device", "device"),
        ("streamed, residuals on host", "host"),
    ):
        policy = MemoryPolicy(residuals=residuals, loss_chunk=chunk)
        step = build_streamed_step(config, optimizer, params, {}, policy=policy)
        yield name, step, lambda p: init_streamed_opt_state(optimizer, p)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = SMOLLM2_135M
    dtype = jnp.dtype(args.dtype)
    optimizer = optax.adamw(1e-4)
    params = init_params(jax.random.PRNGKey(0), config, dtype)
    tokens = jax.random.randint(
        jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0, config.vocab_size
    )
    batch, key = batch_from_tokens(tokens), jax.random.PRNGKey(2)

    rows, compiled = [], {}
    for name, step, init_state in _variants(config, params, optimizer, args.chunk):
        state = init_state(params)
        start = time.perf_counter()
        executable = step.lower(params, state, {}, batch, key).compile()
        compile_seconds = time.perf_counter() - start
        memory = executable.memory_analysis()
        total = (
            memory.temp_size_in_bytes + memory.argument_size_in_bytes + memory.output_size_in_bytes
        )
        total -= memory.alias_size_in_bytes
        compiled[name] = (executable, init_state)
        rows.append([name, memory.temp_size_in_bytes / MIB, total / MIB, compile_seconds])

    seconds = {name: [] for name in compiled}
    live = {name: None for name in compiled}
    for _ in range(args.repeats + 1):  # the first round warms up and is dropped
        for name, (executable, init_state) in compiled.items():
            if live[name] is None:
                live[name] = (jax.tree.map(jnp.copy, params), init_state(params))
            current, state = live[name]
            start = time.perf_counter()
            current, state, metrics = executable(current, state, {}, batch, key)
            jax.block_until_ready(metrics["loss"])
            seconds[name].append(time.perf_counter() - start)
            live[name] = (current, state)
    reference_time = min(seconds["reference (jax.grad)"][1:])
    reference_temp = rows[0][1]

    lines = [
        f"# Streamed vs reference step, SmolLM2-135M shapes ({config.num_layers} layers), full fine-tuning",
        "",
        f"machine: {platform.machine()} CPU, {jax.device_count()} JAX device(s) of kind "
        f"{jax.devices()[0].device_kind!r}, jax {jax.__version__}; batch {args.batch} x seq {args.seq}, "
        f"{args.dtype} params, AdamW, loss chunk {args.chunk}",
        "",
        "| variant | temp MiB | temp / reference | total MiB | compile s | step s | step / reference |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, temp, total, compile_seconds in rows:
        step_time = min(seconds[name][1:])
        lines.append(
            f"| {name} | {temp:.0f} | {temp / reference_temp:.3f} | {total:.0f} | {compile_seconds:.1f} "
            f"| {step_time:.2f} | {step_time / reference_time:.3f} |"
        )
    lines.append("")
    lines.append(
        "On CPU host and device memory are the same RAM: host residuals change placement only."
    )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
