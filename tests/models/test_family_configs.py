"""config.json spellings of the families as their checkpoints on the Hub write them
(transformers 4 and 5), into the ModelConfig the layer reads; RoPE variants against
transformers' own frequency functions; refusals in one line."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from featherweight.errors import ModelConfigError, UnsupportedModelError
from featherweight.models.config import config_from_hf_dict
from featherweight.models.rotary import rope_inverse_frequencies

GEMMA3_4B_TEXT = {  # google/gemma-3-4b-it config.json's text_config (transformers 4.50 spelling)
    "hidden_size": 2560,
    "intermediate_size": 10240,
    "model_type": "gemma3_text",
    "num_hidden_layers": 34,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024,
}


def test_a_multimodal_gemma3_config_gives_its_language_model():
    """Gemma3ForConditionalGeneration: the text config is nested and leaves out what the family
    defaults (vocabulary, heads, head_dim, softcaps, the 1-in-6 global pattern, RoPE bases)."""
    config = config_from_hf_dict(
        {
            "architectures": ["Gemma3ForConditionalGeneration"],
            "model_type": "gemma3",
            "text_config": GEMMA3_4B_TEXT,
            "vision_config": {"model_type": "siglip_vision_model"},
        }
    )
    assert config.model_type == "gemma3_text" and config.vocab_size == 262208
    assert (config.head_dim, config.num_heads, config.num_kv_heads) == (256, 8, 4)
    assert config.sliding_layers == tuple((index + 1) % 6 != 0 for index in range(34))
    assert config.local_rope_theta == 10000.0 and config.rope_theta == 1e6
    assert config.rope_scaling.rope_type == "linear" and config.rope_scaling.factor == 8.0
    assert config.qk_norm and config.sandwich_norms and config.embed_scale
    assert config.norm_offset == 1.0 and config.activation == "gelu_pytorch_tanh"
    assert config.query_scale == pytest.approx(256**-0.5)


def test_gemma3_rope_per_layer_type_equals_transformers():
    """transformers 5's `rope_parameters` per layer type: the global layers' linear scaling and
    the sliding layers' own base give transformers' inverse frequencies."""
    hf = transformers.Gemma3TextConfig(
        **{**GEMMA3_4B_TEXT, "num_hidden_layers": 6, "rope_scaling": None},
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    config = config_from_hf_dict(hf.to_dict())
    for layer_type, local in (("full_attention", False), ("sliding_attention", True)):
        kind = hf.rope_parameters[layer_type]["rope_type"]
        theirs, _ = ROPE_INIT_FUNCTIONS.get(kind, _default_rope)(hf, None, layer_type=layer_type)
        ours, factor = rope_inverse_frequencies(config, local=local)
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
        assert factor == 1.0


def _default_rope(config, device, layer_type=None):
    base = config.rope_parameters[layer_type]["rope_theta"]
    dim = config.head_dim
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0


@pytest.mark.parametrize("seq_len", [64, 8192], ids=["short-factors", "long-factors"])
def test_phi35_longrope_equals_transformers(seq_len):
    """Phi-3.5-mini's LongRoPE: per-frequency divisors (short up to the original context, long
    past it) and the attention factor on cos/sin, as transformers computes them."""
    rotary = 8
    short = [1.0 + 0.1 * index for index in range(rotary // 2)]
    long = [2.0 + 0.5 * index for index in range(rotary // 2)]
    hf = transformers.Phi3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=131072,
        original_max_position_embeddings=4096, pad_token_id=0,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": short,
                         "long_factor": long, "original_max_position_embeddings": 4096},
    )  # fmt: skip
    config = config_from_hf_dict(hf.to_dict())
    theirs, attention = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len)
    ours, factor = rope_inverse_frequencies(config, seq_len)
    np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
    assert factor == pytest.approx(attention) and factor > 1.0


def test_qwen3_config_as_the_hub_writes_it():
    config = config_from_hf_dict(
        {  # Qwen/Qwen3-8B config.json (shape fields)
            "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
            "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "sliding_window": None, "use_sliding_window": False, "max_window_layers": 36,
            "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu",
        }
    )  # fmt: skip
    assert config.qk_norm and config.windows == "none" and not config.attention_bias


@pytest.mark.parametrize(
    ("change", "error", "pattern"),
    [
        ({"model_type": "deepseek_v3"}, UnsupportedModelError, "model_type 'deepseek_v3'"),
        ({"hidden_act": "relu"}, UnsupportedModelError, "hidden activation 'relu'"),
        ({"layer_types": ["sliding_attention"]}, ModelConfigError, "layer_types"),
        ({"sliding_window": 0}, ModelConfigError, "sliding_window=0"),
        (
            {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}},
            UnsupportedModelError,
            "dynamic",
        ),
    ],
    ids=["moe", "activation", "layer-types", "window", "rope"],
)
def test_unsupported_or_broken_fields_are_refused_in_one_line(change, error, pattern):
    hf = {
        "model_type": "mistral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "sliding_window": 16,
    }  # fmt: skip
    with pytest.raises(error, match=pattern) as caught:
        config_from_hf_dict({**hf, **change})
    assert "\n" not in str(caught.value)
