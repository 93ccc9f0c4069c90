"""Qwen3 (dense): Qwen2's layer with an RMSNorm on each query and key head (QK-norm) before RoPE,
no q/k/v biases by default, and head_dim given apart from hidden_size / heads (in GGUF:
`attention.key_length`). llama.cpp's `qwen3` has no sliding window."""

from __future__ import annotations

from typing import Any

from featherweight.errors import ExportError
from featherweight.models.families.base import Family, GGUFGet, HFConfig
from featherweight.models.families.llama import _qwen_extras, qwen_sliding


def _options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {
        "qk_norm": True,
        "attention_bias": bool(hf.get("attention_bias", False)),
        **qwen_sliding(hf),
    }


def _gguf_metadata(config: Any) -> dict[str, Any]:
    if config.sliding_window is not None:
        raise ExportError(
            "llama.cpp's qwen3 runs no sliding window, and this model has one "
            f"(sliding_window={config.sliding_window}); export it as Hugging Face weights "
            "instead (--format merged)"
        )
    return {}


def _gguf_options(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    return {"qk_norm": True}


QWEN3 = Family(
    name="qwen3",
    model_types=("qwen3",),
    architecture="Qwen3ForCausalLM",
    gguf_architecture="qwen3",
    layer_options=_options,
    hf_extras=lambda config: {**_qwen_extras(config), "attention_bias": config.attention_bias},
    hf_layer_names={"q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight"},
    gguf_layer_names={"q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"},
    gguf_options=_gguf_options,
    gguf_metadata=_gguf_metadata,
)
