"""Tiny checkpoints of every supported family, built with transformers (the reference) in the test:
random Hugging Face models, their safetensors directories, and GGUF files written the way
llama.cpp's converter writes them (q/k rows permuted, Llama 3 rope factors as `rope_freqs.weight`;
Qwen3, Gemma 2 / 3 and Phi-3 with their architectures' metadata, names and layouts).
"""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, RopeScalingType, TokenType, quants

from tests.kquant_encoder import ENCODERS, quantize_k

VOCAB = 256
SIZES = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16384,
    rms_norm_eps=1e-5,
)
# One batch of token ids for every logits comparison: equal configs and shapes across test modules
# reuse one compiled forward pass.
TOKENS = np.random.default_rng(0).integers(0, VOCAB, size=(2, 48))
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

# family -> (transformers config class, settings beyond SIZES)
FAMILIES = {
    "llama2": (transformers.LlamaConfig, {}),
    "llama3": (transformers.LlamaConfig, {"rope_theta": 500000.0, "rope_scaling": LLAMA3_ROPE}),
    "mistral": (transformers.MistralConfig, {"sliding_window": None, "rope_theta": 1e6}),
    "qwen2": (transformers.Qwen2Config, {"rope_theta": 1e6}),
    "smollm2": (transformers.LlamaConfig, {"tie_word_embeddings": True, "rope_theta": 1e5}),
}


def hf_config(family: str, **overrides) -> transformers.PretrainedConfig:
    """A tiny transformers config of `family` (see FAMILIES)."""
    config_class, settings = FAMILIES[family]
    return config_class(**{**SIZES, **settings, **overrides})


def random_hf_model(config: transformers.PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """A float32 transformers model with every weight random: norms near 1, biases non-zero, and
    projections large enough that a wrong rotary angle or head layout moves the logits by O(1)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("norm.weight"):
                parameter.copy_(1.0 + 0.2 * torch.randn_like(parameter))
            elif name.endswith("bias"):
                parameter.copy_(0.5 * torch.randn_like(parameter))
            else:
                parameter.copy_(torch.randn_like(parameter) / math.sqrt(parameter.shape[-1]))
    return model


def save_hf(model: torch.nn.Module, directory: Path, max_shard_size: str | None = None) -> Path:
    """`save_pretrained` as safetensors (sharded when `max_shard_size` is small)."""
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    return Path(directory)


def reference_and_loaded(config: transformers.PretrainedConfig, directory: Path):
    """(a random float32 transformers model of `config` with eager attention, featherweight's
    float32 load of it saved in `directory`): the pair every family's parity test compares."""
    from featherweight.io.loader import load_model

    config._attn_implementation = "eager"
    hf_model = random_hf_model(config)
    return hf_model, load_model(save_hf(hf_model, directory), dtype="float32")


def hf_logits(model: torch.nn.Module, token_ids: np.ndarray) -> np.ndarray:
    """Float32 logits [B, S, V] from transformers."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(token_ids))).logits.float().numpy()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (convert_hf_to_gguf.py `LlamaModel.permute`)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def llama3_rope_factors(config: transformers.PretrainedConfig) -> np.ndarray:
    """The `rope_freqs.weight` divisors llama.cpp's converter writes for llama3 rope scaling."""
    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelen = old_context / rope["low_freq_factor"]
    high_wavelen = old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"]
            )
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


def _byte_level_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: a complete 256-token byte-level BPE vocabulary."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    codes = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    table = dict(zip(printable, codes))
    return [chr(table[byte]) for byte in range(256)]


GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _gguf_name(hf_name: str) -> str:
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in top:
        return top[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}"


