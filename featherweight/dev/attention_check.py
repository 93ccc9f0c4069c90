"""Does an attention implementation keep packed documents apart, and agree with blockwise?

A fused kernel handed the wrong mask attends across the documents of a packed row and trains on
it without a sign (MaxText #4476). This is the check every implementation passes, on CPU in the
tests and on a GPU in `benchmarks/gpu_check_attention.py`, for the same inputs
(`packed_inputs`): a row of three documents of unequal length and padding after them, and a row
that is all padding, grouped-query heads.

It reports (`AttentionCheck`) the largest differences from blockwise attention, forward and of the
gradients of a weighted sum of the real tokens' outputs (padding positions carry no loss in
training; what a kernel writes there is its own affair), and the largest gradient that one token's
output sends to the tokens of the other documents (q, k and v): exactly zero when the documents
are kept apart, whatever the kernel's rounding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.models.attention import blockwise_attention

Attention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]
DOCUMENTS = (11, 29, 17)  # the packed row's document lengths; padding fills the rest


class CheckInputs(NamedTuple):
    """q [B, S, H, h], k and v [B, S, K, h], segment_ids [B, S] (0 padding) and loss weights
    [B, S, H, h] (zero at padding)."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    segment_ids: jax.Array
    weights: jax.Array


class AttentionCheck(NamedTuple):
    """Largest absolute differences from blockwise (output and the q, k, v gradients, on real
    tokens), the largest absolute blockwise value of each (the scale they compare with), and
    the largest cross-document gradient."""

    output_error: float
    gradient_errors: tuple[float, float, float]
    output_scale: float
    gradient_scales: tuple[float, float, float]
    cross_document_gradient: float


def packed_inputs(
    seq: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype=jnp.float32,
    documents: tuple[int, ...] = DOCUMENTS,
) -> CheckInputs:
    """Two rows of `seq` positions: `documents` (default three of unequal length; one for rows
    of one document) then padding, and a row of padding only; random q, k, v (fixed seed) in
    `dtype`."""
    if sum(documents) >= seq:
        raise ValueError(f"seq={seq} must exceed the documents' {sum(documents)} tokens")
    row = np.concatenate([np.full(n, i + 1) for i, n in enumerate(documents)])
    segments = np.zeros((2, seq), np.int32)
    segments[0, : row.size] = row
    rng = np.random.default_rng(0)
    q, k, v = (
        jnp.asarray(rng.standard_normal((2, seq, n, head_dim)), dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    weights = rng.standard_normal((2, seq, heads, head_dim)) * (segments > 0)[..., None, None]
    return CheckInputs(q, k, v, jnp.asarray(segments), jnp.asarray(weights, jnp.float32))


def _loss(attention: Attention, inputs: CheckInputs):
    def loss(q, k, v):
        out = attention(q, k, v, inputs.segment_ids)
        return jnp.sum(out.astype(jnp.float32) * inputs.weights)

    return loss


def cross_document_gradient(attention: Attention, inputs: CheckInputs) -> float:
    """The largest |gradient| of the second document's last token's output (the first's, for a
    row of one document) with respect to q, k and v of every token outside that document (other
    documents and padding)."""
    segments = np.asarray(inputs.segment_ids)
    document = min(2, int(segments.max()))
    token = int(np.flatnonzero(segments[0] == document)[-1])
    one_token = jnp.zeros(inputs.weights.shape, jnp.float32).at[0, token].set(1.0)
    probe = inputs._replace(weights=one_token)
    grads = jax.jit(jax.grad(_loss(attention, probe), (0, 1, 2)))(*probe[:3])
    outside = segments != document
    return max(float(jnp.abs(g.astype(jnp.float32)[outside]).max()) for g in grads)


def check_against_blockwise(attention: Attention, inputs: CheckInputs) -> AttentionCheck:
    """`attention` set against blockwise attention on `inputs` (see the module docstring)."""

    def blockwise(q, k, v, segments):
        return blockwise_attention(q, k, v, segments, block=16)

    real = np.asarray(inputs.segment_ids) > 0

    def on_real(x):
        return np.asarray(x, np.float32)[real]

    def forward_and_grads(fn):
        out = jax.jit(fn)(*inputs[:4])
        grads = jax.jit(jax.grad(_loss(fn, inputs), (0, 1, 2)))(*inputs[:3])
        return on_real(out), [on_real(g) for g in grads]

    out, grads = forward_and_grads(attention)
    want, want_grads = forward_and_grads(blockwise)
    return AttentionCheck(
        output_error=float(np.abs(out - want).max()),
        gradient_errors=tuple(float(np.abs(g - w).max()) for g, w in zip(grads, want_grads)),
        output_scale=float(np.abs(want).max()),
        gradient_scales=tuple(float(np.abs(w).max()) for w in want_grads),
        cross_document_gradient=cross_document_gradient(attention, inputs),
    )
