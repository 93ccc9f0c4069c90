"""The host-offload rules of XLA's GPU compiler, checked on programs lowered for CUDA here: each
rule's legal form passes and each illegal form is named (the checker is the oracle the step's
placement tests rely on, so it is tested on its own first)."""

import jax
import jax.numpy as jnp
from jax.experimental.compute_on import compute_on

from featherweight.parallel.offload_rules import check_host_offload, summary

HOST = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
TO_HOST, TO_DEVICE = jax.memory.Space.Host, jax.memory.Space.Device
STACK = jax.device_put(jnp.ones((4, 8)), HOST)


def reasons(function, *arguments):
    return {
        key.split(": ", 1)[1] for key in summary(check_host_offload(jax.jit(function), *arguments))
    }


def test_slicing_a_host_array_and_moving_the_slice_is_legal():
    def f(stack, index):
        return jax.device_put(jax.lax.dynamic_index_in_dim(stack, index, keepdims=False), TO_DEVICE)

    assert reasons(f, STACK, 1) == set()


def test_computing_on_a_host_array_is_named():
    assert reasons(lambda stack: jax.device_put(stack + 1, TO_DEVICE), STACK) == {
        "computes on a host value (XLA: device compute in host memory)"
    }


def test_gathering_from_a_host_array_is_named():
    def f(stack, ids):
        return jax.device_put(stack[jax.device_put(ids, TO_HOST)], TO_DEVICE)

    assert "computes on a host value (XLA: device compute in host memory)" in reasons(
        f, STACK, jnp.array([0, 2])
    )


def test_host_compute_with_compute_on_is_named():
    def f(stack):
        with compute_on("device_host"):
            part = stack * 2
        return jax.device_put(part, TO_DEVICE)

    assert "host compute (compute_on device_host) on a host value" in reasons(f, STACK)


def test_a_host_value_returned_as_a_device_output_is_e1200():
    def f(stack):
        return jax.device_put(stack, TO_DEVICE) * 2, jax.device_put(stack, TO_HOST)

    assert reasons(f, STACK) == set()  # declared host: fine

    found = check_host_offload(jax.jit(lambda x: jax.device_put(x, TO_HOST) + 0), jnp.ones(3))
    assert any(v.op == "stablehlo.add" for v in found)


def test_writing_a_device_value_into_a_host_buffer_without_moving_it_is_named():
    def bad(stack):
        return jax.lax.dynamic_update_index_in_dim(stack, jnp.zeros(8), 0, 0)

    def good(stack):
        new = jax.device_put(jnp.zeros((4, 8)), TO_HOST)
        row = jax.device_put(jnp.zeros(8), TO_HOST)
        return jax.lax.dynamic_update_index_in_dim(new, row, 0, 0)

    assert reasons(good, STACK) == set()
    try:
        found = reasons(bad, STACK)
    except ValueError:  # jax itself refuses mixing memories here: as good as named
        return
    assert found


def test_scanned_offload_of_per_step_outputs_is_legal():
    """The offloaded residual stream's pattern, which compiled and ran on an H200."""

    def f(x):
        def body(carry, _):
            return carry * 2, jax.device_put(carry, TO_HOST)

        _, saved = jax.lax.scan(body, x, None, length=4)
        return jax.device_put(saved[2], TO_DEVICE)

    assert reasons(f, jnp.ones(8)) == set()


def test_violations_name_the_host_argument_they_come_from():
    found = check_host_offload(jax.jit(lambda stack: jax.device_put(stack + 1, TO_DEVICE)), STACK)
    assert found and found[0].origin.startswith("stack")
