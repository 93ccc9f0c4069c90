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
is quantized on its own, so slicing a stack is slicing every field. A tensor whose size is not a
multiple of 64 is refused (`QuantizationError` naming it) rather than padded.

Parity with bitsandbytes 0.50 (`quantize_4bit(w, blocksize=64, quant_type="nf4",
compress_statistics=True)` on CPU, tests/quant/test_nf4.py): the 4-bit codes, the 8-bit absmax codes
and their scales are bit-identical, and each library's dequantization of either library's state
agrees to float32 rounding (about 1e-7 of the block's absmax: XLA may fuse the absmax's
multiply-add into one fma) -- with one exception. The offset is a float32 mean whose rounding depends on the order of
summation, which differs between torch and XLA (and within torch with its vector width and
threads), so the offsets can differ by a few ulps; a centered absmax lying within that shift of an
8-bit rounding threshold then lands on the neighbouring code (measured: 1 block of 5184 in
SmolLM2's layer-0 q projection, 1 of 13824 in a random 1536x576 tensor, none in the other tensors
tried). Given the same offset, everything matches bit for bit.
"""

from __future__ import annotations

import dataclasses
import functools
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


def _blockwise_absmax_scale(flat: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-block absmax [..., n/64] and values scaled into [-1, 1] [..., n/64, 64].

    Multiplies by the reciprocal of the absmax, as bitsandbytes does, so the scaled values (and
    with them the 4-bit codes) are bit-identical to its own. A block of zeros scales to zeros.
    """
    blocks = flat.reshape(*flat.shape[:-1], -1, BLOCK_SIZE)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    reciprocal = jnp.where(absmax > 0, 1.0 / absmax, 0.0)
    scaled = jnp.clip(blocks * reciprocal[..., None], -1, 1)
    return absmax, scaled


def _nearest_code(scaled: jax.Array, code: np.ndarray) -> jax.Array:
    """Index of the nearest code value; a value exactly between two codes takes the lower.

    Counts the midpoints below each value: one fused elementwise pass for a 16-value code.
    """
    midpoints = (code[:-1] + code[1:]) / np.float32(2.0)
    return sum((scaled > midpoint).astype(jnp.uint8) for midpoint in midpoints)


# bitsandbytes' CPU kernel for 8-bit blockwise quantization (csrc/cpu_ops.cpp, quantize_cpu_impl,
# in 0.50) does not search the code: it rounds each normalized value v onto a grid of
# DYNAMIC_GRID_SIZE points, bin = trunc(fma((1 + v) * 0.5, 65535, 0.5)) in float32, and reads the
# code index from a table holding, for each grid point -1 + 2i/65535, the nearest code (the number
# of code midpoints below it). Near a midpoint this can pick the farther code (by up to half a grid
# step), and the seven codes nearest zero are never chosen. Since that composition is a monotone
# step function of v, it is exactly a search among 255 thresholds: the smallest float32 v that
# reaches each code. They are computed once here, on the host, with the kernel's float32
# arithmetic (the fma is exact in float64, then rounded once to float32).
DYNAMIC_GRID_SIZE = 65536


def _grid_bin(normed: np.ndarray) -> np.ndarray:
    """The grid point bitsandbytes' kernel rounds each float32 `normed` value to."""
    half = (np.float32(1) + np.clip(normed, np.float32(-1), np.float32(1))) * np.float32(0.5)
    fused = (half.astype(np.float64) * (DYNAMIC_GRID_SIZE - 1) + 0.5).astype(np.float32)
    return np.trunc(fused).astype(np.int64)


