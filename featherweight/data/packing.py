"""Sequence packing: tokenized examples -> fixed-length rows -> `Batch`es.

Short examples are packed several to a row so that no compute is spent on padding. Each example
keeps its own segment id (1, 2, ... within a row; 0 is padding) and its own positions (restarting
at 0), so the model's block-diagonal causal mask keeps packed examples from attending to each
other and each example sees exactly the rotary positions it would see alone.

Rows hold example indices, not token copies: a packed dataset costs its tokens once, and a batch's
arrays are built only when it is asked for.
"""

from __future__ import annotations

import bisect
import zlib
from collections.abc import Sequence
from typing import Literal, NamedTuple

import numpy as np

from featherweight.errors import ConfigError, DataError
from featherweight.models.batch import Batch

Overflow = Literal["truncate", "error"]


class Example(NamedTuple):
    """One tokenized example.

    ids: int32 [n] token ids. target_mask: bool [n], True where the token is a training target
    (it is predicted from the tokens before it), e.g. the response of an instruction. location:
    "file:line" of the record, for error messages.
    """

    ids: np.ndarray
    target_mask: np.ndarray
    location: str = "<memory>"


class PackStats(NamedTuple):
    """What packing did: counts of examples, rows and tokens, and what did not fit."""

    examples: int
    rows: int
    tokens: int  # real (non-padding) tokens in all rows
    padding_tokens: int  # row slots left empty
    loss_tokens: int  # targets that count in the loss
    truncated_examples: int  # longer than a row, cut to the row length
    truncated_tokens: int  # tokens cut off those examples
    dropped_examples: int  # left with no loss token after truncation
    most_per_row: int = 0  # the most examples one row holds (cuDNN's packed slots must hold it)

    @property
    def fill(self) -> float:
        """Fraction of row slots holding real tokens (1.0 = no padding)."""
        return self.tokens / max(1, self.tokens + self.padding_tokens)


class PackedRows(NamedTuple):
    """Examples packed into rows of `seq_len + 1` tokens (inputs are the first `seq_len`, targets
    the last `seq_len`). `rows[r]` lists the indices into `examples` packed into row r, in order.

    Preference pairs (`pairs`): examples 2p and 2p + 1 are pair p's chosen and rejected
    completions, and batches number them (`Batch.sequence_ids`); `group` consecutive rows always
    go into the same batch, in order (2: a pair padded into two rows). `reference` holds each
    example's precomputed reference log-probs (float32 per token, 0 for the first), when made.
    """

    examples: tuple[Example, ...]
    rows: tuple[tuple[int, ...], ...]
    seq_len: int
    pad_id: int
    pairs: bool = False
    group: int = 1
    reference: tuple[np.ndarray, ...] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def fingerprint(self) -> int:
        """A CRC of the rows' tokens and layout: resuming on different data is refused with it."""
        crc = zlib.crc32(np.asarray([self.seq_len, len(self.rows)], np.int64).tobytes())
        for row in self.rows:
            crc = zlib.crc32(np.asarray(row, np.int64).tobytes(), crc)
            for index in row:
                crc = zlib.crc32(self.examples[index].ids.tobytes(), crc)
        return crc


def _fit(example: Example, capacity: int, overflow: Overflow) -> tuple[Example, int]:
    """The example cut to `capacity` tokens (with the count cut), or a DataError if refused."""
    excess = len(example.ids) - capacity
    if excess <= 0:
        return example, 0
    if overflow == "error":
        raise DataError(
            f"{example.location}: example has {len(example.ids)} tokens, more than a row holds "
            f"(seq_len + 1 = {capacity}); raise seq_len, shorten the example, or set "
            "overflow='truncate' to cut it"
        )
    return example._replace(
        ids=example.ids[:capacity], target_mask=example.target_mask[:capacity]
    ), excess


def pack(
    examples: Sequence[Example],
    seq_len: int,
    pad_id: int,
    overflow: Overflow = "truncate",
    several_per_row: bool = True,
    max_per_row: int | None = None,
) -> tuple[PackedRows, PackStats]:
    """Pack examples into rows of `seq_len + 1` tokens by best-fit decreasing
    (`several_per_row=False`: one example per row, in order, the rest padding), at most
    `max_per_row` examples a row (None: as many as fit).

    Longest examples are placed first, each into the fullest row that still has room (ties keep
    the input order, so the result is deterministic). An example longer than a row is cut to
    the row length (`overflow="truncate"`, counted) or refused with a DataError naming its line
    (`overflow="error"`). Examples left with no loss token (the first token of an example is never
    a target) are dropped and counted.
    """
    if overflow not in ("truncate", "error"):
        raise ConfigError(f"overflow must be 'truncate' or 'error', got {overflow!r}")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be at least 1, got {seq_len}")
    capacity = seq_len + 1
    kept: list[Example] = []
    truncated_examples = truncated_tokens = dropped = 0
    for example in examples:
        fitted, cut = _fit(example, capacity, overflow)
        truncated_examples += cut > 0
        truncated_tokens += cut
        if not fitted.target_mask[1:].any():
            dropped += 1
            continue
        kept.append(fitted)
    counts = (truncated_examples, truncated_tokens, dropped)
    if not several_per_row:
        return _packed(kept, [[index] for index in range(len(kept))], seq_len, pad_id, counts)
    rows = best_fit_rows([len(example.ids) for example in kept], capacity, max_per_row)
    return _packed(kept, rows, seq_len, pad_id, counts)


