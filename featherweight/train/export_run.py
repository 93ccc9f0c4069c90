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

from featherweight.errors import ExportError
from featherweight.io.atomic import check_output_dir, refuse_foreign_output
from featherweight.io.convert import convert
from featherweight.io.gguf_export import export_adapter_gguf, export_merged_gguf
from featherweight.io.gguf_writer import check_quant
from featherweight.io.hf_writer import iter_hf_tensors, save_hf_checkpoint
from featherweight.io.hub import is_hub_name
from featherweight.io.model_source import model_config_from
from featherweight.io.names import expected_shapes, hf_name
from featherweight.io.output_paths import refuse_inside, refuse_overlap
from featherweight.io.peft_export import (
    MERGED_DEFAULT_DTYPE,
    check_merged_dtype,
    export_merged,
    export_peft,
)
from featherweight.models.config import ModelConfig
from featherweight.recipe.build import lora_config_of, split_params
from featherweight.recipe.schema import TrainConfig
from featherweight.train.run import load_weights, read_header
from featherweight.train.run_dir import CHECKPOINT_DIR, CONFIG_FILE
from featherweight.train.saved_run import (
    base_model_path,
    locate,
    read_run_config,
    restore_trainable,
)

FORMATS = ("merged", "peft", "gguf", "gguf-adapter")
ADAPTER_FORMATS = ("peft", "gguf-adapter")


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
            f"{hf_name(key, model_config)} is {shape(theirs)}, the run's {shape(ours)}); name the run's base "
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
    _check_format(export_format, dtype, quant)
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
    _check_recorded_path(run_dir, config)
    model_path = base_model_path(run_dir, config)
    refuse_overlap(out, {"run": run_dir, "base model": model_path}, "export --out")
    refuse_foreign_output(out)
    model_config, tokenizer = read_header(model_path)
    if base_model is not None:
        check_base_model(base_model, model_config)
    trainable = restore_trainable(run_dir, step, config, model_config)

    if export_format == "peft":
        return _export_peft(trainable, config, model_config, model_path, out, base_model, overwrite)
    if export_format == "gguf-adapter":
        return export_adapter_gguf(
            trainable, model_config, lora, out, model_path, tokenizer, overwrite=overwrite
        )
    if lora is None and export_format == "merged":
        return save_hf_checkpoint(
            out, model_config, iter_hf_tensors(trainable, model_config), tokenizer, dtype=dtype,
            overwrite=overwrite,
        )  # fmt: skip
    frozen = trainable
    if lora is not None:  # the base the adapters merge into
        model = load_weights(config, model_path)
        _, frozen = split_params(model.params, config, model_config, jax.random.PRNGKey(0))
    if export_format == "gguf":
        return export_merged_gguf(
            frozen, trainable, model_config, lora, tokenizer, out, quant, overwrite=overwrite
        )
    return export_merged(
        frozen, trainable, model_config, lora, tokenizer, out, dtype=dtype, overwrite=overwrite
    )


def _check_format(export_format: str, dtype: str | None, quant: str) -> None:
    """Refuse an unknown format, and a dtype or GGUF type the format cannot write."""
    if export_format not in FORMATS:
        raise ExportError(
            f"export format {export_format!r} is unknown; use one of {', '.join(FORMATS)}"
        )
    if export_format == "merged":
        check_merged_dtype(dtype)
    if export_format == "gguf":
        check_quant(quant)


def _check_recorded_path(run_dir: Path, config: TrainConfig) -> None:
    """Refuse a base model recorded as a relative path: it depends on where training ran."""
    recorded = config.model.path
    if not (
        Path(recorded).expanduser().is_absolute() or recorded == "demo" or is_hub_name(recorded)
    ):
        raise ExportError(
            f"run {run_dir} records its base model as the relative path {config.model.path!r}, "
            "which depends on the directory training ran from; edit model.path in "
            f"{run_dir / CONFIG_FILE} to the model's absolute path, then export again"
        )


def _export_peft(trainable, config, model_config, model_path, out, base_model, overwrite) -> Path:
    """The adapter in PEFT's format, recording a base transformers loads (see `export_run`)."""
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
        trainable, model_config, lora_config_of(config), out, base, overwrite, write_base,
        quantized_base=config.method == "qlora",
    )  # fmt: skip
