"""gpt-oss (`gpt_oss`): a mixture of experts whose router takes the top-k logits (with a bias)
and then their softmax; experts with biases and a clamped SwiGLU; attention with q/k/v/o
biases, a learned sink logit per head in every softmax, sliding and full layers alternating, and
YaRN RoPE.

On disk the experts are gate and up interleaved in one `gate_up_proj` [E, D, 2F] (in, out: the
transpose of featherweight's [out, in]) and `down_proj` [E, F, D] -- or, as OpenAI publishes
them, MXFP4: 4-bit e2m1 values two to a byte in blocks of 32 with one power-of-two scale each
(`*_blocks`, `*_scales`, already [out, in]); they are decoded on load (to NF4 for QLoRA after).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from featherweight.errors import ExportError, UnsupportedModelError
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


def _no_gguf_export(config: Any) -> dict[str, Any]:
    raise ExportError(
        "GGUF export of gpt-oss is not supported (llama.cpp's gpt-oss: MXFP4 experts, sinks, "
        "YaRN); export it as Hugging Face weights (--format merged)"
    )


def _no_gguf_import(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    raise UnsupportedModelError(
        "gpt-oss GGUF files are not read; load the model's Hugging Face safetensors instead"
    )


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
    gguf_options=_no_gguf_import,
    gguf_metadata=_no_gguf_export,
    hf_layer_names={
        "o_bias": "self_attn.o_proj.bias",
        "sinks": "self_attn.sinks",
        "router": "mlp.router.weight",
        "router_bias": "mlp.router.bias",
        "down_bias": "mlp.experts.down_proj_bias",
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