def _float32_order(values: np.ndarray) -> np.ndarray:
    """float32 -> int64 preserving order (so a bisection can step through every float32)."""
    bits = values.astype(np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _float32_from_order(order: np.ndarray) -> np.ndarray:
    return np.where(order < 0, (-order) | 0x80000000, order).astype(np.uint32).view(np.float32)


def _grid_thresholds(code: np.ndarray) -> np.ndarray:
    """float32 [255]: entry j-1 is the smallest normalized value the kernel maps to code >= j."""
    midpoints = (code[:-1] + code[1:]) * np.float32(0.5)
    grid = np.arange(DYNAMIC_GRID_SIZE, dtype=np.float32) * np.float32(2)
    grid = grid / np.float32(DYNAMIC_GRID_SIZE - 1) - np.float32(1)
    table = np.searchsorted(midpoints, grid, side="left")
    first_bin = np.searchsorted(table, np.arange(1, len(code)), side="left")
    low = np.full(first_bin.shape, _float32_order(np.float32(-1)))
    high = np.full(first_bin.shape, _float32_order(np.float32(1)) + 1)
    while np.any(low < high):
        middle = (low + high) // 2
        reaches = _grid_bin(_float32_from_order(middle)) >= first_bin
        high = np.where(reaches, middle, high)
        low = np.where(reaches, low, middle + 1)
    return np.where(first_bin < DYNAMIC_GRID_SIZE, _float32_from_order(low), np.inf)


DYNAMIC_THRESHOLDS = _grid_thresholds(DYNAMIC_CODE)


def quantize_dynamic(values: jax.Array) -> tuple[jax.Array, jax.Array]:
    """8-bit dynamic-map quantization of the last axis in blocks of 256, as bitsandbytes' CPU
    kernel: codes uint8 [..., n] and each block's absmax, float32 [..., ceil(n/256)].

    A block of zeros gets absmax 0 and code 0 (which dequantizes to 0).
    """
    count = values.shape[-1]
    padded = -(-count // ABSMAX_BLOCK_SIZE) * ABSMAX_BLOCK_SIZE
    pad = [(0, 0)] * (values.ndim - 1) + [(0, padded - count)]
    grouped = jnp.pad(values, pad).reshape(*values.shape[:-1], -1, ABSMAX_BLOCK_SIZE)
    scale = jnp.max(jnp.abs(grouped), axis=-1)
    normed = grouped * (1.0 / scale)[..., None]
    codes = jnp.searchsorted(jnp.asarray(DYNAMIC_THRESHOLDS), normed, side="right")
    codes = jnp.where(scale[..., None] > 0, codes, 0).astype(jnp.uint8)
    return codes.reshape(*values.shape[:-1], padded)[..., :count], scale


def dequantize_dynamic(codes: jax.Array, scale: jax.Array) -> jax.Array:
    """Inverse of `quantize_dynamic`: float32 `DYNAMIC_CODE[codes] * scale` per block of 256."""
    count = codes.shape[-1]
    padded = scale.shape[-1] * ABSMAX_BLOCK_SIZE
    values = jnp.take(jnp.asarray(DYNAMIC_CODE), codes.astype(jnp.int32))
    values = jnp.pad(values, [(0, 0)] * (values.ndim - 1) + [(0, padded - count)])
    values = values.reshape(*values.shape[:-1], -1, ABSMAX_BLOCK_SIZE) * scale[..., None]
    return values.reshape(*values.shape[:-2], padded)[..., :count]


def _quantize_flat(
    flat: jax.Array, block_count: jax.Array, double_quant: bool
) -> tuple[jax.Array, ...]:
    """NF4-quantize the last axis of a float32 array whose length is a multiple of 64.

    `block_count` (n/64 as a float32 array) divides the absmax sum at run time: a compile-time
    divisor would let XLA multiply by its rounded reciprocal instead, and fuse that product into
    the centering as an fma, so the offset subtracted would not be the offset stored.
    """
    absmax, scaled = _blockwise_absmax_scale(flat)
    indices = _nearest_code(scaled, NF4_CODE).reshape(flat.shape)
    codes = (indices[..., 0::2] << 4) | indices[..., 1::2]
    if not double_quant:
        return codes, absmax, None, None
    offset = jnp.sum(absmax, axis=-1) / block_count
    absmax_codes, absmax_scale = quantize_dynamic(absmax - offset[..., None])
    return codes, absmax_codes, absmax_scale, offset


def quantize_nf4(
    weight: jax.Array | np.ndarray,
    double_quant: bool = True,
    stack_axes: int = 0,
    name: str = "weight",
) -> NF4Tensor:
    """Quantize `weight` to NF4; the first `stack_axes` axes are a stack of separate tensors.

    Each tensor of a stack goes through the same compiled function on its own, so a stack's
    fields are bit for bit the stacked fields of its tensors quantized one by one (a batched
    reduction could sum the absmax in another order), and a host stack goes to the device one
    float32 tensor at a time.
    Raises `QuantizationError` when a tensor's size is not a multiple of the block size (64).
    """
    weight = weight if isinstance(weight, jax.Array) else np.asarray(weight)
    stack_shape = tuple(weight.shape[:stack_axes])
    shape = tuple(weight.shape[stack_axes:])
    num_values = math.prod(shape)
    if num_values % BLOCK_SIZE:
        raise QuantizationError(
            f"cannot NF4-quantize {name} of shape {shape}: its {num_values} values are not a "
            f"multiple of the block size {BLOCK_SIZE}; keep this tensor in bf16 or pad the model"
        )
    block_count = jnp.float32(num_values // BLOCK_SIZE)
    tensors = weight.reshape(-1, num_values)
    parts = [
        _quantize_flat_jit(jnp.asarray(tensor, jnp.float32), block_count, double_quant)
        for tensor in tensors
    ]
    if not stack_shape:
        return NF4Tensor(*parts[0], shape)
    fields = [
        None if field[0] is None else jnp.stack(field).reshape(*stack_shape, *field[0].shape)
        for field in zip(*parts)
    ]
    return NF4Tensor(*fields, shape)


_quantize_flat_jit = jax.jit(_quantize_flat, static_argnums=2)


def dequantize_absmax(tensor: NF4Tensor) -> jax.Array:
    """The float32 per-block absmax [..., n/64], undoing the double quantization."""
    if not tensor.double_quantized:
        return tensor.absmax
    values = dequantize_dynamic(tensor.absmax, tensor.absmax_scale)
    return values + tensor.absmax_offset[..., None]


@functools.partial(jax.jit, static_argnames="dtype")
def dequantize_nf4(tensor: NF4Tensor, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """Back to a dense array of `stack_shape + shape`: `NF4_CODE[index] * absmax` per block.

    Computed in float32 and cast to `dtype` at the end (the compute dtype of the layer).
    """
    with jax.named_scope("nf4_dequantize"):
        high = tensor.codes >> 4
        low = tensor.codes & 0xF
        indices = jnp.stack([high, low], axis=-1).reshape(*tensor.stack_shape, -1)
        values = jnp.take(jnp.asarray(NF4_CODE), indices.astype(jnp.int32))
        values = values.reshape(*tensor.stack_shape, -1, BLOCK_SIZE)
        values = values * dequantize_absmax(tensor)[..., None]
        return values.reshape(*tensor.stack_shape, *tensor.shape).astype(dtype)


def take_rows_nf4(tensor: NF4Tensor, row_ids: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Rows `row_ids` of a 2-D NF4 matrix [V, D] (D a multiple of 64), dequantized.

    An embedding lookup from a quantized table: only the gathered rows (and their absmax) are
    ever dense.
    """
    rows, width = tensor.shape
    per_row = width // BLOCK_SIZE
    codes = tensor.codes.reshape(rows, width // 2)[row_ids]  # [..., D/2]
    block_ids = row_ids[..., None] * per_row + jnp.arange(per_row)  # [..., D/64]
    absmax = tensor.absmax[block_ids]
    if tensor.double_quantized:
        scale = tensor.absmax_scale[block_ids // ABSMAX_BLOCK_SIZE]
        absmax = jnp.take(jnp.asarray(DYNAMIC_CODE), absmax.astype(jnp.int32)) * scale
        absmax = absmax + tensor.absmax_offset
    indices = jnp.stack([codes >> 4, codes & 0xF], axis=-1).reshape(*codes.shape[:-1], width)
    values = jnp.take(jnp.asarray(NF4_CODE), indices.astype(jnp.int32))
    values = values.reshape(*codes.shape[:-1], per_row, BLOCK_SIZE) * absmax[..., None]
    return values.reshape(*codes.shape[:-1], width).astype(dtype)


def abstract_nf4(
    shape: tuple[int, ...], stack_shape: tuple[int, ...] = (), double_quant: bool = True
) -> NF4Tensor:
    """An `NF4Tensor` of `jax.ShapeDtypeStruct`s: plan and compile QLoRA without any weights."""
    num_values = math.prod(shape)
    blocks = num_values // BLOCK_SIZE
    sds = jax.ShapeDtypeStruct
    if not double_quant:
        return NF4Tensor(
            sds((*stack_shape, num_values // 2), jnp.uint8),
            sds((*stack_shape, blocks), jnp.float32),
            None,
            None,
            shape,
        )
    return NF4Tensor(
        sds((*stack_shape, num_values // 2), jnp.uint8),
        sds((*stack_shape, blocks), jnp.uint8),
        sds((*stack_shape, -(-blocks // ABSMAX_BLOCK_SIZE)), jnp.float32),
        sds(stack_shape, jnp.float32),
        shape,
    )
