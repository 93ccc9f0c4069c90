"""The layer-streamed step against the reference `jax.grad` step: same numbers, far less memory."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from featherweight.errors import StepConfigError
from featherweight.models.batch import Batch, batch_from_tokens
from featherweight.models.init import init_params
from featherweight.models.linear import LINEAR_NAMES, LoraSpec
from featherweight.models.shapes import abstract_params
from featherweight.quant.nf4 import quantize_nf4
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.policy import MemoryPolicy
from featherweight.step.reference import build_reference_step
from featherweight.step.streamed import build_streamed_step
from tests.conftest import relative_difference, tiny_config

OPTIMIZERS = {
    "sgd": (lambda: optax.sgd(0.1), 1e-6),
    # Adam divides by sqrt(v): float32 reordering (attention tiles, layer-wise remat) moves the
    # updates of near-zero gradients by ~1e-5 relative after five steps
    "adamw": (lambda: optax.adamw(1e-2, weight_decay=0.1), 2e-5),
    "lion": (lambda: optax.lion(1e-3), 1e-5),
}


def _adapters(config, rank=4, seed=5):
    """LoRA adapters on q, v and down with non-zero B (so every path gets a gradient)."""
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    shapes = {"q": (config.q_size, config.hidden_size), "v": (config.kv_size, config.hidden_size)}
    shapes["down"] = (config.hidden_size, config.intermediate_size)
    return {
        "layers": {
            "lora": {
                name: {
                    "a": 0.1 * jax.random.normal(next(keys), (config.num_layers, rank, n_in)),
                    "b": 0.1 * jax.random.normal(next(keys), (config.num_layers, n_out, rank)),
                }
                for name, (n_out, n_in) in shapes.items()
            }
        }
    }


def _nf4_base(params):
    layers = {
        name: quantize_nf4(value, stack_axes=1) if name in LINEAR_NAMES else value
        for name, value in params["layers"].items()
    }
    return {**params, "layers": layers}


def _setup(method, tied):
    config = tiny_config(tie_word_embeddings=tied)
    params = init_params(jax.random.PRNGKey(0), config)
    if method == "full":
        return config, params, {}, None
    lora = LoraSpec(scale=2.0, dropout=0.1)
    frozen = params if method == "lora" else _nf4_base(params)
    return config, _adapters(config), frozen, lora


def _batch(config, batch=2, seq=16, seed=1):
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq + 1), 0, config.vocab_size)
    return batch_from_tokens(tokens)


def _reference_run(config, trainable, frozen, lora, optimizer, steps):
    """The reference step's parameters after `steps` steps on `_batch`, and each step's loss."""
    batch = _batch(config)
    reference = build_reference_step(config, optimizer, lora=lora, donate=False)
    params, state, losses = trainable, optimizer.init(trainable), []
    for step in range(steps):
        params, state, metrics = reference(params, state, frozen, batch, _key(step))
        losses.append(metrics["loss"])
    return params, losses


def _key(step):
    return jax.random.PRNGKey(100 + step)


def _run_both(config, trainable, frozen, lora, optimizer, policy=None, steps=5, reference=None):
    """The reference's and the streamed step's parameters after `steps` steps, each step's loss
    compared; `reference`: the reference's run (`_reference_run`), when a test already has it."""
    expected, losses = reference or _reference_run(
        config, trainable, frozen, lora, optimizer, steps
    )
    batch = _batch(config)
    streamed = build_streamed_step(
        config, optimizer, trainable, frozen, lora=lora, policy=policy, donate=False
    )
    params, state = trainable, init_streamed_opt_state(optimizer, trainable)
    for step in range(steps):
        params, state, metrics = streamed(params, state, frozen, batch, _key(step))
        np.testing.assert_allclose(metrics["loss"], losses[step], rtol=1e-5)
    return expected, params


EQUIVALENCE_CASES = [
    *[(method, tied, "adamw") for method in ("full", "lora", "qlora") for tied in (False, True)],
    ("full", True, "sgd"),
    ("qlora", False, "sgd"),
    ("full", False, "lion"),
    ("lora", True, "lion"),
]


@pytest.mark.default_emitters  # two programs compared at float32 noise (tests/emitters.py)
@pytest.mark.parametrize(("method", "tied", "optimizer_name"), EQUIVALENCE_CASES)
def test_five_streamed_steps_equal_reference(method, tied, optimizer_name):
    make_optimizer, tolerance = OPTIMIZERS[optimizer_name]
    config, trainable, frozen, lora = _setup(method, tied)
    expected, actual = _run_both(config, trainable, frozen, lora, make_optimizer())
    assert relative_difference(expected, actual) <= tolerance
    assert relative_difference(trainable, actual) > 10 * tolerance  # the steps did move the weights


