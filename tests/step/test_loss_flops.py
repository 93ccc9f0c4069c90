"""The chunked loss recomputes each logits chunk at most once: the compiled step's matmul FLOPs
(counted from the optimized HLO, loops by their trip counts) are the unchunked step's -- plus one
LM-head forward where vocabulary chunks meet a trained head -- and a nested-remat loss (a
checkpointed vocabulary scan inside a checkpointed sequence scan, which runs the head's forward
twice more) fails the same bound."""

import jax
import jax.numpy as jnp
import pytest

from featherweight.dev.hlo_cost import hlo_dot_flops
from featherweight.memory.measure import abstract_step_arguments
from featherweight.models.llama import rms_norm
from featherweight.recipe.schema import parse_config
from featherweight.step import loss as loss_module
from tests.conftest import tiny_config

BATCH, SEQ, VOCAB = 2, 32, 512


def _step_flops(model_config, method: str, **memory) -> int:
    config = parse_config(
        {"method": method, "batch_size": BATCH, "data": {"seq_len": SEQ}, "memory": memory}
    )
    step, arguments = abstract_step_arguments(config, model_config)
    return hlo_dot_flops(step.lower(*arguments).compile())


def _nested_remat_losses_sum(hidden, final_norm, head, targets, mask, eps, chunk, vocab_chunk):
    """The deliberately wrong build: autodiff through a checkpointed vocabulary scan nested in a
    checkpointed sequence scan (the head's forward runs once, then twice more in the backward)."""
    batch, seq, _ = hidden.shape
    chunk = loss_module.resolve_chunk_size(seq, chunk)
    count = -(-head.shape[0] // vocab_chunk)

    def chunk_loss(h, chunk_targets, chunk_mask):
        normed = rms_norm(h, final_norm, eps.eps)

        def body(carry, start):
            running_max, running_sum, target_logit = carry
            rows = jax.lax.dynamic_slice_in_dim(head, start, vocab_chunk)
            logits = jnp.einsum("bcd,vd->bcv", normed, rows)
            new_max = jnp.maximum(running_max, logits.max(-1))
            running_sum = running_sum * jnp.exp(running_max - new_max) + jnp.exp(
                logits - new_max[..., None]
            ).sum(-1)
            hit = start + jnp.arange(vocab_chunk) == chunk_targets[..., None]
            return (new_max, running_sum, target_logit + jnp.where(hit, logits, 0).sum(-1)), None

        zeros = jnp.zeros(chunk_targets.shape)
        carry = (zeros - jnp.inf, zeros, zeros)
        (top, total, target), _ = jax.lax.scan(
            jax.checkpoint(body), carry, jnp.arange(count) * vocab_chunk
        )
        return jnp.sum((top + jnp.log(total) - target) * chunk_mask)

    def to_chunks(x):
        return jnp.moveaxis(x.reshape(batch, seq // chunk, chunk, *x.shape[2:]), 1, 0)

    def body(total, xs):
        return total + jax.checkpoint(chunk_loss)(*xs), None

    xs = (to_chunks(hidden), to_chunks(targets), to_chunks(mask))
    return jax.lax.scan(body, jnp.zeros(()), xs)[0]


@pytest.mark.parametrize(
    ("method", "tied"), [("lora", False), ("full", True)], ids=["lora-untied", "full-tied"]
)
def test_chunked_step_flops_are_unchunked_plus_at_most_one_head_forward(method, tied):
    model_config = tiny_config(vocab_size=VOCAB, tie_word_embeddings=tied)
    head_forward = 2 * BATCH * SEQ * VOCAB * model_config.hidden_size
    unchunked = _step_flops(model_config, method, loss_chunk=None)
    sequence_chunked = _step_flops(model_config, method, loss_chunk=8)
    both_chunked = _step_flops(model_config, method, loss_chunk=8, vocab_chunk=128)
    assert sequence_chunked == unchunked  # loss and gradients in one sweep: nothing recomputed
    if method == "full":  # d_head's rows need the final log-sum-exp: a second sweep
        assert both_chunked == unchunked + head_forward
    else:  # a frozen head: one sweep over the vocabulary, nothing recomputed
        assert both_chunked == unchunked


def test_a_nested_remat_loss_fails_the_flop_bound(monkeypatch):
    model_config = tiny_config(vocab_size=VOCAB)
    head_forward = 2 * BATCH * SEQ * VOCAB * model_config.hidden_size
    unchunked = _step_flops(model_config, "lora", loss_chunk=None)
    monkeypatch.setattr(loss_module, "token_losses_sum", _nested_remat_losses_sum)
    nested = _step_flops(model_config, "lora", loss_chunk=8, vocab_chunk=128)
    assert nested >= unchunked + 2 * head_forward  # the bound above fails
