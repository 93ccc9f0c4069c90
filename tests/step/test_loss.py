"""Chunked cross-entropy: sequence and vocabulary chunks give the loss and gradients of the plain
computation (against float64 numpy), and a quantized head is dequantized only chunk by chunk."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from featherweight.errors import StepConfigError
from featherweight.quant.nf4 import dequantize_nf4, quantize_nf4
from featherweight.step.loss import HeadForm, resolve_chunk_size, token_losses_sum

BATCH, SEQ, WIDTH, VOCAB = 2, 16, 32, 200


def _inputs(seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(keys[0], (BATCH, SEQ, WIDTH))
    head = 0.3 * jax.random.normal(keys[1], (VOCAB, WIDTH))
    norm = 1.0 + 0.1 * jax.random.normal(keys[2], (WIDTH,))
    targets = jax.random.randint(keys[3], (BATCH, SEQ), 0, VOCAB)
    mask = (jnp.arange(SEQ) % 3 != 0).astype(jnp.float32)[None].repeat(BATCH, 0)
    return hidden, norm, head, targets, mask


def _float64_reference(hidden, norm, head, targets, mask):
    h = np.asarray(hidden, np.float64)
    normed = h / np.sqrt(np.mean(h * h, -1, keepdims=True) + 1e-5) * np.asarray(norm, np.float64)
    logits = normed @ np.asarray(head, np.float64).T
    top = logits.max(-1, keepdims=True)
    lse = top[..., 0] + np.log(np.exp(logits - top).sum(-1))
    target = np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]
    return float(((lse - target) * np.asarray(mask)).sum())


@pytest.mark.parametrize("train_head", [True, False], ids=["trained-head", "frozen-head"])
@pytest.mark.parametrize(
    ("chunk", "vocab_chunk"), [(None, None), (4, None), (None, 64), (8, 48), (16, 200), (8, 50)]
)
def test_chunked_loss_and_gradients_equal_the_plain_ones(chunk, vocab_chunk, train_head):
    """A trained head takes the two-sweep path, a frozen one the one-sweep path (loss.py)."""
    hidden, norm, head, targets, mask = _inputs()
    expected = _float64_reference(hidden, norm, head, targets, mask)

    def loss(hidden, norm, head, chunk, vocab_chunk):
        return token_losses_sum(
            hidden, norm, head, targets, mask, HeadForm(1e-5), chunk, vocab_chunk
        )

    value = loss(hidden, norm, head, chunk, vocab_chunk)
    assert float(value) == pytest.approx(expected, rel=1e-5)
    argnums = (0, 1, 2) if train_head else (0, 1)
    grads = jax.grad(loss, argnums=argnums)(hidden, norm, head, chunk, vocab_chunk)
    plain = jax.grad(loss, argnums=argnums)(hidden, norm, head, None, None)
    for got, want in zip(grads, plain, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_nf4_head_is_dequantized_chunk_by_chunk():
    hidden, norm, head, targets, mask = _inputs()
    hidden, norm = jnp.concatenate([hidden, hidden], -1), jnp.concatenate([norm, norm])
    head = jnp.concatenate([head, head[::-1]], -1)  # rows of 64 values: whole NF4 blocks
    quantized = quantize_nf4(head)
    expected = token_losses_sum(
        hidden, norm, dequantize_nf4(quantized), targets, mask, HeadForm(1e-5)
    )
    chunked = token_losses_sum(hidden, norm, quantized, targets, mask, HeadForm(1e-5), 8, 64)
    assert float(chunked) == pytest.approx(float(expected), rel=1e-5)
    grad = jax.grad(
        lambda h: token_losses_sum(h, norm, quantized, targets, mask, HeadForm(1e-5), 8, 64)
    )(hidden)
    assert np.all(np.isfinite(grad)) and float(jnp.abs(grad).sum()) > 0


def test_vocab_chunks_bound_the_logits_in_memory():
    batch, seq, width, vocab = 2, 64, 32, 8192
    args = (
        jax.ShapeDtypeStruct((batch, seq, width), jnp.float32),
        jax.ShapeDtypeStruct((width,), jnp.float32),
        jax.ShapeDtypeStruct((vocab, width), jnp.float32),
        jax.ShapeDtypeStruct((batch, seq), jnp.int32),
        jax.ShapeDtypeStruct((batch, seq), jnp.float32),
    )

    def temp(vocab_chunk):
        def value_and_grad(h, n, w, t, m):
            return jax.value_and_grad(token_losses_sum)(
                h, n, w, t, m, HeadForm(1e-5), 16, vocab_chunk
            )

        return jax.jit(value_and_grad).lower(*args).compile().memory_analysis().temp_size_in_bytes

    chunk_logits = batch * 16 * vocab * 4
    assert temp(None) >= chunk_logits  # the [B, chunk, V] logits of one sequence chunk
    assert temp(512) < chunk_logits / 2  # with 512-row vocab chunks they never exist


def test_chunk_size_must_divide_the_sequence():
    assert resolve_chunk_size(64, None) == 64
    assert resolve_chunk_size(64, 128) == 64
    with pytest.raises(StepConfigError, match="does not divide"):
        resolve_chunk_size(64, 48)
