"""Phi-3, Phi-3.5 and Phi-4 (`phi3`): Llama's layer with q, k, v stored as one `qkv_proj` and
gate, up as one `gate_up_proj` on disk (split on load, fused again on export), RoPE on the first
`partial_rotary_factor` of each head, LongRoPE scaling (Phi-3.5), and a sliding window on every
layer when `sliding_window` is set.

GGUF (llama.cpp's `phi3`): the fused tensors as `attn_qkv` and `ffn_up`, the rotated part of each
head as `rope.dimension_count`, the window as `attention.sliding_window` (0: none), read as
transformers runs it (llama.cpp itself currently runs Phi-3 without its window)."""

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


def _options(hf: HFConfig, source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    sliding = layer_types(hf, hf["num_hidden_layers"], lambda index: window is not None)
    parameters = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    return {"partial_rotary_factor": float(factor), **sliding_options(window, sliding)}


def _gguf_options(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    rotary = get("rope.dimension_count", shape["head_dim"])
    window = int(get("attention.sliding_window", 0)) or None
    return {
        "partial_rotary_factor": int(rotary) / shape["head_dim"],
        **sliding_options(window, (True,) * shape["num_layers"]),
    }


def _gguf_metadata(config: Any) -> dict[str, Any]:
    if config.rope_scaling is not None or config.windows == "some":
        raise ExportError(
            f"GGUF export of {config.model_type} supports neither LongRoPE nor a window on some "
            "layers only; export it as Hugging Face weights instead (--format merged)"
        )
    return {"attention.sliding_window": config.sliding_window or 0}


PHI3 = Family(
    name="phi3",
    model_types=("phi3",),
    architecture="Phi3ForCausalLM",
    gguf_architecture="phi3",
    defaults={"rms_norm_eps": 1e-5},
    layer_options=_options,
    hf_extras=lambda config: {
        "sliding_window": config.sliding_window,
        "partial_rotary_factor": config.partial_rotary_factor,
        # not Phi3Config's default 32000, which a vocabulary of 32000 or fewer has no row for
        "pad_token_id": None,
    },
    hf_fused={
        "self_attn.qkv_proj.weight": ("q", "k", "v"),
        "mlp.gate_up_proj.weight": ("gate", "up"),
    },
    gguf_fused={"attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")},
    gguf_options=_gguf_options,
    gguf_metadata=_gguf_metadata,
)
