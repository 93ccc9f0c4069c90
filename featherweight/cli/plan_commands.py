"""`featherweight plan`: every byte of a train step before compiling, for a model and the plan
options, or for a training config exactly as `train` would build it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, NamedTuple

import typer

from featherweight.cli.output import console, friendly_errors, new_file
from featherweight.models.registry import builtin_names

PLANNED_DEVICES = 4096  # virtual CPU devices plan may ask JAX for (--mesh on a CPU machine)


def chunk_option(value: str) -> int | str | None:
    """A chunk option: auto (chosen from the shapes, as train chooses it), none (whole) or a
    number of tokens or rows (checked by the config)."""
    text = value.strip().lower()
    if text in ("none", "null", "whole"):
        return None
    if text == "auto":
        return "auto"
    if not (text.isascii() and text.isdigit()):  # "²".isdigit() is True, int("²") fails
        raise typer.BadParameter(
            f"{value!r} is not a chunk; give auto (chosen from the shapes), none (whole) or a "
            "whole number, e.g. 512"
        )
    return int(text)


CHUNK_HELP = "; auto: chosen from the shapes (as train does), none: whole"
OBJECTIVE_HELP = (
    "sft, dpo or orpo (a preference pair: two rows, or one packed); grpo: plan its config, which "
    "names its rewards"
)


@friendly_errors
def plan(
    ctx: typer.Context,
    model: Annotated[
        str,
        typer.Argument(
            help="a training config (.yaml: planned as train builds it), or a model: dir with "
            f"config.json, .gguf, a Hub name (org/name) or a built-in name: {builtin_names()}",
            show_default=False,
        ),
    ],
    set_: Annotated[
        list[str] | None,
        typer.Option("--set", help="with a config: override, e.g. --set batch_size=4"),
    ] = None,
    method: Annotated[str, typer.Option(help="full, lora or qlora")] = "qlora",
    objective: Annotated[str, typer.Option(help=OBJECTIVE_HELP)] = "sft",
    reference: Annotated[
        str, typer.Option(help="dpo's reference: auto, same_step or precomputed")
    ] = "auto",
    batch: Annotated[int, typer.Option(help="micro-batch size")] = 2,
    seq: Annotated[int, typer.Option(help="sequence length")] = 2048,
    dtype: Annotated[str, typer.Option(help="bfloat16 or float32")] = "bfloat16",
    budget: Annotated[
        str | None,
        typer.Option(help="device memory, e.g. 8GiB, or device (all the device's usable memory)"),
    ] = None,
    offload: Annotated[
        str,
        typer.Option(help="to host memory: none, or any of residuals,optimizer_state,embed,base"),
    ] = "none",
    optimizer: Annotated[
        str, typer.Option(help="adamw, adamw_8bit, sgd, lion, adafactor")
    ] = "adamw",
    lora_rank: Annotated[int, typer.Option(help="LoRA rank")] = 8,
    loss_chunk: Annotated[
        str, typer.Option(callback=chunk_option, help="loss sequence chunk" + CHUNK_HELP)
    ] = "auto",
    vocab_chunk: Annotated[
        str, typer.Option(callback=chunk_option, help="LM-head vocabulary chunk" + CHUNK_HELP)
    ] = "auto",
    mlp_chunk: Annotated[
        str, typer.Option(callback=chunk_option, help="MLP sequence chunk" + CHUNK_HELP)
    ] = "auto",
    attention: Annotated[
        str, typer.Option(help="auto, blockwise, cudnn or pallas (NVIDIA GPUs), materialized")
    ] = "auto",
    quantize_head: Annotated[bool, typer.Option(help="QLoRA: NF4 LM head")] = False,
    measure: Annotated[bool, typer.Option(help="compile the step on abstract shapes")] = True,
    json_output: Annotated[bool, typer.Option("--json", help="one JSON object")] = False,
    plot: Annotated[
        Path | None, typer.Option(callback=new_file, help="stacked bar chart, e.g. plan.png")
    ] = None,
    mesh: Annotated[
        str | None, typer.Option(help="devices, e.g. fsdp=8 or data=2,fsdp=4: bytes per device")
    ] = None,
    target: Annotated[
        str | None,
        typer.Option(
            help="the device to plan and compile for: h100, h200, a100-80gb, a100-40gb, l40s, "
            "l4, rtx4090, rtx3090 (XLA's GPU compiler, no GPU needed) or cpu; default: this "
            "machine's backend"
        ),
    ] = None,
) -> None:
    """Plan every byte of a train step before compiling; measure the compiled step next to it.
    A config (`plan config.yaml [--set ...]`) is planned exactly as `train config.yaml` builds it;
    a model, with the options' settings, resolved as `train` resolves them."""
    from featherweight.io.model_source import model_config_from

    requested, model_source = _requested(ctx)
    mesh_key = "mesh" if is_config_file(model) else "--mesh"  # where the mesh was written
    chosen = _check_target_and_mesh(target, requested.mesh, mesh_key)
    budget_bytes = _budget_bytes(requested, chosen)
    model_config = model_config_from(model_source)
    planned = _plan_on_target(requested, model_config, chosen, budget_bytes, measure)
    _print_plan(planned, model_config, chosen, json_output)
    if plot is not None:
        _plot_plan(planned, plot, budget_bytes, say_where=not json_output)


