"""What the command line prints: the consoles, and the boundary that turns errors into one line."""

from __future__ import annotations

import functools

import typer
from rich.console import Console

from featherweight.errors import FeatherweightError

console = Console()
error_console = Console(stderr=True)


def friendly_errors(command):
    """Turn featherweight's typed errors into a one-line message and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except FeatherweightError as error:
            error_console.print(
                f"[bold red]error:[/] {type(error).__name__}: {error}",
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(code=2) from None

    return wrapper
