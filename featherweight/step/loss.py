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
from featherweight.models.llama import Params, rms_norm
from featherweight.parallel.memory_kinds import host_rows, on_host
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, take_rows_nf4


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


def _head_rows(head: jax.Array | NF4Tensor, row_ids: jax.Array, dtype) -> jax.Array:
    """Rows of the [V, D] head (dequantized when NF4, fetched when in host memory): only a
    vocabulary chunk is ever dense on the device."""
    if isinstance(head, NF4Tensor):
        return take_rows_nf4(head, row_ids, dtype)
    if on_host(head):  # a tied, frozen table in host memory: the chunk's rows come over
        return host_rows(head, row_ids).astype(dtype)
    return jnp.take(head, row_ids, axis=0).astype(dtype)


def _vocab_chunked_nll(normed, head, targets, vocab_chunk: int) -> jax.Array:
    """Cross-entropy [B, c] with logits made `vocab_chunk` rows of the head at a time.

    An online logsumexp (running max and sum) over the vocabulary chunks; rows past the end of
    the vocabulary (last chunk) are masked out. Each chunk is rematerialized in the backward pass.
    """
    vocab = head.shape[0]
    count = -(-vocab // vocab_chunk)

    def body(carry, start):
        running_max, running_sum, target_logit = carry
        row_ids = start + jnp.arange(vocab_chunk)
        valid = row_ids < vocab
        rows = _head_rows(head, jnp.minimum(row_ids, vocab - 1), normed.dtype)
        logits = jnp.einsum("bcd,vd->bcv", normed, rows).astype(jnp.float32)
        logits = jnp.where(valid, logits, -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
            jnp.exp(logits - new_max[..., None]), axis=-1
        )
        hit = row_ids == targets[..., None]
        target_logit = target_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        return (new_max, running_sum, target_logit), None

    shape = targets.shape
    start = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )
    (running_max, running_sum, target_logit), _ = jax.lax.scan(
        jax.checkpoint(body), start, jnp.arange(count) * vocab_chunk
    )
    return running_max + jnp.log(running_sum) - target_logit


def token_losses_sum(
    hidden: jax.Array,
    final_norm: jax.Array,
    head: jax.Array | NF4Tensor,
    target_ids: jax.Array,
    loss_mask: jax.Array,
    eps: float,
    chunk_size: int | None = None,
    vocab_chunk: int | None = None,
) -> jax.Array:
    """Sum over tokens of mask x cross-entropy, computing logits one sequence chunk at a time.

    hidden [B, S, D]; head [V, D] (array, or NF4); targets and mask [B, S]. Each sequence chunk is
    rematerialized, so its backward recomputes the chunk's logits instead of keeping them. With
    `vocab_chunk`, the vocabulary is chunked too: at most B x chunk x vocab_chunk logits and
    `vocab_chunk` dense head rows exist (an NF4 head is dequantized chunk by chunk).
    """
    batch, seq, _ = hidden.shape
    chunk = resolve_chunk_size(seq, chunk_size)
    count = seq // chunk

    def chunk_loss(h, targets, mask):
        normed = rms_norm(h, final_norm, eps)
        if vocab_chunk is not None and vocab_chunk < head.shape[0]:
            nll = _vocab_chunked_nll(normed, head, targets, vocab_chunk)
        else:
            weight = dequantize_nf4(head, normed.dtype) if isinstance(head, NF4Tensor) else head
            logits = jnp.einsum("bcd,vd->bcv", normed, weight.astype(normed.dtype))
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
    vocab_chunk: int | None = None,
) -> jax.Array:
    """Mean cross-entropy over counted tokens, from the last hidden state [B, S, D].

    head_params: {"final_norm", "lm_head" or "embed" (tied)}; the head may be NF4.
    """
    head = head_params.get("lm_head")
    total = token_losses_sum(
        hidden,
        head_params["final_norm"],
        head_params["embed"] if head is None else head,
        batch.target_ids,
        batch.loss_mask,
        config.rms_norm_eps,
        chunk_size,
        vocab_chunk,
    )
    return total / jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