POLICIES_OPTIMIZER = optax.sgd(0.1)


@functools.cache
def _policies_reference():
    """The reference run every policy is compared with: compiled and run once for all seven."""
    config, trainable, frozen, lora = _setup("full", tied=True)
    return _reference_run(config, trainable, frozen, lora, POLICIES_OPTIMIZER, steps=3)


@pytest.mark.parametrize(
    "policy",
    [
        MemoryPolicy(residuals="host"),
        MemoryPolicy(loss_chunk=4),
        MemoryPolicy(save=("qkv",)),
        MemoryPolicy(save=("mlp_hidden", "qkv"), residuals="host", loss_chunk=8),
        MemoryPolicy(save=("mlp_hidden",)),
        MemoryPolicy(save=("attention",)),
        MemoryPolicy(save=("qkv", "attention", "mlp_hidden")),
    ],
    ids=[
        "host",
        "chunked-loss",
        "save-qkv",
        "qkv-mlp-hidden",
        "save-mlp-hidden",
        "save-attention",
        "keep-every-activation",
    ],
)
def test_policies_give_the_reference_result(policy):
    config, trainable, frozen, lora = _setup("full", tied=True)
    reference = _policies_reference()
    expected, actual = _run_both(
        config, trainable, frozen, lora, POLICIES_OPTIMIZER, policy, steps=3, reference=reference
    )
    assert relative_difference(expected, actual) <= 1e-6


def test_host_residuals_are_in_host_memory_and_change_nothing():
    config, params, frozen, _ = _setup("full", tied=False)
    batch, key, optimizer = _batch(config), jax.random.PRNGKey(0), optax.sgd(0.1)
    state = init_streamed_opt_state(optimizer, params)
    host = build_streamed_step(
        config, optimizer, params, frozen, policy=MemoryPolicy(residuals="host"), donate=False
    )
    device = build_streamed_step(config, optimizer, params, frozen, donate=False)
    jaxpr = str(jax.make_jaxpr(host)(params, state, frozen, batch, key))
    stacked_residual = f"f32<host>[{config.num_layers},2,16,{config.hidden_size}]"
    assert stacked_residual in jaxpr, "the scan must emit the residual stream into host memory"
    assert f"f32<host>[{config.num_layers}" not in str(
        jax.make_jaxpr(device)(params, state, frozen, batch, key)
    )
    host_params, _, _ = host(params, state, frozen, batch, key)
    device_params, _, _ = device(params, state, frozen, batch, key)
    for a, b in zip(jax.tree.leaves(host_params), jax.tree.leaves(device_params), strict=True):
        np.testing.assert_array_equal(a, b)


# --- memory ------------------------------------------------------------------------------------


def _abstract_batch(batch, seq):
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return Batch(ids, ids, jax.ShapeDtypeStruct((batch, seq), jnp.float32), ids, None)


def _compiled_memory(
    config, policy=None, reference=False, batch=1, seq=32, chunk=None, **gradient_mode
):
    params = abstract_params(config, jnp.float32)
    optimizer = optax.adamw(1e-3)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    if reference:
        step = build_reference_step(config, optimizer, chunk_size=chunk)
        state = jax.eval_shape(optimizer.init, params)
    else:
        step = build_streamed_step(config, optimizer, params, {}, policy=policy, **gradient_mode)
        state = jax.eval_shape(lambda p: init_streamed_opt_state(optimizer, p), params)
    return (
        step.lower(params, state, {}, _abstract_batch(batch, seq), key).compile().memory_analysis()
    )


def _wide(num_layers, vocab=256):
    return tiny_config(
        num_layers=num_layers, hidden_size=256, intermediate_size=1024, num_heads=8,
        num_kv_heads=4, head_dim=32, vocab_size=vocab,
    )  # fmt: skip


def _layer_bytes(config):
    params = abstract_params(config, jnp.float32)["layers"]
    return sum(leaf.size * 4 for leaf in jax.tree.leaves(params)) // config.num_layers


def test_streamed_temp_holds_no_stacked_gradient():
    """Structure, not one ratio at one shape (the ratio across shapes is in
    benchmarks/results/step_memory_ratios_cpu.md): the reference's temp holds the stacked
    gradient of every tensor; the streamed step's temp is smaller than one stacked tensor."""
    config = _wide(num_layers=32)
    reference = _compiled_memory(config, reference=True)
    streamed = _compiled_memory(config)
    gate_stack = config.num_layers * config.intermediate_size * config.hidden_size * 4
    assert reference.temp_size_in_bytes > 3 * gate_stack  # the reference holds the stacked gradient
    assert streamed.temp_size_in_bytes < gate_stack  # so no stacked-gradient buffer can exist here


