"""The router's load-balancing loss (`step/router_loss.py`): its value against transformers'
`load_balancing_loss_func` of each MoE family, and the streamed step training it against the
`jax.grad` reference step (every way the layer's backward runs: remat, the MLP block, kept MLP
rows; the router trained in one case; packed rows with padding)."""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch
from featherweight.models.init import init_params
from featherweight.peft.lora import LoraConfig, init_lora
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step
from featherweight.step.router_loss import load_balancing_loss_of_layers
from featherweight.step.streamed import build_streamed_step
from tests.tiny_families import tiny_family

_TINY = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=8,
)  # fmt: skip


@pytest.mark.parametrize(
    ("family", "experts", "top_k", "masked"),
    [("qwen3_moe", 8, 2, True), ("mixtral", 4, 2, False), ("gpt_oss", 4, 1, True)],
)
def test_value_equals_transformers(family, experts, top_k, masked):
    """Every layer's logits, the padding masked out: transformers' value (float32, 1e-5)."""
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 2 * 12, experts)).astype(np.float32)  # [L, B*S, E]
    mask = np.ones((2, 12), np.float32)
    if masked:
        mask[1, 7:] = 0.0  # a padded row's tail
    want = modeling.load_balancing_loss_func(
        tuple(torch.from_numpy(layer) for layer in logits), experts, top_k,
        torch.from_numpy(mask) if masked else None,
    )  # fmt: skip
    got = load_balancing_loss_of_layers(jnp.asarray(logits), jnp.asarray(mask.reshape(-1)), top_k)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)


def _packed_batch(vocab: int) -> Batch:
    """Two rows of 16: the first two examples packed, the second one example and padding."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, vocab, size=(2, 16))
    segments = np.array([[1] * 9 + [2] * 7, [1] * 11 + [0] * 5])
    positions = np.array([list(range(9)) + list(range(7)), list(range(16))])
    loss_mask = (segments > 0).astype(np.float32)
    loss_mask[0, :3] = 0.0  # a prompt: not counted by the cross-entropy, but routed and real
    return Batch(
        jnp.asarray(tokens), jnp.asarray(np.roll(tokens, -1, axis=1)), jnp.asarray(loss_mask),
        jnp.asarray(positions), jnp.asarray(segments),
    )  # fmt: skip


CASES = {  # family, its config.json overrides, memory policy, accumulation, router trained
    "qwen3-moe-kept-rows-router": (
        "qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        MemoryPolicy(save=("mlp_hidden",)), 1, True,
    ),
    "mixtral-remat-chunked-accumulated": (
        "mixtral", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        MemoryPolicy(mlp_chunk=8), 2, False,
    ),
    "gpt-oss-mlp-block": (
        "gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
        MemoryPolicy(save=("qkv",)), 1, False,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_streamed_step_trains_it_as_the_reference_does(name):
    """One SGD step (learning rate 1: the update is minus the gradient) of the streamed step
    with the load-balancing loss equals the `jax.grad` reference step's: the loss, aux_loss and
    every trained tensor's gradient (LoRA on attention and the experts; the router itself in
    one case), float32."""
    family, overrides, policy, accumulation, router_trained = CASES[name]
    config = tiny_family(family, **_TINY, **overrides)
    params = init_params(jax.random.PRNGKey(0), config)
    lora = LoraConfig(rank=4, alpha=8.0, targets=("q", "v", "gate", "down"))
    adapters = init_lora(jax.random.PRNGKey(1), config, lora)
    keys = iter(jax.random.split(jax.random.PRNGKey(2), 16))
    trainable = jax.tree.map(lambda x: 0.1 * jax.random.normal(next(keys), x.shape), adapters)
    frozen = params
    if router_trained:
        layers = dict(params["layers"])
        trainable["layers"]["router"] = layers.pop("router")
        frozen = {**params, "layers": layers}
    optimizer, coef = optax.sgd(1.0), 0.5
    batch = _packed_batch(config.vocab_size)
    reference = build_reference_step(
        config, optimizer, lora=lora.spec, donate=False, accumulation_steps=accumulation,
        router_aux_loss_coef=coef,
    )  # fmt: skip
    streamed = build_streamed_step(
        config, optimizer, trainable, frozen, lora=lora.spec, policy=policy, donate=False,
        accumulation_steps=accumulation, router_aux_loss_coef=coef,
    )  # fmt: skip
    ref, _, ref_metrics = reference(trainable, optimizer.init(trainable), frozen, batch, None)
    ours, _, our_metrics = streamed(
        trainable, init_streamed_opt_state(optimizer, trainable), frozen, batch, None
    )
    for metric in ("loss", "aux_loss"):
        np.testing.assert_allclose(our_metrics[metric], ref_metrics[metric], rtol=1e-5)
    assert float(ref_metrics["aux_loss"]) > 0.5  # about 1 when balanced
    for want, got, start in zip(*map(jax.tree.leaves, (ref, ours, trainable)), strict=True):
        ref_grad, our_grad = start - want, start - got
        scale = float(jnp.abs(ref_grad).max())
        # a gradient read back as start - updated is known to one float32 spacing of the weights
        resolution = float(np.spacing(np.float32(jnp.abs(start).max())))
        np.testing.assert_allclose(our_grad, ref_grad, rtol=1e-5, atol=1e-5 * scale + resolution)
    if router_trained:  # the router's gradient is mostly the aux loss's at this coefficient
        assert float(jnp.abs(ref["layers"]["router"] - trainable["layers"]["router"]).max()) > 0


def test_the_coefficient_without_a_router_is_refused():
    config = tiny_family("qwen3", **_TINY)
    with pytest.raises(StepConfigError, match="dense model with no router"):
        build_reference_step(config, optax.sgd(1.0), router_aux_loss_coef=0.01)
