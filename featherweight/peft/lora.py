"""LoRA adapters: settings, PEFT's initialization, the block's static spec, QLoRA's NF4 base,
and the merge.

The adapters are their own pytree, stacked per layer like the base they adapt:

    {"layers": {"lora": {target: {"a": [L, r, in], "b": [L, out, r]}}}}

It is the *trainable* argument of a train step; the frozen base is another argument, so only the
adapters are differentiated and only they carry optimizer state -- no zero gradient of a frozen
weight is ever built. `models.llama.linear` adds `scale * B A x` for every target it finds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Annotated

import jax
import jax.numpy as jnp
import numpy as np
from pydantic import ConfigDict, Field, with_config

from featherweight.errors import AdapterConfigError
from featherweight.models.config import ModelConfig
from featherweight.models.linear import LINEAR_NAMES, LoraSpec, Params
from featherweight.models.shapes import layer_shapes
from featherweight.quant.nf4 import quantize_nf4

# featherweight's target names and the Hugging Face / PEFT module each one adapts.
PEFT_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _target_names(names: Iterable[str]) -> set[str]:
    """Targets in featherweight's spelling; PEFT's ("q_proj") is accepted too."""
    short = [name.strip().removesuffix("_proj") for name in names]
    unknown = [name for name in short if name not in LINEAR_NAMES]
    if unknown:
        raise AdapterConfigError(
            f"unknown LoRA target(s) {unknown}; valid: {list(LINEAR_NAMES)} "
            "(or their PEFT names q_proj, ..., down_proj)"
        )
    return set(short)


@with_config(ConfigDict(extra="forbid"))
@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA settings: rank r, alpha, dropout on the adapter input, targets, rsLoRA scaling.

    The one type for these settings: a training config's `lora:` section validates into it
    (pydantic reads the field bounds below), and Python code builds it directly (`__post_init__`
    checks the same bounds with typed errors). The block's runtime form is `spec`.

    The update to a target weight W [out, in] is `scale * B A` with A [r, in], B [out, r] and
    scale = alpha / r, or alpha / sqrt(r) with rsLoRA (stable for large ranks). `targets` may be a
    tuple or a comma-separated string; it is stored in model order without duplicates. Frozen and
    hashable, so it can be a static argument.
    """

    rank: Annotated[int, Field(gt=0, description="adapter rank r")] = 8
    alpha: Annotated[float, Field(gt=0, description="scale numerator")] = 16.0
    dropout: Annotated[float, Field(ge=0.0, lt=1.0, description="on the adapter input")] = 0.0
    targets: tuple[str, ...] = LINEAR_NAMES
    rslora: Annotated[bool, Field(description="scale alpha/sqrt(rank) instead of alpha/rank")] = (
        False
    )

    def __post_init__(self) -> None:
        names = self.targets.split(",") if isinstance(self.targets, str) else self.targets
        chosen = _target_names(names)
        if not chosen:
            raise AdapterConfigError(
                f"LoRA needs at least one target module; choose from {', '.join(LINEAR_NAMES)}"
            )
        object.__setattr__(self, "targets", tuple(n for n in LINEAR_NAMES if n in chosen))
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise AdapterConfigError(
                f"LoRA rank={self.rank!r} must be a positive integer (typical: 8 to 64)"
            )
        if not self.alpha > 0:
            raise AdapterConfigError(
                f"LoRA alpha={self.alpha!r} must be > 0 (typical: 2 x rank, e.g. {2 * self.rank})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise AdapterConfigError(
                f"LoRA dropout={self.dropout!r} must be in [0, 1) (typical: 0.0 or 0.05)"
            )

    @property
    def scale(self) -> float:
        """The factor on `B A`: alpha / r, or alpha / sqrt(r) with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def check_model(self, config: ModelConfig) -> None:
        """Refuse a rank larger than the smaller dimension of any targeted weight."""
        shapes = layer_shapes(config)
        for target in self.targets:
            out_features, in_features = shapes[target][-2:]
            if self.rank > min(out_features, in_features):
                raise AdapterConfigError(
                    f"LoRA rank={self.rank} exceeds the smaller dimension of target {target!r} "
                    f"(weight [out, in] = [{out_features}, {in_features}]); use rank <= "
                    f"{min(out_features, in_features)} or drop {target!r} from the targets"
                )

    @property
    def spec(self) -> LoraSpec:
        """The runtime form the model's blocks take (a static argument): scale and dropout."""
        return LoraSpec(scale=self.scale, dropout=self.dropout)


