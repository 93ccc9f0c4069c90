"""Where outputs may go: resolved paths, never over an input, never out of their directory.

Every output path the user gives is resolved (`~`, `..`, symlinks) before these rules apply, so a
link cannot dodge them:

1. An output never is, or contains, an input: writing (or replacing, with --overwrite) a training
   output_dir, an export's or a conversion's --out must not be able to delete the model, the
   dataset or the run it reads.
2. featherweight writes only inside the directory it was given: an entry of that directory which
   leads elsewhere (a symlink to another place) is refused rather than followed. Link the whole
   directory instead.
3. An export never goes inside a run's `checkpoints/` directory, which orbax manages.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

from featherweight.errors import InputFileError, OutputNotWritableError


def resolved(path: str | Path) -> Path:
    """`path` made absolute, `~`, `..` and symlinks resolved; a link loop is refused by name."""
    try:
        return Path(path).expanduser().resolve()
    except (RuntimeError, OSError) as error:  # Python 3.11 says RuntimeError("Symlink loop ...")
        raise InputFileError(
            f"{path} cannot be resolved ({error}); it leads through a symbolic link loop -- "
            "remove or fix the link"
        ) from None


def inside(path: Path, base: Path) -> bool:
    """Whether (resolved) `path` is `base` or lies under it."""
    return path == base or base in path.parents


def refuse_overlap(out: Path, inputs: Mapping[str, str | Path | None], what: str) -> None:
    """Refuse an output `out` that is, or contains, one of `inputs` ({role: path}; None skipped)."""
    out = resolved(out)
    for role, path in inputs.items():
        if path is None:
            continue
        source = resolved(path)
        if inside(source, out):
            relation = "is" if source == out else "contains"
            raise OutputNotWritableError(
                f"{what} {out} {relation} the {role} {source}; writing there could destroy it -- "
                f"put the {what} somewhere that does not hold the {role}"
            )


def refuse_escape(base: Path, names: Iterable[str], what: str = "output_dir") -> None:
    """Refuse entries `base/name` that lead outside `base` (symlinks to elsewhere)."""
    base = resolved(base)
    for name in names:
        entry = base / name
        if not entry.is_symlink():
            continue
        target = entry.resolve()
        if not inside(target, base):
            raise OutputNotWritableError(
                f"{entry} is a link to {target}, outside the {what} {base}; featherweight writes "
                f"only inside the {what} -- remove the link (or link the whole {what} instead)"
            )


def refuse_inside(out: Path, managed: Path, what: str, owner: str) -> None:
    """Refuse an output `out` inside `managed`, a directory another component owns."""
    out, managed = resolved(out), resolved(managed)
    if inside(out, managed):
        raise OutputNotWritableError(
            f"{what} {out} lies inside {managed}, which {owner}; put the {what} outside it"
        )
