"""A seeded, resumable, multi-host iterator over packed rows.

Every batch is a pure function of (seed, epoch, step): the epoch's row order is a permutation
drawn from `(seed, epoch)`, and step s takes the next `batch_size x process_count` rows of it.
The iterator's position is therefore four integers (`DataState`), saved with a checkpoint;
restoring them yields exactly the batches an uninterrupted run would have seen, with nothing
buffered to lose.

With several processes (multi-host data parallelism), process p takes the p-th `batch_size` rows
of each step's global batch: each process reads only its own shard, and all of them agree on the
number of steps per epoch. The last step of an epoch is filled up with rows from the start of the
same epoch's order, so every batch is full and shapes never change.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import NamedTuple

import numpy as np

from featherweight.data.packing import PackedRows, make_batch
from featherweight.errors import ConfigError, DataError
from featherweight.models.batch import Batch

_EPOCH_STREAM = 2  # keeps epoch orders apart from the train/eval split's stream of the same seed


class DataState(NamedTuple):
    """The iterator's position: a small pytree of ints, saved in checkpoints.

    step counts the (global) steps already taken in `epoch`. fingerprint identifies the packed
    data, so a checkpoint is not resumed on a different dataset by mistake.
    """

    seed: int
    epoch: int
    step: int
    fingerprint: int

    def as_dict(self) -> dict[str, int]:
        return {name: int(value) for name, value in self._asdict().items()}


def epoch_order(num_rows: int, seed: int, epoch: int, group: int = 1) -> np.ndarray:
    """The row order of one epoch: a permutation seeded by (seed, epoch) -- of groups of `group`
    consecutive rows (a padded preference pair's two rows), each kept together and in order."""
    rng = np.random.default_rng((seed, _EPOCH_STREAM, epoch))
    if group == 1:
        return rng.permutation(num_rows)
    groups = rng.permutation(num_rows // group)
    return (groups[:, None] * group + np.arange(group)).reshape(-1)


def _check_shard(batch_size: int, process_index: int, process_count: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}")
    if process_count < 1 or not 0 <= process_index < process_count:
        raise ConfigError(
            f"process_index {process_index} is not in [0, process_count={process_count}); "
            "pass jax.process_index() and jax.process_count()"
        )


class DataIterator:
    """Endless iterator of training `Batch`es (numpy, [batch_size, seq_len]) over packed rows."""

    def __init__(
        self,
        packed: PackedRows,
        batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        state: DataState | Mapping[str, int] | None = None,
    ) -> None:
        _check_shard(batch_size, process_index, process_count)
        if len(packed) == 0:
            raise DataError("the training set packed into no rows; add examples")
        if batch_size % packed.group:
            raise ConfigError(
                f"batch_size={batch_size} must be a multiple of {packed.group}: each preference "
                f"pair takes {packed.group} rows when not packed (data.pack: false)"
            )
        self.packed = packed
        self.batch_size = batch_size
        self.process_index = process_index
        self.process_count = process_count
        self._fingerprint = packed.fingerprint()
        self._seed, self._epoch, self._step = seed, 0, 0
        self._order = epoch_order(len(packed), seed, 0, packed.group)
        if state is not None:
            self.restore(state)

    @property
    def steps_per_epoch(self) -> int:
        """Global steps in one pass over the rows (the last one topped up from the start)."""
        global_batch = self.batch_size * self.process_count
        return -(-len(self.packed) // global_batch)

    @property
    def state(self) -> DataState:
        return DataState(self._seed, self._epoch, self._step, self._fingerprint)

    def restore(self, state: DataState | Mapping[str, int]) -> None:
        """Continue from a saved position (a DataState or its dict, e.g. read from a checkpoint).

        The saved seed replaces the one given to the constructor."""
        values = dict(state._asdict() if isinstance(state, DataState) else state)
        missing = {"seed", "epoch", "step", "fingerprint"} - values.keys()
        if missing:
            raise DataError(f"data iterator state lacks {sorted(missing)}; got {sorted(values)}")
        if int(values["fingerprint"]) != self._fingerprint:
            raise DataError(
                "the checkpoint's data state was saved for a different dataset (fingerprint "
                f"{int(values['fingerprint'])}, this data has {self._fingerprint}): use the same "
                "data file, tokenizer, seq_len and eval split, or start a fresh run"
            )
        self._seed, self._epoch, self._step = (
            int(values["seed"]),
            int(values["epoch"]),
            int(values["step"]),
        )
        self._order = epoch_order(len(self.packed), self._seed, self._epoch, self.packed.group)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        if self._step >= self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            self._order = epoch_order(len(self.packed), self._seed, self._epoch, self.packed.group)
        first = (self._step * self.process_count + self.process_index) * self.batch_size
        slots = np.arange(first, first + self.batch_size) % len(self.packed)
        self._step += 1
        return make_batch(self.packed, [int(row) for row in self._order[slots]], self.process_index)


def eval_batches(
    packed: PackedRows, batch_size: int, process_index: int = 0, process_count: int = 1
) -> Iterator[Batch]:
    """One pass over the rows in order, each row once; the last batches are padded with empty
    rows (no loss), so every process yields the same number of full-shape batches."""
    _check_shard(batch_size, process_index, process_count)
    global_batch = batch_size * process_count
    for step in range(-(-len(packed) // global_batch)):
        first = (step * process_count + process_index) * batch_size
        yield make_batch(
            packed,
            [slot if slot < len(packed) else None for slot in range(first, first + batch_size)],
            process_index,
        )
