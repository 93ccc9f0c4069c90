"""NF4 (4-bit NormalFloat) with double quantization, as QLoRA defines it.

Storage for a weight of n values (n divisible by 64):
  codes          uint8 [n/2]       two 4-bit indices into `NF4_CODE` per byte, first one high
  absmax         uint8 [n/64]      each block's float32 absmax, minus their mean, in 8 bits
                                   (bitsandbytes' dynamic map, blocks of 256) -- or float32 without
                                   double quantization
  absmax_scale   float32 [ceil(n/64/256)]   the absmax of each block of 256 absmax values
  absmax_offset  float32 []        the mean that was subtracted
That is 0.5 + 1/64 + 4/(64*256) bytes = 4.127 bits per weight.

Every array may carry leading stack axes (e.g. [L] for the scanned layers): each tensor of the stack
is quantized on its own, so slicing a stack is slicing every field.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.errors import QuantizationError

BLOCK_SIZE = 64
ABSMAX_BLOCK_SIZE = 256

NF4_CODE = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    dtype=np.float32,
)


# The signed 8-bit dynamic quantization map (Dettmers, "8-Bit Approximations for Parallelism
# in Deep Learning", 2015) used for the absmax values: a sign, a run-length exponent
# (10^-6 .. 10^0) and the remaining bits as a linear fraction between 0.1 and 1 (midpoints), plus
# 0 and 1: fine steps near zero, coarse near one. Stored as values (like NF4_CODE), since the
# float32 rounding of their construction must match bitsandbytes bit for bit.
# fmt: off
DYNAMIC_CODE = np.array([
    -0.99296874, -0.9789063, -0.96484375, -0.9507812, -0.93671876, -0.92265624,
    -0.9085938, -0.89453125, -0.8804687, -0.86640626, -0.85234374, -0.8382813,
    -0.82421875, -0.8101562, -0.79609376, -0.78203124, -0.7679688, -0.75390625,
    -0.7398437, -0.72578126, -0.7117188, -0.6976563, -0.68359375, -0.6695312,
    -0.65546876, -0.6414063, -0.6273438, -0.61328125, -0.5992187, -0.58515626,
    -0.5710938, -0.5570313, -0.54296875, -0.5289062, -0.5148437, -0.50078124,
    -0.4867187, -0.47265625, -0.45859373, -0.44453126, -0.43046874, -0.41640624,
    -0.40234375, -0.38828123, -0.37421876, -0.36015624, -0.34609374, -0.33203125,
    -0.31796873, -0.30390626, -0.28984374, -0.27578127, -0.26171875, -0.24765624,
    -0.23359375, -0.21953125, -0.20546874, -0.19140625, -0.17734376, -0.16328125,
    -0.14921875, -0.13515624, -0.12109375, -0.107031256, -0.09859375, -0.09578126,
    -0.092968754, -0.09015625, -0.08734375, -0.08453125, -0.08171876, -0.07890625,
    -0.07609375, -0.07328125, -0.070468746, -0.067656256, -0.06484375, -0.06203125,
    -0.059218753, -0.05640625, -0.05359375, -0.05078125, -0.04796875, -0.04515625,
    -0.042343747, -0.03953125, -0.036718752, -0.03390625, -0.03109375, -0.028281251,
    -0.02546875, -0.02265625, -0.019843752, -0.01703125, -0.01421875, -0.01140625,
    -0.00971875, -0.009156249, -0.00859375, -0.00803125, -0.00746875, -0.00690625,
    -0.00634375, -0.00578125, -0.0052187503, -0.0046562497, -0.00409375, -0.0035312497,
    -0.00296875, -0.00240625, -0.00184375, -0.0012812499, -9.437501e-04, -8.3125e-04,
    -7.1875006e-04, -6.062501e-04, -4.9375003e-04, -3.8125002e-04, -2.6875004e-04, -1.5625001e-04,
    -8.875e-05, -6.625e-05, -4.375e-05, -2.1249998e-05, -7.75e-06, -3.2500002e-06,
    -5.5000004e-07, 0, 5.5000004e-07, 3.2500002e-06, 7.75e-06, 2.1249998e-05,
    4.375e-05, 6.625e-05, 8.875e-05, 1.5625001e-04, 2.6875004e-04, 3.8125002e-04,
    4.9375003e-04, 6.062501e-04, 7.1875006e-04, 8.3125e-04, 9.437501e-04, 0.0012812499,
    0.00184375, 0.00240625, 0.00296875, 0.0035312497, 0.00409375, 0.0046562497,
    0.0052187503, 0.00578125, 0.00634375, 0.00690625, 0.00746875, 0.00803125,
    0.00859375, 0.009156249, 0.00971875, 0.01140625, 0.01421875, 0.01703125,
    0.019843752, 0.02265625, 0.02546875, 0.028281251, 0.03109375, 0.03390625,
    0.036718752, 0.03953125, 0.042343747, 0.04515625, 0.04796875, 0.05078125,
    0.05359375, 0.05640625, 0.059218753, 0.06203125, 0.06484375, 0.067656256,
    0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876, 0.08453125,
    0.08734375, 0.09015625, 0.092968754, 0.09578126, 0.09859375, 0.107031256,
    0.12109375, 0.13515624, 0.14921875, 0.16328125, 0.17734376, 0.19140625,
    0.20546874, 0.21953125, 0.23359375, 0.24765624, 0.26171875, 0.27578127,
    0.28984374, 0.30390626, 0.31796873, 0.33203125, 0.34609374, 0.36015624,
    0.37421876, 0.38828123, 0.40234375, 0.41640624, 0.43046874, 0.44453126,
    0.45859373, 0.47265625, 0.4867187, 0.50078124, 0.5148437, 0.5289062,
    0.54296875, 0.5570313, 0.5710938, 0.58515626, 0.5992187, 0.61328125,
    0.6273438, 0.6414063, 0.65546876, 0.6695312, 0.68359375, 0.6976563,
    0.7117188, 0.72578126, 0.7398437, 0.75390625, 0.7679688, 0.78203124,
    0.79609376, 0.8101562, 0.82421875, 0.8382813, 0.85234374, 0.86640626,
    0.8804687, 0.89453125, 0.9085938, 0.92265624, 0.93671876, 0.9507812,
    0.96484375, 0.9789063, 0.99296874, 1,
], dtype=np.float32)
# fmt: on


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NF4Tensor:
    """A weight of `shape` in NF4 (see the module docstring). A pytree: arrays are leaves."""

    codes: jax.Array
    absmax: jax.Array
    absmax_scale: jax.Array | None
    absmax_offset: jax.Array | None
    shape: tuple[int, ...] = dataclasses.field(metadata={"static": True})

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading stack axes (e.g. `(L,)` for layers stacked for `lax.scan`)."""
        return tuple(self.codes.shape[:-1])

    @property
    def nbytes(self) -> int:
        """Bytes held by the quantized representation."""
        leaves = jax.tree.leaves(self)
        return int(sum(math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize for leaf in leaves))

    @property
    def double_quantized(self) -> bool:
        return self.absmax_scale is not None


