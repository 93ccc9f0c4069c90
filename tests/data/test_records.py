"""Training data with SmolLM2's real tokenizer: chat rendering equals transformers', loss masks
cover exactly the responses (instruction, chat, and a differently shaped template), and every bad
input raises a DataError naming the file and line."""

import json

import numpy as np
import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from featherweight.data.records import (
    Record,
    Skipped,
    instruction_messages,
    load_jsonl,
    plain_instruction_prompt,
    prepare_dataset,
    read_records,
    split,
    tokenize_example,
    tokenize_records,
)
from featherweight.errors import ConfigError, DataError
from featherweight.io.gguf_reader import GGUFSource
from featherweight.io.tokenizer import Tokenizer

END = "<|im_end|>"  # SmolLM2's end of turn (and EOS)
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [
        {"role": "system", "content": "Answer in French."},
        {"role": "user", "content": "Coffee?"},
        {"role": "assistant", "content": "Un café ☕, merci."},
        {"role": "user", "content": "And tea?"},
        {"role": "assistant", "content": " Du thé. \n"},
    ],
]
# A template shaped unlike SmolLM2's: BOS in the template, trimmed content, no newline after turns.
TRIM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n\n"
    "{{ m['content'] | trim }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def smol(demo_gguf) -> Tokenizer:
    return GGUFSource(demo_gguf).tokenizer()


