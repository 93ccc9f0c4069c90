"""`featherweight chat`: talk to a model or a training run's latest checkpoint, turn by turn."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Annotated

import typer

from featherweight.cli.model_commands import model_or_demo
from featherweight.cli.output import console, error_console, friendly_errors, not_utf8

EXIT_WORDS = ("/exit", "/quit")


def _user_messages() -> Iterator[str]:
    """Lines typed at the prompt until end of input or /exit. A line that is not UTF-8 text is
    named and skipped: the session goes on. (stdin keeps such bytes as lone surrogates, so a bad
    byte cannot raise inside the decoder and lose the lines read ahead with it.)"""
    reconfigure = getattr(sys.stdin, "reconfigure", None)
    if reconfigure is not None:
        reconfigure(errors="surrogateescape")
    while True:
        try:
            line = console.input("[bold]you>[/] ")
        except EOFError:
            return
        problem = not_utf8(line)
        if problem is not None:
            error_console.print(f"skipped that line: {problem}", highlight=False)
            continue
        if line.strip() in EXIT_WORDS:
            return
        if line.strip():
            yield line


@friendly_errors
def chat(
    model: Annotated[
        str | None,
        typer.Argument(
            help="a training run's directory, HF directory, .gguf, Hub name, or demo (the default)"
        ),
    ] = None,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 128,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    seed: int = 0,
) -> None:
    """Chat through the chat template (the run's data.chat_template when it set one); /exit ends."""
    from featherweight.io.loader import load_model
    from featherweight.train.run_model import chat_replies, load_run_model
    from featherweight.train.saved_run import is_run_dir

    if model is not None and is_run_dir(model):
        loaded, step = load_run_model(model)
        console.print(f"[dim]run {model}, checkpoint {step}; /exit ends[/]")
    else:
        loaded = load_model(model_or_demo(model))
        console.print(f"[dim]model: {loaded.source}; /exit ends[/]")
    for reply in chat_replies(loaded, _user_messages(), max_new_tokens, temperature, seed):
        console.print(f"[bold]model>[/] {reply}", highlight=False)
