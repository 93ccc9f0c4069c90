"""Block-wise 8-bit quantization: the maps against bitsandbytes, nearest-code rounding, round trips."""

import bitsandbytes.functional as bnbf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from featherweight.optim.blockwise8bit import (
    SIGNED_MAP,
    UNSIGNED_MAP,
    dequantize_blockwise,
    nearest_code,
    quantize_blockwise,
    unsigned_dynamic_code,
    zero_moment,
)

MAPS = {"signed": SIGNED_MAP, "unsigned": UNSIGNED_MAP}


def test_unsigned_map_is_bitsandbytes_create_dynamic_map_unsigned():
    expected = bnbf.create_dynamic_map(signed=False).numpy()
    np.testing.assert_array_equal(unsigned_dynamic_code(), expected)
    np.testing.assert_array_equal(UNSIGNED_MAP.values, expected)
    assert UNSIGNED_MAP.values[0] == 0.0 and UNSIGNED_MAP.values[-1] == 1.0


def _critical_values(dynamic_map, rng):
    """Random values over [-1, 1] (or [0, 1]) at every magnitude from 1e-9 up, and every map value
    and midpoint with its float32 neighbours (where the rounding decides)."""
    values = dynamic_map.values
    midpoints = dynamic_map.midpoints[:-1]
    magnitudes = (10.0 ** rng.uniform(-9, 0, 200_000)).astype(np.float32)
    signs = rng.choice([-1.0, 1.0], magnitudes.size) if values[0] < 0 else 1.0
    edges = np.concatenate([midpoints, values])
    edges = np.concatenate(
        [edges, np.nextafter(edges, np.float32(2)), np.nextafter(edges, np.float32(-2))]
    )
    low = -1.0 if values[0] < 0 else 0.0
    special = [0.0, -0.0, 1.0, 1e-30, 3e-8, 1.0000001] + ([-1.0, -1e-30] if low else [])
    return np.concatenate(
        [
            (signs * magnitudes).astype(np.float32),
            rng.uniform(low, 1.0, 200_000).astype(np.float32),
            np.clip(edges, low, 1.0000001).astype(np.float32),
            np.float32(special),
        ]
    )


@pytest.mark.parametrize("name", MAPS)
def test_nearest_code_is_the_nearest_map_value_ties_to_the_lower(name):
    dynamic_map = MAPS[name]
    x = _critical_values(dynamic_map, np.random.default_rng(0))
    got = np.asarray(jax.jit(lambda v: nearest_code(v, dynamic_map))(jnp.asarray(x)))
    # the definition: the number of midpoints strictly below the value
    np.testing.assert_array_equal(got, np.searchsorted(dynamic_map.midpoints[:-1], x, "left"))
    # and that is the nearest value: no map value is closer (checked on a subset, brute force)
    sub = x[::97].astype(np.float64)
    distances = np.abs(sub[:, None] - dynamic_map.values[None, :].astype(np.float64))
    chosen = distances[np.arange(sub.size), got[::97]]
    assert np.all(chosen <= distances.min(axis=1) + 1e-7)


def _blocks_of_every_scale(shape, signed, seed=0):
    """Values spanning seven decades within each block, with one block of zeros."""
    rng = np.random.default_rng(seed)
    values = (10.0 ** rng.uniform(-7, 0, shape)) * rng.uniform(0.5, 2.0, shape)
    if signed:
        values *= rng.choice([-1.0, 1.0], shape)
    flat = values.reshape(-1)
    flat[256:512] = 0.0
    return jnp.asarray(values, jnp.float32)


@pytest.mark.parametrize(
    ("name", "max_error", "max_relative_error"),
    [("signed", 0.007032, 0.062), ("unsigned", 0.003516, 0.033)],
)
def test_round_trip_error_bounds(name, max_error, max_relative_error):
    """Error <= half the largest gap of the map times the block absmax (signed 0.70%, unsigned
    0.35%: the unsigned map is twice as fine); within a decade of the absmax, <= 6.2% / 3.3% of
    the value; positive block maxima and zeros come back exactly, signs are kept. Odd shape:
    flattened, last block padded."""
    dynamic_map = MAPS[name]
    assert np.max(np.diff(dynamic_map.values)) / 2 <= max_error
    shape = (7, 13, 37)  # 3367 values: 13 full blocks and a padded one
    values = _blocks_of_every_scale(shape, signed=name == "signed")
    moment = jax.jit(lambda v: quantize_blockwise(v, dynamic_map, 256))(values)
    assert moment.codes.shape == shape and moment.codes.dtype == jnp.uint8
    assert moment.absmax.shape == (14,) and moment.absmax.dtype == jnp.float32
    restored = np.asarray(dequantize_blockwise(moment, dynamic_map, 256)).reshape(-1)
    flat = np.asarray(values).reshape(-1)
    block_max = np.abs(np.pad(flat, (0, 14 * 256 - flat.size))).reshape(14, 256).max(axis=1)
    np.testing.assert_array_equal(moment.absmax, block_max)
    absmax = np.repeat(block_max, 256)[: flat.size]
    error = np.abs(restored - flat)
    assert np.all(error <= max_error * absmax * (1 + 1e-5))
    top_decade = np.abs(flat) >= 0.1 * absmax
    assert np.all(error[top_decade] <= max_relative_error * np.abs(flat[top_decade]))
    is_max = flat == absmax  # positive maxima only: the signed map holds 1 but not -1
    np.testing.assert_array_equal(restored[is_max], flat[is_max])
    np.testing.assert_array_equal(restored[flat == 0], 0.0)
    assert np.sign(restored[restored != 0]).tolist() == np.sign(flat[restored != 0]).tolist()


@pytest.mark.parametrize("name", MAPS)
def test_zero_moment_is_the_quantized_zeros(name):
    dynamic_map = MAPS[name]
    shape = (3, 300)
    expected = quantize_blockwise(jnp.zeros(shape), dynamic_map, 256)
    got = zero_moment(shape, dynamic_map, 256)
    np.testing.assert_array_equal(got.codes, expected.codes)
    np.testing.assert_array_equal(got.absmax, expected.absmax)
    np.testing.assert_array_equal(dequantize_blockwise(got, dynamic_map, 256), np.zeros(shape))
