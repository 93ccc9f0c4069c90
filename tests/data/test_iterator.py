"""The data iterator: seeded shuffling, exact resume from a saved position, epochs that cover
every row, per-process shards that add up to the global batch, and a one-pass eval."""

import json

import numpy as np
import pytest

from featherweight.data.iterator import DataIterator, DataState, eval_batches
from featherweight.data.packing import Example, pack
from featherweight.errors import ConfigError, DataError

SEQ_LEN = 16


def packed_rows(count: int, first_token: int = 1):
    """`count` rows, one example each, whose first token names the row (to read orders back)."""
    examples = [
        Example(np.full(SEQ_LEN + 1, first_token + n, np.int32), np.ones(SEQ_LEN + 1, bool))
        for n in range(count)
    ]
    return pack(examples, SEQ_LEN, pad_id=0)[0]


ROWS = packed_rows(10)


def row_names(batch) -> list[int]:
    return [int(token) for token in batch.input_ids[:, 0]]


def take(iterator, count: int) -> list:
    return [next(iterator) for _ in range(count)]


def assert_same_batches(left: list, right: list) -> None:
    assert len(left) == len(right)
    for one, other in zip(left, right):
        for name, array in one._asdict().items():
            np.testing.assert_array_equal(array, getattr(other, name), err_msg=name)


def test_resuming_from_a_saved_state_yields_the_uninterrupted_batches():
    uninterrupted = take(DataIterator(ROWS, batch_size=3, seed=7), 9)  # 4 steps/epoch: 2+ epochs
    first = DataIterator(ROWS, batch_size=3, seed=7)
    take(first, 5)
    saved = json.loads(json.dumps(first.state.as_dict()))  # as a checkpoint stores it
    assert saved["epoch"] == 1 and saved["step"] == 1
    resumed = DataIterator(ROWS, batch_size=3, seed=0, state=saved)  # the state's seed wins
    assert_same_batches(take(resumed, 4), uninterrupted[5:])
    assert resumed.state == DataState(7, 2, 1, ROWS.fingerprint())


def test_shuffling_is_seeded_and_differs_between_seeds_and_epochs():
    def epoch_rows(seed: int, epoch: int) -> list[int]:
        iterator = DataIterator(ROWS, batch_size=2, seed=seed)
        batches = take(iterator, (epoch + 1) * iterator.steps_per_epoch)
        return [name for batch in batches[-iterator.steps_per_epoch :] for name in row_names(batch)]

    assert epoch_rows(1, 0) == epoch_rows(1, 0)
    assert epoch_rows(1, 0) != epoch_rows(2, 0)
    assert epoch_rows(1, 0) != epoch_rows(1, 1)
    for seed, epoch in ((1, 0), (2, 0), (1, 1)):
        assert sorted(epoch_rows(seed, epoch)) == list(range(1, 11))  # every row once per epoch


def test_the_last_step_of_an_epoch_is_topped_up_from_the_same_epoch():
    iterator = DataIterator(ROWS, batch_size=4, seed=3)
    assert iterator.steps_per_epoch == 3
    names = [name for batch in take(iterator, 3) for name in row_names(batch)]
    assert names[10:] == names[:2]
    assert sorted(names[:10]) == list(range(1, 11))
    assert iterator.state.epoch == 0 and iterator.state.step == 3
    next(iterator)
    assert iterator.state.epoch == 1 and iterator.state.step == 1


def test_process_shards_make_up_the_global_batch():
    global_batches = take(DataIterator(ROWS, batch_size=4, seed=5), 6)
    shards = [
        take(DataIterator(ROWS, batch_size=2, seed=5, process_index=p, process_count=2), 6)
        for p in range(2)
    ]
    for step, global_batch in enumerate(global_batches):
        joined = [name for shard in shards for name in row_names(shard[step])]
        assert joined == row_names(global_batch)


def test_eval_is_one_ordered_pass_with_inert_padding_rows():
    batches = list(eval_batches(ROWS, batch_size=4))
    assert len(batches) == 3
    names = [name for batch in batches for name in row_names(batch)]
    assert names[:10] == list(range(1, 11)) and names[10:] == [0, 0]
    assert batches[-1].loss_mask[2:].sum() == 0 and batches[-1].loss_mask[:2].all()
    shards = [list(eval_batches(ROWS, 2, process_index=p, process_count=3)) for p in range(3)]
    assert {len(shard) for shard in shards} == {2}
    seen = [name for shard in shards for batch in shard for name in row_names(batch) if name]
    assert sorted(seen) == list(range(1, 11))


def test_resuming_on_different_data_is_refused():
    state = DataIterator(ROWS, batch_size=2).state
    with pytest.raises(DataError, match="different dataset"):
        DataIterator(packed_rows(10, first_token=50), batch_size=2, state=state)
    with pytest.raises(DataError, match="lacks"):
        DataIterator(ROWS, batch_size=2, state={"epoch": 1})


@pytest.mark.parametrize("settings", [{"batch_size": 0}, {"process_index": 2, "process_count": 2}])
def test_bad_iterator_settings_raise_config_errors(settings):
    with pytest.raises(ConfigError):
        DataIterator(ROWS, **{"batch_size": 2, **settings})
