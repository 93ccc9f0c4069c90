"""Loggers besides metrics.jsonl, chosen with `report_to`: TensorBoard and Weights & Biases.

- `tensorboard`: event files in `RUN/tensorboard`, written by tensorboardX (`tensorboard --logdir
  RUN/tensorboard` shows them). A resumed run purges the events past its restored step, so the
  curves show each step once.
- `wandb`: a W&B run in `RUN/wandb`, offline unless `WANDB_MODE` says otherwise (no network is
  needed; `wandb sync RUN/wandb/offline-run-*` uploads it later). Needs `pip install wandb`.

Each logger gets the same records the metrics file gets; scalars are logged under `train/` and
`eval/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from featherweight.errors import ConfigError
from featherweight.train.run_dir import TENSORBOARD_DIR, WANDB_DIR

_PACKAGES = {"tensorboard": "tensorboardX", "wandb": "wandb"}
_EVAL_KEYS = ("eval_loss",)


class Logger(Protocol):
    def log(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def check_loggers(report_to: Sequence[str]) -> None:
    """Refuse, before any work, a logger whose package is not installed."""
    for name in report_to:
        package = _PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"report_to: {name} needs the {package} package, which is not installed; "
                f"pip install {package}, or remove {name} from report_to"
            )


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The record's finite numbers as logger tags (train/loss, eval/loss, ...)."""
    tags = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if not math.isfinite(value):
            continue
        tag = f"eval/{key.removeprefix('eval_')}" if key in _EVAL_KEYS else f"train/{key}"
        tags[tag] = float(value)
    return tags


class TensorBoardLogger:
    def __init__(self, output_dir: Path, start_step: int) -> None:
        from tensorboardX import SummaryWriter

        purge = start_step + 1 if start_step else None  # drop the old run's later steps
        self.writer = SummaryWriter(logdir=str(output_dir / TENSORBOARD_DIR), purge_step=purge)

    def log(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.flush()
        self.writer.close()


class WandbLogger:
    def __init__(self, output_dir: Path, config: dict[str, Any]) -> None:
        import wandb

        directory = output_dir / WANDB_DIR
        directory.mkdir(exist_ok=True)
        self.wandb = wandb
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "featherweight"),
            name=output_dir.name,
            id=hashlib.sha256(str(output_dir).encode()).hexdigest()[:16],  # a resume continues it
            resume="allow",
            dir=str(directory),
            mode=os.environ.get("WANDB_MODE", "offline"),
            config=config,
        )

    def log(self, record: dict[str, Any]) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def open_loggers(
    report_to: Sequence[str], output_dir: Path, start_step: int, config: dict[str, Any]
) -> list[Logger]:
    """The loggers `report_to` names, opened in `output_dir` (call `check_loggers` first)."""
    loggers: list[Logger] = []
    for name in report_to:
        if name == "tensorboard":
            loggers.append(TensorBoardLogger(output_dir, start_step))
        else:
            loggers.append(WandbLogger(output_dir, config))
    return loggers
