"""featherweight's default step against its peers, in one process and one run: bytes, FLOPs, time.

SmolLM2-135M shapes (random weights: only shapes matter), batch 2 x 256 tokens, float32, AdamW
(lr 2e-4, no weight decay), LoRA r8 alpha 16 on every linear of the blocks (and QLoRA, and full
fine-tuning). Three steps per method, on the same random tokens:

- featherweight: the trainer's own step at the method's default memory settings
  (`memory.measure.abstract_step_arguments`: `prepare_run`'s step after `resolve`, built from
  the config `benchmarks/memory_settings.py` builds);
- the plain-JAX peer (`benchmarks/peer_jax.py`): the same model written straightforwardly, each
  layer under `jax.checkpoint` in a `lax.scan`, full-logits loss, `jax.value_and_grad` of the
  trainable pytree, optax AdamW, donated state;
- torch + peft (`benchmarks/peer_torch.py`): transformers' Llama with gradient checkpointing, peft
  LoRA, bitsandbytes NF4 for QLoRA (time only: torch's CPU memory is not comparable).

Bytes: XLA:CPU `compiled.memory_analysis()` of each JAX program, temp + argument + output - alias
(`memory.measure.measurement_of`, the same formula for both), split into frozen base, trainable
weights, optimizer state, batch, temporaries and unaliased outputs. GFLOP: matmul FLOPs in each
compiled program's optimized HLO (`dev.hlo_cost.hlo_dot_flops`, loops counted by their trip
counts). Time: measured on this machine; the steps run interleaved, one round after another
(featherweight, JAX peer, torch; then JAX peer, torch, featherweight; ...: the order rotates each
round: in a fixed order featherweight always followed torch and measured 1.08x the JAX peer in
LoRA, against 0.99x in a run of the JAX steps alone), one warm-up round dropped; a ratio is
featherweight's time over the peer's in the same round, the median over rounds, of process CPU
time (all threads; wall time in brackets). The trainable weights flow from one step to the next
(same layout in both JAX programs); each step keeps its own optimizer state.

    nice python benchmarks/peers.py --method all --rounds 6 --out benchmarks/results/peers_cpu.md
    nice python benchmarks/peers.py --jax-only --rounds 16 --out benchmarks/results/peers_jax_cpu.md

On a shared 2-core machine, two XLA threads make a step's CPU time vary by +-10% from round to
round; one thread on one core varies by about 1% (the report records the XLA flags and the cores):

    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1" taskset -c 1 \
        python benchmarks/peers.py --jax-only --rounds 8 --out benchmarks/results/peers_jax_1thread_cpu.md
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from memory_settings import _config, chosen_chunks
from peer_jax import build_peer_step
from peer_torch import build_torch_step
from results_file import emit

from featherweight.dev.hlo_cost import hlo_dot_flops
from featherweight.memory.defaults import resolve
from featherweight.memory.measure import abstract_step_arguments, measurement_of
from featherweight.models.batch import Batch
from featherweight.models.init import init_params
from featherweight.models.registry import builtin_config
from featherweight.peft.lora import LoraConfig, init_lora, quantize_frozen_base
from featherweight.recipe.optimizer import make_optimizer

MIB = 2**20
METHODS = ("lora", "qlora", "full")
STEPS = ("featherweight", "JAX peer", "torch+peft")
AGAIN = "featherweight again"  # --jax-only: the same step twice a round, the noise floor


def _steps(args) -> tuple[str, ...]:
    """The steps each round runs: with --jax-only, featherweight twice (an A/A control: the
    ratio of a program to itself shows how much of a ratio is noise) and the JAX peer."""
    return ("featherweight", "JAX peer", AGAIN) if args.jax_only else STEPS


def _weights(method: str, model, key) -> tuple[dict, dict]:
    """(trainable, frozen) real arrays in featherweight's layout: a random base (NF4 blocks for
    QLoRA) and PEFT-initialized adapters, or every weight trainable for full fine-tuning."""
    params = init_params(key, model, jnp.float32)
    if method == "full":
        return params, {}
    frozen = quantize_frozen_base(params) if method == "qlora" else params
    return init_lora(jax.random.fold_in(key, 1), model, LoraConfig(rank=8)), frozen


def _compiled(step, arguments):
    """The compiled program (what the rounds run), its memory analysis and its matmul FLOPs."""
    start = time.perf_counter()
    executable = step.lower(*arguments).compile()
    trainable, opt_state, frozen = arguments[:3]
    measured = measurement_of(executable, trainable, opt_state, frozen, time.perf_counter() - start)
    return executable, measured, hlo_dot_flops(executable)


def _measure_method(method: str, args, model, key) -> dict:
    """Compile both JAX steps, build the torch step, run the interleaved rounds."""
    config = _config(method, {}, False, args.batch, args.seq)
    fw_step, fw_abstract = abstract_step_arguments(config, model)
    trainable, frozen = _weights(method, model, key)
    same = jax.tree.structure(trainable) == jax.tree.structure(fw_abstract[0])
    assert same and jax.tree.structure(frozen) == jax.tree.structure(fw_abstract[2]), method
    tokens = jax.random.randint(key, (args.batch, args.seq), 0, model.vocab_size, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(args.seq, dtype=jnp.int32), tokens.shape)
    batch = Batch(tokens, tokens, jnp.ones(tokens.shape, jnp.float32), positions, positions * 0)
    step_key = jax.random.PRNGKey(0)
    fw_opt_state = jax.tree.map(lambda leaf: jnp.zeros(leaf.shape, leaf.dtype), fw_abstract[1])

    optimizer = make_optimizer(config.optimizer, config.steps)  # optax.adamw, the same schedule
    scale = 1.0 if method == "full" else config.lora.scale
    peer_step = build_peer_step(model, optimizer, scale)
    peer_opt_state = optimizer.init(trainable)
    peer_arguments = (trainable, peer_opt_state, frozen, tokens, tokens)
    fw_step, fw_measured, fw_flops = _compiled(
        fw_step, (trainable, fw_opt_state, frozen, batch, step_key)
    )
    peer_step, peer_measured, peer_flops = _compiled(peer_step, peer_arguments)
    print(f"{method}: compiled featherweight and the JAX peer", flush=True)
    torch_step = None
    if not args.jax_only:
        torch_step = build_torch_step(model, method, np.asarray(tokens), np.asarray(tokens))

    steps = _steps(args)
    cpu = {name: [] for name in steps}
    wall = {name: [] for name in steps}
    for round_index in range(args.rounds + 1):  # round 0 warms up and is dropped
        shift = round_index % len(steps)  # each step in each place in turn: no order bias
        for name in steps[shift:] + steps[:shift]:
            cpu_start, wall_start = time.process_time(), time.perf_counter()
            if name in ("featherweight", AGAIN):
                trainable, fw_opt_state, metrics = fw_step(
                    trainable, fw_opt_state, frozen, batch, step_key
                )
                loss = jax.block_until_ready(metrics["loss"])
            elif name == "JAX peer":
                trainable, peer_opt_state, loss = peer_step(
                    trainable, peer_opt_state, frozen, tokens, tokens
                )
                loss = jax.block_until_ready(loss)
            else:
                loss = torch_step()  # a float: the step waited for its result
            if round_index:
                cpu[name].append(time.process_time() - cpu_start)
                wall[name].append(time.perf_counter() - wall_start)
            print(f"{method} round {round_index} {name}: loss {float(loss):.3f}", flush=True)
    return {
        "measured": (fw_measured, peer_measured),
        "flops": (fw_flops, peer_flops),
        "chunks": chosen_chunks(resolve(config, model)),
        "cpu": cpu,
        "wall": wall,
    }


def _ratio(times: dict, peer: str) -> float:
    return statistics.median(
        f / p for f, p in zip(times["featherweight"], times[peer], strict=True)
    )


def _report(results: dict, args) -> list[str]:
    lines = [
        "# featherweight's default step vs its peers: SmolLM2-135M shapes",
        "",
        f"machine: {args.machine}, {jax.device_count()} JAX device(s) of kind "
        f"{jax.devices()[0].device_kind!r}; jax {jax.__version__}"
        f"{'' if args.jax_only else f', torch {_torch_version()}'}; "
        f"batch {args.batch} x seq {args.seq}, float32, AdamW, LoRA r8 alpha 16 on every linear "
        f"(LoRA, QLoRA); {args.rounds} interleaved rounds (order rotating) after one warm-up round",
        "",
        f"threads: XLA_FLAGS={os.environ.get('XLA_FLAGS', '(unset)')!r}; cores this process may use: "
        f"{sorted(os.sched_getaffinity(0))} of {os.cpu_count()}",
        "",
        "MiB: XLA:CPU `memory_analysis()` of the compiled step, temp + argument + output - alias. "
        "GFLOP: matmul FLOPs in the optimized HLO (loops by trip count). Time: median over rounds "
        "of the paired ratio featherweight / peer in the same round, process CPU time (wall time "
        "in brackets), measured on this machine; below 1 featherweight is faster."
        + (
            f' `--jax-only`: no torch; "{AGAIN}" is the same compiled step run again in each '
            "round, so `time / featherweight again` is a ratio of a program to itself: how far "
            "from 1 noise alone moves a ratio."
            if args.jax_only
            else ""
        ),
        "",
        "| method | featherweight MiB | JAX peer MiB | MiB ratio | featherweight GFLOP | "
        f"JAX peer GFLOP | time / JAX peer | time / {_steps(args)[2]} | median wall s "
        f"({', '.join(_steps(args))}) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, result in results.items():
        fw, peer = result["measured"]
        fw_flops, peer_flops = result["flops"]
        cpu, wall = result["cpu"], result["wall"]
        walls = ", ".join(f"{statistics.median(wall[name]):.2f}" for name in wall)
        third = _steps(args)[2]
        lines.append(
            f"| {method} ({result['chunks']}) | {fw.total_bytes / MIB:.1f} | "
            f"{peer.total_bytes / MIB:.1f} | {fw.total_bytes / peer.total_bytes:.3f} | "
            f"{fw_flops / 1e9:.1f} | {peer_flops / 1e9:.1f} | {_ratio(cpu, 'JAX peer'):.3f} "
            f"({_ratio(wall, 'JAX peer'):.3f}) | {_ratio(cpu, third):.3f} "
            f"({_ratio(wall, third):.3f}) | {walls} |"
        )
    lines += [
        "",
        "Bytes by owner (MiB; `measurement_of`'s split of the same totals):",
        "",
        "| method | step | frozen base | trainable | optimizer state | batch | temporaries "
        "| unaliased outputs |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for method, result in results.items():
        for name, measured in zip(STEPS, result["measured"], strict=False):
            parts = " | ".join(f"{b / MIB:.1f}" for b in measured.components.values())
            lines.append(f"| {method} | {name} | {parts} |")
    lines += ["", "Per-round CPU seconds:"]
    for method, result in results.items():
        per_step = "; ".join(
            f"{name}: {', '.join(f'{s:.2f}' for s in seconds)}"
            for name, seconds in result["cpu"].items()
        )
        lines.append(f"- {method}: {per_step}")
    return lines


def _torch_version() -> str:
    import torch  # after peer_torch set torch's OpenMP wait policy

    return torch.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=(*METHODS, "all"), default="all")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--machine", default=f"{platform.machine()} CPU")
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--jax-only", action="store_true", help="no torch; an A/A control of featherweight instead"
    )
    args = parser.parse_args()
    model = builtin_config("SmolLM2-135M")
    key = jax.random.PRNGKey(0)
    results = {}
    for method in METHODS if args.method == "all" else (args.method,):
        results[method] = _measure_method(method, args, model, key)
        gc.collect()  # the previous method's weights and torch model go before the next
    emit(_report(results, args), args.out)


if __name__ == "__main__":
    main()
