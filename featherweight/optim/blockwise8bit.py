"""Block-wise 8-bit quantization with dynamic maps: how the 8-bit optimizer stores its moments.

A tensor's values, flattened and cut into blocks of `block_size` (the last block zero-padded), are
divided by their block's absmax and replaced by the index of the nearest value of a 256-entry map
(Dettmers et al., "8-bit Optimizers via Block-wise Quantization", 2022). The dynamic maps spend
their codes evenly over seven decades (10^-7 .. 1 of the absmax) rather than evenly over [-1, 1],
so small moment values keep a few significant bits:

- `SIGNED_MAP`: bitsandbytes' `create_dynamic_map(signed=True)` (`DYNAMIC_CODE`, shared with NF4's
  double quantization), for the first moment;
- `UNSIGNED_MAP`: `create_dynamic_map(signed=False)`, for the second moment (never negative): the
  sign bit becomes one more fraction bit, twice as fine.

Rounding is to the nearest map value, as in bitsandbytes' 8-bit optimizer kernels; a value
halfway between two takes the lower (the first index of `argmin`, as in their PyTorch reference
implementation). bitsandbytes' CPU `quantize_blockwise` rounds through a grid instead; NF4's
double-quantized absmax follows that one (featherweight/quant/nf4.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.quant.nf4 import DYNAMIC_CODE


def _torch_linspace_float32(start: float, stop: float, steps: int) -> np.ndarray:
    """`torch.linspace(start, stop, steps, dtype=torch.float32)` bit for bit: its CPU kernel
    computes `start + step * i` for the first half and `stop - step * (steps - 1 - i)` for the
    second, each with a single rounding (a fused multiply-add; exact in float64 before the cast)."""
    start32, stop32 = np.float32(start), np.float32(stop)
    step = (stop32 - start32) / np.float32(steps - 1)
    index = np.arange(steps, dtype=np.float64)
    fused = np.where(
        index < steps // 2,
        np.float64(start32) + np.float64(step) * index,
        np.float64(stop32) - np.float64(step) * (steps - 1 - index),
    )
    return fused.astype(np.float32)


def unsigned_dynamic_code(exponent_bits: int = 7) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed=False)` with its float32 rounding: for each decade
    10^(i-6), i = 0..6, the midpoints of 2^(i+1) equal steps from 0.1 to 1, times 10^(i-6); plus
    0 and 1, sorted. 256 values: fine near zero, coarse near one."""
    values = [np.float32(0.0), np.float32(1.0)]
    for i in range(exponent_bits):
        boundaries = _torch_linspace_float32(0.1, 1.0, 2 ** (i + 1) + 1)
        midpoints = (boundaries[:-1] + boundaries[1:]) / np.float32(2.0)
        values.extend(np.float32(10.0 ** (i - exponent_bits + 1)) * midpoints)
    return np.sort(np.array(values, dtype=np.float32))


# The nearest-code search is a table lookup. A normalized value's float32 bits, shifted right by
# CELL_SHIFT, name its cell: 2^9 equal cells per binade of |x| in [2^-25, 1], for each sign (|x|
# below 2^-25 joins the first cell, which then starts at 0; the smallest midpoint is 1.6e-7). No
# cell holds two midpoints (neighbouring midpoints are at least 0.5% apart, a cell spans at most
# 2^-9 = 0.2%; `_lookup_tables` checks it), so the count of midpoints below a value is the count
# below its cell (one lookup) plus one comparison with the next midpoint (a second lookup) -- where
# a binary search over 255 midpoints takes eight, ten times slower on CPU.
CELL_SHIFT = 23 - 9
SMALLEST_CELL = np.float32(2.0**-25)
FIRST_CELL = int(SMALLEST_CELL.view(np.int32)) >> CELL_SHIFT


class DynamicMap(NamedTuple):
    """An 8-bit map and its lookup tables (numpy constants, built once at import).

    values: float32 [256], sorted. midpoints: float32 [256], the 255 midpoints between neighbouring
    values, then +inf. cells: uint8 [2 * cells]; first, for each magnitude cell [low, high) of
    non-negative values, the number of midpoints below low; then, for the same cells of negative
    values (-high, -low], the number of midpoints at or below -high.
    """

    values: np.ndarray
    midpoints: np.ndarray
    cells: np.ndarray


