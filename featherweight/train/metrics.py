"""Training metrics: one JSON line per step in metrics.jsonl, and the loss-curve PNG.

metrics.jsonl is strict JSON (RFC 8259): a non-finite number is written as null, never as the
`NaN` / `Infinity` tokens Python's json module emits by default and other readers refuse. A
resumed run writes `{"step": S, "resumed": true}` where it picked up, which the plot marks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path
from typing import Any

from featherweight.io.atomic import atomic_write_text, write_failure


class MetricsLog:
    """Append-only `metrics.jsonl`; on resume, lines past the restored step are dropped first
    (they belong to steps that will be run again)."""

    def __init__(self, path: Path, resume_step: int) -> None:
        self.path = path
        if path.exists():
            kept = [
                line
                for line in path.read_text().splitlines()
                if line and _step_of(line) <= resume_step
            ]
            atomic_write_text(path, "".join(line + "\n" for line in kept))
        self._handle = open(path, "a")  # noqa: SIM115 (closed by close())

    def write(self, record: dict[str, Any]) -> None:
        with self._typed_failures():
            self._handle.write(json.dumps(strict(record), allow_nan=False) + "\n")
            self._handle.flush()

    def close(self) -> None:
        try:
            with self._typed_failures():
                self._handle.flush()
                os.fsync(self._handle.fileno())
        finally:
            with contextlib.suppress(OSError):  # the failure is reported above
                self._handle.close()

    @contextlib.contextmanager
    def _typed_failures(self):
        """A full disk or a lost permission while writing: the typed error naming what is intact."""
        try:
            yield
        except OSError as error:
            kept = "the checkpoints are intact and the run resumes from the latest one"
            typed = write_failure(error, str(self.path), kept)
            if typed is None:
                raise
            raise typed from None


def strict(record: dict[str, Any]) -> dict[str, Any]:
    """`record` with every non-finite float as None (JSON null)."""
    return {
        key: None if isinstance(value, float) and not math.isfinite(value) else value
        for key, value in record.items()
    }


def smoothed(values: list[float], window: int | None = None) -> list[float]:
    """The trend of a noisy curve without lag: a centred moving average, `window` points wide
    (odd; None: about a fifteenth of the run, at least 3), narrowed symmetrically near the ends
    so every point stays centred on its step. An exponential average (TensorBoard's) trails a
    falling loss by ~1/(1 - weight) steps, drawing it above the raw points for most of a short
    run; a centred one follows a straight trend exactly."""
    count = len(values)
    if window is None:
        window = max(3, count // 15)
    half = max(0, window // 2)
    out = []
    for index in range(count):
        reach = min(half, index, count - 1 - index)
        span = values[index - reach : index + reach + 1]
        out.append(sum(span) / len(span))
    return out


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def loss_figure(records: list[dict[str, Any]]):
    """The loss plot of `records` (metrics.jsonl): train loss per step (raw, and smoothed), eval
    loss where measured, resume marks, the learning rate on a second axis (from zero), and for a
    preference or GRPO run its rewards in a panel below. Steps are whole
    numbers, so the step axis has whole-number ticks only (a 3-step run has no step 1.5)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
    rates = [(r["step"], r["learning_rate"]) for r in records if "learning_rate" in r]
    resumes = [r["step"] for r in records if r.get("resumed")]
    rewards = [r for r in records if "rewards/accuracies" in r]
    sampled = [r for r in records if r.get("reward") is not None]
    if rewards or sampled:  # a preference or GRPO run: its rewards below the loss
        figure, (axes, reward_axes) = plt.subplots(2, 1, figsize=(8, 7), sharex=True)
        if rewards:
            _plot_rewards(reward_axes, rewards)
        else:
            _plot_sampled_rewards(reward_axes, sampled)
    else:
        figure, axes = plt.subplots(figsize=(8, 4.5))
    if train:
        steps, losses = zip(*train, strict=True)
        axes.plot(steps, losses, color="tab:blue", alpha=0.3, label="train loss")
        axes.plot(steps, smoothed(list(losses)), color="tab:blue", label="train loss (smoothed)")
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", color="tab:orange", label="eval loss")
    for number, step in enumerate(resumes):
        axes.axvline(step, color="gray", linestyle="--", label="resumed" if number == 0 else None)
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.set_ylabel("preference loss" if rewards else "GRPO loss" if sampled else "cross-entropy")
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if rates:
        rate_axes = axes.twinx()
        rate_axes.plot(*zip(*rates, strict=True), color="tab:green", linewidth=1, label="lr")
        rate_axes.set_ylabel("learning rate")
        # from zero: warmup and decay read as shares of the peak, and a constant rate is a flat
        # line at its value (not one across an axis of 0.0019 to 0.0021)
        rate_axes.set_ylim(0, 1.1 * max(rate for _, rate in rates) or 1.0)
        more_handles, more_labels = rate_axes.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    if handles:
        axes.legend(handles, labels, loc="upper right")
    figure.tight_layout()
    return figure


def _plot_rewards(axes, records: list[dict[str, Any]]) -> None:
    """A preference run's rewards (TRL's names): accuracy on the left axis, margin on the right."""
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    accuracies = [r["rewards/accuracies"] for r in records]
    axes.plot(steps, accuracies, color="tab:purple", alpha=0.3)
    axes.plot(steps, smoothed(accuracies), color="tab:purple", label="rewards/accuracies")
    axes.set_ylim(-0.05, 1.05)
    axes.set_ylabel("reward accuracy")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    margin_axes = axes.twinx()
    margin_axes.plot(steps, [r["rewards/margins"] for r in records], color="tab:red", linewidth=1,
                     label="rewards/margins")  # fmt: skip
    margin_axes.set_ylabel("reward margin")
    handles, labels = axes.get_legend_handles_labels()
    more_handles, more_labels = margin_axes.get_legend_handles_labels()
    axes.legend(handles + more_handles, labels + more_labels, loc="lower right")


def _plot_sampled_rewards(axes, records: list[dict[str, Any]]) -> None:
    """A GRPO run's reward (TRL's `reward`: the mean over the step's completions) with its spread
    (`reward_std`) as a band."""
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in records]
    means = [r["reward"] for r in records]
    spread = [r.get("reward_std") or 0.0 for r in records]
    axes.fill_between(steps, [m - d for m, d in zip(means, spread, strict=True)],
                      [m + d for m, d in zip(means, spread, strict=True)], color="tab:purple",
                      alpha=0.12, label="reward_std")  # fmt: skip
    axes.plot(steps, means, color="tab:purple", alpha=0.3)
    axes.plot(steps, smoothed(means), color="tab:purple", label="reward")
    axes.set_ylabel("reward")
    axes.set_xlabel("step")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")


def plot_loss_curve(metrics_path: Path, out_path: Path) -> Path:
    """`loss_figure` of the run's metrics, as a PNG written atomically."""
    import matplotlib.pyplot as plt

    figure = loss_figure(read_metrics(metrics_path))
    temporary = out_path.with_name(f".{out_path.name}.tmp.png")
    try:
        figure.savefig(temporary, dpi=110)
        os.replace(temporary, out_path)
    except OSError as error:  # a full disk: the run itself is saved; say so
        temporary.unlink(missing_ok=True)
        kept = "the run's checkpoints and metrics.jsonl are intact, only the plot is missing"
        typed = write_failure(error, f"the loss plot {out_path}", kept)
        if typed is None:
            raise
        raise typed from None
    finally:
        plt.close(figure)
    return out_path
