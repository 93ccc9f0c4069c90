"""The GPU check's speed rows (issue 32): featherweight at its defaults and at the fastest settings
within the device's memory, beside torch + peft (+ bitsandbytes) at the same shapes, in one run.

    python benchmarks/gpu_check_speed.py --out DIR [--tiny] [--deadline SECONDS]
    python benchmarks/gpu_check.py --out DIR --speed ...   (after the check's own cases)

Shapes (random weights drawn with fixed seeds, bf16 on the GPU): Llama-3.1-8B QLoRA b2 x 2048,
Qwen3-30B-A3B QLoRA b1 x 2048 (issue 42: NF4 experts, LoRA on attention and every expert),
Llama-3.1-8B LoRA b2 x 2048, Llama-3.2-1B LoRA b8 x 2048. Per shape, each job in its own
process on a GPU (`peak_bytes_in_use` is a process-lifetime high-water mark; `--tiny` runs them
all in one: `gpu_check_jobs.batches`), recorded as a JSON line in DIR/speed.jsonl as it ends:

- `fw-<shape>`: featherweight at its defaults (`resolve`), set up and run as the trainer does
  (`gpu_check_cases.set_up`, `run_steps`);
- `fw-<shape>-fastest`: at the settings `budget.fit_budget` picks for the device's usable memory
  (`capacity.of_device`: JAX's pool less the library allowance on a GPU, the machine's memory on
  a CPU): the room the lean plan leaves is spent on kept activations, cheapest time first;
- `torch-<shape>`: the torch + peft peer (`peer_torch.build_torch_step`: SDPA, gradient
  checkpointing, AdamW, LoRA r 8 on every linear, bitsandbytes NF4 for QLoRA), bf16 on the GPU;
  skipped with the reason where torch, peft or bitsandbytes are missing, and for the mixture of
  experts (`moe_peer_skipped`: transformers 5 keeps Qwen3-MoE's experts as fused 3-D parameters,
  which bitsandbytes' 4-bit loading, nn.Linear only, leaves in bf16: no QLoRA peer).

Each records the median of steps 3-6, tokens per second, the peak (JAX's `peak_bytes_in_use`;
torch's `max_memory_allocated`) and the model FLOPs utilisation: 4 N FLOPs per token for LoRA and
QLoRA (forward and input gradient; 6 N trained in full) at the GPU's published dense bf16 peak
(`memory/targets.json`), N the parameters a token goes through (a mixture of experts' k routed
experts of E, the router whole: `active_parameter_count`). featherweight and torch run one after the
other in separate processes on one GPU (each needs its whole memory): their ratio is of
consecutive runs, not interleaved repeats. `--tiny`: the same jobs on CPU at SmolLM2-135M layer
shapes (2 layers; the MoE row a 2-layer qwen3_moe, top-2 of 8 experts), float32, b x 64 (the torch
peer on the CPU too): the script runs in CI
(tests/test_gpu_check_speed.py) and cannot rot; its times are no measure of a GPU.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gpu_check_jobs
import jax
import numpy as np
from gpu_check_cases import (
    BATCH_SEED,
    GPU,
    STEPS,
    TIMED,
    TINY,
    Case,
    Scale,
    case_config,
    run_steps,
    set_up,
    settings_text,
)

from featherweight.memory import budget, capacity
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes
from featherweight.memory.targets import targets
from featherweight.models.shapes import layer_shapes, parameter_count

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class Shape:
    """One of the issue's shapes: the model's role in the check's scale, the method, batch x seq."""

    name: str
    model: str  # "large" (Llama-3.1-8B), "small" (Llama-3.2-1B) or "moe" (Qwen3-30B-A3B)
    method: str
    batch: int
    seq: int


SHAPES = (
    Shape("8b-qlora-b2x2048", "large", "qlora", 2, 2048),
    Shape("30b-a3b-qlora-b1x2048", "moe", "qlora", 1, 2048),
    Shape("8b-lora-b2x2048", "large", "lora", 2, 2048),
    Shape("1b-lora-b8x2048", "small", "lora", 8, 2048),
)
TINY_SHAPES = tuple(  # the same roles at --tiny's scale: "tiny-large-qlora-b2x64"
    dataclasses.replace(s, name=f"tiny-{s.model}-{s.method}-b{s.batch}x64", seq=64) for s in SHAPES
)


