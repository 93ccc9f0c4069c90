"""Typed exceptions: featherweight's error interface.

Every message names the offending value, what was expected, and what to do about it. The CLI turns
any `FeatherweightError` into a one-line message and exit code 2, before any expensive work starts.
"""

from __future__ import annotations


class FeatherweightError(Exception):
    """Base class of every error featherweight raises on purpose."""


# --- paths and files --------------------------------------------------------------------------


class CheckpointNotFoundError(FeatherweightError, FileNotFoundError):
    """A model path that does not exist, or a directory without the files a checkpoint needs."""


class UnsafeCheckpointError(FeatherweightError):
    """A pickle-based checkpoint (.bin/.pt/.pth/.ckpt): featherweight never unpickles."""


class CorruptCheckpointError(FeatherweightError):
    """A safetensors or GGUF file, or a run's checkpoint or config, that is truncated or damaged."""


class OutputExistsError(FeatherweightError, FileExistsError):
    """An output directory that already exists and was not allowed to be replaced."""


class OutputNotWritableError(FeatherweightError, PermissionError):
    """An output location that cannot be written: read-only, escaping its directory, or holding
    an input (model, dataset, run) that writing it would destroy."""


class DiskFullError(FeatherweightError, OSError):
    """The disk filled up while a checkpoint, an export or the metrics log was written; what
    existed before is intact."""


# --- models -----------------------------------------------------------------------------------


class UnsupportedModelError(FeatherweightError):
    """A model type, architecture, attention variant or tensor encoding featherweight cannot run."""


class ModelConfigError(FeatherweightError):
    """A model config that lacks required fields or holds impossible values."""


class TensorMismatchError(FeatherweightError):
    """Base for tensors that do not match the model config."""


class MissingTensorError(TensorMismatchError):
    """A tensor the config requires is absent from the checkpoint."""


class UnexpectedTensorError(TensorMismatchError):
    """The checkpoint holds a tensor the config does not explain."""


class TensorShapeError(TensorMismatchError):
    """A tensor whose shape differs from what the config implies."""


class TokenIdError(FeatherweightError, ValueError):
    """Token ids that are not integers or fall outside the vocabulary."""


# --- settings ---------------------------------------------------------------------------------


class ConfigError(FeatherweightError, ValueError):
    """A user setting (CLI flag, YAML key, function argument) with an invalid value."""


class AdapterConfigError(ConfigError):
    """LoRA settings that cannot apply to this model (target names, rank, alpha)."""


class QuantizationError(FeatherweightError, ValueError):
    """A tensor that cannot be quantized as asked (e.g. size not divisible by the block size)."""


class StepConfigError(ConfigError):
    """A train-step setting that cannot work (optimizer, policy, clipping or accumulation)."""


class BudgetError(FeatherweightError):
    """No setting fits the stated memory budget."""


class ExportError(FeatherweightError):
    """An export that cannot be made from what was given (e.g. PEFT format of a full fine-tune)."""


class DataError(FeatherweightError, ValueError):
    """A dataset that is missing, empty or has malformed records (file and line are named)."""


class ShardingError(ConfigError):
    """A mesh or partitioning that cannot work on the devices or shapes at hand."""


class ModelChangedError(FeatherweightError):
    """The base model a run (or its checkpoint) was trained on is no longer the one at its path."""


class TrainingDivergedError(FeatherweightError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""
