"""Every memory setting against the default, in one run: bytes saved and step-time ratio.

SmolLM2-135M shapes (random weights: only shapes matter), batch 2 x 256 tokens, float32, AdamW,
LoRA r8 on every linear (and QLoRA, and full fine-tuning). Each variant is the trainer's own step
(`train.run.prepare_run`'s, via `memory.measure.abstract_step_arguments`), compiled once: its bytes are the
compiled program's `memory_analysis()` (device bytes: temp + argument + output - alias, less the
arguments placed in pinned host memory), its matmul FLOPs are counted in its optimized HLO
(`dev.hlo_cost.hlo_dot_flops`). Times are paired ratios against the default measured in the
same round, the variants interleaved round after round (a shared machine's load drifts hit all
alike); the median over rounds of process CPU time (all threads) and of wall time are given.

    nice python benchmarks/memory_settings.py --method lora --rounds 5 \
        --out benchmarks/results/memory_settings_lora_cpu.md

With `--target h100` (any GPU target of `featherweight.memory.targets`; needs jax[cuda12-local]
and `JAX_PLATFORMS=cpu`) each variant is instead compiled by XLA's GPU compiler for that GPU, with
no GPU present, in bfloat16 (what a GPU runs; `--dtype`), its defaults chosen on that compiler's
calibration: bytes only -- the compiled device bytes (`measure_for_target`: arguments placed in
host memory compiled as device arrays and their exact bytes subtracted, marked "derived") beside
the plan, the matmul FLOPs from the shapes (`step_flops`, equal to the CPU HLO's by test) and the
step-time ratio the planner *estimates* at an accelerator's rates (`step_seconds`): no time is
measured without the GPU.

    JAX_PLATFORMS=cpu python benchmarks/memory_settings.py --method lora --target h100 \
        --out benchmarks/results/memory_settings_lora_h100.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import jax
import jax.numpy as jnp
from results_file import emit

from featherweight.dev.hlo_cost import hlo_dot_flops
from featherweight.memory.defaults import resolve
from featherweight.memory.device_plan import plan_one_device
from featherweight.memory.measure import (
    abstract_step_arguments,
    measure_for_target,
    measurement_of,
)
from featherweight.memory.step_cost import ACCELERATOR_RATES, step_flops, step_seconds
from featherweight.memory.targets import get_target
from featherweight.models.registry import builtin_config
from featherweight.parallel.memory_kinds import to_device
from featherweight.recipe.placement import place
from featherweight.recipe.schema import parse_config

MIB = 2**20
OLD_DEFAULT = {"loss_chunk": None, "mlp_chunk": None, "vocab_chunk": None}  # whole sequence
SEQUENCE_CHUNK = {"loss_chunk": 64, "vocab_chunk": None}  # the head's old default for LoRA
SMALL_LORA = {  # what `plan --budget` reaches with every same-result setting
    "vocab_chunk": 2048,
    "mlp_chunk": 128,
    "residuals": "host",
    "embed": "host",
    "optimizer_state": "host",
}
KEEP_ALL = {"save": ["qkv", "attention", "mlp_hidden"]}  # no projection recomputed backward
ACCUMULATE = {"accumulation_steps": 2}  # the same batch and update, each micro-batch one row
KEEP_DEQUANTIZED = {"save": ["dequantized"]}  # QLoRA: the NF4 weights dequantized once a step
VARIANTS = {
    "lora": [
        ("default", "lora", {}, False),
        ("no chunks (old default)", "lora", OLD_DEFAULT, False),
        ("no MLP chunk", "lora", {"mlp_chunk": None}, False),
        ("loss_chunk 64 instead of a vocabulary chunk", "lora", SEQUENCE_CHUNK, False),
        ("vocab_chunk 16384", "lora", {"vocab_chunk": 16384}, False),
        ("mlp_chunk 128", "lora", {"mlp_chunk": 128}, False),
        ("residuals on host", "lora", {"residuals": "host"}, False),
        ("optimizer state on host", "lora", {"optimizer_state": "host"}, False),
        ("embedding on host (+ vocab_chunk 16384)", "lora", {"embed": "host"}, False),
        ("every setting above", "lora", SMALL_LORA, False),
        ("kept activations: qkv, mlp_hidden", "lora", {"save": ["qkv", "mlp_hidden"]}, False),
        ("kept activations: qkv, attention, mlp_hidden", "lora", KEEP_ALL, False),
        ("two micro-batches of one row (accumulation_steps 2)", "lora", ACCUMULATE, False),
    ],
    "qlora": [
        ("default", "qlora", {}, False),
        ("no chunks (old default)", "qlora", OLD_DEFAULT, False),
        ("no MLP chunk", "qlora", {"mlp_chunk": None}, False),
        ("loss_chunk 64 instead of a vocabulary chunk", "qlora", SEQUENCE_CHUNK, False),
        ("NF4 head", "qlora", {}, True),
        ("NF4 head, no chunks", "qlora", OLD_DEFAULT, True),
        ("NF4 head + vocab_chunk 16384", "qlora", {"vocab_chunk": 16384}, True),
        ("kept activations: qkv, attention, mlp_hidden", "qlora", KEEP_ALL, False),
        ("two micro-batches of one row (accumulation_steps 2)", "qlora", ACCUMULATE, False),
        ("kept dequantized weights", "qlora", KEEP_DEQUANTIZED, False),
        (
            "kept activations + dequantized weights",
            "qlora",
            {"save": [*KEEP_ALL["save"], *KEEP_DEQUANTIZED["save"]]},
            False,
        ),
        ("mlp_chunk 32, dequantized weights not kept", "qlora", {"mlp_chunk": 32}, False),
        (
            "mlp_chunk 32 + kept dequantized weights",
            "qlora",
            {"mlp_chunk": 32, **KEEP_DEQUANTIZED},
            False,
        ),
    ],
    "full": [
        ("default", "full", {}, False),
        ("no chunks (old default)", "full", OLD_DEFAULT, False),
        ("no MLP chunk", "full", {"mlp_chunk": None}, False),
        ("vocab_chunk 16384", "full", {"vocab_chunk": 16384}, False),
        ("residuals on host", "full", {"residuals": "host"}, False),
        ("optimizer state on host", "full", {"optimizer_state": "host"}, False),
        (
            "small: residuals + optimizer state on host, mlp_chunk 128",
            "full",
            {"residuals": "host", "optimizer_state": "host", "mlp_chunk": 128},
            False,
        ),
        ("kept activations: qkv, attention, mlp_hidden", "full", KEEP_ALL, False),
    ],
}


def _config(
    method: str, memory: dict, quantize_head: bool, batch: int, seq: int, dtype: str = "float32"
):
    memory = dict(memory)
    if memory.get("embed") == "host":
        memory.setdefault("vocab_chunk", 16384)  # a tied table on the host is read in chunks
    return parse_config(
        {
            "method": method,
            "batch_size": batch,
            "model": {"dtype": dtype, "quantize_head": quantize_head},
            "data": {"seq_len": seq},
            "optimizer": {"name": "adamw"},
            "lora": {"rank": 8},
            "memory": memory,
        }
    )


def _materialize(abstract, key):
    """Arrays of the abstract arguments' shapes, dtypes and placements (small random floats,
    random integers below 2: valid token ids, NF4 codes and counters)."""
    leaves, treedef = jax.tree.flatten(abstract)
    arrays = []
    for index, leaf in enumerate(leaves):
        leaf_key = jax.random.fold_in(key, index)
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            value = 0.02 * jax.random.normal(leaf_key, leaf.shape, jnp.float32)
        else:
            value = jax.random.randint(leaf_key, leaf.shape, 0, 2)
        value = value.astype(leaf.dtype)
        sharding = getattr(leaf, "sharding", None)
        arrays.append(jax.device_put(value, sharding) if sharding is not None else value)
    return jax.tree.unflatten(treedef, arrays)


def _shared_with(base, abstract, key):
    """Arrays for `abstract` that reuse the leaves of `base` at the same path, shape and dtype
    (moved where `abstract` places them): one frozen base in memory, not one per variant."""
    by_path = dict(jax.tree_util.tree_flatten_with_path(base)[0])
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    leaves = []
    for index, (path, leaf) in enumerate(paths):
        shared = by_path.get(path)
        if shared is None or shared.shape != leaf.shape or shared.dtype != leaf.dtype:
            leaves.append(_materialize(leaf, jax.random.fold_in(key, index)))
        elif getattr(leaf, "sharding", None) is not None:
            leaves.append(jax.device_put(shared, leaf.sharding))
        else:
            leaves.append(shared)
    return jax.tree.unflatten(treedef, leaves)


def chosen_chunks(config) -> str:
    """The chunks of a config, e.g. "vocab_chunk 4096, mlp_chunk 128" (or "no chunks")."""
    memory = config.memory
    chosen = ", ".join(
        f"{field} {getattr(memory, field)}"
        for field in ("loss_chunk", "vocab_chunk", "mlp_chunk")
        if getattr(memory, field) is not None
    )
    return chosen or "no chunks"


def _chosen_name(name: str, config) -> str:
    """The default variant's name with the chunks the lean defaults chose."""
    return f"{name} ({chosen_chunks(config)} chosen)"


