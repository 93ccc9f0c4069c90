"""Every dataset format gives the examples its JSONL twin gives; column mappings, chat and
instruction templates, unpacked rows and skip reasons."""

import json

import datasets
import pandas as pd
import pytest

from featherweight.data.chat_templates import CHAT_TEMPLATES, with_chat_template
from featherweight.data.records import (
    InstructionTemplate,
    Record,
    prepare_dataset,
    read_records,
    tokenize_example,
)
from featherweight.data.sources import is_dataset_name, read_raw_records
from featherweight.errors import ConfigError, DataError
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.tokenizer import Tokenizer

ROWS = [
    {"instruction": f"Add {n} and {n + 1}.", "input": "" if n % 2 else f"n={n}", "output": f"{2 * n + 1}"}
    for n in range(10)
]  # fmt: skip
CHAT = [
    [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}],
]


@pytest.fixture(scope="module")
def smol(demo_gguf) -> Tokenizer:
    return GGUFSource(demo_gguf).tokenizer()


def no_template(tokenizer: Tokenizer) -> Tokenizer:
    return Tokenizer(tokenizer.backend, None, tokenizer.bos_token, tokenizer.eos_token)


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def fingerprint(path, tokenizer, **options):
    dataset = prepare_dataset(path, tokenizer, 64, **options)
    return dataset.train.fingerprint(), dataset.train_stats


def as_format(tmp_path, rows, kind: str):
    frame = pd.DataFrame(rows)
    if kind == "json":
        path = tmp_path / "data.json"
        path.write_text(json.dumps(rows))
    elif kind == "csv":
        path = tmp_path / "data.csv"
        frame.to_csv(path, index=False)
    elif kind == "tsv":
        path = tmp_path / "data.tsv"
        frame.to_csv(path, index=False, sep="\t")
    elif kind == "parquet":
        path = tmp_path / "data.parquet"
        frame.to_parquet(path)
    else:
        path = tmp_path / "saved"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("kind", ["json", "csv", "tsv", "parquet", "save_to_disk"])
def test_every_format_gives_the_examples_of_its_jsonl_twin(tmp_path, smol, kind):
    expected = fingerprint(write_jsonl(tmp_path / "data.jsonl", ROWS), smol)
    assert fingerprint(as_format(tmp_path, ROWS, kind), smol) == expected


def test_chat_records_from_parquet_and_a_saved_dataset_dict(tmp_path, smol):
    rows = [{"messages": messages} for messages in CHAT]
    expected = fingerprint(write_jsonl(tmp_path / "chat.jsonl", rows), smol)
    assert fingerprint(as_format(tmp_path, rows, "parquet"), smol) == expected
    saved = tmp_path / "dict"
    splits = {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(saved))
    assert fingerprint(saved, smol) == expected


def test_text_files_are_one_record_per_non_blank_line(tmp_path, smol):
    (tmp_path / "notes.txt").write_text("First line.\n\nSecond line.\n")
    twin = write_jsonl(
        tmp_path / "notes.jsonl", [{"text": "First line."}, {"text": "Second line."}]
    )
    assert fingerprint(tmp_path / "notes.txt", smol) == fingerprint(twin, smol)


def test_csv_cells_stay_text(tmp_path):
    path = tmp_path / "codes.csv"
    path.write_text("instruction,output\nThe code?,007\nTrue?,TRUE\n")
    records = list(read_records(path))
    assert [r.fields["output"] for r in records] == ["007", "TRUE"]
    assert records[0].location == f"{path} record 1"


def test_columns_map_dataset_fields_onto_records(tmp_path, smol):
    renamed = [
        {"question": r["instruction"], "context": r["input"], "answer": r["output"]} for r in ROWS
    ]
    columns = {"instruction": "question", "input": "context", "output": "answer"}
    expected = fingerprint(write_jsonl(tmp_path / "data.jsonl", ROWS), smol)
    assert fingerprint(as_format(tmp_path, renamed, "csv"), smol, columns=columns) == expected
    path = write_jsonl(tmp_path / "body.jsonl", [{"body": "Some text."}])
    (record,) = read_records(path, columns={"text": "body"})
    assert record.shape == "text" and record.fields["text"] == "Some text."
    with pytest.raises(
        DataError, match=r"body\.jsonl:1: data\.columns maps 'text' to column 'content'"
    ):
        list(read_records(path, columns={"text": "content"}))


def test_sharegpt_conversations_map_roles_and_keys(tmp_path, smol):
    rows = [
        {"conversations": [{"from": "human", "value": m[0]["content"]}, {"from": "gpt", "value": m[1]["content"]}]}
        for m in CHAT
    ]  # fmt: skip
    columns = {"messages": "conversations", "role": "from", "content": "value"}
    expected = fingerprint(
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT]), smol
    )
    assert fingerprint(as_format(tmp_path, rows, "parquet"), smol, columns=columns) == expected


def test_a_named_chat_template_trains_chat_records_on_a_model_without_one(tmp_path, smol):
    bare = no_template(smol)
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": m} for m in CHAT])
    with pytest.raises(DataError, match="chat records need the model's chat template"):
        prepare_dataset(path, bare, 64)
    chatml = with_chat_template(bare, "chatml")
    # SmolLM2's own template is ChatML with a default system prompt; ours has none
    example = tokenize_example(Record({"messages": CHAT[0]}, "chat", "x:1"), chatml)
    text = smol.decode(example.ids, False)
    assert text == "<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    assert smol.decode(example.ids[example.target_mask], False) == "Hello.<|im_end|>"
    template_file = tmp_path / "template.jinja"
    template_file.write_text(CHAT_TEMPLATES["zephyr"])
    assert with_chat_template(bare, str(template_file)).chat_template == CHAT_TEMPLATES["zephyr"]
    with pytest.raises(ConfigError, match=r"'chatlm' is neither a built-in template \(chatml"):
        with_chat_template(bare, "chatlm")


