"""Export a training run (or one of its checkpoints): merged HF weights, a PEFT adapter, or GGUF
(`gguf`: the merged model; `gguf-adapter`: the LoRA adapter for llama.cpp), with a Modelfile.

RUN_OR_CHECKPOINT is a run directory (its latest checkpoint is used) or a checkpoint directory
inside it (`RUN/checkpoints/STEP`). The base model is rebuilt from the run's recorded model path
and method, the trained arrays come from the checkpoint; everything is checked before the base
weights are read.
"""

from __future__ import annotations

from pathlib import Path

import jax
import yaml

from featherweight.errors import CheckpointNotFoundError, CorruptCheckpointError, ExportError
from featherweight.io.atomic import check_output_dir, refuse_foreign_output
from featherweight.io.convert import convert
from featherweight.io.gguf_export import export_adapter_gguf, export_merged_gguf
from featherweight.io.gguf_writer import check_quant
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.io.hub import is_hub_name
from featherweight.io.model_source import model_config_from
from featherweight.io.names import expected_shapes, hf_name
from featherweight.io.output_paths import refuse_inside, refuse_overlap, resolved
from featherweight.io.peft_export import (
    MERGED_DEFAULT_DTYPE,
    check_merged_dtype,
    export_merged,
    export_peft,
)
from featherweight.models.config import ModelConfig
from featherweight.recipe.build import (
    abstract_split,
    lora_config_of,
    opt_state_initializer,
    split_params,
)
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.schema import TrainConfig
from featherweight.train.checkpoint import Checkpointer
from featherweight.train.run import (
    CHECKPOINT_DIR,
    CONFIG_FILE,
    check_same_model,
    load_weights,
    read_header,
    resolve_model_path,
)

FORMATS = ("merged", "peft", "gguf", "gguf-adapter")
ADAPTER_FORMATS = ("peft", "gguf-adapter")


def locate(run_or_checkpoint: str | Path) -> tuple[Path, int]:
    """(run directory, checkpoint step) for a run dir or a checkpoint dir inside one."""
    path = resolved(run_or_checkpoint)
    if not path.exists():
        raise CheckpointNotFoundError(
            f"{path} does not exist; pass a run directory (train's output_dir)"
        )
    if path.parent.name == CHECKPOINT_DIR and path.name.isdigit():
        return path.parent.parent, int(path.name)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointNotFoundError(
            f"{path} is not a featherweight run (no {CONFIG_FILE}); pass train's output_dir or "
            f"one of its {CHECKPOINT_DIR}/STEP directories"
        )
    steps = Checkpointer(path / CHECKPOINT_DIR, keep=1_000_000, read_only=True).all_steps()
    if not steps:
        raise CheckpointNotFoundError(
            f"run {path} has no checkpoint yet; train at least until the first save"
        )
    return path, max(steps)


def read_run_config(run_dir: Path) -> TrainConfig:
    """The settings a run was trained with (its config.yaml)."""
    path = run_dir / CONFIG_FILE
    try:
        return TrainConfig.model_validate(yaml.safe_load(path.read_text()))
    except (yaml.YAMLError, ValueError) as error:  # pydantic's ValidationError is a ValueError
        raise CorruptCheckpointError(
            f"{path} cannot be read ({type(error).__name__}); the run's record of its settings is "
            "damaged -- restore it from the YAML config the run was trained with"
        ) from None


def check_base_model(base_model: str, model_config: ModelConfig) -> None:
    """Refuse a `--base-model` that is not there (a Hub name is resolved: gated, missing, not in
    the cache offline) or has other shapes than the run's base: the adapter would not load on it."""
    base_config = model_config_from(base_model)
    theirs, ours = expected_shapes(base_config), expected_shapes(model_config)
    if theirs != ours:
        key = next(key for key in [*ours, *theirs] if theirs.get(key) != ours.get(key))
        shape = lambda shapes: "absent" if key not in shapes else f"of shape {shapes[key]}"
        raise ExportError(
            f"--base-model {base_model} is not the model this run was trained on (its "
            f"{hf_name(key)} is {shape(theirs)}, the run's {shape(ours)}); name the run's base "
            "model, or leave --base-model out to record the run's own"
        )


