"""Host-resident arrays inside jitted code: a host embedding table streams over in row chunks,
the loss reads a host head one vocabulary chunk at a time, and host stacks are sliced on the host
and rebuilt in fresh host buffers. On CPU host and device share RAM, so these tests check the
numbers and the memory kinds in the program; `test_offload_rules.py` checks the GPU's rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from featherweight.models.llama import embed
from featherweight.parallel.memory_kinds import (
    host_slice,
    host_table_rows,
    on_host,
    placed_like,
    table_chunk,
    to_host,
)
from featherweight.parallel.offload_rules import check_host_offload
from featherweight.step.loss import HeadForm, token_losses_sum
from tests.conftest import tiny_config

HOST_SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


@pytest.mark.parametrize("chunk", [None, 64, 128, 300])
def test_embedding_rows_stream_from_a_host_table(chunk):
    table = jax.random.normal(jax.random.PRNGKey(0), (300, 64))
    ids = jnp.array([[0, 1, 63, 64, 127, 128], [255, 256, 299, 298, 171, 0]])
    host_table = jax.device_put(table, HOST_SHARDING)
    rows = jax.jit(host_table_rows, static_argnums=2)(host_table, ids, chunk)
    np.testing.assert_array_equal(rows, jnp.take(table, ids, axis=0))
    program = str(jax.make_jaxpr(host_table_rows, static_argnums=2)(host_table, ids, chunk))
    assert "f32<host>[300,64]" in program  # the table stays on the host ...
    assert "f32[300,64]" not in program or chunk in (None, 300)  # ... only chunks come over
    assert not check_host_offload(
        jax.jit(host_table_rows, static_argnums=2), host_table, ids, chunk
    )


def test_the_embedding_of_a_host_table_is_the_device_lookup():
    table = jax.random.normal(jax.random.PRNGKey(0), (300, 64))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 300)
    params = {"embed": jax.device_put(table, HOST_SHARDING), "final_norm": jnp.ones(64)}
    config = tiny_config(vocab_size=table.shape[0], hidden_size=64)
    lookup = jax.jit(embed, static_argnums=2)(params, ids, config)
    np.testing.assert_array_equal(lookup, jnp.take(table, ids, axis=0))


def test_table_chunks_divide_the_vocabulary_when_they_can():
    assert table_chunk(49152) == 8192
    assert table_chunk(128256) == 8016  # 16 equal chunks
    assert table_chunk(300) == 300
    assert table_chunk(8209) == 8192  # a prime: clamped last chunk


def test_the_loss_reads_a_host_table_one_vocabulary_chunk_at_a_time():
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    hidden = jax.random.normal(keys[0], (2, 8, 64))
    table = 0.2 * jax.random.normal(keys[1], (300, 64))
    targets = jax.random.randint(keys[2], (2, 8), 0, 300)
    mask = jnp.ones((2, 8))
    norm = jnp.ones(64)

    def loss(h, head):
        return token_losses_sum(h, norm, head, targets, mask, HeadForm(1e-5), None, 128)

    on_device = jax.value_and_grad(loss)(hidden, table)
    host_table = jax.device_put(table, HOST_SHARDING)
    loss_and_grad = jax.jit(jax.value_and_grad(loss))
    on_host_value, on_host_grad = loss_and_grad(hidden, host_table)
    np.testing.assert_allclose(on_host_value, on_device[0], rtol=1e-6)
    np.testing.assert_allclose(on_host_grad, on_device[1], rtol=1e-5, atol=1e-7)
    assert "f32<host>[128,64]" in str(jax.make_jaxpr(loss)(hidden, host_table))
    assert not check_host_offload(loss_and_grad, hidden, host_table)


def test_host_stacks_are_sliced_on_the_host_and_rebuilt_from_a_loops_outputs():
    stack = jax.device_put(jnp.arange(24.0).reshape(4, 3, 2), HOST_SHARDING)

    @jax.jit
    def update_each_layer(stack):
        def body(_, index):
            layer = host_slice(stack, index)
            assert not on_host(layer)
            return None, to_host(layer + 1.0)

        return jax.lax.scan(body, None, jnp.arange(4))[1]

    result = update_each_layer(stack)
    np.testing.assert_array_equal(result, jnp.arange(24.0).reshape(4, 3, 2) + 1.0)
    assert result.sharding.memory_kind == "pinned_host"
    assert not check_host_offload(update_each_layer, stack)


def test_results_keep_the_memory_their_arguments_came_from():
    state = jax.device_put(jnp.ones(4), HOST_SHARDING)

    @jax.jit
    def double(state):
        doubled = jax.device_put(state, jax.memory.Space.Device) * 2
        return placed_like(doubled, state)

    assert double(state).sharding.memory_kind == "pinned_host"
    assert not check_host_offload(double, state)