def _budget_bytes(requested, target) -> int | None:
    """The bytes of the config's memory.budget (`--budget` or the config's), for `target`."""
    from featherweight.memory.budget import budget_bytes_of
    from featherweight.memory.capacity import of_machine

    budget = requested.memory.budget
    return None if budget is None else budget_bytes_of(budget, of_machine(target))


def _requested(ctx: typer.Context):
    """(the `TrainConfig` plan's command line describes, where its model's shapes come from): a
    config file as train reads it, or a model with the plan options' settings."""
    options = ctx.params
    model, overrides, budget = options["model"], options["set_"], options["budget"]
    if is_config_file(model):
        _refuse_plan_options_with_a_config(ctx, model)
        return _config_request(model, overrides, budget)
    if overrides:
        raise _config_error(
            f"--set {overrides[0]} changes a training config, and {model!r} is a model; plan a "
            "config (featherweight plan config.yaml --set ...) or use the plan options "
            "(featherweight plan --help)"
        )
    chunks = {name: options[name] for name in ("loss_chunk", "vocab_chunk", "mlp_chunk")}
    requested = _plan_request(
        method=options["method"], batch_size=options["batch"], dtype=options["dtype"],
        quantize_head=options["quantize_head"], seq_len=options["seq"],
        optimizer=options["optimizer"], lora_rank=options["lora_rank"], mesh=options["mesh"],
        offload=options["offload"], chunks=chunks, attention=options["attention"],
        objective=options["objective"], reference=options["reference"], budget=budget,
    )  # fmt: skip
    return requested, model


def _plot_plan(planned: PlannedStep, plot: Path, budget_bytes: int | None, say_where: bool) -> None:
    """The plan as a stacked bar chart in `plot` (the compiled bytes beside it when measured)."""
    from featherweight.memory.report import plot_plan

    plot_plan(planned.plan, planned.measurement, plot, budget_bytes)
    if say_where:
        console.print(f"plot: {plot}")


def _check_target_and_mesh(target: str | None, mesh, mesh_key: str = "--mesh"):
    """The target (None: this machine), refusing a mesh (`MeshSettings`) with a GPU target and a
    mesh larger than plan can compile; the virtual CPU devices a mesh needs requested before JAX
    starts."""
    from featherweight.errors import ConfigError, ShardingError
    from featherweight.memory.targets import get_target
    from featherweight.parallel.sharding import request_cpu_devices, requested_devices

    chosen = None if target is None else get_target(target)
    if chosen is not None and chosen.platform == "gpu" and mesh is not None:
        raise ConfigError(
            f"--target {chosen.name} compiles for one device; drop the mesh (a mesh is "
            "planned per device of this machine's virtual CPU devices)"
        )
    devices = None if mesh is None else requested_devices(mesh)
    if (devices or 0) > PLANNED_DEVICES:
        sizes = mesh.model_dump().items()
        shown = ",".join(f"{axis}={size}" for axis, size in sizes if size != "auto")
        raise ShardingError(
            f"{mesh_key} {shown!r} names {devices} devices; plan compiles on up to {PLANNED_DEVICES} "
            "(virtual) devices -- plan a smaller mesh: bytes per device depend on the axis "
            "sizes, not on how many replicas run"
        )
    if devices:
        request_cpu_devices(devices)  # a CPU-only machine compiles it too
    return chosen


