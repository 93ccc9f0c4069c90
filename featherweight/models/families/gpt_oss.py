"""gpt-oss (`gpt_oss`): a mixture of experts whose router takes the top-k logits (with a bias)
and then their softmax; experts with biases and a clamped SwiGLU; attention with q/k/v/o
biases, a learned sink logit per head in every softmax, sliding and full layers alternating, and
YaRN RoPE.

On disk the experts are gate and up interleaved in one `gate_up_proj` [E, D, 2F] (in, out: the
transpose of featherweight's [out, in]) and `down_proj` [E, F, D] -- or, as OpenAI publishes
them, MXFP4: 4-bit e2m1 values two to a byte in blocks of 32 with one power-of-two scale each
(`*_blocks`, `*_scales`, already [out, in]); they are decoded on load (to NF4 for QLoRA after).

GGUF (llama.cpp's `gpt-oss`, as its convert_hf_to_gguf.py writes it): gate and up split apart
(`ffn_gate_exps`, `ffn_up_exps`, [E, F, D]) and `ffn_down_exps` [E, D, F], each with a `.bias`
[E, F] or [E, D]; the router `ffn_gate_inp` (+ `.bias`), the sinks `attn_sinks.weight`, the
pre-MLP norm `post_attention_norm`. llama.cpp hard-codes what the file does not say: every other
layer sliding from layer 0, the clamped SwiGLU's alpha 1.702 and limit 7, the softmax over the
top-k logits; YaRN's ends of the ramp always rounded to whole dimensions (the published gpt-oss
says `truncate: false`, so llama.cpp, and a model read from GGUF here, rotate a few middle
frequencies slightly differently from transformers).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featherweight.errors import ExportError
from featherweight.models.families.base import (
    Family,
    GGUFGet,
    HFConfig,
    layer_types,
    sliding_options,
)

# e2m1: the sixteen values a 4-bit MXFP4 code stands for (OCP Microscaling spec)
FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """MXFP4 blocks [..., G, 16] uint8 (low nibble first) and scales [..., G] uint8 (a biased
    power of two, 127 = 2^0) -> float32 [..., G * 32]."""
    blocks, exponents = np.asarray(blocks, np.uint8), np.asarray(scales, np.int32) - 127
    values = np.empty((*blocks.shape[:-1], blocks.shape[-1] * 2), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    values = np.ldexp(values, exponents[..., None])
    return values.reshape(*values.shape[:-2], -1)


def _options(hf: HFConfig, source: str) -> dict[str, Any]:
    window = hf.get("sliding_window")
    sliding = layer_types(hf, hf["num_hidden_layers"], lambda index: bool((index + 1) % 2))
    return {
        "attention_bias": True,
        "output_bias": True,
        "attention_sinks": True,
        "num_experts": int(hf.get("num_local_experts", hf.get("num_experts"))),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "routing": "topk_softmax",
        "expert_bias": True,
        "activation": "clamped_swiglu",
        "swiglu_alpha": float(hf.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(hf.get("swiglu_limit", 7.0)),
        "router_aux_loss_coef": hf.get("router_aux_loss_coef"),
        "output_router_logits": bool(hf.get("output_router_logits", False)),
        **sliding_options(window, sliding),
    }


def _extras(config: Any) -> dict[str, Any]:
    return {
        "attention_bias": True,
        "num_local_experts": config.num_experts,
        "num_experts_per_tok": config.experts_per_token,
        "swiglu_limit": config.swiglu_limit,
        "sliding_window": config.sliding_window,
        "layer_types": config.layer_types(),
        "router_aux_loss_coef": config.router_aux_loss_coef or 0.9,
    }


def _interleaved(part: int):
    """gate (0) or up (1) rows of an interleaved gate_up [E, in, 2F] tensor, as [E, F, in]."""
    return lambda gate_up: np.swapaxes(gate_up[..., part::2], -1, -2)


def _interleaved_mxfp4(part: int):
    return lambda blocks, scales: mxfp4_decode(blocks, scales)[:, part::2]


def _interleave(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """[E, F, in] x 2 -> gate_up [E, in, 2F], gate and up alternating."""
    joined = np.empty((*gate.shape[:-2], gate.shape[-1], 2 * gate.shape[-2]), gate.dtype)
    joined[..., 0::2], joined[..., 1::2] = np.swapaxes(gate, -1, -2), np.swapaxes(up, -1, -2)
    return joined


def _interleave_bias(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    joined = np.empty((*gate.shape[:-1], 2 * gate.shape[-1]), gate.dtype)
    joined[..., 0::2], joined[..., 1::2] = gate, up
    return joined


# What llama.cpp's gpt-oss graph fixes rather than reads (`ggml_swiglu_oai`'s alpha and limit).
_LLAMA_CPP_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}


def _gguf_options(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    """The layer as llama.cpp runs a gpt-oss file (the expert counts and YaRN are read by
    `io/gguf_reader.py` for every architecture)."""
    sliding = tuple(index % 2 == 0 for index in range(shape["num_layers"]))
    window = get("attention.sliding_window", None)
    return {
        "output_bias": True,
        "attention_sinks": True,
        "routing": "topk_softmax",
        "expert_bias": True,
        "activation": "clamped_swiglu",
        **_LLAMA_CPP_SWIGLU,
        **sliding_options(None if window is None else int(window), sliding),
    }


def _gguf_metadata(config: Any) -> dict[str, Any]:
    """`attention.sliding_window`; refuses what llama.cpp would run otherwise."""
    problems = [
        f"{name} {getattr(config, name):g} (llama.cpp uses {value:g})"
        for name, value in _LLAMA_CPP_SWIGLU.items()
        if getattr(config, name) != value
    ]
    every_other = tuple(index % 2 == 0 for index in range(config.num_layers))
    if config.sliding_window is not None and config.sliding_layers != every_other:
        problems.append(f"layer_types {config.layer_types()} (llama.cpp: layers 0, 2, 4... slide)")
    if config.sliding_window is None:
        problems.append("no sliding window (llama.cpp slides every other layer)")
    if problems:
        raise ExportError(
            f"llama.cpp's gpt-oss would run this model differently: {'; '.join(problems)}; "
            "export it as Hugging Face weights (--format merged)"
        )
    return {"attention.sliding_window": config.sliding_window}


_GATE_UP = "mlp.experts.gate_up_proj"
_DOWN = "mlp.experts.down_proj"

GPT_OSS = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    architecture="GptOssForCausalLM",
    gguf_architecture="gpt-oss",
    defaults={"head_dim": 64, "sliding_window": 128},
    layer_options=_options,
    hf_extras=_extras,
    gguf_options=_gguf_options,
    gguf_metadata=_gguf_metadata,
    hf_layer_names={
        "o_bias": "self_attn.o_proj.bias",
        "sinks": "self_attn.sinks",
        "router": "mlp.router.weight",
        "router_bias": "mlp.router.bias",
        "down_bias": "mlp.experts.down_proj_bias",
    },
    gguf_layer_names={
        "mlp_norm": "post_attention_norm.weight",
        "o_bias": "attn_output.bias",
        "sinks": "attn_sinks.weight",
        "router": "ffn_gate_inp.weight",
        "router_bias": "ffn_gate_inp.bias",
        "gate": "ffn_gate_exps.weight",
        "up": "ffn_up_exps.weight",
        "down": "ffn_down_exps.weight",
        "gate_bias": "ffn_gate_exps.bias",
        "up_bias": "ffn_up_exps.bias",
        "down_bias": "ffn_down_exps.bias",
    },
    hf_derived={
        "gate": (
            ((_GATE_UP,), _interleaved(0)),
            ((f"{_GATE_UP}_blocks", f"{_GATE_UP}_scales"), _interleaved_mxfp4(0)),
        ),
        "up": (
            ((_GATE_UP,), _interleaved(1)),
            ((f"{_GATE_UP}_blocks", f"{_GATE_UP}_scales"), _interleaved_mxfp4(1)),
        ),
        "down": (
            ((_DOWN,), lambda down: np.swapaxes(down, -1, -2)),
            ((f"{_DOWN}_blocks", f"{_DOWN}_scales"), mxfp4_decode),
        ),
        "gate_bias": (((f"{_GATE_UP}_bias",), lambda bias: bias[..., 0::2]),),
        "up_bias": (((f"{_GATE_UP}_bias",), lambda bias: bias[..., 1::2]),),
    },
    hf_composed={
        _GATE_UP: (("gate", "up"), _interleave),
        f"{_GATE_UP}_bias": (("gate_bias", "up_bias"), _interleave_bias),
        _DOWN: (("down",), lambda down: np.swapaxes(down, -1, -2)),
    },
)
