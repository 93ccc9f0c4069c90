"""Preference pairs: {prompt, chosen, rejected} records -> tokenized completions -> rows.

Record forms (TRL's): strings -- {"prompt": "...", "chosen": "...", "rejected": "..."} -- or
conversations -- the prompt a list of messages and each completion a list ending with the
assistant's reply; without a "prompt", chosen and rejected are whole conversations and the
prompt is every message before their last one. `data.columns` renames the fields as for SFT.

Each completion is tokenized as the SFT records are (`records.py`): a string prompt goes through
the chat template as a user turn when the tokenizer has one (as instruction records do, so that
`generate` meets the format it learned), else prompt + completion + EOS as plain text; the loss
is on the completion's tokens only (and the template's end of turn).

Rows: packed (`data.pack: true`), whole pairs are packed into rows of `seq_len + 1` tokens by
best-fit decreasing, each pair's chosen then rejected completion side by side; padded (`data.pack:
false`), each completion has a row and a pair's two rows stay together in every batch. A pair
longer than its room is cut at the completions' ends (`overflow: truncate`, counted) or refused
(`overflow: error`); a pair left without a completion token in either completion is dropped, with
its reason counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from featherweight.data.packing import Example, Overflow, PackedRows, best_fit_rows
from featherweight.data.records import (
    Dataset,
    Record,
    Skipped,
    chat_ids,
    plain_instruction_ids,
    read_records,
    refuse_empty,
    render_chat,
    require_chat_template,
    skip_reason,
    split,
)
from featherweight.errors import ConfigError, DataError
from featherweight.io.tokenizer import Tokenizer

NO_COMPLETION = "no completion token left within seq_len (the prompt fills the room)"


class PairExample(NamedTuple):
    """One tokenized pair: the chosen and the rejected completion, each after the same prompt."""

    chosen: Example
    rejected: Example

    @property
    def length(self) -> int:
        return len(self.chosen.ids) + len(self.rejected.ids)


def _conversations(fields: dict[str, Any]) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) message lists of a conversational pair."""
    chosen, rejected = fields["chosen"], fields["rejected"]
    if "prompt" in fields:
        return fields["prompt"], chosen, rejected
    if chosen[:-1] != rejected[:-1]:
        raise DataError(
            'chosen and rejected conversations without a "prompt" must share every message but '
            'their last; give the shared part as "prompt"'
        )
    return chosen[:-1], chosen[-1:], rejected[-1:]


def _completion(tokenizer: Tokenizer, prompt: list[dict], reply: list[dict], where: str):
    """Ids and targets of prompt + reply through the chat template: targets in the reply only."""
    ids, targets = chat_ids(tokenizer, prompt + reply, where)
    prompt_text = render_chat(tokenizer, prompt, True, where)
    offsets = tokenizer.backend.encode(render_chat(tokenizer, prompt + reply, False, where)).offsets
    before = np.asarray([start < len(prompt_text) for start, _ in offsets], bool)
    return ids, targets & ~before


def tokenize_pair(record: Record, tokenizer: Tokenizer) -> PairExample:
    """The pair's two tokenized completions (module docstring)."""
    fields, where = record.fields, record.location
    if isinstance(fields["chosen"], str):
        keys = ("chosen", "rejected")
        if tokenizer.chat_template is None:
            made = [plain_instruction_ids(tokenizer, fields["prompt"], fields[key]) for key in keys]
        else:
            prompt = [{"role": "user", "content": fields["prompt"]}]
            replies = [[{"role": "assistant", "content": fields[key]}] for key in keys]
            made = [_completion(tokenizer, prompt, reply, where) for reply in replies]
    else:
        require_chat_template(tokenizer, where)
        prompt, chosen, rejected = _conversations(fields)
        made = [_completion(tokenizer, prompt, reply, where) for reply in (chosen, rejected)]
    chosen, rejected = (Example(np.asarray(ids, np.int32), targets, where) for ids, targets in made)
    return PairExample(chosen, rejected)


