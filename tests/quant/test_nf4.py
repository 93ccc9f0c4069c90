"""NF4 against bitsandbytes 0.50 on CPU (the reference QLoRA implementation), on random tensors and
real SmolLM2-135M weights: codes, double quantization, dequantization, storage, stacks, row gathers
and refused shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
bnbf = pytest.importorskip("bitsandbytes.functional")

from featherweight.errors import QuantizationError  # noqa: E402
from featherweight.io.gguf_reader import GGUFSource  # noqa: E402
from featherweight.quant.nf4 import (  # noqa: E402
    ABSMAX_BLOCK_SIZE,
    BLOCK_SIZE,
    DYNAMIC_CODE,
    DYNAMIC_THRESHOLDS,
    NF4_CODE,
    NF4Tensor,
    dequantize_absmax,
    dequantize_nf4,
    nf4_nbytes,
    quantize_dynamic,
    quantize_nf4,
    take_rows_nf4,
)

REAL_TENSORS = (("q", 0), ("k", 3), ("gate", 10), ("down", 29))
# Block counts (n/64) of 1, 5 and 600 here, 1728, 5184 and 13824 in the real tensors: all but one
# end in a partial block of 256 absmax values.
RANDOM_SHAPES = ((64,), (5, 64), (300, 128))


@pytest.fixture(scope="module")
def real_weights(demo_gguf):
    source = GGUFSource(demo_gguf)
    try:
        return {key: source.read(key).astype(np.float32) for key in REAL_TENSORS}
    finally:
        source.close()


def random_weight(shape, dtype, seed=0):
    weight = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.02
    if weight.size >= 2 * BLOCK_SIZE:
        weight.reshape(-1, BLOCK_SIZE)[1] = 0.0  # a block of zeros
    if dtype == "bfloat16":
        weight = np.asarray(torch.from_numpy(weight).bfloat16().float())  # exactly representable
    return weight


def bnb_quantize(weight: np.ndarray, dtype: str, double_quant: bool):
    """bitsandbytes' NF4 of `weight` (stored as `dtype`): packed codes and its quant state."""
    tensor = torch.from_numpy(weight)
    if dtype == "bfloat16":
        tensor = tensor.bfloat16()
    packed, state = bnbf.quantize_4bit(
        tensor, blocksize=64, quant_type="nf4", compress_statistics=double_quant
    )
    return packed, state


def bnb_dequantize(packed, state, dtype=torch.float32) -> np.ndarray:
    state.dtype = dtype
    return bnbf.dequantize_4bit(packed, state).float().numpy().reshape(state.shape)


def ours_quantize(weight: np.ndarray, dtype: str, double_quant: bool) -> NF4Tensor:
    return quantize_nf4(jnp.asarray(weight, dtype=dtype), double_quant=double_quant)


def state_as_nf4(packed, state, shape) -> NF4Tensor:
    """bitsandbytes' quantization state as an `NF4Tensor` (the layouts are the same)."""
    codes = jnp.asarray(packed.numpy().reshape(-1))
    if state.nested:
        return NF4Tensor(
            codes,
            jnp.asarray(state.absmax.numpy()),
            jnp.asarray(state.state2.absmax.numpy()),
            jnp.asarray(state.offset.numpy()),
            shape,
        )
    return NF4Tensor(codes, jnp.asarray(state.absmax.numpy()), None, None, shape)


def nf4_as_state(tensor: NF4Tensor) -> tuple:
    """Our `NF4Tensor` as bitsandbytes' packed codes and quant state."""
    packed = torch.from_numpy(np.array(tensor.codes)).reshape(-1, 1)
    nf4_code = torch.from_numpy(NF4_CODE)
    if not tensor.double_quantized:
        absmax = torch.from_numpy(np.array(tensor.absmax))
        return packed, bnbf.QuantState(absmax, tensor.shape, nf4_code, 64, "nf4", torch.float32)
    nested = bnbf.QuantState(
        torch.from_numpy(np.array(tensor.absmax_scale)),
        code=torch.from_numpy(DYNAMIC_CODE),
        blocksize=ABSMAX_BLOCK_SIZE,
        dtype=torch.float32,
    )
    state = bnbf.QuantState(
        torch.from_numpy(np.array(tensor.absmax)),
        tensor.shape,
        nf4_code,
        64,
        "nf4",
        torch.float32,
        offset=torch.from_numpy(np.array(tensor.absmax_offset)),
        state2=nested,
    )
    return packed, state


def block_absmax(weight: np.ndarray) -> np.ndarray:
    return np.abs(weight.reshape(-1, BLOCK_SIZE)).max(axis=-1)


