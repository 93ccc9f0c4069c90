"""The training loop: one copy of the state on the device, read top to bottom.

The step donates parameters and optimizer state, and the loop rebinds them to the step's results:
no previous copy, no host mirror stays alive (keras-core #888). Evaluation reads the same buffers.

The host reads the step's metrics every `log_every` steps (and before every checkpoint and
evaluation), not every step: the device runs ahead in between. Every step still gets its line in
metrics.jsonl (loss, learning rate, tokens, throughput over the interval, gradient norm).

GRPO (objective: grpo): each step first samples its batch -- the step's prompts (in their
resumable order), `grpo.num_generations` completions of each by the current adapters, their
rewards and advantages (`grpo_rollouts.step_data`, keyed by the step, so a resumed run samples
what an uninterrupted one would) -- then runs the same step on it; the rollouts' metrics (TRL's
names) join the step's line with the step's wall-clock split (`time/rollout_seconds`: sampling and
scoring; `time/update_seconds`: the update, waited for, as the next rollouts would), and every
`grpo.log_completions_every` steps one sample completion is printed and written to
completions.jsonl.

On a device mesh each process reads its own rows and the global batch is assembled from them;
with several processes only process 0 writes metrics, plots and progress (checkpoints are written
by all of them, through orbax's multi-host support).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console

from featherweight.data.iterator import eval_batches
from featherweight.errors import TrainingDivergedError
from featherweight.memory import device_memory
from featherweight.memory.budget import describe_changes, plan_within_budget
from featherweight.memory.measure import abstract_batch, measurement_of
from featherweight.memory.plan import MemoryPlan
from featherweight.memory.report import format_bytes, print_report
from featherweight.models.batch import Batch
from featherweight.models.llama import Params, merge_params
from featherweight.parallel.distributed import any_process, is_primary
from featherweight.parallel.sharding import place_batch
from featherweight.recipe.build import attention_implementation, evaluation_fn, lora_config_of
from featherweight.recipe.objectives import objective_of
from featherweight.recipe.optimizer import learning_rate_schedule
from featherweight.recipe.schema import TrainConfig
from featherweight.step.router_loss import METRIC_NAMES as ROUTER_METRICS
from featherweight.train import run_dir
from featherweight.train.dataset import (
    counted,
    data_summary,
    packed_slots_note,
    summary_lines,
    write_summary,
)
from featherweight.train.grpo_rollouts import StepData, step_data
from featherweight.train.loggers import check_loggers, open_loggers
from featherweight.train.metrics import MetricsLog, plot_loss_curve
from featherweight.train.progress import ROLLOUT_SECONDS, UPDATE_SECONDS, training_progress
from featherweight.train.run import PlannedRun, Run, plan_run, prepare_run
from featherweight.train.run_dir import COMPLETIONS_FILE, LOSS_PLOT, METRICS_FILE
from featherweight.train.signals import StopRequest

ROLLOUTS = 1  # GRPO's sampling key: the step's key folded with this, apart from its dropout


@dataclasses.dataclass
class TrainResult:
    output_dir: Path
    step: int
    loss: float | None
    eval_loss: float | None
    stopped_by_signal: int | None
    trainable: Params
    frozen: Params
    run: Run


def device_memory_in_use() -> int | None:
    """Bytes in use on the first local device, when the backend reports it (GPUs do)."""
    stats = jax.local_devices()[0].memory_stats()
    return None if not stats else int(stats.get("bytes_in_use", 0))


def save(run: Run, step: int, trainable: Params, opt_state) -> None:
    metadata = {"step": step, "data": run.data.state.as_dict(), "seed": run.config.seed}
    run.checkpointer.save(step, (trainable, opt_state), metadata)


def global_batch(run: Run, batch: Batch) -> Batch:
    """This process's rows as (part of) the global batch on the mesh; unchanged on one device."""
    return batch if run.mesh is None else place_batch(batch, run.mesh)


