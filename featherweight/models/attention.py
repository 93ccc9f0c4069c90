"""Causal self-attention as the step calls it, and which implementation that is.

Three implementations (`IMPLEMENTATIONS`), one call (`attend`):

- "blockwise": the tiled ("flash") attention below, in plain JAX, on every backend;
- "cudnn": cuDNN's fused kernel through `jax.nn.dot_product_attention(implementation="cudnn")`,
  on NVIDIA GPUs where it applies (`cudnn_refusal` says where it does not);
- "materialized": XLA's path of `jax.nn.dot_product_attention`: float32 B x H x S x S scores,
  forward and backward (the reference the others are tested against).

`choose_attention` turns the user's choice ("auto" or one of the three) into the implementation
for a target (`AttentionTarget`: the platform and GPU generation the run compiles for), refusing
what cannot run there; the planner plans the same choice (`memory/working_set.py`).

Blockwise attention: no S x S array, forward or backward.

The queries and keys are cut into blocks of `block` positions. For each query block the key blocks
at or below the diagonal are visited in a loop (the blocks above it are never computed: causal
attention skips them, it does not mask them), keeping an online softmax: a float32 running max
`m`, sum `l` and output accumulator per query row (FlashAttention, Dao et al. 2022; the loop order
of FlashAttention-2). Only one [B, H, block, block] tile of scores exists at a time.

The backward pass (a `jax.custom_vjp`) keeps only the output and the log-sum-exp `m + log l`
([B, H, S] float32) from the forward pass and recomputes each tile's probabilities, in two passes
over the tiles at or below the diagonal: per query block its dQ, per key block its dK and dV, each
accumulated in float32 over its tiles and written once in the input dtype. No float32 buffer as
long as the sequence exists beyond the row statistics ([B, H, S]); the price is the tiles'
probabilities computed twice. Memory beyond inputs and outputs is O(B x H x (S + block^2)) in
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

IMPLEMENTATIONS = ("blockwise", "cudnn", "materialized")
ATTENTION_CHOICES = ("auto", *IMPLEMENTATIONS)
BLOCK = 512
# the score of a masked pair: finite, so a row with no visible key in a tile keeps finite maxima
_MASKED = -0.7 * float(np.finfo(np.float32).max)


def block_size(seq_len: int, block: int = BLOCK) -> int:
    """The tile edge used for `seq_len` positions: `block`, or the whole sequence when shorter."""
    return max(1, min(block, seq_len))


def blockwise_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None = None,
    block: int = BLOCK,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query attention, tile by tile: -> [B, S, H, h].

    Equal to `jax.nn.dot_product_attention(q, k, v, is_causal=True)` (with the segment mask when
    `segment_ids` are given), with float32 softmax statistics for 16-bit inputs.
    """
    batch, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    tile = block_size(seq, block)
    padded = math.ceil(seq / tile) * tile
    q5 = q.reshape(batch, seq, kv_heads, heads // kv_heads, head_dim)  # [B, S, K, G, h]
    if padded != seq:
        q5, k, v = (_pad_positions(x, padded) for x in (q5, k, v))
        if segment_ids is not None:
            segment_ids = _pad_positions(segment_ids, padded)
    out = _attention(q5, k, v, segment_ids, tile)
    return out[:, :seq].reshape(batch, seq, heads, head_dim)


def _pad_positions(x: jax.Array, length: int) -> jax.Array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, length - x.shape[1])
    return jnp.pad(x, widths)


def _slice(x: jax.Array, index, tile: int) -> jax.Array:
    """Tile `index` along the position axis (axis 1)."""
    return jax.lax.dynamic_slice_in_dim(x, index * tile, tile, axis=1)


def _tile_mask(q_index, k_index, tile: int, segments: jax.Array | None) -> jax.Array:
    """Which (query, key) pairs of a tile are visible: [B or 1, 1, 1, tile, tile] bool."""
    q_pos = q_index * tile + jnp.arange(tile)
    k_pos = k_index * tile + jnp.arange(tile)
    visible = (q_pos[:, None] >= k_pos[None, :])[None]  # [1, tq, tk]
    if segments is not None:
        same = (
            _slice(segments, q_index, tile)[:, :, None] == _slice(segments, k_index, tile)[:, None]
        )
        visible = visible & same  # [B, tq, tk]
    return visible[:, None, None]


