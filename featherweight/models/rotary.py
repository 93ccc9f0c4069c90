"""Rotary position embeddings: each family's inverse frequencies (plain, Llama 3's `llama3`,
`linear`, Phi-3.5's LongRoPE, gpt-oss's YaRN, and Gemma 3's own base for its sliding layers),
the cos/sin tables of integer positions, and the rotation of a head's first r dims (partial
rotary: Phi-4-mini), as transformers computes them."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.models.config import ModelConfig


def rope_inverse_frequencies(config: ModelConfig, seq_len: int = 0, local: bool = False):
    """(inverse frequencies [r/2], the cos/sin factor) with `rope_theta` and its scaling, or the
    sliding layers' own base unscaled (`local`, Gemma 3). LongRoPE takes its long factors past
    the original context (`seq_len`: the positions the call covers)."""
    rotary = config.rotary_dim
    exponents = np.arange(0, rotary, 2, dtype=np.int64).astype(np.float32)
    if local:
        return (1.0 / (config.local_rope_theta ** (exponents / rotary))).astype(np.float32), 1.0
    inv_freq = 1.0 / (config.rope_theta ** (exponents / rotary))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq.astype(np.float32), 1.0
    if scaling.rope_type == "linear":
        return (inv_freq / scaling.factor).astype(np.float32), 1.0
    if scaling.rope_type == "yarn":
        return _yarn_frequencies(
            inv_freq, rotary, config.rope_theta, scaling
        ), scaling.attention_factor
    if scaling.rope_type == "longrope":
        long = seq_len > scaling.original_max_position_embeddings
        factors = np.asarray(scaling.long_factor if long else scaling.short_factor, np.float32)
        return (inv_freq / factors).astype(np.float32), scaling.attention_factor
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * np.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32), 1.0


def _yarn_frequencies(inv_freq: np.ndarray, rotary: int, base: float, scaling) -> np.ndarray:
    """YaRN's frequencies (transformers' `_compute_yarn_parameters`): extrapolated above
    `beta_fast` rotations over the original context, divided by `factor` below `beta_slow`,
    ramped linearly between."""

    def dimension(rotations: float) -> float:
        context = scaling.original_max_position_embeddings
        return rotary * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dimension(scaling.beta_fast), dimension(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(rotary // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp
    return (inv_freq / scaling.factor * (1 - extrapolated) + inv_freq * extrapolated).astype(
        np.float32
    )


def rotary_tables(
    config: ModelConfig, positions: jax.Array, local: bool = False, seq_len: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, S, r] float32 of integer `positions` [B, S] (as transformers computes them)."""
    seq_len = positions.shape[1] if seq_len is None else seq_len
    inv_freq, factor = rope_inverse_frequencies(config, seq_len, local)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, S, r/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, S, r]
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first r dims of [B, S, N, h] by the tables [B, S, r] (HF's `rotate_half`); the
    rest of each head passes unrotated (partial rotary)."""
    with jax.named_scope("rotary"):
        rotary = cos.shape[-1]
        x_rot, x_pass = x[..., :rotary], x[..., rotary:]
        half = rotary // 2
        rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
        cos = cos[:, :, None, :].astype(x.dtype)
        sin = sin[:, :, None, :].astype(x.dtype)
        out = x_rot * cos + rotated * sin
        return out if x_pass.shape[-1] == 0 else jnp.concatenate([out, x_pass], axis=-1)