def printing_planner(console: Console) -> Callable:
    """The trainer's `plan_fn`: fit `memory.budget` (or plan the config as it is) and print the
    plan's headline, before any weight is read."""

    def plan(config: TrainConfig, model_config) -> tuple[TrainConfig, MemoryPlan]:
        planned_config, memory_plan = plan_within_budget(config, model_config)
        host = memory_plan.host_bytes
        console.print(
            f"memory plan: {format_bytes(memory_plan.device_bytes)} on the device"
            + (f" + {format_bytes(host)} in host memory" if host else "")
            + f" (peak phase: {memory_plan.peak_phase}; largest: "
            f"{memory_plan.largest_component().name})",
            highlight=False,
        )
        who = "budget" if config.memory.budget is not None else "planner (to fit the device)"
        for change in describe_changes(config, planned_config, model_config):
            console.print(f"{who} changed {change}", highlight=False)
        return planned_config, memory_plan

    return plan


def compile_step(
    run: Run, trainable: Params, opt_state: Any, console: Console, formulas: bool = False
) -> Callable:
    """Compile the step ahead of the first batch and print its measured memory next to the plan
    (`compiled.memory_analysis()`, per device); the compiled step is what the loop runs."""
    rows = run.config.batch_size * jax.process_count()
    batch = abstract_batch(rows, run.config.data.seq_len, run.config)
    started = time.perf_counter()
    lowered = run.step_fn.lower(trainable, opt_state, run.frozen, batch, jax.random.PRNGKey(0))
    compiled = lowered.compile()
    seconds = time.perf_counter() - started
    if run.plan is not None and compiled.memory_analysis() is not None:
        measurement = measurement_of(compiled, trainable, opt_state, run.frozen, seconds)
        print_report(run.plan, measurement, console, formulas=formulas)
    return compiled


def evaluate(run: Run, trainable: Params) -> float | None:
    """Mean loss over the eval rows (token-weighted), on the live buffers; None without eval data."""
    if run.dataset.eval is None:
        return None
    loss_fn = evaluation_fn(run.config, run.model_config)
    total, count = 0.0, 0.0
    batches = eval_batches(
        run.dataset.eval, run.config.batch_size, jax.process_index(), jax.process_count()
    )
    for index, batch in enumerate(batches):
        if index >= run.config.eval_batches:
            break
        batch_loss, batch_count = loss_fn(trainable, run.frozen, global_batch(run, batch))
        total, count = total + float(batch_loss) * float(batch_count), count + float(batch_count)
    return total / max(count, 1.0)


class StepRecords:
    """The steps since the last host sync: their metrics stay on the device until `flush`.

    Reading a metric (`float(loss)`) waits for the device to finish the step; doing it every
    `log_every` steps instead of every step lets the host queue the next steps meanwhile.
    """

    def __init__(self, run: Run) -> None:
        self.run = run
        self.schedule = learning_rate_schedule(run.config.optimizer, run.config.steps)
        self.pending: list[tuple[int, dict, int, dict]] = []
        # the objective's (and the router loss's) metrics a step's line carries
        self.reported = (*objective_of(run.config).metric_names, *ROUTER_METRICS)
        self.since = time.perf_counter()

    def add(self, step: int, metrics: dict, batch_tokens: int, host: dict | None = None) -> None:
        """A step's device metrics, and those already on the host (GRPO's rollouts)."""
        self.pending.append((step, metrics, batch_tokens, host or {}))

    def flush(self) -> list[dict[str, Any]]:
        """One record per pending step (host sync); a non-finite step raises TrainingDiverged."""
        if not self.pending:
            return []
        steps = [step for step, _, _, _ in self.pending]
        # the update of step s uses the schedule at count s - 1
        rates = np.broadcast_to(self.schedule(np.asarray(steps) - 1), (len(steps),))
        host = jax.device_get([metrics for _, metrics, _, _ in self.pending])
        now = time.perf_counter()
        tokens = sum(batch_tokens for _, _, batch_tokens, _ in self.pending)
        speed = round(tokens / max(now - self.since, 1e-9), 1)
        memory = device_memory_in_use()
        records = []
        rollouts = [rollout for _, _, _, rollout in self.pending]
        for step, metrics, rate, rollout in zip(steps, host, rates, rollouts, strict=True):
            loss = float(metrics["loss"])
            if not math.isfinite(loss) or not bool(metrics.get("params_finite", True)):
                raise diverged(self.run, step, loss)
            records.append({
                "step": step, "loss": loss, "learning_rate": float(rate),
                "tokens": int(metrics["tokens"]), "tokens_per_second": speed,
                "grad_norm": float(metrics.get("grad_norm", np.nan)), "device_bytes": memory,
                **{name: float(metrics[name]) for name in self.reported if name in metrics},
                **rollout,
            })  # fmt: skip
        self.pending, self.since = [], now
        return records


