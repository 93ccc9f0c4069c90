"""Training data: records (any format `data/sources.py` reads) -> tokenized examples with loss
masks -> packed train/eval rows. Records stream through: only the tokenized examples are kept.

Three record shapes, told apart by their keys:

- text:        {"text": "..."}                                  loss on every token (+ EOS)
- instruction: {"instruction": "...", "input": "...", "output": "..."}   loss on the output only
- chat:        {"messages": [{"role": ..., "content": ...}, ...]}    loss on assistant turns only
- preference:  {"prompt", "chosen", "rejected"} (strings, or message lists; `data/preference.py`)

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
import string
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jinja2
import numpy as np

from featherweight.data.packing import Example, Overflow, PackedRows, PackStats, pack
from featherweight.data.sources import (
    is_jsonl,
    map_columns,
    parse_jsonl_line,
    read_raw_records,
)
from featherweight.errors import ConfigError, DataError
from featherweight.io.tokenizer import Tokenizer

_SPLIT_STREAM = 1  # the split's random stream; epoch orders use another (see data/iterator.py)
_SHAPES = (
    '{"text": ...}, {"instruction": ..., "input": ..., "output": ...}, '
    '{"messages": [{"role": ..., "content": ...}, ...]} or {"prompt", "chosen", "rejected"}'
)
Item = TypeVar("Item")


class Record(NamedTuple):
    """One parsed record: its fields, its shape ("text" | "instruction" | "chat"), and where
    it came from."""

    fields: dict[str, Any]
    shape: str
    location: str


# --- reading ---------------------------------------------------------------------------------


def _check_messages(messages: Any, key: str = "messages") -> None:
    """A ValueError unless `messages` is a non-empty list of {"role", "content"} strings."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f'"{key}" must be a non-empty list of {{"role", "content"}} objects')
    for number, message in enumerate(messages):
        if not (
            isinstance(message, dict)
            and isinstance(message.get("role"), str)
            and isinstance(message.get("content"), str)
        ):
            raise ValueError(
                f'{key} message {number} must be an object with string "role" and "content"'
            )


def _check_preference(fields: dict) -> None:
    """A ValueError unless `fields` is a preference pair: TRL's {prompt, chosen, rejected} as
    strings, or as message lists (the prompt may be left out: then chosen and rejected are whole
    conversations that differ in their last, assistant, message)."""
    missing = [key for key in ("chosen", "rejected") if key not in fields]
    if missing:
        raise ValueError(
            f'preference records need "chosen" and "rejected"; this one lacks {missing}'
        )
    values = [fields[key] for key in ("prompt", "chosen", "rejected") if key in fields]
    if all(isinstance(value, str) for value in values):
        if "prompt" not in fields or not fields["prompt"]:
            raise ValueError('a preference record of strings needs a non-empty "prompt"')
        return
    for key in ("prompt", "chosen", "rejected"):
        if key in fields:
            _check_messages(fields[key], key)
    for key in ("chosen", "rejected"):
        if fields[key][-1]["role"] != "assistant":
            raise ValueError(f'the last message of "{key}" must be the assistant\'s reply')


def record_shape(fields: Any) -> str:
    """The shape ("text" | "instruction" | "chat" | "preference") of a parsed JSONL value; a
    ValueError says what is wrong with a value that matches none."""
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {type(fields).__name__}")
    if "chosen" in fields or "rejected" in fields:
        _check_preference(fields)
        return "preference"
    if "messages" in fields:
        messages = fields["messages"]
        _check_messages(messages)
        if not any(message["role"] == "assistant" for message in messages):
            raise ValueError("the conversation has no assistant message, so nothing to learn")
        return "chat"
    if "instruction" in fields or "output" in fields:
        for key in ("instruction", "output"):
            if not isinstance(fields.get(key), str):
                raise ValueError(f'instruction records need a string "{key}"')
        if not isinstance(fields.get("input") or "", str):
            raise ValueError('"input" must be a string when present')
        if not fields["output"].strip():
            raise ValueError(
                '"output" is empty (an empty answer cell?), so the record would train the model '
                "to answer nothing; fill it in, or skip such records with --skip-bad"
            )
        return "instruction"
    if "text" in fields:
        if not isinstance(fields["text"], str) or not fields["text"]:
            raise ValueError('"text" must be a non-empty string')
        return "text"
    raise ValueError(f"record has keys {sorted(fields)}; expected {_SHAPES}")


