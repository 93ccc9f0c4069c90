"""Training data: JSONL records -> tokenized examples with loss masks -> packed train/eval rows.

Three record shapes, told apart by their keys:

- text:        {"text": "..."}                                  loss on every token (+ EOS)
- instruction: {"instruction": "...", "input": "...", "output": "..."}   loss on the output only
- chat:        {"messages": [{"role": ..., "content": ...}, ...]}    loss on assistant turns only

Loss masks are found by rendering, not by knowing a template: the conversation is rendered once
and tokenized once (so the ids equal `transformers`' `apply_chat_template(tokenize=True)`), and the
characters of each assistant reply are located by rendering the conversation before it with
`add_generation_prompt=True`. Tokens inside a reply, and the template's end-of-turn token after it,
are targets; system and user turns and role headers are not. This works for any template whose
renderings of a conversation's prefixes are prefixes of its full rendering (checked, with an error
naming the line otherwise).

Every problem with the data is a `DataError` naming the file and line.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jinja2
import numpy as np

from featherweight.data.packing import Example, Overflow, PackedRows, PackStats, pack
from featherweight.errors import ConfigError, DataError, InputFileError, check_input_file
from featherweight.io.tokenizer import Tokenizer

_SPLIT_STREAM = 1  # the split's random stream; epoch orders use another (see train/iterator.py)
_SHAPES = (
    '{"text": ...}, {"instruction": ..., "input": ..., "output": ...} '
    'or {"messages": [{"role": ..., "content": ...}, ...]}'
)
Item = TypeVar("Item")


class Record(NamedTuple):
    """One parsed JSONL line: its object, its shape ("text" | "instruction" | "chat"), and where
    it came from."""

    fields: dict[str, Any]
    shape: str
    location: str


# --- reading ---------------------------------------------------------------------------------


def record_shape(fields: Any) -> str:
    """The shape ("text" | "instruction" | "chat") of a parsed JSONL value; a ValueError says what
    is wrong with a value that matches none."""
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    if "messages" in fields:
        messages = fields["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError('"messages" must be a non-empty list of {"role", "content"} objects')
        for number, message in enumerate(messages):
            if not (
                isinstance(message, dict)
                and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)
            ):
                raise ValueError(
                    f'message {number} must be an object with string "role" and "content"'
                )
        if not any(message["role"] == "assistant" for message in messages):
            raise ValueError("the conversation has no assistant message, so nothing to learn")
        return "chat"
    if "instruction" in fields or "output" in fields:
        for key in ("instruction", "output"):
            if not isinstance(fields.get(key), str):
                raise ValueError(f'instruction records need a string "{key}"')
        if not isinstance(fields.get("input") or "", str):
            raise ValueError('"input" must be a string when present')
        return "instruction"
    if "text" in fields:
        if not isinstance(fields["text"], str) or not fields["text"]:
            raise ValueError('"text" must be a non-empty string')
        return "text"
    raise ValueError(f"record has keys {sorted(fields)}; expected {_SHAPES}")


def _describe(error: ValueError) -> str:
    if isinstance(error, json.JSONDecodeError):
        return f"not valid JSON ({error.msg}: column {error.colno})"
    if isinstance(error, UnicodeDecodeError):
        return f"not valid UTF-8 ({error.reason} at byte {error.start})"
    if isinstance(error, UnicodeEncodeError):
        half = error.object[error.start : error.end].encode("unicode_escape").decode()
        return f'holds "{half}", half of a UTF-16 surrogate pair, which is not text'
    return str(error)


def _check_text(fields: Any) -> None:
    """Raise UnicodeEncodeError for a string that is not valid Unicode: JSON's "\\ud800" escape
    decodes to a lone surrogate, which no tokenizer can encode."""
    json.dumps(fields, ensure_ascii=False).encode("utf-8")


def _open_input(path: Path):
    try:
        return path.open("rb")
    except OSError as error:
        raise InputFileError(
            f"dataset {path} cannot be read ({error.strerror}); check that it is a file you may read"
        ) from None


def load_jsonl(path: str | Path, skip_bad: bool = False) -> tuple[list[Record], int]:
    """Read a JSONL dataset: (records, number of bad lines skipped). Blank lines are ignored.

    A line that is not JSON, or matches no record shape, raises a DataError naming the file and
    line -- or, with `skip_bad`, is skipped and counted. A missing or empty file, or one with no
    good line, raises a DataError.
    """
    path = check_input_file(
        path, "dataset", "pass a JSONL file (one JSON object per line)", DataError
    )
    records: list[Record] = []
    skipped = 0
    with _open_input(path) as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            location = f"{path}:{number}"
            try:
                fields = json.loads(raw.strip().decode("utf-8"))
                _check_text(fields)
                records.append(Record(fields, record_shape(fields), location))
            except ValueError as error:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
                if not skip_bad:
                    raise DataError(
                        f"{location}: {_describe(error)}; fix the line, or pass --skip-bad to skip "
                        "bad lines"
                    ) from None
                skipped += 1
    if not records:
        if skipped:
            raise DataError(f"dataset {path}: all {skipped} lines are bad and were skipped")
        raise DataError(f"dataset {path} is empty; it needs one JSON object per line")
    return records, skipped


# --- tokenizing --------------------------------------------------------------------------------


def _special_ids(tokenizer: Tokenizer) -> set[int]:
    """Ids of special tokens (end-of-turn markers among them)."""
    added = tokenizer.backend.get_added_tokens_decoder()
    special = {index for index, token in added.items() if token.special}
    return special | ({tokenizer.eos_id} if tokenizer.eos_id is not None else set())


def _mask_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """True for tokens whose characters overlap any [start, end) span."""
    starts = np.asarray([offset[0] for offset in offsets], np.int64)
    ends = np.asarray([offset[1] for offset in offsets], np.int64)
    mask = np.zeros(len(offsets), bool)
    for start, end in spans:
        mask |= (starts < end) & (ends > start)
    return mask


def _render(tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt)
    except jinja2.TemplateError as error:
        raise DataError(f"{where}: the chat template refused this conversation: {error}") from None


def _reply_span(text: str, start: int, turn_end: int, content: str) -> tuple[int, int]:
    """Characters of an assistant reply inside its rendered turn [start, turn_end).

    Templates may trim the content or put markup before it; the reply is found as the stripped
    content inside the turn, else the whole turn is taken.
    """
    reply = content.strip()
    found = text.find(reply, start, turn_end)
    if found < 0:
        return start, turn_end
    return found, found + len(reply)


def _reply_spans(
    tokenizer: Tokenizer, messages: list[dict], text: str, where: str
) -> list[tuple[int, int, int]]:
    """(reply start, reply end, turn end) characters of each assistant turn in the rendered `text`.

    The turn starts where the conversation before it, rendered with the generation prompt, ends;
    it ends where the conversation through it ends.
    """
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:turn], True, where)
        through = _render(tokenizer, messages[: turn + 1], False, where)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{where}: the chat template renders this conversation's turns differently from "
                "the whole conversation, so the assistant replies cannot be located; use "
                "instruction records or a template that renders turns in order"
            )
        reply_start, reply_end = _reply_span(text, len(before), len(through), message["content"])
        spans.append((reply_start, reply_end, len(through)))
    return spans


def _chat_ids(
    tokenizer: Tokenizer, messages: list[dict], where: str
) -> tuple[list[int], np.ndarray]:
    """Ids of the rendered conversation and its targets: each assistant reply + end of turn."""
    text = _render(tokenizer, messages, False, where)
    spans = _reply_spans(tokenizer, messages, text, where)
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    targets = _mask_spans(encoding.offsets, [(start, end) for start, end, _ in spans])
    special = _special_ids(tokenizer)
    token_starts = [offset[0] for offset in encoding.offsets]
    for _, reply_end, turn_end in spans:  # the first special token after a reply ends its turn
        first = bisect.bisect_left(token_starts, reply_end)
        for index in range(first, len(token_starts)):
            if token_starts[index] >= turn_end:
                break
            if encoding.ids[index] in special:
                targets[first : index + 1] = True
                break
    return encoding.ids, targets


def _plain_instruction(
    tokenizer: Tokenizer, prompt: str, response: str
) -> tuple[list[int], np.ndarray]:
    """Prompt + response in one encoding (BOS as the tokenizer adds it) + EOS; targets: response."""
    text = prompt + response
    encoding = tokenizer.backend.encode(text, add_special_tokens=True)
    targets = _mask_spans(encoding.offsets, [(len(prompt), len(text))])
    return _append_eos(tokenizer, encoding.ids, targets)


def _append_eos(tokenizer: Tokenizer, ids: list[int], targets: np.ndarray):
    if tokenizer.eos_id is None:
        return ids, targets
    return [*ids, tokenizer.eos_id], np.append(targets, True)


def instruction_messages(fields: dict[str, Any]) -> list[dict[str, str]]:
    """An instruction record as a user turn (instruction, blank line, input) and an assistant turn."""
    prompt = fields["instruction"]
    if fields.get("input"):
        prompt = f"{prompt}\n\n{fields['input']}"
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": fields["output"]}]


def plain_instruction_prompt(fields: dict[str, Any]) -> str:
    """The prompt of an instruction record for tokenizers without a chat template (Alpaca style)."""
    prompt = f"### Instruction:\n{fields['instruction']}\n\n"
    if fields.get("input"):
        prompt += f"### Input:\n{fields['input']}\n\n"
    return prompt + "### Response:\n"


def _require_template(tokenizer: Tokenizer, where: str) -> None:
    if tokenizer.chat_template is None:
        raise DataError(
            f"{where}: chat records need the model's chat template, and this tokenizer has none; "
            'use a model with a chat template, or {"instruction", "output"} / {"text"} records'
        )


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of `tokenizer` can cover: its longest vocabulary entry."""
    return max(len(token) for token in tokenizer.backend.get_vocab())