def diverged(run: Run, step: int, loss: float) -> TrainingDivergedError:
    last = run.checkpointer.latest_step()
    what = (
        f"loss became {loss}"
        if not math.isfinite(loss)
        else "the update made parameters non-finite (inf or nan)"
    )
    kept = (
        "before any checkpoint was written"
        if last is None
        else f"keeping the last good checkpoint (step {last}) in {run.checkpointer.directory}"
    )
    return TrainingDivergedError(
        f"{what} at step {step}; stopped, {kept}. Lower optimizer.learning_rate or check the data"
    )


class Reporter:
    """Where records go on the primary process: metrics.jsonl, the loggers, the progress."""

    def __init__(self, run: Run, console: Console) -> None:
        self.primary = is_primary()
        self.metrics = (
            MetricsLog(run.output_dir / METRICS_FILE, run.start_step) if self.primary else None
        )
        config = run.config
        self.loggers = (
            open_loggers(config.report_to, run.output_dir, run.start_step, config.model_dump(mode="json"))
            if self.primary else []
        )  # fmt: skip
        self.progress = training_progress(console, config.steps, run.start_step)
        self.console, self.samples = console, None
        rollouts = objective_of(config).rollouts(config)
        if self.primary and rollouts is not None and rollouts.log_completions_every:
            self.samples = MetricsLog(run.output_dir / COMPLETIONS_FILE, run.start_step)
        if 0 < run.start_step < config.steps and self.metrics is not None:
            # a resume mark only where training goes on (a finished run re-run changes nothing)
            self.metrics.write({"step": run.start_step, "resumed": True})

    def write(self, records: list[dict[str, Any]], show: bool = True) -> None:
        for record in records:
            if self.metrics is not None:
                self.metrics.write(record)
            for logger in self.loggers:
                logger.log(record)
        if show and records and "loss" in records[-1]:
            self.progress.update(records[-1]["step"], records[-1])
        elif show and records and records[-1].get("eval_loss") is not None:
            self.progress.evaluated(records[-1]["step"], records[-1]["eval_loss"])

    def sample(self, step: int, data: StepData) -> None:
        """One of the step's completions (the first), its prompt and reward: printed, and a line
        in completions.jsonl."""
        if self.samples is None:
            return
        prompt, completion = data.prompts[0], data.completions[0]
        text = completion[0]["content"] if isinstance(completion, list) else completion
        asked = prompt[-1]["content"] if isinstance(prompt, list) else prompt
        reward = float(data.rewards[0])
        self.console.print(
            f"step {step} sample: {asked!r} -> {text!r} (reward {reward:g})", highlight=False
        )
        self.samples.write(
            {"step": step, "prompt": prompt, "completion": completion, "reward": reward}
        )

    def close(self, output_dir: Path) -> None:
        if self.samples is not None:
            self.samples.close()
        for logger in self.loggers:
            logger.close()
        if self.metrics is not None:
            self.metrics.close()
            plot_loss_curve(output_dir / METRICS_FILE, output_dir / LOSS_PLOT)