def target_report(args, model) -> list[str]:
    """Every variant compiled for a GPU target by XLA's GPU compiler (no GPU needed): bytes, with
    the plan beside them, FLOPs from the shapes and the planner's estimated time ratio."""
    target = get_target(args.target)
    rows, step_target = [], target.step_target
    for index, (name, method, memory, quantize_head) in enumerate(VARIANTS[args.method]):
        if index and args.only not in name:
            continue
        # blockwise unless named: the GPU runs cuDNN for "auto", which a machine without
        # cuDNN's library cannot compile (`measure.cudnn_not_loadable`)
        compiled = {"attention": "blockwise", **memory}
        requested = _config(method, compiled, quantize_head, args.batch, args.seq, args.dtype)
        config = resolve(requested, model, target=step_target)
        if not memory:
            name = _chosen_name(name, config)
        measured = measure_for_target(config, model, target.name)
        planned = plan_one_device(config, model, step_target).device_bytes
        seconds = step_seconds(config, model, ACCELERATOR_RATES, step_target)
        flops = step_flops(config, model, step_target).total
        rows.append((name, measured, planned, flops, seconds))
        print(f"compiled {name}: {measured.device_bytes / MIB:.1f} MiB", flush=True)
    _, base, _, base_flops, base_seconds = rows[0]
    lines = [
        f"# Memory settings vs the default, compiled for {target.name}: {args.model} shapes, "
        f"{args.method}",
        "",
        f"compiled by XLA's GPU compiler for {target.name} ({target.description}) on "
        f"{args.machine} without a GPU (jax {jax.__version__}); batch {args.batch} x seq "
        f"{args.seq}, {args.dtype}, AdamW"
        f"{'' if args.method == 'full' else ', LoRA r8 on every linear'}; defaults chosen on the "
        "xla-gpu calibration. Nothing here was run on a GPU.",
        "",
        "Compiled MiB: the compiler's device bytes (temp + argument + output - alias); "
        '"derived": an argument placed in host memory was compiled as a device array and its '
        "exact bytes subtracted. Planned MiB: the planner's device bytes for the same config. "
        "GFLOP: matmul FLOPs from the shapes (`step_flops`). Estimated time: the planner's "
        "`step_seconds` at 400 TFLOP/s, 2.5 TB/s of device memory for the LM head's matmul bytes "
        "and a 25 GB/s host link (matmuls + head bytes + host transfers), as a ratio to the "
        "default -- an estimate, not a measurement.",
        "",
        "| setting | compiled MiB | saved MiB | planned MiB | GFLOP (ratio) | estimated time ratio | how |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for name, measured, planned, flops, seconds in rows:
        how = "derived" if measured.derived else "compiled"
        lines.append(
            f"| {name} | {measured.device_bytes / MIB:.1f} | "
            f"{(base.device_bytes - measured.device_bytes) / MIB:+.1f} | {planned / MIB:.1f} | "
            f"{flops / 1e9:.1f} ({flops / base_flops:.3f}) | {seconds / base_seconds:.3f} | {how} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(VARIANTS), default="lora")
    parser.add_argument("--model", default="SmolLM2-135M", help="a built-in model's shapes")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--machine", default=f"{platform.machine()} CPU")
    parser.add_argument(
        "--only", default="", help="settings whose name contains this (and the default)"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--target", default="cpu", help="a GPU target compiles only (bytes)")
    parser.add_argument("--dtype", default=None, help="float32 on cpu, bfloat16 on a GPU target")
    args = parser.parse_args()
    model = builtin_config(args.model)
    key = jax.random.PRNGKey(0)
    if args.target != "cpu":
        args.dtype = args.dtype or "bfloat16"
        emit(target_report(args, model), args.out)
        return

    compiled = []
    variants = [v for i, v in enumerate(VARIANTS[args.method]) if not i or args.only in v[0]]
    for name, method, memory, quantize_head in variants:
        config = resolve(
            _config(method, memory, quantize_head, args.batch, args.seq, args.dtype or "float32"),
            model,
        )
        if not memory:  # say what the defaults chose
            name = _chosen_name(name, config)
        step, abstract = abstract_step_arguments(config, model)
        start = time.perf_counter()
        executable = step.lower(*abstract).compile()
        trainable, opt_state, frozen, _, _ = abstract
        measured = measurement_of(
            executable, trainable, opt_state, frozen, time.perf_counter() - start
        )
        compiled.append((name, config, step, abstract, measured, hlo_dot_flops(executable)))
        print(f"compiled {name}: {measured.device_bytes / MIB:.1f} MiB", flush=True)

    # one state flows from variant to variant, placed as the trainer places it (untimed); each
    # step runs as the trainer runs it (jit, compiled in the warm-up round)
    _, _, _, first_abstract, _, _ = compiled[0]
    device_abstract = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), first_abstract
    )
    trainable, opt_state, base_frozen, batch, step_key = _materialize(device_abstract, key)
    tokens = jax.random.randint(key, batch.input_ids.shape, 0, model.vocab_size, jnp.int32)
    batch = batch._replace(
        input_ids=tokens, target_ids=tokens, loss_mask=jnp.ones_like(batch.loss_mask, jnp.float32)
    )
    frozen_by_variant = {}
    for name, _, _, abstract, _, _ in compiled:
        frozen = _shared_with(base_frozen, abstract[2], key)
        frozen_by_variant[name] = to_device(frozen)

    cpu = {name: [] for name, *_ in compiled}
    wall = {name: [] for name, *_ in compiled}
    for round_index in range(args.rounds + 1):  # round 0 warms up and is dropped
        for name, config, step, _, _, _ in compiled:
            # each variant's arguments where its settings put them (the trainer's `place`)
            trainable, opt_state, frozen = place(
                config, to_device(trainable), to_device(opt_state), frozen_by_variant[name]
            )
            frozen_by_variant[name] = frozen
            jax.block_until_ready((trainable, opt_state))
            if not round_index:
                print(f"warming up {name}", flush=True)
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            trainable, opt_state, metrics = step(
                trainable, opt_state, frozen_by_variant[name], batch, step_key
            )
            jax.block_until_ready(metrics["loss"])
            if round_index:
                cpu[name].append(time.process_time() - cpu_start)
                wall[name].append(time.perf_counter() - wall_start)
        print(f"round {round_index} done", flush=True)

    default = compiled[0][0]
    base_bytes, base_flops = compiled[0][4].device_bytes, compiled[0][5]
    lines = [
        f"# Memory settings vs the default: {args.model} shapes, {args.method}",
        "",
        f"machine: {args.machine}, {jax.device_count()} JAX device(s) of kind "
        f"{jax.devices()[0].device_kind!r}; jax {jax.__version__}; batch {args.batch} x seq "
        f"{args.seq}, float32, AdamW{'' if args.method == 'full' else ', LoRA r8 on every linear'}; "
        f"{args.rounds} interleaved rounds after one warm-up round; {datetime.date.today()}",
        "",
        "Bytes: XLA:CPU `memory_analysis()` of the compiled step (device bytes; host-placed "
        "arguments excluded, but on CPU host and device are the same RAM). FLOPs: matmul FLOPs "
        "in the optimized HLO (loops by trip count). Time: median over rounds of the paired "
        "ratio to the default in the same round, process CPU time (wall time in brackets).",
        "",
        "| setting | device MiB | saved MiB | GFLOP | FLOP ratio | step time ratio (wall) | default step s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, _, _, _, measured, flops in compiled:
        cpu_ratio = statistics.median(v / d for v, d in zip(cpu[name], cpu[default], strict=True))
        wall_ratio = statistics.median(
            v / d for v, d in zip(wall[name], wall[default], strict=True)
        )
        lines.append(
            f"| {name} | {measured.device_bytes / MIB:.1f} | "
            f"{(base_bytes - measured.device_bytes) / MIB:+.1f} | {flops / 1e9:.1f} | "
            f"{flops / base_flops:.3f} | {cpu_ratio:.3f} ({wall_ratio:.3f}) | "
            f"{statistics.median(wall[default]):.2f} |"
        )
    lines += [
        "",
        "Per-round CPU seconds: "
        + "; ".join(f"{name}: {', '.join(f'{s:.2f}' for s in cpu[name])}" for name in cpu),
    ]
    emit(lines, args.out)


if __name__ == "__main__":
    main()
