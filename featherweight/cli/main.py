"""`featherweight` command line: thin commands over the library functions.

The app is assembled here from the command modules (which know nothing of it), so running this
module as `__main__` or importing it builds the same app. Any `FeatherweightError` becomes one
line on stderr and exit code 2 (`featherweight.cli.output.friendly_errors`).
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Annotated

import typer

from featherweight.cli.chat_commands import chat
from featherweight.cli.model_commands import convert, generate, setup
from featherweight.cli.output import OneLineErrors, set_debug
from featherweight.cli.plan_commands import plan
from featherweight.cli.train_commands import demo, export, train

app = typer.Typer(
    cls=OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    help="Fine-tune LLMs in JAX inside a memory budget: LoRA, QLoRA and full fine-tuning.",
)
for command in (setup, generate, chat, convert, plan, train, demo, export):
    app.command()(command)


def _print_version(wanted: bool) -> None:
    if wanted:
        typer.echo(f"featherweight {version('featherweight')}")
        raise typer.Exit()


@app.callback()
def options(
    debug: Annotated[
        bool, typer.Option("--debug", help="show the traceback of an unexpected error")
    ] = False,
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    """Fine-tune LLMs in JAX inside a memory budget: LoRA, QLoRA and full fine-tuning."""
    set_debug(debug)


def main() -> None:
    app(prog_name="featherweight")


if __name__ == "__main__":
    main()
