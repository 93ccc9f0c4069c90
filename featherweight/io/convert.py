"""`convert`: any supported checkpoint (GGUF or HF) -> a Hugging Face directory transformers loads,
or (`to="gguf"`) a directory with a GGUF file llama.cpp runs and an Ollama Modelfile; streamed
tensor by tensor from the source (the model is never loaded whole)."""

from __future__ import annotations

from pathlib import Path

from featherweight.errors import ConfigError
from featherweight.io.atomic import atomic_directory, check_output_dir, refuse_foreign_output
from featherweight.io.gguf_writer import check_quant
from featherweight.io.hf_writer import DEFAULT_SHARD_BYTES, hf_named, save_hf_checkpoint
from featherweight.io.hub import model_location
from featherweight.io.loader import open_checkpoint
from featherweight.io.names import expected_shapes
from featherweight.io.ollama import write_gguf_directory
from featherweight.io.output_paths import refuse_overlap

CONVERT_DTYPES = ("float32", "float16", "bfloat16")
CONVERT_TARGETS = ("hf", "gguf")


def convert(
    source_path: str | Path,
    out: str | Path,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    to: str = "hf",
    quant: str = "f16",
) -> Path:
    """Convert `source_path` to an HF directory at `out`; `dtype` casts to one of
    `CONVERT_DTYPES` (None keeps each tensor's stored floating-point dtype). With `to="gguf"`,
    `out` gets `model.gguf` in the GGUF type `quant` (see `GGUF_QUANTS`) and a `Modelfile`."""
    if to not in CONVERT_TARGETS:
        raise ConfigError(
            f"convert --to {to!r} is unknown; use one of {', '.join(CONVERT_TARGETS)}"
        )
    if to == "gguf":
        check_quant(quant)
    if dtype is not None and dtype not in CONVERT_DTYPES:
        raise ConfigError(
            f"convert --dtype {dtype!r}: weights are written as floating point; use one of "
            f"{', '.join(CONVERT_DTYPES)} (or omit --dtype to keep the stored dtype)"
        )
    check_output_dir(Path(out), overwrite)
    source_path = model_location(source_path)  # a Hub name: its snapshot in the Hub cache
    refuse_overlap(Path(out), {"source checkpoint": source_path}, "convert --out")
    refuse_foreign_output(Path(out))
    source = open_checkpoint(source_path)
    try:
        if to == "gguf":
            tensors = ((key, source.read(key)) for key in expected_shapes(source.config))
            with atomic_directory(Path(out), overwrite=overwrite) as staging:
                write_gguf_directory(staging, source.config, tensors, source.tokenizer(), quant)
            return Path(out).expanduser().resolve()
        keyed = ((key, source.read(key)) for key in expected_shapes(source.config))
        tensors = hf_named(source.config, keyed)
        return save_hf_checkpoint(
            out,
            source.config,
            tensors,
            source.tokenizer(),
            dtype=dtype,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
        )
    finally:
        source.close()
