"""The fused kernels' masks are exact: segment ids -> cuDNN's packed layout and row lengths (pure
functions, on CPU), and the Pallas kernel (interpret mode) equals blockwise attention on packed
rows, forward and gradients, sending exactly zero gradient across documents."""

import jax.numpy as jnp
import numpy as np
import pytest

from featherweight.dev.attention_check import (
    check_against_blockwise,
    cross_document_gradient,
    packed_inputs,
)
from featherweight.models.attention import attend, blockwise_attention
from featherweight.models.fused_attention import (
    documents_per_row,
    packed_layout,
    packed_or_fallback,
    pallas_attention,
    row_lengths,
)


def _random_rows(rng, batch, seq):
    """Packed rows as data/packing.py makes them: documents 1, 2, ... of random lengths, then
    padding (0); some rows all padding, some one document filling the row."""
    rows = np.zeros((batch, seq), np.int32)
    for r in range(batch):
        kind = r % 4
        if kind == 0:
            continue  # all padding
        if kind == 1:
            rows[r] = 1  # one document, no padding
            continue
        position, document = 0, 1
        while position < seq and rng.random() > 0.15:
            length = int(rng.integers(1, max(2, seq // 3)))
            rows[r, position : position + length] = document
            position, document = position + length, document + 1
    return rows


def _visible_from_layout(layout, seq):
    """[B, S, S] bool: (query, key) in the same document of the layout, key at or before query."""
    seqlen, offsets = np.asarray(layout.seqlen), np.asarray(layout.offsets)
    document = np.full((seqlen.shape[0], seq), -1)
    for b in range(seqlen.shape[0]):
        for m in range(seqlen.shape[1]):
            if seqlen[b, m] >= 0:
                document[b, offsets[b, m] : offsets[b, m] + seqlen[b, m]] = m
    same = (document[:, :, None] == document[:, None, :]) & (document[:, :, None] >= 0)
    return same & np.tril(np.ones((seq, seq), bool))


def test_packed_layout_masks_exactly_what_the_segment_ids_mask():
    rng = np.random.default_rng(0)
    segments = _random_rows(rng, 16, 40)
    layout = packed_layout(jnp.asarray(segments), max_documents=40)  # as many as a row can hold
    assert layout.seqlen.shape == (16, 40) and layout.offsets.shape == (16, 41)
    # what blockwise masks: same non-padding segment, causal
    want = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] > 0)
    want &= np.tril(np.ones((40, 40), bool))
    np.testing.assert_array_equal(_visible_from_layout(layout, 40), want)


def test_packed_layout_is_the_documented_format():
    segments = jnp.asarray([[1] * 5 + [2] * 9 + [3] * 3 + [0] * 3, [0] * 20, [1] * 20])
    layout = packed_layout(segments, max_documents=4)
    np.testing.assert_array_equal(layout.seqlen, [[5, 9, 3, -1], [-1] * 4, [20, -1, -1, -1]])
    np.testing.assert_array_equal(
        layout.offsets, [[0, 5, 14, -1, -1], [-1] * 5, [0, -1, -1, -1, -1]]
    )
    np.testing.assert_array_equal(row_lengths(segments), [17, 0, 20])
    np.testing.assert_array_equal(documents_per_row(segments), [3, 0, 1])


def test_a_row_of_more_documents_than_the_slots_runs_the_fallback():
    # the fused kernel here is a wrong one (no segment ids), so which ran shows in the output;
    # the packed inputs hold three documents in a row
    inputs = packed_inputs()

    def dispatched(slots):
        def attention(q, k, v, segments):
            return packed_or_fallback(
                q, k, v, segments, _across_documents, blockwise_attention, slots
            )

        return check_against_blockwise(attention, inputs)

    fallback = dispatched(slots=2)  # three documents > 2 slots: blockwise
    assert fallback.output_error <= 1e-5 * fallback.output_scale
    assert fallback.cross_document_gradient == 0.0
    fused = dispatched(slots=3)  # three fit: the fused kernel ran (and attends across)
    assert fused.cross_document_gradient > 0.1


def _pallas(q, k, v, segments):
    return pallas_attention(q, k, v, segments, interpret=True)


def _materialized(q, k, v, segments):
    return attend(q, k, v, segments, "materialized")


def _across_documents(q, k, v, segments):
    """A deliberately wrong kernel: the Pallas kernel without the segment ids (causal only)."""
    return pallas_attention(q, k, v, None, interpret=True)


def test_pallas_equals_blockwise_on_packed_rows_and_keeps_documents_apart():
    check = check_against_blockwise(_pallas, packed_inputs())
    assert check.output_error <= 1e-5 * check.output_scale
    for error, scale in zip(check.gradient_errors, check.gradient_scales):
        assert error <= 1e-5 * scale
    assert check.cross_document_gradient == 0.0


@pytest.mark.parametrize("attention", [_materialized, None], ids=["materialized", "blockwise"])
def test_no_gradient_crosses_documents_in_the_plain_jax_implementations(attention):
    inputs = packed_inputs()
    if attention is None:
        attention = lambda q, k, v, segments: attend(q, k, v, segments, "blockwise")
    assert cross_document_gradient(attention, inputs) == 0.0


def test_the_check_catches_a_kernel_that_attends_across_documents():
    # negative control: the same check fails a kernel that drops the segment ids
    check = check_against_blockwise(_across_documents, packed_inputs())
    assert check.cross_document_gradient > 0.1
    assert check.output_error > 1e-2 * check.output_scale
