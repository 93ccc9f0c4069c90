"""`convert`: any supported checkpoint (GGUF or HF) -> a Hugging Face directory transformers loads,
streamed tensor by tensor from the source (the model is never loaded whole)."""

from __future__ import annotations

from pathlib import Path

from featherweight.errors import ConfigError
from featherweight.io.atomic import check_output_dir
from featherweight.io.hf_writer import DEFAULT_SHARD_BYTES, save_hf_checkpoint
from featherweight.io.loader import open_checkpoint
from featherweight.io.names import expected_shapes, hf_name
from featherweight.io.output_paths import refuse_overlap

CONVERT_DTYPES = ("float32", "float16", "bfloat16")


def convert(
    source_path: str | Path,
    out: str | Path,
    dtype: str | None = None,
    overwrite: bool = False,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> Path:
    """Convert `source_path` to an HF directory at `out`; `dtype` casts to one of
    `CONVERT_DTYPES` (None keeps each tensor's stored floating-point dtype)."""
    if dtype is not None and dtype not in CONVERT_DTYPES:
        raise ConfigError(
            f"convert --dtype {dtype!r}: weights are written as floating point; use one of "
            f"{', '.join(CONVERT_DTYPES)} (or omit --dtype to keep the stored dtype)"
        )
    check_output_dir(Path(out), overwrite)
    refuse_overlap(Path(out), {"source checkpoint": source_path}, "convert --out")
    source = open_checkpoint(source_path)
    try:
        tensors = ((hf_name(key), source.read(key)) for key in expected_shapes(source.config))
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
