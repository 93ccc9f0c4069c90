"""Write a model as a GGUF file llama.cpp runs: llama.cpp's architecture, tensor names and
layout (q/k rows permuted for `llama`, Gemma's norms as 1 + w, Phi-3's q, k, v and gate, up fused),
the hyper-parameters (and the family's own: softcaps, window, `Family.gguf_metadata`) and the
tokenizer in the metadata, each weight in the requested type.

Streaming: every tensor's name, shape and type are known from the config before any tensor is
read, so the header and tensor table are written first (`gguf.GGUFWriter`) and then the tensors
one at a time, each quantized on its own: host memory holds one tensor (and its quantized bytes).

Types (`GGUF_QUANTS`) are those `gguf.quants.quantize` writes: f32, f16, bf16, q8_0, q5_1, q5_0,
q4_1, q4_0, and mxfp4 for a mixture of experts: its expert weights MXFP4 and every other weight
BF16, the file llama.cpp's converter makes of OpenAI's gpt-oss (experts read from that checkpoint's
MXFP4 and left unmerged are written back with the same values). As llama.cpp's converter
does, 1-D tensors, biases, the router (`ffn_gate_inp`) and Llama 3's rope factors stay F32, and a
weight whose rows are not whole blocks of the type (32 values) is written F16. K-quants (Q4_K_M
...) are not written: the `gguf` package has no K-quant encoder; llama.cpp's `llama-quantize` turns
an f16 file from here into any of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    GGMLQuantizationType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    quants,
)

from featherweight.errors import ConfigError, ExportError
from featherweight.io.gguf_reader import ROPE_FACTORS, unpermute_rotary_rows
from featherweight.io.gguf_tokenizer import add_tokenizer
from featherweight.io.hf_writer import join_stored
from featherweight.io.names import TensorKey, expected_shapes, stored_tensors
from featherweight.io.tokenizer import Tokenizer
from featherweight.models.config import ModelConfig, RopeScaling
from featherweight.models.families import family_of
from featherweight.models.rotary import rope_inverse_frequencies

Q = GGMLQuantizationType
GGUF_QUANTS = {
    "f32": (Q.F32, LlamaFileType.ALL_F32),
    "f16": (Q.F16, LlamaFileType.MOSTLY_F16),
    "bf16": (Q.BF16, LlamaFileType.MOSTLY_BF16),
    "q8_0": (Q.Q8_0, LlamaFileType.MOSTLY_Q8_0),
    "q5_1": (Q.Q5_1, LlamaFileType.MOSTLY_Q5_1),
    "q5_0": (Q.Q5_0, LlamaFileType.MOSTLY_Q5_0),
    "q4_1": (Q.Q4_1, LlamaFileType.MOSTLY_Q4_1),
    "q4_0": (Q.Q4_0, LlamaFileType.MOSTLY_Q4_0),
    "mxfp4": (Q.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE),
}


def check_quant(quant: str) -> GGMLQuantizationType:
    """The GGUF tensor type of a `--quant` name, or a `ConfigError` listing the ones written."""
    if quant not in GGUF_QUANTS:
        hint = " (K-quants: quantize an f16 export with llama.cpp's llama-quantize)"
        raise ConfigError(
            f"--quant {quant!r} is not a GGUF type featherweight writes; use one of "
            f"{', '.join(GGUF_QUANTS)}" + (hint if "_k" in quant.lower() else "")
        )
    return GGUF_QUANTS[quant][0]


def gguf_architecture(config: ModelConfig) -> str:
    """llama.cpp's architecture for a config's family (Mistral runs as `llama`)."""
    return family_of(config.model_type).gguf_architecture


def permute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's q/k row order: per head, the two rotary halves interleaved (the inverse of
    `unpermute_rotary_rows`)."""
    permuted = np.empty_like(weight)
    permuted[unpermute_rotary_rows(np.arange(weight.shape[0]), num_heads)] = weight
    return permuted


def to_gguf_layout(config: ModelConfig, key: TensorKey, values: np.ndarray) -> np.ndarray:
    """A tensor in Hugging Face layout -> GGUF's (q/k rows of `llama` files permuted, Gemma's norm
    weights stored as 1 + w)."""
    name, _layer = key
    family = family_of(config.model_type)
    if name.endswith("norm") and family.gguf_norm_offset:
        return values.astype(np.float32) + np.float32(family.gguf_norm_offset)
    if not family.gguf_permutes_qk or name not in ("q", "k"):
        return values
    return permute_rotary_rows(values, config.num_heads if name == "q" else config.num_kv_heads)


def tensor_type(
    name: str, shape: tuple[int, ...], wanted: GGMLQuantizationType
) -> GGMLQuantizationType:
    """As llama.cpp's converter: 1-D tensors, biases and the router stay F32; with MXFP4 only the
    experts' [E, out, in] weights are MXFP4 and the other weights BF16; a weight whose rows are not
    whole blocks of the type is F16."""
    if len(shape) == 1 or not name.endswith(".weight") or ".ffn_gate_inp." in name:
        return Q.F32
    if wanted == Q.MXFP4 and len(shape) != 3:
        return Q.BF16
    if shape[-1] % GGML_QUANT_SIZES[wanted][0]:
        return Q.F16
    return wanted


def _nbytes(shape: tuple[int, ...], kind: GGMLQuantizationType) -> int:
    block, size = GGML_QUANT_SIZES[kind]
    return int(np.prod(shape, dtype=np.int64)) // block * size


