"""LoRA and QLoRA training on a tiny task: the loss falls toward the task's floor, and QLoRA (the
same adapters on an NF4 copy of the base) ends within 5% of LoRA.

The task: each next token is `(5 * previous + 3 + c) mod V` with a fair coin c, so the best
possible loss is ln 2. The frozen base is random with weights of std 1/sqrt(fan in), the scale of
a trained model's: with `init_params`' std 0.02 a frozen head could not express confident logits.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from featherweight.models.batch import batch_from_tokens
from featherweight.models.init import init_params
from featherweight.peft.lora import LoraConfig, init_lora, quantize_frozen_base
from featherweight.step.reference import build_reference_step
from tests.conftest import tiny_config

CONFIG = tiny_config(vocab_size=64)
LORA = LoraConfig(rank=8, alpha=16)
STEPS, BATCH, SEQ = 300, 16, 32
FINAL = 25  # steps averaged for the final loss (each on a fresh batch)


def task_batches(seed: int = 0):
    """STEPS batches of the task, the same for every run."""
    rng = np.random.default_rng(seed)
    for _ in range(STEPS):
        tokens = np.empty((BATCH, SEQ + 1), np.int32)
        tokens[:, 0] = rng.integers(0, CONFIG.vocab_size, BATCH)
        coins = rng.integers(0, 2, (BATCH, SEQ))
        for t in range(SEQ):
            tokens[:, t + 1] = (5 * tokens[:, t] + 3 + coins[:, t]) % CONFIG.vocab_size
        yield batch_from_tokens(jnp.asarray(tokens))


def task_base():
    """Random frozen base; linear and embedding weights of std 1/sqrt(fan in), norms at one."""

    def rescale(path, leaf):
        if "norm" in jax.tree_util.keystr(path):
            return leaf
        return leaf * (1.0 / math.sqrt(leaf.shape[-1]) / 0.02)  # init_params draws std 0.02

    return jax.tree_util.tree_map_with_path(rescale, init_params(jax.random.PRNGKey(0), CONFIG))


def train(frozen) -> list[float]:
    """Losses of STEPS AdamW steps of fresh adapters on `frozen`."""
    adapters = init_lora(jax.random.PRNGKey(1), CONFIG, LORA)
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(adapters)
    step = build_reference_step(CONFIG, optimizer, lora=LORA.spec)
    losses = []
    for batch in task_batches():
        adapters, opt_state, metrics = step(adapters, opt_state, frozen, batch, None)
        losses.append(float(metrics["loss"]))
    return losses


@pytest.fixture(scope="module")
def runs():
    base = task_base()
    return {"lora": train(base), "qlora": train(quantize_frozen_base(base))}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora", "qlora"])
def test_training_reduces_the_loss_toward_the_task_floor(runs, name):
    losses = runs[name]
    final = np.mean(losses[-FINAL:])
    print(f"{name}: loss {losses[0]:.3f} -> {final:.3f} (floor ln 2 = {math.log(2):.3f})")
    assert losses[0] > math.log(CONFIG.vocab_size)  # starts knowing nothing
    assert final < 0.3 * losses[0]


@pytest.mark.slow
def test_qlora_final_loss_within_5_percent_of_lora(runs):
    lora, qlora = (np.mean(runs[name][-FINAL:]) for name in ("lora", "qlora"))
    assert abs(qlora - lora) <= 0.05 * lora, f"QLoRA {qlora:.4f} vs LoRA {lora:.4f}"
