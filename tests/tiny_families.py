"""Tiny config.json dicts of each family beside Llama, for tests that plan, choose or compile
without weights: every feature the family adds, at shapes that compile in seconds (head_dim 48,
apart from hidden / heads = 32; a window of 32 shorter than the tests' sequences)."""

from __future__ import annotations

from typing import Any

from featherweight.models.config import ModelConfig, config_from_hf_dict

_SHAPES = {
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 48,
    "max_position_embeddings": 4096,
}
WINDOW = 32
_MIXED = ["sliding_attention", "full_attention"] * 2

TINY_FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": {**_SHAPES, "model_type": "qwen3", "tie_word_embeddings": True},  # QK-norm
    "gemma2": {  # softcaps, sandwich norms, every other layer sliding
        **_SHAPES,
        "model_type": "gemma2",
        "query_pre_attn_scalar": 64,
        "sliding_window": WINDOW,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    "gemma3": {  # QK-norm, sandwich norms, three sliding layers to one global
        **_SHAPES,
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": 48,
        "sliding_window": WINDOW,
        "layer_types": ["sliding_attention"] * 3 + ["full_attention"],
    },
    "phi3": {  # a quarter of each head unrotated, a window on every layer
        **_SHAPES,
        "model_type": "phi3",
        "partial_rotary_factor": 0.75,
        "sliding_window": WINDOW,
        "tie_word_embeddings": False,
    },
    "mistral": {**_SHAPES, "model_type": "mistral", "sliding_window": WINDOW},
    "qwen2-mixed": {  # sliding from layer 1 on, by its layer types
        **_SHAPES,
        "model_type": "qwen2",
        "use_sliding_window": True,
        "sliding_window": WINDOW,
        "layer_types": _MIXED,
    },
    # mixtures of experts (models/moe.py): routed rows in blocks of 8 at the tests' sequences
    "qwen3_moe": {
        **_SHAPES,
        "model_type": "qwen3_moe",
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 128,
        "norm_topk_prob": True,
    },
    "mixtral": {
        **_SHAPES,
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 384,
    },
    "gpt_oss": {  # sinks, YaRN-free, a window on every other layer, biases, clamped SwiGLU
        **_SHAPES,
        "model_type": "gpt_oss",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 256,
        "head_dim": 32,
        "sliding_window": WINDOW,
    },
}


def tiny_family(name: str, **overrides: Any) -> ModelConfig:
    """The tiny `ModelConfig` of `name` (a key of `TINY_FAMILIES`), config.json fields
    overridden."""
    return config_from_hf_dict({**TINY_FAMILIES[name], **overrides}, source=f"tiny {name}")
