"""The GPU check's attention rows (issue 31): packed rows kept apart, and long context, measured.

    python benchmarks/gpu_check_attention.py --out DIR [--tiny] [--deadline SECONDS]
    python benchmarks/gpu_check.py --out DIR --attention ...   (after the check's own cases)

Jobs, each in its own process on a GPU (`peak_bytes_in_use` is a process-lifetime high-water
mark; `--tiny` runs them all in one: `gpu_check_jobs.batches`), in order of importance (the
check, featherweight and torch at each shape, blockwise at each shape, the longest-context
search), each recorded as a JSON line in DIR/attention.jsonl as it ends:

- `packed-rows`: every attention implementation that can run here against blockwise
  (`dev/attention_check.py`): packed rows of three documents of unequal length and a row of
  padding (cudnn: cuDNN's packed layout; pallas; materialized), rows of one document
  (cudnn_padded); bf16, 32 query and 8 K/V heads, head dim 128. Records each one's largest
  differences from blockwise (forward and the q, k, v gradients, relative to blockwise's largest
  value) and the largest cross-document gradient, which must be exactly 0. An implementation
  the target cannot run is recorded with the refusal's reason, not skipped silently.
- `fw-b1x16384`, `fw-b2x2048`: Llama-3.1-8B QLoRA (random weights, `gpu_check_cases.set_up`,
  the trainer's path) with `memory.attention: auto` -- the implementation it resolves to is
  recorded -- and `-blockwise` beside them: compile seconds, the median of steps 3-6,
  `peak_bytes_in_use` and the plan's device bytes (cuDNN's backward workspace included).
- `torch-b1x16384`, `torch-b2x2048`: torch + peft + bitsandbytes at the same shapes (bf16 on the
  GPU, NF4 linears, LoRA r 8 on every linear, SDPA attention, gradient checkpointing, AdamW),
  skipped with the reason printed where CUDA torch, peft or bitsandbytes are absent.
- `longest-<S>`: QLoRA at b1 x S for S = 32K, 64K, 128K, 192K, 256K, 384K, 512K tokens (from
  128K on with `memory.residuals: host`: the bf16 residual stream, L x S x D, is 32 GiB at 128K),
  until one fails: the longest that ran, with its `peak_bytes_in_use`.

Speed is the median of steps 3-6 of one process; featherweight and torch run in separate
processes one after the other (each needs the GPU's whole memory), so their ratio is of
consecutive runs on one GPU, not interleaved repeats. `--tiny`: the same jobs on CPU at
SmolLM2-135M layer shapes (2 layers), float32, short sequences, Pallas in interpret mode: the
script runs in CI (tests/test_gpu_check_attention.py) and cannot rot; its times are no measure.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import gpu_check_jobs
import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_cases import GPU, TIMED, TINY, Case, Scale, case_config, run_steps, set_up

from featherweight.dev.attention_check import check_against_blockwise, packed_inputs
from featherweight.errors import StepConfigError
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes
from featherweight.models.attention import attend
from featherweight.models.attention_choice import AttentionTarget, choose_attention
from featherweight.models.fused_attention import pallas_attention
from featherweight.recipe.build import attention_implementation

REPO = Path(__file__).resolve().parent.parent
LONGEST = (32768, 65536, 131072, 196608, 262144, 393216, 524288)
TINY_LONGEST = (256,)
EIGHTY_GB = 80e9  # an H100's memory, as the issue's target states it
TOLERANCE = {"bfloat16": 2e-2, "float32": 1e-4}  # largest difference / blockwise's largest value


@dataclasses.dataclass(frozen=True)
class Job:
    """One process: what it runs ("check", "featherweight" or "torch") at batch x seq."""

    name: str
    kind: str
    batch: int = 1
    seq: int = 0
    attention: str = "auto"


def jobs(tiny: bool) -> list[Job]:
    """The jobs in order of importance (see the module docstring)."""
    long, short = ((1, 256), (2, 128)) if tiny else ((1, 16384), (2, 2048))
    shapes = [(f"b{batch}x{seq}", batch, seq) for batch, seq in (long, short)]
    listed = [Job("packed-rows", "check")]
    for shape, batch, seq in shapes:  # the two comparisons first
        listed += [
            Job(f"fw-{shape}", "featherweight", batch, seq),
            Job(f"torch-{shape}", "torch", batch, seq),
        ]
    for shape, batch, seq in shapes:  # what auto gained over blockwise
        listed.append(Job(f"fw-{shape}-blockwise", "featherweight", batch, seq, "blockwise"))
    return listed + [
        Job(f"longest-{seq}", "featherweight", 1, seq)
        for seq in (TINY_LONGEST if tiny else LONGEST)
    ]


# ---------------------------------------------------------------- packed rows kept apart


def _check_one(name: str, rows: str, tiny: bool) -> dict[str, Any]:
    """One implementation against blockwise, or the reason it cannot run on this device."""
    dtype = jnp.float32 if tiny else jnp.bfloat16
    shape = dict(seq=64, heads=4, kv_heads=2, head_dim=16) if tiny else dict(
        seq=256, heads=32, kv_heads=8, head_dim=128
    )  # fmt: skip
    documents = (40,) if rows == "padded" else (11, 29, 17)
    inputs = packed_inputs(**shape, dtype=dtype, documents=documents)
    interpret = jax.default_backend() != "gpu"
    if name == "pallas" and interpret:
        implementation = "pallas (interpret mode)"

        def attention(q, k, v, segments):
            return pallas_attention(q, k, v, segments, interpret=True)
    else:
        choice = "cudnn" if name.startswith("cudnn") else name
        try:
            target = AttentionTarget.of_device()
            implementation = choose_attention(
                choice, target, jnp.dtype(dtype).name, shape["head_dim"], rows
            )
        except StepConfigError as refusal:
            return {"implementation": name, "rows": rows, "refused": str(refusal)}

        def attention(q, k, v, segments):
            return attend(q, k, v, segments, implementation)

    check = check_against_blockwise(attention, inputs)
    relative = [check.output_error / check.output_scale] + [
        error / scale for error, scale in zip(check.gradient_errors, check.gradient_scales)
    ]
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    return {
        "implementation": implementation,
        "rows": rows,
        "relative_errors": dict(zip(("out", "dq", "dk", "dv"), relative)),
        "cross_document_gradient": check.cross_document_gradient,
        "passed": max(relative) <= tolerance and check.cross_document_gradient == 0.0,
    }


def packed_rows_check(tiny: bool) -> dict[str, Any]:
    """`packed-rows`: every implementation against blockwise (see the module docstring)."""
    cases = [("cudnn", "packed"), ("cudnn_padded", "padded"), ("pallas", "packed")]
    cases.append(("materialized", "packed"))
    results = []
    for name, rows in cases:
        try:
            results.append(_check_one(name, rows, tiny))
        except Exception as error:  # a kernel that fails to run is a finding: record it
            traceback.print_exc()
            results.append({"implementation": name, "rows": rows, "error": repr(error)[:2000]})
    return {"implementations": results}


# ---------------------------------------------------------------- long context


def _peak() -> int | None:
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def featherweight_job(job: Job, scale: Scale) -> dict[str, Any]:
    """QLoRA at the job's shape with its attention, as the trainer sets it up and runs it."""
    scale = dataclasses.replace(scale, batch=job.batch, seq=job.seq)
    model = scale.models["large"]()
    if job.seq > model.max_position_embeddings:
        model = dataclasses.replace(model, max_position_embeddings=job.seq)
    memory = (("attention", job.attention),)
    if job.name.startswith("longest") and job.seq > 65536:
        memory += (("residuals", "host"),)  # L x S x D bf16 residuals: 64 GiB at 1M tokens
    config, _ = case_config(Case(job.name, "large", "qlora", job.name, memory), scale, model)
    planned = plan_for_config(config, model).device_bytes  # the plan of the attention it runs
    step, arguments = set_up(config, model, scale)
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    history = run_steps(compiled, arguments)
    step_s = statistics.median(history["step_s"][TIMED])
    return {
        "attention": attention_implementation(config, model),
        "settings": {"residuals": config.memory.residuals},
        "compile_s": compile_s,
        "median_step_s": step_s,
        "tokens_per_s": job.batch * job.seq / step_s,
        "peak_bytes_in_use": _peak(),
        "planned_device_bytes": planned,
        "losses": history["losses"],
    }


