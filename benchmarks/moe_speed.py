"""The mixture-of-experts MLP's time on CPU: featherweight's routed layer (only the routed rows
computed, `models/moe.py`) against a dense loop over every expert at the same shapes (every
token through every expert, the outputs weighted by the router's top-k mask), forward and
forward + VJP, in one process.

The two alternate round after round (the first round warms up and is dropped); the ratio is the
routed layer's process CPU time over the dense loop's in the same round, the median over rounds.
Both compute the same output (checked before timing).

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 \\
        python benchmarks/moe_speed.py --out benchmarks/results/moe_speed_cpu.md
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from results_file import emit

from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.models.llama import gated, mlp_in, mlp_out, norm
from featherweight.models.moe import route, router_logits


def _routed(layer, a, config):
    return mlp_out(layer, a, mlp_in(layer, a, config), config)


def _dense_loop(layer, a, config):
    """Every token through every expert (a scan over E), weighted by its top-k weights (0 for
    experts it was not routed to)."""
    x = norm(config, a, layer["mlp_norm"]).reshape(-1, a.shape[-1])
    weights, experts = route(router_logits(layer, x), config)
    mask = jnp.zeros((x.shape[0], config.num_experts), x.dtype)
    mask = mask.at[jnp.arange(x.shape[0])[:, None], experts].set(weights)

    def expert(total, inputs):
        gate_w, up_w, down_w, column = inputs
        hidden = gated(config, x @ gate_w.T, x @ up_w.T)
        return total + (hidden @ down_w.T) * column[:, None], None

    start = jnp.zeros_like(x)
    xs = (layer["gate"], layer["up"], layer["down"], mask.T)
    out, _ = jax.lax.scan(expert, start, xs)
    return a + out.reshape(a.shape)


def _programs(config: ModelConfig, tokens: int):
    params = init_params(jax.random.PRNGKey(0), config)
    layer = jax.tree.map(lambda leaf: leaf[0], params["layers"])
    a = jax.random.normal(jax.random.PRNGKey(1), (1, tokens, config.hidden_size))
    cotangent = jax.random.normal(jax.random.PRNGKey(2), a.shape)
    programs = {}
    for name, fn in (("routed", _routed), ("dense", _dense_loop)):

        def step(a, cotangent, fn=fn):
            out, pull = jax.vjp(lambda x: fn(layer, x, config), a)
            return out, pull(cotangent)

        programs[name] = jax.jit(step).lower(a, cotangent).compile()
    np.testing.assert_allclose(
        programs["routed"](a, cotangent)[0], programs["dense"](a, cotangent)[0], atol=1e-4
    )
    return programs, (a, cotangent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--machine", default=f"{platform.machine()} CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lines = [
        "# MoE MLP: routed rows only against a dense loop over every expert",
        "",
        f"machine: {args.machine}; jax {jax.__version__}; XLA_FLAGS="
        f"{os.environ.get('XLA_FLAGS', '(unset)')!r}; float32, {args.tokens} tokens, hidden 256, "
        f"expert width 256, top {args.top_k}; forward + VJP; {args.rounds} alternating rounds "
        "after one warm-up round",
        "",
        "Measured on this machine: median process CPU time; the ratio is routed / dense in the "
        "same round, the median over rounds.",
        "",
        "| experts | routed ms | dense loop ms | routed / dense |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for experts in args.experts:
        config = ModelConfig(
            model_type="qwen3_moe", vocab_size=64, hidden_size=256, intermediate_size=256,
            num_layers=1, num_heads=4, num_kv_heads=4, head_dim=64, num_experts=experts,
            experts_per_token=args.top_k, norm_topk_prob=True,
        )  # fmt: skip
        programs, inputs = _programs(config, args.tokens)
        seconds = {name: [] for name in programs}
        for round_index in range(args.rounds + 1):
            order = list(programs) if round_index % 2 else list(programs)[::-1]
            for name in order:
                start = time.process_time()
                jax.block_until_ready(programs[name](*inputs))
                if round_index:
                    seconds[name].append(time.process_time() - start)
        ratio = statistics.median(
            r / d for r, d in zip(seconds["routed"], seconds["dense"], strict=True)
        )
        ms = {name: 1e3 * statistics.median(values) for name, values in seconds.items()}
        lines.append(f"| {experts} | {ms['routed']:.1f} | {ms['dense']:.1f} | {ratio:.3f} |")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
