"""Shared test setup: CPU with 8 virtual devices (for sharding tests), float32 matmuls, fixtures."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from featherweight.demo_model import demo_model_path  # noqa: E402
from featherweight.models.config import ModelConfig  # noqa: E402


def tiny_config(**overrides) -> ModelConfig:
    """A Llama-shaped config small enough to compile in a second or two."""
    values = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    values.update(overrides)
    return ModelConfig(**values)


@pytest.fixture(scope="session")
def demo_gguf():
    """The real SmolLM2-135M-Instruct GGUF, fetched by `featherweight setup` (scripts/test runs it)."""
    path = demo_model_path()
    if not path.is_file():
        pytest.fail(
            f"demo model missing at {path}: run `featherweight setup` first (scripts/test does)"
        )
    return path


def relative_difference(expected, actual) -> float:
    """Largest over the leaves of max |expected - actual| / max |expected|."""
    diffs = jax.tree.map(
        lambda a, b: float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(a)) + 1e-30)),
        expected,
        actual,
    )
    return max(jax.tree.leaves(diffs))
