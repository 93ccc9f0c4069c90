"""What every benchmark does with its report: print it, and write it to `--out` when given."""

from __future__ import annotations

from pathlib import Path


def emit(lines: list[str], out: str | None) -> None:
    """Print the Markdown report; with `out`, also write it there (benchmarks/results/...)."""
    text = "\n".join(lines)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