def _describe(error: Exception) -> str:
    if isinstance(error, RecursionError):
        return "nests deeper than Python's recursion limit allows (a record is a flat object)"
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


class Skipped:
    """Records skipped with skip_bad: how many, for what reason, and the first place of each."""

    def __init__(self) -> None:
        self.reasons: Counter[str] = Counter()
        self.first: dict[str, str] = {}

    @property
    def count(self) -> int:
        return sum(self.reasons.values())

    def add(self, reason: str, location: str) -> None:
        self.reasons[reason] += 1
        self.first.setdefault(reason, location)


def skip_reason(error: Exception, location: str) -> str:
    """A skip reason without its location, so equal problems count together."""
    if isinstance(error, RecursionError):
        return "nested too deeply"
    if isinstance(error, json.JSONDecodeError):
        return "not valid JSON"
    if isinstance(error, UnicodeDecodeError):
        return "not valid UTF-8"
    if isinstance(error, UnicodeEncodeError):
        return "holds half of a UTF-16 surrogate pair"
    text = str(error).removeprefix(f"{location}: ")
    return text.split(";")[0][:120]


def read_records(
    source: str | Path,
    skip_bad: bool = False,
    columns: Mapping[str, str] | None = None,
    skipped: Skipped | None = None,
) -> Iterator[Record]:
    """The good records of `source` (any format `data/sources.py` reads), one at a time.

    A record that is not JSON, or matches no record shape, raises a DataError naming the file and
    line (or record) -- or, with `skip_bad`, is skipped and counted in `skipped`. A missing source
    raises a DataError.
    """
    for raw in read_raw_records(source):
        try:
            value = parse_jsonl_line(raw.fields) if isinstance(raw.fields, bytes) else raw.fields
            fields = map_columns(value, columns)
            _check_text(fields)
            yield Record(fields, record_shape(fields), raw.location)
        # JSONDecodeError and UnicodeDecodeError are ValueErrors; a line nested thousands deep
        # exhausts the parser's recursion
        except (ValueError, RecursionError) as error:
            if not skip_bad:
                raise DataError(
                    f"{raw.location}: {_describe(error)}; fix the record, or pass --skip-bad to "
                    "skip (and count) bad records"
                ) from None
            if skipped is not None:
                skipped.add(skip_reason(error, raw.location), raw.location)


def refuse_empty(source: str | Path, kept: int, skipped: Skipped) -> None:
    if kept:
        return
    jsonl = is_jsonl(source)
    if skipped.count:
        what = "lines" if jsonl else "records"
        raise DataError(f"dataset {source}: all {skipped.count} {what} are bad and were skipped")
    needs = "one JSON object per line" if jsonl else "at least one record"
    raise DataError(f"dataset {source} is empty; it needs {needs}")


def load_jsonl(path: str | Path, skip_bad: bool = False) -> tuple[list[Record], int]:
    """Read a whole dataset (any format `read_records` reads) into a list: (records, number of
    bad records skipped). Blank JSONL lines are ignored; no good record raises a DataError."""
    skipped = Skipped()
    records = list(read_records(path, skip_bad, skipped=skipped))
    refuse_empty(path, len(records), skipped)
    return records, skipped.count


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


def render_chat(
    tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool, where: str
) -> str:
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
        before = render_chat(tokenizer, messages[:turn], True, where)
        through = render_chat(tokenizer, messages[: turn + 1], False, where)
        if not (text.startswith(before) and text.startswith(through)):
            raise DataError(
                f"{where}: the chat template renders this conversation's turns differently from "
                "the whole conversation, so the assistant replies cannot be located; use "
                "instruction records or a template that renders turns in order"
            )
        reply_start, reply_end = _reply_span(text, len(before), len(through), message["content"])
        spans.append((reply_start, reply_end, len(through)))
    return spans


