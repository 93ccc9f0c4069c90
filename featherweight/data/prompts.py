"""GRPO's data: prompt records, and the resumable order a run takes them in.

A record is TRL's prompt-only form: {"prompt": text or a list of {"role", "content"} messages,
any other columns}; the other columns are passed to the reward functions by name. Nothing is
tokenized here: the rollouts turn each step's prompts into ids (`train/grpo_rollouts.py`).

The order is `data/iterator.py`'s: an epoch is a permutation of the records drawn from
(seed, epoch), step s takes the next `prompts_per_step` of it (the last step of an epoch topped
up from its start), and the position is four integers saved with a checkpoint -- a resumed run
takes exactly the prompts an uninterrupted one would have.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from featherweight.data.iterator import DataState, epoch_order
from featherweight.data.records import Skipped, _check_messages, refuse_empty, skip_reason
from featherweight.data.sources import map_columns, parse_jsonl_line, read_raw_records
from featherweight.errors import DataError


class PromptSet(NamedTuple):
    """A run's prompt records (`train`), what reading them skipped, and no eval split."""

    train: list[dict[str, Any]]
    skipped: int = 0
    records: int = 0
    skip_reasons: tuple[tuple[str, int, str], ...] = ()
    eval: None = None


def check_prompt_record(fields: Any) -> dict[str, Any]:
    """`fields` if it is a prompt record (module docstring), else a ValueError saying why."""
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    if "prompt" not in fields:
        raise ValueError(
            f'GRPO records need a "prompt" (text or messages); this one has keys {sorted(fields)}'
        )
    prompt = fields["prompt"]
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError('"prompt" is empty')
        return fields
    _check_messages(prompt, "prompt")
    return fields


def read_prompts(
    source: str | Path, skip_bad: bool = False, columns: Mapping[str, str] | None = None
) -> PromptSet:
    """Every prompt record of `source` (any format `data/sources.py` reads); a bad one raises a
    `DataError` naming its file and line, or with `skip_bad` is counted and skipped."""
    skipped, kept, read = Skipped(), [], 0
    for raw in read_raw_records(source):
        read += 1
        try:
            value = parse_jsonl_line(raw.fields) if isinstance(raw.fields, bytes) else raw.fields
            kept.append(check_prompt_record(map_columns(value, columns)))
        except (ValueError, RecursionError) as error:
            if not skip_bad:
                raise DataError(
                    f"{raw.location}: {error}; fix the record, or pass --skip-bad to skip (and "
                    "count) bad records"
                ) from None
            skipped.add(skip_reason(error, raw.location), raw.location)
    refuse_empty(source, len(kept), skipped)
    reasons = tuple(
        (reason, count, skipped.first[reason]) for reason, count in skipped.reasons.most_common()
    )
    return PromptSet(kept, skipped.count, read, reasons)


def prompts_fingerprint(records: list[dict[str, Any]]) -> int:
    """A CRC of the records: resuming on different prompts is refused with it."""
    crc = 0
    for record in records:
        crc = zlib.crc32(json.dumps(record, sort_keys=True).encode(), crc)
    return crc


class PromptIterator:
    """Endless iterator of each step's prompt records (module docstring); `state`, `restore` and
    `steps_per_epoch` as `data.iterator.DataIterator`'s, so checkpoints hold it the same way."""

    def __init__(self, records: list[dict[str, Any]], prompts_per_step: int, seed: int = 0):
        if not records:
            raise DataError("the prompt set is empty; add prompt records")
        self.records, self.prompts_per_step = records, prompts_per_step
        self._fingerprint = prompts_fingerprint(records)
        self._seed, self._epoch, self._step = seed, 0, 0
        self._order = epoch_order(len(records), seed, 0)

    @property
    def steps_per_epoch(self) -> int:
        return -(-len(self.records) // self.prompts_per_step)

    @property
    def state(self) -> DataState:
        return DataState(self._seed, self._epoch, self._step, self._fingerprint)

    def restore(self, state: Mapping[str, int]) -> None:
        """Continue from a saved position (a checkpoint's data state)."""
        if int(state["fingerprint"]) != self._fingerprint:
            raise DataError(
                "the checkpoint's data state was saved for different prompts (fingerprint "
                f"{int(state['fingerprint'])}, these have {self._fingerprint}): use the same "
                "prompt file, or start a fresh run"
            )
        self._seed, self._epoch, self._step = (
            int(state["seed"]),
            int(state["epoch"]),
            int(state["step"]),
        )
        self._order = epoch_order(len(self.records), self._seed, self._epoch)

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        return self

    def __next__(self) -> list[dict[str, Any]]:
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            self._order = epoch_order(len(self.records), self._seed, self._epoch)
        first = self._step * self.prompts_per_step
        slots = np.arange(first, first + self.prompts_per_step) % len(self.records)
        self._step += 1
        return [self.records[int(index)] for index in self._order[slots]]
