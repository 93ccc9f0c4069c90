"""Atomic writes: an output appears under its final name complete, or not at all.

A directory is written into a hidden temporary sibling (same filesystem), fsynced, and renamed into
place; a crash leaves only the temporary, which the next write removes. A replaced directory is
moved aside first and deleted only after the new one is in place (a crash between the two renames
is undone by the next write, which puts the previous directory back; SIGINT and SIGTERM under
`io/interrupts.py`'s handler are held back until both are done).

A write that fails for lack of space or permission becomes a typed error that says what was being
written and what is intact (`write_failure`); the partial temporary is removed first, so the space
it took is free again. Where an output may go at all is checked up front by `check_output_dir`
with a real write probe (it sees read-only mounts, permissions and quotas as the writer will).

Every directory written here carries a marker (`OUTPUT_MARKER`). `overwrite` replaces only a
directory with that marker (or an empty one): a directory of the user's that holds anything else,
or a file, is refused naming what it holds -- featherweight deletes only what it wrote.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from featherweight.errors import (
    DiskFullError,
    FeatherweightError,
    OutputExistsError,
    OutputNotWritableError,
)
from featherweight.io.interrupts import deferred
from featherweight.io.output_paths import resolved

TEMP_PREFIX = ".fw-tmp-"
OUTPUT_MARKER = ".featherweight-output"  # in every directory `atomic_directory` writes
DISK_FULL_CODES = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE_CODES = (errno.EROFS, errno.EACCES, errno.EPERM)
# native writers put the OS error code in their messages: safetensors (Rust) "(os error 28)",
# tensorstore (orbax) "[os_error_code='28']", Python "[Errno 28]"
_CODE_IN_MESSAGE = re.compile(r"(?:\[Errno |os error |os_error_code=')(\d+)")


def _error_code(error: BaseException) -> int | None:
    if isinstance(error, OSError) and error.errno is not None:
        return error.errno
    match = _CODE_IN_MESSAGE.search(str(error))
    return int(match.group(1)) if match else None


def write_failure(error: BaseException, writing: str, kept: str) -> FeatherweightError | None:
    """The typed error for a write that failed because the disk is full or not writable, else None.

    `writing` names what was being written ("checkpoint 4 in runs/a/checkpoints"), `kept` what
    became of the partial write and what is intact.
    """
    if isinstance(error, FeatherweightError):
        return None  # already says what happened (e.g. a source file that cannot be read)
    code = _error_code(error)
    if code in DISK_FULL_CODES:
        return DiskFullError(
            f"no space left on the device while writing {writing} ({os.strerror(code)}); {kept}. "
            "Free space on that disk (or choose another location) and run the same command again"
        )
    if code in NOT_WRITABLE_CODES:
        return OutputNotWritableError(
            f"cannot write {writing} ({os.strerror(code)}); {kept}. Make the location writable "
            "(or choose another) and run the same command again"
        )
    return None


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


def probe_writable(location: Path, what: str = "output directory") -> None:
    """Refuse `location` unless a file can be created in it (or its nearest existing parent)."""
    parent = Path(location)
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():  # e.g. an output "inside" the dataset or the .gguf it reads
        raise OutputNotWritableError(
            f"cannot write under {parent}: it is a file, not a directory, so the {what} "
            f"{location} cannot go inside it; choose a {what} outside that file"
        )
    try:
        descriptor, probe = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}probe-", dir=parent)
        os.close(descriptor)
        os.unlink(probe)
    except OSError as error:
        raise OutputNotWritableError(
            f"cannot write under {parent} ({error.strerror or error}); choose a writable {what}"
        ) from None


def check_output_dir(out: Path, overwrite: bool) -> Path:
    """Refuse an existing output without `overwrite`, or a location that cannot be written.
    Without `overwrite`, --overwrite is offered only where it would be allowed (a file, or a
    directory of the user's, is named instead). With `overwrite`, what may be replaced is
    `refuse_foreign_output`'s to say: callers check it after their more specific checks, and
    `atomic_directory` before it writes."""
    out = resolved(out)
    if out.exists() and not overwrite:
        refuse_foreign_output(out)
        raise OutputExistsError(
            f"output directory {out} already exists; choose another path or pass --overwrite to "
            "replace it"
        )
    probe_writable(out.parent)
    return out


def refuse_foreign_output(out: Path) -> None:
    """`--overwrite` replaces only an output featherweight wrote (it carries `OUTPUT_MARKER`) or
    an empty directory; a file, or a directory holding anything else, is the user's."""
    out = resolved(out)
    if not out.exists() and not out.is_symlink():
        return
    if not out.is_dir():
        raise OutputExistsError(
            f"{out} is a file, not an output directory featherweight wrote; featherweight never "
            "replaces a file -- choose another path for the output directory"
        )
    if (out / OUTPUT_MARKER).is_file():
        return
    entries = sorted(entry.name for entry in out.iterdir())
    if entries:
        raise OutputExistsError(
            f"{out} holds {entries[0]!r}, which featherweight did not write (no {OUTPUT_MARKER} "
            "marker); featherweight replaces only its own outputs -- choose a new or empty "
            "directory, or remove it yourself"
        )


def _undo_interrupted_replace(out: Path) -> None:
    """Put back a previous `out` that a replacement moved aside but was killed before renaming the
    new one into place."""
    if out.exists() or not out.parent.is_dir():
        return
    for aside in out.parent.glob(f"{TEMP_PREFIX}{out.name}-old-*"):
        if (aside / "old").exists():
            os.replace(aside / "old", out)
            return


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(tree: Path) -> None:
    """Give `tree` and everything in it the modes a plain write would (0666/0777 minus the
    umask): temporary files and directories start private (0600/0700), outputs should not."""
    mask = current_umask()
    for path in [tree, *tree.rglob("*")]:
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


@contextlib.contextmanager
def atomic_directory(out: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory that becomes `out` when the block finishes without error."""
    _undo_interrupted_replace(resolved(out))
    out = check_output_dir(out, overwrite)
    refuse_foreign_output(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for stale in out.parent.glob(f"{TEMP_PREFIX}{out.name}-*"):
        shutil.rmtree(stale, ignore_errors=True)
    temporary = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-", dir=out.parent))
    try:
        yield temporary
        (temporary / OUTPUT_MARKER).write_text(
            "written by featherweight; --overwrite may replace it\n"
        )
        follow_umask(temporary)
        _fsync_tree(temporary)
        with deferred():  # a signal now is recorded, not raised: the output is whole or absent
            if out.exists():
                aside = Path(
                    tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{out.name}-old-", dir=out.parent)
                )
                os.replace(out, aside / "old")
                os.replace(temporary, out)
                shutil.rmtree(aside, ignore_errors=True)
            else:
                os.replace(temporary, out)
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        kept = "the partial copy was removed; " + (
            f"the previous {out} is intact" if out.exists() else f"nothing was written to {out}"
        )
        typed = write_failure(error, str(out), kept)
        if typed is not None:
            raise typed from None
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write a small text file via a temporary file and `os.replace`."""
    path = Path(path)
    descriptor, temporary = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        os.fchmod(descriptor, 0o666 & ~current_umask())  # mkstemp's 0600 is for secrets
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