def test_doubling_the_layers_grows_temp_by_less_than_one_layer():
    config_8, config_16 = _wide(8), _wide(16)
    grown = (
        _compiled_memory(config_16).temp_size_in_bytes
        - _compiled_memory(config_8).temp_size_in_bytes
    )
    residual_bytes = 1 * 32 * config_8.hidden_size * 4
    assert grown < _layer_bytes(config_8) + residual_bytes
    reference_grown = (
        _compiled_memory(config_16, reference=True).temp_size_in_bytes
        - _compiled_memory(config_8, reference=True).temp_size_in_bytes
    )
    assert reference_grown > 8 * _layer_bytes(config_8)  # the reference grows with every layer


def test_two_pass_clipping_keeps_no_gradient_buffer_and_the_kept_mode_one_float32_copy():
    config = _wide(num_layers=8)
    fused = _compiled_memory(config).temp_size_in_bytes
    two_pass = _compiled_memory(config, clip_norm=1.0, two_pass=True).temp_size_in_bytes
    kept = _compiled_memory(config, clip_norm=1.0).temp_size_in_bytes
    params_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(abstract_params(config)))
    head_bytes = config.vocab_size * config.hidden_size * 4
    assert two_pass - fused <= head_bytes + _layer_bytes(config)  # the head's gradient, no stack
    # negative control: the kept float32 buffer of every parameter is visible here (less the one
    # layer's and the head's gradient the fused step holds anyway)
    assert kept - fused >= params_bytes - head_bytes - _layer_bytes(config)


def test_accumulating_adapters_adds_one_adapter_sized_buffer():
    """LoRA with global clipping and 4 micro-batches: the temp of a one-row fused step plus at
    most the float32 adapters (twice: buffer and update), and less than four rows at once."""
    config = _wide(num_layers=8)
    frozen = abstract_params(config, jnp.float32)
    adapters = jax.eval_shape(lambda: _adapters(config, rank=8))
    lora, optimizer = LoraSpec(scale=2.0), optax.adamw(1e-3)
    state = jax.eval_shape(lambda p: init_streamed_opt_state(optimizer, p), adapters)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)

    def temp(batch, **mode):
        step = build_streamed_step(config, optimizer, adapters, frozen, lora=lora, **mode)
        lowered = step.lower(adapters, state, frozen, _abstract_batch(batch, 64), key)
        return lowered.compile().memory_analysis().temp_size_in_bytes

    accumulated = temp(4, clip_norm=1.0, accumulation_steps=4)
    adapter_bytes = sum(leaf.size * 4 for leaf in jax.tree.leaves(adapters))
    assert accumulated - temp(1) <= 2 * adapter_bytes  # one micro-batch's step + the buffer
    assert accumulated < temp(4)  # less than the whole batch at once


def test_chunked_loss_keeps_logits_to_a_chunk():
    batch, seq, chunk = 4, 256, 32
    policy = MemoryPolicy(loss_chunk=chunk)
    small, large = tiny_config(vocab_size=2048), tiny_config(vocab_size=4096)
    grown = (
        _compiled_memory(large, policy, batch=batch, seq=seq).temp_size_in_bytes
        - _compiled_memory(small, policy, batch=batch, seq=seq).temp_size_in_bytes
    )
    full_logits_growth = batch * seq * (4096 - 2048) * 4
    assert grown < full_logits_growth
    unchunked_grown = (
        _compiled_memory(large, batch=batch, seq=seq).temp_size_in_bytes
        - _compiled_memory(small, batch=batch, seq=seq).temp_size_in_bytes
    )
    assert unchunked_grown >= full_logits_growth  # without chunks the logits do grow with V


def test_params_and_optimizer_state_are_donated_and_aliased():
    config, params, frozen, _ = _setup("full", tied=False)
    optimizer = optax.adamw(1e-3)
    state = init_streamed_opt_state(optimizer, params)
    batch, key = _batch(config), jax.random.PRNGKey(0)
    step = build_streamed_step(config, optimizer, params, frozen)
    analysis = step.lower(params, state, frozen, batch, key).compile().memory_analysis()
    donated_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves((params, state)))
    assert analysis.alias_size_in_bytes >= 0.99 * donated_bytes
    new_params, new_state, _ = step(params, state, frozen, batch, key)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves((params, state)))
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((new_params, new_state)))