def add_byte_level_tokenizer(writer: GGUFWriter, vocab_size: int) -> None:
    """The byte-level BPE vocabulary of the tiny GGUF files: past the 256 bytes, two-letter tokens
    and their merges ("a b" -> "ab"), as llama.cpp needs merges to load a byte-level vocabulary."""
    tokens = _byte_level_tokens()[:vocab_size]
    pairs = [(chr(ord("a") + i // 26), chr(ord("a") + i % 26)) for i in range(26 * 26)]
    pairs = pairs[: vocab_size - len(tokens)]
    tokens += [left + right for left, right in pairs]
    merges = [f"{left} {right}" for left, right in pairs]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([TokenType.NORMAL] * vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    architecture: str | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
    type_of=None,
) -> Path:
    """Write `model` as llama.cpp would: 2-D weights in `tensor_type`, norms and biases in F32.

    `architecture` overrides `general.architecture` (to test refusal of other architectures);
    `type_of(gguf_name)`, when given, picks each 2-D weight's type (mixes such as Q4_K_M). K-quant
    types are written with the test encoder of tests/kquant_encoder.py.
    """
    config = model.config
    arch = architecture or ("qwen2" if config.model_type == "qwen2" else "llama")
    head_dim = config.hidden_size // config.num_attention_heads
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    add_byte_level_tokenizer(writer, config.vocab_size)
    for hf_name, parameter in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = parameter.detach().float().numpy()
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            values = llama_cpp_permute(values, config.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            values = llama_cpp_permute(values, config.num_key_value_heads)
        kind = tensor_type if type_of is None else type_of(_gguf_name(hf_name))
        if values.ndim == 1 or kind == GGMLQuantizationType.F32:
            writer.add_tensor(_gguf_name(hf_name), values)
        elif kind in (GGMLQuantizationType.F16, GGMLQuantizationType.I32):
            dtype = np.float16 if kind == GGMLQuantizationType.F16 else np.int32
            writer.add_tensor(_gguf_name(hf_name), values.astype(dtype))
        else:
            packed = quantize_k(values, kind) if kind in ENCODERS else quants.quantize(values, kind)
            writer.add_tensor(_gguf_name(hf_name), packed, raw_dtype=kind)
    for name, values in (extra_tensors or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def hf_from_gguf(path: Path) -> torch.nn.Module:
    """transformers' own reading of a GGUF file (its dequantization and q/k un-permutation)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()


def save_byte_level_tokenizer(directory: Path) -> Path:
    """Write a 256-token byte-level BPE tokenizer (tokenizer.json) into an HF model directory: the
    vocabulary the tiny GGUF files carry."""
    from featherweight.io.tokenizer import tokenizer_from_gguf_fields

    tokenizer = tokenizer_from_gguf_fields(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.tokens": _byte_level_tokens(),
            "tokenizer.ggml.token_type": [TokenType.NORMAL] * VOCAB,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
        }
    )
    tokenizer.save(Path(directory))
    return Path(directory)


def with_weights_through(
    model: torch.nn.Module, tensor_type: GGMLQuantizationType
) -> torch.nn.Module:
    """A copy of `model` whose 2-D weights went through `tensor_type` and back (what a GGUF file
    of that type holds): the reference a quantized export is compared with."""
    import copy

    rounded = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in rounded.parameters():
            if parameter.ndim == 2:
                values = parameter.detach().float().numpy()
                back = quants.dequantize(quants.quantize(values, tensor_type), tensor_type)
                parameter.copy_(torch.from_numpy(np.asarray(back, dtype=np.float32)))
    return rounded


# transformers model_type -> llama.cpp architecture, for `write_family_gguf`
LLAMA_CPP_ARCHITECTURES = {
    "qwen3": MODEL_ARCH.QWEN3,
    "gemma2": MODEL_ARCH.GEMMA2,
    "gemma3_text": MODEL_ARCH.GEMMA3,
    "phi3": MODEL_ARCH.PHI3,
    "gpt_oss": MODEL_ARCH.GPT_OSS,
}


def _family_hyperparameters(writer: GGUFWriter, config: transformers.PretrainedConfig) -> None:
    """The metadata llama.cpp's convert_hf_to_gguf.py writes for Qwen3, Gemma 2 / 3, Phi-3 and
    gpt-oss."""
    kind = config.model_type
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = config.rope_parameters
    if kind == "gemma3_text":
        rope = rope["full_attention"]
    if kind != "gemma2":  # Gemma2Model writes no RoPE base (llama.cpp's default 10000)
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if kind != "phi3":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    if kind == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    if kind == "gemma3_text":
        if config.final_logit_softcapping:
            writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if kind == "phi3":
        rotary = rope.get("partial_rotary_factor", 1.0)
        writer.add_rope_dimension_count(
            int(rotary * config.hidden_size) // config.num_attention_heads
        )
        writer.add_sliding_window(config.sliding_window or 0)
    if kind == "gpt_oss":  # TextModel's expert and YaRN keys, then GptOssModel's own
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
        writer.add_sliding_window(config.sliding_window)
        writer.add_expert_feed_forward_length(config.intermediate_size)


def _llama_cpp_split(hf_name: str, values: np.ndarray):
    """(Hugging Face-style name, tensor) pairs llama.cpp's converter maps a tensor to: gpt-oss's
    sinks gain `.weight`, its interleaved [E, in, 2F] `gate_up_proj` (and bias) is split into
    gate (even columns) and up (odd), each transposed to [E, out, in] like `down_proj`."""
    if hf_name.endswith("self_attn.sinks"):
        return [(hf_name + ".weight", values)]
    if hf_name.endswith("gate_up_proj_bias"):
        stem = hf_name[: -len("gate_up_proj_bias")]
        return [
            (stem + "gate_proj.bias", values[..., ::2]),
            (stem + "up_proj.bias", values[..., 1::2]),
        ]
    if hf_name.endswith("gate_up_proj"):
        stem, out_in = hf_name[: -len("gate_up_proj")], np.swapaxes(values, -1, -2)
        return [
            (stem + "gate_proj.weight", out_in[:, ::2]),
            (stem + "up_proj.weight", out_in[:, 1::2]),
        ]
    if hf_name.endswith("experts.down_proj_bias"):
        return [(hf_name[: -len("_bias")] + ".bias", values)]
    if hf_name.endswith("experts.down_proj"):
        return [(hf_name + ".weight", np.swapaxes(values, -1, -2))]
    return [(hf_name, values)]


def write_family_gguf(path: Path, model: torch.nn.Module) -> Path:
    """Write a Qwen3, Gemma 2 / 3, Phi-3 or gpt-oss model in F32 as llama.cpp's converter does:
    its architecture's metadata, tensor names from the gguf package's own map (Phi-3's `qkv_proj`
    as `attn_qkv`, `gate_up_proj` as `ffn_up`; gpt-oss's experts split by `_llama_cpp_split`),
    Gemma's norm weights stored as 1 + w, no q/k permutation, the head of a tied model left out."""
    config = model.config
    arch = LLAMA_CPP_ARCHITECTURES[config.model_type]
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    writer = GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_name("tiny test model")
    _family_hyperparameters(writer, config)
    writer.add_vocab_size(config.vocab_size)
    add_byte_level_tokenizer(writer, config.vocab_size)
    for hf_name, parameter in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        values = parameter.detach().float().numpy()
        if config.model_type.startswith("gemma") and hf_name.endswith("norm.weight"):
            values = values + 1.0
        for name, part in _llama_cpp_split(hf_name, values):
            stored = names.get_name(name, try_suffixes=(".weight", ".bias"))
            writer.add_tensor(stored, np.ascontiguousarray(part))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


WINDOW = 8  # shorter than TOKENS' 48 positions
# Qwen3, Gemma 2, Gemma 3, Phi-3 and gpt-oss as llama.cpp can run them: family -> (transformers config
# class, settings beyond SIZES). Qwen3's head_dim 128 is transformers' default, so its own GGUF
# reading (which reads no head_dim) keeps it; Gemma 3 has 6 layers, llama.cpp's sliding pattern.
LLAMA_CPP_FAMILIES = {
    "qwen3": (transformers.Qwen3Config, dict(num_hidden_layers=2, head_dim=128)),
    "gemma2": (
        transformers.Gemma2Config,
        dict(
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=3.0,
        ),
    ),
    "gemma3": (
        transformers.Gemma3TextConfig,
        dict(
            num_hidden_layers=6,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
    ),
    "phi3": (
        transformers.Phi3Config,
        dict(
            num_hidden_layers=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 1e4,
                "partial_rotary_factor": 0.5,
            },
            pad_token_id=0,
        ),
    ),
    "gpt_oss": (
        transformers.GptOssConfig,
        dict(
            num_hidden_layers=2,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            sliding_window=WINDOW,
            # llama.cpp always rounds YaRN's ramp ends (truncate), the published model does not
            rope_parameters={
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "original_max_position_embeddings": 512,
                "rope_theta": 150000.0,
            },
        ),
    ),
}


def family_config(family: str) -> transformers.PretrainedConfig:
    """A tiny float32, eager-attention transformers config of a `LLAMA_CPP_FAMILIES` family."""
    config_class, settings = LLAMA_CPP_FAMILIES[family]
    config = config_class(**{**SIZES, "max_position_embeddings": 4096, **settings})
    config._attn_implementation = "eager"
    return config
