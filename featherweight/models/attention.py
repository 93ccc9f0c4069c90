"""Causal self-attention as the step calls it.

The implementations (`IMPLEMENTATIONS`), one call (`attend`):

- "blockwise": the tiled ("flash") attention below, in plain JAX, on every backend;
- "cudnn": cuDNN's fused kernel; packed rows (segment ids) in cuDNN's packed layout, Hopper and
  later (`models/fused_attention.py`), a batch with a row of more documents than its slots
  (`packed_slots`) by blockwise instead;
- "cudnn_padded": cuDNN's fused kernel on rows of one document each, by their lengths;
- "pallas": jax's Pallas Triton flash attention with segment ids (NVIDIA GPUs);
- "materialized": XLA's path of `jax.nn.dot_product_attention`: float32 B x H x S x S scores,
  forward and backward (the reference the others are tested against).

Which one a run calls on its target is `models/attention_choice.py`.

Blockwise attention: no S x S array, forward or backward.

The queries and keys are cut into blocks of `block` positions. For each query block the key blocks
at or below the diagonal are visited in a loop (the blocks above it are never computed: causal
attention skips them, it does not mask them), keeping an online softmax: a float32 running max
`m`, sum `l` and output accumulator per query row (FlashAttention, Dao et al. 2022; the loop order
of FlashAttention-2). Only one [B, H, block, block] tile of scores exists at a time.

A sequence no longer than one block is a single tile: no loop is built, and the tile's products
are taken head-major (q [B, K, G, S, h], k and v [B, K, S, h]: transient copies of O(S H h), so
that no product transposes the S x S tile; measured on this CPU, one XLA thread, SmolLM2-135M's
attention at b2 x 256, forward then forward and backward: 0.79x the time of XLA's materialized
attention, where the loops' layout took 1.10x; `benchmarks/attention_speed.py`). The arrays it
keeps for the backward pass are those of the loops.

The backward pass (a `jax.custom_vjp`) keeps only the output and the log-sum-exp `m + log l`
([B, H, S] float32) from the forward pass and recomputes each tile's probabilities once, in one
pass over the tiles at or below the diagonal, query block by query block: the tile gives its
share of dQ (summed in the query block's float32 carry and written once in the input dtype) and
of dK and dV (summed in place into float32 buffers the size of k and v -- in float32 they are the
outputs themselves). A two-pass backward (dQ per query block, then dK/dV per key block) would avoid
those two buffers for 16-bit inputs, at the price of every tile's probabilities, score product and
dO V^T product computed twice. Memory beyond inputs and outputs is O(B x H x (S + block^2)) in
both directions, against the B x H x S x S float32 scores (and their cotangent) of the
materialized path.

Grouped-query attention reads each K/V head once for its G = H / K query heads (the query heads
are viewed as [K, G]; K/V are never repeated). Segment ids (packed rows) restrict each query to
keys of its own segment. Lengths that do not divide the block are padded at the end: a padded key
lies after every real query, so the causal rule alone keeps it out of real rows.

Layouts: q [B, S, H, h]; k, v [B, S, K, h]; segment_ids [B, S] int or None; out [B, S, H, h].
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import StepConfigError
from featherweight.models.fused_attention import (
    DEFAULT_PACKED_SLOTS,
    cudnn_attention,
    packed_or_fallback,
    pallas_attention,
)

# what a step calls; "cudnn" keeps packed rows apart by cuDNN's packed layout, "cudnn_padded"
# gives it rows of one document each by their lengths
IMPLEMENTATIONS = ("blockwise", "cudnn", "cudnn_padded", "pallas", "materialized")
# what a config names
ATTENTION_CHOICES = ("auto", "blockwise", "cudnn", "pallas", "materialized")
BLOCK = 512
# the score of a masked pair: finite, so a row with no visible key in a tile keeps finite maxima
_MASKED = -0.7 * float(np.finfo(np.float32).max)


class ScoreForm(NamedTuple):
    """How a family forms its attention scores (static): the scale on q.k (None: head_dim^-1/2),
    a tanh softcap (Gemma 2), the sliding window (a query sees itself and the window - 1
    positions before it; None: every earlier position), and whether learned sink logits join
    every softmax (gpt-oss; their values are the layer's, passed beside the form)."""

    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    sinks: bool = False

    def scale_for(self, head_dim: int) -> float:
        return 1.0 / math.sqrt(head_dim) if self.scale is None else self.scale


PLAIN = ScoreForm()


def block_size(seq_len: int, block: int = BLOCK) -> int:
    """The tile edge used for `seq_len` positions: `block`, or the whole sequence when shorter."""
    return max(1, min(block, seq_len))


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    block: int = BLOCK,
    form: ScoreForm = PLAIN,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query attention, tile by tile: -> [B, S, H, h].

    Equal to `jax.nn.dot_product_attention(q, k, v, is_causal=True)` (with the segment mask when
    `segment_ids` are given), with float32 softmax statistics for 16-bit inputs; scores formed as
    `form` says. With a window, each query block visits only the key blocks the window reaches:
    O(S x window) work, not O(S^2). `sinks` [H] (gpt-oss): a logit per head that joins every
    row's softmax and adds no value -- the online softmax starts from it.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    tile = block_size(seq, block)
    padded = math.ceil(seq / tile) * tile
    q5 = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # [B, S, K, G, h]
    if sinks is not None:
        sinks = sinks.astype(jnp.float32).reshape(kv_heads, heads // kv_heads)  # [K, G]
    if tile == seq:  # a lone tile: no loop, its products head-major
        out = _lone_tile(q5, k, v, segment_ids, sinks, form)
        return out.reshape(batch, seq, heads, head_dim)
    if padded != seq:
        q5, k, v = (_pad_positions(x, padded) for x in (q5, k, v))
        if segment_ids is not None:
            segment_ids = _pad_positions(segment_ids, padded)
    out = _attention(q5, k, v, segment_ids, sinks, tile, form)
    return out[:, :seq].reshape(batch, seq, heads, head_dim)


def _pad_positions(x: jax.Array, length: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths)


def _slice(x: jax.Array, index, tile: int) -> jax.Array:
    """Tile `index` along the position axis (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, index * tile, tile, axis=1)


def _tile_mask(
    q_index, k_index, tile: int, segments: jax.Array | None, window: int | None = None
) -> jax.Array:
    """Which (query, key) pairs of a tile are visible: [B or 1, 1, 1, tile, tile] bool."""
    q_pos = q_index * tile + jnp.arange(tile)
    k_pos = k_index * tile + jnp.arange(tile)
    visible = q_pos[:, None] >= k_pos[None, :]
    if window is not None:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    visible = visible[None]  # [1, tq, tk]
    if segments is not None:
        same = (
            _slice(segments, q_index, tile)[:, :, None] == _slice(segments, k_index, tile)[:, None]
        )
        visible = visible & same  # [B, tq, tk]
    return visible[:, None, None]


def _capped(s: jax.Array, form: ScoreForm) -> jax.Array:
    """Scaled scores, softcapped (cap x tanh(s / cap)) when the form caps them."""
    return s if form.softcap is None else form.softcap * jnp.tanh(s / form.softcap)


def _slope(capped: jax.Array, form: ScoreForm) -> jax.Array | float:
    """d capped / d scaled score: 1 - tanh^2 under a softcap, else 1."""
    return 1.0 if form.softcap is None else 1.0 - jnp.square(capped / form.softcap)


def _scores(q_tile: jax.Array, k_tile: jax.Array, form: ScoreForm) -> jax.Array:
    """float32 scores [B, K, G, tq, tk] of q [B, tq, K, G, h] against k [B, tk, K, h], scaled
    and capped as `form` says."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_tile, k_tile, preferred_element_type=jnp.float32)
    return _capped(s * form.scale_for(q_tile.shape[-1]), form)


def _first_key_block(i, tile: int, window: int | None):
    """The first key block a query block `i` can see: 0, or the block holding the first key the
    window reaches from the block's first query."""
    if window is None:
        return 0
    return jnp.maximum(0, (i * tile - window + 1) // tile)


def _causal_sweep(i, visit, carry, tile: int, window: int | None = None):
    """`visit(j, carry)` over the key blocks of query block `i` that it can see: at most i
    (causal attention never visits the blocks above the diagonal), from the first the window
    reaches. One loop body, every tile masked: a diagonal tile visited apart from an unmasked
    loop below it compiled to two bodies whose buffers XLA:CPU does not share (1.5x the tiles'
    bytes)."""
    if isinstance(i, int) and i == 0:  # a lone tile (S <= block): no loop at all
        return visit(0, carry)
    return jax.lax.fori_loop(_first_key_block(i, tile, window), i + 1, visit, carry)


def _over_blocks(count: int, body, init):
    """`body(i, carry)` for i in 0..count-1: a loop, or one call with i = 0 for a lone tile."""
    return body(0, init) if count == 1 else jax.lax.fori_loop(0, count, body, init)


def _forward(q, k, v, segments, sinks, tile, form):
    """(out [B, Sp, K, G, h] in q's dtype, log-sum-exp [B, K, G, Sp] float32): the sinks, when
    given, are each row's first term (a running max and sum of one, no value)."""
    batch, padded, kv_heads, groups, head_dim = q.shape
    stats_shape = (batch, kv_heads, groups, tile)

    def query_block(i):
        q_tile = _slice(q, i, tile)

        def key_block(j, carry):
            row_max, row_sum, acc = carry
            visible = _tile_mask(i, j, tile, segments, form.window)
            s = jnp.where(visible, _scores(q_tile, _slice(k, j, tile), form), _MASKED)
            new_max = jnp.maximum(row_max, s.max(axis=-1))
            correction = jnp.exp(row_max - new_max)
            # a masked score's probability is exp(_MASKED - a real max) = 0 exactly. A row with
            # no visible key yet (segments) has max _MASKED and sums exp(0) = 1 per masked key;
            # the diagonal tile, visited last, always shows the row its own key, and the
            # correction exp(_MASKED - its real max) = 0 then clears that finite sum: no select
            p = jnp.exp(s - new_max[..., None])
            pv = jnp.einsum(
                "bkgqs,bskd->bkgqd",
                p.astype(v.dtype),
                _slice(v, j, tile),
                preferred_element_type=jnp.float32,
            )
            row_sum = row_sum * correction + p.sum(axis=-1)
            return new_max, row_sum, acc * correction[..., None] + pv

        if sinks is None:
            start_max, start_sum = jnp.full(stats_shape, _MASKED, jnp.float32), 0.0
        else:
            start_max, start_sum = jnp.broadcast_to(sinks[None, :, :, None], stats_shape), 1.0
        init = (
            start_max,
            jnp.full(stats_shape, start_sum, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32),
        )
        row_max, row_sum, acc = _causal_sweep(i, key_block, init, tile, form.window)
        out = acc / jnp.where(row_sum > 0, row_sum, 1.0)[..., None]
        return jnp.moveaxis(out, 3, 1).astype(q.dtype), row_max + jnp.log(row_sum)

    def write(i, buffers):
        out, lse = buffers
        out_tile, lse_tile = query_block(i)
        return (
            jax.lax.dynamic_update_slice_in_dim(out, out_tile, i * tile, axis=1),
            jax.lax.dynamic_update_slice_in_dim(lse, lse_tile, i * tile, axis=3),
        )

    # each query block's result is written in place: no stacked copy of the output
    empty = (jnp.zeros(q.shape, q.dtype), jnp.zeros((batch, kv_heads, groups, padded), jnp.float32))
    return _over_blocks(padded // tile, write, empty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _attention(q, k, v, segments, sinks, tile, form):
    return _forward(q, k, v, segments, sinks, tile, form)[0]


def _attention_fwd(q, k, v, segments, sinks, tile, form):
    out, lse = _forward(q, k, v, segments, sinks, tile, form)
    return out, (q, k, v, segments, sinks, out, lse)


def _sinks_cotangent(sinks, lse, delta, axes):
    """d sink = -sum over rows of p_sink x delta (a sink's probability exp(sink - lse) moves
    every row's output by -p_sink x out): [K, G], or None without sinks."""
    if sinks is None:
        return None
    return -jnp.sum(jnp.exp(sinks - lse) * delta, axis=axes)


def _attention_bwd(tile, form, residuals, d_out):
    """One pass over the tiles at or below the diagonal, query block by query block: each tile's
    probabilities are recomputed once and give its share of dQ (summed in the block's float32
    carry, written once) and of dK and dV (summed in place into float32 buffers the size of k
    and v: in float32 they are the outputs themselves)."""
    q, k, v, segments, sinks, out, lse = residuals
    batch, padded, head_dim = q.shape[0], q.shape[1], q.shape[-1]
    scale = form.scale_for(head_dim)
    # D_i = rowsum(dO_i * O_i): the softmax backward's per-row term, [B, K, G, Sp]
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out, out, preferred_element_type=jnp.float32)

    def query_block(i, buffers):
        d_q_all, d_k_all, d_v_all = buffers
        q_tile, do_tile = _slice(q, i, tile), _slice(d_out, i, tile)
        lse_tile = jax.lax.dynamic_slice_in_dim(lse, i * tile, tile, axis=3)[..., None]
        delta_tile = jax.lax.dynamic_slice_in_dim(delta, i * tile, tile, axis=3)[..., None]

        def key_block(j, carry):
            d_q, d_k_all, d_v_all = carry
            k_tile, v_tile = _slice(k, j, tile), _slice(v, j, tile)
            visible = _tile_mask(i, j, tile, segments, form.window)
            # a masked score is _MASKED: its probability exp(_MASKED - lse) is exactly 0
            capped = _scores(q_tile, k_tile, form)
            p = jnp.exp(jnp.where(visible, capped, _MASKED) - lse_tile)
            d_p = jnp.einsum(
                "bqkgd,bskd->bkgqs", do_tile, v_tile, preferred_element_type=jnp.float32
            )
            d_s = (p * (d_p - delta_tile) * _slope(capped, form) * scale).astype(q.dtype)
            d_q = d_q + jnp.einsum(
                "bkgqs,bskd->bqkgd", d_s, k_tile, preferred_element_type=jnp.float32
            )
            d_v = jnp.einsum(
                "bkgqs,bqkgd->bskd", p.astype(v.dtype), do_tile, preferred_element_type=jnp.float32
            )
            d_k = jnp.einsum("bkgqs,bqkgd->bskd", d_s, q_tile, preferred_element_type=jnp.float32)
            return d_q, _add_block(d_k_all, d_k, j, tile), _add_block(d_v_all, d_v, j, tile)

        zeros = jnp.zeros((batch, tile, *q.shape[2:]), jnp.float32)
        d_q, d_k_all, d_v_all = _causal_sweep(
            i, key_block, (zeros, d_k_all, d_v_all), tile, form.window
        )
        d_q_all = jax.lax.dynamic_update_slice_in_dim(
            d_q_all, d_q.astype(q.dtype), i * tile, axis=1
        )
        return d_q_all, d_k_all, d_v_all

    init = (jnp.zeros_like(q), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    d_q, d_k, d_v = _over_blocks(padded // tile, query_block, init)
    sink_rows = None if sinks is None else sinks[None, :, :, None]
    d_sinks = _sinks_cotangent(sink_rows, lse, delta, (0, 3))
    return d_q, d_k.astype(k.dtype), d_v.astype(v.dtype), None, d_sinks


def _add_block(buffer: jax.Array, block: jax.Array, index, tile: int) -> jax.Array:
    """`buffer` with `block` added to its tile `index` along the position axis, in place."""
    return jax.lax.dynamic_update_slice_in_dim(
        buffer, _slice(buffer, index, tile) + block, index * tile, axis=1
    )


_attention.defvjp(_attention_fwd, _attention_bwd)


def _head_major(q, k, v):
    """q [B, S, K, G, h] -> [B, K, G, S, h]; k, v [B, S, K, h] -> [B, K, S, h]."""
    return q.transpose(0, 2, 3, 1, 4), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)


def _head_major_scores(q, k, segments, form: ScoreForm) -> tuple[jax.Array, jax.Array]:
    """(masked float32 scores [B, K, G, S, S], the same unmasked) of head-major
    q [B, K, G, S, h], k [B, K, S, h], scaled and capped as `form` says."""
    scale = form.scale_for(q.shape[-1])
    s = jnp.einsum("bkgqd,bksd->bkgqs", q, k, preferred_element_type=jnp.float32) * scale
    capped = _capped(s, form)
    return jnp.where(_tile_mask(0, 0, q.shape[3], segments, form.window), capped, _MASKED), capped


def _lone_tile_forward(q, k, v, segments, sinks, form):
    """(out [B, S, K, G, h] in q's dtype, the rows' log-sum-exp [B, K, G, S, 1] float32) of a
    sequence that is one tile (the sinks, when given, in every row's sum)."""
    q, k, v = _head_major(q, k, v)
    s, _ = _head_major_scores(q, k, segments, form)
    row_max = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        row_max = jnp.maximum(row_max, sinks[None, :, :, None, None])
    p = jnp.exp(s - row_max)  # unnormalized: the output is divided instead, [S, h] not [S, S]
    row_sum = p.sum(axis=-1, keepdims=True)
    if sinks is not None:
        row_sum = row_sum + jnp.exp(sinks[None, :, :, None, None] - row_max)
    out = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = (out / row_sum).astype(q.dtype).transpose(0, 3, 1, 2, 4)
    return out, row_max + jnp.log(row_sum)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _lone_tile(q, k, v, segments, sinks, form):
    """Attention over a sequence that is one tile: the products taken head-major (batched over
    B and K), so that none transposes the S x S tile; the arrays in and out, and those kept for
    the backward pass, in the loops' layout (the copies are transient)."""
    return _lone_tile_forward(q, k, v, segments, sinks, form)[0]


def _lone_tile_fwd(q, k, v, segments, sinks, form):
    out, lse = _lone_tile_forward(q, k, v, segments, sinks, form)
    return out, (q, k, v, segments, sinks, out, lse)


def _lone_tile_bwd(form, residuals, d_out):
    """The tile's backward: its probabilities made once again from the kept log-sum-exp."""
    q_in, k_in, v_in, segments, sinks, out, lse = residuals
    q, k, v = _head_major(q_in, k_in, v_in)
    d_out, out = (x.transpose(0, 2, 3, 1, 4) for x in (d_out, out))
    scale = form.scale_for(q.shape[-1])
    f32 = jnp.float32
    masked, capped = _head_major_scores(q, k, segments, form)
    p = jnp.exp(masked - lse)
    delta = jnp.einsum("bkgqd,bkgqd->bkgq", d_out, out, preferred_element_type=f32)[..., None]
    d_p = jnp.einsum("bkgqd,bksd->bkgqs", d_out, v, preferred_element_type=f32)
    d_s = (p * (d_p - delta) * _slope(capped, form) * scale).astype(q.dtype)
    d_q = jnp.einsum("bkgqs,bksd->bkgqd", d_s, k, preferred_element_type=f32)
    d_k = jnp.einsum("bkgqs,bkgqd->bksd", d_s, q, preferred_element_type=f32)
    d_v = jnp.einsum("bkgqs,bkgqd->bksd", p.astype(v.dtype), d_out, preferred_element_type=f32)
    return (
        d_q.astype(q.dtype).transpose(0, 3, 1, 2, 4),
        d_k.astype(k.dtype).transpose(0, 2, 1, 3),
        d_v.astype(v.dtype).transpose(0, 2, 1, 3),
        None,
        None
        if sinks is None
        else _sinks_cotangent(sinks[None, :, :, None], lse[..., 0], delta[..., 0], (0, 3)),
    )


_lone_tile.defvjp(_lone_tile_fwd, _lone_tile_bwd)


# --- the implementations behind one call -----------------------------------------------------


def attention_mask(
    segment_ids: jax.Array | None, query_len: int, key_len: int, window: int | None = None
) -> jax.Array:
    """Boolean [B or 1, 1, T, S]: causal (within the window when given), and within one segment
    when segments are given."""
    causal = jnp.tril(jnp.ones((query_len, key_len), dtype=bool), key_len - query_len)
    if window is not None:
        q_pos = jnp.arange(query_len)[:, None] + (key_len - query_len)
        causal = causal & (q_pos - jnp.arange(key_len)[None, :] < window)
    if segment_ids is None:
        return causal[None, None]
    same_segment = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal[None, None] & same_segment


def materialized_attention(
    q, k, v, mask: jax.Array, form: ScoreForm = PLAIN, sinks: jax.Array | None = None
) -> jax.Array:
    """XLA's path: the float32 B x H x T x S scores, scaled, capped and masked by `mask`
    [B or 1, 1, T, S], with each head's sink in its softmax when given -> [B, T, H, h] (the
    reference the tiled and fused paths are tested against; also a cached decode step's
    attention over its cache)."""
    if form.softcap is None and sinks is None:
        scale = form.scale_for(q.shape[-1])
        return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=scale, implementation="xla")
    groups = q.shape[2] // k.shape[2]
    q5 = q.reshape(*q.shape[:2], k.shape[2], groups, q.shape[-1])  # [B, T, K, G, h]
    scores = jnp.einsum("btkgd,bskd->bkgts", q5, k, preferred_element_type=jnp.float32)
    scores = _capped(scores * form.scale_for(q.shape[-1]), form)
    scores = jnp.where(mask[:, :, None], scores, _MASKED)  # [B, K, G, T, S]
    if sinks is not None:  # a column of each head's sink, dropped after the softmax
        sink = sinks.astype(jnp.float32).reshape(1, k.shape[2], groups, 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)
        probs = probs[..., :-1].astype(v.dtype)
    else:
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.astype(q.dtype).reshape(q.shape)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    implementation: str,
    packed_slots: int = DEFAULT_PACKED_SLOTS,
    scale: float | None = None,
    softcap: float | None = None,
    window: int | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query self-attention: q [B, S, H, h], k, v [B, S, K, h]
    -> [B, S, H, h], by `implementation` (one of `IMPLEMENTATIONS`; "cudnn" gives cuDNN packed
    rows of at most `packed_slots` documents, "cudnn_padded" rows of one document each:
    `models/fused_attention.py`), the scores scaled by `scale` (None: head_dim^-1/2), capped by
    `softcap` and kept within `window` positions when given; `sinks` [H]: gpt-oss's per-head
    sink logits. cuDNN and Pallas take no softcap or sinks and Pallas no window:
    `attention_choice` never picks them for such a model."""
    form = ScoreForm(scale, softcap, window)
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids, form=form, sinks=sinks)
    if implementation == "materialized":
        if segment_ids is None and form == PLAIN and sinks is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        mask = attention_mask(segment_ids, q.shape[1], k.shape[1], window)
        return materialized_attention(q, k, v, mask, form, sinks)
    if sinks is not None:
        raise StepConfigError(
            f"attention implementation {implementation!r} takes no attention sinks (gpt-oss); "
            "use memory.attention: blockwise"
        )
    fused_form = dict(scale=form.scale_for(q.shape[-1]), window=window)
    if segment_ids is None and implementation in ("cudnn", "cudnn_padded"):
        return cudnn_attention(q, k, v, None, "plain", **fused_form)
    if implementation == "cudnn_padded":
        return cudnn_attention(q, k, v, segment_ids, "padded", **fused_form)
    if implementation == "cudnn":  # more documents in a row than cuDNN's slots: blockwise

        def packed(q, k, v, segment_ids):
            return cudnn_attention(q, k, v, segment_ids, "packed", packed_slots, **fused_form)

        def fallback(q, k, v, segment_ids):
            return blockwise_attention(q, k, v, segment_ids, form=form)

        return packed_or_fallback(q, k, v, segment_ids, packed, fallback, packed_slots)
    if implementation == "pallas":
        return pallas_attention(q, k, v, segment_ids, scale=fused_form["scale"])
    raise StepConfigError(
        f"attention implementation {implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
    )