def _plan_request(
    *, method, batch_size, dtype, quantize_head, seq_len, optimizer, lora_rank, mesh, offload,
    chunks, attention, objective="sft", reference="auto", budget=None,
):  # fmt: skip
    """The `TrainConfig` the plan options describe (every other setting at its default, as in a
    config file that leaves it out)."""
    from featherweight.errors import ConfigError
    from featherweight.parallel.sharding import parse_mesh
    from featherweight.recipe.placement import HOST_SETTINGS
    from featherweight.recipe.schema import parse_config

    offloaded = set() if offload == "none" else {part.strip() for part in offload.split(",")}
    unknown = offloaded - set(HOST_SETTINGS)
    if unknown:
        raise ConfigError(
            f"--offload {offload!r}: {sorted(unknown)} cannot go to the host; use none, or any of "
            f"{','.join(HOST_SETTINGS)}"
        )
    placements = {name: "host" if name in offloaded else "device" for name in HOST_SETTINGS}
    return parse_config(
        {
            "method": method,
            "objective": objective,
            "dpo": {"reference": reference},
            "batch_size": batch_size,
            "model": {"dtype": dtype, "quantize_head": quantize_head},
            "data": {"seq_len": seq_len},
            "optimizer": {"name": optimizer},
            "lora": {"rank": lora_rank},
            "mesh": None if mesh is None else parse_mesh(mesh).model_dump(),
            "memory": {**placements, **chunks, "attention": attention, "budget": budget},
        },
        source="plan options",
    )


def _print_plan(planned: PlannedStep, model_config, target, json_output: bool) -> None:
    """The plan as one JSON object (with the resolved config), or as the verdict, the report,
    host memory and the host-base estimate."""
    import json

    from featherweight.memory.report import print_report, report_json

    config, memory_plan, judged, changes = (
        planned.config,
        planned.plan,
        planned.verdict,
        planned.changes,
    )
    not_compiled = planned.not_compiled
    estimate = _host_base_estimate(config, model_config, target)
    if json_output:
        report = report_json(memory_plan, planned.measurement, changes, judged)
        report["config"] = config.model_dump(mode="json")
        report["host_base_estimate"] = None if estimate is None else estimate._asdict()
        report["not_compiled"] = not_compiled
        rollout = planned.rollout_measurement
        report["compiled_rollout"] = None if rollout is None else rollout.as_dict()
        typer.echo(json.dumps(report, indent=2))
        return
    if judged is not None:
        console.print(f"[bold]{judged.line}[/]", highlight=False)
    print_report(memory_plan, planned.measurement, console, changes)
    if planned.rollout_measurement is not None:
        console.print(_rollout_line(memory_plan, planned.rollout_measurement), highlight=False)
    if config.memory.base == "host":
        console.print(
            f"host memory: {memory_plan.host_bytes / 2**30:.2f} GiB pinned (the frozen base "
            f"{memory_plan.bytes_of('base_layers') / 2**30:.2f} GiB)",
            highlight=False,
        )
    for line in [] if estimate is None else estimate.lines(target.short_name):
        console.print(line, highlight=False)
    if judged is not None:
        console.print(f"[dim]note: {judged.limit_note}[/]", highlight=False)
    if not_compiled is not None:
        console.print(not_compiled, style="yellow", markup=False, highlight=False)


