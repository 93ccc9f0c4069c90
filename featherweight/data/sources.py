"""Where training records come from: files and datasets read by the `datasets` library.

| source                                   | read by                                                  |
| ---------------------------------------- | -------------------------------------------------------- |
| `.jsonl` / `.ndjson`                     | line by line (`json`), so a bad line is named by number  |
| `.json` (array or lines), `.csv`, `.tsv` | `datasets.load_dataset(builder, streaming=True)`         |
| `.parquet`, `.arrow`, `.txt` (a line each) | the same                                               |
| a `save_to_disk` directory               | `datasets.load_from_disk` (memory-mapped Arrow)          |
| a dataset name (`org/name`)              | `datasets.load_dataset(name)` from the local Hugging Face cache, offline |

Files are streamed (`streaming=True`): rows arrive a chunk at a time and nothing is copied into a
cache, so reading costs memory for the tokens kept, not for the file. CSV cells are read as text
(no number or NaN guessing: an answer "007" stays "007").

`columns` maps featherweight's fields onto the dataset's: `{"output": "answer"}` reads the field
"output" from the column "answer"; `role` and `content` rename the keys inside each message
(ShareGPT's `from` / `value`, whose roles `human` / `gpt` then read as `user` / `assistant`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

from featherweight.errors import DataError, InputFileError, input_file_problem

RECORD_FIELDS = (
    "text",
    "instruction",
    "input",
    "output",
    "messages",
    "prompt",
    "chosen",
    "rejected",
)
MESSAGE_FIELDS = ("role", "content")
COLUMN_KEYS = RECORD_FIELDS + MESSAGE_FIELDS
_BUILDERS = {
    ".json": "json",
    ".csv": "csv",
    ".tsv": "csv",
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".txt": "text",
}
_JSONL = (".jsonl", ".ndjson")
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "bot": "assistant", "model": "assistant"}
_DISK_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")


class RawRecord(NamedTuple):
    """One record as read: its fields (a dict, or the raw bytes of a JSONL line not yet parsed)
    and where it came from ("file:line" or "file record n")."""

    fields: Any
    location: str


def describe_formats() -> str:
    return (
        "a JSONL file (one JSON object per line), or JSON, CSV, TSV, Parquet, Arrow, .txt, a "
        "save_to_disk directory or a cached Hugging Face dataset name"
    )


def _datasets():
    """The `datasets` module, quiet and offline: there is no network to ask. Its own log lines
    are silenced, errors too: a reader's failure reaches the user once, as featherweight's one
    line naming the file (`_guarded`), not also as the library's log."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    return datasets


def _open_input(path: Path):
    try:
        return path.open("rb")
    except OSError as error:
        raise InputFileError(
            f"dataset {path} cannot be read ({error.strerror}); check that it is a file you may read"
        ) from None


def _jsonl_lines(path: Path) -> Iterator[RawRecord]:
    with _open_input(path) as lines:
        for number, raw in enumerate(lines, start=1):
            if raw.strip():
                yield RawRecord(raw, f"{path}:{number}")


def _file_rows(path: Path, builder: str) -> Iterator[dict[str, Any]]:
    datasets = _datasets()
    options: dict[str, Any] = {}
    if builder == "csv":
        options["sep"] = "\t" if path.suffix == ".tsv" else ","
        probe = datasets.load_dataset(
            builder, data_files=str(path), split="train", streaming=True, **options
        )
        names = list(next(iter(probe), {}))
        string = datasets.Value("string")
        options["features"] = datasets.Features({name: string for name in names})
        options["keep_default_na"] = False
    rows = datasets.load_dataset(
        builder, data_files=str(path), split="train", streaming=True, **options
    )
    for row in rows:
        if builder == "text" and not row["text"].strip():
            continue  # blank lines separate nothing in a text file
        yield row


def _disk_rows(path: Path) -> Iterator[dict[str, Any]]:
    datasets = _datasets()
    loaded = datasets.load_from_disk(str(path))
    yield from _train_split(loaded, str(path))


def _train_split(loaded: Any, name: str) -> Any:
    """The "train" split of a DatasetDict (or its only split); a Dataset as it is."""
    if not hasattr(loaded, "keys"):
        return loaded
    splits = list(loaded.keys())
    if "train" in splits:
        return loaded["train"]
    if len(splits) == 1:
        return loaded[splits[0]]
    raise DataError(
        f"dataset {name} has splits {splits} and none is called 'train'; save the split to train "
        "on with save_to_disk, or export it to a file"
    )


def _cached_rows(name: str) -> Iterator[dict[str, Any]]:
    datasets = _datasets()
    try:
        loaded = datasets.load_dataset(name)
    except (ConnectionError, FileNotFoundError, ValueError) as error:
        raise DataError(
            f"dataset {name!r} is neither a file nor a dataset in the local Hugging Face cache "
            f"({type(error).__name__}); pass {describe_formats()}, or download the "
            "dataset first (datasets.load_dataset on a machine with network, same HF_HOME)"
        ) from None
    yield from _train_split(loaded, name)


