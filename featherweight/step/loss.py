"""Batches and the language-model loss, with chunked cross-entropy.

The LM head and the loss run over sequence chunks inside a rematerialized scan, so at most
`B x chunk x V` float32 logits exist at once -- forward and backward. Full logits for Llama 3's
128k vocabulary at B=8, S=4096 would be 16 GiB.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from featherweight.errors import StepConfigError
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params, lm_head_weight, rms_norm


class Batch(NamedTuple):
    """One micro-batch, all [B, S]: inputs, next-token targets, a loss mask (1 = counted),
    positions (reset per packed example) and segment ids (packed examples never attend across)."""

    input_ids: jax.Array
    target_ids: jax.Array
    loss_mask: jax.Array
    positions: jax.Array
    segment_ids: jax.Array | None = None


def batch_from_tokens(tokens: jax.Array) -> Batch:
    """A plain causal-LM batch from token rows [B, S+1]: predict token t+1 from tokens <= t."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
    return Batch(inputs, targets, jnp.ones(inputs.shape, jnp.float32), positions, None)


def resolve_chunk_size(seq_len: int, chunk_size: int | None) -> int:
    """The sequence chunk of the loss: all of it when None; must divide the sequence length."""
    if chunk_size is None or chunk_size >= seq_len:
        return seq_len
    if chunk_size <= 0 or seq_len % chunk_size:
        divisors = [c for c in (64, 128, 256, 512, 1024, 2048) if c < seq_len and seq_len % c == 0]
        raise StepConfigError(
            f"loss chunk size {chunk_size} does not divide the sequence length {seq_len}; "
            f"use a divisor such as {divisors[-1] if divisors else seq_len}"
        )
    return chunk_size


def token_losses_sum(
    hidden: jax.Array,
    final_norm: jax.Array,
    head_weight: jax.Array,
    target_ids: jax.Array,
    loss_mask: jax.Array,
    eps: float,
    chunk_size: int | None = None,
) -> jax.Array:
    """Sum over tokens of mask x cross-entropy, computing logits one sequence chunk at a time.

    hidden [B, S, D]; head_weight [V, D]; targets and mask [B, S]. Each chunk is rematerialized,
    so its backward recomputes the chunk's logits instead of keeping them.
    """
    batch, seq, _ = hidden.shape
    chunk = resolve_chunk_size(seq, chunk_size)
    count = seq // chunk

    def chunk_loss(h, targets, mask):
        normed = rms_norm(h, final_norm, eps)
        logits = jnp.einsum("bcd,vd->bcv", normed, head_weight.astype(normed.dtype))
        logits = logits.astype(jnp.float32)
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        return jnp.sum(nll * mask.astype(jnp.float32))

    if count == 1:
        return chunk_loss(hidden, target_ids, loss_mask)

    def to_chunks(x):
        return jnp.moveaxis(x.reshape(batch, count, chunk, *x.shape[2:]), 1, 0)

    def body(total, chunk_inputs):
        return total + jax.checkpoint(chunk_loss)(*chunk_inputs), None

    total, _ = jax.lax.scan(
        body,
        jnp.zeros((), jnp.float32),
        (to_chunks(hidden), to_chunks(target_ids), to_chunks(loss_mask)),
    )
    return total


def head_loss(
    head_params: Params,
    hidden: jax.Array,
    batch: Batch,
    config: ModelConfig,
    chunk_size: int | None = None,
) -> jax.Array:
    """Mean cross-entropy over counted tokens, from the last hidden state [B, S, D].

    head_params: {"final_norm", "lm_head" or "embed" (tied)}.
    """
    total = token_losses_sum(
        hidden,
        head_params["final_norm"],
        lm_head_weight(head_params),
        batch.target_ids,
        batch.loss_mask,
        config.rms_norm_eps,
        chunk_size,
    )
    return total / jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