def _host_base_estimate(config, model_config, target):
    """Transfer and compute estimates of `memory.base: host` on a GPU target, else None."""
    from featherweight.memory.step_cost import host_base_estimate

    if config.memory.base != "host" or target is None or target.peak_flops is None:
        return None
    return host_base_estimate(
        config,
        model_config,
        target.host_link_bytes_per_second,
        target.peak_flops,
        target.step_target,
    )


class PlannedStep(NamedTuple):
    """What `plan` shows: the resolved config (fitted to the budget when one is given), its plan,
    the compiled step's measurement (None with --no-measure), the verdict (None without a limit),
    the budget's changes to the resolved settings, why the step was not compiled where
    compiling was asked for and cannot be done here (None otherwise), and for an objective that
    samples its batches (GRPO) its rollout program compiled beside the step (None otherwise)."""

    config: Any
    plan: Any
    measurement: Any
    verdict: Any
    changes: list[str]
    not_compiled: str | None = None
    rollout_measurement: Any = None


def _plan_on_target(requested, model_config, target, budget_bytes, measure) -> PlannedStep:
    """The plan of `requested` for `target` (None: this machine's device) by the trainer's own
    planning function (`budget.plan_within_budget`: resolved as train resolves it, fitted to the
    budget when one is given, "auto" attention chosen for the target's GPU); the step compiled
    for the target; and, where the plan does not fit a GPU, the settings a budget of its usable
    memory would pick, as an option."""
    from featherweight.memory import capacity
    from featherweight.memory.budget import describe_changes, plan_within_budget
    from featherweight.memory.defaults import resolve
    from featherweight.models.attention_choice import AttentionTarget

    step_target = AttentionTarget.of_device() if target is None else target.step_target
    config, memory_plan = plan_within_budget(
        requested, model_config, step_target, capacity.of_machine(target)
    )
    resolved = resolve(requested, model_config, target=step_target)
    on_target, options = capacity.of_target(target), []
    if budget_bytes is None and on_target is not None:
        options = _options_on_target(resolved, memory_plan, model_config, on_target, step_target)
    not_compiled = _not_compiled_here(config, model_config, target) if measure else None
    measured = measure and not_compiled is None
    measurement = _measure(config, model_config, target) if measured else None
    rollout = _measure_rollout(config, model_config, target) if measured else None
    limit = on_target
    if budget_bytes is not None:
        limit = capacity.of_budget(budget_bytes, target, holds_host=step_target.one_memory)
    judged = capacity.verdict(memory_plan, limit, measurement, options)
    changes = describe_changes(resolved, config, model_config, step_target)  # est. step time
    return PlannedStep(config, memory_plan, measurement, judged, changes, not_compiled, rollout)


def _not_compiled_here(config, model_config, target) -> str | None:
    """Why the step planned for a GPU target cannot be compiled on this machine, with how to
    compile it (None where it can): XLA's GPU compiler is not installed (the `gpu-plan` extra),
    or the step calls cuDNN, whose library does not load here. The plan answers either way."""
    from featherweight.memory.measure import cudnn_not_loadable
    from featherweight.memory.targets import install_command
    from featherweight.parallel.backend import cuda_plugin_installed

    if target is None or target.platform != "gpu":
        return None
    if not cuda_plugin_installed():
        return (
            f"not compiled for the {target.short_name}: XLA's GPU compiler is not installed; "
            f'to compile here: pip install "featherweight[gpu-plan]" ({install_command()})'
        )
    refusal = cudnn_not_loadable(config, model_config, target.step_target)
    if refusal is None:
        return None
    return (
        f"not compiled for the {target.short_name}: {refusal}; compile it where cuDNN's library "
        "loads (the GPU itself), or compare with memory.attention: blockwise"
    )


def _measure(config, model_config, target):
    """The step compiled for `target` (None: this machine) on abstract shapes."""
    from featherweight.memory.measure import measure_compiled, measure_for_target

    if target is None:
        return measure_compiled(config, model_config)
    return measure_for_target(config, model_config, target.name)


