"""A run directory's ownership: featherweight removes only what it wrote, and one trainer at a time.

A run directory carries a marker (`.featherweight-run`) written before anything else. Replacing a
run (`--overwrite`, the demo) is allowed only in a directory with that marker, and removes only
the entries a run writes (`RUN_ENTRIES`, atomic-write temporaries); any other entry -- the user's
config file, notes, an export they put there -- makes it refuse, naming that entry, before
anything is removed. A directory without the marker that is not empty is never cleared.

While a trainer works in a directory it holds an exclusive `flock` on the directory itself: a
second trainer on the same `output_dir` gets a clear error instead of deleting a live run. The OS
releases the lock when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from pathlib import Path

from featherweight.errors import OutputExistsError
from featherweight.io.atomic import TEMP_PREFIX, atomic_write_text

MARKER = ".featherweight-run"
CONFIG_FILE = "config.yaml"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"
CHECKPOINT_DIR = "checkpoints"
LOSS_PLOT = "loss.png"
DATA_SUMMARY = "data_summary.json"
TENSORBOARD_DIR = "tensorboard"  # event files (report_to: tensorboard)
WANDB_DIR = "wandb"  # offline runs (report_to: wandb)
COMPLETIONS_FILE = "completions.jsonl"  # GRPO: sample completions (grpo.log_completions_every)
# what a run writes into its directory (the marker included)
RUN_ENTRIES = (
    CONFIG_FILE, RUN_FILE, METRICS_FILE, CHECKPOINT_DIR, LOSS_PLOT, MARKER, DATA_SUMMARY,
    TENSORBOARD_DIR, WANDB_DIR, COMPLETIONS_FILE,
)  # fmt: skip
_TEMPORARY_PREFIXES = (TEMP_PREFIX, ".loss.png.tmp")
_held: dict[Path, int] = {}  # directory -> the descriptor holding its lock, in this process


def is_run_entry(name: str) -> bool:
    """Whether a directory entry is one a run writes (or a temporary of one of its writes)."""
    return name in RUN_ENTRIES or name.startswith(_TEMPORARY_PREFIXES)


def foreign_entries(directory: Path) -> list[str]:
    """The entries of `directory` that no run writes, sorted (empty when it does not exist)."""
    if not directory.is_dir():
        return []
    return sorted(entry.name for entry in directory.iterdir() if not is_run_entry(entry.name))


def is_owned(directory: Path) -> bool:
    """Whether `directory` is a run directory featherweight created (it carries the marker)."""
    return (directory / MARKER).is_file()


def check_replaceable(directory: Path) -> None:
    """Refuse to replace `directory` unless featherweight created it and it holds nothing else.

    Nothing is removed here; `clear_run` does that after every other check of the new run passed.
    """
    if not directory.is_dir() or not any(directory.iterdir()):
        return
    if not is_owned(directory):
        first = sorted(entry.name for entry in directory.iterdir())[0]
        raise OutputExistsError(
            f"output_dir {directory} was not created by featherweight (it holds {first!r} and no "
            f"{MARKER} marker); featherweight replaces only its own runs -- choose a new or empty "
            "output_dir"
        )
    foreign = foreign_entries(directory)
    if foreign:
        raise OutputExistsError(
            f"output_dir {directory} holds {foreign[0]!r}, which featherweight did not write"
            + (f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else "")
            + "; --overwrite removes only a run's own files -- move it out, or choose a new "
            "output_dir"
        )


def acquire(directory: Path) -> None:
    """Hold an exclusive lock on `directory` for the rest of this process (or until `release`).

    Raises `OutputExistsError` when another process holds it. Re-acquiring in the same process is
    a no-op.
    """
    directory = directory.resolve()
    if directory in _held:
        return
    descriptor = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(descriptor)
        raise OutputExistsError(
            f"output_dir {directory} is in use by another featherweight process; wait for it to "
            "finish (or stop it), or choose another output_dir"
        ) from None
    _held[directory] = descriptor


def release(directory: Path) -> None:
    """Give up the lock `acquire` took (no-op when this process holds none)."""
    descriptor = _held.pop(directory.resolve(), None)
    if descriptor is not None:
        with contextlib.suppress(OSError):
            fcntl.flock(descriptor, fcntl.LOCK_UN)
        os.close(descriptor)


def clear_run(directory: Path) -> None:
    """Remove the entries a run wrote in `directory` (checked by `check_replaceable` first)."""
    check_replaceable(directory)
    for entry in sorted(directory.iterdir()) if directory.is_dir() else []:
        if entry.name == MARKER or not is_run_entry(entry.name):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def claim(directory: Path) -> None:
    """Create `directory` if needed, lock it, and mark it as a featherweight run directory.

    Refuses a non-empty directory without the marker (someone else's files live there).
    """
    existed = directory.is_dir() and any(directory.iterdir())
    if existed and not is_owned(directory):
        check_replaceable(directory)  # raises, naming what is there
    directory.mkdir(parents=True, exist_ok=True)
    acquire(directory)
    if not is_owned(directory):
        atomic_write_text(directory / MARKER, json.dumps({"featherweight_run": 1}) + "\n")
