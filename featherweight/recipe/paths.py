"""Where a config's paths point: one rule, applied once, before anything reads a file.

An input a config file names with a relative path (`model.path`, `data.train`, `data.eval`,
`data.chat_template`) is read from that file's folder (as Docker Compose, tsconfig, Cargo and
pre-commit read theirs): a config next to its data names it `qa.csv`, from any working directory.
What a run writes goes where the command runs, as every peer trainer writes its outputs (TRL,
torchtune, Axolotl): `output_dir: runs/lora-qa` in `examples/lora-csv-qa.yaml` is `./runs/lora-qa`
from the repository root, where the next command (`featherweight chat runs/lora-qa`) looks for it.
A relative path given on the command line (`--set data.train=qa.csv`) or in Python is read from
the working directory, as any command-line path is. Either way the run records absolute paths, so
a resume or an export from elsewhere reads the same files, and the output_dir is always a path
(`runs/a` is never taken for a name).

A value that names something instead of a file stays a name when no path of that name exists:
`demo`, a Hugging Face dataset (`org/name`) or Hub model (`org/name`), a built-in chat template.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from featherweight.data.chat_templates import CHAT_TEMPLATES
from featherweight.data.sources import looks_like_dataset_name
from featherweight.errors import CheckpointNotFoundError, ConfigError, DataError, FeatherweightError
from featherweight.io.hub import looks_like_hub_name
from featherweight.io.output_paths import resolved


def _model_name(value: str) -> bool:
    return value == "demo" or looks_like_hub_name(value)


def _dataset_name(value: str) -> bool:
    return value == "demo" or looks_like_dataset_name(value)


def _template_name(value: str) -> bool:
    return value in CHAT_TEMPLATES


def _never_a_name(_value: str) -> bool:
    return False


# (section, field) of every path setting -> the names it may hold instead of a path
PATH_SETTINGS: dict[tuple[str, ...], Callable[[str], bool]] = {
    ("model", "path"): _model_name,
    ("data", "train"): _dataset_name,
    ("data", "eval"): _dataset_name,
    ("data", "chat_template"): _template_name,
    ("output_dir",): _never_a_name,
}
# the settings a run writes to: read from the working directory even when written in a config file
OUTPUT_SETTINGS = {("output_dir",)}


def _dotted(key: tuple[str, ...]) -> str:
    return ".".join(key)


def path_from(base: Path, value: str) -> Path:
    """`value` as a path read from `base` (`~` expanded; absolute paths stay as they are)."""
    return resolved(base / Path(value).expanduser())


def absolute_value(key: tuple[str, ...], value: str, base: Path) -> str:
    """The setting `key`'s `value` with a relative path read from `base`; a name (see
    PATH_SETTINGS) stays a name unless a path of that name exists there."""
    path = path_from(base, value)
    return value if PATH_SETTINGS[key](value) and not path.exists() else str(path)


def absolute_paths(config, base: Path | None = None):
    """`config` (a TrainConfig) with every relative path read from `base` (the working
    directory by default); the other settings, and which of them were set, stay as they are."""
    base = Path.cwd() if base is None else base
    updates: dict[str, dict[str, str | None]] = {}
    for key in PATH_SETTINGS:
        *section, field = key
        holder = getattr(config, section[0]) if section else config
        value = getattr(holder, field)
        if isinstance(value, str):
            updates.setdefault(section[0] if section else "", {})[field] = absolute_value(
                key, value, base
            )
    top = updates.pop("", {})
    sections = {
        name: getattr(config, name).model_copy(update=fields) for name, fields in updates.items()
    }
    return config.model_copy(update={**top, **sections})


def _missing_path_error(key: tuple[str, ...]) -> type[FeatherweightError]:
    return {"model": CheckpointNotFoundError, "data": DataError}.get(key[0], ConfigError)


def from_config_folder(
    values: dict[str, Any], config_file: Path, skip: set[str], line_of: Callable[[str], str]
) -> dict[str, Any]:
    """The settings `values` read from `config_file`, with each relative input path read from the
    file's folder (settings named in `skip`, overridden on the command line, and the outputs,
    read from the working directory, are left alone). An input that is not there is refused now,
    naming where it was looked for and why."""
    base = resolved(config_file).parent
    for key, is_name in PATH_SETTINGS.items():
        holder: Any = values
        for part in key[:-1]:
            holder = holder.get(part) if isinstance(holder, dict) else None
        value = holder.get(key[-1]) if isinstance(holder, dict) else None
        if key in OUTPUT_SETTINGS or _dotted(key) in skip:
            continue
        if not isinstance(value, str) or not value.strip():
            continue
        path = path_from(base, value)
        if is_name(value) and not path.exists():
            continue
        holder[key[-1]] = str(path)
        if not Path(value).expanduser().is_absolute() and not path.exists():
            raise _missing_path_error(key)(
                f"{config_file}{line_of(_dotted(key))}: {_dotted(key)} {value!r} is not at {path}; "
                f"a relative path in a config file is read from the config's folder {base}, not "
                f"the working directory{_in_working_directory(value, base)} -- fix the path, or "
                "make it absolute"
            )
    return values


def reward_files_from(values: dict[str, Any], base: Path, skip: set[str]) -> dict[str, Any]:
    """`values` with each reward named as a relative "file.py:function" (grpo.rewards) read from
    `base`, the config's folder: a missing file is refused when the rewards are loaded."""
    grpo = values.get("grpo")
    rewards = grpo.get("rewards") if isinstance(grpo, dict) else None
    if "grpo.rewards" in skip or not isinstance(rewards, list):
        return values
    for index, reward in enumerate(rewards):
        location, _, function = reward.rpartition(":") if isinstance(reward, str) else ("", "", "")
        if location.endswith(".py") and not Path(location).expanduser().is_absolute():
            rewards[index] = f"{path_from(base, location)}:{function}"
    return values


def _in_working_directory(value: str, base: Path) -> str:
    """A hint when the path a config names is where the working directory would have read it."""
    if not Path(value).expanduser().exists():
        return ""
    return f" (it is in the working directory: write {os.path.relpath(resolved(value), base)})"
