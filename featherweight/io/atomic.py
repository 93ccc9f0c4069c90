"""Atomic writes: an output appears under its final name complete, or not at all.

A directory is written into a hidden temporary sibling (same filesystem), fsynced, and renamed into
place; a crash leaves only the temporary, which the next write removes. A replaced directory is
moved aside first and deleted only after the new one is in place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from featherweight.errors import OutputExistsError, OutputNotWritableError

TEMP_PREFIX = ".fw-tmp-"


def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with open(os.path.join(root, name), "rb") as handle:
                os.fsync(handle.fileno())
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def check_output_dir(out: Path, overwrite: bool) -> Path:
    """Refuse an existing output without `overwrite`, or a parent that cannot be written."""
    out = Path(out).expanduser().resolve()
    if out.exists() and not overwrite:
        raise OutputExistsError(
            f"output directory {out} already exists; choose another path or pass --overwrite"
        )
    parent = out.parent
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK):
        raise OutputNotWritableError(f"cannot write under {parent} (read-only or no permission)")
    return out


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` when the block finishes without error."""
    out = check_output_dir(out, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f"{TEMP_PREFIX}{out.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    temporary = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        yield temporary
        _fsync_tree(temporary)
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-old-", dir=out.parent))
            os.replace(out, aside / "old")
            os.replace(temporary, out)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(temporary, out)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file via a temporary file and `os.replace`."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
