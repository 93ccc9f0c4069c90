"""What a model family is: the few ways its decoder layer differs from Llama's, its config.json
fields, and its tensor names on disk (Hugging Face and GGUF).

A family is data read by code written once: `models/llama.py`'s layer reads the `ModelConfig` a
family's `layer_options` fills in, `io/names.py` reads its name maps, `io/loader.py` and the
writers split and fuse its fused projections. Adding a dense family is one module that builds a
`Family` and one line in `models/families/__init__.py`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from featherweight.errors import ModelConfigError

HFConfig = dict[str, Any]
# (the tensors it reads, by their names within a layer; the numpy function of them)
Derivation = tuple[tuple[str, ...], Callable[..., Any]]
# A GGUF file's `{arch}.<suffix>` metadata: (suffix, default) -> value.
GGUFGet = Callable[[str, Any], Any]


def _no_options(hf: HFConfig, source: str) -> dict[str, Any]:
    return {}


def _no_gguf_options(get: GGUFGet, shape: dict[str, int]) -> dict[str, Any]:
    return {}


def _no_extras(config: Any) -> dict[str, Any]:
    return {}


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family.

    name: featherweight's name for it (messages, GGUF export's default architecture).
    model_types: the config.json `model_type`s it reads; the first is the one an export writes.
    architecture: the transformers class an export names in `architectures`.
    gguf_architecture: llama.cpp's `general.architecture` for it.
    defaults: config.json fields a checkpoint may leave out, with transformers' defaults for the
      family (Gemma 3's vocabulary is not written in its config.json).
    layer_options: (config.json, source) -> the `ModelConfig` fields in which its layer differs
      from Llama's (norm form and placement, QK-norm, softcaps, windows, activation, ...).
    hf_extras: ModelConfig -> the family's own config.json fields an export writes back.
    hf_layer_names / gguf_layer_names: featherweight's layer tensor keys -> their names on disk,
      overriding (or adding to) the Llama spellings in `io/names.py`; a name with "{e}" is one
      tensor per expert of an MoE layer, stacked on load into the key's [E, ...] tensor.
    hf_fused: a tensor stored fused on disk -> the keys it is split into on load, in order along
      its rows (Phi-3's `qkv_proj` and `gate_up_proj`), fused again on export.
    gguf_fused: the same for GGUF names.
    gguf_permutes_qk: llama.cpp stores q/k rows permuted for its interleaved RoPE ("llama" only).
    gguf_norm_offset: llama.cpp stores Gemma's RMSNorm weights as 1 + w.
    gguf_options: (the file's `{arch}.*` metadata, its shape: num_layers, hidden_size,
      num_heads, head_dim) -> the layer options, as llama.cpp runs the architecture (what it
      reads from the file and what it hard-codes: Gemma 3's sliding pattern and local RoPE base).
    gguf_metadata: ModelConfig -> the family's own `{arch}.*` metadata an export writes; raises
      `ExportError` for a config llama.cpp would run differently from featherweight.
    hf_derived: a layer key computed from tensors stored in another form -> its ways to read it,
      the first whose tensors the checkpoint holds wins: (the stored names within the layer,
      numpy function of those tensors -> the key's tensor). gpt-oss's experts: gate and up
      interleaved in one [E, in, 2F] tensor, or MXFP4 blocks and scales.
    hf_composed: a stored name within the layer an export writes -> (the keys it is made of,
      numpy function of those tensors -> the stored tensor): `hf_derived`'s inverse.
    """

    name: str
    model_types: tuple[str, ...]
    architecture: str
    gguf_architecture: str
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    layer_options: Callable[[HFConfig, str], dict[str, Any]] = _no_options
    hf_extras: Callable[[Any], dict[str, Any]] = _no_extras
    hf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    gguf_layer_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    hf_fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    gguf_fused: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    gguf_permutes_qk: bool = False
    gguf_norm_offset: float = 0.0
    gguf_options: Callable[[GGUFGet, dict[str, int]], dict[str, Any]] = _no_gguf_options
    gguf_metadata: Callable[[Any], dict[str, Any]] = _no_extras
    hf_derived: Mapping[str, tuple[Derivation, ...]] = dataclasses.field(default_factory=dict)
    hf_composed: Mapping[str, Derivation] = dataclasses.field(default_factory=dict)


def layer_types(hf: HFConfig, num_layers: int, default: Callable[[int], bool]) -> tuple[bool, ...]:
    """Which layers attend within a sliding window: config.json's `layer_types` when given, else
    the family's rule `default(layer index)`."""
    listed = hf.get("layer_types")
    if listed is None:
        return tuple(bool(default(index)) for index in range(num_layers))
    known = {"sliding_attention", "full_attention"}
    if len(listed) != num_layers or not set(listed) <= known:
        raise ModelConfigError(
            f"config.json's layer_types must list 'sliding_attention' or 'full_attention' for "
            f"each of the {num_layers} layers; restore the model's original config.json"
        )
    return tuple(kind == "sliding_attention" for kind in listed)


def sliding_options(window: Any, sliding: tuple[bool, ...]) -> dict[str, Any]:
    """The window fields of a `ModelConfig`: none when no layer slides or no window is set."""
    if window is None or not any(sliding):
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelConfigError(
            f"config.json's sliding_window={window!r} must be a positive integer or null"
        )
    return {"sliding_window": window, "sliding_layers": sliding}
