"""A run already on disk: where its checkpoint is, the settings it recorded, its base model, and
the trained arrays of one checkpoint -- what `export`, `generate RUN` and `chat RUN` read.

Everything here only reads: the run's config.yaml (its resolved settings), run.json (the base
model's path, commit and fingerprint) and one checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import jax
import yaml

from featherweight.errors import CheckpointNotFoundError, CorruptCheckpointError
from featherweight.io.output_paths import resolved
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.recipe.build import abstract_split, opt_state_initializer
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.schema import TrainConfig
from featherweight.train.checkpoint import Checkpointer
from featherweight.train.run import check_same_model, resolve_model_path
from featherweight.train.run_dir import CHECKPOINT_DIR, CONFIG_FILE

EVERY_CHECKPOINT = 1_000_000  # `keep` for a read-only checkpointer: it removes nothing anyway


def is_run_dir(path: str | Path) -> bool:
    """Whether `path` is a training run's directory (or one of its checkpoints)."""
    path = Path(path).expanduser()
    return (path / CONFIG_FILE).is_file() or (
        path.parent.name == CHECKPOINT_DIR and (path.parent.parent / CONFIG_FILE).is_file()
    )


def locate(run_or_checkpoint: str | Path) -> tuple[Path, int]:
    """(run directory, checkpoint step) for a run dir (its latest checkpoint) or a checkpoint dir
    inside one."""
    path = resolved(run_or_checkpoint)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{path} does not exist; pass a run directory (train's output_dir)"
        )
    if path.parent.name == CHECKPOINT_DIR and path.name.isdigit():
        return path.parent.parent, int(path.name)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointNotFoundError(
            f"{path} is not a featherweight run (no {CONFIG_FILE}); pass train's output_dir or "
            f"one of its {CHECKPOINT_DIR}/STEP directories"
        )
    checkpoints = Checkpointer(path / CHECKPOINT_DIR, keep=EVERY_CHECKPOINT, read_only=True)
    steps = checkpoints.all_steps()
    if not steps:
        raise CheckpointNotFoundError(
            f"run {path} has no checkpoint yet; train at least until the first save"
        )
    return path, max(steps)


def read_run_config(run_dir: Path) -> TrainConfig:
    """The settings a run was trained with (its config.yaml: resolved, no "auto" left)."""
    path = run_dir / CONFIG_FILE
    try:
        return TrainConfig.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        raise CorruptCheckpointError(
            f"{path} cannot be read ({type(error).__name__}); the run's record of its settings is "
            "damaged -- restore it from the YAML config the run was trained with"
        ) from None


def base_model_path(run_dir: Path, config: TrainConfig) -> Path:
    """Where the run's base model is on this disk (a Hub name: the commit it trained on), refused
    when it is not the model the run trained on."""
    model_path = resolve_model_path(config, run_dir)
    check_same_model(run_dir, model_path)
    return model_path


def restore_trainable(
    run_dir: Path, step: int, config: TrainConfig, model_config: ModelConfig
) -> Params:
    """The trainable arrays of checkpoint `step` (the optimizer state is read and dropped)."""
    abstract_trainable, _ = abstract_split(config, model_config)
    optimizer = make_optimizer(config.optimizer, config.steps)
    abstract_state = jax.eval_shape(opt_state_initializer(config, optimizer), abstract_trainable)
    checkpoints = Checkpointer(run_dir / CHECKPOINT_DIR, keep=EVERY_CHECKPOINT, read_only=True)
    (trainable, _), _ = checkpoints.restore(step, (abstract_trainable, abstract_state))
    return trainable
