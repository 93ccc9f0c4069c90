"""Typed exceptions: featherweight's error interface.

Every message names the offending value, what was expected, and what to do about it. The CLI turns
any `FeatherweightError` into a one-line message and exit code 2, before any expensive work starts.
At the end, the two checks every reader of an input file goes through (`check_input_file`,
`read_input_text`), so a FIFO, a link loop, a file without read permission or bytes that are not
UTF-8 are named as what they are, with the path, instead of surfacing as an OS exception.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class FeatherweightError(Exception):
    """Base class of every error featherweight raises on purpose."""


# --- paths and files --------------------------------------------------------------------------


class InputFileError(FeatherweightError, OSError):
    """An input path that cannot be read as a file: no permission, not UTF-8 text, a symbolic
    link loop, a FIFO or device where a regular file is expected, a file where a directory is."""


class CheckpointNotFoundError(FeatherweightError, FileNotFoundError):
    """A model path that does not exist, or a directory without the files a checkpoint needs."""


class HubModelError(FeatherweightError):
    """A model named on the Hugging Face Hub (`org/name`) that cannot be had: gated, missing,
    refused, or not in the local Hub cache while offline."""


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


class RewardFunctionError(FeatherweightError):
    """A GRPO reward function that cannot be loaded, raises, or returns the wrong number of
    rewards (the function is named)."""


class TrainingDivergedError(FeatherweightError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


# --- reading input files ----------------------------------------------------------------------


def input_file_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a regular file, in words; None when it can. Asked before
    opening: opening a FIFO would block until someone writes to it."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if os.path.islink(path) else "does not exist"
    except OSError as error:
        if error.errno == errno.ELOOP:
            return "is a symbolic link loop"
        if error.errno == errno.ENOTDIR:
            return "does not exist (a part of the path is a file, not a directory)"
        return f"cannot be read ({error.strerror})"
    if stat.S_ISDIR(mode):
        return "is a directory"
    if stat.S_ISFIFO(mode):
        return "is a FIFO (named pipe), not a regular file"
    if not stat.S_ISREG(mode):
        return "is a device or socket, not a regular file"
    return None


def check_input_file(
    path: str | Path, what: str, fix: str, missing: type[FeatherweightError]
) -> Path:
    """`path` when it is a regular file. A missing path or a directory raises `missing` (the
    caller's type: a config, a dataset, a model); a FIFO, a device or a link loop `InputFileError`."""
    problem = input_file_problem(path)
    if problem is None:
        return Path(path)
    expected = problem.startswith("does not exist") or problem == "is a directory"
    raise (missing if expected else InputFileError)(f"{what} {path} {problem}; {fix}")


def read_input_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of the input file `path`; an unreadable file or bytes that are not UTF-8
    raise `InputFileError` naming `what`, the path and the fix."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputFileError(
            f"{what} {path} is not UTF-8 text ({error.reason} at byte {error.start}); save it "
            "as UTF-8"
        ) from None
    except OSError as error:
        raise InputFileError(
            f"{what} {path} cannot be read ({error.strerror or error}); check that it is a file "
            "you may read"
        ) from None
