"""AdamW with 8-bit moments: bitsandbytes' block-wise 8-bit Adam as an optax transformation.

fp32 AdamW keeps two float32 moments, 8 bytes per trainable parameter: 64 GB for a full fine-tune
of an 8B model. Here both moments are stored block-wise in 8 bits (featherweight/optim/
blockwise8bit.py): the first with the signed dynamic map, the second with the unsigned one.
Per tensor of n values:

  mu.codes   uint8   [shape]             nu.codes   uint8   [shape]
  mu.absmax  float32 [ceil(n / 256)]     nu.absmax  float32 [ceil(n / 256)]

2 bytes per parameter plus 8 per block of 256: 2.03 bytes/param (`adam_8bit_state_bytes`).

Each `update` dequantizes the moments, runs optax's own Adam arithmetic (`update_moment`,
`bias_correction`) in float32, takes the update from these fresh float32 moments and only then
requantizes them, as bitsandbytes' kernels do: quantization error reaches the updates one step
late, through the stored state. Tensors smaller than `min_8bit_size` values (norms, biases;
bitsandbytes' default 4096) keep float32 moments, where 8 bits would save little; their updates
are `optax.scale_by_adam`'s.

The maps resolve about seven decades below each block's absmax. A second-moment value under
1.6e-7 of its block's absmax (a gradient ~4e-4 of the block's largest) is stored as 0 while its
first moment may not be, and that element's next update is then larger than fp32 Adam's. This is
bitsandbytes' behaviour too; it recommends float32 state for embeddings, whose rows see sparse
gradients: wrap with `optax.multi_transform` to give them `optax.adamw`.

Blocks run over each state leaf's own flattened values. `jax.vmap(init)` over stacked layers (the
streamed step) gives each layer its own blocks and its own `min_8bit_size` test; `init` on a
stacked [L, ...] tensor (the reference step) cuts blocks across the stack and tests L times the
size. The two agree when one layer's size is a multiple of `block_size` (every linear weight of
the supported models) and both sizes fall on the same side of `min_8bit_size`.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from featherweight.errors import ConfigError
from featherweight.optim.blockwise8bit import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    DynamicMap,
    QuantizedMoment,
    dequantize_blockwise,
    quantize_blockwise,
    zero_moment,
)

BLOCK_SIZE = 256
MIN_8BIT_SIZE = 4096


class ScaleByAdam8bitState(NamedTuple):
    """count: int32 [] steps taken; mu, nu: for each parameter leaf a `QuantizedMoment`, or a
    float32 array of the leaf's shape when it has fewer than `min_8bit_size` values."""

    count: jax.Array
    mu: Any
    nu: Any


def adam_8bit_state_bytes(
    num_params: int, block_size: int = BLOCK_SIZE, min_8bit_size: int = MIN_8BIT_SIZE
) -> int:
    """Bytes of both moments of one tensor of `num_params` values: the planner's formula (the
    state's int32 step count adds 4 bytes). Layers stacked under `jax.vmap(init)` count one
    layer at a time."""
    if num_params < min_8bit_size:
        return 8 * num_params
    return 2 * num_params + 8 * math.ceil(num_params / block_size)


def _check_settings(b1: float, b2: float, block_size: int, min_8bit_size: int) -> None:
    for name, value in (("b1", b1), ("b2", b2)):
        if not 0.0 <= value < 1.0:
            raise ConfigError(f"{name}={value} must be a decay rate in [0, 1), e.g. 0.9 or 0.999")
    if block_size <= 0:
        raise ConfigError(f"block_size={block_size} must be a positive number of values, e.g. 256")
    if min_8bit_size < 0:
        raise ConfigError(
            f"min_8bit_size={min_8bit_size} must be >= 0 (0 keeps every tensor's moments in 8 bits)"
        )


def scale_by_adam_8bit(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
) -> optax.GradientTransformation:
    """`optax.scale_by_adam` with both moments kept in 8 bits (see the module docstring).

    Args:
      b1: decay rate of the first moment (mean of the gradients).
      b2: decay rate of the second moment (mean of the squared gradients).
      eps: added to the root of the bias-corrected second moment.
      block_size: values per quantization block (one float32 absmax each).
      min_8bit_size: tensors with fewer values keep float32 moments.

    Returns:
      An optax `GradientTransformation` whose state holds uint8 and float32 arrays and an int32
      count (no dtype changes in `update`, so a donated state is updated in place).
    """
    _check_settings(b1, b2, block_size, min_8bit_size)

    def zeros(param: jax.Array, dynamic_map: DynamicMap):
        if param.size < min_8bit_size:
            return jnp.zeros(param.shape, jnp.float32)
        return zero_moment(param.shape, dynamic_map, block_size)

    def restore(moment, dynamic_map: DynamicMap) -> jax.Array:
        if isinstance(moment, QuantizedMoment):
            return dequantize_blockwise(moment, dynamic_map, block_size)
        return moment

    def store(value: jax.Array, like, dynamic_map: DynamicMap):
        if isinstance(like, QuantizedMoment):
            return quantize_blockwise(value, dynamic_map, block_size)
        return value

    def init_fn(params):
        return ScaleByAdam8bitState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: zeros(p, SIGNED_MAP), params),
            nu=jax.tree.map(lambda p: zeros(p, UNSIGNED_MAP), params),
        )

    def update_fn(updates, state, params=None):
        del params
        count = optax.safe_increment(state.count)

        def update_leaf(grad, mu, nu):
            grad32 = grad.astype(jnp.float32)
            m = optax.tree.update_moment(grad32, restore(mu, SIGNED_MAP), b1, 1)
            v = optax.tree.update_moment_per_elem_norm(grad32, restore(nu, UNSIGNED_MAP), b2, 2)
            m_hat = optax.tree.bias_correction(m, b1, count)
            v_hat = optax.tree.bias_correction(v, b2, count)
            update = (m_hat / (jnp.sqrt(v_hat) + eps)).astype(grad.dtype)
            return update, store(m, mu, SIGNED_MAP), store(v, nu, UNSIGNED_MAP)

        grads, treedef = jax.tree.flatten(updates)
        results = [
            update_leaf(*leaf)
            for leaf in zip(grads, treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu))
        ]
        new_updates, mu, nu = (
            treedef.unflatten([result[part] for result in results]) for part in range(3)
        )
        return new_updates, ScaleByAdam8bitState(count, mu, nu)

    return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(
    learning_rate: optax.ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-4,
    block_size: int = BLOCK_SIZE,
    min_8bit_size: int = MIN_8BIT_SIZE,
    mask: Any = None,
) -> optax.GradientTransformation:
    """AdamW with 8-bit moments: `optax.adamw`'s chain (Adam scaling, decoupled weight decay over
    `mask`, learning rate) with `scale_by_adam_8bit` in place of `scale_by_adam`, so about 2.03
    bytes of optimizer state per parameter instead of 8."""
    return optax.chain(
        scale_by_adam_8bit(b1, b2, eps, block_size, min_8bit_size),
        optax.add_decayed_weights(weight_decay, mask),
        optax.scale_by_learning_rate(learning_rate),
    )