def test_the_instruction_template_overrides_the_chat_template(smol):
    template = InstructionTemplate("Q: {instruction}\nI: {input}\nA:\n", "Q: {instruction}\nA:\n")
    record = Record({"instruction": "Say hi.", "output": "Hi!"}, "instruction", "x:1")
    example = tokenize_example(record, smol, instruction_template=template)
    assert smol.decode(example.ids, False) == "Q: Say hi.\nA:\nHi!<|im_end|>"
    assert smol.decode(example.ids[example.target_mask], False) == "Hi!<|im_end|>"
    with pytest.raises(ConfigError, match=r"names \['question'\]"):
        InstructionTemplate("{question}", "{instruction}").check()


def test_unpacked_rows_hold_one_example_each(tmp_path, smol):
    path = write_jsonl(tmp_path / "data.jsonl", ROWS)
    packed = prepare_dataset(path, smol, 128)
    single = prepare_dataset(path, smol, 128, pack_examples=False)
    assert single.train.rows == tuple((index,) for index in range(len(ROWS)))
    assert packed.train_stats.rows < single.train_stats.rows == len(ROWS)
    assert single.train_stats.tokens == packed.train_stats.tokens
    assert single.train_stats.fill < packed.train_stats.fill <= 1.0
    assert single.train_stats.fill == pytest.approx(single.train_stats.tokens / (len(ROWS) * 129))


def test_skipped_records_are_counted_with_their_reasons(tmp_path, smol):
    lines = [json.dumps(row) for row in ROWS[:4]] + ["{oops", "[1]", "{also bad", '{"text": ""}']
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines))
    dataset = prepare_dataset(path, smol, 64, skip_bad=True)
    assert dataset.records == 8 and dataset.skipped == 4
    reasons = {reason: (count, first) for reason, count, first in dataset.skip_reasons}
    assert reasons["not valid JSON"] == (2, f"{path}:5")
    assert reasons["expected a JSON object, got list"] == (1, f"{path}:6")
    assert reasons['"text" must be a non-empty string'] == (1, f"{path}:8")


def test_missing_sources_and_names_not_in_the_cache_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(DataError, match=r"nope\.csv does not exist; pass a JSONL file"):
        list(read_raw_records(tmp_path / "nope.csv"))
    (tmp_path / "data.xml").write_text("<a/>")
    with pytest.raises(DataError, match=r"unknown file type '\.xml'"):
        list(read_raw_records(tmp_path / "data.xml"))
    (tmp_path / "plain").mkdir()
    with pytest.raises(DataError, match="is a directory but not one datasets' save_to_disk wrote"):
        list(read_raw_records(tmp_path / "plain"))
    assert is_dataset_name("someone/nonexistent-set") and not is_dataset_name(str(tmp_path))
    with pytest.raises(
        DataError, match=r"neither a file nor a dataset in the local Hugging Face cache"
    ):
        list(read_raw_records("someone/nonexistent-set"))
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"bad\.parquet cannot be read"):
        list(read_raw_records(bad))


def test_streamed_reading_keeps_only_tokens(tmp_path, smol):
    # a 4 MB CSV cell is cut before tokenizing: the example is bounded by seq_len, not the file
    path = tmp_path / "big.csv"
    pd.DataFrame({"text": ["word " * 800_000, "short"]}).to_csv(path, index=False)
    dataset = prepare_dataset(path, smol, 64)
    assert dataset.train_stats.truncated_examples == 1
    assert max(len(example.ids) for example in dataset.train.examples) <= 65


def cache_like_a_hub_download(rows, name: str, hf_home) -> None:
    """Put `rows` into `hf_home`'s datasets cache where `load_dataset(name)` finds a dataset
    downloaded from the Hub (`org___name/default/0.0.0/<hash>/name-train.arrow`), offline."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    source = hf_home / "source.parquet"
    pd.DataFrame(rows).to_parquet(source)
    folder = name.replace("/", "___")
    builder = Parquet(
        data_files={"train": str(source)},
        dataset_name=folder,
        hash="0123abcd",
        cache_dir=str(hf_home / "datasets"),
    )
    builder.download_and_prepare()
    (config_dir,) = (hf_home / "datasets" / folder).iterdir()
    prepared = config_dir.rename(config_dir.with_name("default")) / "0.0.0" / "0123abcd"
    arrow = prepared / f"{folder}-train.arrow"
    arrow.rename(prepared / f"{name.split('/')[1]}-train.arrow")


def test_a_dataset_name_in_the_local_cache_reads_offline(tmp_path, smol, monkeypatch):
    hf_home = tmp_path / "hf"
    hf_home.mkdir()
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_DATASETS_CACHE", str(hf_home / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    cache_like_a_hub_download(ROWS, "someone/tiny-set", hf_home)
    expected = fingerprint(write_jsonl(tmp_path / "data.jsonl", ROWS), smol)
    assert fingerprint("someone/tiny-set", smol) == expected


def test_a_file_the_reader_cannot_parse_is_reported_once(tmp_path, caplog):
    path = tmp_path / "bad.json"
    path.write_text('{"text": "a"\n[broken')
    with pytest.raises(DataError, match=r"bad\.json cannot be read as \.json"):
        list(read_raw_records(path))
    assert [r.getMessage() for r in caplog.records if r.name.startswith("datasets")] == []
