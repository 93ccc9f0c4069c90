"""featherweight's Llama-family forward pass equals transformers' on the same checkpoint.

Each family's tiny random model is built by transformers, saved with `save_pretrained` (one of them
sharded), loaded by `load_model` and compared logit by logit in float32 (max abs diff <= 1e-4),
and in bfloat16 against transformers' bfloat16 (to bfloat16 rounding).
"""

import copy
import json

import ml_dtypes
import numpy as np
import pytest
import torch
import transformers

from featherweight.inference.generate import logits
from featherweight.io.loader import load_model
from tests.tiny_checkpoints import TOKENS, hf_config, hf_logits, random_hf_model, save_hf

FLOAT32_TOLERANCE = 1e-4

# case -> (family, config overrides, max_shard_size for save_pretrained)
CASES = {
    "llama2-sharded": ("llama2", {}, "40KB"),
    "llama3-rope-scaling": ("llama3", {}, None),
    "mistral": ("mistral", {}, None),
    "qwen2-bias-mha": ("qwen2", {"num_key_value_heads": 4}, None),
    "smollm2-tied": ("smollm2", {}, None),
}


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(case, transformers model, saved directory) for one family."""
    family, overrides, shard_size = CASES[request.param]
    model = random_hf_model(hf_config(family, **overrides))
    directory = save_hf(model, tmp_path_factory.mktemp(request.param), shard_size)
    return request.param, model, directory


def test_float32_logits_equal_transformers(checkpoint):
    case, hf_model, directory = checkpoint
    loaded = load_model(directory, dtype="float32")
    expected = hf_logits(hf_model, TOKENS)
    diff = np.abs(np.asarray(logits(loaded, TOKENS)) - expected).max()
    assert diff <= FLOAT32_TOLERANCE, f"{case}: max abs diff {diff:.2e} vs transformers"
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits


def test_family_features_are_exercised(checkpoint):
    """Each case really carries the feature it is named for (so its parity means something)."""
    case, _hf_model, directory = checkpoint
    config = load_model(directory, dtype="float32").config
    if case == "llama2-sharded":
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 3
    if case == "llama3-rope-scaling":
        assert config.rope_scaling is not None and config.rope_scaling.factor == 8.0
    if case == "qwen2-bias-mha":
        assert config.attention_bias and config.num_kv_heads == config.num_heads
    if case == "smollm2-tied":
        assert config.tie_word_embeddings
    if case != "qwen2-bias-mha":
        assert config.num_kv_heads < config.num_heads  # grouped-query attention


def test_llama3_scaling_changes_the_logits():
    """Without the llama3 rope scaling the same weights give other logits: the llama3 parity
    could not hold if the scaling were ignored."""
    scaled = random_hf_model(hf_config("llama3"))
    unscaled = random_hf_model(hf_config("llama3", rope_scaling=None))
    unscaled.load_state_dict(scaled.state_dict())
    diff = np.abs(hf_logits(unscaled, TOKENS) - hf_logits(scaled, TOKENS)).max()
    assert diff > 100 * FLOAT32_TOLERANCE


def test_bfloat16_logits_close_to_transformers_bfloat16(checkpoint):
    """bfloat16 compute agrees with transformers' bfloat16 to bfloat16 rounding: within 5% of
    the logit scale (measured 1-2% on these models, as far as either is from float32)."""
    case, hf_model, directory = checkpoint
    loaded = load_model(directory, dtype="bfloat16")
    assert loaded.dtype == np.dtype(ml_dtypes.bfloat16)
    ours = np.asarray(logits(loaded, TOKENS))
    reference = hf_logits(copy.deepcopy(hf_model).to(torch.bfloat16), TOKENS)
    exact = hf_logits(hf_model, TOKENS)
    scale = np.abs(exact).max()
    diff = np.abs(ours - reference).max()
    assert diff <= 0.05 * scale, f"{case}: bf16 max abs diff {diff:.3f} (logit scale {scale:.2f})"
    assert np.abs(ours - exact).max() > 0  # it did compute in bfloat16


def test_stored_dtype_is_kept_and_float16_becomes_float32(tmp_path):
    """dtype=None keeps a bfloat16 checkpoint in bfloat16, and computes float16 ones in float32
    (featherweight's compute dtypes are float32 and bfloat16)."""
    bf16_dir = save_hf(random_hf_model(hf_config("llama2")).to(torch.bfloat16), tmp_path / "bf16")
    f16_dir = save_hf(random_hf_model(hf_config("llama2")).to(torch.float16), tmp_path / "f16")
    assert load_model(bf16_dir).dtype == np.dtype(ml_dtypes.bfloat16)
    from_f16 = load_model(f16_dir)
    assert from_f16.dtype == np.float32
    reference = transformers.AutoModelForCausalLM.from_pretrained(f16_dir, dtype=torch.float32)
    expected = hf_logits(reference.eval(), TOKENS)
    assert np.abs(np.asarray(logits(from_f16, TOKENS)) - expected).max() <= FLOAT32_TOLERANCE
