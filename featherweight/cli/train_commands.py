"""`featherweight train | demo | export`: the commands over training runs."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from featherweight.cli.output import (
    console,
    friendly_errors,
    path_text,
    stopped,
    stops_on_signal,
)


def outcome_line(result) -> str:
    """The run's last word: the step reached and its losses, or that there was nothing to train."""
    steps = result.run.config.steps
    if result.step <= result.run.start_step:
        return (
            f"nothing to train: {result.output_dir} is already at step {result.step} of {steps}; "
            "raise steps to train on"
        )
    line = f"done: step {result.step} of {steps}"
    if result.loss is not None:
        line += f", loss {result.loss:.4f}"
    if result.eval_loss is not None:
        line += f", eval loss {result.eval_loss:.4f}"
    return line


@friendly_errors
def train(
    config: Annotated[Path | None, typer.Argument(help="YAML config (omit: all defaults)")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="override, e.g. --set steps=200")
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="replace another run in output_dir")] = False,
    skip_bad: Annotated[
        bool, typer.Option("--skip-bad", help="skip (and count) bad records")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run", help="check the inputs and print the plan, then stop (nothing written)"
        ),
    ] = False,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="the memory table with each row's formula")
    ] = False,
) -> None:
    """Fine-tune as CONFIG says: memory plan first, then training with checkpoints (resumable).

    On several hosts, run it on each with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and
    JAX_PROCESS_ID set (or under srun / mpirun): the processes join one run.
    """
    from featherweight.io.interrupts import EXIT_CODES
    from featherweight.parallel.distributed import initialize_from_env, is_primary
    from featherweight.recipe.schema import load_config
    from featherweight.train.loop import dry_run as plan_only
    from featherweight.train.loop import train as run_training

    initialize_from_env()
    overrides = list(set_ or []) + (["data.skip_bad=true"] if skip_bad else [])
    settings = load_config(config, overrides)
    if dry_run:
        planned = plan_only(settings, overwrite=overwrite, console=console, verbose=verbose)
        console.print(
            f"dry run: stopped after the plan; {planned.directory.path} is as it was "
            "(run the same command without --dry-run to train)",
            highlight=False,
        )
        return
    result = run_training(settings, overwrite=overwrite, console=console, verbose=verbose)
    if result.stopped_by_signal is not None:
        raise typer.Exit(code=EXIT_CODES.get(result.stopped_by_signal, 1))
    if not is_primary():
        return
    out = result.output_dir
    console.print(outcome_line(result), highlight=False)
    console.print(f"metrics: {out / 'metrics.jsonl'}  loss curve: {out / 'loss.png'}")
    if "tensorboard" in settings.report_to:
        console.print(f"tensorboard: tensorboard --logdir {out / 'tensorboard'}")
    console.print(
        f"try it: featherweight generate {out} --prompt '...'  (or featherweight chat {out})"
    )
    console.print("export with:")
    console.print(f"  featherweight export {out} --format merged --out {out / 'merged'}")
    if settings.method != "full":
        console.print(f"  featherweight export {out} --format peft --out {out / 'adapter'}")


@friendly_errors
def demo(
    output_dir: Annotated[
        str, typer.Option(callback=path_text, help="where the demo run goes")
    ] = "runs/demo",
    steps: Annotated[
        int | None, typer.Option(min=1, help="training steps (default: the demo's)")
    ] = None,
) -> None:
    """QLoRA-fine-tune the embedded SmolLM2-135M on a generated task; accuracy before and after."""
    from featherweight.demo.run import run_demo

    run_demo(output_dir, steps, console)


@friendly_errors
def export(
    run: Annotated[str, typer.Argument(help="run directory, or RUN/checkpoints/STEP")],
    format_: Annotated[
        str,
        typer.Option(
            "--format",
            help="merged (HF weights), peft (adapter), gguf (merged, llama.cpp) or gguf-adapter",
        ),
    ],
    out: Annotated[Path, typer.Option(help="output directory")],
    dtype: Annotated[
        str,
        typer.Option(
            help="merged weights dtype: float32 keeps the model as trained; bfloat16 halves the "
            "files and may change answers (checked)"
        ),
    ] = "float32",
    overwrite: bool = False,
    base_model: Annotated[
        str | None,
        typer.Option(help="peft: the base to record, an HF id or directory (default: the run's)"),
    ] = None,
    check: Annotated[
        bool, typer.Option(help="merged: compare greedy outputs with the run in float32")
    ] = True,
    quant: Annotated[
        str,
        typer.Option(
            help="--format gguf: f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, mxfp4 (MoE experts)"
        ),
    ] = "f16",
) -> None:
    """Export a run's checkpoint: merged Hugging Face weights, a PEFT LoRA adapter, or GGUF (the
    merged model, or the adapter for llama-server --lora) with an Ollama Modelfile.

    SIGINT/SIGTERM/SIGHUP stop it (exit 130/143/129) with one line saying what was kept: the
    previous --out is never replaced by a partial export."""
    from featherweight.io.interrupts import StopOnSignal
    from featherweight.train.export_check import merged_output_check, qlora_note
    from featherweight.train.export_run import export_run
    from featherweight.train.saved_run import locate, read_run_config

    with stops_on_signal(out, "export"):
        written = export_run(
            run, format_, out, dtype=dtype, overwrite=overwrite, base_model=base_model, quant=quant
        )
    console.print(f"wrote {written}")
    notes = []
    with StopOnSignal() as stop:
        try:
            if format_ == "peft" and read_run_config(locate(run)[0]).method == "qlora":
                notes.append(qlora_note(written))
            if format_ == "merged" and check:
                notes.append(merged_output_check(run, written, dtype))
        except KeyboardInterrupt:
            stopped(stop, f"the check of the export stopped; {written} itself is complete")
    for note in filter(None, notes):
        console.print(f"[yellow]warning:[/] {note}", highlight=False)
