"""Phi-3, Phi-3.5 and Phi-4 (`phi3`): Llama's layer with q, k, v stored as one `qkv_proj` and
gate, up as one `gate_up_proj` on disk (split on load, fused again on export), RoPE on the first
`partial_rotary_factor` of each head, LongRoPE scaling (Phi-3.5), and a sliding window on every
layer when `sliding_window` is set."""

from __future__ import annotations

from typing import Any

from featherweight.models.families.base import Family, HFConfig, layer_types, sliding_options


def _options(hf: HFConfig, source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    sliding = layer_types(hf, hf["num_hidden_layers"], lambda index: window is not None)
    parameters = hf.get("rope_parameters") or {}
    factor = hf.get("partial_rotary_factor", parameters.get("partial_rotary_factor", 1.0))
    return {"partial_rotary_factor": float(factor), **sliding_options(window, sliding)}


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
    },
    hf_fused={
        "self_attn.qkv_proj.weight": ("q", "k", "v"),
        "mlp.gate_up_proj.weight": ("gate", "up"),
    },
    gguf_fused={"attn_qkv.weight": ("q", "k", "v"), "ffn_up.weight": ("gate", "up")},
)
