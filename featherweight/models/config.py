"""The model config: the numbers that fix every shape of a decoder-only model, and the few ways
its family's layer differs from Llama's (`models/families/`).

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
from featherweight.models.families import family_of

ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "clamped_swiglu")

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


ROPE_TYPES = ("llama3", "linear", "longrope", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling of the frequencies: Llama 3's `llama3` (wavelength-dependent interpolation),
    `linear` (every frequency divided by `factor`: Gemma 3's global layers) or `longrope`
    (Phi-3.5: per-frequency divisors, `short_factor` up to the original context and
    `long_factor` beyond it, and cos/sin scaled by `attention_factor`) or `yarn` (gpt-oss:
    frequencies between `beta_fast` and `beta_slow` rotations ramped from extrapolated to
    divided by `factor`, cos/sin scaled by `attention_factor`)."""

    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: str = "llama3"
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json `rope_scaling` that transformers reads back into this scaling."""
        if self.rope_type == "linear":
            return {"rope_type": "linear", "factor": self.factor}
        if self.rope_type == "yarn":
            return {
                "rope_type": "yarn",
                "factor": self.factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "beta_fast": self.beta_fast,
                "beta_slow": self.beta_slow,
                "truncate": self.truncate,
            }
        if self.rope_type == "longrope":
            return {
                "rope_type": "longrope",
                "short_factor": list(self.short_factor),
                "long_factor": list(self.long_factor),
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "attention_factor": self.attention_factor,
            }
        return {
            "rope_type": "llama3",
            "factor": self.factor,
            "low_freq_factor": self.low_freq_factor,
            "high_freq_factor": self.high_freq_factor,
            "original_max_position_embeddings": self.original_max_position_embeddings,
        }


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of a decoder-only transformer, and how its family's layer differs
    from Llama's (the defaults are Llama's):

    norm_offset: RMSNorm weights applied as (offset + w), in float32 (Gemma: 1).
    qk_norm: an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3).
    sandwich_norms: norms after attention and after the MLP too, before each residual add (Gemma).
    query_scale: the attention scores' scale (None: head_dim^-1/2).
    attn_softcap, final_softcap: cap * tanh(x / cap) on the attention scores, on the logits.
    sliding_window, sliding_layers: the window (a query sees itself and the window - 1 positions
      before it) and which layers use it; no window when `sliding_window` is None.
    local_rope_theta: the RoPE base of the sliding layers, unscaled (Gemma 3); None: as the rest.
    partial_rotary_factor: the fraction of each head RoPE rotates (Phi-4-mini: 0.75).
    embed_scale: embeddings multiplied by sqrt(hidden_size) (Gemma).
    activation: the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU).
    num_experts, experts_per_token: a mixture-of-experts MLP (`models/moe.py`): E experts of
      width `intermediate_size`, each token routed to its top k; 0: a dense MLP.
    norm_topk_prob: the top-k routing weights renormalized to sum to one (Mixtral, Qwen3-MoE's
      config flag).
    router_aux_loss_coef, output_router_logits: the family's load-balancing loss weight, and
      whether its config.json turns that loss on (transformers' default: off). Training reads
      both through the `moe.router_aux_loss_coef` setting (`step/router_loss.py`): null trains
      the loss at this weight when `output_router_logits` is set, and not at all otherwise.
    routing: "softmax_topk" (softmax over every expert, then the top k) or "topk_softmax"
      (gpt-oss: the top k logits, then a softmax over them).
    output_bias: the o projection has a bias too (gpt-oss; `attention_bias` gives q, k, v theirs).
    expert_bias: the router and each expert's gate, up and down have biases (gpt-oss).
    attention_sinks: a learned logit per head that joins every softmax and takes no value
      (gpt-oss's sinks).
    swiglu_alpha, swiglu_limit: gpt-oss's clamped SwiGLU ("clamped_swiglu"): gate clamped above
      and up clamped both ways at the limit, (up + 1) * gate * sigmoid(alpha * gate).
    """

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
    norm_offset: float = 0.0
    qk_norm: bool = False
    sandwich_norms: bool = False
    query_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] = ()
    local_rope_theta: float | None = None
    partial_rotary_factor: float = 1.0
    embed_scale: bool = False
    activation: str = "silu"
    num_experts: int = 0
    experts_per_token: int = 0
    norm_topk_prob: bool = False
    router_aux_loss_coef: float | None = None
    output_router_logits: bool = False
    routing: str = "softmax_topk"
    output_bias: bool = False
    expert_bias: bool = False
    attention_sinks: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

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
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ModelConfigError(
                f"partial_rotary_factor={self.partial_rotary_factor} leaves {self.rotary_dim} of "
                f"head_dim={self.head_dim} rotated; RoPE needs a positive even number"
            )
        if self.activation not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"hidden activation {self.activation!r} is not supported; supported: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ModelConfigError(
                f"num_experts_per_tok={self.experts_per_token} must be between 1 and the "
                f"{self.num_experts} experts"
            )
        if self.sliding_window is not None and len(self.sliding_layers) != self.num_layers:
            raise ModelConfigError(
                f"sliding_layers lists {len(self.sliding_layers)} layers, the model has "
                f"{self.num_layers}"
            )

    @property
    def q_size(self) -> int:
        """Output width of the query projection: heads x head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Output width of each of the key and value projections."""
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """The leading dimensions of each head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def windows(self) -> str:
        """Which layers attend within the window: "none", "all" or "some" (a pattern)."""
        if self.sliding_window is None or not any(self.sliding_layers):
            return "none"
        return "all" if all(self.sliding_layers) else "some"

    @property
    def attention_scale(self) -> float:
        """The factor on the attention scores: `query_scale`, or head_dim^-1/2."""
        return self.head_dim**-0.5 if self.query_scale is None else self.query_scale

    def layer_types(self) -> list[str]:
        """transformers' `layer_types`: each layer's attention, sliding or full."""
        sliding = self.sliding_layers or (False,) * self.num_layers
        return ["sliding_attention" if slide else "full_attention" for slide in sliding]

    def to_hf_dict(self) -> dict[str, Any]:
        """The `config.json` that transformers reads back into an equal model."""
        family = family_of(self.model_type)
        config: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": family.model_types[0],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": self.activation,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
        }
        if self.rope_scaling is not None:
            config["rope_scaling"] = self.rope_scaling.to_hf_dict()
        return {**config, **family.hf_extras(self)}


def _rope_fields(hf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the global layers' rope parameters, the sliding layers') from either transformers 4
    (`rope_theta` + `rope_scaling`) or 5 (`rope_parameters`, per layer type for Gemma 3)."""
    parameters = hf.get("rope_parameters") or {}
    if "full_attention" in parameters or "sliding_attention" in parameters:
        full = dict(parameters.get("full_attention") or {})
        local = dict(parameters.get("sliding_attention") or {})
        return full, local
    merged = {**parameters, **(hf.get("rope_scaling") or {})}
    if "rope_theta" in hf:
        merged.setdefault("rope_theta", hf["rope_theta"])
    return merged, {}