def nf4_nbytes(num_values: int, double_quant: bool = True) -> int:
    """Bytes of one NF4 tensor of `num_values` weights (the planner's formula)."""
    blocks = num_values // BLOCK_SIZE
    if not double_quant:
        return num_values // 2 + 4 * blocks
    return num_values // 2 + blocks + 4 * math.ceil(blocks / ABSMAX_BLOCK_SIZE) + 4


def _blockwise_absmax_scale(flat: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """Per-block absmax and values scaled into [-1, 1], rounding as bitsandbytes' NF4 does.

    Full blocks multiply by the reciprocal of their absmax; a trailing partial block divides.
    """
    n = flat.shape[-1]
    full = n - n % block
    blocks = flat[..., :full].reshape(*flat.shape[:-1], full // block, block)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = jnp.clip(blocks * (1.0 / jnp.maximum(absmax, 1e-38))[..., None], -1, 1)
    scaled = scaled.reshape(*flat.shape[:-1], full)
    if full < n:
        tail = flat[..., full:]
        tail_absmax = jnp.maximum(jnp.max(jnp.abs(tail), axis=-1), 1e-38)
        absmax = jnp.concatenate([absmax, tail_absmax[..., None]], axis=-1)
        scaled = jnp.concatenate([scaled, jnp.clip(tail / tail_absmax[..., None], -1, 1)], -1)
    return absmax, scaled


def _nearest_code(scaled: jax.Array, code: np.ndarray) -> jax.Array:
    """Index of the nearest code value; a value exactly between two codes takes the lower."""
    midpoints = jnp.asarray((code[:-1] + code[1:]) / np.float32(2.0))
    return jnp.searchsorted(midpoints, scaled, side="left").astype(jnp.uint8)


def _nearest_dynamic_code(centered: jax.Array) -> tuple[jax.Array, jax.Array]:
    """8-bit dynamic-map quantization of the centered absmax in blocks of 256.

    As bitsandbytes' CPU kernel: divide by the block's absmax, take the code value at or below,
    and step right only when the right neighbour is strictly closer (ties stay left).
    """
    blocks = centered.shape[-1]
    padded = -(-blocks // ABSMAX_BLOCK_SIZE) * ABSMAX_BLOCK_SIZE
    pad = [(0, 0)] * (centered.ndim - 1) + [(0, padded - blocks)]
    grouped = jnp.pad(centered, pad).reshape(*centered.shape[:-1], -1, ABSMAX_BLOCK_SIZE)
    scale = jnp.max(jnp.abs(grouped), axis=-1)
    normed = (grouped / scale[..., None]).reshape(*centered.shape[:-1], padded)[..., :blocks]
    search_code = DYNAMIC_CODE.copy()
    search_code[0] = -1.0
    code = jnp.asarray(search_code)
    lower = jnp.clip(jnp.searchsorted(code, normed, side="right") - 1, 0, 254)
    closer_right = jnp.abs(normed - code[lower + 1]) < jnp.abs(normed - code[lower])
    return (lower + closer_right).astype(jnp.uint8), scale


def _quantize_flat(flat: jax.Array, double_quant: bool) -> tuple[jax.Array, ...]:
    """NF4-quantize the last axis of a float32 array whose length is a multiple of 64."""
    absmax, scaled = _blockwise_absmax_scale(flat, BLOCK_SIZE)
    indices = _nearest_code(scaled, NF4_CODE)
    codes = (indices[..., 0::2] << 4) | indices[..., 1::2]
    if not double_quant:
        return codes, absmax, None, None
    offset = jnp.mean(absmax, axis=-1)
    absmax_codes, absmax_scale = _nearest_dynamic_code(absmax - offset[..., None])
    return codes, absmax_codes, absmax_scale, offset


def quantize_nf4(
    weight: jax.Array | np.ndarray,
    double_quant: bool = True,
    stack_axes: int = 0,
    name: str = "weight",
) -> NF4Tensor:
    """Quantize `weight` to NF4; the first `stack_axes` axes are a stack of separate tensors.

    Raises `QuantizationError` when a tensor's size is not a multiple of the block size (64).
    """
    weight = jnp.asarray(weight)
    stack_shape = tuple(weight.shape[:stack_axes])
    shape = tuple(weight.shape[stack_axes:])
    num_values = math.prod(shape)
    if num_values % BLOCK_SIZE:
        raise QuantizationError(
            f"cannot NF4-quantize {name} of shape {shape}: its {num_values} values are not a "
            f"multiple of the block size {BLOCK_SIZE}; keep this tensor in bf16 or pad the model"
        )
    flat = weight.reshape(*stack_shape, num_values).astype(jnp.float32)
    codes, absmax, absmax_scale, offset = _quantize_flat_jit(flat, double_quant)
    return NF4Tensor(codes, absmax, absmax_scale, offset, shape)


_quantize_flat_jit = jax.jit(_quantize_flat, static_argnums=1)


def dequantize_absmax(tensor: NF4Tensor) -> jax.Array:
    """The float32 per-block absmax [..., n/64], undoing the double quantization."""
    if not tensor.double_quantized:
        return tensor.absmax
    values = jnp.take(jnp.asarray(DYNAMIC_CODE), tensor.absmax.astype(jnp.int32))
    blocks = tensor.absmax.shape[-1]
    padded = tensor.absmax_scale.shape[-1] * ABSMAX_BLOCK_SIZE
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, padded - blocks)])
    values = values.reshape(*values.shape[:-1], -1, ABSMAX_BLOCK_SIZE)
    values = values * tensor.absmax_scale[..., None]
    values = values.reshape(*values.shape[:-2], padded)[..., :blocks]
    return values + tensor.absmax_offset[..., None]


