"""Everything a run needs before its first step, checked in order of cost.

1. the output directory (another run there? writable?) and the config -- no I/O beyond stat;
2. the checkpoint's header (model config, tokenizer) and the method's settings;
3. the memory plan (and the budget, which may change settings) -- before any weight is read;
4. the dataset (typed errors with file and line);
5. the weights (NF4-quantized on load for QLoRA, each tensor checked for NaN/inf), the
   trainable/frozen split; only then are the run's files written (an input refused up to here
   leaves the output directory as it was); with a device mesh, the weights are read to host
   memory and placed shard by shard; the step;
6. the latest checkpoint when the run resumes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, NamedTuple

import jax
import yaml

from featherweight.data.chat_templates import with_chat_template
from featherweight.data.demo_task import invented_world, write_training_data
from featherweight.data.iterator import DataIterator
from featherweight.data.prompts import PromptIterator, PromptSet, read_prompts
from featherweight.data.records import Dataset
from featherweight.errors import (
    ConfigError,
    DataError,
    ModelChangedError,
    ModelConfigError,
    OutputExistsError,
)
from featherweight.inference.rollout import Sampling
from featherweight.io.atomic import atomic_write_text, probe_writable
from featherweight.io.embedded_model import cache_dir, require_demo_model
from featherweight.io.hub import model_location, snapshot_revision
from featherweight.io.loader import load_model, open_checkpoint
from featherweight.io.output_paths import refuse_escape, refuse_overlap, resolved
from featherweight.io.tokenizer import Tokenizer
from featherweight.memory import capacity
from featherweight.memory.capacity import Verdict, refuse_unless_fits
from featherweight.memory.defaults import resolve
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params
from featherweight.models.model import Model
from featherweight.parallel.distributed import is_primary, sync_processes
from featherweight.parallel.sharding import (
    check_layout,
    mesh_from_settings,
    parameter_spec,
    shard_tree,
)
from featherweight.recipe.build import (
    abstract_split,
    attention_implementation,
    build_train_step,
    check_method_settings,
    split_params,
)
from featherweight.recipe.objectives import objective_of, step_objective
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.paths import absolute_paths
from featherweight.recipe.placement import arguments_on_host, place
from featherweight.recipe.schema import (
    GrpoSettings,
    TrainConfig,
    changed_settings,
    take_saved_choices,
)
from featherweight.step.loss import resolve_chunk_size
from featherweight.train import run_dir
from featherweight.train.checkpoint import Checkpointer
from featherweight.train.dataset import build_dataset, steps_from_epochs
from featherweight.train.grpo_rollouts import GrpoSetup
from featherweight.train.reference_logps import precompute_reference
from featherweight.train.rewards import load_rewards
from featherweight.train.run_dir import CHECKPOINT_DIR, CONFIG_FILE, RUN_FILE

FINGERPRINT_BYTES = 1 << 20  # of a GGUF file: its header (metadata, tensor table) lies in here


@dataclasses.dataclass
class Run:
    """A prepared run: the state lives here only until the loop takes it over."""

    config: TrainConfig
    output_dir: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    model_source: Path
    dataset: Dataset
    data: DataIterator
    trainable: Params
    frozen: Params
    opt_state: Any
    step_fn: Any
    checkpointer: Checkpointer
    start_step: int
    plan: Any = None
    mesh: Any = None  # the device mesh (jax.sharding.Mesh), None on one device
    fit: Verdict | None = None  # the plan against this device (`memory.capacity`)
    rollouts: GrpoSetup | None = None  # GRPO: what each step's rollouts need besides the model


def _comparable(config: TrainConfig) -> dict[str, Any]:
    """The settings that define a run; `steps` may grow when resuming, and `output_dir` is where
    the run is, however it was spelled (a run saved with a relative one still resumes)."""
    values = config.model_dump(mode="json")
    values.pop("steps")
    values.pop("output_dir")
    return values


class RunDirectory(NamedTuple):
    """Where a run writes, whether it resumes the run already there, and its config: when
    resuming, each setting it leaves "auto" is the one the run recorded (`take_saved_choices`)."""

    path: Path
    resuming: bool
    config: TrainConfig


def check_run_dir(config: TrainConfig, overwrite: bool) -> RunDirectory:
    """The output dir (resolved) and whether the run resumes -- refusing another run's directory
    unless `overwrite`.

    The directory is locked here when it exists (one trainer at a time). With `overwrite` nothing
    is removed yet: `write_run_files` clears the old run's files once the new run's settings,
    model header and data have all been checked.
    """
    out = resolved(config.output_dir)
    if out.exists() and not out.is_dir():
        raise OutputExistsError(f"output_dir {out} is a file; choose a directory for output_dir")
    refuse_escape(out, run_dir.RUN_ENTRIES)
    if out.is_dir() and is_primary():
        run_dir.acquire(out)
    resuming = False
    if out.is_dir() and not overwrite and any(out.iterdir()):
        if not run_dir.is_owned(out):
            first = sorted(entry.name for entry in out.iterdir())[0]
            raise OutputExistsError(
                f"output_dir {out} holds {first!r} and is not a featherweight run (no "
                f"{run_dir.MARKER} marker); featherweight never writes over files it did not "
                "write -- choose a new or empty output_dir"
            )
        saved = out / CONFIG_FILE
        saved_config = _saved_config(saved) if saved.is_file() else None
        if saved_config is not None:
            config = take_saved_choices(config, saved_config)
            resuming = _comparable(saved_config) == _comparable(config)
        if not resuming:
            what = (
                f"another run (its config differs: {changed_settings(_comparable(saved_config), _comparable(config))})"
                if saved_config is not None
                else f"a run that never started (no {CONFIG_FILE})"
            )
            raise OutputExistsError(
                f"output_dir {out} holds {what}; {_replace_advice(out)} (an identical config "
                "resumes automatically)"
            )
    probe_writable(out, "output_dir")
    return RunDirectory(out, resuming, config)


def _replace_advice(out: Path) -> str:
    """How to get past another run in `out`: --overwrite only where it would be allowed."""
    foreign = run_dir.foreign_entries(out)
    if not foreign:
        return "pass --overwrite to replace it, or choose a new output_dir"
    return (
        f"choose a new output_dir (--overwrite would refuse: {foreign[0]!r} in it is not a run's "
        "file, and featherweight removes only its own)"
    )


def check_steps_ahead(config: TrainConfig, output_dir: Path) -> None:
    """Refuse to resume a run whose checkpoint is already past `steps`: it would train nothing
    and report the old run as done (checked before any weight is read)."""
    checkpoints = output_dir / CHECKPOINT_DIR
    if not checkpoints.is_dir():
        return
    latest = Checkpointer(checkpoints, keep=1_000_000, read_only=True).latest_step()
    if latest is not None and latest > config.steps:
        raise ConfigError(
            f"steps: {config.steps} is below step {latest}, where run {output_dir} already is "
            f"(its latest checkpoint); set steps to {latest} or more to resume it, or choose a "
            "new output_dir for a shorter run"
        )


def model_fingerprint(model_path: Path) -> dict[str, Any]:
    """What identifies a base model's content cheaply: sizes, and a hash of its config
    (a HF directory) or of its first MiB (a GGUF file: metadata and tensor table)."""
    digest = hashlib.sha256()
    if model_path.is_dir():
        config = model_path / "config.json"
        digest.update(config.read_bytes() if config.is_file() else b"")
        weights = sorted(model_path.glob("*.safetensors"))
        return {"sha256": digest.hexdigest(), "bytes": sum(w.stat().st_size for w in weights)}
    with model_path.open("rb") as file:
        digest.update(file.read(FINGERPRINT_BYTES))
    return {"sha256": digest.hexdigest(), "bytes": model_path.stat().st_size}


def check_same_model(output_dir: Path, model_path: Path) -> None:
    """Refuse to resume (or export) a run whose base model at its recorded path changed."""
    recorded = _recorded(output_dir).get("model_fingerprint")
    if recorded and recorded != model_fingerprint(model_path):
        raise ModelChangedError(
            f"the base model at {model_path} is not the one run {output_dir} was trained on "
            "(its config or size changed since); its checkpoints are intact -- put the original "
            "model back at that path, or start a new run with --overwrite or a new output_dir"
        )


def _saved_config(saved: Path) -> TrainConfig:
    """The config of the run already in output_dir; a damaged file is named, not a crash."""
    try:
        return TrainConfig.model_validate(yaml.safe_load(saved.read_text()))
    except (yaml.YAMLError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        raise OutputExistsError(
            f"output_dir {saved.parent} holds a run whose {saved.name} cannot be read "
            f"({type(error).__name__}); pass --overwrite to replace that run, or choose a new "
            "output_dir"
        ) from None


def resolve_model_path(config: TrainConfig, run: Path | None = None) -> Path:
    """Where the run's base model is on this disk: the demo's cached GGUF, a path, or a Hub
    name's snapshot -- for an existing `run`, the snapshot of the commit it recorded."""
    if config.model.path == "demo":
        return require_demo_model()
    revision = None if run is None else _recorded(run).get("model_revision")
    return model_location(config.model.path, revision=revision)


