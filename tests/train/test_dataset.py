"""The data side of a run's attention: the note that says when cuDNN's packed slots are fewer
than the documents the training rows hold, and what to set."""

import numpy as np

from featherweight.data.packing import Example, pack
from featherweight.data.records import Dataset
from featherweight.recipe.schema import parse_config
from featherweight.train.dataset import packed_slots_note


def _dataset(lengths, max_per_row=None) -> Dataset:
    examples = [Example(np.ones(n, np.int32), np.ones(n, bool)) for n in lengths]
    train, stats = pack(examples, 31, 0, max_per_row=max_per_row)
    return Dataset(train, None, stats, None, 0, len(lengths), ())


def test_the_note_names_the_rows_with_more_documents_than_cudnns_slots():
    dataset = _dataset([4] * 8 + [30])  # a row of 8 short examples, a row of one long one
    config = parse_config({})
    note = packed_slots_note(config, "cudnn", dataset)
    assert "holds 4 documents a row and 1 of 2 training rows hold more (up to 8)" in note
    assert "data.max_documents_per_row: N" in note
    assert packed_slots_note(config, "blockwise", dataset) is None  # no slots to exceed
    capped = parse_config({"data": {"max_documents_per_row": 8}})
    assert packed_slots_note(capped, "cudnn", dataset) is None  # 8 slots hold every row
    assert packed_slots_note(config, "cudnn", _dataset([4] * 8, max_per_row=4)) is None