def lora_shapes(
    model_config: ModelConfig, lora_config: LoraConfig
) -> dict[str, dict[str, tuple[int, ...]]]:
    """{target: {"a": (L, r, in), "b": (L, out, r)}} after checking the rank against the model;
    an MoE layer's expert weights [E, out, in] get one adapter per expert, (L, E, r, in) and
    (L, E, out, r)."""
    lora_config.check_model(model_config)
    layers, rank = model_config.num_layers, lora_config.rank
    shapes = layer_shapes(model_config)
    result = {}
    for target in lora_config.targets:
        *experts, out_features, in_features = shapes[target]
        lead = (layers, *experts)
        result[target] = {"a": (*lead, rank, in_features), "b": (*lead, out_features, rank)}
    return result


def init_lora(
    key: jax.Array, model_config: ModelConfig, lora_config: LoraConfig, dtype=jnp.float32
) -> Params:
    """Fresh adapters as PEFT initializes them, so that the adapted model starts as the base.

    A: `kaiming_uniform_(a=sqrt(5))` on [r, in], i.e. U(-1/sqrt(in), 1/sqrt(in)); B: zeros.
    """
    lora_config.check_model(model_config)
    return _fresh_adapters(key, model_config, lora_config, jnp.dtype(dtype))


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _fresh_adapters(key, model_config: ModelConfig, lora_config: LoraConfig, dtype) -> Params:
    """`init_lora` as one compiled program (one dispatch instead of one per random op)."""
    shapes = lora_shapes(model_config, lora_config)
    keys = jax.random.split(key, len(shapes))
    adapters = {}
    for target_key, (target, shape) in zip(keys, shapes.items()):
        bound = 1.0 / math.sqrt(shape["a"][-1])
        a = jax.random.uniform(target_key, shape["a"], jnp.float32, -bound, bound)
        adapters[target] = {"a": a.astype(dtype), "b": jnp.zeros(shape["b"], dtype)}
    return {"layers": {"lora": adapters}}


def abstract_lora(model_config: ModelConfig, lora_config: LoraConfig, dtype=jnp.float32) -> Params:
    """The adapter pytree as `jax.ShapeDtypeStruct`s: compile and plan without allocating."""
    shapes = lora_shapes(model_config, lora_config)
    return {
        "layers": {
            "lora": {
                target: {part: jax.ShapeDtypeStruct(shape, dtype) for part, shape in pair.items()}
                for target, pair in shapes.items()
            }
        }
    }


def check_adapters(
    adapters: dict[str, dict[str, jax.Array]], model_config: ModelConfig, lora_config: LoraConfig
) -> None:
    """Raise `AdapterConfigError` unless `adapters` ({target: {"a", "b"}}) fit both configs."""
    expected = lora_shapes(model_config, lora_config)
    if set(adapters) != set(expected):
        raise AdapterConfigError(
            f"the adapters hold targets {sorted(adapters)} but the LoRA config names "
            f"{sorted(expected)}; pass the LoraConfig the adapters were trained with"
        )
    for target, pair in expected.items():
        for part, shape in pair.items():
            found = tuple(np.shape(adapters[target][part]))
            if found != shape:
                raise AdapterConfigError(
                    f"adapter {target}.{part} has shape {found}, expected {shape} from the model "
                    f"and LoRA configs (rank {lora_config.rank}); pass the configs the adapters "
                    "were trained with"
                )


def quantize_frozen_base(params: Params) -> Params:
    """QLoRA's frozen base from dense parameters: every linear stack of the blocks in NF4.

    Norms, embeddings and the LM head stay as they are. (`load_model(..., quantize="nf4")` does
    the same while reading a checkpoint, without a dense copy of the blocks.)
    """
    layers = dict(params["layers"])
    for name in LINEAR_NAMES:
        stack_axes = layers[name].ndim - 2  # layers, and an MoE layer's experts
        layers[name] = quantize_nf4(layers[name], stack_axes=stack_axes, name=name)
    return {**params, "layers": layers}


def merge_lora_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """`W + scale * B A` in float32 on the host: W [..., out, in], A [..., r, in], B [..., out, r].

    Runs in numpy so that a merged export streams tensor by tensor without touching the device.
    """
    weight = np.asarray(weight, np.float32)
    update = np.asarray(b, np.float32) @ np.asarray(a, np.float32)
    return weight + np.float32(scale) * update
