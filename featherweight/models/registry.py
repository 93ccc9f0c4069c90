"""Built-in configs of popular models: plan (and compile) them by name, without any file.

The values are the published `config.json` fields that fix the shapes (copied from the models'
Hugging Face repositories), turned into `ModelConfig`s by the same `config_from_hf_dict` that reads
a checkpoint, so a built-in name and a downloaded checkpoint give equal configs.
"""

from __future__ import annotations

from typing import Any

from featherweight.errors import CheckpointNotFoundError
from featherweight.models.config import ModelConfig, config_from_hf_dict

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def _llama32(hidden: int, layers: int, heads: int, head_dim: int) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": 8192,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": head_dim,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }


def _smollm2(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, theta: float
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "rope_theta": theta,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }


HF_CONFIGS: dict[str, dict[str, Any]] = {
    "Llama-3.1-8B": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "Llama-3.1-70B": {  # meta-llama/Llama-3.1-70B config.json
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    },
    "Llama-3.2-1B": _llama32(hidden=2048, layers=16, heads=32, head_dim=64),
    "Llama-3.2-3B": _llama32(hidden=3072, layers=28, heads=24, head_dim=128),
    "Mistral-7B-v0.3": {
        "model_type": "mistral",
        "vocab_size": 32768,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2.5-7B": {
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 131072,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "SmolLM2-135M": _smollm2(576, 1536, layers=30, heads=9, kv_heads=3, theta=100000.0),
    "SmolLM2-360M": _smollm2(960, 2560, layers=32, heads=15, kv_heads=5, theta=100000.0),
    "SmolLM2-1.7B": _smollm2(2048, 8192, layers=24, heads=32, kv_heads=32, theta=130000.0),
}

BUILTIN_MODELS: tuple[str, ...] = tuple(HF_CONFIGS)


DEMO_MODEL = "SmolLM2-135M"  # `demo`: the embedded SmolLM2-135M-Instruct has its shapes
# fine-tuned variants share their base model's shapes: Qwen2.5-7B-Instruct plans as Qwen2.5-7B
_VARIANT_TAGS = ("-instruct", "-chat", "-it")


def _lookup_key(name: str) -> str:
    key = name.strip().lower().rsplit("/", 1)[-1].removeprefix("meta-")
    if key == "demo":
        return DEMO_MODEL.lower()
    for tag in _VARIANT_TAGS:
        key = key.replace(tag, "")
    return key


def is_builtin_model(name: str) -> bool:
    """Whether `name` is a built-in model: any case, with or without an `org/` prefix, its
    -Instruct / -chat variants, or `demo`."""
    return any(_lookup_key(name) == _lookup_key(known) for known in BUILTIN_MODELS)


def builtin_names() -> str:
    """The built-in names as a user reads them (help texts, errors)."""
    return ", ".join(BUILTIN_MODELS) + " (and their -Instruct variants), demo"


def builtin_config(name: str) -> ModelConfig:
    """The `ModelConfig` of a built-in model, by name (see `is_builtin_model`)."""
    for known, hf in HF_CONFIGS.items():
        if _lookup_key(name) == _lookup_key(known):
            return config_from_hf_dict(hf, source=f"built-in {known}")
    raise CheckpointNotFoundError(
        f"{name!r} is neither a model path nor a built-in model name; built-in models: "
        f"{builtin_names()} (or give a directory with config.json, or a .gguf file)"
    )