def _encode(values: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    values = np.ascontiguousarray(values, dtype=np.float32)
    if kind == Q.F32:
        return values
    return quants.quantize(values, kind)


def add_hyperparameters(writer: GGUFWriter, config: ModelConfig) -> None:
    """Shapes, attention and RoPE settings under llama.cpp's `{arch}.*` keys."""
    writer.add_block_count(config.num_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_heads)
    writer.add_head_count_kv(config.num_kv_heads)
    writer.add_rope_dimension_count(config.rotary_dim)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    if config.num_experts:  # llama.cpp's expert keys (the experts' width is intermediate_size)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.experts_per_token)
        writer.add_expert_feed_forward_length(config.intermediate_size)
    scaling = config.rope_scaling
    if scaling is not None and scaling.rope_type == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling.factor)
    elif scaling is not None and scaling.rope_type == "yarn":
        add_yarn(writer, scaling)
    elif scaling is not None:
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
    for suffix, value in family_of(config.model_type).gguf_metadata(config).items():
        if value is None:
            continue
        key = f"{gguf_architecture(config)}.{suffix}"
        if isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_float32(key, float(value))


def add_yarn(writer: GGUFWriter, scaling: RopeScaling) -> None:
    """YaRN under llama.cpp's keys. ggml scales cos/sin by 1 + 0.1 ln(factor) (transformers'
    default attention factor) itself; another attention factor is refused rather than guessed."""
    default = 1.0 + 0.1 * math.log(scaling.factor)
    if abs(scaling.attention_factor - default) > 1e-6 * default:
        raise ExportError(
            f"YaRN attention_factor {scaling.attention_factor:g} is not 1 + 0.1 ln(factor) = "
            f"{default:g}, the one llama.cpp applies; export as Hugging Face weights "
            "(--format merged)"
        )
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(scaling.factor)
    writer.add_rope_scaling_orig_ctx_len(scaling.original_max_position_embeddings)
    writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
    writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)


def rope_factors(config: ModelConfig) -> np.ndarray | None:
    """Llama 3 rope scaling as llama.cpp stores it: per-frequency divisors (`rope_freqs.weight`)."""
    if config.rope_scaling is None or config.rope_scaling.rope_type != "llama3":
        return None
    plain = dataclasses.replace(config, rope_scaling=None)
    return (rope_inverse_frequencies(plain)[0] / rope_inverse_frequencies(config)[0]).astype(
        np.float32
    )


def _in_gguf_layout(
    config: ModelConfig,
    shapes: dict[TensorKey, tuple[int, ...]],
    tensors: Iterable[tuple[TensorKey, np.ndarray]],
):
    """The keyed tensors in GGUF's layout, checked to come in `shapes`' order, all of them."""
    order = iter(shapes)
    for key, values in tensors:
        expected = next(order, None)
        if key != expected or tuple(values.shape) != shapes[key]:
            raise ExportError(
                f"GGUF writer got tensor {key} {tuple(values.shape)} where {expected} "
                f"{shapes.get(expected)} was due; the tensors do not follow the model config"
            )
        yield key, to_gguf_layout(config, key, values)
    missing = next(order, None)
    if missing is not None:
        raise ExportError(f"GGUF writer: tensor {missing} was never given")


def write_model_gguf(
    path: Path,
    config: ModelConfig,
    tensors: Iterable[tuple[TensorKey, np.ndarray]],
    tokenizer: Tokenizer | None,
    quant: str = "f16",
    name: str | None = None,
) -> Path:
    """Write the model at `path` (not atomically: callers write into a staging directory).

    `tensors` yields (key, Hugging Face-layout tensor) in `expected_shapes(config)` order, one at a
    time; each is put in GGUF's layout, quantized and written before the next is drawn (the parts
    of a fused tensor are held until the last comes).
    """
    wanted = check_quant(quant)
    if wanted == Q.MXFP4 and not config.num_experts:
        raise ExportError(
            "--quant mxfp4 writes the experts of a mixture-of-experts model as MXFP4, and this "
            f"{config.model_type} model has none; use bf16, q8_0 or q4_0"
        )
    if tokenizer is None:
        raise ExportError(
            "GGUF files carry their tokenizer, and this model has none (no tokenizer.json); put "
            "the model's tokenizer.json beside its config.json and export again"
        )
    writer = GGUFWriter(None, gguf_architecture(config))
    writer.add_type("model")
    writer.add_name(name or f"{config.model_type} fine-tuned with featherweight")
    writer.add_file_type(GGUF_QUANTS[quant][1])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    add_hyperparameters(writer, config)
    add_tokenizer(writer, tokenizer, config.vocab_size)

    shapes = expected_shapes(config)
    layout = stored_tensors(config, gguf=True)
    stored_shapes = {}
    for stored, parts in layout:
        rows = sum(shapes[part][0] for part in parts)
        stored_shapes[stored] = (rows, *shapes[parts[0]][1:])
    kinds = {stored: tensor_type(stored, shape, wanted) for stored, shape in stored_shapes.items()}
    for stored, shape in stored_shapes.items():
        writer.add_tensor_info(
            stored, shape, np.dtype(np.float32), _nbytes(shape, kinds[stored]), kinds[stored]
        )
    factors = rope_factors(config)
    if factors is not None:
        writer.add_tensor_info(ROPE_FACTORS, factors.shape, factors.dtype, factors.nbytes, Q.F32)
    writer.write_header_to_file(path=Path(path))
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for stored, values in join_stored(layout, _in_gguf_layout(config, shapes, tensors)):
        writer.write_tensor_data(_encode(values, kinds[stored]))
    if factors is not None:
        writer.write_tensor_data(factors)
    writer.close()
    return Path(path)
