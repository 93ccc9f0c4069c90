"""Sliding-window attention's time against the sequence length, on CPU: blockwise attention with
a fixed window (Mistral's and Gemma's sliding layers) against full causal attention, forward then
forward and backward, at growing S, in one process.

At fixed W, the windowed attention's work grows linearly in S (each query block visits at most
ceil(W / block) + 1 key blocks: `models/attention.py`), the full attention's quadratically. The
two alternate round after round (the first round warms up and is dropped); the time of each
length is the median over rounds of process CPU time, and the ratio at each S is taken to the
same implementation's time at the shortest S, in the same run.

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 \\
        python benchmarks/window_attention.py --out benchmarks/results/window_attention_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
from results_file import emit

from featherweight.models.attention import ScoreForm, blockwise_attention


def _program(seq: int, window: int | None, args):
    """The compiled forward, then forward + VJP, of blockwise attention, and its inputs."""
    key = jax.random.PRNGKey(0)
    shapes = [(1, seq, args.heads, 64), *[(1, seq, args.heads // 4, 64)] * 2]
    q, k, v = (jax.random.normal(jax.random.fold_in(key, i), s) for i, s in enumerate(shapes))
    d_out = jax.random.normal(jax.random.fold_in(key, 3), shapes[0])

    def attention(q, k, v):
        return blockwise_attention(q, k, v, None, args.block, ScoreForm(window=window))

    def layer(q, k, v, d_out):
        out = attention(q, k, v)
        _, pull = jax.vjp(attention, q, k, v)
        return out, pull(d_out)

    return jax.jit(layer).lower(q, k, v, d_out).compile(), (q, k, v, d_out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--machine", default=f"{platform.machine()} CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    kinds = {"window": args.window, "full": None}
    programs = {(k, s): _program(s, w, args) for k, w in kinds.items() for s in args.seqs}
    seconds = {name: [] for name in programs}
    for round_index in range(args.rounds + 1):
        order = list(programs) if round_index % 2 else list(programs)[::-1]
        for name in order:
            compiled, inputs = programs[name]
            start = time.process_time()
            jax.block_until_ready(compiled(*inputs))
            if round_index:
                seconds[name].append(time.process_time() - start)
    ms = {name: 1e3 * statistics.median(values) for name, values in seconds.items()}
    shortest = args.seqs[0]
    lines = [
        "# Sliding-window blockwise attention: time against S at a fixed window",
        "",
        f"machine: {args.machine}; jax {jax.__version__}; XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '(unset)')!r}; float32, batch 1, {args.heads} query heads "
        f"over {args.heads // 4} KV heads of dim 64, tile {args.block}, window {args.window}; "
        f"{args.rounds} alternating rounds after one warm-up round",
        "",
        "Measured on this machine: median process CPU time of the forward then forward + VJP; "
        f"'x S={shortest}' is the time over the same implementation's time at S={shortest}, in "
        "this run (linear growth doubles it with S, quadratic quadruples it).",
        "",
        f"| S | window ms | window x S={shortest} | full causal ms | full x S={shortest} | "
        "window / full |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for seq in args.seqs:
        window, full = ms[("window", seq)], ms[("full", seq)]
        lines.append(
            f"| {seq} | {window:.1f} | {window / ms[('window', shortest)]:.2f} | {full:.1f} | "
            f"{full / ms[('full', shortest)]:.2f} | {window / full:.3f} |"
        )
    emit(lines, args.out)


if __name__ == "__main__":
    main()