def _lookup_tables(values: np.ndarray) -> DynamicMap:
    midpoints = (values[:-1] + values[1:]) / np.float32(2.0)
    cells = np.arange(FIRST_CELL, (int(np.float32(1.0).view(np.int32)) >> CELL_SHIFT) + 1)
    low = (cells << CELL_SHIFT).astype(np.int32).view(np.float32).copy()
    low[0] = 0.0
    high = ((cells + 1) << CELL_SHIFT).astype(np.int32).view(np.float32)
    positive = np.searchsorted(midpoints, low, side="left")
    negative = np.searchsorted(midpoints, -high, side="right")
    most_per_cell = max(
        np.max(np.searchsorted(midpoints, high, side="left") - positive),
        np.max(np.searchsorted(midpoints, -low, side="right") - negative),
    )
    if most_per_cell > 1:
        raise ValueError("a lookup cell holds two midpoints of the map: make CELL_SHIFT smaller")
    return DynamicMap(
        values=values,
        midpoints=np.append(midpoints, np.float32(np.inf)),
        cells=np.concatenate([positive, negative]).astype(np.uint8),
    )


SIGNED_MAP = _lookup_tables(DYNAMIC_CODE)
UNSIGNED_MAP = _lookup_tables(unsigned_dynamic_code())


class QuantizedMoment(NamedTuple):
    """A tensor in 8 bits. codes: uint8, the tensor's shape (indices into the map); absmax:
    float32 [ceil(size / block_size)], each block's largest magnitude."""

    codes: jax.Array
    absmax: jax.Array


def _lookup(table: np.ndarray, indices: jax.Array) -> jax.Array:
    """`table[indices]` for indices known to be in range: no wrap-around or bounds handling."""
    return jnp.asarray(table).at[indices].get(mode="promise_in_bounds")


def nearest_code(normed: jax.Array, dynamic_map: DynamicMap) -> jax.Array:
    """int32 index of the map value nearest to each value in [-1, 1] (the number of midpoints
    below it: a value halfway between two map values takes the lower)."""
    magnitude = jnp.clip(jnp.abs(normed), SMALLEST_CELL, 1.0)
    cell = (jax.lax.bitcast_convert_type(magnitude, jnp.int32) >> CELL_SHIFT) - FIRST_CELL
    cell = cell + jnp.where(normed < 0, dynamic_map.cells.size // 2, 0)
    below = _lookup(dynamic_map.cells, cell).astype(jnp.int32)
    return below + (_lookup(dynamic_map.midpoints, below) < normed)


def quantize_blockwise(
    values: jax.Array, dynamic_map: DynamicMap, block_size: int
) -> QuantizedMoment:
    """`values` (any shape) in 8 bits, blocks of `block_size` of its flattened values. Each block
    is scaled by the reciprocal of its absmax (as bitsandbytes' kernels); a block of zeros gets
    absmax 0 and dequantizes to zeros."""
    flat = values.reshape(-1).astype(jnp.float32)
    blocks = -(-flat.size // block_size)
    grouped = jnp.pad(flat, (0, blocks * block_size - flat.size)).reshape(blocks, block_size)
    absmax = jnp.max(jnp.abs(grouped), axis=1)
    reciprocal = jnp.where(absmax > 0, 1.0 / absmax, 0.0)
    codes = nearest_code(grouped * reciprocal[:, None], dynamic_map).astype(jnp.uint8)
    return QuantizedMoment(codes.reshape(-1)[: flat.size].reshape(values.shape), absmax)


def dequantize_blockwise(
    moment: QuantizedMoment, dynamic_map: DynamicMap, block_size: int
) -> jax.Array:
    """float32 values of `moment`'s shape: `values[codes] * absmax` per block."""
    size = moment.codes.size
    values = _lookup(dynamic_map.values, moment.codes.reshape(-1).astype(jnp.int32))
    grouped = jnp.pad(values, (0, moment.absmax.size * block_size - size))
    grouped = grouped.reshape(-1, block_size) * moment.absmax[:, None]
    return grouped.reshape(-1)[:size].reshape(moment.codes.shape)


def zero_moment(shape: tuple[int, ...], dynamic_map: DynamicMap, block_size: int):
    """The quantized zeros of `shape`, built directly (no float32 tensor of that size)."""
    size = int(np.prod(shape))
    zero_index = int(np.flatnonzero(dynamic_map.values == 0)[0])
    return QuantizedMoment(
        jnp.full(shape, zero_index, jnp.uint8),
        jnp.zeros((-(-size // block_size),), jnp.float32),
    )
