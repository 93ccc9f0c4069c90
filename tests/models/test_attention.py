"""Blockwise attention equals the materialized attention, keeps no S x S array, skips the tiles
above the diagonal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from featherweight.models.attention import ScoreForm, attend, blockwise_attention

# batch, seq, heads, kv heads, head dim, block, packed
CASES = [
    pytest.param(2, 64, 4, 4, 16, 16, False, id="mha-divides"),
    pytest.param(2, 37, 4, 2, 16, 8, False, id="gqa-odd-length"),
    pytest.param(2, 37, 6, 2, 8, 8, True, id="gqa-packed-odd-length"),
    pytest.param(1, 50, 4, 1, 16, 16, True, id="mqa-packed"),
    pytest.param(3, 1, 4, 2, 8, 16, False, id="one-token"),
    pytest.param(2, 1, 4, 2, 8, 16, True, id="one-token-packed"),
    pytest.param(1, 20, 2, 1, 8, 64, True, id="block-longer-than-sequence"),
]


def _inputs(batch, seq, heads, kv_heads, head_dim, packed, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v = (
        jnp.asarray(rng.standard_normal((batch, seq, n, head_dim)), dtype)
        for n in (heads, kv_heads, kv_heads)
    )
    # packed rows: sorted segment ids 0..3 (as data/packing.py numbers them, 0 = padding)
    segments = jnp.asarray(np.sort(rng.integers(0, 4, (batch, seq)), axis=1)) if packed else None
    weights = jnp.asarray(rng.standard_normal((batch, seq, heads, head_dim)), jnp.float32)
    return q, k, v, segments, weights


def _grads(attention, q, k, v, segments, weights):
    """Gradients of sum(attention * weights) with respect to q, k, v (jitted: one compile)."""

    def loss(q, k, v, segments, weights):
        return jnp.sum(attention(q, k, v, segments).astype(jnp.float32) * weights)

    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v, segments, weights)


def _blockwise(block):
    return lambda q, k, v, segments: blockwise_attention(q, k, v, segments, block)


def _materialized(q, k, v, segments):
    return attend(q, k, v, segments, "materialized")


def _forward(attention, q, k, v, segments):
    return jax.jit(attention)(q, k, v, segments)


@pytest.mark.parametrize("batch,seq,heads,kv_heads,head_dim,block,packed", CASES)
def test_float32_forward_and_gradients_equal_the_materialized_attention(
    batch, seq, heads, kv_heads, head_dim, block, packed
):
    q, k, v, segments, weights = _inputs(batch, seq, heads, kv_heads, head_dim, packed)
    out = _forward(_blockwise(block), q, k, v, segments)
    expected_out = _forward(_materialized, q, k, v, segments)
    np.testing.assert_allclose(out, expected_out, atol=1e-5, rtol=1e-5)
    grads = _grads(_blockwise(block), q, k, v, segments, weights)
    expected = _grads(_materialized, q, k, v, segments, weights)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_bfloat16_is_within_the_noise_of_the_materialized_bfloat16_path(packed):
    q, k, v, segments, weights = _inputs(2, 96, 8, 2, 32, packed, jnp.bfloat16)
    # the exact answer: float32 arithmetic on the same bf16-rounded inputs
    as32 = [jnp.asarray(np.asarray(x, np.float32)) for x in (q, k, v)]
    exact = _forward(_materialized, *as32, segments)
    exact_grads = _grads(_materialized, *as32, segments, weights)
    fused = _forward(_blockwise(32), q, k, v, segments)
    plain = _forward(_materialized, q, k, v, segments)
    fused_grads = _grads(_blockwise(32), q, k, v, segments, weights)
    plain_grads = _grads(_materialized, q, k, v, segments, weights)

    def error(x, ref):  # root-mean-square error against the float32 answer
        return float(jnp.sqrt(jnp.mean((x.astype(jnp.float32) - ref) ** 2)))

    # the bf16 path's own rounding sets the noise: blockwise may be at most 1.5 times as far off
    assert fused.dtype == jnp.bfloat16
    assert error(fused, exact) <= 1.5 * error(plain, exact)
    for got, base, ref in zip(fused_grads, plain_grads, exact_grads):
        assert got.dtype == jnp.bfloat16
        assert error(got, ref) <= 1.5 * error(base, ref)


def test_packed_rows_never_attend_across_documents():
    # the second document's output must not change when the first document's keys/values do
    q, k, v, _, _ = _inputs(1, 24, 2, 1, 8, False)
    segments = jnp.asarray([[1] * 10 + [2] * 14])
    out = _forward(_blockwise(8), q, k, v, segments)
    first = (np.arange(24) < 10)[None, :, None, None]
    changed = _forward(_blockwise(8), q, k + 3.0 * first, v + 5.0 * first, segments)
    np.testing.assert_array_equal(out[:, 10:], changed[:, 10:])
    assert not np.allclose(out[:, :10], changed[:, :10])


def test_tiles_above_the_diagonal_are_skipped_not_masked():
    # a NaN in the last key block's values reaches a query block only if that tile is computed:
    # masking multiplies it by a zero probability (NaN), skipping never reads it
    q, k, v, _, weights = _inputs(1, 64, 2, 1, 8, False)
    poisoned = jnp.asarray(np.where(np.arange(64)[None, :, None, None] >= 48, np.nan, v))
    out = _forward(_blockwise(16), q, k, poisoned, None)
    assert bool(jnp.isfinite(out[:, :48]).all()) and not bool(jnp.isfinite(out[:, 48:]).any())
    d_q = _grads(_blockwise(16), q, k, poisoned, None, weights)[0]
    assert bool(jnp.isfinite(d_q[:, :48]).all())
    # negative control: the materialized path computes every tile and masks it
    assert not bool(jnp.isfinite(_forward(_materialized, q, k, poisoned, None)[:, :48]).all())


def _tile_ops(jaxpr, tile: int) -> dict[str, int]:
    """How many exp and dot_general equations of `jaxpr` (nested ones included) make a tile: an
    output with two axes of `tile` (queries and keys, in any order)."""
    counts = {"exp": 0, "dot_general": 0}
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in counts and eqn.outvars[0].aval.shape.count(tile) == 2:
            counts[eqn.primitive.name] += 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            for name, count in _tile_ops(sub, tile).items():
                counts[name] += count
    return counts


def _tile_op_counts(seq, block, packed):
    q, k, v, segments, weights = _inputs(1, seq, 4, 2, 8, packed)

    def vjp(q, k, v, weights):
        out, pull = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, segments, block), q, k, v)
        return pull(weights.astype(out.dtype))

    return _tile_ops(jax.make_jaxpr(vjp)(q, k, v, weights).jaxpr, block)


@pytest.mark.parametrize("packed", [False, True])
def test_the_backward_recomputes_a_tiles_probabilities_once(packed):
    # tiles in loops (S > block; each loop body is counted once): the forward makes a tile's
    # scores and probabilities once, the backward its scores, probabilities and dP once (one
    # pass: dQ, dK, dV from the same tile); a two-pass backward makes each twice (5, 3)
    assert _tile_op_counts(64, 32, packed) == {"exp": 2, "dot_general": 3}


def _tile_transposes(jaxpr, tile: int) -> int:
    """How many transpose equations of `jaxpr` (nested ones included) move a whole tile."""
    count = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose" and eqn.outvars[0].aval.shape.count(tile) == 2:
            count += 1
        for sub in jax.core.jaxprs_in_params(eqn.params):
            count += _tile_transposes(sub, tile)
    return count


def _vjp_jaxpr(seq, block, packed):
    q, k, v, segments, weights = _inputs(2, seq, 6, 2, 8, packed)

    def vjp(q, k, v, weights):
        out, pull = jax.vjp(lambda q, k, v: blockwise_attention(q, k, v, segments, block), q, k, v)
        return pull(weights.astype(out.dtype))

    return jax.make_jaxpr(vjp)(q, k, v, weights).jaxpr


@pytest.mark.parametrize("packed", [False, True])
def test_a_lone_tile_computes_head_major_without_moving_the_tile(packed):
    # a lone tile (S <= block) is the whole score matrix: its products are batched over (B, K)
    # with the tile's axes last, so neither direction transposes it; the same count as the loops
    assert _tile_transposes(_vjp_jaxpr(32, 32, packed), 32) == 0
    assert _tile_op_counts(32, 32, packed) == {"exp": 2, "dot_general": 3}
    # negative control: the loops' layout moves tiles
    assert _tile_transposes(_vjp_jaxpr(64, 32, packed), 32) > 0


def _temp_bytes(attention, seq, batch=1, heads=4, kv_heads=2, head_dim=32):
    q = jax.ShapeDtypeStruct((batch, seq, heads, head_dim), jnp.float32)
    kv = jax.ShapeDtypeStruct((batch, seq, kv_heads, head_dim), jnp.float32)
    segments = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def loss(q, k, v, segments):
        return jnp.sum(attention(q, k, v, segments))

    grad = jax.jit(jax.grad(loss, (0, 1, 2)))
    return grad.lower(q, kv, kv, segments).compile().memory_analysis().temp_size_in_bytes


def _is_linear_without_scores(attention, heads=4):
    """Forward + backward temp on XLA:CPU at S, 2S, 4S: grows linearly (the second step adds at
    most 2.2x the first) and stays under one float32 S x S score matrix at 4S. S = 1024: below
    it XLA:CPU's fixed buffers of the loops still outweigh the per-position ones."""
    seqs = (1024, 2048, 4096)
    temps = [_temp_bytes(attention, seq, heads=heads) for seq in seqs]
    linear = temps[2] - temps[1] <= 2.2 * (temps[1] - temps[0])
    below_scores = temps[2] < heads * seqs[2] ** 2 * 4
    return linear and below_scores