def tokenize_example(record: Record, tokenizer: Tokenizer, max_chars: int | None = None) -> Example:
    """Token ids and the targets of one record (see the module docstring for what is a target).

    Instruction records use the chat template when the tokenizer has one, else the plain
    "### Instruction / ### Input / ### Response" format. Chat records need a chat template.
    `max_chars` cuts a text record before it is tokenized (bounded memory for a huge record):
    callers pass more characters than the tokens they keep can cover.
    """
    fields, where = record.fields, record.location
    if record.shape == "text":
        text = fields["text"] if max_chars is None else fields["text"][:max_chars]
        ids = tokenizer.encode(text, add_special_tokens=True)
        ids, targets = _append_eos(tokenizer, ids, np.ones(len(ids), bool))
    elif record.shape == "instruction" and tokenizer.chat_template is None:
        ids, targets = _plain_instruction(
            tokenizer, plain_instruction_prompt(fields), fields["output"]
        )
    elif record.shape == "instruction":
        ids, targets = _chat_ids(tokenizer, instruction_messages(fields), where)
    else:
        _require_template(tokenizer, where)
        ids, targets = _chat_ids(tokenizer, fields["messages"], where)
    return Example(np.asarray(ids, np.int32), targets, where)


def tokenize_records(
    records: Sequence[Record],
    tokenizer: Tokenizer,
    skip_bad: bool = False,
    max_tokens: int | None = None,
) -> tuple[list[Example], int]:
    """Tokenize every record: (examples, number skipped). A record the template refuses raises
    its DataError, or with `skip_bad` is skipped and counted. A tokenizer without a chat template
    meeting chat records is a setting problem and raises whatever `skip_bad` says.

    With `max_tokens` (what packing keeps of an example at most), a text record is cut to
    `(max_tokens + 2) x max_token_chars` characters before tokenizing: every kept token is the same
    as from the whole text (a cut can change only the token it falls in), and a multi-megabyte
    record costs memory in proportion to the sequence length, not to its size."""
    max_chars = None if max_tokens is None else (max_tokens + 2) * max_token_chars(tokenizer)
    chat = next((record for record in records if record.shape == "chat"), None)
    if chat is not None:
        _require_template(tokenizer, chat.location)
    examples, skipped = [], 0
    for record in records:
        try:
            examples.append(tokenize_example(record, tokenizer, max_chars))
        except DataError:
            if not skip_bad:
                raise
            skipped += 1
    return examples, skipped


