"""What DPO and ORPO share: preference pairs as data, and the checks of a batch of pairs.

A record is TRL's {prompt, chosen, rejected}; a pair's two completions lie in one packed row or
in two consecutive padded rows, kept together (`data/preference.py`). The objectives average
over a batch's pairs, so a batch is never split into micro-batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from featherweight.data.preference import prepare_preference_dataset
from featherweight.data.records import Dataset
from featherweight.errors import ConfigError
from featherweight.io.tokenizer import Tokenizer
from featherweight.recipe.schema import TrainConfig


def prepare_pairs(
    path: str | Path, tokenizer: Tokenizer, seq_len: int, *, instruction_template: Any = None,
    **options: Any,
) -> Dataset:  # fmt: skip
    """The dataset of preference pairs, with `prepare_dataset`'s signature: a pair's prompt is
    given, so no instruction template applies."""
    del instruction_template
    return prepare_preference_dataset(path, tokenizer, seq_len, **options)


def check_pairs(config: TrainConfig) -> None:
    """Refuse batch settings a preference objective cannot train (a `ConfigError` naming the
    config keys, before anything is read)."""
    most = config.data.max_documents_per_row
    if config.data.pack and most is not None and most < 2:
        raise ConfigError(
            f"data.max_documents_per_row={most} cannot hold a preference pair (two examples) in "
            "a packed row; set 2 or more, or data.pack: false"
        )
    if config.memory.accumulation_steps > 1:
        raise ConfigError(
            f"objective: {config.objective} averages over each batch's pairs, so "
            "memory.accumulation_steps > 1 is not supported; set it to 1 (a smaller batch_size, "
            "or memory.residuals: host, fits the memory instead)"
        )