def test_blockwise_memory_is_linear_in_the_sequence_with_no_score_matrix():
    assert _is_linear_without_scores(_blockwise(64))
    # negative control: the materialized path fails the same bound
    assert not _is_linear_without_scores(_materialized)


# --- the families' score forms: windows, softcaps, scales ------------------------------------

# seq, block, window, softcap, scale, packed
FORMS = [
    pytest.param(64, 16, 20, None, None, False, id="window-loops"),
    pytest.param(37, 8, 5, None, None, True, id="window-packed-odd-length"),
    pytest.param(40, 64, 7, None, None, False, id="window-lone-tile"),
    pytest.param(48, 16, None, 1.5, 0.2, False, id="softcap-scale-loops"),
    pytest.param(30, 64, None, 2.0, None, True, id="softcap-lone-tile-packed"),
    pytest.param(64, 16, 24, 3.0, 0.3, True, id="window-softcap-scale-packed"),
]


@pytest.mark.parametrize("seq,block,window,softcap,scale,packed", FORMS)
def test_windows_softcaps_and_scales_equal_the_materialized_attention(
    seq, block, window, softcap, scale, packed
):
    """Gemma's and Mistral's score forms: blockwise (its loops and its lone tile), forward and
    gradients, against the materialized path with the same window, cap and scale."""
    q, k, v, segments, weights = _inputs(2, seq, 4, 2, 16, packed)
    form = dict(scale=scale, softcap=softcap, window=window)

    def blockwise(q, k, v, segments):
        return blockwise_attention(q, k, v, segments, block, ScoreForm(scale, softcap, window))

    def materialized(q, k, v, segments):
        return attend(q, k, v, segments, "materialized", **form)

    expected = _forward(materialized, q, k, v, segments)
    np.testing.assert_allclose(_forward(blockwise, q, k, v, segments), expected, atol=2e-5)
    for want, got in zip(
        _grads(materialized, q, k, v, segments, weights),
        _grads(blockwise, q, k, v, segments, weights),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, atol=2e-4, rtol=1e-4)
    # the form changes the result: a window, cap or scale ignored could not pass
    plain = _forward(lambda q, k, v, s: attend(q, k, v, s, "materialized"), q, k, v, segments)
    assert np.abs(np.asarray(expected) - np.asarray(plain)).max() > 1e-2


