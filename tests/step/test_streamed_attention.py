"""The streamed step calls the attention its policy names: with the Pallas kernel (interpret mode
on CPU) it trains packed rows exactly as with blockwise attention."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from featherweight.models import attention
from featherweight.models.batch import Batch
from featherweight.models.fused_attention import pallas_attention
from featherweight.models.init import init_params
from featherweight.models.llama import LoraSpec
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.streamed import build_streamed_step
from tests.conftest import relative_difference, tiny_config
from tests.step.test_streamed import _adapters


def _packed_batch(config) -> Batch:
    """Two rows of 32: three documents (7, 13, 9 tokens) then padding; one document of 20 then
    padding. Positions restart per document; padding has no loss."""
    segments = np.zeros((2, 32), np.int32)
    segments[0, :29] = np.repeat([1, 2, 3], [7, 13, 9])
    segments[1, :20] = 1
    positions = np.zeros((2, 32), np.int32)
    for row in range(2):
        for document in range(1, 4):
            where = np.flatnonzero(segments[row] == document)
            positions[row, where] = np.arange(where.size)
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, config.vocab_size, (2, 32))
    targets = rng.integers(0, config.vocab_size, (2, 32))
    loss_mask = (segments > 0).astype(np.float32)
    return Batch(*(jnp.asarray(x) for x in (tokens, targets, loss_mask, positions, segments)))


def _train(config, policy, steps=3):
    params = init_params(jax.random.PRNGKey(0), config)
    trainable, lora, optimizer = _adapters(config), LoraSpec(scale=2.0), optax.adamw(1e-2)
    step = build_streamed_step(
        config, optimizer, trainable, params, lora=lora, policy=policy, donate=False
    )
    state, batch, losses = init_streamed_opt_state(optimizer, trainable), _packed_batch(config), []
    for index in range(steps):
        trainable, state, metrics = step(trainable, state, params, batch, jax.random.PRNGKey(index))
        losses.append(float(metrics["loss"]))
    return trainable, losses


def test_the_pallas_kernel_trains_packed_rows_as_blockwise_does(monkeypatch):
    config = tiny_config()
    expected, expected_losses = _train(config, MemoryPolicy(attention="blockwise"))
    # on CPU the kernel runs only in interpret mode
    monkeypatch.setattr(
        attention, "pallas_attention", functools.partial(pallas_attention, interpret=True)
    )
    actual, losses = _train(config, MemoryPolicy(attention="pallas"))
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)
    assert relative_difference(expected, actual) <= 2e-5