def _scores(q_tile: jax.Array, k_tile: jax.Array, scale: float) -> jax.Array:
    """float32 scores [B, K, G, tq, tk] of q [B, tq, K, G, h] against k [B, tk, K, h]."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", q_tile, k_tile, preferred_element_type=jnp.float32)
    return s * scale


def _forward(q, k, v, segments, tile):
    """(out [B, Sp, K, G, h] in q's dtype, log-sum-exp [B, K, G, Sp] float32)."""
    batch, padded, kv_heads, groups, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    stats_shape = (batch, kv_heads, groups, tile)

    def query_block(i):
        q_tile = _slice(q, i, tile)

        def key_block(j, carry):
            row_max, row_sum, acc = carry
            visible = _tile_mask(i, j, tile, segments)
            s = jnp.where(visible, _scores(q_tile, _slice(k, j, tile), scale), _MASKED)
            new_max = jnp.maximum(row_max, s.max(axis=-1))
            correction = jnp.exp(row_max - new_max)
            p = jnp.where(visible, jnp.exp(s - new_max[..., None]), 0.0)
            pv = jnp.einsum(
                "bkgqs,bskd->bkgqd",
                p.astype(v.dtype),
                _slice(v, j, tile),
                preferred_element_type=jnp.float32,
            )
            row_sum = row_sum * correction + p.sum(axis=-1)
            return new_max, row_sum, acc * correction[..., None] + pv

        init = (
            jnp.full(stats_shape, _MASKED, jnp.float32),
            jnp.zeros(stats_shape, jnp.float32),
            jnp.zeros((*stats_shape, head_dim), jnp.float32),
        )
        # causal: only the key blocks 0..i, the blocks above the diagonal are never visited
        row_max, row_sum, acc = jax.lax.fori_loop(0, i + 1, key_block, init)
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
    return jax.lax.fori_loop(0, padded // tile, write, empty)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, segments, tile):
    return _forward(q, k, v, segments, tile)[0]


def _attention_fwd(q, k, v, segments, tile):
    out, lse = _forward(q, k, v, segments, tile)
    return out, (q, k, v, segments, out, lse)


def _attention_bwd(tile, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    batch, padded, kv_heads, _, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim)
    count = padded // tile
    # D_i = rowsum(dO_i * O_i): the softmax backward's per-row term, [B, K, G, Sp]
    delta = jnp.einsum("bqkgd,bqkgd->bkgq", d_out, out, preferred_element_type=jnp.float32)

    def tile_grads(i, j):
        """Probabilities p and score cotangents dS (scaled, in q's dtype) of tile (i, j)."""
        q_tile, do_tile = _slice(q, i, tile), _slice(d_out, i, tile)
        lse_tile = jax.lax.dynamic_slice_in_dim(lse, i * tile, tile, axis=3)
        delta_tile = jax.lax.dynamic_slice_in_dim(delta, i * tile, tile, axis=3)
        s = _scores(q_tile, _slice(k, j, tile), scale)
        p = jnp.where(_tile_mask(i, j, tile, segments), jnp.exp(s - lse_tile[..., None]), 0.0)
        d_p = jnp.einsum(
            "bqkgd,bskd->bkgqs", do_tile, _slice(v, j, tile), preferred_element_type=jnp.float32
        )
        return p, (p * (d_p - delta_tile[..., None]) * scale).astype(q.dtype)

    def query_block(i):
        """dQ of query block i: its key blocks 0..i (causal)."""

        def key_block(j, d_q):
            _, d_s = tile_grads(i, j)
            return d_q + jnp.einsum(
                "bkgqs,bskd->bqkgd", d_s, _slice(k, j, tile), preferred_element_type=jnp.float32
            )

        zeros = jnp.zeros((batch, tile, *q.shape[2:]), jnp.float32)
        return jax.lax.fori_loop(0, i + 1, key_block, zeros).astype(q.dtype)

    def key_block(j):
        """dK, dV of key block j: its query blocks j..n-1 (causal)."""

        def query_block(i, carry):
            d_k, d_v = carry
            p, d_s = tile_grads(i, j)
            d_v = d_v + jnp.einsum(
                "bkgqs,bqkgd->bskd",
                p.astype(v.dtype),
                _slice(d_out, i, tile),
                preferred_element_type=jnp.float32,
            )
            d_k = d_k + jnp.einsum(
                "bkgqs,bqkgd->bskd", d_s, _slice(q, i, tile), preferred_element_type=jnp.float32
            )
            return d_k, d_v

        zeros = jnp.zeros((batch, tile, kv_heads, head_dim), jnp.float32)
        d_k, d_v = jax.lax.fori_loop(j, count, query_block, (zeros, zeros))
        return d_k.astype(k.dtype), d_v.astype(v.dtype)

    # two passes, each output tile accumulated in float32 and written once, in place, in the
    # input dtype: no S-long float32 accumulator (the tiles' probabilities are computed twice)
    def write_q(i, d_q):
        return jax.lax.dynamic_update_slice_in_dim(d_q, query_block(i), i * tile, axis=1)

    def write_kv(j, buffers):
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(buffer, block, j * tile, axis=1)
            for buffer, block in zip(buffers, key_block(j))
        )

    d_q = jax.lax.fori_loop(0, count, write_q, jnp.zeros_like(q))
    d_k, d_v = jax.lax.fori_loop(0, count, write_kv, (jnp.zeros_like(k), jnp.zeros_like(v)))
    return d_q, d_k, d_v, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# --- the implementations behind one call -----------------------------------------------------

_PACKED_ROWS = (
    "cudnn attention cannot keep packed rows apart: jax.nn.dot_product_attention takes no "
    "segment ids for cuDNN (MaxText #4476 attended across documents); use blockwise"
)


def attention_mask(segment_ids: jax.Array | None, query_len: int, key_len: int) -> jax.Array:
    """Boolean [B or 1, 1, T, S]: causal, and within one segment when segments are given."""
    causal = jnp.tril(jnp.ones((query_len, key_len), dtype=bool), key_len - query_len)
    if segment_ids is None:
        return causal[None, None]
    same_segment = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    return causal[None, None] & same_segment


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array | None,
    implementation: str,
) -> jax.Array:
    """Causal (and segment-masked) grouped-query self-attention: q [B, S, H, h], k, v [B, S, K, h]
    -> [B, S, H, h], by `implementation` (one of `IMPLEMENTATIONS`)."""
    if implementation == "blockwise":
        return blockwise_attention(q, k, v, segment_ids)
    if implementation == "materialized":
        if segment_ids is None:
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
        mask = attention_mask(segment_ids, q.shape[1], k.shape[1])
        return jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    if implementation == "cudnn":
        if segment_ids is not None:
            raise StepConfigError(_PACKED_ROWS)
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    raise StepConfigError(
        f"attention implementation {implementation!r} is unknown; use one of {IMPLEMENTATIONS}"
    )


