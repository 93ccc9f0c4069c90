"""Host-resident arrays inside jitted code: the embedding rows a batch uses come from a host table,
and host stacks are sliced and written on the host. On CPU host and device share RAM, so the tests
check the numbers and the memory kinds in the program."""

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.models.llama import embed
from featherweight.parallel.memory_kinds import host_slice, host_write, on_host
from featherweight.step.loss import token_losses_sum

HOST_SHARDING = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def test_embedding_rows_come_from_a_host_table():
    table = jax.random.normal(jax.random.PRNGKey(0), (300, 64))
    ids = jax.random.randint(jax.random.PRNGKey(1), (2, 7), 0, 300)
    params = {"embed": jax.device_put(table, HOST_SHARDING), "final_norm": jnp.ones(64)}
    rows = jax.jit(embed)(params, ids)
    np.testing.assert_array_equal(rows, jnp.take(table, ids, axis=0))
    program = str(jax.make_jaxpr(embed)(params, ids))
    assert "f32<host>[300,64]" in program  # the table stays on the host ...
    assert "f32<host>[2,7,64]" in program  # ... the gather runs there, and only rows move
    assert "f32[300,64]" not in program


def test_the_loss_reads_a_host_table_one_vocabulary_chunk_at_a_time():
    keys = jax.random.split(jax.random.PRNGKey(2), 3)
    hidden = jax.random.normal(keys[0], (2, 8, 64))
    table = 0.2 * jax.random.normal(keys[1], (300, 64))
    targets = jax.random.randint(keys[2], (2, 8), 0, 300)
    mask = jnp.ones((2, 8))
    norm = jnp.ones(64)

    def loss(h, head):
        return token_losses_sum(h, norm, head, targets, mask, 1e-5, None, 128)

    on_device = jax.value_and_grad(loss)(hidden, table)
    host_table = jax.device_put(table, HOST_SHARDING)
    on_host_value, on_host_grad = jax.jit(jax.value_and_grad(loss))(hidden, host_table)
    np.testing.assert_allclose(on_host_value, on_device[0], rtol=1e-6)
    np.testing.assert_allclose(on_host_grad, on_device[1], rtol=1e-5, atol=1e-7)
    assert "f32<host>[128,64]" in str(jax.make_jaxpr(loss)(hidden, host_table))


def test_host_stacks_are_sliced_and_written_on_the_host():
    stack = jax.device_put(jnp.zeros((4, 3, 2)), HOST_SHARDING)

    @jax.jit
    def update_each_layer(stack):
        def body(index, stack):
            layer = host_slice(stack, index)
            assert not on_host(layer)
            return host_write(stack, layer + index + 1.0, index)

        return jax.lax.fori_loop(0, 4, body, stack)

    result = update_each_layer(stack)
    np.testing.assert_array_equal(result[:, 0, 0], [1.0, 2.0, 3.0, 4.0])
    assert result.sharding.memory_kind == "pinned_host"