def _measure_rollout(config, model_config, target):
    """The rollout program of an objective that samples its batches, compiled for `target`
    (None: this machine) on abstract shapes; None for one that reads them."""
    from featherweight.memory.rollout_measure import measure_rollout
    from featherweight.recipe.objectives import objective_of

    if objective_of(config).rollouts(config) is None:
        return None
    return measure_rollout(config, model_config, "cpu" if target is None else target.name)


def _rollout_line(memory_plan, rollout) -> str:
    """The rollout phase planned beside its program compiled: the program's arguments are the
    weights, so the resident optimizer state is added to its bytes."""
    resident_state = memory_plan.bytes_of("optimizer_state")
    compiled = rollout.total_bytes + resident_state
    return (
        f"rollout phase: {memory_plan.rollout_device_bytes / 2**30:.2f} GiB planned, "
        f"{compiled / 2**30:.2f} GiB compiled for {rollout.target} (the sampling program, "
        f"{rollout.total_bytes / 2**30:.2f} GiB, and the optimizer state it leaves in place)"
    )


def _options_on_target(resolved, memory_plan, model_config, on_target, step_target) -> list[str]:
    """Where the plan does not fit the target GPU: the settings a budget of its usable memory
    would pick, or what else would help."""
    from featherweight.errors import BudgetError
    from featherweight.memory.budget import describe_changes, fit_budget

    if on_target.needed_bytes(memory_plan) <= on_target.limit_bytes:
        return []
    try:
        fitted, _ = fit_budget(resolved, model_config, on_target.limit_bytes, target=step_target)
    except BudgetError:
        return ["a GPU with more memory, a shorter sequence or a lighter method"]
    changes = ", ".join(describe_changes(resolved, fitted))
    return [f"--budget {on_target.limit_bytes / 2**30:.2f}GiB picks {changes}"]


CONFIG_SUFFIXES = (".yaml", ".yml")
# each plan option that describes a setting -> the config key `--set` changes instead
OPTION_SETTINGS = {
    "method": "method",
    "objective": "objective",
    "reference": "dpo.reference",
    "batch": "batch_size",
    "seq": "data.seq_len",
    "dtype": "model.dtype",
    "offload": "memory.residuals=host (and the other memory placements)",
    "optimizer": "optimizer.name",
    "lora_rank": "lora.rank",
    "loss_chunk": "memory.loss_chunk",
    "vocab_chunk": "memory.vocab_chunk",
    "mlp_chunk": "memory.mlp_chunk",
    "attention": "memory.attention",
    "quantize_head": "model.quantize_head",
    "mesh": "mesh",
}


def is_config_file(source: str) -> bool:
    """Whether plan's argument names a training config (a .yaml file) rather than a model."""
    return Path(source).suffix.lower() in CONFIG_SUFFIXES


def _config_error(message: str):
    from featherweight.errors import ConfigError

    return ConfigError(message)


def _refuse_plan_options_with_a_config(ctx: typer.Context, config: str) -> None:
    """A setting option beside a config would plan something `train config` does not build:
    refused, naming the `--set` that changes the config instead."""
    for option, key in OPTION_SETTINGS.items():
        source = ctx.get_parameter_source(option)  # typer's own click: compared by name
        if source is not None and source.name == "COMMANDLINE":
            flag = "--" + option.replace("_", "-")
            raise _config_error(
                f"{flag} sets what {config} already says; with a config, change a setting with "
                f"--set {key.split('=')[0]}=... (e.g. --set batch_size=4), so the plan is what "
                f"featherweight train {config} builds"
            )


def _config_request(config_file: str, overrides: list[str] | None, budget: str | None):
    """The config `train config_file --set ...` would run (every path as train reads it, a
    `--budget` in place of its memory.budget) and where its model's shapes come from."""
    from featherweight.recipe.paths import absolute_paths
    from featherweight.recipe.schema import load_config

    budget_override = [] if budget is None else [f"memory.budget={budget}"]
    config = absolute_paths(load_config(config_file, [*(overrides or []), *budget_override]))
    return config, config.model.path
