"""What global-norm clipping costs the streamed step in full fine-tuning: step time and memory of
the two-pass form (a norm-only backward pass, then the updating pass) against the one-pass fused
step, per-tensor clipping, a kept float32 gradient buffer and the reference `jax.grad` step.

Step times are ratios to the fused step from interleaved repeats in one process (every variant
runs once per round, rounds repeated; the median of each variant's rounds, the first round
dropped); temp bytes are `compiled.memory_analysis()` of XLA's CPU compile. Random weights.

    python benchmarks/clipping_two_pass.py [--layers 8] [--seq 128] [--repeats 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import optax
from results_file import emit

from featherweight.models.batch import batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.reference import build_reference_step
from featherweight.step.streamed import build_streamed_step

MIB = 2**20
CLIP = 1.0


def _variants(config, params, optimizer):
    clipped = optax.chain(optax.clip_by_global_norm(CLIP), optimizer)
    streamed_init = lambda opt: lambda p: init_streamed_opt_state(opt, p)
    yield (
        "fused, no clipping",
        build_streamed_step(config, optimizer, params, {}),
        streamed_init(optimizer),
    )
    yield (
        "fused, per-tensor clipping",
        build_streamed_step(config, clipped, params, {}),
        streamed_init(clipped),
    )
    yield (
        "two-pass global clipping",
        build_streamed_step(config, optimizer, params, {}, clip_norm=CLIP, two_pass=True),
        streamed_init(optimizer),
    )
    yield (
        "kept float32 gradient, global clipping",
        build_streamed_step(config, optimizer, params, {}, clip_norm=CLIP),
        streamed_init(optimizer),
    )
    yield (
        "reference (jax.grad), global clipping",
        build_reference_step(config, clipped),
        clipped.init,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    config = ModelConfig(
        model_type="llama", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=4 * args.hidden, num_layers=args.layers, num_heads=args.hidden // 32,
        num_kv_heads=args.hidden // 64, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False,
    )  # fmt: skip
    optimizer = optax.adamw(1e-4)
    params = init_params(jax.random.PRNGKey(0), config, jnp.float32)
    tokens = jax.random.randint(
        jax.random.PRNGKey(1), (args.batch, args.seq + 1), 0, config.vocab_size
    )
    batch, key = batch_from_tokens(tokens), jax.random.PRNGKey(2)

    compiled, temps = {}, {}
    for name, step, init_state in _variants(config, params, optimizer):
        state = init_state(params)
        executable = step.lower(params, state, {}, batch, key).compile()
        temps[name] = executable.memory_analysis().temp_size_in_bytes
        compiled[name] = (executable, init_state)

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
    medians = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    # per round ratio to the fused step of the same round: robust to a machine whose load changes
    fused = "fused, no clipping"
    ratios = {
        name: statistics.median(t / f for t, f in zip(times[1:], seconds[fused][1:]))
        for name, times in seconds.items()
    }

    lines = [
        "# Global-norm clipping with the streamed step, full fine-tuning: time and memory",
        "",
        f"machine: {platform.machine()} CPU (shared, loaded), {jax.device_count()} JAX device(s), "
        f"jax {jax.__version__}; {config.num_layers} layers, hidden {config.hidden_size}, vocab "
        f"{config.vocab_size}, untied; batch {args.batch} x seq {args.seq}, float32, AdamW; "
        f"{args.repeats} interleaved rounds (first dropped); temp from XLA CPU memory_analysis()",
        "",
        "| variant | step s (median) | step / fused (median of per-round ratios) | temp MiB | temp / fused |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in compiled:
        lines.append(
            f"| {name} | {medians[name]:.3f} | {ratios[name]:.2f} | {temps[name] / MIB:.1f} "
            f"| {temps[name] / temps[fused]:.2f} |"
        )
    lines += [
        "",
        "Two-pass differentiates every layer twice (the forward pass and the head's VJP once);",
        "the kept buffer and the reference hold a gradient of the model's size instead.",
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