def jobs(tiny: bool) -> list[tuple[str, str, Shape]]:
    """(job name, kind: "defaults", "fastest" or "torch", shape), most important first."""
    listed = []
    for shape in TINY_SHAPES if tiny else SHAPES:
        listed += [
            (f"fw-{shape.name}", "defaults", shape),
            (f"fw-{shape.name}-fastest", "fastest", shape),
            (f"torch-{shape.name}", "torch", shape),
        ]
    return listed


def peak_flops(device_kind: str) -> float | None:
    """The published dense bf16 peak of the GPU `device_kind` names ("NVIDIA H100 80GB HBM3"),
    None where no target matches (a CPU)."""
    kind = device_kind.upper().replace("-", " ")
    for target in targets().values():
        if target.platform == "gpu" and target.short_name in kind and target.peak_flops:
            return target.peak_flops
    return None


def active_parameter_count(model_config) -> int:
    """The weights one token goes through: all of a dense model's; of a mixture of experts', its k
    routed experts of E (the router, which scores every expert, counted whole)."""
    total = parameter_count(model_config)
    if not model_config.num_experts:
        return total
    shapes = layer_shapes(model_config)
    per_expert = sum(
        math.prod(shapes[name][1:])
        for name in ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")
        if name in shapes
    )
    idle = model_config.num_experts - model_config.experts_per_token
    return total - model_config.num_layers * idle * per_expert


def model_flops_per_token(model_config, method: str) -> int:
    """4 N for adapters on a frozen base (forward, input gradient), 6 N for full fine-tuning; N
    the active parameters."""
    return (6 if method == "full" else 4) * active_parameter_count(model_config)


def moe_peer_skipped(model_config) -> str:
    """Why the torch peer of a mixture of experts is not run: no QLoRA of its experts exists."""
    experts = 3 * model_config.num_experts * model_config.hidden_size
    experts *= model_config.intermediate_size * model_config.num_layers
    return (
        "torch peer skipped: transformers 5 keeps qwen3_moe's experts as fused 3-D parameters, "
        "which bitsandbytes' 4-bit loading (nn.Linear only) leaves in bf16 "
        f"({format_bytes(2 * experts)} of experts): no QLoRA peer"
    )


def _scaled(scale: Scale, shape: Shape) -> Scale:
    return dataclasses.replace(scale, batch=shape.batch, seq=shape.seq)


def featherweight_job(kind: str, shape: Shape, scale: Scale) -> dict[str, Any]:
    """featherweight at its defaults, or at the fastest settings within the device's memory."""
    model = scale.models[shape.model]()
    config, _ = case_config(Case(shape.name, shape.model, shape.method, kind), scale, model)
    pool = None
    if kind == "fastest":
        pool = capacity.of_device()
        config, _ = budget.fit_budget(config, model, pool.limit_bytes)
    planned = plan_for_config(config, model).device_bytes
    step, arguments = set_up(config, model, scale)
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    history = run_steps(compiled, arguments)
    stats = jax.devices()[0].memory_stats() or {}
    return {
        "settings": settings_text(config),
        "pool_bytes": None if pool is None else pool.limit_bytes,
        "compile_s": compile_s,
        "step_s": history["step_s"],
        "losses": history["losses"],
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "planned_device_bytes": planned,
    }


def torch_job(shape: Shape, scale: Scale) -> dict[str, Any]:
    """The torch + peft (+ bitsandbytes) peer at the shape, or why it cannot run here."""
    model = scale.models[shape.model]()
    if model.num_experts:
        return {"skipped": moe_peer_skipped(model)}
    try:
        import peft  # noqa: F401
        import torch
        import transformers  # noqa: F401

        if shape.method == "qlora":
            import bitsandbytes  # noqa: F401
    except ImportError as error:
        return {"skipped": f"torch + peft (+ bitsandbytes) not installed ({error})"}
    from peer_torch import build_torch_step

    gpu = jax.default_backend() == "gpu"
    if gpu and not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA device here"}
    device = "cuda" if gpu else "cpu"
    tokens = np.random.default_rng(BATCH_SEED).integers(
        0, model.vocab_size, (shape.batch, shape.seq + 1)
    )
    step = build_torch_step(model, shape.method, tokens[:, :-1], tokens[:, 1:], device)
    seconds, losses = [], []
    for _ in range(STEPS):
        start = time.perf_counter()
        losses.append(step())  # .item(): waits for the device
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() if gpu else None
    return {"torch": torch.__version__, "step_s": seconds, "losses": losses,
            "peak_bytes_in_use": peak}  # fmt: skip


