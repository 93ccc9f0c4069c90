"""The GPU check's family and GRPO rows (issues 41-43): the families beside Llama trained on a GPU
as `train` runs them, each against another attention implementation from the same weights and
batch, and GRPO's two phases (rollouts, then the update) at the 8B goal's settings.

    python benchmarks/gpu_check_families.py --out DIR [--tiny] [--deadline SECONDS] [--jobs a,b]

Each job runs in its own process on a GPU (`peak_bytes_in_use` is a process's high-water mark;
`--tiny` runs them all in one: `gpu_check_jobs.batches`) and records a JSON line in
DIR/families.jsonl:

- a family job (`qwen3-0.6b-lora-packed`, ...): the model's real shapes, random weights (seed 0),
  bf16, b2 x 2048, one random batch whose rows hold documents of unequal length and padding
  (`documents_batch`: packed rows where the job packs, one document then padding where it does
  not). The step with `memory.attention: auto`, as `train` resolves it on this GPU (cuDNN where it
  masks exactly what the rows need: Qwen3's packed rows through cuDNN's packed layout, its padded
  rows and Gemma 3's (head dim 256) with its window taken away through cuDNN's public call;
  windows and gpt-oss's sinks keep it blockwise), runs 7
  steps: the device peak (measured) against the plan's device bytes (planned), tokens per
  second (median of steps 3-6). Then the same step with the other implementation (blockwise;
  materialized where auto is blockwise) from the same weights: the first step's loss and
  gradient norm must agree within 1e-2 (bf16; 1e-4 in float32), judged at identical weights as
  `gpu_check.py` judges placements (a GPU's step is not bitwise deterministic, so later steps are
  reported, not judged).
- `grpo-8b-qlora`: `examples/grpo-8b-12gb.yaml`'s settings (Llama-3.1-8B QLoRA, 8 completions of
  512 tokens after a 256-token prompt, `memory.budget: 12GiB` fitted as `train` fits it) on
  random weights: the rollouts (`sample_rollouts`, temperature 1, no stop token: every row runs
  to the length limit), timed (tokens per second) and the device peak after them against the
  rollout phase's plan; then 3 GRPO steps on those completions (random advantages) and the peak
  after them against the plan's peak.

`--tiny`: the same jobs on CPU, each model cut to 2 layers and a 4096-token vocabulary (gpt-oss to
4 experts of 256), float32, b2 x 128 (GRPO: SmolLM2-135M's layers, 4 completions of 32 after a
16-token prompt): the
script runs in CI (tests/test_gpu_check_families.py) and cannot rot; auto is blockwise there, so
each family is compared with materialized attention. Its times are no measure of a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import gpu_check_jobs
import jax
import jax.numpy as jnp
import numpy as np
from gpu_check_cases import BATCH_SEED, TIMED, run_steps, set_up, settings_text

from featherweight.inference.rollout import Sampling, sample_rollouts
from featherweight.memory import budget
from featherweight.memory.defaults import with_lean_defaults
from featherweight.memory.plan import plan_for_config
from featherweight.memory.report import format_bytes
from featherweight.models.attention_choice import AttentionTarget
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.llama import merge_params
from featherweight.models.registry import builtin_config
from featherweight.recipe.build import attention_implementation, lora_config_of
from featherweight.recipe.schema import TrainConfig, parse_config
from featherweight.train.grpo_rollouts import rollout_batch

REPO = Path(__file__).resolve().parent.parent


@dataclasses.dataclass(frozen=True)
class FamilyJob:
    """A family's row: the builtin model, the method, and whether its rows are packed."""

    name: str
    model: str
    method: str
    pack: bool
    window: bool = True  # False: the model's sliding window taken away (every layer global)


FAMILY_JOBS = (
    FamilyJob("qwen3-0.6b-lora-packed", "Qwen3-0.6B", "lora", True),
    FamilyJob("qwen3-0.6b-lora-padded", "Qwen3-0.6B", "lora", False),
    FamilyJob("gemma3-1b-qlora-padded-no-window", "Gemma-3-1B", "qlora", False, window=False),
    FamilyJob("gemma3-1b-qlora-padded", "Gemma-3-1B", "qlora", False),
    FamilyJob("phi3.5-mini-qlora-padded", "Phi-3.5-mini", "qlora", False),
    FamilyJob("gpt-oss-20b-qlora-padded", "gpt-oss-20b", "qlora", False),
)
GRPO_JOB = "grpo-8b-qlora"
STEPS_COMPARED = 3  # the other implementation's steps: the first is judged