def _rows(source: str | Path) -> Iterator[RawRecord]:
    path = Path(source).expanduser()
    problem = input_file_problem(path)
    if problem and problem != "is a directory" and not problem.startswith("does not exist"):
        # a FIFO would block, a link loop or an unreadable path fail deep inside a reader
        raise InputFileError(f"dataset {path} {problem}; pass {describe_formats()}")
    if path.is_dir():
        if not any((path / marker).is_file() for marker in _DISK_MARKERS):
            raise DataError(
                f"dataset {path} is a directory but not one datasets' save_to_disk wrote (no "
                f"{_DISK_MARKERS[0]}); pass {describe_formats()}"
            )
        rows = _disk_rows(path)
    elif path.is_file() and path.suffix.lower() in _JSONL:
        yield from _jsonl_lines(path)
        return
    elif path.is_file():
        builder = _BUILDERS.get(path.suffix.lower())
        if builder is None:
            raise DataError(
                f"dataset {path}: unknown file type {path.suffix or '(no suffix)'!r}; pass "
                f"{describe_formats()} (told apart by the suffix)"
            )
        rows = _file_rows(path, builder)
    elif looks_like_dataset_name(str(source)):
        rows = _cached_rows(str(source))
    else:
        raise DataError(f"dataset {path} does not exist; pass {describe_formats()}")
    for number, row in enumerate(_guarded(rows, path), start=1):
        yield RawRecord(row, f"{path} record {number}")


def looks_like_dataset_name(source: str) -> bool:
    """`name` or `org/name` (no file suffix, at most one slash, not a path) reads as a Hugging
    Face dataset name."""
    return (
        source.count("/") <= 1
        and not source.startswith((".", "/", "~"))
        and Path(source).suffix.lower() not in (*_BUILDERS, *_JSONL)
    )


def _guarded(rows: Iterator[dict[str, Any]], path: Path) -> Iterator[dict[str, Any]]:
    """The rows, with a reader's failure (a malformed file) as a DataError naming the file."""
    iterator = iter(rows)
    while True:
        try:
            row = next(iterator)
        except StopIteration:
            return
        except DataError:
            raise
        except Exception as error:  # pyarrow, pandas and json raise many types for a bad file
            first = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
            raise DataError(
                f"dataset {path} cannot be read as {path.suffix or 'a dataset'}: "
                f"{type(error).__name__}: {first}; check the file's format and encoding"
            ) from None
        yield row


def map_columns(fields: Any, columns: Mapping[str, str] | None) -> Any:
    """`fields` with the dataset's columns renamed to featherweight's (see the module docstring);
    columns whose value is missing (None, as Arrow fills absent keys) are dropped. A mapped column
    the record lacks raises a ValueError naming it and the record's columns."""
    if not isinstance(fields, dict):
        return fields
    columns = columns or {}
    record = {key: value for key, value in fields.items() if value is not None}
    for field in RECORD_FIELDS:
        column = columns.get(field)
        if column is None or column == field:
            continue
        if column not in record:
            if field == "input":  # an instruction's input is optional
                continue
            raise ValueError(
                f"data.columns maps {field!r} to column {column!r}, which this record lacks "
                f"(it has {sorted(fields)})"
            )
        record[field] = record.pop(column)
    if "role" in columns or "content" in columns:
        for field in ("messages", "prompt", "chosen", "rejected"):  # message lists
            if isinstance(record.get(field), list):
                record[field] = [_map_message(message, columns) for message in record[field]]
    return record


def _map_message(message: Any, columns: Mapping[str, str]) -> Any:
    if not isinstance(message, dict):
        return message
    role_key, content_key = columns.get("role", "role"), columns.get("content", "content")
    role = message.get(role_key)
    return {
        "role": _SHAREGPT_ROLES.get(role, role) if role_key != "role" else role,
        "content": message.get(content_key),
    }


def read_raw_records(source: str | Path) -> Iterator[RawRecord]:
    """Every record of `source` in order, as read (see the module docstring for the formats).

    JSONL lines come as bytes, parsed by the caller (so a bad line is counted, not fatal, with
    skip_bad); other formats come as dicts. A missing or unreadable source raises a DataError.
    """
    yield from _rows(source)


def parse_jsonl_line(raw: bytes) -> Any:
    """One JSONL line's value (a ValueError for bad JSON or UTF-8)."""
    return json.loads(raw.strip().decode("utf-8"))


def is_jsonl(source: str | Path) -> bool:
    return Path(source).suffix.lower() in _JSONL


def is_dataset_name(source: str) -> bool:
    """Whether `source` names a Hugging Face dataset (no file or directory of that name exists)."""
    return not Path(source).expanduser().exists() and looks_like_dataset_name(source)