def job_main(name: str, tiny: bool) -> dict[str, Any]:
    """In the child process: run one job; its record."""
    _, kind, shape = next(job for job in jobs(tiny) if job[0] == name)
    scale = _scaled(TINY if tiny else GPU, shape)
    device = jax.devices()[0]
    record = {"job": name, "kind": kind, "shape": shape.name, "device": device.device_kind}
    record |= {"platform": jax.default_backend(), "jax": jax.__version__}
    record |= {"batch": shape.batch, "seq": shape.seq, "method": shape.method}
    result = torch_job(shape, scale) if kind == "torch" else featherweight_job(kind, shape, scale)
    if "step_s" in result:
        step_s = statistics.median(result["step_s"][TIMED])
        tokens_per_s = shape.batch * shape.seq / step_s
        peak = peak_flops(device.device_kind)
        flops = model_flops_per_token(scale.models[shape.model](), shape.method)
        result |= {"median_step_s": step_s, "tokens_per_s": tokens_per_s}
        result["mfu"] = None if peak is None else tokens_per_s * flops / peak
    return {**record, **result}


def _row(record: dict[str, Any]) -> str:
    if "median_step_s" not in record:
        return f"| {record['job']} | {record.get('error') or record.get('skipped')} | | | | |"
    peak, mfu = record.get("peak_bytes_in_use"), record.get("mfu")
    what = record.get("settings") or f"torch {record.get('torch')}"
    return (
        f"| {record['job']} | {what} | {record['tokens_per_s']:,.0f} | "
        f"{format_bytes(peak) if peak else 'no device peak (CPU)'} | "
        f"{f'{mfu:.0%}' if mfu is not None else 'no GPU peak'} | "
        f"{format_bytes(record['planned_device_bytes']) if 'planned_device_bytes' in record else ''} |"
    )


def speed_ups(records: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    """Per shape: featherweight's tokens/s over torch's, at defaults and at its fastest."""
    lines = []
    for shape in TINY_SHAPES if tiny else SHAPES:
        torch_run = records.get(f"torch-{shape.name}", {})
        for suffix, what in (("", "defaults"), ("-fastest", "fastest within the device")):
            mine = records.get(f"fw-{shape.name}{suffix}", {})
            if "tokens_per_s" in mine and "tokens_per_s" in torch_run:
                ratio = mine["tokens_per_s"] / torch_run["tokens_per_s"]
                lines.append(f"- {shape.name}, {what}: {ratio:.2f}x torch+peft's tokens/s")
            else:
                lines.append(f"- {shape.name}, {what}: not measured")
    return lines


def table_lines(records: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    """The results as markdown: one row per job, then the speed-ups."""
    return [
        gpu_check_jobs.title("speed (issue 32)", records, tiny),
        "",
        "Measured on that device by `python benchmarks/gpu_check_speed.py`: median of steps 3-6 "
        + ("of each job, all in one process (--tiny)" if tiny else "of one process per job")
        + "; featherweight and torch one after the other. MFU: 4 N "
        "FLOPs per token (LoRA, QLoRA) at the GPU's published dense bf16 peak.",
        "",
        "| job | settings | tokens/s | peak | MFU | planned |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
        *(_row(record) for record in records.values()),
        "",
        *speed_ups(records, tiny),
    ]


def main(argv: list[str] | None = None) -> int:
    args = gpu_check_jobs.parse_args(__doc__, REPO, argv)
    if args.job:
        return gpu_check_jobs.run_child(job_main, args, "speed")
    names = [name for name, _, _ in jobs(args.tiny)]
    records = gpu_check_jobs.run_jobs(__file__, "speed", names, args)
    gpu_check_jobs.write_table("speed", records, table_lines(records, args.tiny), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
