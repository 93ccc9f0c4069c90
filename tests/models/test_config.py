"""`ModelConfig` from Hugging Face config dicts: every family's fields, both rope spellings,
refusals with the offending field named, and the round trip back to a config transformers reads."""

import json

import jax
import pytest
import transformers

from featherweight.errors import (
    CheckpointNotFoundError,
    ModelConfigError,
    UnsupportedModelError,
)
from featherweight.models.config import (
    ModelConfig,
    RopeScaling,
    config_from_hf_dict,
    read_hf_config,
)
from tests.tiny_checkpoints import LLAMA3_ROPE, hf_config


def hf_dict(family: str, **overrides) -> dict:
    return hf_config(family, **overrides).to_dict()


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "smollm2"])
def test_transformers_configs_parse(family):
    hf = hf_config(family)
    config = config_from_hf_dict(hf.to_dict())
    assert config.model_type == hf.model_type
    assert (config.hidden_size, config.num_layers) == (hf.hidden_size, hf.num_hidden_layers)
    assert (config.num_heads, config.num_kv_heads) == (4, 2)
    assert config.head_dim == hf.hidden_size // hf.num_attention_heads
    assert config.rope_theta == hf.rope_parameters["rope_theta"]
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.tie_word_embeddings == (family == "smollm2")
    assert config.attention_bias == (family == "qwen2")
    assert (config.rope_scaling is not None) == (family == "llama3")


def test_llama3_rope_scaling_from_both_spellings():
    """transformers 4 writes `rope_scaling` + `rope_theta`; transformers 5 `rope_parameters`."""
    expected = RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    v5 = hf_dict("llama3")
    assert "rope_parameters" in v5
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4.update(rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    for spelling in (v5, v4):
        config = config_from_hf_dict(spelling)
        assert config.rope_scaling == expected
        assert config.rope_theta == 500000.0


def test_defaults_for_optional_fields():
    hf = {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "eos_token_id": [7, 8],
    }
    config = config_from_hf_dict(hf)
    assert config.num_kv_heads == 4  # no num_key_value_heads: multi-head attention
    assert config.head_dim == 16
    assert config.eos_token_id == 7  # first of a list
    assert config.rope_scaling is None and config.rope_theta == 10000.0


def test_config_is_hashable_and_a_jit_static_argument():
    config = config_from_hf_dict(hf_dict("qwen2"))
    assert hash(config) == hash(config_from_hf_dict(hf_dict("qwen2")))
    double = jax.jit(lambda x, cfg: x * cfg.num_layers, static_argnums=1)
    assert int(double(3, config)) == 6


@pytest.mark.parametrize("family", ["llama2", "llama3", "mistral", "qwen2", "smollm2"])
def test_to_hf_dict_round_trips_through_transformers(family, tmp_path):
    """The config.json we write is read by transformers and parses back to the same config."""
    config = config_from_hf_dict(hf_dict(family))
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    reread = transformers.AutoConfig.from_pretrained(tmp_path)
    assert reread.model_type == config.model_type
    assert reread.num_key_value_heads == config.num_kv_heads
    assert reread.tie_word_embeddings == config.tie_word_embeddings
    assert config_from_hf_dict(reread.to_dict()) == config
    assert read_hf_config(tmp_path) == config


def test_unsupported_model_type_lists_the_supported_ones():
    with pytest.raises(
        UnsupportedModelError, match=r"'gpt2'.*llama, mistral.*qwen2, qwen3, gemma2.*phi3"
    ):
        config_from_hf_dict({**hf_dict("llama2"), "model_type": "gpt2"})


def test_unsupported_architecture_lists_the_supported_ones():
    hf = {**hf_dict("llama2"), "architectures": ["LlamaForSequenceClassification"]}
    with pytest.raises(
        UnsupportedModelError, match=r"LlamaForSequenceClassification.*LlamaForCausalLM"
    ):
        config_from_hf_dict(hf)


def test_mistral_sliding_window_applies_to_every_layer():
    hf = hf_dict("mistral", sliding_window=4096, max_position_embeddings=32768)
    config = config_from_hf_dict(hf)
    assert config.windows == "all" and config.sliding_window == 4096


def test_qwen2_sliding_window_slides_from_max_window_layers_on():
    hf = hf_dict("qwen2", use_sliding_window=True, sliding_window=1024, max_window_layers=1)
    config = config_from_hf_dict(hf)
    assert config.sliding_window == 1024
    assert config.sliding_layers == tuple(index >= 1 for index in range(config.num_layers))
    assert config_from_hf_dict(hf_dict("qwen2", sliding_window=1024)).windows == "none"


def test_unsupported_rope_type_is_named():
    hf = hf_dict("llama2")
    hf["rope_parameters"] = {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModelError, match=r"'dynamic'.*llama3, linear, longrope, yarn"):
        config_from_hf_dict(hf)


def test_llama3_scaling_without_its_fields_is_named():
    hf = hf_dict("llama2")
    hf["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10000.0}
    with pytest.raises(ModelConfigError, match="low_freq_factor"):
        config_from_hf_dict(hf)


@pytest.mark.parametrize(
    ("field", "value", "pattern"),
    [("hidden_act", "gelu", "'gelu'"), ("mlp_bias", True, "mlp_bias")],
)
def test_unsupported_layer_features_are_named(field, value, pattern):
    with pytest.raises(UnsupportedModelError, match=pattern):
        config_from_hf_dict({**hf_dict("llama2"), field: value})


def test_missing_required_fields_are_named():
    hf = hf_dict("llama2")
    del hf["hidden_size"], hf["num_hidden_layers"]
    with pytest.raises(ModelConfigError, match="hidden_size, num_hidden_layers"):
        config_from_hf_dict(hf, source="/models/x/config.json")


@pytest.mark.parametrize(
    ("overrides", "pattern"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "multiple"),
        ({"head_dim": 15}, "even"),
        ({"num_layers": 0}, "num_layers=0"),
    ],
)
def test_impossible_shapes_are_refused(overrides, pattern):
    values = dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    with pytest.raises(ModelConfigError, match=pattern):
        ModelConfig(**{**values, **overrides})


def test_read_hf_config_errors_name_the_file(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"no config\.json"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"config.json is not valid JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelConfigError, match="JSON object"):
        read_hf_config(tmp_path)