@dataclasses.dataclass(frozen=True)
class Scale:
    """The GPU's shapes or --tiny's."""

    dtype: str
    batch: int
    seq: int
    tolerance: float
    grpo: dict[str, int]  # prompt, completion, generations


GPU = Scale("bfloat16", 2, 2048, 1e-2, {"prompt": 256, "completion": 512, "generations": 8})
TINY = Scale("float32", 2, 128, 1e-4, {"prompt": 16, "completion": 32, "generations": 4})


def job_names() -> list[str]:
    return [job.name for job in FAMILY_JOBS] + [GRPO_JOB]


def model_of(name: str, tiny: bool) -> ModelConfig:
    """The builtin model, or at --tiny its layer cut to 2 layers (a sliding and a global one where
    it has both), a 4096-token vocabulary and at most 4 experts of 256."""
    model = builtin_config(name)
    if not tiny:
        return model
    layers = model.sliding_layers
    if layers:  # a sliding layer and a global one, where the model has both
        layers = (layers[0], not layers[0]) if len(set(layers)) == 2 else layers[:2]
    model = dataclasses.replace(model, num_layers=2, vocab_size=4096, sliding_layers=layers)
    if model.num_experts:
        model = dataclasses.replace(
            model, num_experts=4, experts_per_token=2, intermediate_size=256
        )
    return model