def print_data_summary(run: Run, console: Console) -> None:
    """What the data became (records, skipped, split, tokens, rows, epochs): printed, and written
    to the run's data_summary.json."""
    if run.rollouts is not None:  # prompts: the rows are sampled each step
        print_prompts_summary(run, console)
        return
    summary = data_summary(run.config, run.dataset, run.data.steps_per_epoch, run.config.data.train)
    for line in summary_lines(summary):
        console.print(line, highlight=False)
    attention = attention_implementation(run.config, run.model_config)
    note = packed_slots_note(run.config, attention, run.dataset)
    if note is not None:
        console.print(note, highlight=False)
    if is_primary():
        write_summary(run.output_dir, summary)


def print_prompts_summary(run: Run, console: Console) -> None:
    """GRPO's data: the prompt records read (and skipped), and the epochs the steps make."""
    config, prompts = run.config, run.dataset
    per_step = config.batch_size // config.grpo.num_generations
    skipped = f", {prompts.skipped:,} skipped" if prompts.skipped else ""
    console.print(
        f"data: {counted(len(prompts.train), 'prompt record')} read from {config.data.train}"
        f"{skipped}; {per_step} prompts x {config.grpo.num_generations} completions a step",
        highlight=False,
    )
    epochs = round(config.steps / run.data.steps_per_epoch, 3)
    console.print(
        f"steps: {config.steps:,} = {counted(epochs, 'epoch')} of "
        f"{counted(run.data.steps_per_epoch, 'step')}",
        highlight=False,
    )


def next_batch(run: Run, trainable: Params, key: jax.Array) -> tuple[Batch, StepData | None]:
    """The step's batch: the data's next one, or GRPO's rollouts of the next prompts sampled by
    the current adapters with `key` (and their data: metrics, texts, rewards)."""
    if run.rollouts is None:
        return global_batch(run, next(run.data)), None
    lora = lora_config_of(run.config)
    data = step_data(
        run.rollouts, next(run.data), merge_params(run.frozen, trainable), run.model_config,
        None if lora is None else lora.spec, key, jnp.dtype(run.config.model.dtype),
    )  # fmt: skip
    return data.batch, data


def train(
    config: TrainConfig,
    overwrite: bool = False,
    console: Console | None = None,
    plan_fn=None,
    on_step: Callable[[int, Params, Any, dict], None] | None = None,
    verbose: bool = False,
) -> TrainResult:
    """Run (or resume) the training `config` describes; see the module docstring.

    `on_step(step, trainable, opt_state, metrics)`, when given, sees the live state after every
    step (monitoring, tests); it must not keep references to it. `verbose`: the memory table
    with each row's formula (wider than 100 columns).
    """
    console = (console or Console()) if is_primary() else Console(quiet=True)
    check_loggers(config.report_to)
    # from the very start: SIGINT/SIGTERM/SIGHUP during setup (planning, loading, compiling) is
    # recorded too, and the run stops cleanly before its first step instead of dying mid-setup
    with StopRequest() as stop:
        return _train(config, overwrite, console, plan_fn, on_step, stop, verbose)


def dry_run(
    config: TrainConfig,
    overwrite: bool = False,
    console: Console | None = None,
    verbose: bool = False,
) -> PlannedRun:
    """`train --dry-run`: the run's checks and its plan, made and printed as `train` makes them
    (the plan's table under its headline), then stop: no weight or record is read, nothing is
    written."""
    console = console or Console()
    planned = plan_run(config, overwrite, printing_planner(console))
    print_report(planned.plan, None, console, formulas=verbose)
    if planned.fit is not None:
        console.print(
            f"device memory: {planned.fit.line} ({planned.fit.limit_note})", highlight=False
        )
    run_dir.release(planned.directory.path)
    return planned