# --- which implementation a target runs ------------------------------------------------------


class AttentionTarget(NamedTuple):
    """What the attention is compiled for: the platform ("cpu", "gpu", "tpu") and, for an NVIDIA
    GPU, its compute capability ("8.0" A100, "8.9" Ada, "9.0" H100); None elsewhere."""

    platform: str
    compute_capability: str | None = None

    @classmethod
    def of_device(cls, device: jax.Device | None = None) -> AttentionTarget:
        """The target of `device` (default: the first device, the one a run computes on)."""
        device = device or jax.devices()[0]
        return cls(device.platform, getattr(device, "compute_capability", None))

    def __str__(self) -> str:
        if self.compute_capability is None:
            return self.platform
        return f"{self.platform} (compute capability {self.compute_capability})"


def cudnn_refusal(
    target: AttentionTarget, dtype: str, head_dim: int, segment_ids: bool, backward: bool = True
) -> str | None:
    """Why cuDNN's fused attention cannot run this call (None when it can): an NVIDIA GPU, bf16 or
    fp16, head dim a multiple of 8 and <= 128 (<= 256 on Hopper and later; Ampere/Ada's backward
    stops at 128), causal, and no segment ids."""
    if target.platform != "gpu" or target.compute_capability is None:
        return f"cuDNN needs an NVIDIA GPU, the target is {target}"
    if dtype not in ("bfloat16", "float16"):
        return f"cuDNN's fused attention needs bfloat16 or float16, the dtype is {dtype}"
    hopper = int(target.compute_capability.split(".")[0]) >= 9
    limit = 256 if hopper else 128
    if head_dim % 8 or head_dim > limit:
        why = "" if hopper or head_dim > 256 else " (Ampere/Ada: the backward stops at 128)"
        work = "training" if backward else "the forward pass"
        return (
            f"head dim {head_dim} is not a multiple of 8 up to {limit} on {target}{why} for {work}"
        )
    if segment_ids:
        return _PACKED_ROWS
    return None


def choose_attention(
    choice: str,
    target: AttentionTarget,
    dtype: str,
    head_dim: int,
    segment_ids: bool,
    backward: bool = True,
) -> str:
    """The implementation `choice` means on `target`: "auto" is cudnn where `cudnn_refusal` finds
    nothing against it and blockwise otherwise; an explicit choice is kept, or refused with the
    reason when it cannot run (`StepConfigError`)."""
    if choice == "flash":
        raise StepConfigError(
            "memory.attention: flash is gone (it only changed the plan); use blockwise (tiled "
            "attention on every backend), cudnn (NVIDIA GPUs) or auto"
        )
    if choice not in ATTENTION_CHOICES:
        raise StepConfigError(
            f"memory.attention={choice!r} is unknown; use one of {', '.join(ATTENTION_CHOICES)}"
        )
    refusal = cudnn_refusal(target, dtype, head_dim, segment_ids, backward)
    if choice == "auto":
        return "blockwise" if refusal else "cudnn"
    if choice == "cudnn" and refusal:
        raise StepConfigError(f"memory.attention=cudnn cannot run: {refusal}")
    return choice