def documents_batch(model: ModelConfig, scale: Scale, pack: bool) -> Batch:
    """One random batch (seed `BATCH_SEED`) whose rows hold documents of unequal length, then
    padding: packed, row 0 three documents and row 1 two; unpacked, one document a row, row 1
    ending in padding. Each token predicts the next within its document; padding carries no
    loss."""
    seq = scale.seq
    lengths = (
        ([seq // 2, seq // 4, seq // 4], [seq // 3, seq // 2]) if pack else ([seq], [3 * seq // 4])
    )
    rng = np.random.default_rng(BATCH_SEED)
    ids = rng.integers(0, model.vocab_size, (scale.batch, seq + 1)).astype(np.int32)
    segments = np.zeros((scale.batch, seq), np.int32)
    positions = np.zeros((scale.batch, seq), np.int32)
    mask = np.zeros((scale.batch, seq), np.float32)
    for row in range(scale.batch):
        start = 0
        for index, length in enumerate(lengths[row % 2]):
            segments[row, start : start + length] = index + 1
            positions[row, start : start + length] = np.arange(length)
            mask[row, start : start + length - 1] = 1.0  # a document's last token has no target
            start += length
    batch = Batch(ids[:, :-1], ids[:, 1:], mask, positions, segments)
    return jax.tree.map(jnp.asarray, batch)


def family_config(job: FamilyJob, scale: Scale, attention: str) -> TrainConfig:
    config = parse_config(
        {
            "method": job.method,
            "batch_size": scale.batch,
            "model": {"dtype": scale.dtype},
            "data": {"seq_len": scale.seq, "pack": job.pack},
            "optimizer": {"name": "adamw", "learning_rate": 1e-3, "schedule": "constant"},
            "memory": {"attention": attention},
        }
    )
    return config


def _run(config: TrainConfig, model: ModelConfig, scale: Scale, batch: Batch) -> dict[str, Any]:
    """Set up, compile and run `config` on `batch`: its history, compile seconds and the
    device's peak after the steps."""
    step, arguments = set_up(config, model, scale)
    arguments = (*arguments[:3], batch, arguments[4])
    start = time.perf_counter()
    compiled = step.lower(*arguments).compile()
    compile_s = time.perf_counter() - start
    history = run_steps(compiled, arguments)
    stats = jax.devices()[0].memory_stats() or {}
    return {"compile_s": compile_s, **history, "peak_bytes_in_use": stats.get("peak_bytes_in_use")}


def family_job(job: FamilyJob, scale: Scale, tiny: bool) -> dict[str, Any]:
    """The family's row (module docstring)."""
    model = model_of(job.model, tiny)
    if not job.window:
        model = dataclasses.replace(model, sliding_window=None, sliding_layers=())
    target = AttentionTarget.of_device()
    auto = with_lean_defaults(family_config(job, scale, "auto"), model)
    chosen = attention_implementation(auto, model, target)
    other = "materialized" if chosen == "blockwise" else "blockwise"
    batch = documents_batch(model, scale, job.pack)
    record: dict[str, Any] = {"model": job.model, "method": job.method, "pack": job.pack}
    record |= {"attention": chosen, "compared_with": other, "settings": settings_text(auto)}
    record["planned_device_bytes"] = plan_for_config(auto, model, target).device_bytes
    first = _run(auto, model, scale, batch)
    tokens = float(np.asarray(batch.loss_mask).sum())
    record |= first | {"tokens_per_s": tokens / statistics.median(first["step_s"][TIMED])}
    compared = with_lean_defaults(family_config(job, scale, other), model)
    compared = compared.model_copy(update={"memory": compared.memory.model_copy(
        update={name: getattr(auto.memory, name) for name in ("loss_chunk", "vocab_chunk", "mlp_chunk")}
    )})  # fmt: skip
    second = _run(compared, model, scale, batch)
    record["compared"] = {key: second[key][:STEPS_COMPARED] for key in ("losses", "grad_norms")}
    differences = {
        key: abs(first[key][0] - second[key][0]) / max(abs(second[key][0]), 1e-30)
        for key in ("losses", "grad_norms")
    }
    record["step1_relative_differences"] = differences
    record["matches"] = max(differences.values()) <= scale.tolerance
    return record


def grpo_config(scale: Scale) -> TrainConfig:
    """examples/grpo-8b-12gb.yaml's step settings at `scale` (its data and reward are the run's,
    not the step's: the reward is named, never called here)."""
    shapes = scale.grpo
    return parse_config(
        {
            "model": {"dtype": scale.dtype},
            "method": "qlora",
            "objective": "grpo",
            "grpo": {
                "rewards": ["planet_colour_reward.py:planet_colour"],
                "num_generations": shapes["generations"],
                "max_completion_length": shapes["completion"],
                "temperature": 1.0,
                "beta": 0.0,
                "loss_type": "dapo",
            },
            "lora": {
                "rank": 16,
                "alpha": 32,
                "targets": ["q", "k", "v", "o", "gate", "up", "down"],
            },
            "data": {"seq_len": shapes["prompt"] + shapes["completion"]},
            "memory": {"budget": "12GiB"},
            "optimizer": {"name": "adamw", "learning_rate": 1e-5, "schedule": "constant"},
            "batch_size": shapes["generations"],
        }
    )


def grpo_job(scale: Scale, tiny: bool) -> dict[str, Any]:
    """GRPO's two phases at the 8B goal's settings (module docstring)."""
    name = "SmolLM2-135M" if tiny else "Llama-3.1-8B"
    model = model_of(name, tiny)
    target = AttentionTarget.of_device()
    config, plan = budget.plan_within_budget(grpo_config(scale), model, target)
    step, arguments = set_up(config, model, dataclasses.replace(scale, batch=config.batch_size))
    trainable, opt_state, frozen, _, key = arguments
    shapes = scale.grpo
    prompt = np.random.default_rng(BATCH_SEED).integers(0, model.vocab_size, shapes["prompt"])
    sampling = Sampling(1.0, 1.0, shapes["completion"])
    lora = lora_config_of(config)
    params = merge_params(frozen, trainable)
    times = []
    for _ in range(2):  # the first call compiles
        start = time.perf_counter()
        rollout = sample_rollouts(
            params, model, lora.spec, [prompt.tolist()], key, shapes["generations"], sampling,
            stop_ids=[], dtype=config.model.dtype, chunk=config.memory.rollout_chunk,
        )  # fmt: skip
        times.append(time.perf_counter() - start)
    peak_rollout = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    completion_tokens = int(rollout.lengths.sum())
    advantages = np.random.default_rng(BATCH_SEED).standard_normal(len(rollout.lengths))
    batch = rollout_batch([prompt.tolist()], rollout, advantages, config.data.seq_len)
    batch = jax.tree.map(jnp.asarray, batch)
    compiled = step.lower(trainable, opt_state, frozen, batch, key).compile()
    update_s, losses = [], []
    for index in range(3):
        start = time.perf_counter()
        trainable, opt_state, metrics = compiled(
            trainable, opt_state, frozen, batch, jax.random.fold_in(key, index)
        )
        jax.block_until_ready(metrics)
        update_s.append(time.perf_counter() - start)
        losses.append(float(metrics["loss"]))
    peak = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
    return {
        "model": name, "settings": settings_text(config),
        "rollout_chunk": config.memory.rollout_chunk,
        "rollout_s": times, "completion_tokens": completion_tokens,
        "rollout_tokens_per_s": completion_tokens / times[1],
        "peak_after_rollouts": peak_rollout,
        "planned_rollout_device_bytes": plan.rollout_device_bytes,
        "update_s": update_s, "losses": losses, "peak_bytes_in_use": peak,
        "planned_device_bytes": plan.device_bytes,
        "planned_train_device_bytes": plan.train_device_bytes,
    }  # fmt: skip


def job_main(name: str, tiny: bool) -> dict[str, Any]:
    scale = TINY if tiny else GPU
    device = jax.devices()[0]
    record = {"job": name, "device": device.device_kind, "platform": jax.default_backend()}
    record |= {"jax": jax.__version__, "dtype": scale.dtype}
    if name == GRPO_JOB:
        return record | grpo_job(scale, tiny)
    job = next(job for job in FAMILY_JOBS if job.name == name)
    return record | family_job(job, scale, tiny)


def _bytes(value: int | None) -> str:
    return format_bytes(value) if value else "no device peak (CPU)"


def _row(record: dict[str, Any]) -> str:
    name = record["job"]
    if "error" in record:
        return f"| {name} | {record['error']} | | | | |"
    if name == GRPO_JOB:
        return (
            f"| {name} | rollouts: {record['rollout_tokens_per_s']:,.0f} tokens/s, peak "
            f"{_bytes(record['peak_after_rollouts'])} (planned "
            f"{format_bytes(record['planned_rollout_device_bytes'])}); update "
            f"{statistics.median(record['update_s']):.2f} s | {record['settings']} | | "
            f"{_bytes(record['peak_bytes_in_use'])} | {format_bytes(record['planned_device_bytes'])} |"
        )
    differences = record["step1_relative_differences"]
    verdict = "match" if record["matches"] else "MISMATCH"
    return (
        f"| {name} | {record['attention']} vs {record['compared_with']}: {verdict} (step-1 loss "
        f"{differences['losses']:.1e}, gradient norm {differences['grad_norms']:.1e}) | "
        f"{record['settings']} | {record['tokens_per_s']:,.0f} | "
        f"{_bytes(record['peak_bytes_in_use'])} | {format_bytes(record['planned_device_bytes'])} |"
    )


def table_lines(records: dict[str, dict[str, Any]], tiny: bool) -> list[str]:
    return [
        gpu_check_jobs.title("families and GRPO", records, tiny),
        "",
        "Measured on that device by `python benchmarks/gpu_check_families.py` ("
        + ("every job in one process, --tiny" if tiny else "one process per job")
        + "); planned: `plan_for_config` / `plan_within_budget` for the device. Peak: "
        "`peak_bytes_in_use` after the steps (the process's high-water mark: for a family job it "
        "is the auto step's, taken before the compared step runs).",
        "",
        "| job | result | settings | tokens/s | peak (measured) | planned |",
        "| --- | --- | --- | ---: | ---: | ---: |",
        *(_row(record) for record in records.values()),
    ]


def main(argv: list[str] | None = None) -> int:
    args = gpu_check_jobs.parse_args(__doc__, REPO, argv)
    if args.job:
        return gpu_check_jobs.run_child(job_main, args, "families")
    records = gpu_check_jobs.run_jobs(__file__, "families", job_names(), args)
    gpu_check_jobs.write_table("families", records, table_lines(records, args.tiny), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