def _train(
    config, overwrite, console, plan_fn, on_step, stop: StopRequest, verbose: bool = False
) -> TrainResult:
    run = prepare_run(config, overwrite, plan_fn or printing_planner(console))
    config = run.config
    if run.fit is not None:  # the plan against this device (on a GPU: JAX's pool)
        console.print(f"device memory: {run.fit.line} ({run.fit.limit_note})", highlight=False)
    print_data_summary(run, console)
    trainable, opt_state = run.trainable, run.opt_state
    run.step_fn = compile_step(run, trainable, opt_state, console, formulas=verbose)
    run.trainable = run.opt_state = None  # the loop holds the only references from here on
    base_key = jax.random.PRNGKey(config.seed)
    loss = eval_loss = None
    step, stopping = run.start_step, any_process(stop.requested)
    if run.start_step:
        console.print(f"resuming {run.output_dir} at step {run.start_step}")
    if stopping:
        by = stop.signal_number or "on another process"
        console.print(f"stopped by signal {by} during setup; nothing new to save")
    steps = range(run.start_step + 1, config.steps + 1) if not stopping else range(0)
    reporter, pending = Reporter(run, console), StepRecords(run)
    peak_shown = run.plan is None
    with reporter.progress:
        for step in steps:
            step_key = jax.random.fold_in(base_key, step)
            started = time.perf_counter()
            batch, rollouts = next_batch(run, trainable, jax.random.fold_in(step_key, ROLLOUTS))
            sampled = time.perf_counter()
            trainable, opt_state, metrics = run.step_fn(
                trainable, opt_state, run.frozen, batch, step_key
            )
            host = None
            if rollouts is not None:  # the next rollouts wait for this update anyway
                jax.block_until_ready(metrics)
                host = {
                    **rollouts.metrics,
                    ROLLOUT_SECONDS: sampled - started,
                    UPDATE_SECONDS: time.perf_counter() - sampled,
                }
            pending.add(step, metrics, int(batch.input_ids.size), host)
            every = config.grpo.log_completions_every
            if rollouts is not None and every and step % every == 0:
                reporter.sample(step, rollouts)
            if on_step is not None:
                on_step(step, trainable, opt_state, metrics)
            stopping = any_process(stop.requested)
            save_now = step % config.checkpoint.every_steps == 0 or step == config.steps or stopping
            eval_now = bool(config.eval_every) and step % config.eval_every == 0
            if step % config.log_every == 0 or save_now or eval_now:
                records = pending.flush()  # checked before any checkpoint holds these steps
                loss = records[-1]["loss"]
                reporter.write(records)
                if not peak_shown:  # on a GPU: the device's peak after the first steps
                    stats = device_memory.local_memory_stats()
                    line = device_memory.peak_line(run.plan.device_bytes, stats, step)
                    if line is not None:
                        console.print(line, highlight=False)
                    peak_shown = True
            if eval_now:
                eval_loss = evaluate(run, trainable)
                reporter.write([{"step": step, "eval_loss": eval_loss}])
            if save_now:
                save(run, step, trainable, opt_state)
            if stopping:
                by = stop.signal_number or "on another process"
                console.print(f"stopped by signal {by} after step {step}; checkpoint saved")
                break
    stopping = stopping or any_process(stop.requested)  # a signal during the last save
    if not stopping and not (config.eval_every and config.steps % config.eval_every == 0):
        eval_loss = evaluate(run, trainable)
        if eval_loss is not None:
            reporter.write([{"step": config.steps, "eval_loss": eval_loss}], show=False)
    run.checkpointer.close()
    reporter.close(run.output_dir)
    run_dir.release(run.output_dir)
    return TrainResult(
        run.output_dir, step, loss, eval_loss, stop.signal_number, trainable, run.frozen, run
    )