def torch_job(job: Job, scale: Scale) -> dict[str, Any]:
    """torch + peft + bitsandbytes QLoRA at the job's shape on the GPU, or why it cannot run."""
    try:
        import bitsandbytes  # noqa: F401
        import peft  # noqa: F401
        import torch
        import transformers  # noqa: F401
    except ImportError as error:
        return {"skipped": f"torch + peft + bitsandbytes not installed ({error})"}
    if not torch.cuda.is_available():
        return {"skipped": "torch has no CUDA device here"}
    from peer_torch import build_torch_step  # bf16, SDPA, checkpointing, NF4 linears, LoRA r 8

    model_config = scale.models["large"]()
    tokens = np.random.default_rng(1).integers(0, model_config.vocab_size, (job.batch, job.seq + 1))
    step = build_torch_step(model_config, "qlora", tokens[:, :-1], tokens[:, 1:], device="cuda")
    torch.cuda.reset_peak_memory_stats()
    seconds = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    step_s = statistics.median(seconds[TIMED])
    return {
        "torch": torch.__version__,
        "median_step_s": step_s,
        "tokens_per_s": job.batch * job.seq / step_s,
        "peak_bytes_in_use": torch.cuda.max_memory_allocated(),
    }


def job_main(job: Job, tiny: bool) -> dict[str, Any]:
    """In the child process: run one job; its record."""
    scale = TINY if tiny else GPU
    device = jax.devices()[0]
    record = {"job": job.name, "device": device.device_kind, "jax": jax.__version__}
    record["platform"] = jax.default_backend()
    if job.kind == "check":
        return {**record, **packed_rows_check(tiny)}
    run = featherweight_job if job.kind == "featherweight" else torch_job
    return {**record, "batch": job.batch, "seq": job.seq, **run(job, scale)}


