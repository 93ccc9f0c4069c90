"""cuDNN's fused attention against blockwise, one attention call at a time, by head dim and window:
which of Gemma 3's features (head dim 256, a sliding window) parts cuDNN's result from blockwise.

    python benchmarks/gpu_check_window.py [--tiny]

On an H200 (2026-11-28) Gemma-3-1B's QLoRA step with cuDNN's padded call (window 512, head dim
256) agreed with blockwise on the first loss (6.3e-5) and not on the gradient norm (0.577 against
0.909): this isolates the call. Per case (bf16, B 2 x S 2048, 8 query and 4 key-value heads, row
1 ending in 548 padding positions, the Gemma 3 scale): the largest absolute difference from
blockwise of the output and of each gradient (q, k, v) of a weighted sum of the real tokens'
outputs, over the largest blockwise value. Prints a JSON line per case. `--tiny`: CPU, float32,
S 128, window 32, materialized attention standing in for cuDNN (a rehearsal).
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from featherweight.models.attention import attend


def inputs(seq: int, head_dim: int, dtype):
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(keys[0], (2, seq, 8, head_dim), jnp.float32).astype(dtype)
    k = jax.random.normal(keys[1], (2, seq, 4, head_dim), jnp.float32).astype(dtype)
    v = jax.random.normal(keys[2], (2, seq, 4, head_dim), jnp.float32).astype(dtype)
    segments = np.ones((2, seq), np.int32)
    segments[1, seq - seq * 268 // 1000 :] = 0  # padding
    weights = jax.random.normal(keys[3], (2, seq, 8, head_dim), jnp.float32)
    weights = weights * jnp.asarray(segments)[:, :, None, None]
    return q, k, v, jnp.asarray(segments), weights


def case(implementation: str, seq: int, head_dim: int, window: int | None, dtype) -> dict:
    q, k, v, segments, weights = inputs(seq, head_dim, dtype)
    scale = 1.0 / 16.0 if head_dim == 256 else head_dim**-0.5

    def run(name):
        def loss(q, k, v):
            out = attend(q, k, v, segments, name, scale=scale, window=window)
            return jnp.sum(out.astype(jnp.float32) * weights), out

        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(
            q, k, v
        )
        return [np.asarray(x, np.float32) for x in (out, *grads)]

    fused, reference = run(implementation), run("blockwise")
    real = np.asarray(segments, bool)
    errors = []
    for a, b in zip(fused, reference, strict=True):
        a, b = a[real], b[real]
        errors.append(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
    return {
        "implementation": implementation, "head_dim": head_dim, "window": window,
        "relative_errors": dict(zip(("out", "dq", "dk", "dv"), errors, strict=True)),
    }  # fmt: skip


def main() -> int:
    tiny = "--tiny" in sys.argv
    implementation, seq, window, dtype = (
        ("materialized", 128, 32, jnp.float32)
        if tiny
        else ("cudnn_padded", 2048, 512, jnp.bfloat16)
    )
    for head_dim in (128, 256):
        for size in (None, window):
            try:
                record = case(implementation, seq, head_dim, size, dtype)
            except Exception as error:  # a case the kernel refuses: said, the others still run
                record = {"head_dim": head_dim, "window": size, "error": repr(error)[:300]}
            print(json.dumps({"device": jax.devices()[0].device_kind, **record}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