@pytest.fixture(scope="module")
def hf_smol(smol):
    """transformers' tokenizer over the same vocabulary, with SmolLM2's chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizers.Tokenizer.from_str(smol.backend.to_str()),
        chat_template=smol.chat_template,
        bos_token=smol.bos_token,
        eos_token=smol.eos_token,
    )


def with_template(tokenizer: Tokenizer, template: str | None) -> Tokenizer:
    return Tokenizer(tokenizer.backend, template, tokenizer.bos_token, tokenizer.eos_token)


def chat(messages, line: int = 1) -> Record:
    return Record({"messages": messages}, "chat", f"data.jsonl:{line}")


def target_runs(tokenizer: Tokenizer, example) -> list[str]:
    """The decoded text of each maximal run of target tokens."""
    edges = np.diff(np.concatenate([[0], example.target_mask.astype(int), [0]]))
    starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
    return [
        tokenizer.decode(example.ids[a:b], skip_special_tokens=False) for a, b in zip(starts, ends)
    ]


def write_lines(tmp_path, lines: list[str | bytes], name: str = "data.jsonl"):
    path = tmp_path / name
    path.write_bytes(b"\n".join(ln if isinstance(ln, bytes) else ln.encode() for ln in lines))
    return path


# --- rendering and masks ------------------------------------------------------------------------


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_rendering_and_ids_equal_transformers(smol, hf_smol, conversation):
    for messages, prompt in ((conversation, False), (conversation[:-1], True)):
        ours = smol.apply_chat_template(messages, add_generation_prompt=prompt)
        theirs = hf_smol.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
        assert ours == theirs
    ids = hf_smol.apply_chat_template(conversation, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert tokenize_example(chat(conversation), smol).ids.tolist() == list(ids)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_chat_targets_are_exactly_the_assistant_replies_and_their_end_of_turn(smol, conversation):
    example = tokenize_example(chat(conversation), smol)
    replies = [m["content"] + END for m in conversation if m["role"] == "assistant"]
    assert target_runs(smol, example) == replies


def test_chat_targets_with_a_differently_shaped_template(smol):
    tokenizer = with_template(smol, TRIM_TEMPLATE)
    example = tokenize_example(chat(CONVERSATIONS[1]), tokenizer)
    assert smol.decode(example.ids, False).startswith("<|im_start|><|im_start|>system\n\nAnswer")
    assert target_runs(smol, example) == ["Un café ☕, merci." + END, "Du thé." + END]


def test_instruction_targets_with_the_chat_template(smol):
    fields = {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}
    example = tokenize_example(Record(fields, "instruction", "x:1"), smol)
    text = smol.decode(example.ids, False)
    assert text == smol.apply_chat_template(instruction_messages(fields), False)
    assert "<|im_start|>user\nAdd the numbers.\n\n2 and 3<|im_end|>" in text
    assert target_runs(smol, example) == ["5" + END]
    no_input = tokenize_example(Record({**fields, "input": ""}, "instruction", "x:2"), smol)
    assert "<|im_start|>user\nAdd the numbers.<|im_end|>" in smol.decode(no_input.ids, False)


def test_instruction_targets_without_a_chat_template(smol):
    fields = {"instruction": "Say hi.", "output": "Hello, world!"}
    example = tokenize_example(Record(fields, "instruction", "x:1"), with_template(smol, None))
    assert smol.decode(example.ids, False) == (
        "### Instruction:\nSay hi.\n\n### Response:\nHello, world!" + END
    )
    assert plain_instruction_prompt({**fields, "input": "now"}).count("### Input:\nnow\n\n") == 1
    assert target_runs(smol, example) == ["Hello, world!" + END]


def test_text_examples_get_eos_and_loss_everywhere(smol):
    example = tokenize_example(Record({"text": "Plain text."}, "text", "x:1"), smol)
    assert example.ids.tolist() == [*smol.encode("Plain text."), smol.eos_id]
    assert example.target_mask.all()


# --- bad input ----------------------------------------------------------------------------------


def test_missing_directory_and_empty_datasets_are_refused(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl does not exist"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(DataError, match="is a directory"):
        load_jsonl(tmp_path)
    for content in ([""], ["", "  ", ""]):
        with pytest.raises(DataError, match=r"empty\.jsonl is empty"):
            load_jsonl(write_lines(tmp_path, content, "empty.jsonl"))


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", r"not valid JSON \(Expecting value: column 1\)"),
        ('{"text": "cut', "Unterminated string starting at: column 10"),
        ("[1, 2]", "expected a JSON object, got list"),
        ('{"prompt": "x"}', r"record has keys \['prompt'\]"),
        ('{"instruction": "x"}', 'string "output"'),
        ('{"text": 5}', '"text" must be a non-empty string'),
        ('{"messages": []}', '"messages" must be a non-empty list'),
        ('{"messages": [{"role": "user"}]}', "message 0 must be an object"),
        ('{"messages": [{"role": "user", "content": "hi"}]}', "no assistant message"),
        (b'{"text": "\xff"}', "not valid UTF-8 .* at byte 10"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, message):
    path = write_lines(tmp_path, ['{"text": "good"}', "", line, '{"text": "good"}'])
    with pytest.raises(DataError, match=rf"data\.jsonl:3: .*{message}.*--skip-bad"):
        load_jsonl(path)
    records, skipped = load_jsonl(path, skip_bad=True)
    assert skipped == 1 and [r.location for r in records] == [f"{path}:1", f"{path}:4"]


def test_skip_bad_with_only_bad_lines_still_fails(tmp_path):
    path = write_lines(tmp_path, ["{", "", "nope"])
    with pytest.raises(DataError, match="all 2 lines are bad"):
        load_jsonl(path, skip_bad=True)


def test_records_the_template_refuses_name_their_line_or_are_skipped(smol):
    refusing = with_template(
        smol,
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    )
    records = [chat(CONVERSATIONS[0], 1), chat(CONVERSATIONS[1], 2)]
    with pytest.raises(
        DataError, match=r"data\.jsonl:2: the chat template refused .*no system role"
    ):
        tokenize_records(records, refusing)
    examples, skipped = tokenize_records(records, refusing, skip_bad=True)
    assert skipped == 1 and [e.location for e in examples] == ["data.jsonl:1"]


def test_templates_that_rewrite_earlier_turns_are_refused(smol):
    last_differs = with_template(
        smol,
        "{% for m in messages %}{% if loop.last %}LAST{% endif %}{{ m['content'] }}{% endfor %}",
    )
    with pytest.raises(DataError, match=r"data\.jsonl:4: the chat template renders"):
        tokenize_example(chat(CONVERSATIONS[0], 4), last_differs)


def test_chat_records_without_a_chat_template_are_refused_even_with_skip_bad(smol):
    records = [Record({"text": "a"}, "text", "d:1"), chat(CONVERSATIONS[0], 2)]
    with pytest.raises(
        DataError, match=r"data\.jsonl:2: chat records need the model's chat template"
    ):
        tokenize_records(records, with_template(smol, None), skip_bad=True)


# --- split and the whole pipeline ---------------------------------------------------------------


def test_split_is_seeded_disjoint_and_complete():
    items = list(range(40))
    train, held_out = split(items, 0.25, seed=3)
    assert len(held_out) == 10 and sorted(train + held_out) == items
    assert split(items, 0.25, seed=3) == (train, held_out)
    assert split(items, 0.25, seed=4) != (train, held_out)
    assert split(items, 0.0, seed=3)[1] == [] and len(split(items, 0.01, seed=3)[1]) == 1
    with pytest.raises(ConfigError, match="eval_fraction"):
        split(items, 1.0, seed=3)
    with pytest.raises(DataError, match="cannot give both"):
        split([1], 0.5, seed=3)


def test_prepare_dataset_splits_packs_and_counts(tmp_path, smol):
    lines = [json.dumps({"text": f"Example number {n}."}) for n in range(12)]
    lines[5] = json.dumps({"text": "long " * 80})
    lines.insert(7, "garbage")
    lines.append(json.dumps({"messages": CONVERSATIONS[1]}))
    path = write_lines(tmp_path, lines)
    dataset = prepare_dataset(path, smol, 64, skip_bad=True, eval_fraction=0.25, seed=1)
    assert dataset.skipped == 1
    assert dataset.train_stats.truncated_examples + dataset.eval_stats.truncated_examples == 1
    train = {e.location for e in dataset.train.examples}
    held_out = {e.location for e in dataset.eval.examples}
    assert not train & held_out and len(train | held_out) == 13
    again = prepare_dataset(path, smol, 64, skip_bad=True, eval_fraction=0.25, seed=1)
    assert again.train.fingerprint() == dataset.train.fingerprint()
    assert again.eval.fingerprint() == dataset.eval.fingerprint()
    with pytest.raises(DataError, match=r"data\.jsonl:6: example has \d+ tokens"):
        prepare_dataset(path, smol, 64, skip_bad=True, overflow="error")


def test_a_huge_text_record_is_cut_before_tokenizing_and_keeps_the_same_tokens(smol):
    # a record far longer than a row: only what packing keeps is tokenized, token for token
    words = " ".join(f"word{i % 977} ünïcode{i % 13}" for i in range(40_000))  # ~800 KB
    record = Record({"text": words}, "text", "big.jsonl:1")
    whole = tokenize_example(record, smol)
    (cut,), skipped = tokenize_records([record], smol, max_tokens=65)
    assert skipped == 0 and len(cut.ids) < len(whole.ids) // 100
    assert np.array_equal(cut.ids[:65], whole.ids[:65])
    assert np.array_equal(cut.target_mask[:65], whole.target_mask[:65])


def test_a_line_nested_too_deeply_is_a_bad_record_not_a_crash(tmp_path):
    depth = 200_000
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n{"text": ' + "[" * depth + "]" * depth + "}\n")
    with pytest.raises(DataError, match=r"deep\.jsonl:2: nests deeper than Python's recursion"):
        list(read_records(path))
    skipped = Skipped()
    assert [record.location for record in read_records(path, True, skipped=skipped)] == [
        f"{path}:1"
    ]
    assert dict(skipped.reasons) == {"nested too deeply": 1}


@pytest.mark.parametrize("answer", ["", "  "])
def test_an_instruction_with_an_empty_answer_is_refused_or_skipped_and_counted(tmp_path, answer):
    path = tmp_path / "qa.csv"
    path.write_text(f"instruction,output\nWhat?,Yes\nWho?,{answer}\n")
    with pytest.raises(
        DataError, match=r"record 2.*\"output\" is empty \(an empty answer cell\?\)"
    ):
        list(read_records(path))
    skipped = Skipped()
    assert len(list(read_records(path, skip_bad=True, skipped=skipped))) == 1
    assert skipped.count == 1
