"""Attention alone on CPU at short sequences: blockwise (a lone tile, computed head-major) against
XLA's materialized attention, time and compiled bytes, in one process.

SmolLM2-135M's attention shapes (9 query heads over 3 KV heads of dim 64), float32, packed-row
segment ids as the train step passes them. Each implementation runs what a layer of the streamed
step runs: the forward pass (the forward scan), then forward and backward (the layer's VJP in the
backward loop), jitted once. The implementations alternate round after round (the first round
warms up and is dropped); a ratio is blockwise over materialized in the same round, the median
over rounds of process CPU time. Bytes: XLA:CPU `memory_analysis()` temp of each program.

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 \\
        python benchmarks/attention_speed.py --out benchmarks/results/attention_speed_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from results_file import emit

from featherweight.models.attention import attend, block_size
from featherweight.models.registry import builtin_config

IMPLEMENTATIONS = ("blockwise", "materialized")


def _program(implementation: str, batch: int, seq: int, model):
    """The compiled forward, then forward + VJP, of one implementation, and its inputs."""
    key = jax.random.PRNGKey(0)
    heads, kv_heads, head_dim = model.num_heads, model.num_kv_heads, model.head_dim
    shapes = [(batch, seq, heads, head_dim), *[(batch, seq, kv_heads, head_dim)] * 2]
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(shapes))
    d_out = jax.random.normal(jax.random.fold_in(key, 3), shapes[0])
    segments = jnp.zeros((batch, seq), jnp.int32)

    def attention(q, k, v):
        return attend(q, k, v, segments, implementation)

    def layer(q, k, v, d_out):
        out = attention(q, k, v)  # the forward scan
        _, pull = jax.vjp(attention, q, k, v)  # the backward loop's VJP
        return out, pull(d_out)

    compiled = jax.jit(layer).lower(q, k, v, d_out).compile()
    return compiled, (q, k, v, d_out)


def _measure(args, model, seq: int) -> dict:
    programs = {name: _program(name, args.batch, seq, model) for name in IMPLEMENTATIONS}
    seconds = {name: [] for name in IMPLEMENTATIONS}
    for round_index in range(args.rounds + 1):
        order = IMPLEMENTATIONS if round_index % 2 else IMPLEMENTATIONS[::-1]
        for name in order:
            compiled, inputs = programs[name]
            start = time.process_time()
            jax.block_until_ready(compiled(*inputs))
            if round_index:
                seconds[name].append(time.process_time() - start)
    ratio = statistics.median(
        b / m for b, m in zip(seconds["blockwise"], seconds["materialized"], strict=True)
    )
    temp = {n: c.memory_analysis().temp_size_in_bytes for n, (c, _) in programs.items()}
    return {"seconds": seconds, "ratio": ratio, "temp": temp}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--machine", default=f"{platform.machine()} CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = builtin_config("SmolLM2-135M")
    lines = [
        "# Attention alone: blockwise (lone tile, head-major) vs XLA's materialized attention",
        "",
        f"machine: {args.machine}; jax {jax.__version__}; XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '(unset)')!r}; cores this process may use: "
        f"{sorted(os.sched_getaffinity(0))}; SmolLM2-135M attention shapes, batch {args.batch}, "
        f"float32; {args.rounds} alternating rounds after one warm-up round",
        "",
        "Time: measured on this machine, median over rounds of the paired ratio of process CPU "
        "time (blockwise / materialized, forward then forward + VJP). MiB: XLA:CPU compiled temp.",
        "",
        "| S | tile | blockwise ms | materialized ms | blockwise / materialized time | "
        "blockwise MiB | materialized MiB |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for seq in args.seqs:
        result = _measure(args, model, seq)
        ms = {n: 1e3 * statistics.median(s) for n, s in result["seconds"].items()}
        lines.append(
            f"| {seq} | {block_size(seq)} | {ms['blockwise']:.2f} | {ms['materialized']:.2f} | "
            f"{result['ratio']:.3f} | {result['temp']['blockwise'] / 2**20:.1f} | "
            f"{result['temp']['materialized'] / 2**20:.1f} |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