def assert_close_per_block(actual, expected, weight, slack=0.0):
    """|actual - expected| <= 1e-6 x the block's absmax (+ slack), in every block of 64."""
    diff = np.abs(np.asarray(actual, np.float32) - expected).reshape(-1, BLOCK_SIZE).max(-1)
    bound = 1e-6 * block_absmax(weight) + slack
    assert np.all(diff <= bound), f"max diff {diff.max():.3g} over {np.sum(diff > bound)} blocks"


def parity_cases():
    for shape in RANDOM_SHAPES:
        for dtype in ("float32", "bfloat16"):
            name = "x".join(map(str, shape))
            yield pytest.param(("random", shape, dtype), id=f"random-{name}-{dtype}")
    for key in REAL_TENSORS:
        yield pytest.param(("real", key, "float32"), id=f"smollm2-{key[0]}{key[1]}")


@pytest.fixture(params=list(parity_cases()))
def case(request, real_weights):
    kind, spec, dtype = request.param
    weight = random_weight(spec, dtype) if kind == "random" else real_weights[spec]
    return weight, dtype


def test_code_tables_match_bitsandbytes():
    assert np.array_equal(NF4_CODE, bnbf.get_4bit_type("nf4", device="cpu").numpy())
    assert np.array_equal(DYNAMIC_CODE, bnbf.create_dynamic_map().numpy())
    assert NF4_CODE.shape == (16,) and NF4_CODE[7] == 0.0 and NF4_CODE[0] == -1.0
    assert np.all(np.diff(NF4_CODE) > 0)


def test_single_quantization_is_identical(case):
    """Without double quantization: same codes, same float32 absmax, same dequantized values."""
    weight, dtype = case
    packed, state = bnb_quantize(weight, dtype, double_quant=False)
    ours = ours_quantize(weight, dtype, double_quant=False)
    assert np.array_equal(np.asarray(ours.codes), packed.numpy().reshape(-1))
    assert np.array_equal(np.asarray(ours.absmax), state.absmax.numpy())
    assert_close_per_block(dequantize_nf4(ours), bnb_dequantize(packed, state), weight)


def test_double_quantization_matches_given_the_offset(case):
    """Same 4-bit codes, and our 8-bit absmax codes and scales are exactly what bitsandbytes makes
    of the same centered absmax (our offset fed to its blockwise quantizer)."""
    weight, dtype = case
    packed, _ = bnb_quantize(weight, dtype, double_quant=True)
    ours = ours_quantize(weight, dtype, double_quant=True)
    assert np.array_equal(np.asarray(ours.codes), packed.numpy().reshape(-1))
    offset = torch.from_numpy(np.array(ours.absmax_offset))
    centered = torch.from_numpy(block_absmax(weight)) - offset
    absmax_codes, nested = bnbf.quantize_blockwise(centered, blocksize=ABSMAX_BLOCK_SIZE)
    assert np.array_equal(np.asarray(ours.absmax), absmax_codes.numpy())
    assert np.array_equal(np.asarray(ours.absmax_scale), nested.absmax.numpy())


def test_dequantization_matches_both_ways(case):
    """Our dequantization of bitsandbytes' state, and its dequantization of ours, agree."""
    weight, dtype = case
    packed, state = bnb_quantize(weight, dtype, double_quant=True)
    expected = bnb_dequantize(packed, state)
    assert_close_per_block(
        dequantize_nf4(state_as_nf4(packed, state, weight.shape)), expected, weight
    )
    ours = ours_quantize(weight, dtype, double_quant=True)
    ours_packed, ours_state = nf4_as_state(ours)
    assert_close_per_block(dequantize_nf4(ours), bnb_dequantize(ours_packed, ours_state), weight)
    if dtype == "bfloat16":  # the compute-dtype output: the same values, rounded to bf16
        got = dequantize_nf4(state_as_nf4(packed, state, weight.shape), jnp.bfloat16)
        expected = bnb_dequantize(packed, state, torch.bfloat16)
        bf16_step = 2.0**-8 * block_absmax(expected)
        assert_close_per_block(got, expected, weight, slack=bf16_step)


def test_quantize_dequantize_matches_bitsandbytes(case):
    """End to end. The only freedom is the float32 rounding of the absmax mean (the offset), whose
    summation order differs between torch and XLA: within 4 ulps. It shifts every dequantized absmax
    by at most twice that (offset and scale), and moves an absmax to the neighbouring 8-bit code
    only in rare blocks."""
    weight, dtype = case
    packed, state = bnb_quantize(weight, dtype, double_quant=True)
    ours = ours_quantize(weight, dtype, double_quant=True)
    offset_gap = abs(float(ours.absmax_offset) - state.offset.item())
    assert offset_gap <= 4 * np.spacing(np.float32(state.offset.item()))
    same_code = np.asarray(ours.absmax) == state.absmax.numpy()
    steps = np.abs(np.asarray(ours.absmax, np.int32) - state.absmax.numpy().astype(np.int32))
    assert np.all(steps[~same_code] == 1)
    assert np.mean(~same_code) <= (0.001 if offset_gap else 0.0)
    diff = np.abs(np.asarray(dequantize_nf4(ours)) - bnb_dequantize(packed, state))
    diff = diff.reshape(-1, BLOCK_SIZE).max(-1)[same_code]
    assert np.all(diff <= 1e-6 * block_absmax(weight)[same_code] + 2 * offset_gap)