def tokenize_pairs(
    records: Iterable[Record], tokenizer: Tokenizer, skip_bad: bool, skipped: Skipped
) -> list[PairExample]:
    """Every preference record tokenized; another record shape is refused (it would train
    nothing here), a pair the template refuses raises -- or with `skip_bad` is counted."""
    pairs = []
    for record in records:
        if record.shape != "preference":
            raise DataError(
                f"{record.location}: a record of the {record.shape} shape in a preference run; "
                "objective: dpo "
                'and orpo train on {"prompt", "chosen", "rejected"} records (strings or message '
                "lists), or set objective: sft"
            )
        try:
            pairs.append(tokenize_pair(record, tokenizer))
        except DataError as error:
            if not skip_bad:
                raise DataError(f"{record.location}: {error}") from None
            skipped.add(skip_reason(error, record.location), record.location)
    return pairs


class PairStats(NamedTuple):
    """What pairing and packing did: pairs kept, rows, tokens, truncations and drops."""

    pairs: int
    rows: int
    tokens: int  # real (non-padding) tokens in all rows
    padding_tokens: int
    loss_tokens: int
    truncated_pairs: int  # pairs with a completion cut to fit
    truncated_tokens: int
    dropped_pairs: int
    drop_reasons: tuple[tuple[str, int], ...] = ()
    most_per_row: int = 0  # the most examples one row holds (cuDNN's packed slots must hold it)

    @property
    def fill(self) -> float:
        return self.tokens / max(1, self.tokens + self.padding_tokens)


def _cut(example: Example, length: int) -> Example:
    return example._replace(ids=example.ids[:length], target_mask=example.target_mask[:length])


def _fit_pair(pair: PairExample, capacity: int, together: bool, overflow: Overflow):
    """(the pair cut to its room, tokens cut): `capacity` for each completion, or for both
    together when they share a row (the longer one cut first)."""
    lengths = [len(pair.chosen.ids), len(pair.rejected.ids)]
    if together and sum(lengths) > capacity:
        half = capacity // 2
        if min(lengths) >= half:
            room = [capacity - half, half]
        else:
            room = [capacity - lengths[1], lengths[1]] if lengths[0] > lengths[1] else [
                lengths[0], capacity - lengths[0]
            ]  # fmt: skip
    else:
        room = [capacity, capacity]
    excess = sum(max(0, n - r) for n, r in zip(lengths, room, strict=True))
    if excess and overflow == "error":
        raise DataError(
            f"{pair.chosen.location}: the pair has {lengths[0]} + {lengths[1]} tokens, more than "
            f"its room ({capacity} tokens {'per row' if together else 'per completion'}); raise "
            "data.seq_len, shorten it, or set data.overflow: truncate"
        )
    fitted = PairExample(_cut(pair.chosen, room[0]), _cut(pair.rejected, room[1]))
    return fitted, excess


def pack_pairs(
    pairs: Sequence[PairExample],
    seq_len: int,
    pad_id: int,
    overflow: Overflow = "truncate",
    several_per_row: bool = True,
    max_per_row: int | None = None,
) -> tuple[PackedRows, PairStats]:
    """Rows of `seq_len + 1` tokens holding the pairs (module docstring), at most `max_per_row`
    examples a row (None: as many as fit); a pair is two, so a row holds `max_per_row // 2`."""
    if several_per_row and max_per_row is not None and max_per_row < 2:
        raise ConfigError(
            f"data.max_documents_per_row={max_per_row} cannot hold a preference pair (two "
            "examples) in a packed row; set 2 or more, or data.pack: false"
        )
    capacity = seq_len + 1
    kept: list[PairExample] = []
    truncated = cut_tokens = 0
    drops: Counter[str] = Counter()
    for pair in pairs:
        fitted, cut = _fit_pair(pair, capacity, several_per_row, overflow)
        truncated, cut_tokens = truncated + (cut > 0), cut_tokens + cut
        if not (fitted.chosen.target_mask[1:].any() and fitted.rejected.target_mask[1:].any()):
            drops[NO_COMPLETION] += 1
            continue
        kept.append(fitted)
    examples = tuple(example for pair in kept for example in pair)
    if several_per_row:
        pairs_per_row = None if max_per_row is None else max_per_row // 2
        rows = best_fit_rows([pair.length for pair in kept], capacity, pairs_per_row)
        rows = [tuple(e for p in row for e in (2 * p, 2 * p + 1)) for row in rows]
    else:
        rows = [(index,) for index in range(len(examples))]
    packed = PackedRows(
        examples, tuple(rows), seq_len, pad_id, pairs=True, group=1 if several_per_row else 2
    )
    tokens = sum(len(example.ids) for example in examples)
    stats = PairStats(
        pairs=len(kept),
        rows=len(rows),
        tokens=tokens,
        padding_tokens=len(rows) * capacity - tokens,
        loss_tokens=sum(int(example.target_mask[1:].sum()) for example in examples),
        truncated_pairs=truncated,
        truncated_tokens=cut_tokens,
        dropped_pairs=sum(drops.values()),
        drop_reasons=tuple(drops.most_common()),
        most_per_row=max((len(row) for row in rows), default=0),
    )
    return packed, stats


