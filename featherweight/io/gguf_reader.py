"""GGUF files (llama.cpp's format) as a checkpoint source: config from metadata, tensors
dequantized by the `gguf` package, and the tokenizer from the metadata.

Every tensor type the installed `gguf` package can dequantize is read (F32, F16, BF16, the legacy
Q4_0 ... Q8_0, the K-quants Q2_K ... Q6_K of Q4_K_M-style files, the IQ and ternary types, MXFP4):
the set is asked of the package itself, so a newer `gguf` widens it. A tensor is read in chunks of
rows with plain file reads (no memory map, whose touched pages would stay resident) and each chunk
is dequantized straight into the caller's buffer: on top of the result, host memory holds one
chunk (`CHUNK_VALUES` values) of bytes and floats, never a second copy of a tensor.

The architectures are the families' `gguf_architecture`s (llama, qwen2, qwen3, qwen3moe, gemma2,
gemma3, phi3, gpt-oss); each family reads its own metadata (`Family.gguf_options`) as llama.cpp
runs it. Llama 3's rope scaling is recognised from the `rope_freqs.weight` factors llama.cpp
writes for it, linear scaling (Gemma 3) and YaRN (gpt-oss, as ggml computes it) from
`rope.scaling.type`. GGUF stores the q and k projections of `llama` files with rows permuted for
llama.cpp's interleaved rotary layout (permuted back to Hugging Face's half-split layout on read),
Gemma's norm weights as 1 + w (the 1 is taken off on read), and Phi-3's q, k, v and gate, up
fused along their rows (each part read as its row range).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from featherweight.errors import CorruptCheckpointError, TensorShapeError, UnsupportedModelError
from featherweight.io.names import (
    TensorKey,
    gguf_fused_parts,
    gguf_name,
    parse_gguf_name,
    validate_tensors,
)
from featherweight.io.tokenizer import Tokenizer, tokenizer_from_gguf_fields
from featherweight.models.config import ModelConfig, RopeScaling
from featherweight.models.families import BY_GGUF_ARCHITECTURE
from featherweight.models.rotary import rope_inverse_frequencies

SUPPORTED_ARCHITECTURES = tuple(BY_GGUF_ARCHITECTURE)
CHUNK_VALUES = 1 << 18  # values dequantized at a time (1 MiB of float32)
ROPE_FACTORS = "rope_freqs.weight"  # read into the config, not a parameter
_IGNORED = {ROPE_FACTORS}
_LONGROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


@functools.cache
def dequantizable_types() -> frozenset[GGMLQuantizationType]:
    """Every tensor type the installed `gguf` package dequantizes, found by asking it (one block
    of zeros each): F32, F16, BF16, Q4_0 ... Q8_0, Q2_K ... Q6_K, IQ*, TQ* in gguf 0.19."""
    kinds = set()
    for kind in GGMLQuantizationType:
        if kind not in GGML_QUANT_SIZES:
            continue
        try:
            quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[kind][1]), np.uint8), kind)
        except Exception:  # NotImplementedError, or an integer type the package cannot view
            continue
        kinds.add(kind)
    return frozenset(kinds)


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")


def _field_value(field: Any) -> Any:
    return field.contents()


@functools.cache
def _known_keys(architecture: str) -> frozenset[str]:
    """Every metadata key the gguf package defines, for this architecture."""
    keys: list[str] = []

    def collect(namespace: type) -> None:
        for name, value in vars(namespace).items():
            if isinstance(value, str) and not name.startswith("_"):
                keys.append(value.replace("{arch}", architecture))
            elif inspect.isclass(value):
                collect(value)

    collect(gguf.Keys)
    return frozenset(key for key in keys if "{" not in key)


def unpermute_rotary_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, interleaved pairs back to two halves."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    grouped = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


class GGUFSource:
    """One open GGUF file: config, tensor shapes, tensor reads and tokenizer."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(str(self.path))
        except Exception as error:  # the gguf package raises many types on a bad header
            raise CorruptCheckpointError(
                f"{self.path} is not a readable GGUF file ({type(error).__name__}: {error}); "
                "it may be truncated -- download it again"
            ) from None
        self.fields = {name: field for name, field in self.reader.fields.items()}
        self.architecture = self._get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"{self.path}: GGUF architecture {self.architecture!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self._check_keys()
        self.tensors = {tensor.name: tensor for tensor in self.reader.tensors}
        self._check_tensor_layout()
        supported = dequantizable_types()
        for tensor in self.tensors.values():
            if tensor.tensor_type not in supported:
                kind = getattr(tensor.tensor_type, "name", str(tensor.tensor_type))
                raise UnsupportedModelError(
                    f"{self.path}: tensor {tensor.name!r} is stored as {kind}, which the installed "
                    f"gguf package (version {_gguf_version()}) cannot dequantize; supported: "
                    f"{', '.join(sorted(k.name for k in supported))}. Upgrade gguf, or use a file "
                    "quantized with one of these (or the original safetensors)."
                )
        self.family = BY_GGUF_ARCHITECTURE[self.architecture]
        self.config = self._config()
        self._keys: dict[TensorKey, tuple[str, int]] = {}  # key -> (stored name, first row)
        shapes: dict[TensorKey, tuple[int, ...]] = {}
        unknown = []
        for name, tensor in self.tensors.items():
            if name in _IGNORED:
                continue
            shape = tuple(int(size) for size in reversed(tensor.shape.tolist()))
            parts = gguf_fused_parts(name, self.config)
            if parts is None:
                key = parse_gguf_name(name, self.config)
                if key is None:
                    unknown.append(name)
                    continue
                parts = [(key, 0, shape[0])]
            elif len(shape) != 2 or shape[0] != parts[-1][2]:
                raise TensorShapeError(
                    f"{self.path}: tensor {name!r} has shape {shape}, expected "
                    f"({parts[-1][2]}, ...) from the metadata; the file is damaged"
                )
            for key, first, stop in parts:
                self._keys[key] = (name, first)
                shapes[key] = (stop - first, *shape[1:])
        validate_tensors(self.config, shapes, unknown, str(self.path), spell=gguf_name)
        self.shapes = shapes

    def _check_keys(self) -> None:
        """Refuse a metadata key one byte away from a key GGUF defines: a damaged name would
        otherwise leave its setting at a default silently (e.g. the context length)."""
        known = _known_keys(self.architecture)
        for name in self.fields:
            if name in known or name.startswith("GGUF."):
                continue
            for key in known:
                if len(key) == len(name) and sum(a != b for a, b in zip(key, name)) == 1:
                    raise CorruptCheckpointError(
                        f"{self.path}: metadata key {name!r} is one byte away from GGUF's {key!r}; "
                        "the file is damaged -- download it again"
                    )

    def _check_tensor_layout(self) -> None:
        """Tensors lie one after another from the start of the data section, each aligned, up to
        the end of the file: a damaged offset, dimension or type in the tensor table shows up as a
        gap or an overlap instead of silently reading another tensor's bytes."""
        size = self.path.stat().st_size
        expected = self.reader.data_offset
        for tensor in sorted(self.reader.tensors, key=lambda tensor: tensor.data_offset):
            end = int(tensor.data_offset) + int(tensor.n_bytes)
            if tensor.data_offset != expected or end > size:
                where = f"bytes {tensor.data_offset}-{end}, expected from {expected}"
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {tensor.name!r} lies at {where} in a file of {size} "
                    "bytes; the tensor table is damaged or the file truncated -- download it again"
                )
            expected = end + (-end) % self.reader.alignment

    def _get(self, name: str, default: Any = None) -> Any:
        field = self.fields.get(name)
        if field is None:
            return default
        try:
            return _field_value(field)
        except Exception as error:
            raise CorruptCheckpointError(
                f"{self.path}: metadata {name!r} is unreadable ({error})"
            ) from None

    def _config(self) -> ModelConfig:
        arch = self.architecture
        need = ["block_count", "embedding_length", "feed_forward_length", "attention.head_count"]
        missing = [key for key in need if f"{arch}.{key}" not in self.fields]
        if missing:
            raise CorruptCheckpointError(
                f"{self.path} lacks metadata {', '.join(f'{arch}.{key}' for key in missing)}"
            )
        if any(name in self.tensors for name in _LONGROPE_FACTORS):
            raise UnsupportedModelError(
                f"{self.path}: LongRoPE factors ({_LONGROPE_FACTORS[0]!r}) are not read from GGUF; "
                "load the model's Hugging Face safetensors instead"
            )
        num_heads = int(self._get(f"{arch}.attention.head_count"))
        hidden = int(self._get(f"{arch}.embedding_length"))
        tokens = self.fields.get("tokenizer.ggml.tokens")
        vocab = self._get(f"{arch}.vocab_size") or (len(tokens.data) if tokens else None)
        if vocab is None:
            vocab = int(self.tensors["token_embd.weight"].shape[-1])
        rotary = self._get(f"{arch}.rope.dimension_count")
        head_dim = self._get(f"{arch}.attention.key_length") or (
            rotary if self.family.name != "phi3" else None  # Phi-3 rotates part of each head
        )
        head_dim = int(head_dim or hidden // num_heads)
        shape = {
            "num_layers": int(self._get(f"{arch}.block_count")),
            "hidden_size": hidden,
            "num_heads": num_heads,
            "head_dim": head_dim,
        }
        options = self.family.gguf_options(
            lambda suffix, default=None: self._get(f"{arch}.{suffix}", default), shape
        )
        bos = self._get("tokenizer.ggml.bos_token_id")
        eos = self._get("tokenizer.ggml.eos_token_id")
        config = ModelConfig(
            model_type=self.family.model_types[0],
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(
                # an MoE's experts' width; llama.cpp fills feed_forward_length with the dense MLP's
                self._get(f"{arch}.expert_feed_forward_length")
                or self._get(f"{arch}.feed_forward_length")
            ),
            **self._experts(),
            num_layers=shape["num_layers"],
            num_heads=num_heads,
            num_kv_heads=int(self._get(f"{arch}.attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self._get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(self._get(f"{arch}.rope.freq_base", 10000.0)),
            max_position_embeddings=int(self._get(f"{arch}.context_length", 4096)),
            tie_word_embeddings="output.weight" not in self.tensors,
            attention_bias="blk.0.attn_q.bias" in self.tensors,
            bos_token_id=None if bos is None else int(bos),
            eos_token_id=None if eos is None else int(eos),
            **options,
        )
        return dataclasses.replace(config, rope_scaling=self._rope_scaling(config))

    def _experts(self) -> dict[str, int]:
        """An MoE file's expert count and experts per token, or nothing."""
        count = self._get(f"{self.architecture}.expert_count")
        if not count:
            return {}
        used = self._get(f"{self.architecture}.expert_used_count")
        return {"num_experts": int(count), "experts_per_token": int(used)}

    def _rope_scaling(self, config: ModelConfig) -> RopeScaling | None:
        """Linear rope scaling (`rope.scaling.type`, Gemma 3's global layers), or Llama 3's,
        recognised from the `rope_freqs.weight` factors llama.cpp stores.

        GGUF keeps no llama3 scaling settings, only the per-frequency divisors they produce. They
        are matched against Llama 3's published settings (low 1, high 4, original context 8192,
        factor = the largest divisor); anything else is refused rather than silently ignored,
        which would shift every rotary angle.
        """
        kind = self._get(f"{self.architecture}.rope.scaling.type")
        factor = self._get(f"{self.architecture}.rope.scaling.factor")
        if kind == "linear" and factor:
            return RopeScaling(factor=float(factor), rope_type="linear")
        if kind == "yarn" and factor:
            return self._yarn(float(factor))
        if kind not in (None, "none", "linear"):
            raise UnsupportedModelError(
                f"{self.path}: rope scaling type {kind!r} ({self.architecture}.rope.scaling.type) "
                "is not supported; supported: linear, yarn, Llama 3's per-frequency factors or none"
            )
        tensor = self.tensors.get(ROPE_FACTORS)
        if tensor is None:
            return None
        factors = np.asarray(quants.dequantize(tensor.data, tensor.tensor_type)).reshape(-1)
        if np.all(factors == 1.0):
            return None
        original = self._get(f"{self.architecture}.rope.scaling.original_context_length", 8192)
        scaling = RopeScaling(
            factor=float(factors.max()),
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=int(original),
        )
        scaled, _ = rope_inverse_frequencies(dataclasses.replace(config, rope_scaling=scaling))
        implied = rope_inverse_frequencies(config)[0] / scaled
        if factors.shape == implied.shape and np.allclose(implied, factors, rtol=1e-4):
            return scaling
        raise UnsupportedModelError(
            f"{self.path}: tensor {ROPE_FACTORS!r} holds RoPE frequency factors that are not "
            f"Llama 3's rope scaling (factor {scaling.factor:g}, low_freq_factor 1, "
            f"high_freq_factor 4, original context {original}); featherweight cannot run them. "
            "Load the model's Hugging Face safetensors instead (its config.json states the scaling)."
        )

    def _yarn(self, factor: float) -> RopeScaling:
        """YaRN as llama.cpp runs it (ggml's `rope_yarn`): the ramp between the `beta_fast` and
        `beta_slow` dimensions with its ends rounded to whole dimensions, and cos/sin scaled by
        `yarn_attn_factor` times 1 + 0.1 ln(factor)."""
        rope = f"{self.architecture}.rope.scaling"
        original = self._get(f"{rope}.original_context_length")
        if original is None:
            raise CorruptCheckpointError(
                f"{self.path}: YaRN rope scaling lacks {rope}.original_context_length"
            )
        attention = float(self._get(f"{rope}.yarn_attn_factor", 1.0))
        return RopeScaling(
            factor=factor,
            original_max_position_embeddings=int(original),
            rope_type="yarn",
            attention_factor=attention * (1.0 + 0.1 * math.log(factor)),
            beta_fast=float(self._get(f"{rope}.yarn_beta_fast", 32.0)),
            beta_slow=float(self._get(f"{rope}.yarn_beta_slow", 1.0)),
            truncate=True,
        )

    def keys(self) -> list[TensorKey]:
        return list(self._keys)

    def stored_dtype(self, key: TensorKey) -> np.dtype:
        """Dtype a tensor has once read: float32 for quantized and F32, float16 for F16."""
        kind = self.tensors[self._keys[key][0]].tensor_type
        return np.dtype(np.float16) if kind == GGMLQuantizationType.F16 else np.dtype(np.float32)

    def read(self, key: TensorKey) -> np.ndarray:
        """The tensor in Hugging Face layout ([out, in]), dequantized (see `stored_dtype`)."""
        return self.read_into(key, np.empty(self.shapes[key], dtype=self.stored_dtype(key)))

    def read_into(self, key: TensorKey, out: np.ndarray) -> np.ndarray:
        """Dequantize the tensor into `out` (cast to its dtype), `CHUNK_VALUES` at a time.

        Rows are read from the file with plain reads and dequantized chunk by chunk; the q and k
        rows of a `llama` file go straight to their un-permuted places in `out`, a fused tensor's
        part is its own rows, and a Gemma norm loses llama.cpp's + 1.
        """
        name, first_row = self._keys[key]
        tensor = self.tensors[name]
        shape = self.shapes[key]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        row_bytes = int(tensor.n_bytes) // int(np.prod(tensor.shape[1:], dtype=np.int64))
        offset = self.family.gguf_norm_offset if key[0].endswith("norm") else 0.0
        rows_per_chunk = max(1, CHUNK_VALUES // shape[-1])
        destination = self._row_destinations(key, rows)
        matrix = out.reshape(rows, shape[-1])
        raw = np.empty(min(rows, rows_per_chunk) * row_bytes, dtype=np.uint8)
        try:
            with open(self.path, "rb") as handle:
                handle.seek(int(tensor.data_offset) + first_row * row_bytes)
                for start in range(0, rows, rows_per_chunk):
                    count = min(rows_per_chunk, rows - start)
                    chunk = raw[: count * row_bytes]
                    if handle.readinto(chunk) != chunk.size:
                        raise OSError("the file ends inside the tensor")
                    values = quants.dequantize(chunk.reshape(count, row_bytes), tensor.tensor_type)
                    values = values - offset if offset else values
                    where = slice(start, start + count)
                    matrix[where if destination is None else destination[where]] = values
        except (OSError, ValueError) as error:
            raise CorruptCheckpointError(
                f"{self.path}: tensor {tensor.name!r} cannot be read ({error}); the file may be "
                "truncated -- download it again"
            ) from None
        return out

    def _row_destinations(self, key: TensorKey, rows: int) -> np.ndarray | None:
        """Where each stored row goes in Hugging Face layout (None: in place): llama.cpp permutes
        the q and k rows of `llama` files for its interleaved rotary layout."""
        name, _layer = key
        if not self.family.gguf_permutes_qk or name not in ("q", "k"):
            return None
        heads = self.config.num_heads if name == "q" else self.config.num_kv_heads
        return np.argsort(unpermute_rotary_rows(np.arange(rows), heads))

    def tokenizer(self) -> Tokenizer:
        fields = {}
        for name in self.fields:
            if name.startswith("tokenizer."):
                fields[name] = self._get(name)
        return tokenizer_from_gguf_fields(fields)

    def close(self) -> None:
        self.tensors = {}
        self.reader = None
