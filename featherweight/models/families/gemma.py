"""Gemma 2 and Gemma 3 (text): RMSNorm weights applied as (1 + w) in float32, a norm after
attention and after the MLP as well as before each ("sandwich"), embeddings scaled by sqrt(D),
GELU (tanh) in the MLP, queries scaled by `query_pre_attn_scalar`^-1/2, and sliding-window
layers in a pattern. Gemma 2 adds tanh softcaps on the attention scores and the final logits;
Gemma 3 adds QK-norm, a RoPE base of its own for the sliding layers (`rope_local_base_freq`)
and its `rope_scaling` on the global layers only.

A `Gemma3ForConditionalGeneration` checkpoint (model_type "gemma3") carries the text model's
config under `text_config` and its weights under `language_model`: the loader reads that part.
"""

from __future__ import annotations

from typing import Any

from featherweight.errors import ExportError
from featherweight.models.families.base import (
    Family,
    GGUFGet,
    HFConfig,
    layer_types,
    sliding_options,
)

_SANDWICH_HF = {
    "mlp_norm": "pre_feedforward_layernorm.weight",
    "post_attn_norm": "post_attention_layernorm.weight",
    "post_mlp_norm": "post_feedforward_layernorm.weight",
}
_SANDWICH_GGUF = {
    "mlp_norm": "ffn_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}


# The layer every Gemma runs: (1 + w) norms, sandwich norms, sqrt(D)-scaled embeddings, GeGLU.
_GEMMA_LAYER = {"norm_offset": 1.0, "sandwich_norms": True, "embed_scale": True}


def _common(hf: HFConfig, pattern: int) -> dict[str, Any]:
    sliding = layer_types(hf, hf["num_hidden_layers"], lambda index: bool((index + 1) % pattern))
    return {
        **_GEMMA_LAYER,
        "activation": hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh",
        "query_scale": float(hf["query_pre_attn_scalar"]) ** -0.5,
        "attn_softcap": _cap(hf.get("attn_logit_softcapping")),
        "final_softcap": _cap(hf.get("final_logit_softcapping")),
        **sliding_options(hf.get("sliding_window"), sliding),
    }


def _cap(value: Any) -> float | None:
    return None if not value else float(value)


def _gemma2_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return _common(hf, pattern=2)


def _gemma3_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {
        **_common(hf, pattern=int(hf.get("sliding_window_pattern", 6))),
        "qk_norm": True,
        "local_rope_theta": float(hf.get("rope_local_base_freq", 10000.0)),
    }


# What llama.cpp hard-codes for Gemma (llama-model.cpp): queries scaled by head_dim^-1/2, or by
# (hidden / heads)^-1/2 for the 27B models, which it knows by their layer count; the sliding
# pattern (Gemma 2: every 2nd layer global, Gemma 3: every 6th); Gemma 3's sliding layers' RoPE
# base 10000; Gemma 2's softcaps default to 50 and 30, and its window to 4096.
_LLAMA_CPP_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
_LLAMA_CPP_PATTERN = {"gemma2": 2, "gemma3": 6}
_LLAMA_CPP_LOCAL_ROPE_THETA = 10000.0


def _llama_cpp_query_scale(name: str, shape: dict[str, int]) -> float:
    if shape["num_layers"] == _LLAMA_CPP_27B_LAYERS[name]:
        return float(shape["hidden_size"] // shape["num_heads"]) ** -0.5
    return float(shape["head_dim"]) ** -0.5


def _gguf_common(name: str, shape: dict[str, int], window: Any) -> dict[str, Any]:
    pattern = _LLAMA_CPP_PATTERN[name]
    sliding = tuple(bool((index + 1) % pattern) for index in range(shape["num_layers"]))
    return {
        **_GEMMA_LAYER,
        "activation": "gelu_pytorch_tanh",
        "query_scale": _llama_cpp_query_scale(name, shape),
        **sliding_options(int(window) or None, sliding),
    }


def _gemma2_gguf(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    return {
        **_gguf_common("gemma2", shape, get("attention.sliding_window", 4096)),
        "attn_softcap": _cap(get("attn_logit_softcapping", 50.0)),
        "final_softcap": _cap(get("final_logit_softcapping", 30.0)),
    }


def _gemma3_gguf(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    return {
        **_gguf_common("gemma3", shape, get("attention.sliding_window", 0)),
        "qk_norm": True,
        "final_softcap": _cap(get("final_logit_softcapping", 0.0)),
        "local_rope_theta": _LLAMA_CPP_LOCAL_ROPE_THETA,
    }


def _check_llama_cpp_runs(config: Any, name: str) -> None:
    """Refuse a config llama.cpp would run otherwise than featherweight (see above)."""
    shape = {
        "num_layers": config.num_layers,
        "hidden_size": config.hidden_size,
        "num_heads": config.num_heads,
        "head_dim": config.head_dim,
    }
    expected = _gguf_common(name, shape, config.sliding_window or 0)
    problems = []
    if abs(config.attention_scale - expected["query_scale"]) > 1e-6 * expected["query_scale"]:
        problems.append(
            f"query_pre_attn_scalar {config.attention_scale**-2:g} (llama.cpp uses "
            f"{expected['query_scale'] ** -2:g})"
        )
    if config.sliding_window is not None and config.sliding_layers != expected["sliding_layers"]:
        problems.append(
            f"sliding layers {config.layer_types()} (llama.cpp: every "
            f"{_LLAMA_CPP_PATTERN[name]}th layer global)"
        )
    if name == "gemma2" and None in (config.attn_softcap, config.final_softcap):
        problems.append("no softcap (llama.cpp always caps Gemma 2's scores and logits)")
    if name == "gemma3" and config.attn_softcap is not None:
        problems.append(f"attention softcap {config.attn_softcap:g} (llama.cpp has none)")
    local = config.local_rope_theta
    if name == "gemma3" and config.windows != "none" and local != _LLAMA_CPP_LOCAL_ROPE_THETA:
        problems.append(f"rope_local_base_freq {local:g} (llama.cpp uses 10000)")
    if problems:
        raise ExportError(
            f"llama.cpp would run this {name} model differently: {'; '.join(problems)}; export "
            "it as Hugging Face weights instead (--format merged)"
        )


def _gemma2_metadata(config: Any) -> dict[str, Any]:
    _check_llama_cpp_runs(config, "gemma2")
    return {
        "attn_logit_softcapping": config.attn_softcap,
        "final_logit_softcapping": config.final_softcap,
        "attention.sliding_window": config.sliding_window or 0,
    }


def _gemma3_metadata(config: Any) -> dict[str, Any]:
    _check_llama_cpp_runs(config, "gemma3")
    return {
        "final_logit_softcapping": config.final_softcap,
        "attention.sliding_window": config.sliding_window or 0,
    }


def _query_pre_attn_scalar(query_scale: float) -> int | float:
    """transformers 5 types `query_pre_attn_scalar` as an int, and refuses 16.0."""
    scalar = query_scale**-2
    return round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar


def _extras(config: Any) -> dict[str, Any]:
    return {
        "hidden_activation": config.activation,
        "query_pre_attn_scalar": _query_pre_attn_scalar(config.attention_scale),
        "attn_logit_softcapping": config.attn_softcap,
        "final_logit_softcapping": config.final_softcap,
        "sliding_window": config.sliding_window,
        "layer_types": config.layer_types(),
        "attention_bias": False,
    }


def _gemma3_extras(config: Any) -> dict[str, Any]:
    return {**_extras(config), "rope_local_base_freq": config.local_rope_theta}


_GEMMA_DEFAULTS = {  # transformers' Gemma2Config / Gemma3TextConfig defaults (2B / 1B-ish shapes)
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

GEMMA2 = Family(
    name="gemma2",
    model_types=("gemma2",),
    architecture="Gemma2ForCausalLM",
    gguf_architecture="gemma2",
    defaults={
        **_GEMMA_DEFAULTS,
        "vocab_size": 256000,
        "max_position_embeddings": 8192,
        "rope_theta": 10000.0,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    layer_options=_gemma2_options,
    hf_extras=_extras,
    hf_layer_names=_SANDWICH_HF,
    gguf_layer_names=_SANDWICH_GGUF,
    gguf_norm_offset=1.0,
    gguf_options=_gemma2_gguf,
    gguf_metadata=_gemma2_metadata,
)
GEMMA3 = Family(
    name="gemma3",
    model_types=("gemma3_text", "gemma3"),
    architecture="Gemma3ForCausalLM",
    gguf_architecture="gemma3",
    defaults={
        **_GEMMA_DEFAULTS,
        "vocab_size": 262208,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
    },
    layer_options=_gemma3_options,
    hf_extras=_gemma3_extras,
    hf_layer_names={
        **_SANDWICH_HF,
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight",
    },
    gguf_layer_names={
        **_SANDWICH_GGUF,
        "q_norm": "attn_q_norm.weight",
        "k_norm": "attn_k_norm.weight",
    },
    gguf_norm_offset=1.0,
    gguf_options=_gemma3_gguf,
    gguf_metadata=_gemma3_metadata,
)