def _rope_settings(
    hf: dict[str, Any], source: str
) -> tuple[float, RopeScaling | None, float | None]:
    """(`rope_theta`, its scaling, the sliding layers' own base or None) from config.json."""
    rope, local = _rope_fields(hf)
    theta = float(rope.get("rope_theta", 10000.0))
    local_theta = local.get("rope_theta", hf.get("rope_local_base_freq"))
    local_theta = None if local_theta is None else float(local_theta)
    rope_type = rope.get("rope_type") or rope.get("type") or "default"
    if rope_type == "default":
        return theta, None, local_theta
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{source}: rope scaling type {rope_type!r} is not supported; "
            f"supported: {', '.join(ROPE_TYPES)} or none"
        )
    try:
        if rope_type == "linear":
            scaling = RopeScaling(factor=float(rope["factor"]), rope_type="linear")
        elif rope_type == "yarn":
            scaling = _yarn(hf, rope)
        elif rope_type == "longrope":
            scaling = _longrope(hf, rope)
        else:
            scaling = RopeScaling(
                factor=float(rope["factor"]),
                low_freq_factor=float(rope["low_freq_factor"]),
                high_freq_factor=float(rope["high_freq_factor"]),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            )
    except KeyError as missing:
        raise ModelConfigError(
            f"{source}: {rope_type} rope scaling lacks the field {missing}; copy it from the "
            "original config.json"
        ) from None
    return theta, scaling, local_theta


def _longrope(hf: dict[str, Any], rope: dict[str, Any]) -> RopeScaling:
    """Phi-3.5's LongRoPE, with transformers' defaults for the factor and the attention factor."""
    original = int(
        rope.get("original_max_position_embeddings") or hf["original_max_position_embeddings"]
    )
    factor = float(rope.get("factor") or hf.get("max_position_embeddings", original) / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        rope_type="longrope",
        short_factor=tuple(float(x) for x in rope["short_factor"]),
        long_factor=tuple(float(x) for x in rope["long_factor"]),
        attention_factor=float(attention),
    )


def _yarn(hf: dict[str, Any], rope: dict[str, Any]) -> RopeScaling:
    """YaRN (gpt-oss), with transformers' defaults for the attention factor and the betas."""
    original = int(rope["original_max_position_embeddings"])
    factor = float(rope.get("factor") or hf["max_position_embeddings"] / original)
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else 0.1 * math.log(factor) + 1.0
    return RopeScaling(
        factor=factor,
        original_max_position_embeddings=original,
        rope_type="yarn",
        attention_factor=float(attention),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        truncate=bool(rope.get("truncate", True)),
    )


def _text_part(hf: dict[str, Any]) -> dict[str, Any]:
    """A multimodal checkpoint's language model config (Gemma 3's `text_config`), else `hf`."""
    text = hf.get("text_config")
    if hf.get("model_type") == "gemma3" and isinstance(text, dict):
        return {"model_type": "gemma3_text", **text}
    return hf


def config_from_hf_dict(hf: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Validate a Hugging Face config dict and turn it into a `ModelConfig`."""
    model_type = hf.get("model_type")
    family = family_of(model_type, source)
    architectures = hf.get("architectures") or [family.architecture]
    known = {family.architecture, "Gemma3ForConditionalGeneration"}
    if not set(architectures) & known:
        raise UnsupportedModelError(
            f"{source}: architectures {architectures} are not supported (featherweight runs "
            f"causal language models); supported for {model_type}: {family.architecture}"
        )
    hf = {**family.defaults, **_text_part(hf)}
    missing = [field for field in _REQUIRED_HF_FIELDS if field not in hf]
    if missing:
        raise ModelConfigError(
            f"{source} lacks required field(s) {', '.join(missing)}; "
            "copy the model's original config.json"
        )
    _check_field_types(hf, source)
    if hf.get("mlp_bias"):
        raise UnsupportedModelError(f"{source}: mlp_bias=true is not supported")
    theta, scaling, local_theta = _rope_settings(hf, source)
    num_heads = int(hf["num_attention_heads"])
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // num_heads
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    fields: dict[str, Any] = dict(
        model_type=family.model_types[0],
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
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=eos,
        activation=hf.get("hidden_act", "silu"),
    )
    fields.update(family.layer_options(hf, source))
    if local_theta is not None and "local_rope_theta" in fields:
        fields["local_rope_theta"] = local_theta
    return ModelConfig(**fields)


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