def attach_reference(packed: PackedRows, row_logps: Sequence[np.ndarray]) -> PackedRows:
    """`packed` with each example's reference log-probs taken from per-row log-probs of the
    targets ([seq_len] per row, in row order: `row_logps[r][t]` is token t + 1's)."""
    values: list[np.ndarray | None] = [None] * len(packed.examples)
    for row, logps in zip(packed.rows, row_logps, strict=True):
        start = 0
        for index in row:
            length = len(packed.examples[index].ids)
            example = np.zeros(length, np.float32)
            example[1:] = logps[start : start + length - 1]
            values[index] = example
            start += length
    # (not `_replace`: a PackedRows' len() is its row count, which NamedTuple._make trips on)
    return PackedRows(*packed[:-1], reference=tuple(values))


def seq_len_hint(pairs: Sequence[PairExample], together: bool) -> str:
    """What `data.seq_len` would keep the pairs whole. Packed (`together`), a row holds a pair:
    seq_len counts both sequences, prompt + chosen and prompt + rejected (TRL's `max_length` counts
    one); padded, each sequence has a row of its own."""
    needs = sorted(
        (len(p.chosen.ids) + len(p.rejected.ids) if together else max(len(p.chosen.ids),
         len(p.rejected.ids))) - 1
        for p in pairs
    )  # fmt: skip
    counted = "both sequences of a pair (data.pack: true)" if together else "one sequence"
    return (
        f"data.seq_len={needs[-1]} keeps every pair whole, {needs[(len(needs) - 1) // 2]} half of "
        f"them (seq_len counts {counted}); raise data.seq_len"
    )


def prepare_preference_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    skip_bad: bool = False,
    overflow: Overflow = "truncate",
    eval_fraction: float = 0.0,
    seed: int = 0,
    columns: Mapping[str, str] | None = None,
    pack_examples: bool = True,
    max_per_row: int | None = None,
) -> Dataset:
    """Read, tokenize, split (seeded, by pair) and pack a preference dataset: a `Dataset` whose
    rows hold pairs (at most `max_per_row` examples a row) and whose stats are `PairStats`."""
    skipped = Skipped()
    pairs = tokenize_pairs(read_records(path, skip_bad, columns, skipped), tokenizer, skip_bad,
                           skipped)  # fmt: skip
    refuse_empty(path, len(pairs), skipped)
    train_pairs, eval_pairs = split(pairs, eval_fraction, seed)
    options = (seq_len, tokenizer.pad_id, overflow, pack_examples, max_per_row)
    train, train_stats = pack_pairs(train_pairs, *options)
    if train_stats.pairs == 0:
        raise DataError(
            f"dataset {path}: no pair keeps a completion token within seq_len={seq_len} "
            f"({train_stats.dropped_pairs} dropped: {NO_COMPLETION}); "
            + seq_len_hint(train_pairs, pack_examples)
        )
    evaluation, eval_stats = pack_pairs(eval_pairs, *options) if eval_pairs else (None, None)
    reasons = tuple(
        (reason, count, skipped.first[reason]) for reason, count in skipped.reasons.most_common()
    )
    return Dataset(
        train, evaluation, train_stats, eval_stats, skipped.count, len(pairs) + skipped.count,
        reasons,
    )  # fmt: skip
