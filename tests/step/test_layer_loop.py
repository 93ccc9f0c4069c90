"""The layer loop with the frozen base in pinned host memory (`memory.base: host`): the same
training, bit for bit, as with the base on the device, and a compiled step whose device bytes hold
at most two layers of the base (no buffer the size of the stack)."""

import jax
import numpy as np
import optax
import pytest

from featherweight.memory.measure import measure_compiled
from featherweight.memory.state_bytes import frozen_layer_bytes
from featherweight.models.batch import batch_from_tokens
from featherweight.models.init import init_params
from featherweight.parallel.memory_kinds import to_device, to_host
from featherweight.peft.lora import LoraConfig, init_lora
from featherweight.recipe.schema import parse_config
from featherweight.step.opt_state import init_streamed_opt_state
from featherweight.step.reference import model_loss
from featherweight.step.streamed import build_streamed_step
from tests.conftest import tiny_config, training_case

UNTIED = tiny_config(vocab_size=512, num_layers=3, tie_word_embeddings=False)
TIED = tiny_config(vocab_size=512, num_layers=3, tie_word_embeddings=True)
BATCH = batch_from_tokens(jax.random.randint(jax.random.PRNGKey(3), (2, 33), 0, 512))
ADAMW = optax.adamw(1e-2, weight_decay=0.1)


def _train(config, method, base_on, steps=2):
    trainable, frozen, lora = training_case(config, method, rank=4)
    if base_on == "host":
        frozen = {**frozen, "layers": to_host(frozen["layers"])}
    state = init_streamed_opt_state(ADAMW, trainable)
    step = build_streamed_step(config, ADAMW, trainable, frozen, lora)
    evaluate = jax.jit(lambda t, f: model_loss(t, f, BATCH, config, lora))
    losses = []
    for index in range(steps):
        trainable, state, metrics = step(trainable, state, frozen, BATCH, jax.random.PRNGKey(index))
        losses.append(np.asarray(metrics["loss"]))
    losses.append(np.asarray(evaluate(trainable, frozen)))  # the evaluation's forward too
    kinds = {leaf.sharding.memory_kind for leaf in jax.tree.leaves(frozen["layers"])}
    return losses, jax.tree.leaves(jax.tree.map(np.asarray, (trainable, state))), kinds


@pytest.mark.default_emitters  # two programs compared bit for bit (tests/emitters.py)
@pytest.mark.parametrize(
    ("config", "method"),
    [
        (TIED, "qlora"),
        pytest.param(UNTIED, "lora", marks=pytest.mark.slow),
        pytest.param(TIED, "lora", marks=pytest.mark.slow),
        pytest.param(UNTIED, "qlora", marks=pytest.mark.slow),
    ],
    ids=["tied-qlora", "untied-lora", "tied-lora", "untied-qlora"],
)
def test_the_base_on_the_host_trains_bit_for_bit_as_on_the_device(config, method):
    losses, leaves, kinds = _train(config, method, "device")
    host_losses, host_leaves, host_kinds = _train(config, method, "host")
    assert kinds == {"device"} and host_kinds == {"pinned_host"}
    for expected, actual in zip(losses, host_losses, strict=True):
        np.testing.assert_array_equal(actual, expected)
    for expected, actual in zip(leaves, host_leaves, strict=True):
        np.testing.assert_array_equal(actual, expected)


@pytest.mark.default_emitters  # two programs compared bit for bit (tests/emitters.py)
@pytest.mark.slow
def test_the_base_on_the_host_with_dropout_and_global_clipping_trains_bit_for_bit():
    """The kept-gradient mode (global clipping of the adapters) and per-layer dropout keys, which
    ride beside the host base through the scan: the same training as with the base on the device."""
    params = init_params(jax.random.PRNGKey(0), UNTIED)
    lora = LoraConfig(rank=4, alpha=8, dropout=0.1)

    def train(frozen):
        trainable = init_lora(jax.random.PRNGKey(1), UNTIED, lora)
        state = init_streamed_opt_state(ADAMW, trainable)
        step = build_streamed_step(UNTIED, ADAMW, trainable, frozen, lora.spec, clip_norm=1.0)
        for index in range(2):
            trainable, state, metrics = step(
                trainable, state, frozen, BATCH, jax.random.PRNGKey(index)
            )
        return [np.asarray(metrics["loss"]), *map(np.asarray, jax.tree.leaves(trainable))]

    on_host = train({**params, "layers": to_host(params["layers"])})
    for expected, actual in zip(train(params), on_host, strict=True):
        np.testing.assert_array_equal(actual, expected)


