"""Progress a user sees in any terminal: a live bar on a TTY, plain lines everywhere else.

Under nohup, CI or `| tee` a live bar prints nothing until the end (rich draws it only on a
terminal), so off a TTY the trainer prints one line per `log_every` steps instead:

    step 20/100 | loss 2.3141 | lr 1.96e-04 | 5,210 tok/s | 0.41 GiB | ETA 0:01:12

and a line of its own after each evaluation (`step 20/100 | eval loss 2.2907`; on the bar, the
last eval loss stays in the status). Both are fed at the loop's host syncs (every `log_every`
steps), never per step.
"""

from __future__ import annotations

import datetime
import time
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

# a GRPO step's wall-clock split (metrics.jsonl, TensorBoard, the progress line): sampling and
# scoring its completions, then the update on them (the step waited for before the next sampling)
ROLLOUT_SECONDS, UPDATE_SECONDS = "time/rollout_seconds", "time/update_seconds"


def status_text(record: dict[str, Any]) -> str:
    """loss (and a preference run's reward accuracy and margin; a GRPO run's mean reward and its
    step's rollout and update seconds), learning rate, throughput and device memory of one
    step's record."""
    parts = [f"loss {record['loss']:.4f}"]
    if "rewards/accuracies" in record:
        parts.append(
            f"reward acc {record['rewards/accuracies']:.2f}, margin {record['rewards/margins']:.3f}"
        )
    if "reward" in record:
        parts.append(f"reward {record['reward']:.3f}")
    if ROLLOUT_SECONDS in record:
        parts.append(
            f"rollout {record[ROLLOUT_SECONDS]:.1f} s + update {record[UPDATE_SECONDS]:.1f} s"
        )
    if record.get("learning_rate") is not None:
        parts.append(f"lr {record['learning_rate']:.2e}")
    parts.append(f"{record['tokens_per_second']:,.0f} tok/s")
    if record.get("device_bytes") is not None:
        parts.append(f"{record['device_bytes'] / 2**30:.2f} GiB")
    return " | ".join(parts)


def eta_text(seconds: float | None) -> str:
    if seconds is None:
        return "ETA -"
    return f"ETA {datetime.timedelta(seconds=round(seconds))}"


def eval_text(step: int, total: int, eval_loss: float) -> str:
    return f"step {step}/{total} | eval loss {eval_loss:.4f}"


class TrainingProgress(Protocol):
    def update(self, step: int, record: dict[str, Any]) -> None: ...

    def evaluated(self, step: int, eval_loss: float) -> None: ...

    def __enter__(self) -> TrainingProgress: ...

    def __exit__(self, *exc: object) -> None: ...


class _Clock:
    """Seconds per step since the loop's first sync, for the ETA."""

    def __init__(self, start_step: int, total: int) -> None:
        self.start_step, self.total = start_step, total
        self.started = time.perf_counter()

    def remaining(self, step: int) -> float | None:
        done = step - self.start_step
        if done <= 0:
            return None
        return (time.perf_counter() - self.started) / done * (self.total - step)


class PlainProgress:
    """One line per update (the loop updates every `log_every` steps): for files and pipes."""

    def __init__(self, console: Console, total: int, start_step: int) -> None:
        self.console, self.total = console, total
        self.clock = _Clock(start_step, total)

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def update(self, step: int, record: dict[str, Any]) -> None:
        line = f"step {step}/{self.total} | {status_text(record)} | "
        self.console.print(line + eta_text(self.clock.remaining(step)), highlight=False)

    def evaluated(self, step: int, eval_loss: float) -> None:
        self.console.print(eval_text(step, self.total, eval_loss), highlight=False)


class BarProgress:
    """rich's live bar (a TTY): step count, status and time remaining."""

    def __init__(self, console: Console, total: int, start_step: int) -> None:
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"), TimeRemainingColumn(), console=console,
        )  # fmt: skip
        self.task = self.progress.add_task("train", total=total, completed=start_step, status="")
        self.total, self.eval_status = total, ""

    def __enter__(self) -> BarProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def update(self, step: int, record: dict[str, Any]) -> None:
        status = status_text(record) + self.eval_status
        self.progress.update(self.task, completed=step, status=status)

    def evaluated(self, step: int, eval_loss: float) -> None:
        self.eval_status = f" | eval loss {eval_loss:.4f} (step {step})"
        self.progress.console.print(eval_text(step, self.total, eval_loss), highlight=False)


def training_progress(console: Console, total: int, start_step: int) -> TrainingProgress:
    """A live bar when `console` is a terminal, plain lines otherwise."""
    kind = BarProgress if console.is_terminal else PlainProgress
    return kind(console, total, start_step)