def test_dynamic_thresholds_reproduce_the_kernel_at_near_ties():
    """The 8-bit quantizer equals bitsandbytes' CPU kernel exactly where rounding is delicate: at
    every threshold and the float32 just below, at code midpoints and at the kernel's grid points."""
    grid = np.arange(65536, dtype=np.float32) * np.float32(2) / np.float32(65535) - np.float32(1)
    midpoints = (DYNAMIC_CODE[:-1] + DYNAMIC_CODE[1:]) * np.float32(0.5)
    probes = [DYNAMIC_THRESHOLDS, midpoints, grid]
    probes += [np.nextafter(p, np.float32(-2)) for p in probes]
    probes += [np.nextafter(p, np.float32(2)) for p in probes]
    values = np.clip(np.concatenate(probes), -1, 1).astype(np.float32)
    per_block = ABSMAX_BLOCK_SIZE - 1  # the last slot of each block holds 1.0: absmax exactly 1
    blocks = -(-values.size // per_block)
    laid_out = np.zeros((blocks, ABSMAX_BLOCK_SIZE), np.float32)
    laid_out[:, :per_block].reshape(-1)[: values.size] = values
    laid_out[:, -1] = 1.0
    expected, state = bnbf.quantize_blockwise(torch.from_numpy(laid_out.reshape(-1)), blocksize=256)
    codes, scale = quantize_dynamic(jnp.asarray(laid_out.reshape(-1)))
    assert np.all(np.asarray(scale) == 1.0) and np.all(state.absmax.numpy() == 1.0)
    assert np.array_equal(np.asarray(codes), expected.numpy())


def test_storage_of_a_real_layer_is_under_052_bytes_per_weight(real_weights):
    weight = real_weights[("gate", 10)]
    tensor = quantize_nf4(weight)
    assert tensor.nbytes == nf4_nbytes(weight.size)
    assert tensor.nbytes / weight.size <= 0.52
    assert quantize_nf4(weight, double_quant=False).nbytes / weight.size > 0.56


def test_stacked_quantization_equals_per_tensor():
    stack = np.random.default_rng(1).standard_normal((3, 192, 320)).astype(np.float32)
    stacked = quantize_nf4(stack, stack_axes=1)
    assert stacked.stack_shape == (3,) and stacked.shape == (192, 320)
    for index in range(3):
        alone = quantize_nf4(stack[index])
        for got, want in zip(jax.tree.leaves(stacked), jax.tree.leaves(alone)):
            assert np.array_equal(np.asarray(got)[index], np.asarray(want))
    dense = np.asarray(dequantize_nf4(stacked))
    assert np.array_equal(dense[1], np.asarray(dequantize_nf4(quantize_nf4(stack[1]))))


@pytest.mark.parametrize("double_quant", [True, False])
def test_take_rows_equals_dequantize_then_index(double_quant):
    # 300 rows of 2 blocks: rows straddle the blocks of 256 absmax values.
    table = quantize_nf4(random_weight((300, 128), "float32", seed=2), double_quant=double_quant)
    row_ids = jnp.asarray([[0, 127, 128, 299], [5, 5, 200, 64]])
    dense = dequantize_nf4(table, jnp.bfloat16)
    rows = take_rows_nf4(table, row_ids, jnp.bfloat16)
    assert rows.dtype == jnp.bfloat16 and rows.shape == (2, 4, 128)
    assert np.array_equal(np.asarray(rows), np.asarray(dense[row_ids]))


def test_absmax_roundtrip_error_is_small(real_weights):
    weight = real_weights[("down", 29)]
    absmax = np.asarray(dequantize_absmax(quantize_nf4(weight)))
    assert np.max(np.abs(absmax - block_absmax(weight)) / block_absmax(weight)) < 0.05


@pytest.mark.parametrize("shape", [(3, 10), (100,), (2, 2, 40)])
def test_size_not_divisible_by_the_block_is_refused(shape):
    with pytest.raises(QuantizationError, match=r"layer 3 q .*not a multiple of the block size 64"):
        quantize_nf4(np.ones(shape, np.float32), name="layer 3 q")
