"""The language-model loss, with chunked cross-entropy and its own backward pass.

Full logits for Llama 3's 128k vocabulary at B=8, S=4096 would be 16 GiB. With a sequence chunk
(`loss_chunk`) and/or a vocabulary chunk (`vocab_chunk`), at most `B x chunk x vocab_chunk`
float32 logits exist at once, forward and backward, and an NF4 head is dense one vocabulary
chunk at a time.

The chunked loss has a custom VJP whose forward pass computes the loss and its gradients (for a
cotangent of 1) in the same sweep over the sequence chunks, so no logits chunk is made again:

  sequence chunks only   each chunk's logits are made once; the loss, (softmax - onehot) x mask
                         and its contractions into d_hidden (and d_head) follow at once;
  vocabulary chunks, frozen head
                         per sequence chunk, one sweep over the vocabulary chunks gives an online
                         log-sum-exp (running max and sum), the target logit and the running
                         softmax-weighted sum of head rows (rescaled as the max moves, as flash
                         attention does for its output): d_normed = that sum / the running sum -
                         the target's row. Each logits chunk is made once;
  vocabulary chunks, trained head
                         d_head's rows need each token's final log-sum-exp, so a first sweep gives
                         it and a second rebuilds each logits chunk once for the gradients;
  backward               scales the kept gradients by the cotangent.

So the head's matmuls are the unchunked step's (forward, d_hidden, d_head) with a sequence chunk
and with vocabulary chunks of a frozen head, plus one head forward with vocabulary chunks of a
trained head -- not a rematerialized scan nested in another, which re-ran the head's forward twice
more (tests/step/test_loss_flops.py counts them in the compiled HLO). Whether the head is trained
is read from the differentiation itself (`symbolic_zeros`: the head is "perturbed" or not). A trained head's gradient is accumulated transposed, [D, V], when the vocabulary is whole
(`_add_head_grad`). Without any chunk the plain computation runs under autodiff.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch
from featherweight.models.config import ModelConfig
from featherweight.models.llama import Params, rms_norm, softcap
from featherweight.parallel.memory_kinds import host_row_slice, on_host, to_device, to_host
from featherweight.quant.nf4 import NF4Tensor, dequantize_nf4, take_rows_nf4


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


class HeadForm(NamedTuple):
    """How the family's head turns the last hidden state into logits: the final RMSNorm's
    epsilon and weight offset (Gemma: 1 + w), the logits' tanh softcap (Gemma 2), and a
    sampling temperature the logits are divided by (GRPO's log-probs are those of the
    distribution it samples from, as TRL's are)."""

    eps: float
    offset: float = 0.0
    softcap: float | None = None
    temperature: float = 1.0

    def norm(self, hidden: jax.Array, weight: jax.Array) -> jax.Array:
        """The normed hidden state, divided by the temperature: the logits are linear in it."""
        normed = rms_norm(hidden, weight, self.eps, self.offset)
        return normed if self.temperature == 1.0 else normed / self.temperature


def head_form(config: ModelConfig, temperature: float = 1.0) -> HeadForm:
    """The `HeadForm` of a model, its logits at `temperature`: softcap(l) / T is
    (cap / T) tanh((l / T) / (cap / T)), so the cap is divided too and nothing else changes."""
    cap = config.final_softcap
    return HeadForm(
        config.rms_norm_eps, config.norm_offset, None if cap is None else cap / temperature,
        temperature,
    )  # fmt: skip


class _Chunks(NamedTuple):
    """The static layout of a chunked loss: the head's form, sequence chunk, vocabulary chunk."""

    form: HeadForm
    seq: int
    vocab: int


def _head_rows(head: jax.Array | NF4Tensor, start, size: int, dtype) -> jax.Array:
    """Rows [start, start + size) of the [V, D] head in `dtype` (dequantized when NF4, fetched
    when in host memory): only a vocabulary chunk is ever dense on the device."""
    if size == head.shape[0]:
        if isinstance(head, NF4Tensor):
            return dequantize_nf4(head, dtype)
        return (to_device(head) if on_host(head) else head).astype(dtype)
    if isinstance(head, NF4Tensor):
        return take_rows_nf4(head, start + jnp.arange(size), dtype)
    if on_host(head):  # a tied, frozen table in host memory: the chunk's rows come over
        return host_row_slice(head, start, size).astype(dtype)
    return jax.lax.dynamic_slice_in_dim(head, start, size).astype(dtype)


def _logits(normed: jax.Array, rows: jax.Array, cap: float | None) -> jax.Array:
    """[B, c, D] x [Vc, D] -> float32 logits [B, c, Vc] (accumulated in float32), softcapped
    (cap x tanh(logits / cap)) when the family caps them."""
    logits = jnp.einsum("bcd,vd->bcv", normed, rows, preferred_element_type=jnp.float32)
    return softcap(logits, cap)


def _slope(capped: jax.Array, cap: float | None) -> jax.Array | float:
    """d capped / d logits of softcapped logits: 1 - tanh^2 = 1 - (capped / cap)^2 (1 uncapped)."""
    return 1.0 if cap is None else 1.0 - jnp.square(capped / cap)


def _vocab_sweep(head, chunk: int, normed, body, carry):
    """Run `body(carry, rows, row_ids, fresh) -> carry` over the head `chunk` rows at a time.

    A dense device head whose rows divide into chunks is scanned as [V / chunk, chunk, D] blocks
    (a free reshape; XLA:CPU then holds one block's copy, where a clamped slice held two). Else
    the last chunk starts at V - chunk so every slice is in range; `fresh` [Vc] marks the rows a
    chunk sees first (the overlap with the previous chunk is masked out by the body).
    """
    vocab = head.shape[0]
    count = -(-vocab // chunk)
    if count > 1 and not vocab % chunk and not isinstance(head, NF4Tensor) and not on_host(head):

        def block_step(carry, xs):
            index, rows = xs
            row_ids = index * chunk + jnp.arange(chunk)
            return body(carry, rows.astype(normed.dtype), row_ids, jnp.ones((chunk,), bool)), None

        blocks = head.reshape(count, chunk, head.shape[1])
        return jax.lax.scan(block_step, carry, (jnp.arange(count), blocks))[0]

    def step(carry, index):
        first = index * chunk
        start = jnp.minimum(first, vocab - chunk)
        row_ids = start + jnp.arange(chunk)
        rows = _head_rows(head, start, chunk, normed.dtype)
        return body(carry, rows, row_ids, row_ids >= first), None

    if count == 1:
        return step(carry, 0)[0]
    return jax.lax.scan(step, carry, jnp.arange(count))[0]


def _chunk_logsumexp(normed, head, targets, vocab_chunk: int, cap: float | None):
    """(log-sum-exp over the vocabulary, target logit), both [B, c] float32, one sweep."""

    def body(carry, rows, row_ids, fresh):
        running_max, running_sum, target_logit = carry
        logits = jnp.where(fresh, _logits(normed, rows, cap), -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.sum(
            jnp.exp(logits - new_max[..., None]), axis=-1
        )
        hit = (row_ids == targets[..., None]) & fresh
        return new_max, running_sum, target_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)

    shape = targets.shape
    start = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )
    running_max, running_sum, target_logit = _vocab_sweep(head, vocab_chunk, normed, body, start)
    return running_max + jnp.log(running_sum), target_logit


def _softmax_grads(logits, rows, row_ids, fresh, logsumexp, targets, weight, normed, d_head, cap):
    """A logits chunk's contribution to d_normed [B, c, D] (float32) and to d_head's rows.

    d_logits = (softmax - onehot) x weight (x the softcap's slope), contracted at once with the
    head rows and `normed`.
    """
    probs = jnp.where(fresh, jnp.exp(logits - logsumexp[..., None]), 0.0)
    hit = (row_ids == targets[..., None]) & fresh
    d_logits = ((probs - hit) * weight[..., None] * _slope(logits, cap)).astype(rows.dtype)
    d_normed = jnp.einsum("bcv,vd->bcd", d_logits, rows, preferred_element_type=jnp.float32)
    if d_head is not None:
        d_head = _add_head_grad(d_head, normed, d_logits, row_ids[0])
    return d_normed, d_head


def _add_head_grad(d_head, normed, d_logits, start):
    """d_head plus the rows' gradient normed^T x d_logits.

    A whole-vocabulary d_head is kept transposed, [D, V]: normed^T [D, B c] x d_logits [B c, V]
    reads the logits' gradient as it lies, where [V, D] needs a transposed copy of it -- one more
    logits-sized buffer. With vocabulary chunks d_head is [V, D] and the chunk's rows (a small
    transposed copy) are added in place.
    """
    if d_head.shape[-1] == d_logits.shape[-1] and d_head.shape[0] == normed.shape[-1]:
        d_rows = jnp.einsum("bcd,bcv->dv", normed, d_logits, preferred_element_type=jnp.float32)
        return d_head + d_rows.astype(d_head.dtype)
    d_rows = jnp.einsum("bcv,bcd->vd", d_logits, normed, preferred_element_type=jnp.float32)
    old = jax.lax.dynamic_slice_in_dim(d_head, start, d_rows.shape[0])
    return jax.lax.dynamic_update_slice_in_dim(d_head, old + d_rows.astype(d_head.dtype), start, 0)


def _chunk_value_and_grads(normed, head, targets, weight, vocab_chunk: int, d_head, cap):
    """One sequence chunk's cross-entropy [B, c] and, for the loss sum x `weight`, d_normed
    [B, c, D] float32 and d_head (+= its rows'; None when the head is frozen).

    Without vocabulary chunks the logits are made once and serve both. With them, a first sweep
    gives the log-sum-exp, and a second rebuilds each logits chunk once for the gradients.
    """
    vocab = head.shape[0]
    if vocab_chunk == vocab:
        rows = _head_rows(head, 0, vocab, normed.dtype)
        logits = _logits(normed, rows, cap)
        logsumexp = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        row_ids, fresh = jnp.arange(vocab), jnp.ones((vocab,), bool)
        d_normed, d_head = _softmax_grads(
            logits, rows, row_ids, fresh, logsumexp, targets, weight, normed, d_head, cap
        )
        return logsumexp - target_logit, d_normed, d_head

    logsumexp, target_logit = _chunk_logsumexp(normed, head, targets, vocab_chunk, cap)

    def body(carry, rows, row_ids, fresh):
        d_normed, d_head = carry
        logits = _logits(normed, rows, cap)
        part, d_head = _softmax_grads(
            logits, rows, row_ids, fresh, logsumexp, targets, weight, normed, d_head, cap
        )
        return d_normed + part, d_head

    start = (jnp.zeros(normed.shape, jnp.float32), d_head)
    d_normed, d_head = _vocab_sweep(head, vocab_chunk, normed, body, start)
    return logsumexp - target_logit, d_normed, d_head


def _frozen_head_value_and_grads(normed, head, targets, weight, vocab_chunk: int, cap):
    """A frozen head's sequence chunk in one vocabulary sweep: cross-entropy [B, c] and, for the
    loss sum x `weight`, d_normed [B, c, D] float32.

    d_normed = sum_v softmax_v x slope_v x row_v - slope_target x row_target (slope: the
    softcap's derivative, 1 without one): the sweep keeps the running max, the running
    sum of exp(logit - max) and the rows weighted by exp(logit - max), rescaling both when the
    max moves, so no logits chunk is made twice (the trained head's d_head rows would need the
    final log-sum-exp before the sweep: `_chunk_value_and_grads`). A head in host memory cannot
    be gathered from, so the sweep also picks the target rows out of each chunk it brings over.
    """
    host_head = not isinstance(head, NF4Tensor) and on_host(head)

    def body(carry, rows, row_ids, fresh):
        running_max, running_sum, target_logit, weighted_rows, target_rows = carry
        logits = jnp.where(fresh, _logits(normed, rows, cap), -jnp.inf)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=-1))
        decay = jnp.exp(running_max - new_max)
        probs = jnp.exp(logits - new_max[..., None])  # unnormalized; 0 where not fresh
        running_sum = running_sum * decay + jnp.sum(probs, axis=-1)
        sloped = probs * _slope(jnp.where(fresh, logits, 0.0), cap)
        weighted_rows = weighted_rows * decay[..., None] + jnp.einsum(
            "bcv,vd->bcd", sloped.astype(rows.dtype), rows, preferred_element_type=jnp.float32
        )
        hit = (row_ids == targets[..., None]) & fresh
        target_logit = target_logit + jnp.sum(jnp.where(hit, logits, 0.0), axis=-1)
        if host_head:
            target_rows = target_rows + _chunk_target_rows(rows, row_ids, fresh, targets)
        return new_max, running_sum, target_logit, weighted_rows, target_rows

    shape = targets.shape
    start = (
        jnp.full(shape, -jnp.inf, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(normed.shape, jnp.float32),
        jnp.zeros(normed.shape, jnp.float32) if host_head else None,
    )
    running_max, running_sum, target_logit, weighted_rows, target_rows = _vocab_sweep(
        head, vocab_chunk, normed, body, start
    )
    expected_row = weighted_rows / running_sum[..., None]
    if not host_head:
        target_rows = _target_rows(head, targets)
    target_rows = target_rows * _slope(target_logit, cap)[..., None] if cap else target_rows
    d_normed = (expected_row - target_rows) * weight[..., None]
    return running_max + jnp.log(running_sum) - target_logit, d_normed


def _target_rows(head, targets) -> jax.Array:
    """The head rows of the target tokens, [B, c, D] float32 (gathered: only these are dense)."""
    if isinstance(head, NF4Tensor):
        return take_rows_nf4(head, targets, jnp.float32)
    return jnp.take(head, targets, axis=0, mode="clip").astype(jnp.float32)


def _chunk_target_rows(rows, row_ids, fresh, targets) -> jax.Array:
    """The rows of one vocabulary chunk [Vc, D] that are targets, [B, c, D] float32 (zero for
    targets outside the chunk or in its overlap with the previous one)."""
    local = targets - row_ids[0]
    clipped = jnp.clip(local, 0, rows.shape[0] - 1)
    inside = (local >= 0) & (local < rows.shape[0]) & fresh[clipped]
    picked = jnp.take(rows, clipped, axis=0).astype(jnp.float32)
    return jnp.where(inside[..., None], picked, 0.0)


def _perturbed(tree) -> bool:
    """Whether any leaf of a `symbolic_zeros` custom-VJP argument is being differentiated."""
    return any(leaf.perturbed for leaf in jax.tree.leaves(tree))


def _values(tree):
    """The primal values of a `symbolic_zeros` custom-VJP argument."""
    return jax.tree.map(lambda leaf: leaf.value, tree)


def _to_chunks(x: jax.Array, chunk: int) -> jax.Array:
    """[B, S, ...] -> [S / chunk, B, chunk, ...]."""
    batch, seq = x.shape[:2]
    return jnp.moveaxis(x.reshape(batch, seq // chunk, chunk, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array) -> jax.Array:
    """[S / chunk, B, chunk, ...] -> [B, S, ...]."""
    count, batch, chunk = x.shape[:3]
    return jnp.moveaxis(x, 0, 1).reshape(batch, count * chunk, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked_loss_sum(layout: _Chunks, hidden, final_norm, head, targets, mask):
    @jax.named_scope("loss_chunk")
    def body(total, chunk_inputs):
        h, chunk_targets, chunk_mask = chunk_inputs
        normed = layout.form.norm(h, final_norm)
        logsumexp, target_logit = _chunk_logsumexp(
            normed, head, chunk_targets, layout.vocab, layout.form.softcap
        )
        return total + jnp.sum((logsumexp - target_logit) * chunk_mask), None

    xs = (_to_chunks(hidden, layout.seq), _to_chunks(targets, layout.seq))
    xs += (_to_chunks(mask.astype(jnp.float32), layout.seq),)
    return jax.lax.scan(body, jnp.zeros((), jnp.float32), xs)[0]


def _chunked_loss_fwd(layout: _Chunks, hidden, final_norm, head, targets, mask):
    """The loss and, in the same sweeps, its gradients for a cotangent of 1 (the loss is a sum,
    so the backward pass only scales them): no logits chunk is ever made again. The arguments
    come as `symbolic_zeros` primals: a head nobody differentiates gets no gradient (and, with
    vocabulary chunks, the one-sweep path)."""
    train_head = _perturbed(head)
    hidden, final_norm, head, targets, mask = _values((hidden, final_norm, head, targets, mask))
    weight = mask.astype(jnp.float32)
    one_sweep = not train_head and layout.vocab < head.shape[0]

    @jax.named_scope("loss_chunk")
    def body(carry, chunk_inputs):
        d_head, d_norm = carry
        h, chunk_targets, chunk_weight = chunk_inputs
        normed, norm_vjp = jax.vjp(layout.form.norm, h, final_norm)
        cap = layout.form.softcap
        if one_sweep:
            nll, d_normed = _frozen_head_value_and_grads(
                normed, head, chunk_targets, chunk_weight, layout.vocab, cap
            )
        else:
            nll, d_normed, d_head = _chunk_value_and_grads(
                normed, head, chunk_targets, chunk_weight, layout.vocab, d_head, cap
            )
        d_h, d_w = norm_vjp(d_normed.astype(normed.dtype))
        return (d_head, d_norm + d_w.astype(jnp.float32)), (nll, d_h)

    start = (
        jnp.zeros(_head_grad_shape(layout, head), head.dtype) if train_head else None,
        jnp.zeros(final_norm.shape, jnp.float32),
    )
    xs = tuple(_to_chunks(x, layout.seq) for x in (hidden, targets, weight))
    (d_head, d_norm), (nll, d_hidden) = jax.lax.scan(body, start, xs)
    nll = _from_chunks(nll)
    total = jnp.sum(nll * weight)
    return total, (_from_chunks(d_hidden), d_norm, d_head, nll, final_norm, head, targets, mask)


def _head_grad_shape(layout: _Chunks, head) -> tuple[int, int]:
    """[D, V] for a whole-vocabulary head gradient, [V, D] with vocabulary chunks
    (`_add_head_grad`)."""
    vocab, width = head.shape
    return (width, vocab) if layout.vocab == vocab else (vocab, width)


def _zero_cotangent(leaf):
    """The cotangent of an input that gets no gradient (a frozen head, the targets); the step
    never reads it, so XLA drops it."""
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        return np.zeros(leaf.shape, jax.dtypes.float0)
    zeros = jnp.zeros(leaf.shape, leaf.dtype)
    return to_host(zeros) if on_host(leaf) else zeros


def _chunked_loss_bwd(layout: _Chunks, residuals, g):
    d_hidden, d_norm, d_head, nll, final_norm, head, targets, mask = residuals
    scale = g.astype(jnp.float32)
    if d_head is None:
        d_head = jax.tree.map(_zero_cotangent, head)
    else:
        d_head = d_head.T if layout.vocab == head.shape[0] else d_head  # `_head_grad_shape`
        d_head = (d_head * scale).astype(head.dtype)
    return (
        (d_hidden * scale).astype(d_hidden.dtype),
        (d_norm * scale).astype(final_norm.dtype),
        d_head,
        _zero_cotangent(targets),
        (scale * nll).astype(mask.dtype)
        if jnp.issubdtype(mask.dtype, jnp.inexact)
        else _zero_cotangent(mask),
    )


_chunked_loss_sum.defvjp(_chunked_loss_fwd, _chunked_loss_bwd, symbolic_zeros=True)


def token_losses_sum(
    hidden: jax.Array,
    final_norm: jax.Array,
    head: jax.Array | NF4Tensor,
    target_ids: jax.Array,
    loss_mask: jax.Array,
    form: HeadForm,
    chunk_size: int | None = None,
    vocab_chunk: int | None = None,
) -> jax.Array:
    """Sum over tokens of mask x cross-entropy, the logits made as `form` says.

    hidden [B, S, D]; head [V, D] (array, or NF4; a host-resident table only with `vocab_chunk`);
    targets and mask [B, S]. With a sequence chunk shorter than S or a vocabulary chunk smaller
    than V, at most B x chunk x vocab_chunk float32 logits and `vocab_chunk` dense head rows exist
    at a time, and the backward pass rebuilds each logits chunk once (module docstring).
    """
    seq, vocab = hidden.shape[1], head.shape[0]
    chunk = resolve_chunk_size(seq, chunk_size)
    rows = vocab if vocab_chunk is None else min(vocab_chunk, vocab)
    if chunk < seq or rows < vocab:
        layout = _Chunks(form, chunk, rows)
        return _chunked_loss_sum(layout, hidden, final_norm, head, target_ids, loss_mask)
    with jax.named_scope("loss_chunk"):  # the whole sequence as one chunk
        normed = form.norm(hidden, final_norm)
        logits = _logits(normed, _head_rows(head, 0, vocab, normed.dtype), form.softcap)
        target_logit = jnp.take_along_axis(logits, target_ids[..., None], axis=-1)[..., 0]
        nll = jax.nn.logsumexp(logits, axis=-1) - target_logit
        return jnp.sum(nll * loss_mask.astype(jnp.float32))


def token_nll(
    head_params: Params,
    hidden: jax.Array,
    target_ids: jax.Array,
    config: ModelConfig,
    chunk_size: int | None = None,
    vocab_chunk: int | None = None,
    temperature: float = 1.0,
) -> jax.Array:
    """Each token's cross-entropy [B, S] float32 (of the logits at `temperature`), forward only,
    over the same sequence and vocabulary chunks as the loss (at most B x chunk x vocab_chunk
    logits at a time): what the objectives read before the weighted loss is differentiated."""
    head = head_params.get("lm_head")
    head = head_params["embed"] if head is None else head
    seq, vocab = hidden.shape[1], head.shape[0]
    layout = _Chunks(
        head_form(config, temperature),
        resolve_chunk_size(seq, chunk_size),
        vocab if vocab_chunk is None else min(vocab_chunk, vocab),
    )

    @jax.named_scope("loss_chunk")
    def body(_, chunk_inputs):
        h, chunk_targets = chunk_inputs
        normed = layout.form.norm(h, head_params["final_norm"])
        logsumexp, target_logit = _chunk_logsumexp(
            normed, head, chunk_targets, layout.vocab, layout.form.softcap
        )
        return None, logsumexp - target_logit

    xs = (_to_chunks(hidden, layout.seq), _to_chunks(target_ids, layout.seq))
    return _from_chunks(jax.lax.scan(body, None, xs)[1])


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
        head_form(config),
        chunk_size,
        vocab_chunk,
    )
    return total / jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