def test_bf16_params_are_aliased_too():
    config = tiny_config()
    params = init_params(jax.random.PRNGKey(0), config, jnp.bfloat16)
    optimizer = optax.adamw(1e-3)
    state = init_streamed_opt_state(optimizer, params)
    step = build_streamed_step(config, optimizer, params, {})
    analysis = (
        step.lower(params, state, {}, _batch(config), jax.random.PRNGKey(0))
        .compile()
        .memory_analysis()
    )
    assert analysis.alias_size_in_bytes >= 0.99 * sum(
        leaf.nbytes for leaf in jax.tree.leaves((params, state))
    )


def test_non_finite_loss_skips_the_update():
    config, params, frozen, _ = _setup("full", tied=True)
    optimizer = optax.adamw(1e-3)
    state = init_streamed_opt_state(optimizer, params)
    poisoned = {**params, "final_norm": params["final_norm"].at[0].set(jnp.nan)}
    step = build_streamed_step(config, optimizer, poisoned, frozen, donate=False)
    new_params, _, metrics = step(poisoned, state, frozen, _batch(config), jax.random.PRNGKey(0))
    assert not bool(metrics["updated"])
    for before, after in zip(jax.tree.leaves(poisoned), jax.tree.leaves(new_params), strict=True):
        np.testing.assert_array_equal(before, after)


def _overflowing(where: str) -> optax.GradientTransformation:
    """SGD whose update is infinite for the layer slices (`where="layers"`) or for the tensors of
    vocabulary rows (`"table"`: the LM head and embedding) -- each tensor is updated on its own,
    so the shapes tell them apart in the tiny model."""

    def update(updates, state, params=None):
        def bump(u):
            table = u.ndim == 2 and u.shape[0] == tiny_config().vocab_size
            return u + jnp.inf if table == (where == "table") else -0.01 * u

        return jax.tree.map(bump, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


@pytest.mark.parametrize(
    ("method", "mode", "where"),
    [
        ("lora", "fused", "layers"),
        ("lora", "kept", "layers"),
        ("lora", "two_pass", "layers"),
        ("full", "fused", "table"),
        ("full", "kept", "table"),
    ],
)
def test_params_finite_reports_an_update_that_overflowed(method, mode, where):
    """The layers' finiteness is read per slice as the backward loop writes it (not in another pass
    over the stacks): an infinite slice of the adapters (LoRA trains nothing else) or of the head
    makes the metric false; a finite update keeps it true."""
    config, trainable, frozen, lora = _setup(method, tied=False)
    clip = {
        "fused": {},
        "kept": {"clip_norm": 1e9},
        "two_pass": {"clip_norm": 1e9, "two_pass": True},
    }
    for optimizer, finite in [(optax.sgd(0.01), True), (_overflowing(where), False)]:
        step = build_streamed_step(
            config, optimizer, trainable, frozen, lora=lora, donate=False, **clip[mode]
        )
        state = init_streamed_opt_state(optimizer, trainable)
        new, _, metrics = step(trainable, state, frozen, _batch(config), jax.random.PRNGKey(0))
        assert bool(metrics["updated"])
        assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new)) == finite
        assert bool(metrics["params_finite"]) == finite


# --- bad input -------------------------------------------------------------------------------


def test_refuses_what_cannot_work():
    config, params, frozen, _ = _setup("full", tied=False)
    with pytest.raises(StepConfigError, match="GradientTransformation"):
        build_streamed_step(config, "adam", params, frozen)
    with pytest.raises(StepConfigError, match="MultiSteps"):
        build_streamed_step(config, optax.MultiSteps(optax.sgd(0.1), 4), params, frozen)
    with pytest.raises(StepConfigError, match="two_pass clipping needs clip_norm"):
        build_streamed_step(config, optax.sgd(0.1), params, frozen, two_pass=True)
    with pytest.raises(StepConfigError, match="drop two_pass"):
        build_streamed_step(
            config, optax.sgd(0.1), params, frozen, clip_norm=1.0, two_pass=True,
            accumulation_steps=2,
        )  # fmt: skip
    with pytest.raises(StepConfigError, match="attention_probs"):
        MemoryPolicy(save=("attention_probs",))
    ragged = {**params, "layers": {**params["layers"], "up": params["layers"]["up"][:1]}}
    with pytest.raises(StepConfigError, match="up"):
        build_streamed_step(config, optax.sgd(0.1), ragged, frozen)
    step = build_streamed_step(
        config, optax.sgd(0.1), params, frozen, policy=MemoryPolicy(loss_chunk=5)
    )
    state = init_streamed_opt_state(optax.sgd(0.1), params)
    with pytest.raises(StepConfigError, match="does not divide the sequence length 16"):
        step(params, state, frozen, _batch(config), jax.random.PRNGKey(0))
