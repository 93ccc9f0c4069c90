"""Packing: a packed row computes exactly what its examples compute alone (logits and loss), every
example lands in exactly one row, loss masks never cross examples, and overlong examples are cut
with a count or refused with their line."""

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from featherweight.data.packing import Example, make_batch, pack, row_tokens
from featherweight.errors import ConfigError, DataError
from featherweight.models.init import init_params
from featherweight.models.llama import forward
from tests.conftest import tiny_config

CONFIG = tiny_config()
SEQ_LEN = 32
PAD_ID = 0


def random_example(rng: np.random.Generator, length: int, line: int) -> Example:
    """Token ids in [1, V) with a random target mask (first token never a target in practice)."""
    ids = rng.integers(1, CONFIG.vocab_size, size=length).astype(np.int32)
    targets = rng.random(length) < 0.6
    targets[-1] = True  # at least one target after the first token
    return Example(ids, targets, f"data.jsonl:{line}")


EXAMPLES = [random_example(np.random.default_rng(n), n, n) for n in (5, 13, 2, 20, 9, 30, 7, 33)]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


@pytest.fixture(scope="module")
def model():
    params = init_params(jax.random.PRNGKey(0), CONFIG)
    return jax.jit(lambda ids, pos, seg: forward(params, ids, CONFIG, pos, seg))


def test_packed_rows_compute_what_each_example_computes_alone(model):
    packed, stats = pack(EXAMPLES, SEQ_LEN, PAD_ID)
    assert stats.rows < len(EXAMPLES)  # several examples really share rows
    assert max(len(row) for row in packed.rows) >= 3
    batch = make_batch(packed, range(len(packed)))
    packed_logits = np.asarray(model(batch.input_ids, batch.positions, batch.segment_ids))
    packed_nll = -np.take_along_axis(log_softmax(packed_logits), batch.target_ids[..., None], -1)
    packed_loss = float((packed_nll[..., 0] * batch.loss_mask).sum())

    # Each example alone in its own row; trailing padding is invisible to a causal model.
    alone_ids = np.full((len(packed.examples), SEQ_LEN + 1), PAD_ID, np.int32)
    for index, example in enumerate(packed.examples):
        alone_ids[index, : len(example.ids)] = example.ids
    positions = np.broadcast_to(np.arange(SEQ_LEN + 1), alone_ids.shape)
    alone_logits = np.asarray(model(alone_ids, positions, None))

    alone_loss = 0.0
    for row_index, row in enumerate(packed.rows):
        start = 0
        for example_index in row:
            example = packed.examples[example_index]
            alone = alone_logits[example_index]
            inputs = min(len(example.ids), SEQ_LEN - start)  # a row's last token is only a target
            np.testing.assert_allclose(
                packed_logits[row_index, start : start + inputs], alone[:inputs], atol=1e-5, rtol=0
            )
            nll = -log_softmax(alone)[np.arange(len(example.ids) - 1), example.ids[1:]]
            alone_loss += float(nll[example.target_mask[1:]].sum())
            start += len(example.ids)
    np.testing.assert_allclose(packed_loss, alone_loss, rtol=1e-5)
    assert batch.loss_mask.sum() == stats.loss_tokens


def test_loss_mask_never_crosses_examples_and_padding_is_inert():
    packed, stats = pack(EXAMPLES, SEQ_LEN, PAD_ID)
    batch = make_batch(packed, [*range(len(packed)), None])
    segments, mask = batch.segment_ids, batch.loss_mask
    boundary = np.zeros_like(mask, bool)
    boundary[:, :-1] = segments[:, 1:] != segments[:, :-1]
    assert not (mask.astype(bool) & boundary).any()  # the next example's first token: no loss
    assert not mask[segments == 0].any()
    assert (batch.input_ids[segments == 0] == PAD_ID).all()
    assert (segments[-1] == 0).all() and not mask[-1].any()  # the padding row
    for row in range(len(packed)):  # positions restart at 0 at each example
        starts = np.flatnonzero(np.diff(segments[row], prepend=-1) != 0)
        assert (batch.positions[row, starts] == 0).all()
    assert stats.tokens + stats.padding_tokens == stats.rows * (SEQ_LEN + 1)
    assert stats.fill == stats.tokens / (stats.rows * (SEQ_LEN + 1))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, SEQ_LEN + 1), min_size=1, max_size=40))
