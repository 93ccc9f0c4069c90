"""The layer's forward and VJP with the NF4 weights kept dense (`save: dequantized`): the same
losses and gradients as the step that dequantizes again in its backward pass, alone and beside
the activation classes, with and without the MLP's sequence chunks, and kept in host memory with
the residuals (`residuals: host`)."""

import jax
import numpy as np
import optax
import pytest

from featherweight.models.batch import batch_from_tokens
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import DEQUANTIZED, MemoryPolicy
from featherweight.step.streamed import build_streamed_step
from tests.conftest import tiny_config, training_case

CONFIG = tiny_config()
BATCH = batch_from_tokens(jax.random.randint(jax.random.PRNGKey(3), (2, 17), 0, 256))
SGD = optax.sgd(0.1)


def _train(save: tuple[str, ...], mlp_chunk: int | None, residuals: str, steps: int = 2):
    """Losses, gradient norms and the trained adapters of `steps` QLoRA steps (float32, CPU)."""
    trainable, frozen, lora = training_case(CONFIG, "qlora", rank=4)
    policy = MemoryPolicy(save=save, mlp_chunk=mlp_chunk, residuals=residuals)
    step = build_streamed_step(CONFIG, SGD, trainable, frozen, lora, policy=policy, donate=False)
    state = init_streamed_opt_state(SGD, trainable)
    metrics = []
    for index in range(steps):
        trainable, state, out = step(trainable, state, frozen, BATCH, jax.random.PRNGKey(index))
        metrics.append((np.asarray(out["loss"]), np.asarray(out["grad_norm"])))
    return metrics, jax.tree.leaves(jax.tree.map(np.asarray, trainable))


@pytest.mark.default_emitters  # two programs compared bit for bit (tests/emitters.py)
@pytest.mark.parametrize(
    ("activations", "mlp_chunk", "residuals"),
    [
        ((), None, "device"),
        ((), 8, "device"),
        (("qkv", "attention", "mlp_hidden"), None, "device"),
        (("mlp_hidden",), 8, "device"),
        ((), None, "host"),
    ],
    ids=[
        "alone",
        "alone-mlp-chunk",
        "with-every-activation",
        "with-mlp-hidden-mlp-chunk",
        "kept-in-host-memory",
    ],
)
def test_kept_dequantized_weights_train_as_dequantizing_twice(activations, mlp_chunk, residuals):
    # sgd: the trained adapters differ from the start by the gradients, so equal adapters after
    # two steps are equal gradients. Bit for bit: the kept weights are the values `linear`
    # dequantizes (kept in bfloat16 instead, the losses move by ~1e-6 relative on this model)
    metrics, adapters = _train(activations, mlp_chunk, residuals)
    kept_metrics, kept_adapters = _train((*activations, DEQUANTIZED), mlp_chunk, residuals)
    np.testing.assert_array_equal(np.array(kept_metrics), np.array(metrics))
    for expected, actual in zip(adapters, kept_adapters, strict=True):
        np.testing.assert_array_equal(actual, expected)
