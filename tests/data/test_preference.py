"""Preference pairs with SmolLM2's real tokenizer: TRL's string and conversational forms, loss on
the completions only, pairs kept whole in rows and batches, and what packing did counted."""

import json

import numpy as np
import pytest

from featherweight.data.iterator import DataIterator, eval_batches
from featherweight.data.preference import NO_COMPLETION, prepare_preference_dataset
from featherweight.errors import ConfigError, DataError
from featherweight.io.gguf_reader import GGUFSource
from tests.data.test_records import target_runs, with_template


@pytest.fixture(scope="module")
def smol(demo_gguf):
    return GGUFSource(demo_gguf).tokenizer()


STRING = {"prompt": "What colour is Velqua?", "chosen": "It is red.", "rejected": "It is blue."}
CONVERSATION = {
    "prompt": [
        {"role": "user", "content": "Hi."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Colour of Velqua?"},
    ],
    "chosen": [{"role": "assistant", "content": "Red."}],
    "rejected": [{"role": "assistant", "content": "Blue, I think."}],
}
IMPLICIT = {  # no prompt: the shared messages before the last are the prompt
    "chosen": [*CONVERSATION["prompt"], *CONVERSATION["chosen"]],
    "rejected": [*CONVERSATION["prompt"], *CONVERSATION["rejected"]],
}


def write(tmp_path, records, name="pairs.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def completions(tokenizer, dataset):
    """(chosen, rejected) target texts of the first pair."""
    chosen, rejected = dataset.train.examples[:2]
    return target_runs(tokenizer, chosen), target_runs(tokenizer, rejected)


@pytest.mark.parametrize(
    "record", [STRING, CONVERSATION, IMPLICIT], ids=["string", "chat", "implicit"]
)
def test_the_loss_is_on_the_completion_only(smol, tmp_path, record):
    dataset = prepare_preference_dataset(write(tmp_path, [record]), smol, 128)
    chosen, rejected = completions(smol, dataset)
    reply = "It is red." if record is STRING else "Red."
    assert chosen == [f"{reply}<|im_end|>"]  # the reply and the template's end of turn
    assert rejected == [("It is blue." if record is STRING else "Blue, I think.") + "<|im_end|>"]
    # the prompt (an earlier assistant turn too) is never a target
    assert "Hello!" not in "".join(chosen)


def test_string_pairs_without_a_chat_template_are_prompt_plus_completion_and_eos(smol, tmp_path):
    plain = with_template(smol, None)
    dataset = prepare_preference_dataset(write(tmp_path, [STRING]), plain, 64)
    chosen, rejected = completions(plain, dataset)
    assert chosen == [" It is red.<|im_end|>"] or chosen == ["It is red.<|im_end|>"]
    assert len(rejected) == 1 and rejected[0].endswith("blue.<|im_end|>")


def test_columns_rename_pair_fields(smol, tmp_path):
    record = {"question": STRING["prompt"], "good": STRING["chosen"], "bad": STRING["rejected"]}
    columns = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    dataset = prepare_preference_dataset(write(tmp_path, [record]), smol, 128, columns=columns)
    assert completions(smol, dataset)[0] == ["It is red.<|im_end|>"]


def test_packed_rows_hold_whole_pairs_and_batches_number_them(smol, tmp_path):
    records = [{**STRING, "chosen": f"It is red{'.' * n}"} for n in range(1, 6)]
    dataset = prepare_preference_dataset(write(tmp_path, records), smol, 256)
    packed = dataset.train
    assert all(len(row) % 2 == 0 and row[0::2] == tuple(i - 1 for i in row[1::2])
               for row in packed.rows)  # fmt: skip
    assert dataset.train_stats.pairs == 5 and dataset.train_stats.rows < 5  # several per row
    batches = DataIterator(packed, 1, seed=5)
    for _ in range(len(packed)):  # every row, alone in its batch
        batch = next(batches)
        counted = np.unique(batch.sequence_ids[batch.loss_mask > 0])
        # chosen 2q and rejected 2q + 1 for each pair q of the batch, numbered from 0
        assert list(counted) == list(range(len(counted))) and len(counted) % 2 == 0


def test_padded_pairs_take_two_rows_that_stay_together(smol, tmp_path):
    records = [{**STRING, "chosen": f"It is red{'!' * n}."} for n in range(6)]
    dataset = prepare_preference_dataset(write(tmp_path, records), smol, 64, pack_examples=False)
    assert dataset.train.group == 2 and len(dataset.train) == 12
    for batch in [*(next(iter_) for iter_ in [DataIterator(dataset.train, 4, seed=3)] * 6),
                  *eval_batches(dataset.train, 4)]:  # fmt: skip
        rows = [sorted(set(row[row >= 0])) for row in batch.sequence_ids]
        assert rows == [[0], [1], [2], [3]]  # each row one completion, pairs in row order
    with pytest.raises(Exception, match="multiple of 2"):
        DataIterator(dataset.train, 3)


def test_summary_counts_truncated_and_dropped_pairs(smol, tmp_path):
    long_prompt = {**STRING, "prompt": "word " * 150}
    long_reply = {**STRING, "chosen": "red " * 100}
    dataset = prepare_preference_dataset(
        write(tmp_path, [STRING, long_prompt, long_reply]), smol, 128
    )
    stats = dataset.train_stats
    assert (stats.pairs, stats.dropped_pairs, stats.truncated_pairs) == (2, 1, 2)
    assert stats.drop_reasons == ((NO_COMPLETION, 1),)
    with pytest.raises(DataError, match="overflow: truncate"):
        prepare_preference_dataset(write(tmp_path, [long_reply]), smol, 128, overflow="error")


def test_sft_records_in_a_preference_run_are_refused_with_the_line(smol, tmp_path):
    path = write(tmp_path, [STRING, {"instruction": "Say hi.", "output": "hi"}])
    shape = "a record of the instruction shape"  # not "a instruction record"
    with pytest.raises(DataError, match=rf"pairs.jsonl:2: {shape} in a preference run"):
        prepare_preference_dataset(path, smol, 64)


def test_processes_number_their_pairs_apart_in_the_global_batch(smol, tmp_path):
    records = [{**STRING, "chosen": f"It is red{'!' * n}."} for n in range(8)]
    dataset = prepare_preference_dataset(write(tmp_path, records), smol, 64, pack_examples=False)
    shards = [
        next(DataIterator(dataset.train, 2, process_index=p, process_count=2)) for p in (0, 1)
    ]
    ids = np.concatenate([shard.sequence_ids for shard in shards])  # the global batch's rows
    per_row = [sorted(set(row[row >= 0])) for row in ids]
    assert per_row == [[0], [1], [128], [129]]  # process 1's pair after process 0's 2 x 64 slots
    assert ids.max() < ids.size


def test_max_per_row_counts_a_pair_as_two_examples(smol, tmp_path):
    records = [{**STRING, "chosen": f"It is red{'.' * n}"} for n in range(1, 6)]
    path = write(tmp_path, records)
    free = prepare_preference_dataset(path, smol, 512)
    assert free.train_stats.most_per_row == 10  # all five pairs in one row
    capped = prepare_preference_dataset(path, smol, 512, max_per_row=5)  # two pairs a row
    assert capped.train_stats.most_per_row == 4 and capped.train_stats.rows == 3
    assert sorted(i for row in capped.train.rows for i in row) == list(range(10))
    with pytest.raises(ConfigError, match="max_documents_per_row=1 cannot hold a preference"):
        prepare_preference_dataset(path, smol, 512, max_per_row=1)
    single = prepare_preference_dataset(path, smol, 512, pack_examples=False, max_per_row=1)
    assert single.train_stats.rows == 10  # unpacked: a pair in two rows, no limit to refuse


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_when_no_pair_fits_the_error_names_the_seq_len_that_would(smol, tmp_path, pack):
    """A seq_len that holds no completion: the error says which seq_len keeps every pair whole,
    counting both sequences of a packed pair (TRL's max_length counts one)."""
    long_prompt = {**STRING, "prompt": "What colour is Velqua? " * 20}
    path = write(tmp_path, [long_prompt, STRING])
    with pytest.raises(DataError, match="no pair keeps a completion") as error:
        prepare_preference_dataset(path, smol, 16, pack_examples=pack)
    needed = int(error.value.args[0].split("data.seq_len=")[1].split()[0])
    dataset = prepare_preference_dataset(path, smol, needed, pack_examples=pack, overflow="error")
    assert dataset.train_stats.pairs == 2 and dataset.train_stats.truncated_pairs == 0
    with pytest.raises(DataError):  # one token fewer cuts a pair
        prepare_preference_dataset(path, smol, needed - 1, pack_examples=pack, overflow="error")
    assert ("both sequences" in str(error.value)) == pack