def test_every_example_is_packed_once_and_rows_never_overflow(lengths):
    rng = np.random.default_rng(0)
    examples = [
        Example(rng.integers(1, 200, n).astype(np.int32), np.ones(n, bool)) for n in lengths
    ]
    packed, stats = pack(examples, SEQ_LEN, PAD_ID)
    kept = [n for n in lengths if n > 1]  # a one-token example has nothing to predict
    assert stats.dropped_examples == len(lengths) - len(kept)
    placed = sorted(index for row in packed.rows for index in row)
    assert placed == list(range(len(kept)))
    loads = [sum(len(packed.examples[i].ids) for i in row) for row in packed.rows]
    assert max(loads, default=0) <= SEQ_LEN + 1
    for later, row in enumerate(packed.rows):  # a row is opened only when no earlier one had room
        opener = len(packed.examples[row[0]].ids)
        assert all(load + opener > SEQ_LEN + 1 for load in loads[:later])


def test_rows_hold_the_example_tokens_in_order():
    packed, _ = pack(EXAMPLES, SEQ_LEN, PAD_ID)
    for row_index, row in enumerate(packed.rows):
        tokens, targets, segments, _ = row_tokens(packed, row_index)
        for segment, example_index in enumerate(row, start=1):
            example = packed.examples[example_index]
            np.testing.assert_array_equal(tokens[segments == segment], example.ids)
            np.testing.assert_array_equal(targets[segments == segment], example.target_mask)


def test_overlong_examples_are_truncated_with_a_count():
    long = random_example(np.random.default_rng(1), SEQ_LEN + 10, 7)
    packed, stats = pack([long, EXAMPLES[0]], SEQ_LEN, PAD_ID, overflow="truncate")
    assert stats.truncated_examples == 1 and stats.truncated_tokens == 9
    cut = next(example for example in packed.examples if example.location.endswith(":7"))
    np.testing.assert_array_equal(cut.ids, long.ids[: SEQ_LEN + 1])


def test_overlong_examples_are_refused_by_config_naming_the_line():
    long = random_example(np.random.default_rng(1), SEQ_LEN + 2, 7)
    with pytest.raises(DataError, match=r"data\.jsonl:7: example has 34 tokens"):
        pack([EXAMPLES[0], long], SEQ_LEN, PAD_ID, overflow="error")
    with pytest.raises(ConfigError, match="overflow"):
        pack(EXAMPLES, SEQ_LEN, PAD_ID, overflow="drop")


def test_examples_whose_targets_are_all_cut_off_are_dropped_and_counted():
    ids = np.arange(1, SEQ_LEN + 6, dtype=np.int32)
    targets = np.zeros(len(ids), bool)
    targets[SEQ_LEN + 2 :] = True  # the response lies past the row
    packed, stats = pack([Example(ids, targets), EXAMPLES[1]], SEQ_LEN, PAD_ID)
    assert stats.dropped_examples == 1 and stats.truncated_examples == 1
    assert stats.examples == len(packed.examples) == 1


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(2, 12), min_size=1, max_size=40), st.integers(1, 5))
def test_a_row_holds_at_most_max_per_row_examples_and_every_example_once(lengths, most):
    rng = np.random.default_rng(0)
    examples = [
        Example(rng.integers(1, 200, n).astype(np.int32), np.ones(n, bool)) for n in lengths
    ]
    packed, stats = pack(examples, SEQ_LEN, PAD_ID, max_per_row=most)
    assert max(len(row) for row in packed.rows) <= most
    assert stats.most_per_row == max(len(row) for row in packed.rows)
    assert sorted(index for row in packed.rows for index in row) == list(range(len(lengths)))
    loads = [sum(len(packed.examples[i].ids) for i in row) for row in packed.rows]
    assert max(loads) <= SEQ_LEN + 1


def test_max_per_row_changes_only_rows_that_would_hold_more():
    short = [random_example(np.random.default_rng(n), 4, n) for n in range(12)]  # 8 fit a row
    _, free = pack(short, SEQ_LEN, PAD_ID)
    packed, capped = pack(short, SEQ_LEN, PAD_ID, max_per_row=3)
    assert free.most_per_row == 8 and free.rows == 2
    assert capped.most_per_row == 3 and capped.rows == 4
    assert [len(row) for row in packed.rows] == [3, 3, 3, 3]
    _, wide = pack(short, SEQ_LEN, PAD_ID, max_per_row=8)  # a limit no row reaches: as before
    assert wide == free