# --- memory: the compiled step holds at most two layers of the base -------------------------------

MEMORY_MODEL = tiny_config(vocab_size=512, num_layers=8)  # the stack dominates the step


def _config(method, base):
    return parse_config(
        {
            "method": method,
            "model": {"path": "unused", "dtype": "float32"},
            "data": {"train": "unused", "seq_len": 64},
            "batch_size": 2,
            "lora": {"rank": 4},
            "memory": {"base": base},
        }
    )


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_the_device_holds_at_most_two_layers_of_a_host_base(method):
    """Device bytes by the shared rule (host-resident arguments left out by their memory kind).
    With the base on the device, leaving its stack out of the device bytes gives what the step
    needs besides the base; with the base on the host, the device holds that and at most two
    layers of the base more (the one computing and the one coming over). The negative control:
    the base on the device exceeds that by the whole stack less two layers."""
    stack = frozen_layer_bytes(_config(method, "device"), MEMORY_MODEL)
    two_layers = 2 * stack // MEMORY_MODEL.num_layers
    on_device = measure_compiled(_config(method, "device"), MEMORY_MODEL)
    on_host = measure_compiled(_config(method, "host"), MEMORY_MODEL)
    without_base = on_device.device_bytes - stack
    assert on_host.host_argument_bytes == stack  # the stack is a host argument, byte for byte
    assert on_device.host_argument_bytes == 0
    assert on_host.device_bytes <= without_base + two_layers
    assert on_device.device_bytes > without_base + two_layers  # negative control


# --- the program: what crosses from the host to the device ----------------------------------------


def _host_to_device_bytes(jaxpr) -> list[int]:
    """Bytes of every host-to-device `device_put` in a jaxpr and the jaxprs inside it (scan,
    while, cond, remat, pjit bodies), one entry per transfer as the program is written."""
    moved = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for source, target in zip(eqn.invars, eqn.outvars, strict=True):
                if "<host>" in str(source.aval) and "<host>" not in str(target.aval):
                    moved.append(source.aval.size * source.aval.dtype.itemsize)
        for param in eqn.params.values():
            for inner in param if isinstance(param, (tuple, list)) else (param,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    moved.extend(_host_to_device_bytes(inner))
    return moved


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_only_single_layers_of_a_host_base_come_to_the_device(method):
    """On CPU host and device are one memory, so the compiled bytes cannot show a copy of the
    stack to the device; the program can. The step brings layer slices over at four places
    (the forward's first layer and its one-ahead fetch, the backward's), and nothing else: an
    added transfer of a whole stack fails the count. Negative control: the same walk sees a
    whole stack brought over when a program does it."""
    trainable, frozen, lora = training_case(UNTIED, method, rank=4)
    host_layers = to_host(frozen["layers"])
    frozen = {**frozen, "layers": host_layers}
    state = init_streamed_opt_state(ADAMW, trainable)
    step = build_streamed_step(UNTIED, ADAMW, trainable, frozen, lora)
    program = jax.make_jaxpr(step)(trainable, state, frozen, BATCH, jax.random.PRNGKey(0))
    stack = sum(leaf.nbytes for leaf in jax.tree.leaves(host_layers))
    moved = _host_to_device_bytes(program.jaxpr)
    assert sum(moved) == 4 * stack // UNTIED.num_layers
    whole = jax.make_jaxpr(lambda layers: to_device(layers))(host_layers)
    assert sum(_host_to_device_bytes(whole.jaxpr)) == stack