def test_tiles_outside_the_window_are_skipped_not_masked():
    """With a window, a query block visits only the key blocks the window reaches: NaN keys and
    values further back never reach it (a masked tile would multiply NaN by zero). So the work
    is O(S x W): at fixed W, each query block reads at most ceil(W / block) + 1 key blocks."""
    seq, block, window = 128, 16, 20
    q, k, v, _, weights = _inputs(1, seq, 2, 1, 8, False)
    behind = np.arange(seq)[None, :, None, None] < 32  # keys 0..31: out of reach from 64 on
    k_poisoned, v_poisoned = (jnp.asarray(np.where(behind, np.nan, x)) for x in (k, v))

    def windowed(q, k, v, segments):
        return blockwise_attention(q, k, v, segments, block, ScoreForm(window=window))

    out = _forward(windowed, q, k_poisoned, v_poisoned, None)
    assert bool(jnp.isfinite(out[:, 64:]).all())
    d_q = _grads(windowed, q, k_poisoned, v_poisoned, None, weights)[0]
    assert bool(jnp.isfinite(d_q[:, 64:]).all())
    # negative control: without the window every earlier block is visited
    assert not bool(jnp.isfinite(_forward(_blockwise(block), q, k_poisoned, v, None)[:, 64:]).all())


def test_mixed_layers_pick_their_window_in_the_scan():
    """Gemma's pattern: in one scan, a sliding layer and a global layer (a `lax.cond` on the
    layer index) each equal the attention of their own kind."""
    from featherweight.models.config import ModelConfig
    from featherweight.models.llama import AttentionInputs, attention_core

    config = ModelConfig(
        model_type="gemma2", vocab_size=16, hidden_size=32, intermediate_size=32, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=6, sliding_layers=(True, False),
    )  # fmt: skip
    q, k, v, _, _ = _inputs(1, 40, 4, 2, 16, False)
    inputs = AttentionInputs(jnp.ones((1, 40, 16)), jnp.zeros((1, 40, 16)), None)
    per_layer = jax.jit(
        lambda index: attention_core(q, k, v, inputs.at_layer(index), config)
    )  # one program, two layers
    for index, window in ((0, 6), (1, None)):
        expected = attend(q, k, v, None, "materialized", window=window).reshape(1, 40, -1)
        np.testing.assert_allclose(per_layer(jnp.int32(index)), expected, atol=2e-5)
