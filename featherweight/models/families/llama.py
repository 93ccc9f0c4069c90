"""The Llama family and the families that differ from it only in config fields: Llama 2/3
(and SmolLM2), Mistral and Ministral (a sliding window on every layer), Qwen2 (q/k/v biases;
sliding layers from `max_window_layers` on when `use_sliding_window`)."""

from __future__ import annotations

from typing import Any

from featherweight.models.families.base import Family, HFConfig, layer_types, sliding_options


def _llama_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {"attention_bias": bool(hf.get("attention_bias", False))}


def _mistral_options(hf: HFConfig, source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    sliding = layer_types(hf, hf["num_hidden_layers"], lambda index: window is not None)
    return sliding_options(window, sliding)


def qwen_sliding(hf: HFConfig) -> dict[str, Any]:
    """Qwen2/Qwen3: layers from `max_window_layers` on slide when `use_sliding_window` is set."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first = hf.get("max_window_layers", 28)
    sliding = layer_types(
        hf, hf["num_hidden_layers"], lambda index: window is not None and index >= first
    )
    return sliding_options(window, sliding)


def _qwen2_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {"attention_bias": bool(hf.get("attention_bias", True)), **qwen_sliding(hf)}


def _window_extras(config: Any) -> dict[str, Any]:
    return {"sliding_window": config.sliding_window}


def _qwen_extras(config: Any) -> dict[str, Any]:
    if config.sliding_window is None:
        return {"use_sliding_window": False}
    return {
        "use_sliding_window": True,
        "sliding_window": config.sliding_window,
        "layer_types": config.layer_types(),
    }


LLAMA = Family(
    name="llama",
    model_types=("llama",),
    architecture="LlamaForCausalLM",
    gguf_architecture="llama",
    layer_options=_llama_options,
    hf_extras=lambda config: {"attention_bias": config.attention_bias, "mlp_bias": False},
    gguf_permutes_qk=True,
)
MISTRAL = Family(
    name="mistral",
    model_types=("mistral",),
    architecture="MistralForCausalLM",
    gguf_architecture="llama",
    layer_options=_mistral_options,
    hf_extras=_window_extras,
    gguf_permutes_qk=True,
)
MINISTRAL = Family(
    name="ministral",
    model_types=("ministral",),
    architecture="MinistralForCausalLM",
    gguf_architecture="llama",
    layer_options=_mistral_options,
    hf_extras=lambda config: {**_window_extras(config), "layer_types": config.layer_types()},
    gguf_permutes_qk=True,
)
QWEN2 = Family(
    name="qwen2",
    model_types=("qwen2",),
    architecture="Qwen2ForCausalLM",
    gguf_architecture="qwen2",
    layer_options=_qwen2_options,
    hf_extras=_qwen_extras,
)