def chat_ids(
    tokenizer: Tokenizer, messages: list[dict], where: str
) -> tuple[list[int], np.ndarray]:
    """Ids of the rendered conversation and its targets: each assistant reply + end of turn."""
    text = render_chat(tokenizer, messages, False, where)
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


def plain_instruction_ids(
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


class InstructionTemplate(NamedTuple):
    """How an instruction record becomes a prompt without a chat template: Python format strings
    over {instruction} and {input}; the response follows the prompt, then EOS."""

    prompt: str = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
    prompt_no_input: str = "### Instruction:\n{instruction}\n\n### Response:\n"

    def check(self) -> None:
        """Raise ConfigError for a template naming a field other than {instruction}, {input}."""
        for name, template, allowed in (
            ("prompt", self.prompt, {"instruction", "input"}),
            ("prompt_no_input", self.prompt_no_input, {"instruction"}),
        ):
            try:
                fields = {field for _, field, _, _ in string.Formatter().parse(template) if field}
            except ValueError as error:
                raise ConfigError(f"data.instruction_template.{name}: {error}") from None
            if "instruction" not in fields or fields - allowed:
                raise ConfigError(
                    f"data.instruction_template.{name} names {sorted(fields)}; it must name "
                    f"{{instruction}}"
                    + (" (and may name {input})" if len(allowed) > 1 else "")
                    + " and nothing else (write {{ and }} for literal braces)"
                )


ALPACA = InstructionTemplate()


def plain_instruction_prompt(fields: dict[str, Any], template: InstructionTemplate = ALPACA) -> str:
    """The prompt of an instruction record without a chat template (Alpaca style by default)."""
    if fields.get("input"):
        return template.prompt.format(instruction=fields["instruction"], input=fields["input"])
    return template.prompt_no_input.format(instruction=fields["instruction"])


def require_chat_template(tokenizer: Tokenizer, where: str) -> None:
    if tokenizer.chat_template is None:
        raise DataError(
            f"{where}: chat records need the model's chat template, and this tokenizer has none; "
            'use a model with a chat template, or {"instruction", "output"} / {"text"} records'
        )


def max_token_chars(tokenizer: Tokenizer) -> int:
    """The most characters one token of `tokenizer` can cover: its longest vocabulary entry."""
    return max(len(token) for token in tokenizer.backend.get_vocab())


def tokenize_example(
    record: Record,
    tokenizer: Tokenizer,
    max_chars: int | None = None,
    instruction_template: InstructionTemplate | None = None,
) -> Example:
    """Token ids and the targets of one record (see the module docstring for what is a target).

    Instruction records use `instruction_template` when one is given, else the chat template
    when the tokenizer has one, else the Alpaca "### Instruction / ### Input / ### Response"
    format (`ALPACA`). Chat records need a chat template. `max_chars` cuts a text record before it
    is tokenized (bounded memory for a huge record): callers pass more characters than the tokens
    they keep can cover.
    """
    fields, where = record.fields, record.location
    if record.shape == "preference":
        raise DataError(
            f"{where}: a preference record ({{prompt, chosen, rejected}}) in a run with objective: "
            "sft; set objective: dpo or orpo to train on pairs, or use sft records"
        )
    if record.shape == "text":
        text = fields["text"] if max_chars is None else fields["text"][:max_chars]
        ids = tokenizer.encode(text, add_special_tokens=True)
        ids, targets = _append_eos(tokenizer, ids, np.ones(len(ids), bool))
    elif record.shape == "instruction" and (
        instruction_template is not None or tokenizer.chat_template is None
    ):
        prompt = plain_instruction_prompt(fields, instruction_template or ALPACA)
        ids, targets = plain_instruction_ids(tokenizer, prompt, fields["output"])
    elif record.shape == "instruction":
        ids, targets = chat_ids(tokenizer, instruction_messages(fields), where)
    else:
        require_chat_template(tokenizer, where)
        ids, targets = chat_ids(tokenizer, fields["messages"], where)
    return Example(np.asarray(ids, np.int32), targets, where)


def tokenize_stream(
    records: Iterable[Record],
    tokenizer: Tokenizer,
    skip_bad: bool = False,
    max_tokens: int | None = None,
    instruction_template: InstructionTemplate | None = None,
    skipped: Skipped | None = None,
) -> Iterator[Example]:
    """Tokenize records one at a time (only the examples are kept by whoever consumes this).

    A record the template refuses raises its DataError, or with `skip_bad` is skipped and counted.
    A tokenizer without a chat template meeting a chat record is a setting problem and raises
    whatever `skip_bad` says.

    With `max_tokens` (what packing keeps of an example at most), a text record is cut to
    `(max_tokens + 2) x max_token_chars` characters before tokenizing: every kept token is the same
    as from the whole text (a cut can change only the token it falls in), and a multi-megabyte
    record costs memory in proportion to the sequence length, not to its size."""
    max_chars = None if max_tokens is None else (max_tokens + 2) * max_token_chars(tokenizer)
    for record in records:
        if record.shape == "chat":
            require_chat_template(tokenizer, record.location)
        try:
            yield tokenize_example(record, tokenizer, max_chars, instruction_template)
        except DataError as error:
            if not skip_bad:
                raise
            if skipped is not None:
                skipped.add(skip_reason(error, record.location), record.location)


def tokenize_records(
    records: Sequence[Record],
    tokenizer: Tokenizer,
    skip_bad: bool = False,
    max_tokens: int | None = None,
) -> tuple[list[Example], int]:
    """Tokenize every record (see `tokenize_stream`): (examples, number skipped). Chat records
    without a chat template are refused before any record is tokenized."""
    chat = next((record for record in records if record.shape == "chat"), None)
    if chat is not None:
        require_chat_template(tokenizer, chat.location)
    skipped = Skipped()
    examples = list(tokenize_stream(records, tokenizer, skip_bad, max_tokens, skipped=skipped))
    return examples, skipped.count


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
    skipped: int  # bad records skipped with skip_bad
    records: int = 0  # records read (good and skipped)
    skip_reasons: tuple[tuple[str, int, str], ...] = ()  # (reason, count, first location)


def prepare_dataset(
    path: str | Path,
    tokenizer: Tokenizer,
    seq_len: int,
    *,
    skip_bad: bool = False,
    overflow: Overflow = "truncate",
    eval_fraction: float = 0.0,
    seed: int = 0,
    columns: Mapping[str, str] | None = None,
    instruction_template: InstructionTemplate | None = None,
    pack_examples: bool = True,
    max_per_row: int | None = None,
) -> Dataset:
    """Read, tokenize (streamed), split (seeded) and pack a dataset into rows of `seq_len + 1`
    tokens, at most `max_per_row` examples a row (None: as many as fit). `pack_examples=False`
    puts one example in each row (the rest padding)."""
    skipped = Skipped()
    records = read_records(path, skip_bad, columns, skipped)
    # packing keeps at most seq_len + 1 tokens of an example ("truncate"), and "error" refuses
    # one longer than that, which a cut at more characters than those tokens cover still shows
    examples = list(
        tokenize_stream(records, tokenizer, skip_bad, seq_len + 1, instruction_template, skipped)
    )
    refuse_empty(path, len(examples), skipped)
    train_examples, eval_examples = split(examples, eval_fraction, seed)
    options = (seq_len, tokenizer.pad_id, overflow, pack_examples, max_per_row)
    train, train_stats = pack(train_examples, *options)
    if train_stats.rows == 0:
        raise DataError(
            f"dataset {path}: no training example has a loss token within seq_len={seq_len}; "
            "raise seq_len"
        )
    evaluation, eval_stats = pack(eval_examples, *options) if eval_examples else (None, None)
    reasons = tuple(
        (reason, count, skipped.first[reason]) for reason, count in skipped.reasons.most_common()
    )
    return Dataset(
        train, evaluation, train_stats, eval_stats, skipped.count,
        len(examples) + skipped.count, reasons,
    )  # fmt: skip