# --- splitting and the whole pipeline ----------------------------------------------------------


def split(items: Sequence[Item], eval_fraction: float, seed: int) -> tuple[list[Item], list[Item]]:
    """A seeded shuffle of `items` cut into (train, eval): disjoint, and the same for the same
    seed. `eval_fraction` > 0 keeps at least one eval item; the train part must not be empty."""
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    order = np.random.default_rng((seed, _SPLIT_STREAM)).permutation(len(items))
    num_eval = max(1, round(len(items) * eval_fraction)) if eval_fraction > 0 else 0
    if num_eval >= len(items):
        raise DataError(
            f"{len(items)} examples cannot give both a train and an eval set "
            f"(eval_fraction={eval_fraction}); add examples or set eval_fraction to 0"
        )
    shuffled = [items[int(index)] for index in order]
    return shuffled[num_eval:], shuffled[:num_eval]


class Dataset(NamedTuple):
    """A prepared dataset: packed train and eval rows and what preparing them did."""

    train: PackedRows
    eval: PackedRows | None
    train_stats: PackStats
    eval_stats: PackStats | None
    skipped: int  # bad lines or records skipped with skip_bad


def prepare_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    skip_bad: bool = False,
    overflow: Overflow = "truncate",
    eval_fraction: float = 0.0,
    seed: int = 0,
) -> Dataset:
    """Read, tokenize, split (seeded) and pack a JSONL file into rows of `seq_len + 1` tokens."""
    records, skipped_lines = load_jsonl(path, skip_bad)
    # packing keeps at most seq_len + 1 tokens of an example ("truncate"), and "error" refuses
    # one longer than that, which a cut at more characters than those tokens cover still shows
    examples, skipped_records = tokenize_records(records, tokenizer, skip_bad, seq_len + 1)
    if not examples:
        raise DataError(f"dataset {path}: every record was skipped; nothing is left to train on")
    train_examples, eval_examples = split(examples, eval_fraction, seed)
    train, train_stats = pack(train_examples, seq_len, tokenizer.pad_id, overflow)
    if train_stats.rows == 0:
        raise DataError(
            f"dataset {path}: no training example has a loss token within seq_len={seq_len}; "
            "raise seq_len"
        )
    evaluation, eval_stats = (
        pack(eval_examples, seq_len, tokenizer.pad_id, overflow) if eval_examples else (None, None)
    )
    return Dataset(train, evaluation, train_stats, eval_stats, skipped_lines + skipped_records)