def best_fit_rows(
    lengths: Sequence[int], capacity: int, max_per_row: int | None = None
) -> list[list[int]]:
    """Item indices grouped into rows of `capacity` slots by best-fit decreasing: longest first,
    each into the fullest row that still has room and fewer than `max_per_row` items (None: no
    limit); ties keep the input order: deterministic."""
    if max_per_row is not None and max_per_row < 1:
        raise ConfigError(f"max_per_row must be at least 1, got {max_per_row}")
    order = sorted(range(len(lengths)), key=lambda index: -lengths[index])
    rows: list[list[int]] = []
    open_rows: list[tuple[int, int]] = []  # (free slots, row index), sorted
    for index in order:
        slot = bisect.bisect_left(open_rows, (lengths[index], -1))
        if slot == len(open_rows):
            rows.append([index])
            free, row = capacity - lengths[index], len(rows) - 1
        else:
            free, row = open_rows.pop(slot)
            rows[row].append(index)
            free -= lengths[index]
        if free > 0 and (max_per_row is None or len(rows[row]) < max_per_row):
            bisect.insort(open_rows, (free, row))
    return rows


def _packed(
    kept: list[Example], rows: list[list[int]], seq_len: int, pad_id: int, counts: tuple[int, ...]
) -> tuple[PackedRows, PackStats]:
    """The rows and their statistics; `counts`: (truncated examples, tokens cut, dropped)."""
    packed = PackedRows(tuple(kept), tuple(tuple(row) for row in rows), seq_len, pad_id)
    tokens = sum(len(example.ids) for example in kept)
    stats = PackStats(
        examples=len(kept),
        rows=len(rows),
        tokens=tokens,
        padding_tokens=len(rows) * (seq_len + 1) - tokens,
        loss_tokens=sum(int(example.target_mask[1:].sum()) for example in kept),
        truncated_examples=counts[0],
        truncated_tokens=counts[1],
        dropped_examples=counts[2],
        most_per_row=max((len(row) for row in rows), default=0),
    )
    return packed, stats


def row_tokens(packed: PackedRows, row: int | None) -> tuple[np.ndarray, ...]:
    """Token ids, target mask, segment ids and positions of one row, each [seq_len + 1].

    `row=None` gives an all-padding row (segment 0, no targets).
    """
    capacity = packed.seq_len + 1
    tokens = np.full(capacity, packed.pad_id, np.int32)
    targets = np.zeros(capacity, bool)
    segments = np.zeros(capacity, np.int32)
    positions = np.zeros(capacity, np.int32)
    start = 0
    for segment, index in enumerate(packed.rows[row] if row is not None else (), start=1):
        example = packed.examples[index]
        end = start + len(example.ids)
        tokens[start:end] = example.ids
        targets[start:end] = example.target_mask
        segments[start:end] = segment
        positions[start:end] = np.arange(end - start)
        start = end
    return tokens, targets, segments, positions


def make_batch(packed: PackedRows, rows: Sequence[int | None], shard: int = 0) -> Batch:
    """A `Batch` of numpy arrays [len(rows), seq_len] from row indices (None = padding row).

    target_ids[t] = token t+1; loss_mask[t] is 1 only when token t+1 is a target of the same
    example as token t, so no example is ever predicted from another one's last token. `shard`:
    which of a global batch's equal parts these rows are (a process's), so that the completion
    ids of preference pairs are numbered apart from the other parts'.
    """
    tokens, targets, segments, positions = (
        np.stack(parts) for parts in zip(*(row_tokens(packed, row) for row in rows))
    )
    same_example = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)
    loss_mask = (targets[:, 1:] & same_example).astype(np.float32)
    sequence_ids = reference = None
    if packed.pairs:
        ids = _sequence_ids(packed, rows)[:, :-1]
        sequence_ids = np.where(ids < 0, ids, ids + shard * ids.size).astype(np.int32)
    if packed.reference is not None:
        reference = _row_values(packed, rows, packed.reference)[:, 1:] * loss_mask
    return Batch(
        input_ids=tokens[:, :-1],
        target_ids=tokens[:, 1:],
        loss_mask=loss_mask,
        positions=positions[:, :-1],
        segment_ids=segments[:, :-1],
        sequence_ids=sequence_ids,
        reference_logps=reference,
    )


def _row_spans(packed: PackedRows, row: int | None):
    """(example index, start, end) of each example in a row, in order."""
    start = 0
    for index in packed.rows[row] if row is not None else ():
        end = start + len(packed.examples[index].ids)
        yield index, start, end
        start = end


def _sequence_ids(packed: PackedRows, rows: Sequence[int | None]) -> np.ndarray:
    """[len(rows), seq_len + 1] int32: each token's completion in the batch -- the pairs
    numbered in order of appearance, chosen 2q and rejected 2q + 1 -- and -1 for padding."""
    ids = np.full((len(rows), packed.seq_len + 1), -1, np.int32)
    numbers: dict[int, int] = {}
    for slot, row in enumerate(rows):
        for index, start, end in _row_spans(packed, row):
            pair = numbers.setdefault(index // 2, len(numbers))
            ids[slot, start:end] = 2 * pair + index % 2
    return ids


def _row_values(packed: PackedRows, rows: Sequence[int | None], values) -> np.ndarray:
    """[len(rows), seq_len + 1] float32: per-token `values` of each example, laid out as its
    tokens are."""
    out = np.zeros((len(rows), packed.seq_len + 1), np.float32)
    for slot, row in enumerate(rows):
        for index, start, end in _row_spans(packed, row):
            out[slot, start:end] = values[index]
    return out
