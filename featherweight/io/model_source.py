"""Where a model's config comes from: a checkpoint directory, a GGUF file, a built-in name, or a
Hugging Face Hub name (`org/name`: its config.json alone, from the Hub cache or downloaded).

Planning needs only shapes, so this reads a `config.json` or GGUF metadata and never a tensor. A
built-in name answers without the network; a Hub name that is not built in fetches config.json.
"""

from __future__ import annotations

from pathlib import Path

from featherweight.errors import CheckpointNotFoundError
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.hub import CONFIG_FILES, hub_snapshot, is_hub_name
from featherweight.models.config import ModelConfig, read_hf_config
from featherweight.models.registry import BUILTIN_MODELS, builtin_config, is_builtin_model


def model_config_from(source: str | Path) -> ModelConfig:
    """The config of a model given as a directory with a `config.json` (no weights needed), a
    `config.json` file, a `.gguf` file (its metadata; tensors are not read), a built-in name, or
    a Hub name (its config.json)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return read_hf_config(path)
    if path.is_file() and path.suffix == ".gguf":
        return GGUFSource(path).config
    if path.is_file() and path.name == "config.json":
        return read_hf_config(path.parent)
    if is_hub_name(source) and not is_builtin_model(str(source)):
        return read_hf_config(hub_snapshot(str(source), CONFIG_FILES))
    looks_like_path = path.suffix in (".gguf", ".json") or len(path.parts) > 1
    if path.exists() or (looks_like_path and not is_builtin_model(str(source))):
        raise CheckpointNotFoundError(
            f"model {str(source)!r} is not a directory with config.json, a .gguf file, a "
            f"Hugging Face name (org/name) or a built-in model name ({', '.join(BUILTIN_MODELS)})"
        )
    return builtin_config(str(source))
