"""A small test-only encoder for GGUF's K-quant block formats (Q4_K, Q5_K, Q6_K), so tests can
write the files people download (Q4_K_M mixes Q4_K and Q6_K) without llama.cpp. The `gguf`
package dequantizes these formats but cannot write them (`gguf.quants.quantize` stops at Q8_0).

Each super-block holds 256 values. The encoder picks scales by plain absmax / min-max rounding --
not llama.cpp's error-minimizing search -- which is enough for fixtures: what matters is that the
bytes follow the layout `gguf.quants.dequantize` reads (checked in tests/io/test_kquant_encoder.py).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

QK_K = 256


def _f16(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16)


def _pack_6bit_scales(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins per super-block -> the 12 bytes Q4_K/Q5_K use."""
    packed = np.zeros((scales.shape[0], 12), dtype=np.uint8)
    low, high = slice(0, 4), slice(4, 8)
    packed[:, 0:4] = (scales[:, low] & 0x3F) | ((scales[:, high] >> 4) << 6)
    packed[:, 4:8] = (mins[:, low] & 0x3F) | ((mins[:, high] >> 4) << 6)
    packed[:, 8:12] = (scales[:, high] & 0x0F) | ((mins[:, high] & 0x0F) << 4)
    return packed


def _affine_codes(blocks: np.ndarray, levels: int):
    """Sub-blocks of 32 as d * sc * q - dmin * m: (d, dmin, sc, m, q) with 6-bit sc, m."""
    sub = blocks.reshape(-1, 8, 32)
    low = np.minimum(sub.min(axis=-1), 0.0)
    step = (sub.max(axis=-1) - low) / levels
    d = _f16(step.max(axis=-1) / 63)
    dmin = _f16(-low.min(axis=-1) / 63)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), 0, 63)
    m = np.clip(np.rint(np.divide(-low, dmin32, out=np.zeros_like(low), where=dmin32 > 0)), 0, 63)
    scale = (d32 * sc)[..., None]
    offset = (dmin32 * m)[..., None]
    q = np.divide(sub + offset, scale, out=np.zeros_like(sub), where=scale > 0)
    q = np.clip(np.rint(q), 0, levels).astype(np.uint8)
    return d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q


def encode_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] float32 -> [n, 144] bytes: d, dmin (f16), 12 bytes of scales, 128 of nibbles."""
    d, dmin, sc, m, q = _affine_codes(blocks, 15)
    pairs = q.reshape(-1, 4, 2, 32)  # sub-block 2c in the low nibble, 2c+1 in the high
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_6bit_scales(sc, m), nibbles], axis=1,
    )  # fmt: skip


def encode_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 176]: d, dmin, scales, 32 bytes of fifth bits, 128 of low nibbles."""
    d, dmin, sc, m, q = _affine_codes(blocks, 31)
    low = (q & 0x0F).reshape(-1, 4, 2, 32)
    nibbles = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 8, 32)  # bit j of byte i: sub-block j's value i
    fifth = np.zeros((q.shape[0], 32), dtype=np.uint8)
    for sub in range(8):
        fifth |= high[:, sub] << sub
    return np.concatenate(
        [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2),
         _pack_6bit_scales(sc, m), fifth, nibbles], axis=1,
    )  # fmt: skip


def encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[n, 256] -> [n, 210]: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales
    (one per 16 values), d (f16). Value = d * scale * (q - 32), q in 0..63."""
    sub = blocks.reshape(-1, 16, 16)
    amax = np.abs(sub).max(axis=-1)
    step = amax / 31
    d = _f16(step.max(axis=-1) / 127)
    d32 = d.astype(np.float32)[:, None]
    scales = np.clip(
        np.rint(np.divide(step, d32, out=np.zeros_like(step), where=d32 > 0)), -128, 127
    )
    scale = (d32 * scales)[..., None]
    q = np.divide(sub, scale, out=np.zeros_like(sub), where=scale > 0)
    q = (np.clip(np.rint(q), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)
    low = (q & 0x0F).reshape(-1, 2, 2, 64)  # half h, nibble s, byte i: value h*128 + s*64 + i
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = (q >> 4).reshape(-1, 2, 4, 32)  # half h, shift t, byte j: value h*128 + t*32 + j
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [
            ql,
            qh.reshape(-1, 64),
            scales.astype(np.int8).view(np.uint8),
            d.view(np.uint8).reshape(-1, 2),
        ],
        axis=1,
    )


ENCODERS = {
    GGMLQuantizationType.Q4_K: encode_q4_k,
    GGMLQuantizationType.Q5_K: encode_q5_k,
    GGMLQuantizationType.Q6_K: encode_q6_k,
}


def quantize_k(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """A float tensor [..., n] (n divisible by 256) -> its bytes [..., n / 256 * type_size]."""
    values = np.asarray(values, dtype=np.float32)
    if values.shape[-1] % QK_K:
        raise ValueError(f"{kind.name} needs rows of whole 256-value blocks, got {values.shape}")
    packed = ENCODERS[kind](values.reshape(-1, QK_K))
    return packed.reshape(*values.shape[:-1], -1)
