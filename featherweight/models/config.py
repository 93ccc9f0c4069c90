"""The model config: the numbers that fix every shape of a Llama-family model.

Built from a Hugging Face `config.json` (a dict), from GGUF metadata, or from the built-in table of
popular models. Frozen and hashable, so it can be a static argument of `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from featherweight.errors import (
    CheckpointNotFoundError,
    ModelConfigError,
    UnsupportedModelError,
    check_input_file,
    read_input_text,
)

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

_REQUIRED_HF_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)


Positive = Field(None, gt=0)
Number = StrictFloat  # strict: an int (JSON's 10000) is a number, a bool or a string is not


class _RopeFields(BaseModel):
    """A `rope_scaling` (transformers 4) or `rope_parameters` (5) mapping."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    rope_type: str | None = None
    type: str | None = None
    rope_theta: Number | None = Positive
    factor: Number | None = Positive
    low_freq_factor: Number | None = Positive
    high_freq_factor: Number | None = Positive
    original_max_position_embeddings: StrictInt | None = Positive


class _HFFields(BaseModel):
    """The types and ranges of the config.json fields featherweight reads, checked before any of
    them is used (a `"64"`, a negative size or a `rope_scaling` that is not a mapping would
    otherwise surface mid-compile)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    vocab_size: StrictInt = Field(gt=0)
    hidden_size: StrictInt = Field(gt=0)
    intermediate_size: StrictInt = Field(gt=0)
    num_hidden_layers: StrictInt = Field(gt=0)
    num_attention_heads: StrictInt = Field(gt=0)
    num_key_value_heads: StrictInt | None = Positive
    head_dim: StrictInt | None = Positive
    rms_norm_eps: Number | None = Positive
    rope_theta: Number | None = Positive
    max_position_embeddings: StrictInt | None = Positive
    tie_word_embeddings: StrictBool | None = None
    attention_bias: StrictBool | None = None
    mlp_bias: StrictBool | None = None
    bos_token_id: StrictInt | None = Field(None, ge=0)
    eos_token_id: StrictInt | list[StrictInt] | None = None
    sliding_window: StrictInt | None = None
    use_sliding_window: StrictBool | None = None
    rope_scaling: _RopeFields | None = None
    rope_parameters: _RopeFields | None = None


def _check_field_types(hf: dict[str, Any], source: str) -> None:
    """Refuse wrongly typed or impossible config.json values, naming each (up to three)."""
    try:
        _HFFields.model_validate(hf)
    except ValidationError as error:
        problems = [
            f"{'.'.join(str(part) for part in item['loc'])}: "
            f"{item['msg'].replace(' or instance of _RopeFields', '')} "
            f"(got {repr(item.get('input'))[:40]})"
            for item in error.errors()
        ]
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ModelConfigError(
            f"{source} holds invalid values: {'; '.join(problems[:3])}{more}; restore the "
            "model's original config.json"
        ) from None
    heads, head_dim = hf["num_attention_heads"], hf.get("head_dim")
    if head_dim is None and hf["hidden_size"] % heads:
        raise ModelConfigError(
            f"{source}: hidden_size={hf['hidden_size']} is not divisible by "
            f"num_attention_heads={heads} and no head_dim is given; restore the model's original "
            "config.json"
        )


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama 3's `llama3` rope scaling (wavelength-dependent interpolation of the frequencies)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only Llama-family transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers"):
            if getattr(self, name) <= 0:
                raise ModelConfigError(
                    f"model config field {name}={getattr(self, name)} must be > 0"
                )
        if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} must be a positive multiple of "
                f"num_key_value_heads={self.num_kv_heads} (grouped-query attention)"
            )
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be positive and even for RoPE")

    @property
    def q_size(self) -> int:
        """Output width of the query projection: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Output width of each of the key and value projections."""
        return self.num_kv_heads * self.head_dim

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that transformers reads back into an equal model."""
        config: dict[str, Any] = {
            "architectures": [ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.model_type == "llama":
            config["attention_bias"] = self.attention_bias
            config["mlp_bias"] = False
        if self.model_type == "mistral":
            config["sliding_window"] = None
        if self.model_type == "qwen2":
            config["use_sliding_window"] = False
        if self.rope_scaling is not None:
            config["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": self.rope_scaling.factor,
                "low_freq_factor": self.rope_scaling.low_freq_factor,
                "high_freq_factor": self.rope_scaling.high_freq_factor,
                "original_max_position_embeddings": self.rope_scaling.original_max_position_embeddings,
            }
        return config


def _rope_settings(hf: dict[str, Any], source: str) -> tuple[float, RopeScaling | None]:
    """`rope_theta` and llama3 scaling from either transformers 4 or 5 config spellings."""
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or parameters or None
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10000.0))
    if not scaling:
        return float(theta), None
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise UnsupportedModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported; "
            "supported: 'llama3' or none"
        )
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as missing:
        raise ModelConfigError(
            f"{source}: llama3 rope scaling lacks the field {missing}; copy it from the "
            "original config.json"
        ) from None


def _refuse_sliding_window(hf: dict[str, Any], model_type: str, source: str) -> None:
    """Sliding-window attention is not implemented: refuse configs whose attention needs it."""
    window = hf.get("sliding_window")
    if model_type == "qwen2":
        needs = bool(hf.get("use_sliding_window", False)) and window is not None
    else:
        needs = window is not None and window < hf.get("max_position_embeddings", math.inf)
    if needs:
        raise UnsupportedModelError(
            f"{source}: this {model_type} config uses sliding-window attention "
            f"(sliding_window={window}), "
            "which featherweight does not implement; use a checkpoint without it "
            "(e.g. Mistral-7B-v0.3, whose sliding_window is null)"
        )


def config_from_hf_dict(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate a Hugging Face config dict and turn it into a `ModelConfig`."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{source}: model_type {model_type!r} is not supported; "
            f"supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    architectures = hf.get("architectures") or [ARCHITECTURES[model_type]]
    if not set(architectures) & set(ARCHITECTURES.values()):
        raise UnsupportedModelError(
            f"{source}: architectures {architectures} are not supported (featherweight runs "
            f"causal language models); supported: {', '.join(ARCHITECTURES.values())}"
        )
    missing = [field for field in _REQUIRED_HF_FIELDS if field not in hf]
    if missing:
        raise ModelConfigError(
            f"{source} lacks required field(s) {', '.join(missing)}; "
            "copy the model's original config.json"
        )
    _check_field_types(hf, source)
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    _refuse_sliding_window(hf, model_type, source)
    theta, scaling = _rope_settings(hf, source)
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(hf["vocab_size"]),
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
    )


def read_hf_config(directory: Path) -> ModelConfig:
    """Read and validate `directory/config.json`."""
    path = Path(directory) / "config.json"
    if not os.path.lexists(path):
        raise CheckpointNotFoundError(
            f"{directory} has no config.json; point at a Hugging Face model directory "
            "(config.json + *.safetensors) or a .gguf file"
        )
    check_input_file(path, "model config", "restore the original", CheckpointNotFoundError)
    try:
        hf = json.loads(read_input_text(path, "model config"))
    except json.JSONDecodeError as error:
        raise ModelConfigError(
            f"{path} is not valid JSON ({error}); restore the original"
        ) from None
    if not isinstance(hf, dict):
        raise ModelConfigError(f"{path} must hold a JSON object, found {type(hf).__name__}")
    return config_from_hf_dict(hf, source=str(path))
