"""LoRA vs QLoRA, side by side in one run: train-step time on a small model, and the compiled step's
memory (XLA's `memory_analysis`) for SmolLM2-135M shapes.

    python benchmarks/lora_vs_qlora.py --machine "2-core CPU, no GPU" \
        --out benchmarks/results/lora_vs_qlora_cpu.txt

Both steps are the reference step (`jax.value_and_grad` of the adapters only; frozen base a
separate, non-differentiated argument), with the same adapters, optimizer and batches; QLoRA's
base holds every linear weight of the blocks in NF4 and dequantizes it inside the block. Times are
medians over interleaved rounds (LoRA step, QLoRA step, ...) so that load drifts hit both alike.
Memory totals are temp + argument + output - alias bytes, from steps compiled on abstract shapes
(nothing is allocated), for a float32 and a bfloat16 base. On CPU a bf16 LoRA total includes a
float32 copy of every layer stack: XLA:CPU cannot slice bf16 inside a loop and converts the stacks
before it (not so on GPU), so the float32 pair is the CPU comparison that measures the step.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from featherweight.io.embedded_model import demo_model_path
from featherweight.io.loader import open_checkpoint, params_nbytes
from featherweight.models.batch import Batch, batch_from_tokens
from featherweight.models.config import ModelConfig
from featherweight.models.init import init_params
from featherweight.models.llama import Params
from featherweight.models.shapes import abstract_params
from featherweight.peft.lora import (
    LoraConfig,
    abstract_lora,
    init_lora,
    quantize_frozen_base,
)
from featherweight.step.reference import build_reference_step

LORA = LoraConfig(rank=16, alpha=32)
OPTIMIZER = optax.adamw(1e-4)
SMALL = ModelConfig(
    model_type="llama",
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=768,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
)
SMALL_BATCH, SMALL_SEQ = 4, 128
SMOL_BATCH, SMOL_SEQ, SMOL_CHUNK = 4, 512, 128
MIB = 2**20


def time_steps(rounds: int) -> dict[str, float]:
    """Median seconds per step of LoRA and QLoRA on SMALL (float32 compute), interleaved."""
    base = init_params(jax.random.PRNGKey(0), SMALL, jnp.float32)
    frozen = {"lora": base, "qlora": quantize_frozen_base(base)}
    step = build_reference_step(SMALL, OPTIMIZER, lora=LORA.spec)
    rng = np.random.default_rng(0)
    batch = batch_from_tokens(
        jnp.asarray(rng.integers(0, SMALL.vocab_size, (SMALL_BATCH, SMALL_SEQ + 1)))
    )
    state = {}
    for name in frozen:
        adapters = init_lora(jax.random.PRNGKey(1), SMALL, LORA)
        state[name] = (adapters, OPTIMIZER.init(adapters))
        for _ in range(2):  # compile and warm up
            *state[name], metrics = step(*state[name], frozen[name], batch, None)
            jax.block_until_ready(metrics)
    seconds: dict[str, list[float]] = {name: [] for name in frozen}
    for _ in range(rounds):
        for name in frozen:
            start = time.perf_counter()
            *state[name], metrics = step(*state[name], frozen[name], batch, None)
            jax.block_until_ready(metrics)
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in seconds.items()}


def step_memory(config: ModelConfig, frozen: Params) -> int:
    """temp + argument + output - alias bytes of the donated LoRA step on these shapes."""
    adapters = abstract_lora(config, LORA)
    ids = jax.ShapeDtypeStruct((SMOL_BATCH, SMOL_SEQ), jnp.int32)
    batch = Batch(ids, ids, jax.ShapeDtypeStruct((SMOL_BATCH, SMOL_SEQ), jnp.float32), ids, None)
    step = build_reference_step(config, OPTIMIZER, lora=LORA.spec, chunk_size=SMOL_CHUNK)
    opt_state = jax.eval_shape(OPTIMIZER.init, adapters)
    stats = step.lower(adapters, opt_state, frozen, batch, None).compile().memory_analysis()
    return (
        stats.temp_size_in_bytes
        + stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
    )


def abstract_nbytes(tree) -> int:
    return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def memory_rows(config: ModelConfig) -> list[str]:
    """One line per base dtype: LoRA and QLoRA step totals, base bytes, and the saving."""
    adapter_bytes = abstract_nbytes(abstract_lora(config, LORA))
    rows = [f"adapters (rank {LORA.rank}, all 7 targets, float32): {adapter_bytes / MIB:.1f} MiB"]
    for dtype in (jnp.float32, jnp.bfloat16):
        dense = abstract_params(config, dtype)
        quantized = jax.eval_shape(quantize_frozen_base, dense)
        lora_total = step_memory(config, dense)
        qlora_total = step_memory(config, quantized)
        base_saving = abstract_nbytes(dense) - abstract_nbytes(quantized)
        rows.append(
            f"{jnp.dtype(dtype).name:>8} base: LoRA step {lora_total / MIB:8.1f} MiB | "
            f"QLoRA step {qlora_total / MIB:8.1f} MiB | QLoRA/LoRA {qlora_total / lora_total:.3f}"
            f" | saved {(lora_total - qlora_total) / MIB:.1f} MiB of {base_saving / MIB:.1f} MiB"
            " base bytes"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--machine", required=True, help='e.g. "2-core CPU, no GPU"')
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    smol = open_checkpoint(demo_model_path()).config
    load = os.getloadavg()[0]
    medians = time_steps(args.rounds)
    small_base = init_params(jax.random.PRNGKey(0), SMALL, jnp.float32)
    lines = [
        f"LoRA vs QLoRA -- machine: {args.machine}; jax {jax.__version__} on "
        f"{jax.devices()[0].platform}, {platform.machine()}; load average at start {load:.1f}",
        "",
        f"Step time, small model: {SMALL.num_layers} layers, hidden {SMALL.hidden_size}, "
        f"MLP {SMALL.intermediate_size}, vocab {SMALL.vocab_size}",
        f"  batch {SMALL_BATCH} x {SMALL_SEQ} tokens, float32 compute, rank {LORA.rank}, AdamW; "
        f"base {params_nbytes(small_base) / MIB:.1f} MiB dense, "
        f"{params_nbytes(quantize_frozen_base(small_base)) / MIB:.1f} MiB NF4",
        f"  median of {args.rounds} interleaved steps: LoRA {medians['lora'] * 1e3:.1f} ms, "
        f"QLoRA {medians['qlora'] * 1e3:.1f} ms, QLoRA/LoRA = "
        f"{medians['qlora'] / medians['lora']:.2f}",
        "",
        f"Step memory (memory_analysis: temp + argument + output - alias), SmolLM2-135M shapes "
        f"({smol.num_layers} layers, hidden {smol.hidden_size}, vocab {smol.vocab_size}, tied), "
        f"batch {SMOL_BATCH} x {SMOL_SEQ}, loss chunk {SMOL_CHUNK}, remat per layer",
        *(f"  {row}" for row in memory_rows(smol)),
        "  (bf16 on CPU: the LoRA total includes a float32 copy of every layer stack that XLA:CPU",
        "   makes because it cannot slice bf16 in a loop; compare the float32 pair on CPU.)",
    ]
    report = "\n".join(lines) + "\n"
    print(report, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)


if __name__ == "__main__":
    main()