def export_run(
    run_or_checkpoint: str | Path,
    export_format: str,
    out: str | Path,
    dtype: str | None = MERGED_DEFAULT_DTYPE,
    overwrite: bool = False,
    base_model: str | None = None,
    quant: str = "f16",
) -> Path:
    """Write `out` from a run's checkpoint: `merged` (HF directory), `peft` (adapter), `gguf`
    (merged, in GGUF type `quant`) or `gguf-adapter` (llama.cpp LoRA adapter).

    A PEFT adapter records a base transformers loads: `base_model` (an HF id or directory) when
    given, else the run's HF directory, else (a GGUF base) the base written as an HF directory
    into `out/base` in the run's dtype."""
    if export_format not in FORMATS:
        raise ExportError(
            f"export format {export_format!r} is unknown; use one of {', '.join(FORMATS)}"
        )
    if export_format == "merged":
        check_merged_dtype(dtype)
    if export_format == "gguf":
        check_quant(quant)
    run_dir, step = locate(run_or_checkpoint)
    config = read_run_config(run_dir)
    lora = lora_config_of(config)
    if lora is None and export_format in ADAPTER_FORMATS:
        raise ExportError(
            f"run {run_dir} is a full fine-tune: it has no adapters for the {export_format} "
            "format; use --format merged or gguf"
        )
    out = check_output_dir(Path(out), overwrite)
    refuse_inside(out, run_dir / CHECKPOINT_DIR, "export --out", "holds the run's checkpoints")
    recorded = config.model.path
    if not (
        Path(recorded).expanduser().is_absolute() or recorded == "demo" or is_hub_name(recorded)
    ):
        raise ExportError(
            f"run {run_dir} records its base model as the relative path {config.model.path!r}, "
            "which depends on the directory training ran from; edit model.path in "
            f"{run_dir / CONFIG_FILE} to the model's absolute path, then export again"
        )
    model_path = resolve_model_path(config, run_dir)
    check_same_model(run_dir, model_path)
    refuse_overlap(out, {"run": run_dir, "base model": model_path}, "export --out")
    refuse_foreign_output(out)
    model_config, tokenizer = read_header(model_path)
    if base_model is not None:
        check_base_model(base_model, model_config)

    abstract_trainable, _ = abstract_split(config, model_config)
    optimizer = make_optimizer(config.optimizer, config.steps)
    abstract_state = jax.eval_shape(opt_state_initializer(config, optimizer), abstract_trainable)
    checkpointer = Checkpointer(run_dir / CHECKPOINT_DIR, keep=1_000_000, read_only=True)
    (trainable, _), _ = checkpointer.restore(step, (abstract_trainable, abstract_state))

    if export_format == "peft":
        write_base = None
        if base_model is None and not model_path.is_dir():
            write_base = lambda directory: convert(model_path, directory, config.model.dtype)
        base = base_model or (
            config.model.path  # a Hub name: what peft loads, not this machine's cache
            if is_hub_name(config.model.path)
            else str(model_path)
            if model_path.is_dir()
            else None
        )
        return export_peft(
            trainable, model_config, lora, out, base, overwrite, write_base,
            quantized_base=config.method == "qlora",
        )  # fmt: skip
    if export_format == "gguf-adapter":
        return export_adapter_gguf(
            trainable, model_config, lora, out, model_path, tokenizer, overwrite=overwrite
        )
    if export_format == "gguf":
        frozen = trainable
        if lora is not None:
            model = load_weights(config, model_path)
            _, frozen = split_params(model.params, config, model_config, jax.random.PRNGKey(0))
        return export_merged_gguf(
            frozen, trainable, model_config, lora, tokenizer, out, quant, overwrite=overwrite
        )
    if lora is None:
        return save_hf_checkpoint(
            out,
            model_config,
            iter_hf_tensors(trainable, model_config),
            tokenizer,
            dtype=dtype,
            overwrite=overwrite,
        )
    model = load_weights(config, model_path)
    _, frozen = split_params(model.params, config, model_config, jax.random.PRNGKey(0))
    return export_merged(
        frozen, trainable, model_config, lora, tokenizer, out, dtype=dtype, overwrite=overwrite
    )