def dequantize_nf4(tensor: NF4Tensor, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Back to a dense array of `stack_shape + shape`: `NF4_CODE[index] * absmax` per block.

    Computed in float32 and cast to `dtype` at the end (the compute dtype of the layer).
    """
    high = tensor.codes >> 4
    low = tensor.codes & 0xF
    indices = jnp.stack([high, low], axis=-1).reshape(*tensor.stack_shape, -1)
    values = jnp.take(jnp.asarray(NF4_CODE), indices.astype(jnp.int32))
    values = values.reshape(*tensor.stack_shape, -1, BLOCK_SIZE)
    values = values * dequantize_absmax(tensor)[..., None]
    return values.reshape(*tensor.stack_shape, *tensor.shape).astype(dtype)


def take_rows_nf4(tensor: NF4Tensor, row_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `row_ids` of a 2-D NF4 matrix [V, D] (D a multiple of 64), dequantized.

    An embedding lookup from a quantized table: only the gathered rows are ever dense.
    """
    rows, width = tensor.shape
    codes = tensor.codes.reshape(rows, width // 2)[row_ids]  # [..., D/2]
    absmax = dequantize_absmax(tensor).reshape(rows, width // BLOCK_SIZE)[row_ids]
    indices = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], width)
    values = jnp.take(jnp.asarray(NF4_CODE), indices.astype(jnp.int32))
    values = values.reshape(*codes.shape[:-1], width // BLOCK_SIZE, BLOCK_SIZE)
    values = values * absmax[..., None]
    return values.reshape(*codes.shape[:-1], width).astype(dtype)
