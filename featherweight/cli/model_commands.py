"""`featherweight setup | generate | convert`: commands over models."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated

import typer

from featherweight.cli.output import (
    console,
    error_console,
    finite,
    friendly_errors,
    positive,
    stops_on_signal,
    utf8_text,
)

DEFAULT_PROMPT = "Write one sentence about why the sky is blue."


DEMO_NAME = "demo"


def model_or_demo(model: str | None) -> str | Path:
    """The model a command names: the embedded demo model for none or the name `demo` (as a
    config's `model.path: demo` means it, unless a path of that name exists), else the path or
    Hub name as given."""
    from featherweight.io.embedded_model import require_demo_model

    if model is None or (model == DEMO_NAME and not Path(model).exists()):
        return require_demo_model()
    return model


@friendly_errors
def setup() -> None:
    """Fetch the embedded demo model (SmolLM2-135M-Instruct GGUF) into the local cache."""
    from featherweight.io.embedded_model import install_demo_model

    path = install_demo_model()
    console.print(f"demo model ready: {path}")


@friendly_errors
def generate(
    model: Annotated[
        str | None,
        typer.Argument(
            help="HF directory, .gguf, Hub name (org/name), a training run's directory, or demo "
            "(the default)"
        ),
    ] = None,
    prompt: Annotated[
        str, typer.Option(callback=utf8_text, help="Text to continue or answer (UTF-8).")
    ] = DEFAULT_PROMPT,
    max_new_tokens: Annotated[int, typer.Option(min=1)] = 48,
    temperature: Annotated[float, typer.Option(min=0.0, callback=finite, help="0 = greedy.")] = 0.0,
    seed: Annotated[int, typer.Option(min=0, max=2**32 - 1)] = 0,
    dtype: Annotated[
        str | None, typer.Option(help="float32 or bfloat16 (default: the model's, or the run's)")
    ] = None,
    chat: Annotated[
        bool | None, typer.Option(help="Use the chat template (default: if any)")
    ] = None,
) -> None:
    """Generate text with a KV cache (greedy by default), via the chat template when present.

    A run directory generates with its latest checkpoint (base + adapters, no export needed).
    The reply alone goes to stdout, for scripts; the model and the time to stderr."""
    from featherweight.inference.generate import generate as generate_text
    from featherweight.io.loader import load_model
    from featherweight.train.run_model import load_run_model
    from featherweight.train.saved_run import is_run_dir

    if model is not None and is_run_dir(model):
        loaded, _ = load_run_model(model, dtype=dtype)
    else:
        loaded = load_model(model_or_demo(model), dtype=dtype)
    error_console.print(
        f"[dim]model: {loaded.source} ({loaded.config.num_layers} layers, {loaded.dtype.name})[/]",
        highlight=False,
    )
    start = time.perf_counter()
    reply = generate_text(loaded, prompt, max_new_tokens, temperature, seed, chat)
    seconds = time.perf_counter() - start
    typer.echo(reply)  # stdout holds the reply alone: `reply=$(featherweight generate ...)`
    error_console.print(f"[dim]{seconds:.1f} s including compilation[/]")


def shard_gib(value: float | None) -> float | None:
    """A shard size in GiB: positive, and a whole number of bytes (1e308 GiB is not)."""
    value = positive(value)
    if value is not None and not math.isfinite(value * 1024**3):
        raise typer.BadParameter(
            f"{value} GiB is too large for a shard; give e.g. 2 (GiB per file)"
        )
    return value


@friendly_errors
def convert(
    source: Annotated[
        str, typer.Argument(help="GGUF file, HF directory, Hub name (org/name) or demo")
    ],
    out: Annotated[Path, typer.Option(help="Output directory")],
    dtype: Annotated[str | None, typer.Option(help="cast tensors, e.g. bfloat16")] = None,
    overwrite: bool = False,
    max_shard_gib: Annotated[
        float, typer.Option(callback=shard_gib, help="shard size in GiB")
    ] = 2.0,
    to: Annotated[str, typer.Option(help="hf (transformers) or gguf (llama.cpp, Ollama)")] = "hf",
    quant: Annotated[
        str,
        typer.Option(
            help="GGUF type: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, mxfp4 (MoE experts)"
        ),
    ] = "f16",
) -> None:
    """Convert a checkpoint into a Hugging Face directory that transformers loads, or (--to gguf)
    a GGUF file llama.cpp runs with an Ollama Modelfile beside it. SIGINT/SIGTERM/SIGHUP stop it
    (exit 130/143/129); the previous --out is never replaced by a partial conversion."""
    from featherweight.io.convert import convert as convert_checkpoint

    with stops_on_signal(out, "conversion"):
        written = convert_checkpoint(
            model_or_demo(source),
            out,
            dtype=dtype,
            overwrite=overwrite,
            max_shard_bytes=int(max_shard_gib * 1024**3),
            to=to,
            quant=quant,
        )
    console.print(f"wrote {written}")
