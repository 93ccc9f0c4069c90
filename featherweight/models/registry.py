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


def _qwen3(hidden: int, intermediate: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    """Qwen/Qwen3-{0.6B,4B,8B,14B,32B} config.json: 8 K/V heads of 128 everywhere."""
    return {
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_bias": False,
        "tie_word_embeddings": tied,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }


def _gemma3(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, head_dim: int,
    scalar: int,
) -> dict[str, Any]:  # fmt: skip
    """google/gemma-3-{4b,12b,27b}-pt config.json `text_config` (transformers' Gemma3TextConfig
    defaults for what it leaves out: the vocabulary, 262,208 rows, the image tokens included)."""
    return {
        "model_type": "gemma3_text",
        "vocab_size": 262208,
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "query_pre_attn_scalar": scalar,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
    }


def _qwen3_moe(
    hidden: int, intermediate: int, moe_intermediate: int, layers: int, heads: int
) -> dict[str, Any]:
    """Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B config.json: 128 experts, 8 a token,
    renormalized; 4 K/V heads of 128; every layer sparse."""
    return {
        **_qwen3(hidden, intermediate, layers, heads, tied=False),
        "model_type": "qwen3_moe",
        "num_key_value_heads": 4,
        "moe_intermediate_size": moe_intermediate,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
    }


def _gpt_oss(layers: int, experts: int) -> dict[str, Any]:
    """openai/gpt-oss-{20b,120b} config.json: windowed (128) and full layers alternating, YaRN
    (x32 of 4,096 positions), 4 experts a token; the experts' MXFP4 `quantization_config` is
    left out (`plan` counts the weights as the trainer loads them)."""
    return {
        "model_type": "gpt_oss",
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_local_experts": experts,
        "num_experts_per_tok": 4,
        "experts_per_token": 4,
        "attention_bias": True,
        "swiglu_limit": 7.0,
        "sliding_window": 128,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2),
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
        "router_aux_loss_coef": 0.9,
        "tie_word_embeddings": False,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
    }


# microsoft/Phi-3.5-mini-instruct config.json's LongRoPE factors, one per rotated pair (48)
_PHI35_LONG = (
    1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601,
    1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661,
    3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432,
    7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945,
    24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523,
    32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992,
    50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305,
    58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203,
    62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094,
    63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688,
    64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938,
    64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062,
)  # fmt: skip
_PHI35_SHORT = (
    1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842,
    1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842,
    1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094,
    1.1599998474121094, 1.1699998378753662, 1.2899998426437378, 1.339999794960022,
    1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788,
    1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745,
    2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346,
    2.0199997425079346, 2.0199997425079346, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914,
    2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756,
    2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533,
    2.729999542236328, 2.749999523162842, 2.8399994373321533,
)  # fmt: skip


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
    "Qwen3-0.6B": _qwen3(1024, 3072, layers=28, heads=16, tied=True),
    "Qwen3-4B": _qwen3(2560, 9728, layers=36, heads=32, tied=True),
    "Qwen3-8B": _qwen3(4096, 12288, layers=36, heads=32, tied=False),
    "Qwen3-14B": _qwen3(5120, 17408, layers=40, heads=40, tied=False),
    "Qwen3-32B": _qwen3(5120, 25600, layers=64, heads=64, tied=False),
    "Gemma-2-9B": {  # google/gemma-2-9b config.json
        "model_type": "gemma2",
        "vocab_size": 256000,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "num_hidden_layers": 42,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "Gemma-3-1B": {  # google/gemma-3-1b-pt config.json (text only: 262,144 rows)
        "model_type": "gemma3_text",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "Gemma-3-4B": _gemma3(2560, 10240, 34, heads=8, kv_heads=4, head_dim=256, scalar=256),
    "Gemma-3-12B": _gemma3(3840, 15360, 48, heads=16, kv_heads=8, head_dim=256, scalar=256),
    "Gemma-3-27B": _gemma3(5376, 21504, 62, heads=32, kv_heads=16, head_dim=128, scalar=168),
    "Phi-4": {  # microsoft/phi-4 config.json
        "model_type": "phi3",
        "vocab_size": 100352,
        "hidden_size": 5120,
        "intermediate_size": 17920,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 10,
        "rms_norm_eps": 1e-5,
        "rope_theta": 250000.0,
        "max_position_embeddings": 16384,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 100257,
        "eos_token_id": 100265,
    },
    "Phi-3.5-mini": {  # microsoft/Phi-3.5-mini-instruct config.json
        "model_type": "phi3",
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": list(_PHI35_LONG),
            "short_factor": list(_PHI35_SHORT),
        },
        "original_max_position_embeddings": 4096,
        "max_position_embeddings": 131072,
        "sliding_window": 262144,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
    "Mistral-Small-24B": {  # mistralai/Mistral-Small-24B-Base-2501 config.json
        "model_type": "mistral",
        "vocab_size": 131072,
        "hidden_size": 5120,
        "intermediate_size": 32768,
        "num_hidden_layers": 40,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "SmolLM2-135M": _smollm2(576, 1536, layers=30, heads=9, kv_heads=3, theta=100000.0),
    "SmolLM2-360M": _smollm2(960, 2560, layers=32, heads=15, kv_heads=5, theta=100000.0),
    "SmolLM2-1.7B": _smollm2(2048, 8192, layers=24, heads=32, kv_heads=32, theta=130000.0),
    "Qwen3-30B-A3B": _qwen3_moe(2048, 6144, 768, layers=48, heads=32),
    "Qwen3-235B-A22B": _qwen3_moe(4096, 12288, 1536, layers=94, heads=64),
    "Mixtral-8x7B-v0.1": {  # mistralai/Mixtral-8x7B-v0.1 config.json
        "model_type": "mixtral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "router_aux_loss_coef": 0.02,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "gpt-oss-20b": _gpt_oss(layers=24, experts=32),
    "gpt-oss-120b": _gpt_oss(layers=36, experts=128),
}

BUILTIN_MODELS: tuple[str, ...] = tuple(HF_CONFIGS)


DEMO_MODEL = "SmolLM2-135M"  # `demo`: the embedded SmolLM2-135M-Instruct has its shapes
# fine-tuned variants share their base model's shapes: Qwen2.5-7B-Instruct plans as Qwen2.5-7B,
# gemma-3-27b-it and -pt as Gemma-3-27B, Mistral-Small-24B-Instruct-2501 as Mistral-Small-24B
_VARIANT_TAGS = ("-instruct", "-chat", "-it", "-pt", "-base", "-2501")


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