def _recorded(run: Path) -> dict[str, Any]:
    """The run's run.json (empty when it has none, or one that cannot be read)."""
    try:
        recorded = json.loads((run / RUN_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def resolve_data_path(config: TrainConfig) -> Path:
    """The training JSONL; "demo" writes the generated demo task into the cache."""
    if config.data.train == "demo":
        return write_training_data(cache_dir() / "demo_data" / "demo_train.jsonl", invented_world())
    return Path(config.data.train).expanduser()


def read_header(model_path: Path) -> tuple[ModelConfig, Tokenizer | None]:
    """The model config and tokenizer from the checkpoint's header (no weights read)."""
    source = open_checkpoint(model_path)
    try:
        return source.config, source.tokenizer()
    finally:
        source.close()


def check_tokenizer_fits(
    tokenizer: Tokenizer | None, model_config: ModelConfig, model_path: Path
) -> None:
    """Refuse a tokenizer whose ids reach past the embedding table (a mismatched tokenizer file):
    the first batch would index rows that do not exist."""
    if tokenizer is not None and tokenizer.vocab_size > model_config.vocab_size:
        raise ModelConfigError(
            f"the tokenizer of {model_path} has {tokenizer.vocab_size} tokens but the model's "
            f"embedding has {model_config.vocab_size} rows; the tokenizer belongs to another "
            "model: use the tokenizer.json that came with these weights"
        )


def load_weights(config: TrainConfig, model_path: Path) -> Model:
    quantize = "nf4" if config.method == "qlora" else None
    return load_model(
        model_path,
        dtype=config.model.dtype,
        quantize=quantize,
        quantize_head=config.model.quantize_head,
        layers_on_host="base" in arguments_on_host(config),  # the base never reaches the device
    )


def loading_device(mesh) -> contextlib.AbstractContextManager:
    """Where weights are read to before they are sharded: host memory when a mesh will hold the
    model (it may not fit one accelerator), else the default device."""
    if mesh is None:
        return contextlib.nullcontext()
    return jax.default_device(jax.local_devices(backend="cpu")[0])


def write_run_files(
    output_dir: Path, config: TrainConfig, model_path: Path, model_config: ModelConfig, clear: bool
) -> None:
    """The run's identity: its config and what the export needs to rebuild the model."""
    if clear:
        run_dir.clear_run(output_dir)
    run_dir.claim(output_dir)
    atomic_write_text(
        output_dir / CONFIG_FILE, yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    )
    run = {
        "model_path": str(model_path.resolve()),
        "model_revision": snapshot_revision(model_path),  # a Hub name's commit, else None
        "model_fingerprint": model_fingerprint(model_path),
        "method": config.method,
        "attention": attention_implementation(config, model_config),  # auto resolved here
        "model_config": model_config.to_hf_dict(),
    }
    atomic_write_text(output_dir / RUN_FILE, json.dumps(run, indent=2))


def check_step_settings(config: TrainConfig) -> None:
    """The step's memory settings, checked before anything is written: the step itself meets them
    only when it is first traced, after the run's files exist."""
    _ = config.memory.policy  # MemoryPolicy validates the policy fields
    resolve_chunk_size(config.data.seq_len, config.memory.loss_chunk)


def restore_state(
    checkpointer: Checkpointer, step: int, trainable: Params, opt_state: Any
) -> tuple[tuple[Params, Any], dict[str, Any]]:
    """Checkpoint `step` in place of the state just built: that state (loaded or initialised) is
    only a template -- its shapes, dtypes and shardings (memory kinds included) become the restore
    targets and its buffers are freed first, so one copy of the state exists at any time and
    host-resident leaves are read straight into host memory."""
    live = (trainable, opt_state)
    targets = jax.tree.map(
        lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding), live
    )
    for leaf in jax.tree.leaves(live):
        leaf.delete()  # built by prepare_run a moment ago; nothing else holds it
    del live, trainable, opt_state
    return checkpointer.restore(step, targets)


def _check_inputs(config: TrainConfig, overwrite: bool) -> tuple[RunDirectory, Path]:
    """The run directory and the base model's path, checked before anything is read: the same
    base when resuming, no input inside the output, nothing foreign to replace."""
    directory = check_run_dir(absolute_paths(config), overwrite)
    output_dir, config = directory.path, directory.config
    model_path = resolve_model_path(config, output_dir if directory.resuming else None)
    if directory.resuming:
        check_same_model(output_dir, model_path)
    inputs = {
        "model": model_path,
        "dataset": None if config.data.train == "demo" else config.data.train,
        "eval dataset": config.data.eval,
    }
    refuse_overlap(output_dir, inputs, "output_dir")
    if overwrite:
        run_dir.check_replaceable(output_dir)  # only featherweight's own files, before any work
    return directory, model_path


def _resolve_and_plan(
    config: TrainConfig, model_config: ModelConfig, mesh, plan_fn
) -> tuple[TrainConfig, Any, Verdict | None]:
    """(the config with every "auto" chosen from the shapes -- and fitted to its budget by
    `plan_fn` --, its plan, the plan's verdict on this device), refused when the plan does not
    fit (`memory.capacity`)."""
    config = resolve(config, model_config, mesh)
    plan = fit = None
    if plan_fn is not None:
        config, plan = plan_fn(config, model_config)
        fit = refuse_unless_fits(plan, capacity.of_device())
    check_step_settings(config)
    if mesh is not None:
        global_batch = config.batch_size * jax.process_count()
        check_layout(mesh, *abstract_split(config, model_config), global_batch)
    return config, plan, fit


def _read_data(
    config: TrainConfig, tokenizer: Tokenizer | None, model_path: Path
) -> tuple[Dataset, DataIterator, TrainConfig]:
    """The dataset, its batch iterator, and the config with `epochs` turned into steps."""
    if tokenizer is None:
        raise DataError(f"{model_path} has no tokenizer; the trainer needs one to read the dataset")
    rollouts = objective_of(config).rollouts(config)
    if rollouts is not None:  # rows sampled each step from prompt records
        return _read_prompts(config, rollouts)
    dataset = build_dataset(config, tokenizer, resolve_data_path(config))
    data = _iterator(dataset, config)
    _refuse_batch_beyond_rows(config, len(dataset.train), dataset.train.group)
    return dataset, data, steps_from_epochs(config, data.steps_per_epoch)


def _read_prompts(
    config: TrainConfig, rollouts: GrpoSettings
) -> tuple[PromptSet, PromptIterator, TrainConfig]:
    """The prompt records of an objective that samples its rows (GRPO), their resumable order,
    and the config with `epochs` as steps."""
    if config.data.train == "demo":
        raise DataError(
            "objective: grpo needs prompt records ({prompt, other columns}); set data.train to "
            "a file of them, e.g. examples/planet-colour-prompts.jsonl"
        )
    prompts = read_prompts(config.data.train, config.data.skip_bad, dict(config.data.columns))
    per_step = config.batch_size // rollouts.num_generations
    if per_step > len(prompts.train):
        raise DataError(
            f"batch_size {config.batch_size} / grpo.num_generations "
            f"{rollouts.num_generations} = {per_step} prompts a step, more than the "
            f"{len(prompts.train)} prompt records; lower batch_size or add prompts"
        )
    data = PromptIterator(prompts.train, per_step, config.data.shuffle_seed)
    return prompts, data, steps_from_epochs(config, data.steps_per_epoch)


def grpo_setup(config: TrainConfig, settings: GrpoSettings, tokenizer: Tokenizer) -> GrpoSetup:
    """The rewards (loaded, so a bad one is refused before any weight is read), the chat
    template and the sampling settings (`settings`: the objective's rollouts) of a GRPO run;
    reward files are read from the working directory (a config file's are made absolute from its
    folder when it is loaded)."""
    rewards = load_rewards(settings.rewards, settings.reward_weights, Path.cwd())
    sampling = Sampling(settings.temperature, settings.top_p, settings.max_completion_length)
    return GrpoSetup(
        with_chat_template(tokenizer, config.data.chat_template), rewards,
        settings.num_generations, sampling, settings.scale_rewards, config.data.seq_len,
        config.memory.rollout_chunk,
    )  # fmt: skip


def _refuse_batch_beyond_rows(config: TrainConfig, rows: int, group: int) -> None:
    """A batch larger than the training rows repeats rows in every step (the batch is filled up
    from the same rows): the work of several passes over the data a step, for nothing."""
    global_batch = config.batch_size * jax.process_count()
    if global_batch > rows:
        per_process = " per process" if jax.process_count() > 1 else ""
        most = max(group, rows // jax.process_count() // group * group)  # whole pairs
        raise DataError(
            f"batch_size {config.batch_size}{per_process} is more than the {rows} training rows "
            f"the data packs into (seq_len {config.data.seq_len}): each step would repeat rows, "
            f"{global_batch / rows:.1f}x the work of one pass; set batch_size to {most} or less, "
            "or add data"
        )


def _iterator(dataset: Dataset, config: TrainConfig) -> DataIterator:
    """The batches of this process's rows."""
    return DataIterator(
        dataset.train,
        config.batch_size,
        config.data.shuffle_seed,
        jax.process_index(),
        jax.process_count(),
    )


class PlannedRun(NamedTuple):
    """A run checked and planned, nothing read beyond the checkpoint's header (steps 1-3 of the
    module docstring): what `train --dry-run` shows, and where `prepare_run` goes on from."""

    directory: RunDirectory
    model_path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    mesh: Any
    config: TrainConfig  # resolved (and fitted to its budget)
    plan: Any
    fit: Verdict | None


def plan_run(config: TrainConfig, overwrite: bool = False, plan_fn=None) -> PlannedRun:
    """Check the output directory, the model's header and the method, then resolve and plan.

    The config is resolved once (`memory.defaults.resolve`; a resumed run keeps what it
    recorded). `plan_fn(config, model_config) -> (config, plan)` plans memory (and may change
    settings to fit a budget) before any weights are read.
    """
    directory, model_path = _check_inputs(config, overwrite)
    config = directory.config
    model_config, tokenizer = read_header(model_path)
    check_tokenizer_fits(tokenizer, model_config, model_path)
    check_method_settings(config, model_config)
    mesh = mesh_from_settings(config.mesh)
    config, plan, fit = _resolve_and_plan(config, model_config, mesh, plan_fn)
    return PlannedRun(directory, model_path, model_config, tokenizer, mesh, config, plan, fit)


def prepare_run(config: TrainConfig, overwrite: bool = False, plan_fn=None) -> Run:
    """Check, resolve, plan (`plan_run`), load and (when resuming) restore: a run ready for its
    first step. The config `plan_run` resolved is the one built and written to the run's config
    file."""
    directory, model_path, model_config, tokenizer, mesh, config, plan, fit = plan_run(
        config, overwrite, plan_fn
    )
    output_dir = directory.path
    dataset, data, config = _read_data(config, tokenizer, model_path)
    sampling = objective_of(config).rollouts(config)
    rollouts = None if sampling is None else grpo_setup(config, sampling, tokenizer)
    if directory.resuming:
        check_steps_ahead(config, output_dir)

    with loading_device(mesh):
        model = load_weights(config, model_path)
        trainable, frozen = split_params(
            model.params, config, model_config, jax.random.PRNGKey(config.seed)
        )
    del model
    # only now, with the weights read and checked, does the run directory change
    if is_primary():
        write_run_files(output_dir, config, model_path, model_config, clear=overwrite)
    sync_processes("run files written")
    if mesh is not None:
        trainable = shard_tree(trainable, mesh, parameter_spec)
        frozen = shard_tree(frozen, mesh, parameter_spec)
    optimizer = make_optimizer(config.optimizer, config.steps)
    step_fn, init_opt_state = build_train_step(config, model_config, trainable, frozen, optimizer)
    opt_state = init_opt_state(trainable)  # made in the memory memory.optimizer_state names
    trainable, opt_state, frozen = place(config, trainable, opt_state, frozen)
    objective = step_objective(config)
    if objective is not None and objective.needs_reference and objective.reference == "precomputed":
        # before any restore: the weights as loaded are the reference (full fine-tuning)
        dataset = precompute_reference(config, model_config, trainable, frozen, dataset)
        data = _iterator(dataset, config)
    checkpointer = Checkpointer(output_dir / CHECKPOINT_DIR, keep=config.checkpoint.keep)
    start_step = 0
    latest = checkpointer.latest_step() if directory.resuming else None
    if latest is not None:
        (trainable, opt_state), metadata = restore_state(checkpointer, latest, trainable, opt_state)
        data.restore(metadata["data"])
        start_step = int(metadata["step"])
    return Run(
        config, output_dir, model_config, tokenizer, model_path, dataset, data, trainable, frozen,
        opt_state, step_fn, checkpointer, start_step, plan, mesh, fit, rollouts,
    )  # fmt: skip
