"""The step users run (built from a config by `recipe.build.build_train_step`) trains as the
reference step does, over 20 steps: global-norm clipping (adapters' gradient kept; two passes for
full fine-tuning), accumulation over micro-batches, tied and untied, AdamW. Per-tensor clipping is
what its name says."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from featherweight.memory.defaults import resolve
from featherweight.models.batch import batch_from_tokens
from featherweight.models.init import init_params
from featherweight.recipe.build import build_train_step, split_params
from featherweight.recipe.optimizer import make_optimizer
from featherweight.recipe.schema import parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.streamed import build_streamed_step
from featherweight.step.top_update import embedding_gradient, embedding_squared_norm
from tests.conftest import relative_difference, tiny_config

STEPS = 20
CLIP = 0.05  # below every step's gradient norm here: clipping acts on every step
TOLERANCE = 5e-5  # float32, 20 AdamW steps
LR, EPS = 1e-3, 1e-6


def _config(method, clipping=None, accumulation=1, step="streamed"):
    optimizer = {"name": "adamw", "learning_rate": LR, "weight_decay": 0.1, "eps": EPS}
    optimizer["schedule"] = "constant"
    if clipping is not None:
        optimizer.update(clip_norm=CLIP, clipping=clipping)
    return parse_config(
        {
            "method": method,
            "model": {"dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "optimizer": optimizer,
            "memory": {"step": step, "accumulation_steps": accumulation},
            "batch_size": 4,
            "steps": STEPS,
        }
    )


def _train(config, model_config, trainable, frozen, batches):
    config = resolve(config, model_config)  # the chunks the trainer would choose
    optimizer = make_optimizer(config.optimizer, config.steps)
    step, init_opt_state = build_train_step(config, model_config, trainable, frozen, optimizer)
    params, state = jax.tree.map(jnp.copy, trainable), init_opt_state(trainable)
    norms, losses = [], []
    for index, batch in enumerate(batches):
        params, state, metrics = step(params, state, frozen, batch, jax.random.PRNGKey(index))
        norms.append(float(metrics["grad_norm"]))
        losses.append(float(metrics["loss"]))
    return params, np.array(norms), np.array(losses)


CASES = [
    ("full", False, "two_pass", 1),
    ("full", True, "two_pass", 1),
    ("full", False, "global", 2),
    ("full", True, None, 2),
    ("lora", False, "global", 1),
    ("lora", True, "global", 2),
    ("qlora", False, None, 2),
    ("qlora", True, "global", 1),
]


@pytest.mark.parametrize(("method", "tied", "clipping", "accumulation"), CASES)
def test_twenty_steps_equal_the_reference_step(method, tied, clipping, accumulation):
    model_config = tiny_config(tie_word_embeddings=tied)
    params = init_params(jax.random.PRNGKey(0), model_config)
    streamed = _config(method, clipping, accumulation)
    # the reference: whole-batch jax.grad, optax's clip_by_global_norm, no accumulation
    reference = _config(method, None if clipping is None else "global", step="reference")
    trainable, frozen = split_params(params, streamed, model_config, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (STEPS, 4, 17), 0, model_config.vocab_size)
    batches = [batch_from_tokens(rows) for rows in tokens]
    expected, ref_norms, ref_losses = _train(reference, model_config, trainable, frozen, batches)
    actual, norms, losses = _train(streamed, model_config, trainable, frozen, batches)
    assert relative_difference(expected, actual) <= TOLERANCE
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms, ref_norms, rtol=1e-4)
    assert np.all(np.isfinite(norms))
    if clipping is not None:
        assert np.all(norms > CLIP)  # the clip acted on every step
    assert relative_difference(trainable, actual) > 100 * TOLERANCE  # the weights did move


def test_reference_step_accumulation_equals_the_whole_batch():
    model_config = tiny_config()
    params = init_params(jax.random.PRNGKey(0), model_config)
    whole = _config("full", "global", step="reference")
    split = _config("full", "global", accumulation=4, step="reference")
    trainable, frozen = split_params(params, whole, model_config, jax.random.PRNGKey(1))
    tokens = jax.random.randint(jax.random.PRNGKey(2), (5, 4, 17), 0, model_config.vocab_size)
    batches = [batch_from_tokens(rows) for rows in tokens]
    expected, norms, _ = _train(whole, model_config, trainable, frozen, batches)
    actual, split_norms, _ = _train(split, model_config, trainable, frozen, batches)
    assert relative_difference(expected, actual) <= TOLERANCE
    np.testing.assert_allclose(split_norms, norms, rtol=1e-4)


def test_per_tensor_clipping_clips_each_layer_slice_not_the_whole_gradient():
    model_config = tiny_config()
    params = init_params(jax.random.PRNGKey(0), model_config)
    lr, clip = 1.0, 1e-3
    optimizer = optax.chain(optax.clip_by_global_norm(clip), optax.sgd(lr))
    step = build_streamed_step(model_config, optimizer, params, {}, donate=False)
    state = init_streamed_opt_state(optimizer, params)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 17), 0, model_config.vocab_size)
    new, _, metrics = step(params, state, {}, batch_from_tokens(tokens), jax.random.PRNGKey(0))
    delta = jax.tree.map(lambda a, b: a - b, new, params)
    slice_norms = [
        float(jnp.linalg.norm(leaf[index]))
        for leaf in jax.tree.leaves(delta["layers"])
        for index in range(model_config.num_layers)
    ]
    assert max(slice_norms) <= lr * clip * (1 + 1e-4)  # every tensor slice clipped on its own
    total = float(jnp.sqrt(sum(jnp.sum(leaf**2) for leaf in jax.tree.leaves(delta))))
    assert total > 3 * lr * clip  # so the whole update is far past the global bound
    assert float(metrics["grad_norm"]) > clip


def test_untied_embedding_norm_without_a_table_sized_buffer():
    table = jnp.zeros((50, 8))
    ids = jnp.array([[3, 7, 3, 49], [7, 7, 0, 3]])
    cotangent = jax.random.normal(jax.random.PRNGKey(0), (2, 4, 8))
    dense = jnp.sum(embedding_gradient(ids, cotangent, {}, table) ** 2)
    np.testing.assert_allclose(embedding_squared_norm(ids, cotangent, {}, table), dense, rtol=1e-6)