# ---------------------------------------------------------------- the driver and the table


def _ratio(records: dict, shape: str) -> str:
    mine, theirs = records.get(f"fw-{shape}", {}), records.get(f"torch-{shape}", {})
    if "median_step_s" in mine and "median_step_s" in theirs:
        return f"{mine['median_step_s'] / theirs['median_step_s']:.2f}x torch+peft's time"
    return "not measured"


def _row(record: dict[str, Any]) -> str:
    if "error" in record or "skipped" in record:
        return f"| {record['job']} | {record.get('error') or record.get('skipped')} | | | | |"
    peak, planned = record.get("peak_bytes_in_use"), record.get("planned_device_bytes")
    return (
        f"| {record['job']} | {record.get('attention', 'torch SDPA')} | "
        f"{record['median_step_s']:.3f} s | {record['tokens_per_s']:,.0f} | "
        f"{format_bytes(peak) if peak else 'no device peak (CPU)'} | "
        f"{format_bytes(planned) if planned else ''} |"
    )


def table_lines(records: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    """The results as markdown: the packed-rows check, the long-context rows, their ratios."""
    some = next((r for r in records.values() if "device" in r), {})
    lines = [
        f"# GPU check, attention (issue 31): {some.get('device', 'no device')}, jax "
        f"{some.get('jax', '?')}" + (" (--tiny, CPU: no speed measure)" if tiny else ""),
        "",
        "Measured on that device by `python benchmarks/gpu_check_attention.py`.",
        "",
        "| implementation | rows | relative error out / dq / dk / dv | cross-document gradient |"
        " passed |",
        "| --- | --- | --- | --- | --- |",
    ]
    for result in records.get("packed-rows", {}).get("implementations", []):
        why = result.get("refused") or result.get("error")
        if why:
            lines.append(f"| {result['implementation']} | {result['rows']} | {why} | | not run |")
            continue
        errors = " / ".join(f"{e:.1e}" for e in result["relative_errors"].values())
        lines.append(
            f"| {result['implementation']} | {result['rows']} | {errors} | "
            f"{result['cross_document_gradient']:g} | {'yes' if result['passed'] else 'NO'} |"
        )
    lines += [
        "",
        "| job | attention | median step (3-6) | tokens/s | peak_bytes_in_use | planned |",
    ]
    lines.append("| --- | --- | --- | --- | --- | --- |")
    lines += [_row(record) for name, record in records.items() if name != "packed-rows"]
    shapes = {name.split("-")[1] for name in records if name.startswith("fw-")}
    lines += ["", *(f"- {shape}: {_ratio(records, shape)}" for shape in sorted(shapes))]
    fits = [  # within an 80 GB GPU's memory (an H200 holds more: its longer rows do not count)
        r
        for n, r in records.items()
        if n.startswith("longest") and "error" not in r
        and (r["peak_bytes_in_use"] or 0) <= EIGHTY_GB
    ]  # fmt: skip
    if fits:
        longest = max(fits, key=lambda record: record["seq"])
        peak = longest["peak_bytes_in_use"]
        lines.append(
            f"- longest context that ran within 80 GB: {longest['seq']:,} tokens (b1), "
            "peak_bytes_in_use "
            f"{format_bytes(peak) if peak else 'none (CPU)'}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = gpu_check_jobs.parse_args(__doc__, REPO, argv)
    # the longest-context search stops at the first length that fails
    stop = lambda name, record: name.startswith("longest") and "error" in record
    if args.job:
        by_name = {job.name: job for job in jobs(args.tiny)}
        run = lambda name, tiny: job_main(by_name[name], tiny)
        return gpu_check_jobs.run_child(run, args, "attention", stop)
    names = [job.name for job in jobs(args.tiny)]
    records = gpu_check_jobs.run_jobs(__file__, "attention", names, args, stop)
    gpu_check_jobs.write_table("attention", records, table_lines(records, args.tiny), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
