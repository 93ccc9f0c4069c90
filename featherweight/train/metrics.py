"""Training metrics: one JSON line per step in metrics.jsonl, and the loss-curve PNG."""

from __future__ import annotations

import contextlib
import json
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
        try:
            self._handle.write(json.dumps(record) + "\n")
            self._handle.flush()
        except OSError as error:
            kept = "the checkpoints are intact and the run resumes from the latest one"
            typed = write_failure(error, str(self.path), kept)
            if typed is None:
                raise
            raise typed from None

    def close(self) -> None:
        try:
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as error:
            kept = "the checkpoints are intact and the run resumes from the latest one"
            typed = write_failure(error, str(self.path), kept)
            if typed is None:
                raise
            raise typed from None
        finally:
            with contextlib.suppress(OSError):  # the failure is reported above
                self._handle.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 0))
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        return 1 << 62


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss_curve(metrics_path: Path, out_path: Path) -> Path:
    """Train loss per step (and eval loss where measured) as a PNG, written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in records if "eval_loss" in r]
    figure, axes = plt.subplots(figsize=(7, 4))
    if train:
        axes.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
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
